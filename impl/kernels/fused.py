"""The fast path of the reference's hot rules: the same arithmetic as :mod:`impl.ops`, with
reused buffers and rows spread over threads.

Each function here computes, operation for operation, what the rule of the same name in
:mod:`impl.ops` computes, and states nothing new: the formulas are in ``impl.ops``. The
difference is where the numbers go, and, in causal attention only, which masked terms are
skipped: it takes its queries in blocks, each against only the keys it can see, so its sums
and products run over fewer, differently grouped terms. Large arrays come from
:mod:`impl.kernels.buffers` (no page faults after the first step), row-independent work is
cut into parts that run on :mod:`impl.kernels.threads` (numpy releases the GIL in its
loops), and intermediate results are written in place instead of allocated.
``tests/impl/test_kernels.py`` holds each one to its plain rule: values and gradients
bitwise equal, for 1, 2 and 3 threads, except that a matrix product split by rows, and
blocked attention, may differ from the plain rule in the last bits (attention: at most 3e-15
of the largest entry, measured at 300 tokens).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from impl.kernels import buffers
from impl.kernels.threads import Part, run_concurrently, run_in_parts, thread_count
from impl.tape import Array, Tensor, unbroadcast

__all__ = [
    "ProductClock",
    "add",
    "causal_attention",
    "gather_rows",
    "indexed_mean_nll",
    "matmul",
    "reshape",
    "rms_norm",
    "rotary",
    "swiglu",
    "timed_weight_products",
]

IndexArray = npt.NDArray[np.intp]


@dataclass
class ProductClock:
    """Time spent in the fast path's matrix products with a shared 2-D weight (forward and
    backward), and how many such calls there were (small products run plain, untimed)."""

    seconds: float = 0.0
    calls: int = 0


_CLOCK: list[ProductClock] = []


@contextmanager
def timed_weight_products() -> Iterator[ProductClock]:
    """Time every weight-matrix product the fast path runs inside the block (for ``bench``)."""
    clock = ProductClock()
    _CLOCK.append(clock)
    try:
        yield clock
    finally:
        _CLOCK.remove(clock)


def add(a: Tensor, b: Tensor) -> Tensor:
    """:func:`impl.ops.add`, the sum in a reused buffer."""

    def vjp(g: Array) -> tuple[Array, Array]:
        return unbroadcast(g, a.shape), unbroadcast(g, b.shape)

    return Tensor.from_operation(buffers.add(a.value, b.value), (a, b), vjp, "add")


def _matrix_products(pairs: list[tuple[Array, Array]]) -> list[Array]:
    """``a @ b`` for each pair of 2-D operands: one product per thread when there are at
    least as many products as threads, else each product split by rows."""
    started = time.perf_counter()
    products = [buffers.empty((a.shape[0], b.shape[1])) for a, b in pairs]
    multiply_adds = [a.shape[0] * a.shape[1] * b.shape[1] for a, b in pairs]
    if len(pairs) >= thread_count():
        tasks = [
            functools.partial(np.matmul, a, b, out=out)
            for (a, b), out in zip(pairs, products, strict=True)
        ]
        run_concurrently(tasks, sum(multiply_adds))
    else:
        for (a, b), product, work in zip(pairs, products, multiply_adds, strict=True):
            run_in_parts(functools.partial(_multiply_rows, a, b, product), product.shape[:1], work)
    for clock in _CLOCK:
        clock.seconds += time.perf_counter() - started
        clock.calls += 1
    return products


def _multiply_rows(a: Array, b: Array, product: Array, part: Part) -> None:
    np.matmul(a[part], b, out=product[part])


def _rows(array: Array, shape: tuple[int, ...]) -> Array:
    """``array.reshape(shape)``; where that needs a copy, the copy is a reused buffer."""
    if array.flags.c_contiguous:
        return array.reshape(shape)
    return buffers.copy(array).reshape(shape)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """:func:`impl.ops.matmul` with a shared 2-D weight ``b``: one product over all rows,
    split by rows over threads, and its two backward products one per thread."""
    inner, outer = b.shape
    rows = _rows(a.value, (-1, inner))
    (product,) = _matrix_products([(rows, b.value)])

    def vjp(g: Array) -> tuple[Array, Array]:
        upstream = _rows(g, (-1, outer))
        if b.value.T.flags.c_contiguous:
            # A transposed table (the tied head): its gradient made in the table's own layout,
            # so summing it with the lookup's gradient reads both in order (measured at
            # 32,000 x 512: 27 ms, against 126 ms across a transposed one).
            grad_a, grad_b_transposed = _matrix_products(
                [(upstream, b.value.T), (upstream.T, rows)]
            )
            grad_b = grad_b_transposed.T
        else:
            grad_a, grad_b = _matrix_products([(upstream, b.value.T), (rows.T, upstream)])
        return grad_a.reshape(a.shape), grad_b

    return Tensor.from_operation(product.reshape(*a.shape[:-1], outer), (a, b), vjp, "matmul")


def reshape(a: Tensor, shape: tuple[int, ...]) -> Tensor:
    """:func:`impl.ops.reshape`; a copy, where one is needed, is a reused buffer."""

    def vjp(g: Array) -> tuple[Array]:
        return (_rows(g, a.shape),)

    return Tensor.from_operation(_rows(a.value, shape), (a,), vjp, "reshape")


def gather_rows(table: Tensor, ids: IndexArray) -> Tensor:
    """:func:`impl.ops.gather_rows`, the rows and the table gradient in reused buffers."""
    width = table.shape[1]

    def vjp(g: Array) -> tuple[Array]:
        grad = buffers.zeros(table.shape)
        np.add.at(grad, ids.reshape(-1), g.reshape(-1, width))
        return (grad,)

    rows = np.take(table.value, ids, axis=0, out=buffers.empty((*ids.shape, width)))
    return Tensor.from_operation(rows, (table,), vjp, "gather_rows")


def _rotate_pairs(values: Array, cos: Array, sin: Array, out: Array) -> None:
    """:func:`impl.ops.rotate_pairs` written into ``out``."""
    first, second = values[..., 0::2], values[..., 1::2]
    even, odd = out[..., 0::2], out[..., 1::2]
    np.multiply(first, cos, out=even)
    even -= second * sin
    np.multiply(first, sin, out=odd)
    odd += second * cos


def _rotated(values: Array, cos: Array, sin: Array) -> Array:
    rotated = buffers.empty(values.shape)

    def rotate_part(part: Part) -> None:
        _rotate_pairs(values[part], cos, sin, rotated[part])

    run_in_parts(rotate_part, values.shape[:-2], values.size)
    return rotated


def rotary(x: Tensor, cos: Array, sin: Array) -> Tensor:
    """:func:`impl.ops.rotary`, the leading axes spread over threads."""

    def vjp(g: Array) -> tuple[Array]:
        return (_rotated(g, cos, -sin),)

    return Tensor.from_operation(_rotated(x.value, cos, sin), (x,), vjp, "rotary")


def rms_norm(x: Tensor, gain: Tensor, epsilon: float) -> Tensor:
    """:func:`impl.ops.rms_norm`, rows spread over threads, intermediates in place."""
    width = x.shape[-1]
    leading = x.shape[:-1]
    inverse_root = np.empty((*leading, 1))
    normalized = buffers.empty(x.shape)
    value = buffers.empty(x.shape)

    def forward_part(part: Part) -> None:
        rows = x.value[part]
        squares = np.multiply(rows, rows, out=buffers.empty(rows.shape))
        mean_square = squares.mean(axis=-1, keepdims=True)
        np.exp(-0.5 * np.log(mean_square + epsilon), out=inverse_root[part])
        np.multiply(rows, inverse_root[part], out=normalized[part])
        np.multiply(normalized[part], gain.value, out=value[part])

    run_in_parts(forward_part, leading, x.value.size)

    def vjp(g: Array) -> tuple[Array, Array]:
        grad_x = buffers.empty(x.shape)
        gain_terms = buffers.empty(x.shape)

        def backward_part(part: Part) -> None:
            rows, root = x.value[part], inverse_root[part]
            scaled = np.multiply(g[part], gain.value, out=buffers.empty(rows.shape))
            scratch = np.multiply(scaled, rows, out=buffers.empty(rows.shape))
            projection = scratch.sum(axis=-1, keepdims=True)
            projection *= root**3 / width
            into = grad_x[part]
            np.multiply(scaled, root, out=into)
            into -= np.multiply(rows, projection, out=scratch)
            np.multiply(g[part], normalized[part], out=gain_terms[part])

        run_in_parts(backward_part, leading, x.value.size)
        return grad_x, gain_terms.reshape(-1, width).sum(axis=0)

    return Tensor.from_operation(value, (x, gain), vjp, "rms_norm")


def _sigmoid(u: Array, out: Array) -> None:
    """:func:`impl.ops.sigmoid` written into ``out`` (the same operations in the same order)."""
    np.negative(u, out=out)
    with np.errstate(over="ignore", under="ignore"):  # per thread: each part sets its own
        np.exp(out, out=out)
    out += 1.0
    np.divide(1.0, out, out=out)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """:func:`impl.ops.swiglu`, rows spread over threads, the gate gradient built in place."""
    leading = gate.shape[:-1]
    sigmoids, activated, value = (buffers.empty(gate.shape) for _ in range(3))

    def forward_part(part: Part) -> None:
        _sigmoid(gate.value[part], sigmoids[part])
        np.multiply(gate.value[part], sigmoids[part], out=activated[part])
        np.multiply(activated[part], up.value[part], out=value[part])

    run_in_parts(forward_part, leading, gate.value.size)

    def vjp(g: Array) -> tuple[Array, Array]:
        grad_gate, grad_up = buffers.empty(gate.shape), buffers.empty(gate.shape)

        def backward_part(part: Part) -> None:
            # ((1 - s) u + 1) s * up * g, left to right, as impl.ops.swiglu writes it.
            into = grad_gate[part]
            np.subtract(1.0, sigmoids[part], out=into)
            into *= gate.value[part]
            into += 1.0
            into *= sigmoids[part]
            into *= up.value[part]
            into *= g[part]
            np.multiply(g[part], activated[part], out=grad_up[part])

        run_in_parts(backward_part, leading, gate.value.size)
        return grad_gate, grad_up

    return Tensor.from_operation(value, (gate, up), vjp, "swiglu")


_FUTURE_MASKS: dict[int, npt.NDArray[np.bool_]] = {}

# Queries are taken this many at a time, each block against the keys up to its last query
# only: products, softmax and gradients skip the keys every query of the block masks out
# (at 512 tokens, 36/64 of the full square is computed). Forward + backward on one thread,
# attention of the large bench model (2 x 8 heads x 512 tokens x 64): full square 162 ms,
# blocks of 256: 131, 128: 111, 64: 100, 32: 103; SmolLM2-135M's (9 x 1,024): 350 ms full,
# 215 in blocks of 64 or 128; the medium model's (4 x 4 x 128): 9.3 ms full, 8.2 in 64s.
QUERY_BLOCK = 64


def _future_mask(length: int) -> npt.NDArray[np.bool_]:
    """The ``[T, T]`` mask of keys after each query, built once per length."""
    mask = _FUTURE_MASKS.get(length)
    if mask is None:
        mask = np.triu(np.ones((length, length), dtype=bool), k=1)
        mask.flags.writeable = False
        _FUTURE_MASKS[length] = mask
    return mask


def _query_blocks(tokens: int) -> list[tuple[int, int]]:
    """``(first, end)`` of each block of queries; a block sees keys ``[0, end)``."""
    return [(first, min(first + QUERY_BLOCK, tokens)) for first in range(0, tokens, QUERY_BLOCK)]


def _causal_weights(query: Array, key_transposed: Array, out: Array) -> None:
    """The weights of :func:`impl.ops.causal_attention` written into ``out``, block by block
    of queries; entries after a block's last query are left unwritten (never read)."""
    tokens = query.shape[-2]
    future = _future_mask(tokens)
    scale = math.sqrt(query.shape[-1])
    for first, end in _query_blocks(tokens):
        weights, hidden = out[..., first:end, :end], future[first:end, :end]
        np.matmul(query[..., first:end, :], key_transposed[..., :end], out=weights)
        weights /= scale
        np.copyto(weights, -np.inf, where=hidden)
        weights -= weights.max(axis=-1, keepdims=True)
        # exp(-inf) is 0, but special values take exp's slow path: exponentiate zeros there
        # and clear them after. Every visible weight is computed exactly as before.
        np.copyto(weights, 0.0, where=hidden)
        np.exp(weights, out=weights)
        np.copyto(weights, 0.0, where=hidden)
        weights /= weights.sum(axis=-1, keepdims=True)


