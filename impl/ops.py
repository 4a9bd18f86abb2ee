"""Differentiable operations: each computes its value and states its derivative rule.

Every function here takes tensors, computes the forward value with numpy, and records a
vector-Jacobian product on the tape. Broadcasting operations route their gradients
through :func:`unbroadcast`, the one helper that sums out broadcast axes. No rule loops
in Python over batch, tokens, heads or features.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import numpy.typing as npt

from impl import workspace
from impl.parallel import Part, run_concurrently, run_in_parts, thread_count
from impl.tape import Array, Tensor

__all__ = [
    "add",
    "add_constant",
    "causal_attention",
    "causal_softmax",
    "divide",
    "exp",
    "gather_rows",
    "indexed_mean_nll",
    "log",
    "matmul",
    "mean",
    "mul",
    "reshape",
    "rms_norm",
    "rotary",
    "rotate_pairs",
    "scale",
    "sigmoid",
    "silu",
    "swiglu_product",
    "transpose",
    "unbroadcast",
]

IndexArray = npt.NDArray[np.intp]


def unbroadcast(gradient: Array, shape: tuple[int, ...]) -> Array:
    """Sum ``gradient`` down to ``shape``, undoing numpy broadcasting."""
    extra = gradient.ndim - len(shape)
    if extra > 0:
        gradient = gradient.sum(axis=tuple(range(extra)))
    stretched = tuple(
        axis for axis, size in enumerate(shape) if size == 1 and gradient.shape[axis] != 1
    )
    if stretched:
        gradient = gradient.sum(axis=stretched, keepdims=True)
    return gradient


def add(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``a + b`` with broadcasting."""

    def vjp(g: Array) -> tuple[Array, Array]:
        return unbroadcast(g, a.shape), unbroadcast(g, b.shape)

    return Tensor.from_operation(workspace.add(a.value, b.value), (a, b), vjp, "add")


