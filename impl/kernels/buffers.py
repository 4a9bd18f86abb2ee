"""Reusable buffers for the large arrays of a training step.

Every forward and backward pass allocates the same large arrays again. Memory fresh from the
operating system costs a page fault per 4 KiB page on first touch, and glibc hands freed
memory back at the end of each step: a medium bench step took about 26,000 page faults and
65 ms of system time (``getrusage``) before this cache, and takes none after the first step.
The cache keeps each large buffer after use and hands it out again, for an array with
the same number of elements (in any shape), once nothing refers to it any more.

"Nothing refers to it" is read off the reference count of the flat buffer the cache
owns: callers only ever get views of it, and every view holds a reference to its base. A
buffer is reused only when the cache's own reference is the last one, so an array a
caller still holds (a tensor's value, a gradient, a view of either) is never overwritten.

Buffers below :data:`MIN_POOLED_BYTES` come straight from numpy. The cache holds at most
``DECODER_CONFORMANCE_WORKSPACE_MIB`` MiB (default: a quarter of physical memory; 0 turns it
off); past that, free buffers of the least recently used sizes are dropped first.
:func:`release` drops every free buffer.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections import OrderedDict

import numpy as np
import numpy.typing as npt

__all__ = [
    "MIN_POOLED_BYTES",
    "add",
    "cached_bytes",
    "copy",
    "empty",
    "limit_bytes",
    "release",
    "zeros",
]

# Smaller arrays come from glibc's heap, which reuses them cheaply without this cache.
MIN_POOLED_BYTES = 128 * 1024
_ITEM_BYTES = np.dtype(np.float64).itemsize

Array = npt.NDArray[np.float64]


def _configured_limit() -> int:
    text = os.environ.get("DECODER_CONFORMANCE_WORKSPACE_MIB", "").strip()
    if text.isdigit():
        return int(text) * 2**20
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        physical = 8 * 2**30
    return physical // 4


def _reference_count(buffers: list[Array], index: int) -> int:
    return sys.getrefcount(buffers[index])


# What _reference_count reports for a buffer only its list holds (measured: it differs
# between Python versions).
_FREE_COUNT = _reference_count([np.empty(1)], 0)


class _Workspace:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.cached = 0
        self._lock = threading.Lock()
        # Flat buffers by element count, the least recently asked-for count first.
        self._buffers: OrderedDict[int, list[Array]] = OrderedDict()

    def empty(self, shape: tuple[int, ...]) -> Array:
        """An uninitialized float64 array of ``shape``: a reused buffer when one is free."""
        size = math.prod(shape)
        nbytes = size * _ITEM_BYTES
        if nbytes < MIN_POOLED_BYTES:
            return np.empty(shape)
        with self._lock:
            buffers = self._buffers.setdefault(size, [])
            self._buffers.move_to_end(size)
            for index in range(len(buffers)):
                if _reference_count(buffers, index) == _FREE_COUNT:
                    return buffers[index].reshape(shape)
            if self.cached + nbytes > self.limit:
                self._evict(self.cached + nbytes - self.limit)
            if self.cached + nbytes > self.limit:
                return np.empty(shape)
            buffer = np.empty(size)
            buffers.append(buffer)
            self.cached += nbytes
            return buffer.reshape(shape)

    def _evict(self, needed: int) -> None:
        """Drop free buffers, least recently used sizes first, until ``needed`` bytes are gone."""
        for size in list(self._buffers):
            buffers = self._buffers[size]
            for index in reversed(range(len(buffers))):
                if needed <= 0:
                    return
                if _reference_count(buffers, index) == _FREE_COUNT:
                    freed = buffers.pop(index).nbytes
                    self.cached -= freed
                    needed -= freed
            if not buffers:
                del self._buffers[size]

    def release(self) -> None:
        with self._lock:
            self._evict(self.cached + 1)


_WORKSPACE = _Workspace(_configured_limit())
empty = _WORKSPACE.empty  # called for every array the reference makes: one call, not two


def zeros(shape: tuple[int, ...]) -> Array:
    """A float64 array of zeros of ``shape``, from :func:`empty`."""
    array = empty(shape)
    array.fill(0.0)
    return array


def copy(array: Array) -> Array:
    """A copy of ``array`` (C order) in a buffer from :func:`empty`."""
    copied = empty(array.shape)
    np.copyto(copied, array)
    return copied


def add(first: Array, second: Array) -> Array:
    """``first + second`` (broadcasting) in a buffer from :func:`empty`."""
    return np.add(first, second, out=empty(np.broadcast_shapes(first.shape, second.shape)))


def release() -> None:
    """Drop every cached buffer that no array refers to any more."""
    _WORKSPACE.release()


def cached_bytes() -> int:
    """Bytes the cache holds, in use or free."""
    return _WORKSPACE.cached


def limit_bytes() -> int:
    """The most bytes the cache keeps."""
    return _WORKSPACE.limit