def _causal_product(lower: Array, right: Array, out: Array) -> None:
    """``lower @ right`` into ``out``, for ``lower`` ``[.., T, T]`` zero after each query's
    keys (weights, score gradients): each block of queries over the keys it sees."""
    for first, end in _query_blocks(lower.shape[-1]):
        np.matmul(lower[..., first:end, :end], right[..., :end, :], out=out[..., first:end, :])


def _score_gradients(g: Array, weights: Array, value_transposed: Array, out: Array) -> None:
    """The scores' gradient ``ds`` of :func:`impl.ops.causal_attention` into ``out``, block
    by block of queries (the blocks of ``weights`` written); ``ds`` is 0 where ``w`` is."""
    scale = math.sqrt(g.shape[-1])
    for first, end in _query_blocks(weights.shape[-1]):
        visible, gradient = weights[..., first:end, :end], out[..., first:end, :end]
        np.matmul(g[..., first:end, :], value_transposed[..., :end], out=gradient)
        products = np.multiply(gradient, visible, out=buffers.empty(visible.shape))
        gradient -= products.sum(axis=-1, keepdims=True)
        gradient *= visible
        gradient /= scale


def _causal_transposed_product(lower: Array, right: Array, out: Array) -> None:
    """``lower^T @ right`` into ``out``, for ``lower`` as in :func:`_causal_product`: each block
    of keys over the queries that see it (from the block's first key on)."""
    for first, end in _query_blocks(lower.shape[-1]):
        np.matmul(
            np.swapaxes(lower[..., first:, first:end], -1, -2),
            right[..., first:, :],
            out=out[..., first:end, :],
        )


