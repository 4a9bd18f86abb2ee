"""The reference's fast path: reused buffers, rows spread over threads, fused rules.

The rules themselves are :mod:`impl.ops`; :mod:`impl.kernels.fused` computes the hot ones
(matrix products, RMSNorm, SwiGLU, attention, RoPE, the loss) operation for operation the
same way, with buffers from :mod:`impl.kernels.buffers` and parts on
:mod:`impl.kernels.threads`. A rule hands its work to the fast path only where that can gain
something (:func:`worthwhile`): the suite's small models, the golden cases and the seed's
report run the plain rules; the benchmark sizes run here.
"""

from __future__ import annotations

from impl.kernels import buffers, threads
from impl.kernels.fused import ProductClock, timed_weight_products
from impl.kernels.threads import set_thread_count, thread_count

__all__ = [
    "POOLED_ELEMENTS",
    "SPLIT_WORK",
    "ProductClock",
    "buffers",
    "set_thread_count",
    "thread_count",
    "threads",
    "timed_weight_products",
    "worthwhile",
]

# Below this many float64 elements a buffer comes straight from numpy (nothing to reuse) ...
POOLED_ELEMENTS = buffers.MIN_POOLED_BYTES // 8
# ... and below this much work nothing is split over threads.
SPLIT_WORK = 2 * threads.MIN_WORK_PER_PART


def worthwhile(elements: int, work: int = 0) -> bool:
    """Whether the fast path can gain anything over the plain rule: an output large enough
    to come from a reused buffer, or work (elements touched, multiply-adds) large enough to
    split over threads."""
    return elements >= POOLED_ELEMENTS or work >= SPLIT_WORK
