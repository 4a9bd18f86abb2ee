"""The bench command's arithmetic and report (its timings are measured, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

from conformance.bench import (
    SIZES,
    BenchResult,
    Measurement,
    forward_backward_flops,
    linear_product_flops,
    render_bench,
)
from spec.config import FIXTURE, DecoderConfig


def test_flop_count_of_one_block_and_the_head() -> None:
    config = DecoderConfig(10, 4, 2, 6, 1, 3)
    batch, length = 2, 3
    rows = batch * length
    block = 2 * rows * (4 * 16 + 3 * 4 * 6) + 2 * 2 * batch * length * length * 4
    head = 2 * rows * 4 * 10
    assert forward_backward_flops(config, batch, length) == 3 * (block + head)
    projections = 2 * rows * (4 * 16 + 3 * 4 * 6)
    assert linear_product_flops(config, batch, length) == 3 * (projections + head)


def test_sizes_are_the_issue_s() -> None:
    medium, batch, length = SIZES["medium"]
    assert (
        medium.vocabulary_size,
        medium.model_width,
        medium.heads,
        medium.feed_forward_width,
        medium.layers,
    ) == (4096, 256, 8, 688, 4)
    assert (batch, length) == (4, 128)
    large, batch, length = SIZES["large"]
    assert (
        large.vocabulary_size,
        large.model_width,
        large.heads,
        large.feed_forward_width,
        large.layers,
    ) == (32000, 512, 8, 1376, 8)
    assert (batch, length) == (2, 512)


def test_report_shows_ratios_rates_and_growth() -> None:
    result = BenchResult(threads=2, matmul_gflops=100.0, allocator="default")
    result.sizes["medium"] = {
        "reference": Measurement([0.3, 0.2, 0.25], 150.0),
        "torch": Measurement([0.2, 0.2, 0.2], 200.0),
    }
    result.layers = {1: {"reference": Measurement([0.1])}, 2: {"reference": Measurement([0.2])}}
    text = render_bench(result)
    assert "medium     0.2500s   0.2000s     1.25x" in text
    assert "0.75x" in text  # memory ratio 150 / 200
    assert "2.00x" in text  # layers 1 -> 2 doubles the time


def test_breakdown_shows_products_and_the_rest() -> None:
    result = BenchResult(threads=2, matmul_gflops=100.0, allocator="default")
    config, batch, length = SIZES["medium"]
    seconds = linear_product_flops(config, batch, length) / 50e9  # 50 GFLOP/s
    result.sizes["medium"] = {
        "reference": Measurement([0.3], None, [0.30, 0.32, 0.31], [seconds] * 3),
        "torch": Measurement([0.2]),  # no breakdown asked of it: no row
    }
    text = render_bench(result)
    assert f"medium  reference   0.3100s   {seconds:.4f}s     50.0   {0.31 - seconds:.4f}s" in text
    assert "medium  torch" not in text


@pytest.mark.parametrize(
    "backend",
    [
        "reference",
        pytest.param(
            "torch",
            marks=pytest.mark.skipif(find_spec("torch") is None, reason="torch not installed"),
        ),
    ],
)
def test_worker_splits_a_step_into_products_and_the_rest(backend: str) -> None:
    job = [
        sys.executable, "-m", "conformance.bench_worker", "--backend", backend,
        "--config", json.dumps(FIXTURE.config.as_dict()), "--batch", "1", "--tokens", "3",
        "--repeats", "2", "--breakdown",
    ]  # fmt: skip
    finished = subprocess.run(job, capture_output=True, text=True, check=True, timeout=300)
    answer = json.loads(finished.stdout.strip().splitlines()[-1])
    assert len(answer["seconds"]) == 2
    assert 0.0 < answer["product_seconds"] < answer["instrumented_seconds"]