def causal_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """:func:`impl.ops.causal_attention`, batch and heads spread over threads, each block of
    queries against only the keys it can see."""
    *leading, tokens, _ = query.shape
    weights = buffers.empty((*leading, tokens, tokens))
    attended = buffers.empty(value.shape)
    keys_transposed = np.swapaxes(key.value, -1, -2)

    def forward_part(part: Part) -> None:
        _causal_weights(query.value[part], keys_transposed[part], weights[part])
        _causal_product(weights[part], value.value[part], attended[part])

    run_in_parts(forward_part, weights.shape[:-2], weights.size)

    def vjp(g: Array) -> tuple[Array, Array, Array]:
        grad_query, grad_key, grad_value = (buffers.empty(query.shape) for _ in range(3))
        scores = buffers.empty(weights.shape)
        values_transposed = np.swapaxes(value.value, -1, -2)

        def backward_part(part: Part) -> None:
            _score_gradients(g[part], weights[part], values_transposed[part], scores[part])
            _causal_product(scores[part], key.value[part], grad_query[part])  # dq = ds k
            _causal_transposed_product(scores[part], query.value[part], grad_key[part])  # ds^T q
            _causal_transposed_product(weights[part], g[part], grad_value[part])  # dv = w^T g

        run_in_parts(backward_part, weights.shape[:-2], weights.size)
        return grad_query, grad_key, grad_value

    return Tensor.from_operation(attended, (query, key, value), vjp, "causal_attention")


