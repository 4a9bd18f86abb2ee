"""Small derivative rules and a composed attention, for mutants that change one step.

The reference fuses RMSNorm, SwiGLU and attention into single rules; a mutant that gets one
step of them wrong builds that layer again from the pieces here (each a value and a VJP on
the public :class:`impl.tape.Tensor`), changing only the step it is about.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from impl import ops
from impl.layers import CausalSelfAttention
from impl.tape import Array, Tensor, unbroadcast

__all__ = [
    "ComposedAttention",
    "divide",
    "exp",
    "future_mask",
    "log",
    "masked_softmax",
    "mean",
    "mul",
    "scale",
    "shift",
    "silu",
    "softmax_gradient",
    "softmax_of",
    "weights_without_maximum",
]


def mul(a: Tensor, b: Tensor) -> Tensor:
    """``a * b`` with broadcasting.  VJP: ``(g b, g a)``, each summed to its input's shape."""

    def vjp(g: Array) -> tuple[Array, Array]:
        return unbroadcast(g * b.value, a.shape), unbroadcast(g * a.value, b.shape)

    return Tensor.from_operation(a.value * b.value, (a, b), vjp, "mul")


def mean(a: Tensor, axis: int) -> Tensor:
    """Mean over one axis, kept as a size-1 axis.  VJP: ``g / n`` spread over the axis."""
    size = a.shape[axis]

    def vjp(g: Array) -> tuple[Array]:
        return (np.broadcast_to(g / size, a.shape),)

    return Tensor.from_operation(a.value.mean(axis=axis, keepdims=True), (a,), vjp, "mean")


def log(a: Tensor) -> Tensor:
    """Natural logarithm.  VJP: ``g / a``."""

    def vjp(g: Array) -> tuple[Array]:
        return (g / a.value,)

    return Tensor.from_operation(np.log(a.value), (a,), vjp, "log")


def exp(a: Tensor) -> Tensor:
    """Exponential.  VJP: ``g exp(a)``."""
    value = np.exp(a.value)

    def vjp(g: Array) -> tuple[Array]:
        return (g * value,)

    return Tensor.from_operation(value, (a,), vjp, "exp")


def scale(a: Tensor, factor: float) -> Tensor:
    """``a * factor`` for a plain number.  VJP: ``g factor``."""
    return Tensor.from_operation(a.value * factor, (a,), lambda g: (g * factor,), "scale")


def divide(a: Tensor, divisor: float) -> Tensor:
    """``a / divisor`` for a plain number.  VJP: ``g / divisor``."""
    return Tensor.from_operation(a.value / divisor, (a,), lambda g: (g / divisor,), "divide")


def shift(a: Tensor, constant: float) -> Tensor:
    """``a + constant`` for a plain number.  VJP: ``g``."""
    return Tensor.from_operation(a.value + constant, (a,), lambda g: (g,), "shift")


def silu(a: Tensor) -> Tensor:
    """``u sigmoid(u)``.  VJP: ``g s (1 + u (1 - s))`` with ``s = sigmoid(u)``."""
    sigmoids = ops.sigmoid(a.value)

    def vjp(g: Array) -> tuple[Array]:
        return (g * (sigmoids * (1.0 + a.value * (1.0 - sigmoids))),)

    return Tensor.from_operation(a.value * sigmoids, (a,), vjp, "silu")


def future_mask(length: int, diagonal: int = 1) -> npt.NDArray[np.bool_]:
    """``[T, T]``: True where the key comes ``diagonal`` or more positions after the query."""
    return np.triu(np.ones((length, length), dtype=bool), k=diagonal)


def masked_softmax(scores: Tensor, blocked: npt.NDArray[np.bool_], fill: float) -> Tensor:
    """Softmax over the last axis after setting the ``blocked`` scores to ``fill``.

    VJP: ``w (g - sum(g w))`` per row, zero at the blocked scores (they are constants).
    """
    filled = np.where(blocked, fill, scores.value)
    shifted = np.exp(filled - filled.max(axis=-1, keepdims=True))
    return softmax_of(scores, shifted / shifted.sum(axis=-1, keepdims=True), blocked)


def softmax_of(
    scores: Tensor, weights: npt.NDArray[np.float64], blocked: npt.NDArray[np.bool_]
) -> Tensor:
    """The softmax rule's node over ``scores`` with ``weights`` computed however a mutant
    computes them.  VJP: :func:`softmax_gradient`."""
    return Tensor.from_operation(
        weights, (scores,), lambda g: (softmax_gradient(weights, blocked, g),), "masked_softmax"
    )


def softmax_gradient(weights: Array, blocked: npt.NDArray[np.bool_], g: Array) -> Array:
    """The softmax's VJP: ``w (g - sum(g w))`` per row, zero at the ``blocked`` scores."""
    result: Array = np.where(
        blocked, 0.0, weights * (g - (g * weights).sum(axis=-1, keepdims=True))
    )
    return result


def weights_without_maximum(scores: Array, blocked: npt.NDArray[np.bool_]) -> Array:
    """``exp(s) / sum(exp(s))`` over the keys not ``blocked``, without subtracting the row
    maximum first: exact until exp overflows (inf / inf) or a whole row underflows (0 / 0)."""
    with np.errstate(over="ignore", invalid="ignore"):
        powers = np.where(blocked, 0.0, np.exp(scores))
        weights: Array = powers / powers.sum(axis=-1, keepdims=True)
    return weights


class ComposedAttention(CausalSelfAttention):
    """Attention from separate score, softmax and product rules: the reference's arithmetic
    in steps, for a mutant to override :meth:`scores` or :meth:`weights`."""

    def scores(self, query: Tensor, key: Tensor) -> Tensor:
        """``q k^T / sqrt(hw)``, ``[B, H, T, T]``."""
        return divide(ops.matmul(query, ops.transpose(key, 2, 3)), math.sqrt(query.shape[-1]))

    def weights(self, scores: Tensor) -> Tensor:
        """Softmax over keys, each query seeing only itself and earlier positions."""
        return masked_softmax(scores, future_mask(scores.shape[-1]), -math.inf)

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """``weights(scores(q, k)) v``."""
        return ops.matmul(self.weights(self.scores(query, key)), value)
