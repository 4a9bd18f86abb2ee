"""Row-parallel execution: parts cover every row once, and results do not depend on threads."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from impl import ops, parallel
from impl.tape import Array, Tensor

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """Set the thread count for one test; the previous count is restored after it."""
    previous = parallel.thread_count()
    yield parallel.set_thread_count
    parallel.set_thread_count(previous)


@given(
    shape=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=3).map(tuple),
    parts=st.integers(min_value=2, max_value=8),
)
def test_split_covers_every_index_once(shape: tuple[int, ...], parts: int) -> None:
    seen = np.zeros(shape[:2], dtype=int)
    pieces = parallel._split(shape, parts)
    for piece in pieces:
        seen[piece] += 1
    assert np.all(seen == 1)
    assert 1 <= len(pieces) <= parts


def test_small_work_runs_once_in_the_calling_thread(threads: Callable[[int], None]) -> None:
    threads(4)
    calls: list[tuple[tuple[slice, ...], str]] = []
    parallel.run_in_parts(
        lambda part: calls.append((part, threading.current_thread().name)),
        (64, 8),
        parallel.MIN_WORK_PER_PART,
    )
    assert calls == [((slice(None),), threading.current_thread().name)]


def test_large_work_is_spread_over_threads(threads: Callable[[int], None]) -> None:
    threads(3)
    names: list[str] = []
    rows = np.zeros(30, dtype=int)

    def kernel(part: tuple[slice, ...]) -> None:
        names.append(threading.current_thread().name)
        rows[part] += 1

    parallel.run_in_parts(kernel, (30,), 30 * parallel.MIN_WORK_PER_PART)
    assert len(names) == 3 and len(set(names)) >= 2  # an idle helper may take two parts
    assert np.all(rows == 1)


def test_an_error_in_a_part_is_raised_after_every_part_finished(
    threads: Callable[[int], None],
) -> None:
    threads(2)
    finished: list[int] = []

    def kernel(part: tuple[slice, ...]) -> None:
        start = part[0].start
        if start:
            raise ValueError(f"part at {start} failed")
        finished.append(start)

    with pytest.raises(ValueError, match="part at 5 failed"):
        parallel.run_in_parts(kernel, (10,), 10 * parallel.MIN_WORK_PER_PART)
    assert finished == [0]


@pytest.mark.parametrize("count", [0, -1, True, 1.5, "2"])
def test_thread_count_must_be_a_positive_integer(count: object) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        parallel.set_thread_count(count)  # type: ignore[arg-type]


def test_blas_thread_count_is_restored_after_parts(threads: Callable[[int], None]) -> None:
    threads(2)
    parallel.run_in_parts(lambda part: None, (8,), 8 * parallel.MIN_WORK_PER_PART)
    controls = parallel._THREADS._blas
    if controls is None:
        pytest.skip("numpy's BLAS here is not OpenBLAS")
    get, _ = controls
    seen: list[int] = []
    before = get()
    parallel.run_in_parts(lambda part: seen.append(get()), (8,), 8 * parallel.MIN_WORK_PER_PART)
    assert seen == [1, 1]
    assert get() == before


def _elementwise_results(seed: int) -> list[Array]:
    """Values and gradients of every row-parallel operation, on shapes big enough to split."""
    rng = np.random.default_rng(seed)
    results: list[Array] = []

    def run(operation: Callable[..., Tensor], *shapes: tuple[int, ...]) -> None:
        leaves = [Tensor(rng.normal(size=shape), requires_grad=True) for shape in shapes]
        output = operation(*leaves)
        output.backward(rng.normal(size=output.shape) if output.shape else None)
        results.append(output.value.copy())
        results.extend(leaf.grad.copy() for leaf in leaves if leaf.grad is not None)

    angles = rng.normal(size=(96, 8))
    run(lambda x, g: ops.rms_norm(x, g, 1e-6), (3, 96, 160), (160,))
    run(ops.swiglu_product, (3, 96, 200), (3, 96, 200))
    run(ops.causal_attention, (3, 4, 96, 16), (3, 4, 96, 16), (3, 4, 96, 16))
    run(lambda x: ops.rotary(x, np.cos(angles), np.sin(angles)), (3, 4, 96, 16))
    targets = rng.integers(0, 700, size=288)
    run(lambda logits: ops.indexed_mean_nll(logits, targets), (3, 96, 700))
    return results


def test_row_parallel_operations_are_bitwise_independent_of_the_thread_count(
    threads: Callable[[int], None],
) -> None:
    threads(1)
    single = _elementwise_results(seed=5)
    for count in (2, 3):
        threads(count)
        for expected, actual in zip(single, _elementwise_results(seed=5), strict=True):
            np.testing.assert_array_equal(actual, expected)


def test_split_matrix_products_agree_with_one_product(threads: Callable[[int], None]) -> None:
    """Rows split over threads: the same products to rounding (BLAS may block them apart)."""
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(4, 128, 96)), rng.normal(size=(96, 80))
    g = rng.normal(size=(4, 128, 80))
    outcomes = []
    for count in (1, 2):
        threads(count)
        a, b = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        product = ops.matmul(a, b)
        product.backward(g)
        assert a.grad is not None and b.grad is not None
        outcomes.append((product.value.copy(), a.grad.copy(), b.grad.copy()))
    for one, split in zip(*outcomes, strict=True):
        np.testing.assert_allclose(split, one, rtol=1e-13, atol=1e-13 * np.abs(one).max())
    np.testing.assert_allclose(outcomes[0][0], x @ w, rtol=1e-13, atol=1e-12)


def _product_in_child(queue: multiprocessing.Queue[Array]) -> None:
    left = Tensor(np.ones((256, 64)))
    queue.put(ops.matmul(left, Tensor(np.ones((64, 64)))).value.copy())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_threads(threads: Callable[[int], None]) -> None:
    threads(2)
    parallel.run_in_parts(lambda part: None, (8,), 8 * parallel.MIN_WORK_PER_PART)
    context = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[Array] = context.Queue()
    child = context.Process(target=_product_in_child, args=(queue,))
    child.start()
    result = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    np.testing.assert_array_equal(result, np.full((256, 64), 64.0))


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({"DECODER_CONFORMANCE_THREADS": "3", "OMP_NUM_THREADS": "1"}, 3),
        ({"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "5"}, 2),
        ({"OPENBLAS_NUM_THREADS": "5"}, 5),
        ({"DECODER_CONFORMANCE_THREADS": "zero", "OPENBLAS_NUM_THREADS": "4"}, 4),
    ],
)
def test_thread_count_comes_from_the_environment(
    environment: dict[str, str], expected: int
) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in parallel.THREAD_VARIABLES}
    answer = subprocess.run(
        [sys.executable, "-c", "from impl import parallel; print(parallel.thread_count())"],
        env={**clean, **environment},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(answer.stdout) == expected


def test_concurrent_tasks_run_on_separate_threads_and_nest_inline(
    threads: Callable[[int], None],
) -> None:
    threads(2)
    names: list[str] = []
    inner: list[tuple[slice, ...]] = []

    def task() -> None:
        names.append(threading.current_thread().name)
        # Work asked for from inside a task runs inline: no helper waits on a busy helper.
        parallel.run_in_parts(inner.append, (8,), 8 * parallel.MIN_WORK_PER_PART)

    parallel.run_concurrently([task, task], 2 * parallel.MIN_WORK_PER_PART)
    assert len(set(names)) == 2
    assert inner == [(slice(None),), (slice(None),)]


def test_small_concurrent_work_runs_in_the_calling_thread(
    threads: Callable[[int], None],
) -> None:
    threads(2)
    names: list[str] = []

    def task() -> None:
        names.append(threading.current_thread().name)

    parallel.run_concurrently([task, task], parallel.MIN_WORK_PER_PART)
    assert names == [threading.current_thread().name] * 2


def test_concurrent_products_equal_the_products_one_by_one(
    threads: Callable[[int], None],
) -> None:
    rng = np.random.default_rng(8)
    pairs = [(rng.normal(size=(300, 70)), rng.normal(size=(70, 90))) for _ in range(2)]
    threads(2)
    together = ops._matrix_products(pairs)
    threads(1)
    for (a, b), product in zip(pairs, together, strict=True):
        np.testing.assert_allclose(product, a @ b, rtol=1e-13, atol=1e-12)