def indexed_mean_nll(logits: Tensor, targets: IndexArray) -> Tensor:
    """:func:`impl.ops.indexed_mean_nll`, rows spread over threads."""
    vocabulary = logits.shape[-1]
    rows = logits.value.reshape(-1, vocabulary)
    count = rows.shape[0]
    exponentials = buffers.empty(rows.shape)  # exp(row - row max), kept for backward
    totals = np.empty((count, 1))
    log_sum_exp = np.empty(count)

    def forward_part(part: Part) -> None:
        row_max = rows[part].max(axis=-1, keepdims=True)
        shifted = exponentials[part]
        np.subtract(rows[part], row_max, out=shifted)
        np.exp(shifted, out=shifted)
        shifted.sum(axis=-1, keepdims=True, out=totals[part])
        log_sum_exp[part] = (row_max + np.log(totals[part]))[:, 0]

    run_in_parts(forward_part, rows.shape[:1], rows.size)
    value = np.asarray(np.mean(log_sum_exp - rows[np.arange(count), targets]), dtype=np.float64)

    def vjp(g: Array) -> tuple[Array]:
        grad = buffers.empty(rows.shape)  # the saved exponentials stay intact
        weight = g / count

        def backward_part(part: Part) -> None:
            grad_part = grad[part]
            np.divide(exponentials[part], totals[part], out=grad_part)
            grad_part[np.arange(grad_part.shape[0]), targets[part]] -= 1.0
            grad_part *= weight

        run_in_parts(backward_part, rows.shape[:1], rows.size)
        return (grad.reshape(logits.shape),)

    return Tensor.from_operation(value, (logits,), vjp, "indexed_mean_nll")
