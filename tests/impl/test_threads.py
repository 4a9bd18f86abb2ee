"""Row-parallel execution: parts cover every row once, errors and BLAS threads are handled."""

from __future__ import annotations

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

from conformance.runner import THREAD_VARIABLES
from impl.kernels import threads as parallel

ROOT = Path(__file__).resolve().parents[2]


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


# Run in a fresh interpreter: forking the test process itself would copy whatever threads
# other tests started there (JAX's, for one), which fork cannot carry and JAX warns about.
_FORKED_CHILD_SCRIPT = """
import multiprocessing
import numpy as np
from impl import ops
from impl.kernels import threads
from impl.tape import Tensor

def product_in_child(queue):
    left = Tensor(np.ones((256, 64)))
    queue.put(ops.matmul(left, Tensor(np.ones((64, 64)))).value.copy())

if __name__ == "__main__":
    threads.set_thread_count(2)
    threads.run_in_parts(lambda part: None, (8,), 8 * threads.MIN_WORK_PER_PART)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=product_in_child, args=(queue,), daemon=True)
    child.start()
    result = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0, child.exitcode
    np.testing.assert_array_equal(result, np.full((256, 64), 64.0))
    print("child ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_threads() -> None:
    answer = subprocess.run(
        [sys.executable, "-c", _FORKED_CHILD_SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() == "child ok"


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
    clean = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    answer = subprocess.run(
        [sys.executable, "-c", "from impl.kernels import threads; print(threads.thread_count())"],
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
