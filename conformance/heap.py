"""Giving freed heap memory back to the system between large pieces of work."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

__all__ = ["return_freed_memory"]


@functools.cache
def _trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def return_freed_memory() -> None:
    """Give the heap's freed pages back to the system (glibc's ``malloc_trim``). numpy's
    arrays below glibc's mmap threshold (32 MiB at most) live in the heap, and what they free
    stays resident until then: gigabytes after a pass at SmolLM2-135M's shape, held while
    the next large piece of work runs. Elsewhere (no glibc) nothing happens."""
    trim = _trim()
    if trim is not None:
        trim(0)
