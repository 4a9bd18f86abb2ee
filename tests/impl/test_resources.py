"""The memory bound and the byte estimates: where the bound comes from, and that each
estimate is an upper bound of what the reference really allocates, within a small factor.

The peaks are measured with ``tracemalloc``, which sees numpy's array allocations, after the
fast path's cached free buffers are dropped (``buffers.release``), so every array a call
needs is counted as new.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import timeit
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from impl.kernels import buffers
from impl.model import DecoderModel
from impl.resources import (
    MEMORY_LIMIT_VARIABLE,
    forward_bytes,
    loss_bytes,
    memory_limit,
    parameter_bytes,
)
from spec.config import FIXTURE, DecoderConfig
from spec.errors import describe_bytes

ROOT = Path(__file__).resolve().parents[2]
Result = TypeVar("Result")


@pytest.fixture
def no_configured_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    monkeypatch.delenv(MEMORY_LIMIT_VARIABLE, raising=False)
    yield monkeypatch


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1000", 1000),
        (" 4096 ", 4096),
        ("1k", 2**10),
        ("12G", 12 * 2**30),
        ("512MiB", 512 * 2**20),
        ("2TB", 2 * 2**40),
        ("0", 0),
    ],
)
def test_the_variable_sets_the_bound(
    no_configured_limit: pytest.MonkeyPatch, text: str, expected: int
) -> None:
    no_configured_limit.setenv(MEMORY_LIMIT_VARIABLE, text)
    bound = memory_limit()
    assert bound.bytes == min(expected, bound.bytes)
    if expected < 2**30:  # below any machine's half (and any address-space limit here)
        assert (bound.bytes, bound.source) == (expected, MEMORY_LIMIT_VARIABLE)


@pytest.mark.parametrize("text", ["lots", "12 GB please", "-5", "1.5G", "0x100"])
def test_an_unreadable_variable_is_ignored_with_a_warning(
    no_configured_limit: pytest.MonkeyPatch, text: str
) -> None:
    """Not silently, and not fatally: the machine's own bounds still hold."""
    machine = memory_limit()
    no_configured_limit.setenv(MEMORY_LIMIT_VARIABLE, text)
    no_configured_limit.setattr("impl.resources._UNREADABLE_WARNED", set())
    with pytest.warns(RuntimeWarning, match=MEMORY_LIMIT_VARIABLE):
        assert memory_limit().source == machine.source


def test_without_a_variable_the_bound_is_at_most_half_the_machine(
    no_configured_limit: pytest.MonkeyPatch,
) -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bound = memory_limit()
    assert 0 < bound.bytes <= physical // 2
    # A larger variable does not raise the bound past half the machine.
    no_configured_limit.setenv(MEMORY_LIMIT_VARIABLE, str(physical))
    assert memory_limit().bytes == bound.bytes


def test_an_address_space_limit_lowers_the_bound_and_refuses_at_once() -> None:
    """Under ``ulimit -v`` 3 GiB the bound is what is left of it; the 20000 x 10000 table
    (4.5 GiB with its gradients) is refused in microseconds, not after 14 s and 4.7 GB."""
    cap = 3 * 2**30
    # The child sets the limit itself, first thing: a preexec_fn would fork this process, whose
    # imported JAX warns that a fork of its threads may deadlock.
    script = (
        "import resource, time\n"
        "hard = resource.getrlimit(resource.RLIMIT_AS)[1]\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({cap}, hard))\n"
        "from impl.model import DecoderModel\n"
        "from impl.resources import memory_limit\n"
        "from spec.config import DecoderConfig\n"
        "bound = memory_limit()\n"
        "print(bound.bytes, bound.source)\n"
        "started = time.perf_counter()\n"
        "try:\n"
        "    DecoderModel.from_seed(DecoderConfig(20000, 10000, 2, 4, 0, 4), 1)\n"
        "except ValueError as error:\n"
        "    print(error.kind, time.perf_counter() - started)\n"
        "    print(error)\n"
    )

    environment = {k: v for k, v in os.environ.items() if k != MEMORY_LIMIT_VARIABLE}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    bound_line, refusal_line, message = result.stdout.splitlines()
    bound, source = bound_line.split(" ", 1)
    assert 0 < int(bound) < cap
    assert source == "the address space left under RLIMIT_AS"
    kind, seconds = refusal_line.split()
    assert kind == "parameter-allocation-failed"
    assert float(seconds) < 0.1
    assert "need about 4.5 GiB with their gradients" in message
    assert message.endswith("(the address space left under RLIMIT_AS)")


