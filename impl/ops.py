"""Differentiable operations: each computes its value and states its derivative rule.

Every function here takes tensors, computes the forward value with numpy, and records a
vector-Jacobian product on the tape. Broadcasting operations route their gradients
through :func:`unbroadcast`, the one helper that sums out broadcast axes. No rule loops
in Python over batch, tokens, heads or features.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

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

    return Tensor.from_operation(a.value + b.value, (a, b), vjp, "add")


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


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product over the last two axes, broadcasting leading axes."""
    if a.value.ndim < 2 or b.value.ndim < 2:
        raise ValueError(f"matmul needs rank >= 2 operands, got {list(a.shape)} @ {list(b.shape)}")
    shared_weight = b.value.ndim == 2 and a.value.ndim > 2
    if shared_weight:
        # [..., n] @ [n, m]: one large product over all rows beats one per leading index.
        inner, outer = b.shape
        value = (a.value.reshape(-1, inner) @ b.value).reshape(*a.shape[:-1], outer)
    else:
        value = a.value @ b.value

    def vjp(g: Array) -> tuple[Array, Array]:
        if b.value.ndim == 2:
            inner, outer = b.shape
            rows = g.reshape(-1, outer)
            grad_a = (rows @ b.value.T).reshape(a.shape) if shared_weight else g @ b.value.T
            grad_b = a.value.reshape(-1, inner).T @ rows
            return grad_a, grad_b
        grad_a = unbroadcast(g @ np.swapaxes(b.value, -1, -2), a.shape)
        return grad_a, unbroadcast(np.swapaxes(a.value, -1, -2) @ g, b.shape)

    return Tensor.from_operation(value, (a, b), vjp, "matmul")


def transpose(a: Tensor, axis1: int, axis2: int) -> Tensor:
    """Swap two axes."""

    def vjp(g: Array) -> tuple[Array]:
        return (np.swapaxes(g, axis1, axis2),)

    return Tensor.from_operation(np.swapaxes(a.value, axis1, axis2), (a,), vjp, "transpose")


