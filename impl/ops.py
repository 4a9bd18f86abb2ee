"""The derivative rules of the decoder: one function a rule, its value and its VJP.

Each rule computes its value with plain numpy and records on the tape a vector-Jacobian
product (VJP): given ``g``, the gradient of the loss with respect to the rule's value, it
returns the gradient with respect to each input. The docstring states both formulas.
Broadcasting rules sum their gradients back to each input's shape with
:func:`unbroadcast`. No rule loops in Python over batch, tokens, heads or features.

The hot rules hand large work to their fast path in :mod:`impl.kernels.fused`, which
computes the same arithmetic with reused buffers and threads (``kernels.worthwhile``;
attention there also skips the terms its mask hides);
everything the suite and the golden cases run stays here.

Shapes: B batch, T tokens, d model width, H heads, hw head width, f feed-forward width,
V vocabulary.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from impl import kernels
from impl.kernels import fused
from impl.tape import Array, Tensor, unbroadcast

__all__ = [
    "add",
    "causal_attention",
    "gather_rows",
    "indexed_mean_nll",
    "matmul",
    "reshape",
    "rms_norm",
    "rotary",
    "rotate_pairs",
    "sigmoid",
    "swiglu",
    "transpose",
    "unbroadcast",
]

IndexArray = npt.NDArray[np.intp]


def add(a: Tensor, b: Tensor) -> Tensor:
    """``a + b`` with broadcasting.  VJP: ``(g, g)``, each summed to its input's shape."""
    size = max(a.value.size, b.value.size)
    if kernels.worthwhile(size, size):
        return fused.add(a, b)

    def vjp(g: Array) -> tuple[Array, Array]:
        return unbroadcast(g, a.shape), unbroadcast(g, b.shape)

    return Tensor.from_operation(a.value + b.value, (a, b), vjp, "add")


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` over the last two axes, leading axes broadcast.

    VJP: ``da = g b^T``, ``db = a^T g``, each summed to its input's shape. A shared 2-D
    weight ``[n, m]`` (every projection, the tied head) multiplies all rows of ``a`` at once,
    ``[..., n] -> [rows, n]``, and its gradient is one product over those rows.
    """
    if a.value.ndim < 2 or b.value.ndim < 2:
        raise ValueError(f"matmul needs rank >= 2 operands, got {list(a.shape)} @ {list(b.shape)}")
    if b.value.ndim != 2:
        value = a.value @ b.value

        def batched_vjp(g: Array) -> tuple[Array, Array]:
            grad_a = unbroadcast(g @ np.swapaxes(b.value, -1, -2), a.shape)
            return grad_a, unbroadcast(np.swapaxes(a.value, -1, -2) @ g, b.shape)

        return Tensor.from_operation(value, (a, b), batched_vjp, "matmul")
    inner, outer = b.shape
    if kernels.worthwhile(a.value.size // inner * outer, a.value.size * outer):
        return fused.matmul(a, b)
    rows = a.value.reshape(-1, inner)

    def vjp(g: Array) -> tuple[Array, Array]:
        upstream = g.reshape(-1, outer)
        return (upstream @ b.value.T).reshape(a.shape), rows.T @ upstream

    return Tensor.from_operation(
        (rows @ b.value).reshape(*a.shape[:-1], outer), (a, b), vjp, "matmul"
    )


def transpose(a: Tensor, axis1: int, axis2: int) -> Tensor:
    """Swap two axes.  VJP: swap them back."""

    def vjp(g: Array) -> tuple[Array]:
        return (np.swapaxes(g, axis1, axis2),)

    return Tensor.from_operation(np.swapaxes(a.value, axis1, axis2), (a,), vjp, "transpose")


def reshape(a: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The same values in a new shape.  VJP: ``g`` in the input's shape."""
    if kernels.worthwhile(a.value.size):
        return fused.reshape(a, shape)

    def vjp(g: Array) -> tuple[Array]:
        return (g.reshape(a.shape),)

    return Tensor.from_operation(a.value.reshape(shape), (a,), vjp, "reshape")


def gather_rows(table: Tensor, ids: IndexArray) -> Tensor:
    """The lookup ``table[ids]``: one row of the ``[V, d]`` table per ID, ``[..., d]``.

    VJP: ``d table[v] = sum of g over the positions whose ID is v`` (repeated IDs add up).
    ``ids`` must already be in range.
    """
    width = table.shape[1]
    if kernels.worthwhile(ids.size * width):
        return fused.gather_rows(table, ids)

    def vjp(g: Array) -> tuple[Array]:
        grad = np.zeros(table.shape)
        np.add.at(grad, ids.reshape(-1), g.reshape(-1, width))
        return (grad,)

    return Tensor.from_operation(np.take(table.value, ids, axis=0), (table,), vjp, "gather_rows")


def rotate_pairs(values: Array, cos: Array, sin: Array) -> Array:
    """``(a, b) -> (a cos - b sin, a sin + b cos)`` on the interleaved feature pairs
    (2j, 2j+1) of the last axis; ``-sin`` rotates back."""
    first, second = values[..., 0::2], values[..., 1::2]
    rotated = np.empty_like(values)
    rotated[..., 0::2] = first * cos - second * sin
    rotated[..., 1::2] = first * sin + second * cos
    return rotated


def rotary(x: Tensor, cos: Array, sin: Array) -> Tensor:
    """RoPE: rotate the interleaved pairs (2j, 2j+1) of ``x [..., T, hw]`` by the angles
    whose cosines and sines ``cos``, ``sin`` are ``[T, hw/2]``.

    VJP: a rotation's transpose is the rotation by the opposite angle, so
    ``dx = rotate_pairs(g, cos, -sin)``. Interleaved neighbours, not the "rotate half"
    layout some libraries use (RECIPE.md, RoPE).
    """
    if kernels.worthwhile(x.value.size):
        return fused.rotary(x, cos, sin)

    def vjp(g: Array) -> tuple[Array]:
        return (rotate_pairs(g, cos, -sin),)

    return Tensor.from_operation(rotate_pairs(x.value, cos, sin), (x,), vjp, "rotary")


def rms_norm(x: Tensor, gain: Tensor, epsilon: float) -> Tensor:
    """RMSNorm over the last axis of width ``n``: ``y = x r gain`` with
    ``r = exp(-0.5 log(mean(x^2) + eps))`` per row (the recipe's log/exp form of
    ``1 / sqrt``; the two differ in the last bit, and the seed's numbers use this one).

    VJP: with ``u = g gain``, ``dx = u r - x (sum(u x) r^3 / n)`` per row, and
    ``dgain = sum over rows of g x r``.
    """
    if kernels.worthwhile(x.value.size):
        return fused.rms_norm(x, gain, epsilon)
    width = x.shape[-1]
    mean_square = (x.value * x.value).mean(axis=-1, keepdims=True)
    inverse_root = np.exp(-0.5 * np.log(mean_square + epsilon))
    normalized = x.value * inverse_root

    def vjp(g: Array) -> tuple[Array, Array]:
        scaled = g * gain.value
        projection = (scaled * x.value).sum(axis=-1, keepdims=True) * (inverse_root**3 / width)
        grad_x = scaled * inverse_root - x.value * projection
        return grad_x, (g * normalized).reshape(-1, width).sum(axis=0)

    return Tensor.from_operation(normalized * gain.value, (x, gain), vjp, "rms_norm")


def sigmoid(u: Array) -> Array:
    """``1 / (1 + exp(-u))``, to a few roundings relative to the value in both tails.

    Below ``u = -709.78`` ``exp(-u)`` overflows to ``inf`` and the result is 0, where the
    true value is under 1e-308 (overflow and underflow are not reported). Not
    ``(tanh(u / 2) + 1) / 2``: that cancels for negative ``u`` (relative error 9e-9 at
    ``u = -20``, all of it below -37), and ``tanh`` costs 2.4 times ``exp`` here (15 against
    6.3 ns an element).
    """
    with np.errstate(over="ignore", under="ignore"):
        result: Array = 1.0 / (1.0 + np.exp(-u))
    return result


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's hidden activation ``silu(gate) * up``, ``silu(u) = u s`` with ``s = sigmoid(u)``.

    VJP: ``d gate = g up s (1 + u (1 - s))`` (the derivative of SiLU), ``d up = g silu(gate)``.
    """
    if kernels.worthwhile(gate.value.size):
        return fused.swiglu(gate, up)
    sigmoids = sigmoid(gate.value)
    activated = gate.value * sigmoids

    def vjp(g: Array) -> tuple[Array, Array]:
        grad_gate = ((1.0 - sigmoids) * gate.value + 1.0) * sigmoids * up.value * g
        return grad_gate, g * activated

    return Tensor.from_operation(activated * up.value, (gate, up), vjp, "swiglu")


def causal_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """``out = w v`` with ``w = softmax(q k^T / sqrt(hw))`` over the key axis, every key
    after its query masked out (``-inf``, so its weight is exactly 0), for ``[B, H, T, hw]``.
    The softmax subtracts each row's maximum first.

    VJP: with ``dw = g v^T`` and ``ds = w (dw - sum(dw w))`` per row, divided by
    ``sqrt(hw)``: ``dq = ds k``, ``dk = ds^T q``, ``dv = w^T g``.
    """
    *leading, tokens, head_width = query.shape
    if kernels.worthwhile(math.prod(leading) * tokens * tokens):
        return fused.causal_attention(query, key, value)
    future = np.triu(np.ones((tokens, tokens), dtype=bool), k=1)
    scores = query.value @ np.swapaxes(key.value, -1, -2) / math.sqrt(head_width)
    masked = np.where(future, -np.inf, scores)
    exponentials = np.exp(masked - masked.max(axis=-1, keepdims=True))
    weights = exponentials / exponentials.sum(axis=-1, keepdims=True)

    def vjp(g: Array) -> tuple[Array, Array, Array]:
        weight_gradient = g @ np.swapaxes(value.value, -1, -2)
        total = (weight_gradient * weights).sum(axis=-1, keepdims=True)
        scores_gradient = (weight_gradient - total) * weights / math.sqrt(head_width)
        return (
            scores_gradient @ key.value,
            np.swapaxes(scores_gradient, -1, -2) @ query.value,
            np.swapaxes(weights, -1, -2) @ g,
        )

    return Tensor.from_operation(
        weights @ value.value, (query, key, value), vjp, "causal_attention"
    )


def indexed_mean_nll(logits: Tensor, targets: IndexArray) -> Tensor:
    """The loss: the mean over all rows of ``-log softmax(logits[row])[target]``, written
    ``max + log(sum(exp(row - max))) - row[target]``; ``targets`` flat and in range.

    VJP: ``d logits[row] = (softmax(row) - onehot(target)) g / rows``.
    """
    vocabulary = logits.shape[-1]
    if kernels.worthwhile(logits.value.size):
        return fused.indexed_mean_nll(logits, targets)
    rows = logits.value.reshape(-1, vocabulary)
    count = rows.shape[0]
    row_max = rows.max(axis=-1, keepdims=True)
    exponentials = np.exp(rows - row_max)
    totals = exponentials.sum(axis=-1, keepdims=True)
    log_sum_exp = (row_max + np.log(totals))[:, 0]
    value = np.asarray(np.mean(log_sum_exp - rows[np.arange(count), targets]), dtype=np.float64)

    def vjp(g: Array) -> tuple[Array]:
        grad = exponentials / totals
        grad[np.arange(count), targets] -= 1.0
        grad *= g / count
        return (grad.reshape(logits.shape),)

    return Tensor.from_operation(value, (logits,), vjp, "indexed_mean_nll")
