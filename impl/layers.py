"""The decoder's layers, in dependency order, each holding its named parameters.

Shapes use B (batch), T (tokens), d (model width), H (heads), hw (head width),
f (feed-forward width) and V (vocabulary).

Extension points, for a variant of the model (a port under study, a deliberately broken
one): subclass a layer and override the method named here, then give the class to a
:class:`impl.model.DecoderModel` subclass (its ``norm_class``, ``rope_class``,
``attention_class``, ``feed_forward_class`` and ``block_class``).

- :meth:`RMSNorm.forward`, :meth:`SwiGLU.forward`, :meth:`DecoderBlock.forward`: the whole
  layer.
- :class:`RotaryEmbedding`: ``inverse_frequency`` (set in ``__init__``),
  :meth:`~RotaryEmbedding.tables` and :meth:`~RotaryEmbedding.forward`.
- :class:`CausalSelfAttention`: :meth:`~CausalSelfAttention.split_heads` /
  :meth:`~CausalSelfAttention.merge_heads` (the head layout), :meth:`~CausalSelfAttention.attend`
  (scores, mask, softmax and the weighted sum), or :meth:`~CausalSelfAttention.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from impl import ops
from impl.errors import BlockFailure, DecoderModelError, RmsZeroMeanSquare
from impl.tape import Array, Tensor

__all__ = [
    "CausalSelfAttention",
    "DecoderBlock",
    "Linear",
    "NamedParameter",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
]


@dataclass(frozen=True)
class NamedParameter:
    """A trainable leaf and its stable name."""

    name: str
    tensor: Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The leaf's shape."""
        return self.tensor.shape


class Linear:
    """Bias-free ``y = x @ W`` with ``W`` stored ``[in, out]``."""

    def __init__(self, weight: NamedParameter) -> None:
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        """``[..., in]`` to ``[..., out]``."""
        return ops.matmul(x, self.weight.tensor)


class RMSNorm:
    """``x * exp(-0.5 log(mean(x^2) + eps)) * gain`` over the last axis (:func:`ops.rms_norm`)."""

    def __init__(self, gain: NamedParameter, epsilon: float) -> None:
        self.gain = gain
        self.epsilon = epsilon

    def forward(self, x: Tensor) -> Tensor:
        """Normalize every row; with epsilon 0 a row whose float64 mean square is exactly 0
        (all zeros, or values so small their squares underflow) is refused, not a NaN."""
        if self.epsilon == 0.0:
            rows = x.value.reshape(-1, x.shape[-1])
            zero_rows = np.flatnonzero(np.mean(rows * rows, axis=-1) == 0.0)
            if zero_rows.size:
                raise RmsZeroMeanSquare(row=int(zero_rows[0]))
        return ops.rms_norm(x, self.gain.tensor, self.epsilon)


class RotaryEmbedding:
    """RoPE on interleaved feature pairs, positions ``0 .. T - 1``, tables cached.

    ``inverse_frequency[j] = base^(-2j / hw)``. Tables grow on demand up to the longest
    sequence seen, so a huge context capacity costs nothing until it is used.
    """

    def __init__(self, head_width: int, base: float) -> None:
        pairs = head_width // 2
        self.inverse_frequency: Array = base ** (
            -2.0 * np.arange(pairs, dtype=np.float64) / head_width
        )
        self._cos: Array = np.empty((0, pairs))
        self._sin: Array = np.empty((0, pairs))

    def tables(self, end: int) -> tuple[Array, Array]:
        """``cos`` and ``sin`` of every angle for positions ``0 .. end - 1``, ``[end, hw/2]``."""
        if end > self._cos.shape[0]:
            positions = np.arange(end, dtype=np.float64)[:, None]
            angles = positions * self.inverse_frequency  # (end, hw/2)
            self._cos, self._sin = np.cos(angles), np.sin(angles)
        return self._cos[:end], self._sin[:end]

    def forward(self, x: Tensor) -> Tensor:
        """Rotate ``[..., T, hw]`` features at positions ``0 .. T - 1``."""
        cos, sin = self.tables(x.shape[-2])
        return ops.rotary(x, cos, sin)