def reshape(a: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The same values in a new shape."""

    def vjp(g: Array) -> tuple[Array]:
        return (g.reshape(a.shape),)

    return Tensor.from_operation(a.value.reshape(shape), (a,), vjp, "reshape")


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


def sigmoid(u: Array) -> Array:
    """``1 / (1 + exp(-u))`` as ``(1 + tanh(u / 2)) / 2``: one transcendental, no overflow."""
    result: Array = np.tanh(0.5 * u)
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
        grad = np.zeros(table.shape, dtype=np.float64)
        np.add.at(grad, ids.reshape(-1), g.reshape(-1, width))
        return (grad,)

    return Tensor.from_operation(table.value[ids], (table,), vjp, "gather_rows")


def rotate_pairs(values: Array, cos: Array, sin: Array) -> Array:
    """``(a, b) -> (a cos - b sin, a sin + b cos)`` on interleaved pairs (2j, 2j+1) of the last
    axis; ``-sin`` rotates back. A new array."""
    first, second = values[..., 0::2], values[..., 1::2]
    rotated = np.empty_like(values)
    even, odd = rotated[..., 0::2], rotated[..., 1::2]
    np.multiply(first, cos, out=even)
    even -= second * sin
    np.multiply(first, sin, out=odd)
    odd += second * cos
    return rotated


def rotary(x: Tensor, cos: Array, sin: Array) -> Tensor:
    """Rotate interleaved feature pairs (2j, 2j+1) of ``x [..., T, hw]`` by per-position angles.

    ``cos`` and ``sin`` are ``[T, hw/2]``. Interleaved neighbours, not the "rotate half"
    layout some libraries use (RECIPE.md, RoPE).
    """

    def vjp(g: Array) -> tuple[Array]:
        # A rotation's transpose is the rotation by the opposite angle.
        return (rotate_pairs(g, cos, -sin),)

    return Tensor.from_operation(rotate_pairs(x.value, cos, sin), (x,), vjp, "rotary")


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
    picked = np.arange(rows.shape[0])
    row_max = rows.max(axis=-1, keepdims=True)
    shifted = rows - row_max
    np.exp(shifted, out=shifted)
    totals = shifted.sum(axis=-1, keepdims=True)
    log_sum_exp = (row_max + np.log(totals))[:, 0]
    value = np.asarray(np.mean(log_sum_exp - rows[picked, targets]), dtype=np.float64)

    def vjp(g: Array) -> tuple[Array]:
        grad = shifted / totals  # a fresh array: the saved exponentials stay intact
        grad[picked, targets] -= 1.0
        grad *= g / rows.shape[0]
        return (grad.reshape(logits.shape),)

    return Tensor.from_operation(value, (logits,), vjp, "indexed_mean_nll")


def rms_norm(x: Tensor, gain: Tensor, epsilon: float) -> Tensor:
    """``x * exp(-0.5 log(mean(x^2) + eps)) * gain`` over the last axis, as one operation.

    The same arithmetic as composing mul, mean, log, exp; fused so the backward pass needs no
    chain of intermediate nodes:
    ``dx = r (g gain) - x r^3 mean((g gain) x)``, ``dgain = sum(g x r)``.
    """
    width = x.shape[-1]
    mean_square = (x.value * x.value).mean(axis=-1, keepdims=True)
    inverse_root = np.exp(-0.5 * np.log(mean_square + epsilon))
    normalized = x.value * inverse_root
    value = normalized * gain.value

    def vjp(g: Array) -> tuple[Array, Array]:
        scaled = g * gain.value
        projection = (scaled * x.value).sum(axis=-1, keepdims=True)
        projection *= inverse_root**3 / width
        grad_x = scaled * inverse_root
        grad_x -= x.value * projection
        grad_gain = (g * normalized).reshape(-1, width).sum(axis=0)
        return grad_x, grad_gain

    return Tensor.from_operation(value, (x, gain), vjp, "rms_norm")


def swiglu_product(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` as one operation (the SwiGLU hidden activation)."""
    sigmoids = sigmoid(gate.value)
    activated = gate.value * sigmoids

    def vjp(g: Array) -> tuple[Array, Array]:
        grad_gate = 1.0 - sigmoids
        grad_gate *= gate.value
        grad_gate += 1.0
        grad_gate *= sigmoids
        grad_gate *= up.value
        grad_gate *= g
        return grad_gate, g * activated

    return Tensor.from_operation(activated * up.value, (gate, up), vjp, "swiglu_product")


_FUTURE_MASKS: dict[int, npt.NDArray[np.bool_]] = {}


def future_mask(length: int) -> npt.NDArray[np.bool_]:
    """The ``[T, T]`` mask of keys after each query, built once per length."""
    mask = _FUTURE_MASKS.get(length)
    if mask is None:
        mask = np.triu(np.ones((length, length), dtype=bool), k=1)
        mask.flags.writeable = False
        _FUTURE_MASKS[length] = mask
    return mask


def causal_weights(query: Array, key_transposed: Array) -> Array:
    """``softmax(q k^T / sqrt(hw))`` with keys after each query masked, ``[..., T, T]``."""
    future = future_mask(query.shape[-2])
    weights: Array = query @ key_transposed
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
    gradient: Array = g @ value_transposed
    gradient -= (gradient * weights).sum(axis=-1, keepdims=True)
    gradient *= weights
    gradient /= math.sqrt(g.shape[-1])
    return gradient


def causal_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """``softmax(q k^T / sqrt(hw), keys after the query masked) v`` for ``[B, H, T, hw]``.

    The scores, the mask, the softmax and the weighted sum as one operation: the forward
    arithmetic of :func:`causal_softmax` over :func:`matmul`, with one saved matrix.
    """
    weights = causal_weights(query.value, np.ascontiguousarray(np.swapaxes(key.value, -1, -2)))

    def vjp(g: Array) -> tuple[Array, Array, Array]:
        scores = score_gradient(g, weights, np.ascontiguousarray(np.swapaxes(value.value, -1, -2)))
        grad_query = scores @ key.value
        grad_key = np.swapaxes(scores, -1, -2) @ query.value
        grad_value = np.swapaxes(weights, -1, -2) @ g
        return grad_query, grad_key, grad_value

    return Tensor.from_operation(
        weights @ value.value, (query, key, value), vjp, "causal_attention"
    )
