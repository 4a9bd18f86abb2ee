"""The memory bound, and what the reference's entry points would allocate, in bytes.

Every entry point that allocates in proportion to its sizes compares its estimate with
:func:`memory_limit` first and refuses above it, before allocating anything: a request for
7 TiB is a refusal with a kind in a few microseconds, not a ``MemoryError`` traceback (or
the kernel's OOM killer) minutes later. The estimates are pure arithmetic on the sizes.

The bound is the smallest of

- ``DECODER_CONFORMANCE_MEMORY_LIMIT``, in bytes (``12884901888``, or with a binary suffix:
  ``12G``, ``512MiB``; a value that cannot be read is ignored with a ``RuntimeWarning``);
- the address space left under the soft ``RLIMIT_AS``, when one is set (``ulimit -v``);
- half the physical memory, or half the cgroup's memory limit where that is smaller.

It bounds one call's own new allocations, not the process's total: arrays that already exist
(a model's parameters, the caller's tokens, the fast path's cached free buffers) are not
counted against it.

The estimates count the float64 arrays :mod:`impl.ops`, :mod:`impl.layers` and
:mod:`impl.kernels.fused` create (B batch, T tokens, d width, H heads, hw head width, f
feed-forward width, V vocabulary, N blocks, R = B T rows, S = B H T^2 attention scores):

- a forward pass keeps per block 15 R d (two RMSNorms of 2 each, query, key, value, two
  rotated, attended, merged, output, two residual sums, down), 5 R f (gate, up, sigmoid,
  SiLU, product), the S attention weights and 4 R per-row inverse roots; then 3 R d + R
  (embedding, final norm) and R V logits; on top, at one time, 2 R max(d, f) of
  elementwise temporaries, 3 S where the plain attention rule runs (S below the fast
  path's pool size), the causal mask's T^2 bytes (3 T^2 while it is built) and the 2 T hw
  of the RoPE tables;
- a loss adds 2 R V (the softmax's exponentials and one temporary), and the backward pass
  it exists for: R V + R d for the head, one block's 10 R d + 4 R f + 2 S at a time, the
  P leaf gradients a first backward creates, and 3 more copies of the largest weight while
  they accumulate (the tied table's two contributions and their sum);
- building a model: its values and gradients (2 P for P scalars), one copy of the largest
  matrix in flight, and the draw's per-block temporaries.

Each adds a fixed allowance for the tape's Python objects. ``tests/impl/test_resources.py``
measures the peak (``tracemalloc``, which sees numpy's allocations) on six configurations
and holds every estimate between the peak and 2x it (3x for building, which counts the
gradients a first backward adds). Measured: forward 1.01-1.19x, loss and backward
1.02-1.31x, building 1.5-2.3x, from a mid-size model to the bench's large one.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from dataclasses import dataclass

from impl.kernels import POOLED_ELEMENTS
from spec.config import DecoderConfig
from spec.parameters import parameter_count
from spec.recipe import DRAW_BLOCK_SCALARS

__all__ = [
    "MEMORY_LIMIT_VARIABLE",
    "MemoryLimit",
    "forward_bytes",
    "loss_bytes",
    "memory_limit",
    "memory_limit_bytes",
    "parameter_bytes",
]

MEMORY_LIMIT_VARIABLE = "DECODER_CONFORMANCE_MEMORY_LIMIT"

_FLOAT_BYTES = 8
# The draw's uint64 and float64 temporaries alive at once, per scalar of a block (measured
# about 5; counted with a margin).
_DRAW_TEMPORARIES = 8
# Tensors, closures and small arrays of the tape, per block and per pass.
_BLOCK_OVERHEAD_BYTES = 64 * 2**10
_PASS_OVERHEAD_BYTES = 256 * 2**10

_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
_UNREADABLE_WARNED: set[str] = set()
_LIMIT_PATTERN = re.compile(r"\s*(\d+)\s*([KMGTP]?)(?:I?B)?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class MemoryLimit:
    """The bound in bytes, and where it comes from (for the refusal's message)."""

    bytes: int
    source: str


def _configured_limit() -> MemoryLimit | None:
    text = os.environ.get(MEMORY_LIMIT_VARIABLE)
    if text is None or not text.strip():
        return None
    match = _LIMIT_PATTERN.fullmatch(text)
    if match is None:
        # Not silent, and not fatal either: the machine's own bounds still hold. Once per
        # value, not once per forward pass.
        if text not in _UNREADABLE_WARNED:
            _UNREADABLE_WARNED.add(text)
            warnings.warn(
                f"{MEMORY_LIMIT_VARIABLE} must be a number of bytes, optionally with a binary "
                f"suffix (K, M, G, T, P), got {text!r}; ignoring it",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
    digits, suffix = match.groups()
    return MemoryLimit(int(digits) * _SUFFIXES[suffix.upper()], MEMORY_LIMIT_VARIABLE)


def _address_space_left() -> MemoryLimit | None:
    """The address space the soft ``RLIMIT_AS`` leaves this process, or None without one."""
    try:
        import resource
    except ImportError:  # not on a POSIX system
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as statm:
            in_use = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        in_use = 0
    return MemoryLimit(max(soft - in_use, 0), "the address space left under RLIMIT_AS")


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as limit:
                text = limit.read().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


@functools.cache
def _half_the_machine() -> MemoryLimit:
    """Half the physical memory (or the cgroup's limit): room for everything else."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        physical = 8 * 2**30
    cgroup = _cgroup_limit()
    if cgroup is not None and cgroup < physical:
        return MemoryLimit(cgroup // 2, "half the cgroup's memory limit")
    return MemoryLimit(physical // 2, "half the physical memory")


def memory_limit() -> MemoryLimit:
    """The smallest of the configured limit, the address space left and half the machine.

    Read on every call (a few microseconds): a test or a user may set the variable or
    ``ulimit -v`` at any time.
    """
    candidates = [_half_the_machine()]
    for bound in (_configured_limit(), _address_space_left()):
        if bound is not None:
            candidates.append(bound)
    return min(candidates, key=lambda bound: bound.bytes)


def memory_limit_bytes() -> int:
    """:func:`memory_limit` in bytes."""
    return memory_limit().bytes


@dataclass(frozen=True)
class _Sizes:
    """A configuration's sizes as Python ints: numpy sizes would wrap around past 2**63."""

    vocabulary: int
    width: int
    heads: int
    feed_forward: int
    layers: int

    @classmethod
    def of(cls, config: DecoderConfig) -> _Sizes:
        return cls(
            int(config.vocabulary_size),
            int(config.model_width),
            int(config.heads),
            int(config.feed_forward_width),
            int(config.layers),
        )

    @property
    def head_width(self) -> int:
        return self.width // self.heads

    @property
    def largest_matrix(self) -> int:
        """Scalars of the largest parameter matrix (the table, or a block's d x d or d x f)."""
        d = self.width
        blocks = max(d * d, d * self.feed_forward) if self.layers else 0
        return max(self.vocabulary * d, blocks)


def parameter_bytes(config: DecoderConfig) -> int:
    """Bytes to build a model of ``config``: values and gradients, one matrix in flight
    (drawn, then copied into its leaf), and the draw's temporaries."""
    largest = _Sizes.of(config).largest_matrix
    drawing = _DRAW_TEMPORARIES * min(largest, DRAW_BLOCK_SCALARS)
    return _FLOAT_BYTES * (2 * parameter_count(config) + largest + drawing) + _PASS_OVERHEAD_BYTES


def forward_bytes(config: DecoderConfig, batch: int, length: int) -> int:
    """Bytes a forward pass over ``batch`` x ``length`` tokens allocates (see the module)."""
    sizes = _Sizes.of(config)
    d, f, v, layers = sizes.width, sizes.feed_forward, sizes.vocabulary, sizes.layers
    batch, length = int(batch), int(length)
    rows = batch * length
    scores = batch * sizes.heads * length * length
    # The plain rule's score, masked and exponential arrays; the fast path writes in place.
    plain_attention = 3 * scores if layers and scores < POOLED_ELEMENTS else 0
    kept = layers * (15 * rows * d + 5 * rows * f + scores + 4 * rows) + 3 * rows * d + rows * v
    transient = 2 * rows * max(d, f) + plain_attention
    rope = 2 * length * sizes.head_width
    mask_bytes = 3 * length * length if layers else 0
    overhead = layers * _BLOCK_OVERHEAD_BYTES + _PASS_OVERHEAD_BYTES
    return _FLOAT_BYTES * (kept + rows + transient + rope) + mask_bytes + overhead


def loss_bytes(config: DecoderConfig, batch: int, length: int) -> int:
    """Bytes a loss over ``batch`` x ``length`` tokens and its backward pass allocate.

    The backward is counted here because a loss exists to be differentiated, and a backward
    that ran out of memory half-way would leave some gradients accumulated and others not.
    """
    sizes = _Sizes.of(config)
    d, f, v = sizes.width, sizes.feed_forward, sizes.vocabulary
    rows = int(batch) * int(length)
    scores = rows * sizes.heads * int(length)
    softmax = 2 * rows * v + 2 * rows
    head = rows * v + rows * d
    block = (10 * rows * d + 4 * rows * f + 2 * scores) if sizes.layers else 0
    accumulation = parameter_count(config) + 3 * sizes.largest_matrix
    backward = head + block + accumulation
    return forward_bytes(config, batch, length) + _FLOAT_BYTES * (softmax + backward)
