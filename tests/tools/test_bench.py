"""The bench command's arithmetic and report (its timings are measured, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import numpy as np
import pytest

from conformance.tools import bench
from conformance.tools.bench import (
    SIZES,
    BenchResult,
    Measurement,
    forward_backward_flops,
    linear_product_flops,
    render_bench,
    round_ratios,
)
from impl import ops
from impl.model import DecoderModel
from impl.tape import Tensor
from spec.config import DecoderConfig


def test_flop_counts_match_the_products_a_forward_pass_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted from the shapes the reference multiplies, not from the formula: every 2-D
    weight product (projections, tied head) and attention's scores and weighted sums."""
    config = DecoderConfig(10, 4, 2, 6, 2, 3)
    batch, length = 2, 3
    weight_products: list[int] = []
    attention_products: list[int] = []
    matmul, attention = ops.matmul, ops.causal_attention

    def counting_matmul(a: Tensor, b: Tensor) -> Tensor:
        if b.value.ndim == 2:
            weight_products.append(a.value.size * b.shape[1])  # rows x inner x outer
        return matmul(a, b)

    def counting_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        *leading, tokens, width = query.shape
        attention_products.append(2 * int(np.prod(leading)) * tokens * tokens * width)
        return attention(query, key, value)

    monkeypatch.setattr(ops, "matmul", counting_matmul)
    monkeypatch.setattr(ops, "causal_attention", counting_attention)
    model = DecoderModel.from_seed(config, 0)
    model.forward(np.zeros((batch, length), dtype=np.int64))
    assert len(weight_products) == 7 * config.layers + 1
    # A multiply-add is two FLOPs; backward costs twice the forward.
    linear = 3 * 2 * sum(weight_products)
    assert linear_product_flops(config, batch, length) == linear
    assert forward_backward_flops(config, batch, length) == linear + 3 * 2 * sum(attention_products)


def test_report_shows_ratios_rates_and_growth() -> None:
    result = BenchResult(threads=2, matmul_gflops=100.0, allocator="default")
    result.sizes["medium"] = {
        "reference": Measurement([0.3, 0.2, 0.25], 150.0),
        "torch": Measurement([0.2, 0.2, 0.2], 200.0),
    }
    result.layers = {1: {"reference": Measurement([0.1])}, 2: {"reference": Measurement([0.2])}}
    text = render_bench(result)
    assert "medium     0.2500s   0.2000s     1.25x           -" in text  # one round: no range
    assert "0.75x" in text  # memory ratio 150 / 200
    assert "2.00x" in text  # layers 1 -> 2 doubles the time


def test_report_shows_the_spread_of_paired_round_ratios() -> None:
    result = BenchResult(threads=2, matmul_gflops=100.0, allocator="default")
    reference = Measurement([0.3, 0.3, 0.2, 0.2], round_medians=[0.3, 0.2])
    torch = Measurement([0.4, 0.4, 0.4, 0.4], round_medians=[0.4, 0.4])
    result.sizes["medium"] = {"reference": reference, "torch": torch}
    assert round_ratios(reference, torch) == pytest.approx([0.75, 0.5])
    assert round_ratios(reference, None) == []
    assert "0.62x  0.50-0.75x" in render_bench(result)  # median 0.25 / 0.4, then the range


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
    """On a model large enough for the reference's fast path, which times its products."""
    config = DecoderConfig(256, 64, 4, 96, 1, 128)
    job = [
        sys.executable, "-m", "conformance.tools.bench_worker", "--backend", backend,
        "--config", json.dumps(config.as_dict()), "--batch", "2", "--tokens", "128",
        "--repeats", "2", "--breakdown",
    ]  # fmt: skip
    finished = subprocess.run(job, capture_output=True, text=True, check=True, timeout=300)
    answer = json.loads(finished.stdout.strip().splitlines()[-1])
    assert len(answer["seconds"]) == 2
    assert 0.0 < answer["product_seconds"] < answer["instrumented_seconds"]


def test_the_machine_rate_is_the_best_of_samples_taken_through_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One sample taken while another process had the cores must not become the rate that
    every achieved GFLOP/s is read against."""
    rates = iter([38.3, 94.0, 90.5])
    jobs: list[str] = []

    def fake_worker(arguments: list[str], environment: dict[str, str]) -> dict[str, object]:
        backend = arguments[arguments.index("--backend") + 1]
        jobs.append(backend)
        if backend == "matmul":
            return {"gflops": next(rates)}
        return {"seconds": [0.1, 0.1], "peak_mib": 10.0}

    monkeypatch.setattr(bench, "_worker", fake_worker)
    monkeypatch.setattr(bench, "find_spec", lambda name: None)  # the reference alone
    result = bench.run_bench(sizes=["small", "medium"], threads=1, rounds=1, scaling=False)
    assert jobs == ["matmul", "reference", "matmul", "reference", "matmul"]
    assert result.matmul_samples == [38.3, 94.0, 90.5]
    assert result.matmul_gflops == 94.0
    assert "94.0 GFLOP/s (the best of 3 measurements through the run; the lowest 38.3)" in (
        render_bench(result)
    )
