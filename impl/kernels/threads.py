"""Spread row-independent numpy work over this machine's cores.

numpy's BLAS runs matrix products on several threads, but its elementwise ufuncs run on one.
The large steps of the decoder (matrix products, softmax, SwiGLU, RMSNorm, the loss) treat
each row on its own, so :func:`run_in_parts` cuts the leading axes into contiguous parts and
runs one part per thread; numpy releases the GIL inside its loops, so the parts really run at
once. While parts run, OpenBLAS is held to one thread per call: its own idle threads spin for
a while after each product, and on a small machine they take the cores the parts need
(measured on the medium bench model: letting BLAS thread the products itself made a step
about 1.5x slower).

An elementwise part does the same arithmetic on its rows as one call over all rows would, so
those results are bitwise the same for any thread count (tests/impl/test_threads.py). A matrix
product split by rows can differ in the last bit from an unsplit one, as BLAS results differ
between thread counts; for a given thread count every result is reproducible. Reductions
across rows (a gain's gradient, the mean loss) stay in the calling thread, in one call.

The thread count is ``DECODER_CONFORMANCE_THREADS``, else ``OMP_NUM_THREADS``, else
``OPENBLAS_NUM_THREADS``, else the CPUs this process may run on; :func:`set_thread_count`
overrides it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = [
    "MIN_WORK_PER_PART",
    "Part",
    "run_concurrently",
    "run_in_parts",
    "set_thread_count",
    "thread_count",
]

# A part smaller than this costs more to hand to a thread (about 50 us) than it saves.
MIN_WORK_PER_PART = 1 << 15
# Where the thread count is read from, first match wins.
_COUNT_VARIABLES = ("DECODER_CONFORMANCE_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")

# An index into the leading axes: slices, one per axis up to and including the split one.
Part = tuple[slice, ...]
BlasControls = tuple[Callable[[], int], Callable[[int], None]]


def _configured_thread_count() -> int:
    for variable in _COUNT_VARIABLES:
        text = os.environ.get(variable, "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _openblas_thread_controls() -> BlasControls | None:
    """``(get, set)`` for the thread count of the OpenBLAS numpy loaded, or None elsewhere."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", "")):
            getter = getattr(library, f"{prefix}_get_num_threads{suffix}", None)
            setter = getattr(library, f"{prefix}_set_num_threads{suffix}", None)
            if getter is not None and setter is not None:
                getter.restype, setter.restype = ctypes.c_int, None
                setter.argtypes = [ctypes.c_int]
                return getter, setter
    return None


class _Threads:
    """The helper threads, started on first use (and again in a forked child)."""

    def __init__(self) -> None:
        self.count = _configured_thread_count()
        self._pool: ThreadPoolExecutor | None = None
        self._owner = -1  # the process that started the pool
        self._lock = threading.Lock()
        self._blas: BlasControls | None = None
        self._blas_looked_up = False
        self.local = threading.local()  # .busy: this thread is running a part or task

    def helpers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._owner != os.getpid():
                self._pool = ThreadPoolExecutor(self.count - 1, thread_name_prefix="decoder-part")
                self._owner = os.getpid()
            return self._pool

    def resize(self, count: int) -> None:
        with self._lock:
            if self._pool is not None and self._owner == os.getpid():
                self._pool.shutdown(wait=True)
            self._pool = None
            self.count = count

    @contextlib.contextmanager
    def single_threaded_blas(self) -> Iterator[None]:
        if not self._blas_looked_up:
            import numpy  # noqa: F401  (the lookup reads the BLAS library numpy loads)

            self._blas = _openblas_thread_controls()
            self._blas_looked_up = True
        if self._blas is None:
            yield
            return
        get, set_ = self._blas
        previous = get()
        set_(1)
        try:
            yield
        finally:
            set_(previous)


_THREADS = _Threads()


def thread_count() -> int:
    """How many threads the reference spreads its work over."""
    return _THREADS.count


def set_thread_count(threads: int) -> None:
    """Use ``threads`` threads from now on (1: everything in the calling thread)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"thread count must be a positive integer, got {threads!r}")
    _THREADS.resize(threads)


def _split(shape: tuple[int, ...], parts: int) -> list[Part]:
    """Up to ``parts`` contiguous pieces of the first axis long enough to give each a piece,
    else of the longer of the first two axes."""
    candidates = shape[:2]
    axis = next(
        (index for index, size in enumerate(candidates) if size >= parts),
        max(range(len(candidates)), key=lambda index: candidates[index]),
    )
    length = shape[axis]
    parts = min(parts, length)
    bounds = [length * index // parts for index in range(parts + 1)]
    leading = (slice(None),) * axis
    return [(*leading, slice(bounds[i], bounds[i + 1])) for i in range(parts)]


def run_in_parts(kernel: Callable[[Part], None], shape: tuple[int, ...], work: int) -> None:
    """Call ``kernel(part)`` for parts of the leading axes ``shape`` that cover them once.

    ``work`` is what the whole call does, in elements touched (multiply-adds for a matrix
    product); small work, and work asked for from inside a part, runs in one call on the
    calling thread. The kernel writes only the rows of its part. An exception in any part is
    raised here after every part has finished.
    """
    parts = min(_THREADS.count, work // MIN_WORK_PER_PART)
    pieces = _split(shape, parts) if parts >= 2 and shape else []
    if len(pieces) < 2 or getattr(_THREADS.local, "busy", False):
        kernel((slice(None),))
        return
    _run([functools.partial(kernel, piece) for piece in pieces])


def run_concurrently(tasks: Sequence[Callable[[], object]], work: int) -> None:
    """Run independent tasks at once, one thread each (at most :func:`thread_count` at once).

    For a few large matrix products: each product whole on one thread is faster than each
    product split by rows over all threads (every thread would pack the same operand).
    ``work`` is what all tasks do together, as for :func:`run_in_parts`; small work, work
    asked for from inside a part or task, and work with one thread run one task after another.
    """
    if (
        len(tasks) < 2
        or _THREADS.count < 2
        or work // MIN_WORK_PER_PART < 2
        or getattr(_THREADS.local, "busy", False)
    ):
        for task in tasks:
            task()
        return
    _run(tasks)


def _busy(task: Callable[[], object]) -> None:
    _THREADS.local.busy = True
    try:
        task()
    finally:
        _THREADS.local.busy = False


def _run(tasks: Sequence[Callable[[], object]]) -> None:
    """The first task on the calling thread, the rest on helpers, BLAS on one thread each."""
    pool = _THREADS.helpers()
    with _THREADS.single_threaded_blas():
        futures: list[Future[None]] = [pool.submit(_busy, task) for task in tasks[1:]]
        try:
            _busy(tasks[0])
        finally:
            errors = [future.exception() for future in futures]
    for error in errors:
        if error is not None:
            raise error
