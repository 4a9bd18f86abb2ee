"""Differentiable operations: each computes its value and states its derivative rule.

Every function here takes tensors, computes the forward value with numpy, and records a
vector-Jacobian product on the tape. Broadcasting operations route their gradients
through :func:`unbroadcast`, the one helper that sums out broadcast axes. No rule loops
in Python over batch, tokens, heads or features.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from impl.tape import Array, Tensor

__all__ = [
    "add",
    "add_constant",
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
    "rotary",
    "scale",
    "silu",
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

    def vjp(g: Array) -> tuple[Array, Array]:
        grad_a = unbroadcast(g @ np.swapaxes(b.value, -1, -2), a.shape)
        if b.value.ndim == 2:
            # A shared weight: fold every leading axis into one product instead of
            # materialising a per-batch gradient and summing it.
            inner, outer = b.shape
            grad_b = a.value.reshape(-1, inner).T @ g.reshape(-1, outer)
        else:
            grad_b = unbroadcast(np.swapaxes(a.value, -1, -2) @ g, b.shape)
        return grad_a, grad_b

    return Tensor.from_operation(a.value @ b.value, (a, b), vjp, "matmul")


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


def _sigmoid(u: Array) -> Array:
    # exp(-|u|) never overflows; both branches share it.
    decay = np.exp(-np.abs(u))
    result: Array = np.where(u >= 0, 1.0 / (1.0 + decay), decay / (1.0 + decay))
    return result


def silu(a: Tensor) -> Tensor:
    """``u * sigmoid(u)``."""
    sigmoid = _sigmoid(a.value)

    def vjp(g: Array) -> tuple[Array]:
        return (g * (sigmoid * (1.0 + a.value * (1.0 - sigmoid))),)

    return Tensor.from_operation(a.value * sigmoid, (a,), vjp, "silu")


def gather_rows(table: Tensor, ids: IndexArray) -> Tensor:
    """``table[ids]``: one row of a 2-D table per ID; ``ids`` must already be in range."""
    width = table.shape[1]

    def vjp(g: Array) -> tuple[Array]:
        grad = np.zeros(table.shape, dtype=np.float64)
        np.add.at(grad, ids.reshape(-1), g.reshape(-1, width))
        return (grad,)

    return Tensor.from_operation(table.value[ids], (table,), vjp, "gather_rows")


def rotary(x: Tensor, cos: Array, sin: Array) -> Tensor:
    """Rotate interleaved feature pairs (2j, 2j+1) of ``x [..., T, hw]`` by per-position angles.

    ``cos`` and ``sin`` are ``[T, hw/2]``. Interleaved neighbours, not the "rotate half"
    layout some libraries use (RECIPE.md, RoPE).
    """
    pairs_shape = (*x.shape[:-1], x.shape[-1] // 2, 2)

    def rotate(values: Array, sin_sign: float) -> Array:
        pairs = values.reshape(pairs_shape)
        first, second = pairs[..., 0], pairs[..., 1]
        signed_sin = sin_sign * sin
        rotated = np.stack(
            (first * cos - second * signed_sin, first * signed_sin + second * cos), axis=-1
        )
        return rotated.reshape(values.shape)

    def vjp(g: Array) -> tuple[Array]:
        # A rotation's transpose is the rotation by the opposite angle.
        return (rotate(g, -1.0),)

    return Tensor.from_operation(rotate(x.value, 1.0), (x,), vjp, "rotary")


def causal_softmax(scores: Tensor) -> Tensor:
    """Softmax over the last (key) axis of ``[..., T, T]`` scores, keys after the query masked."""
    length = scores.shape[-1]
    future = np.triu(np.ones((length, length), dtype=bool), k=1)
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
    shifted = np.exp(rows - row_max)
    totals = shifted.sum(axis=-1, keepdims=True)
    log_sum_exp = (row_max + np.log(totals))[:, 0]
    value = np.asarray(np.mean(log_sum_exp - rows[picked, targets]), dtype=np.float64)

    def vjp(g: Array) -> tuple[Array]:
        grad = shifted / totals
        grad[picked, targets] -= 1.0
        grad *= g / rows.shape[0]
        return (grad.reshape(logits.shape),)

    return Tensor.from_operation(value, (logits,), vjp, "indexed_mean_nll")