class CausalSelfAttention:
    """Multi-head causal self-attention with RoPE on queries and keys (never values)."""

    def __init__(
        self,
        query: NamedParameter,
        key: NamedParameter,
        value: NamedParameter,
        output: NamedParameter,
        *,
        heads: int,
        rope: RotaryEmbedding,
    ) -> None:
        self.query = Linear(query)
        self.key = Linear(key)
        self.value = Linear(value)
        self.output = Linear(output)
        self.heads = heads
        self.rope = rope

    def split_heads(self, x: Tensor) -> Tensor:
        """``[B, T, d]`` to ``[B, H, T, hw]``: head h takes the contiguous features
        ``h hw .. (h + 1) hw - 1``."""
        batch, tokens, width = x.shape
        per_head = ops.reshape(x, (batch, tokens, self.heads, width // self.heads))  # (B,T,H,hw)
        return ops.transpose(per_head, 1, 2)  # (B, H, T, hw)

    def merge_heads(self, x: Tensor) -> Tensor:
        """``[B, H, T, hw]`` back to ``[B, T, d]``."""
        batch, heads, tokens, head_width = x.shape
        return ops.reshape(ops.transpose(x, 1, 2), (batch, tokens, heads * head_width))

    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """``softmax(q k^T / sqrt(hw), causal) v``, ``[B, H, T, hw]`` (``ops.causal_attention``)."""
        return ops.causal_attention(query, key, value)

    def forward(self, x: Tensor) -> Tensor:
        """``[B, T, d]`` to ``[B, T, d]``; position ``t`` attends to keys ``0 .. t``."""
        query = self.rope.forward(self.split_heads(self.query.forward(x)))
        key = self.rope.forward(self.split_heads(self.key.forward(x)))
        value = self.split_heads(self.value.forward(x))
        return self.output.forward(self.merge_heads(self.attend(query, key, value)))


class SwiGLU:
    """``down(silu(x @ W_gate) * (x @ W_up))``."""

    def __init__(self, gate: NamedParameter, up: NamedParameter, down: NamedParameter) -> None:
        self.gate = Linear(gate)
        self.up = Linear(up)
        self.down = Linear(down)

    def forward(self, x: Tensor) -> Tensor:
        """``[..., d]`` to ``[..., d]`` through a hidden width ``f``."""
        return self.down.forward(ops.swiglu(self.gate.forward(x), self.up.forward(x)))  # (..., f)


class DecoderBlock:
    """Pre-normalized block: ``h = x + attn(norm(x))``, ``y = h + ffn(norm(h))``."""

    def __init__(
        self,
        layer: int,
        attention_norm: RMSNorm,
        attention: CausalSelfAttention,
        ffn_norm: RMSNorm,
        ffn: SwiGLU,
    ) -> None:
        self.layer = layer
        self.attention_norm = attention_norm
        self.attention = attention
        self.ffn_norm = ffn_norm
        self.ffn = ffn

    def normalize(self, norm: RMSNorm, x: Tensor, component: str) -> Tensor:
        """``norm.forward(x)``; a refusal is wrapped with this block's layer and component."""
        try:
            return norm.forward(x)
        except DecoderModelError as error:
            raise BlockFailure(source=error, layer=self.layer, component=component) from error

    def forward(self, x: Tensor) -> Tensor:
        """``[B, T, d]`` to ``[B, T, d]``."""
        attended = self.attention.forward(
            self.normalize(self.attention_norm, x, "attention RMSNorm")
        )
        hidden = ops.add(x, attended)
        fed = self.ffn.forward(self.normalize(self.ffn_norm, hidden, "feed-forward RMSNorm"))
        return ops.add(hidden, fed)