def mul(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``a * b`` with broadcasting."""

    def vjp(g: Array) -> tuple[Array, Array]:
        return unbroadcast(g * b.value, a.shape), unbroadcast(g * a.value, b.shape)

    return Tensor.from_operation(a.value * b.value, (a, b), vjp, "mul")


def add_constant(a: Tensor, constant: float) -> Tensor:
    """``a + constant`` for a plain number."""

    def vjp(g: Array) -> tuple[Array]:
        return (g,)

    return Tensor.from_operation(a.value + constant, (a,), vjp, "add_constant")


def scale(a: Tensor, factor: float) -> Tensor:
    """``a * factor`` for a plain number."""

    def vjp(g: Array) -> tuple[Array]:
        return (g * factor,)

    return Tensor.from_operation(a.value * factor, (a,), vjp, "scale")


def divide(a: Tensor, divisor: float) -> Tensor:
    """``a / divisor`` for a plain number."""

    def vjp(g: Array) -> tuple[Array]:
        return (g / divisor,)

    return Tensor.from_operation(a.value / divisor, (a,), vjp, "divide")


def _matrix_product(a: Array, b: Array) -> Array:
    """``a @ b`` for 2-D operands, the rows of ``a`` spread over threads."""
    (product,) = _matrix_products([(a, b)])
    return product


def _matrix_products(pairs: list[tuple[Array, Array]]) -> list[Array]:
    """``a @ b`` for each pair of 2-D operands: one product per thread when there are at
    least as many products as threads, else each product split by rows."""
    products = [workspace.empty((a.shape[0], b.shape[1])) for a, b in pairs]
    multiply_adds = [a.shape[0] * a.shape[1] * b.shape[1] for a, b in pairs]
    if len(pairs) >= thread_count():
        tasks = [
            functools.partial(np.matmul, a, b, out=out)
            for (a, b), out in zip(pairs, products, strict=True)
        ]
        run_concurrently(tasks, sum(multiply_adds))
        return products
    for (a, b), product, work in zip(pairs, products, multiply_adds, strict=True):
        run_in_parts(functools.partial(_multiply_rows, a, b, product), product.shape[:1], work)
    return products


def _multiply_rows(a: Array, b: Array, product: Array, part: Part) -> None:
    np.matmul(a[part], b, out=product[part])


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product over the last two axes, broadcasting leading axes."""
    if a.value.ndim < 2 or b.value.ndim < 2:
        raise ValueError(f"matmul needs rank >= 2 operands, got {list(a.shape)} @ {list(b.shape)}")
    shared_weight = b.value.ndim == 2
    if shared_weight:
        # [..., n] @ [n, m]: one large product over all rows beats one per leading index.
        inner, outer = b.shape
        rows = reshaped(a.value, (-1, inner))
        value = _matrix_product(rows, b.value).reshape(*a.shape[:-1], outer)
    else:
        value = a.value @ b.value

    def vjp(g: Array) -> tuple[Array, Array]:
        if shared_weight:
            upstream = reshaped(g, (-1, outer))
            grad_a, grad_b = _matrix_products([(upstream, b.value.T), (rows.T, upstream)])
            return grad_a.reshape(a.shape), grad_b
        grad_a = unbroadcast(g @ np.swapaxes(b.value, -1, -2), a.shape)
        return grad_a, unbroadcast(np.swapaxes(a.value, -1, -2) @ g, b.shape)

    return Tensor.from_operation(value, (a, b), vjp, "matmul")


def transpose(a: Tensor, axis1: int, axis2: int) -> Tensor:
    """Swap two axes."""

    def vjp(g: Array) -> tuple[Array]:
        return (np.swapaxes(g, axis1, axis2),)

    return Tensor.from_operation(np.swapaxes(a.value, axis1, axis2), (a,), vjp, "transpose")


def reshaped(array: Array, shape: tuple[int, ...]) -> Array:
    """``array.reshape(shape)``; where that needs a copy, the copy is a workspace buffer."""
    if array.flags.c_contiguous:
        return array.reshape(shape)
    return workspace.copy(array).reshape(shape)


def reshape(a: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The same values in a new shape."""

    def vjp(g: Array) -> tuple[Array]:
        return (reshaped(g, a.shape),)

    return Tensor.from_operation(reshaped(a.value, shape), (a,), vjp, "reshape")


def mean(a: Tensor, axis: int) -> Tensor:
    """Mean over one axis, kept as a size-1 axis."""
    size = a.shape[axis]

    def vjp(g: Array) -> tuple[Array]:
        return (np.broadcast_to(g / size, a.shape),)

    return Tensor.from_operation(a.value.mean(axis=axis, keepdims=True), (a,), vjp, "mean")


def log(a: Tensor) -> Tensor:
    """Natural logarithm."""

    def vjp(g: Array) -> tuple[Array]:
        return (g / a.value,)

    return Tensor.from_operation(np.log(a.value), (a,), vjp, "log")


def exp(a: Tensor) -> Tensor:
    """Exponential."""
    value = np.exp(a.value)

    def vjp(g: Array) -> tuple[Array]:
        return (g * value,)

    return Tensor.from_operation(value, (a,), vjp, "exp")


def sigmoid(u: Array, out: Array | None = None) -> Array:
    """``1 / (1 + exp(-u))`` as ``(1 + tanh(u / 2)) / 2``: one transcendental, no overflow.
    Written into ``out`` (a new array when None)."""
    result: Array = np.multiply(u, 0.5, out=out)
    np.tanh(result, out=result)
    result += 1.0
    result *= 0.5
    return result


def silu(a: Tensor) -> Tensor:
    """``u * sigmoid(u)``."""
    sigmoids = sigmoid(a.value)

    def vjp(g: Array) -> tuple[Array]:
        return (g * (sigmoids * (1.0 + a.value * (1.0 - sigmoids))),)

    return Tensor.from_operation(a.value * sigmoids, (a,), vjp, "silu")


def gather_rows(table: Tensor, ids: IndexArray) -> Tensor:
    """``table[ids]``: one row of a 2-D table per ID; ``ids`` must already be in range."""
    width = table.shape[1]

    def vjp(g: Array) -> tuple[Array]:
        grad = workspace.zeros(table.shape)
        np.add.at(grad, ids.reshape(-1), g.reshape(-1, width))
        return (grad,)

    rows = np.take(table.value, ids, axis=0, out=workspace.empty((*ids.shape, width)))
    return Tensor.from_operation(rows, (table,), vjp, "gather_rows")


def rotate_pairs(values: Array, cos: Array, sin: Array, out: Array | None = None) -> Array:
    """``(a, b) -> (a cos - b sin, a sin + b cos)`` on interleaved pairs (2j, 2j+1) of the last
    axis; ``-sin`` rotates back. Written into ``out`` (a new array when None)."""
    first, second = values[..., 0::2], values[..., 1::2]
    rotated = np.empty_like(values) if out is None else out
    even, odd = rotated[..., 0::2], rotated[..., 1::2]
    np.multiply(first, cos, out=even)
    even -= second * sin
    np.multiply(first, sin, out=odd)
    odd += second * cos
    return rotated


def _rotated(values: Array, cos: Array, sin: Array) -> Array:
    """:func:`rotate_pairs` of ``[..., T, hw]`` values, the leading axes spread over threads."""
    rotated = workspace.empty(values.shape)

    def rotate_part(part: Part) -> None:
        rotate_pairs(values[part], cos, sin, out=rotated[part])

    run_in_parts(rotate_part, values.shape[:-2], values.size)
    return rotated


def rotary(x: Tensor, cos: Array, sin: Array) -> Tensor:
    """Rotate interleaved feature pairs (2j, 2j+1) of ``x [..., T, hw]`` by per-position angles.

    ``cos`` and ``sin`` are ``[T, hw/2]``. Interleaved neighbours, not the "rotate half"
    layout some libraries use (RECIPE.md, RoPE).
    """

    def vjp(g: Array) -> tuple[Array]:
        # A rotation's transpose is the rotation by the opposite angle.
        return (_rotated(g, cos, -sin),)

    return Tensor.from_operation(_rotated(x.value, cos, sin), (x,), vjp, "rotary")


def causal_softmax(scores: Tensor) -> Tensor:
    """Softmax over the last (key) axis of ``[..., T, T]`` scores, keys after the query masked."""
    future = future_mask(scores.shape[-1])
    masked = np.where(future, -np.inf, scores.value)
    shifted = np.exp(masked - masked.max(axis=-1, keepdims=True))
    weights = shifted / shifted.sum(axis=-1, keepdims=True)

    def vjp(g: Array) -> tuple[Array]:
        return (weights * (g - (g * weights).sum(axis=-1, keepdims=True)),)

    return Tensor.from_operation(weights, (scores,), vjp, "causal_softmax")


def indexed_mean_nll(logits: Tensor, targets: IndexArray) -> Tensor:
    """Mean over rows of ``-log softmax(logits[row])[target]``; ``targets`` flat, in range."""
    vocabulary = logits.shape[-1]
    rows = logits.value.reshape(-1, vocabulary)
    count = rows.shape[0]
    exponentials = workspace.empty(rows.shape)  # exp(row - row max), kept for backward
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
        grad = workspace.empty(rows.shape)  # the saved exponentials stay intact
        weight = g / count

        def backward_part(part: Part) -> None:
            grad_part = grad[part]
            np.divide(exponentials[part], totals[part], out=grad_part)
            grad_part[np.arange(grad_part.shape[0]), targets[part]] -= 1.0
            grad_part *= weight

        run_in_parts(backward_part, rows.shape[:1], rows.size)
        return (grad.reshape(logits.shape),)

    return Tensor.from_operation(value, (logits,), vjp, "indexed_mean_nll")


def rms_norm(x: Tensor, gain: Tensor, epsilon: float) -> Tensor:
    """``x * exp(-0.5 log(mean(x^2) + eps)) * gain`` over the last axis, as one operation.

    The same arithmetic as composing mul, mean, log, exp; fused so the backward pass needs no
    chain of intermediate nodes:
    ``dx = r (g gain) - x r^3 mean((g gain) x)``, ``dgain = sum(g x r)``.
    """
    width = x.shape[-1]
    leading = x.shape[:-1]
    inverse_root = np.empty((*leading, 1))
    normalized = workspace.empty(x.shape)
    value = workspace.empty(x.shape)

    def forward_part(part: Part) -> None:
        rows = x.value[part]
        squares = np.multiply(rows, rows, out=workspace.empty(rows.shape))
        mean_square = squares.mean(axis=-1, keepdims=True)
        np.exp(-0.5 * np.log(mean_square + epsilon), out=inverse_root[part])
        np.multiply(rows, inverse_root[part], out=normalized[part])
        np.multiply(normalized[part], gain.value, out=value[part])

    run_in_parts(forward_part, leading, x.value.size)

    def vjp(g: Array) -> tuple[Array, Array]:
        grad_x = workspace.empty(x.shape)
        gain_terms = workspace.empty(x.shape)

        def backward_part(part: Part) -> None:
            rows, root = x.value[part], inverse_root[part]
            scaled = np.multiply(g[part], gain.value, out=workspace.empty(rows.shape))
            scratch = np.multiply(scaled, rows, out=workspace.empty(rows.shape))
            projection = scratch.sum(axis=-1, keepdims=True)
            projection *= root**3 / width
            into = grad_x[part]
            np.multiply(scaled, root, out=into)
            into -= np.multiply(rows, projection, out=scratch)
            np.multiply(g[part], normalized[part], out=gain_terms[part])

        run_in_parts(backward_part, leading, x.value.size)
        return grad_x, gain_terms.reshape(-1, width).sum(axis=0)

    return Tensor.from_operation(value, (x, gain), vjp, "rms_norm")


def swiglu_product(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` as one operation (the SwiGLU hidden activation)."""
    leading = gate.shape[:-1]
    sigmoids, activated, value = (workspace.empty(gate.shape) for _ in range(3))

    def forward_part(part: Part) -> None:
        sigmoid(gate.value[part], out=sigmoids[part])
        np.multiply(gate.value[part], sigmoids[part], out=activated[part])
        np.multiply(activated[part], up.value[part], out=value[part])

    run_in_parts(forward_part, leading, gate.value.size)

    def vjp(g: Array) -> tuple[Array, Array]:
        grad_gate, grad_up = workspace.empty(gate.shape), workspace.empty(gate.shape)

        def backward_part(part: Part) -> None:
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

    return Tensor.from_operation(value, (gate, up), vjp, "swiglu_product")


_FUTURE_MASKS: dict[int, npt.NDArray[np.bool_]] = {}


def future_mask(length: int) -> npt.NDArray[np.bool_]:
    """The ``[T, T]`` mask of keys after each query, built once per length."""
    mask = _FUTURE_MASKS.get(length)
    if mask is None:
        mask = np.triu(np.ones((length, length), dtype=bool), k=1)
        mask.flags.writeable = False
        _FUTURE_MASKS[length] = mask
    return mask


def causal_weights(query: Array, key_transposed: Array, out: Array | None = None) -> Array:
    """``softmax(q k^T / sqrt(hw))`` with keys after each query masked, ``[..., T, T]``."""
    future = future_mask(query.shape[-2])
    weights: Array = np.matmul(query, key_transposed, out=out)
    weights /= math.sqrt(query.shape[-1])
    np.copyto(weights, -np.inf, where=future)
    weights -= weights.max(axis=-1, keepdims=True)
    # exp(-inf) is 0, but special values take exp's slow path: exponentiate zeros there and
    # clear them after. Every visible weight is computed exactly as before.
    np.copyto(weights, 0.0, where=future)
    np.exp(weights, out=weights)
    np.copyto(weights, 0.0, where=future)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights


def score_gradient(g: Array, weights: Array, value_transposed: Array) -> Array:
    """d loss / d scores (already divided by sqrt(hw)) for ``out = weights @ v``."""
    gradient = np.matmul(g, value_transposed, out=workspace.empty(weights.shape))
    products = np.multiply(gradient, weights, out=workspace.empty(weights.shape))
    gradient -= products.sum(axis=-1, keepdims=True)
    gradient *= weights
    gradient /= math.sqrt(g.shape[-1])
    return gradient


def causal_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """``softmax(q k^T / sqrt(hw), keys after the query masked) v`` for ``[B, H, T, hw]``.

    The scores, the mask, the softmax and the weighted sum as one operation: the forward
    arithmetic of :func:`causal_softmax` over :func:`matmul`, with one saved matrix. Batch
    and heads are spread over threads.
    """
    *leading, tokens, _ = query.shape
    weights = workspace.empty((*leading, tokens, tokens))
    attended = workspace.empty(value.shape)
    keys_transposed = np.swapaxes(key.value, -1, -2)

    def forward_part(part: Part) -> None:
        causal_weights(query.value[part], keys_transposed[part], out=weights[part])
        np.matmul(weights[part], value.value[part], out=attended[part])

    run_in_parts(forward_part, weights.shape[:-2], weights.size)

    def vjp(g: Array) -> tuple[Array, Array, Array]:
        grad_query, grad_key, grad_value = (workspace.empty(query.shape) for _ in range(3))
        values_transposed = np.swapaxes(value.value, -1, -2)

        def backward_part(part: Part) -> None:
            scores = score_gradient(g[part], weights[part], values_transposed[part])
            np.matmul(scores, key.value[part], out=grad_query[part])
            np.matmul(np.swapaxes(scores, -1, -2), query.value[part], out=grad_key[part])
            np.matmul(np.swapaxes(weights[part], -1, -2), g[part], out=grad_value[part])

        run_in_parts(backward_part, weights.shape[:-2], weights.size)
        return grad_query, grad_key, grad_value

    return Tensor.from_operation(attended, (query, key, value), vjp, "causal_attention")