def _peak(action: Callable[[], Result]) -> tuple[Result, int]:
    """``action()``'s result and the most bytes it had allocated at once."""
    gc.collect()
    buffers.release()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = action()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    return result, peak


# (V, d, H, f, N, B, T): a mid-size model, attention-dominated, vocabulary-dominated,
# feed-forward-dominated, the plain (small-score) attention rule, and depth 0.
MEASURED = [
    (512, 128, 4, 384, 2, 2, 256),
    (5, 4, 2, 4, 2, 1, 1024),
    (20_000, 64, 2, 128, 1, 1, 64),
    (100, 64, 2, 4096, 1, 2, 128),
    (64, 32, 2, 64, 2, 64, 8),
    (3000, 96, 2, 256, 0, 8, 64),
]
# Above this peak the fixed allowance for the tape's Python objects no longer dominates,
# and the estimate must be within a small factor of the peak, not only above it.
MEANINGFUL_PEAK = 4 * 2**20


@pytest.mark.parametrize("sizes", MEASURED, ids=[",".join(map(str, s)) for s in MEASURED])
def test_estimates_bound_the_measured_peaks(sizes: tuple[int, ...]) -> None:
    vocabulary, width, heads, feed_forward, layers, batch, length = sizes
    config = DecoderConfig(vocabulary, width, heads, feed_forward, layers, length)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocabulary, (batch, length))
    targets = rng.integers(0, vocabulary, (batch, length))
    model, building = _peak(lambda: DecoderModel.from_seed(config, 1))
    _, forward = _peak(lambda: model.forward(tokens))

    def step() -> None:
        model.loss(tokens, targets).backward()

    _, training = _peak(step)
    # Building counts the gradients a first backward adds: up to 3x the build's own peak.
    for name, estimate, peak, factor in (
        ("build", parameter_bytes(config), building, 3.0),
        ("forward", forward_bytes(config, batch, length), forward, 2.0),
        ("loss + backward", loss_bytes(config, batch, length), training, 2.0),
    ):
        shown = f"{name}: estimate {describe_bytes(estimate)}, peak {describe_bytes(peak)}"
        assert peak <= estimate, f"{shown}: the estimate is no upper bound"
        if peak >= MEANINGFUL_PEAK:
            assert estimate <= factor * peak, f"{shown}: more than {factor}x"


def test_numpy_sizes_do_not_wrap_around() -> None:
    """A numpy int64 context of 3e9 squares past 2**63; the estimate must not wrap."""
    exact = DecoderConfig(5, 4, 2, 4, 2, 3_000_000_000)
    numpy_sized = DecoderConfig(*(np.int64(size) for size in (5, 4, 2, 4, 2, 3_000_000_000)))  # type: ignore[arg-type]
    assert forward_bytes(numpy_sized, 1, np.int64(3_000_000_000)) == forward_bytes(  # type: ignore[arg-type]
        exact, 1, 3_000_000_000
    )
    assert forward_bytes(exact, 1, 3_000_000_000) > 2 * 2 * 9 * 10**18 * 8


def test_the_check_is_cheap(no_configured_limit: pytest.MonkeyPatch) -> None:
    """The bound and the estimates (arithmetic and a getrlimit call), for a large model and
    context, cost a small part of the smallest forward pass they guard, the seed fixture's.

    Timed as a ratio, each side the best of seven repeats, because this machine is shared
    and an absolute budget failed once under load (53 against 50 microseconds a check).
    Measured 2026-12-08, three runs: the check 18-20 microseconds, 3.7-5.2% of the
    fixture's forward (0.39-0.50 ms, which makes the same check itself). A quarter leaves five
    times that for noise, yet fails if the check ever allocates or walks activation-sized data.
    """
    no_configured_limit.setenv(MEMORY_LIMIT_VARIABLE, "12G")
    large = DecoderConfig(50_000, 512, 8, 1376, 12, 4096)
    model = DecoderModel.from_seed(FIXTURE.config, FIXTURE.seed)
    tokens = np.asarray(FIXTURE.tokens)

    def check() -> None:
        memory_limit()
        forward_bytes(large, 8, 4096)
        loss_bytes(large, 8, 4096)
        parameter_bytes(large)

    check_seconds = min(timeit.repeat(check, number=200, repeat=7)) / 200
    forward_seconds = min(timeit.repeat(lambda: model.forward(tokens), number=20, repeat=7)) / 20
    assert check_seconds < 0.25 * forward_seconds, (check_seconds, forward_seconds)
