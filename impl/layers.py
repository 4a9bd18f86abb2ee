"""The decoder's layers, in dependency order, each owning its named parameters.

Shapes use B (batch), T (tokens), d (model width), H (heads), hw (head width),
f (feed-forward width) and V (vocabulary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from impl import ops
from impl.errors import BlockFailure, DecoderModelError, RmsZeroMeanSquare, TokenIdOutOfBounds
from impl.tape import Array, Tensor

__all__ = [
    "CausalSelfAttention",
    "DecoderBlock",
    "Embedding",
    "Linear",
    "NamedParameter",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "first_out_of_range",
]

IndexArray = npt.NDArray[np.intp]


@dataclass(frozen=True)
class NamedParameter:
    """A trainable leaf and its stable name."""

    name: str
    tensor: Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The leaf's shape."""
        return self.tensor.shape


def first_out_of_range(ids: npt.NDArray[Any], vocabulary_size: int) -> int | None:
    """Flat position of the first ID outside ``[0, vocabulary_size)``, or None."""
    flat = ids.reshape(-1)
    outside = np.flatnonzero((flat < 0) | (flat >= vocabulary_size))
    return int(outside[0]) if outside.size else None


class Embedding:
    """Token lookup: ``E[z]`` gathers one row of the ``[V, d]`` table per token ID."""

    def __init__(self, weight: NamedParameter) -> None:
        self.weight = weight

    @property
    def vocabulary_size(self) -> int:
        """Rows of the table."""
        return self.weight.shape[0]

    def forward(self, ids: IndexArray) -> Tensor:
        """``[B, T]`` IDs to ``[B, T, d]`` rows; refuses an ID outside ``[0, V)``."""
        position = first_out_of_range(ids, self.vocabulary_size)
        if position is not None:
            raise TokenIdOutOfBounds(
                position=position,
                id=int(ids.reshape(-1)[position]),
                vocabulary_size=self.vocabulary_size,
            )
        return ops.gather_rows(self.weight.tensor, ids)


class Linear:
    """Bias-free ``y = x @ W`` with ``W`` stored ``[in, out]``."""

    def __init__(self, weight: NamedParameter) -> None:
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        """``[..., in]`` to ``[..., out]``."""
        return ops.matmul(x, self.weight.tensor)


class RMSNorm:
    """``x * exp(-0.5 log(mean(x^2) + eps)) * gain`` over the last axis.

    The log/exp form of the inverse root is the recipe's, not ``1 / sqrt``: the two
    differ in the last bit, and the published trace was computed with this one.
    """

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
    """RoPE on interleaved feature pairs, with cos/sin tables cached per position.

    Tables grow on demand up to the longest sequence seen, so a huge context capacity
    costs nothing until it is used.
    """

    def __init__(self, head_width: int, context: int, base: float) -> None:
        self.head_width = head_width
        self.context = context
        self.base = base
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

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """Rotate ``[..., T, hw]`` features at positions ``offset .. offset + T - 1``."""
        end = offset + x.shape[-2]
        cos, sin = self.tables(end)
        return ops.rotary(x, cos[offset:end], sin[offset:end])


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

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        per_head = ops.reshape(x, (batch, tokens, self.heads, width // self.heads))  # (B,T,H,hw)
        return ops.transpose(per_head, 1, 2)  # (B, H, T, hw)

    def _merge_heads(self, x: Tensor) -> Tensor:
        batch, heads, tokens, head_width = x.shape
        return ops.reshape(ops.transpose(x, 1, 2), (batch, tokens, heads * head_width))  # (B,T,d)

    def _scores(self, query: Tensor, key: Tensor) -> Tensor:
        """``q k^T / sqrt(hw)``, ``[B, H, T, T]`` (the composed path)."""
        return ops.divide(ops.matmul(query, ops.transpose(key, 2, 3)), math.sqrt(query.shape[-1]))

    def _weights(self, scores: Tensor) -> Tensor:
        """Softmax over keys, each query seeing only itself and earlier positions."""
        return ops.causal_softmax(scores)

    def _attend_composed(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Attention from separate score, softmax and product nodes; the same arithmetic as
        the fused operation, kept for variants that change one step."""
        return ops.matmul(self._weights(self._scores(query, key)), value)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """``softmax(q k^T / sqrt(hw), causal) v``, ``[B, H, T, hw]``, as one fused operation."""
        return ops.causal_attention(query, key, value)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """``[B, T, d]`` to ``[B, T, d]``; position ``t`` attends to keys ``0 .. t``."""
        query = self.rope.forward(self._split_heads(self.query.forward(x)), offset)
        key = self.rope.forward(self._split_heads(self.key.forward(x)), offset)
        value = self._split_heads(self.value.forward(x))
        return self.output.forward(self._merge_heads(self._attend(query, key, value)))


class SwiGLU:
    """``down(silu(x @ W_gate) * (x @ W_up))``."""

    def __init__(self, gate: NamedParameter, up: NamedParameter, down: NamedParameter) -> None:
        self.gate = Linear(gate)
        self.up = Linear(up)
        self.down = Linear(down)

    def forward(self, x: Tensor) -> Tensor:
        """``[..., d]`` to ``[..., d]`` through a hidden width ``f``."""
        hidden = ops.swiglu_product(self.gate.forward(x), self.up.forward(x))  # (..., f)
        return self.down.forward(hidden)


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

    def parameters(self) -> list[NamedParameter]:
        """The block's nine parameters in the stable order."""
        attention = self.attention
        return [
            self.attention_norm.gain,
            attention.query.weight,
            attention.key.weight,
            attention.value.weight,
            attention.output.weight,
            self.ffn_norm.gain,
            self.ffn.gate.weight,
            self.ffn.up.weight,
            self.ffn.down.weight,
        ]

    def _normalize(self, norm: RMSNorm, x: Tensor, component: str) -> Tensor:
        try:
            return norm.forward(x)
        except DecoderModelError as error:
            raise BlockFailure(source=error, layer=self.layer, component=component) from error

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """``[B, T, d]`` to ``[B, T, d]``."""
        attended = self.attention.forward(
            self._normalize(self.attention_norm, x, "attention RMSNorm"), offset
        )
        hidden = ops.add(x, attended)
        fed = self.ffn.forward(self._normalize(self.ffn_norm, hidden, "feed-forward RMSNorm"))
        return ops.add(hidden, fed)
