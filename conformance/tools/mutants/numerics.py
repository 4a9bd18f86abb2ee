"""Mutants in the forward numerics: masks, RoPE, attention, RMSNorm, SwiGLU, residuals."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from conformance.mutants.base import MutantBackend, model_with
from impl import ops
from impl.layers import CausalSelfAttention, DecoderBlock, RMSNorm, RotaryEmbedding, SwiGLU
from impl.tape import Array, Tensor


def _masked_softmax(scores: Tensor, blocked: npt.NDArray[np.bool_], fill: float) -> Tensor:
    """Softmax over keys after setting the ``blocked`` scores to ``fill``."""
    filled = np.where(blocked, fill, scores.value)
    shifted = np.exp(filled - filled.max(axis=-1, keepdims=True))
    weights = shifted / shifted.sum(axis=-1, keepdims=True)

    def vjp(g: Array) -> tuple[Array]:
        # Blocked scores are constants: no gradient flows back through them.
        return (np.where(blocked, 0.0, weights * (g - (g * weights).sum(axis=-1, keepdims=True))),)

    return Tensor.from_operation(weights, (scores,), vjp, "masked_softmax")


def _elementwise(x: Tensor, value: Array, derivative: Array) -> Tensor:
    """A pointwise function of ``x`` given its values and its derivative."""
    return Tensor.from_operation(value, (x,), lambda g: (g * derivative,), "elementwise")


def _future(length: int, diagonal: int) -> npt.NDArray[np.bool_]:
    return np.triu(np.ones((length, length), dtype=bool), k=diagonal)


class _SeesNextToken(CausalSelfAttention):
    _attend = CausalSelfAttention._attend_composed

    def _weights(self, scores: Tensor) -> Tensor:
        length = scores.shape[-1]
        return _masked_softmax(scores, _future(length, 2), -math.inf)


class MaskSeesNextToken(MutantBackend):
    """The causal mask starts one diagonal too late: position t also sees t + 1.

    Rule: CAUSAL-PREFIX-BITWISE.
    """

    name = "mask-sees-next-token"
    model_class = model_with("SeesNextToken", attention_class=_SeesNextToken)


class _FiniteMask(CausalSelfAttention):
    _attend = CausalSelfAttention._attend_composed

    def _weights(self, scores: Tensor) -> Tensor:
        length = scores.shape[-1]
        return _masked_softmax(scores, _future(length, 1), -30.0)


class MaskWithFiniteFill(MutantBackend):
    """Future scores are set to -30 instead of minus infinity: a leak of about e^-30.

    A subtle mask error: every value moves by ~1e-13, far below any value tolerance, but the
    earlier rows are no longer bitwise unchanged. Rule: CAUSAL-PREFIX-BITWISE.
    """

    name = "mask-with-finite-fill"
    model_class = model_with("FiniteMask", attention_class=_FiniteMask)


class _KeysOneAhead(CausalSelfAttention):
    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        query = self.rope.forward(self._split_heads(self.query.forward(x)), offset)
        key = self.rope.forward(self._split_heads(self.key.forward(x)), offset + 1)  # the slip
        value = self._split_heads(self.value.forward(x))
        return self.output.forward(self._merge_heads(self._attend(query, key, value)))


class RopeKeysOneAhead(MutantBackend):
    """Keys are rotated for position t + 1, queries for t.

    (Shifting both by the same amount would change nothing: RoPE sees only the difference.)
    Rule: VALUE-STAGES.
    """

    name = "rope-keys-one-ahead"
    model_class = model_with("KeysOneAhead", attention_class=_KeysOneAhead)


class _RotateHalf(RotaryEmbedding):
    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        width = x.shape[-1]
        half = width // 2
        # Put feature j beside feature j + hw/2, rotate neighbours, and put them back.
        order = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
        gather = Tensor(np.eye(width)[:, order])
        rotated = super().forward(ops.matmul(x, gather), offset)
        return ops.matmul(rotated, ops.transpose(gather, 0, 1))


class RopeRotateHalfPairs(MutantBackend):
    """RoPE pairs feature j with j + hw/2 ("rotate half") instead of 2j with 2j + 1.

    Rule: VALUE-STAGES.
    """

    name = "rope-rotate-half-pairs"
    model_class = model_with("RotateHalf", rope_class=_RotateHalf)


class _HalfFrequencies(RotaryEmbedding):
    def __init__(self, head_width: int, context: int, base: float) -> None:
        super().__init__(head_width, context, base)
        self.inverse_frequency = base ** (-1.0 * np.arange(head_width // 2) / head_width)


class RopeFrequencyExponentHalved(MutantBackend):
    """RoPE frequencies ``base^(-j/hw)`` instead of ``base^(-2j/hw)``. Rule: VALUE-STAGES."""

    name = "rope-frequency-exponent-halved"
    model_class = model_with("HalfFrequencies", rope_class=_HalfFrequencies)


class _Float32Frequencies(RotaryEmbedding):
    def __init__(self, head_width: int, context: int, base: float) -> None:
        super().__init__(head_width, context, base)
        self.inverse_frequency = self.inverse_frequency.astype(np.float32).astype(np.float64)


class RopeFrequenciesInFloat32(MutantBackend):
    """RoPE frequencies rounded to float32: relative errors near 1e-7 (a tiny effect).

    Rule: VALUE-STAGES.
    """

    name = "rope-frequencies-in-float32"
    model_class = model_with("Float32Frequencies", rope_class=_Float32Frequencies)


class _RopeOnValues(CausalSelfAttention):
    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        query = self.rope.forward(self._split_heads(self.query.forward(x)), offset)
        key = self.rope.forward(self._split_heads(self.key.forward(x)), offset)
        value = self.rope.forward(self._split_heads(self.value.forward(x)), offset)  # the mistake
        return self.output.forward(self._merge_heads(self._attend(query, key, value)))


class RopeOnValues(MutantBackend):
    """RoPE rotates the values as well as queries and keys. Rule: VALUE-STAGES."""

    name = "rope-on-values"
    model_class = model_with("RopeOnValuesModel", attention_class=_RopeOnValues)


class _ScaledByModelWidth(CausalSelfAttention):
    _attend = CausalSelfAttention._attend_composed

    def _scores(self, query: Tensor, key: Tensor) -> Tensor:
        width = query.shape[-1] * self.heads
        return ops.divide(ops.matmul(query, ops.transpose(key, 2, 3)), math.sqrt(width))


class AttentionScaledByModelWidth(MutantBackend):
    """Scores divided by sqrt(d) instead of sqrt(head width). Rule: VALUE-STAGES."""

    name = "attention-scaled-by-model-width"
    model_class = model_with("ScaledByModelWidth", attention_class=_ScaledByModelWidth)


class _HeadsInterleaved(CausalSelfAttention):
    def _split_heads(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        per_head = ops.reshape(x, (batch, tokens, width // self.heads, self.heads))  # (B,T,hw,H)
        return ops.transpose(ops.transpose(per_head, 2, 3), 1, 2)

    def _merge_heads(self, x: Tensor) -> Tensor:
        batch, heads, tokens, head_width = x.shape
        back = ops.transpose(ops.transpose(x, 1, 2), 2, 3)  # (B, T, hw, H)
        return ops.reshape(back, (batch, tokens, heads * head_width))


class HeadsStrided(MutantBackend):
    """Head h takes features h, h + H, h + 2H, ... instead of a contiguous slice.

    Rule: VALUE-STAGES.
    """

    name = "heads-strided"
    model_class = model_with("HeadsStrided", attention_class=_HeadsInterleaved)


class _EpsilonOutsideRoot(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        root = ops.exp(ops.scale(ops.log(ops.mean(ops.mul(x, x), axis=-1)), 0.5))
        inverse = ops.exp(ops.scale(ops.log(ops.add_constant(root, self.epsilon)), -1.0))
        return ops.mul(ops.mul(x, inverse), self.gain.tensor)


class RmsEpsilonOutsideRoot(MutantBackend):
    """``x / (sqrt(mean(x^2)) + eps)`` instead of ``x / sqrt(mean(x^2) + eps)``.

    With eps = 1e-6 the values move by about 1e-6 relative: a tiny effect. Rule: VALUE-STAGES.
    """

    name = "rms-epsilon-outside-root"
    model_class = model_with("EpsilonOutsideRoot", norm_class=_EpsilonOutsideRoot)


class _NormOverTokens(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        mean_square = ops.mean(ops.mul(x, x), axis=-2)  # over positions, not features
        inverse = ops.exp(ops.scale(ops.log(ops.add_constant(mean_square, self.epsilon)), -0.5))
        return ops.mul(ops.mul(x, inverse), self.gain.tensor)


class RmsOverTokenAxis(MutantBackend):
    """RMSNorm's mean runs over token positions instead of features.

    Rules: CAUSAL-PREFIX-BITWISE (a later token changes earlier rows), VALUE-STAGES.
    """

    name = "rms-over-token-axis"
    model_class = model_with("NormOverTokens", norm_class=_NormOverTokens)


class _SigmoidGate(SwiGLU):
    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate.forward(x)
        sigmoid = 1.0 / (1.0 + np.exp(-np.clip(gate.value, -700, 700)))
        activated = _elementwise(gate, sigmoid, sigmoid * (1.0 - sigmoid))
        return self.down.forward(ops.mul(activated, self.up.forward(x)))


class GateSigmoidNotSilu(MutantBackend):
    """The gate uses sigmoid(u) instead of silu(u) = u sigmoid(u). Rule: VALUE-STAGES."""

    name = "gate-sigmoid-not-silu"
    model_class = model_with("SigmoidGate", feed_forward_class=_SigmoidGate)


class _SiluOnUp(SwiGLU):
    def forward(self, x: Tensor) -> Tensor:
        return self.down.forward(ops.mul(self.gate.forward(x), ops.silu(self.up.forward(x))))


class SiluOnUpBranch(MutantBackend):
    """SiLU applied to the up branch instead of the gate. Rule: VALUE-STAGES."""

    name = "silu-on-up-branch"
    model_class = model_with("SiluOnUp", feed_forward_class=_SiluOnUp)


class _PostNorm(DecoderBlock):
    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        hidden = self.attention_norm.forward(ops.add(x, self.attention.forward(x, offset)))
        return self.ffn_norm.forward(ops.add(hidden, self.ffn.forward(hidden)))


class PostNormBlocks(MutantBackend):
    """Blocks normalize after the residual add (post-norm) instead of before. Rule: VALUE-STAGES."""

    name = "post-norm-blocks"
    model_class = model_with("PostNorm", block_class=_PostNorm)


class _NoFeedForwardResidual(DecoderBlock):
    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        hidden = ops.add(x, self.attention.forward(self.attention_norm.forward(x), offset))
        return self.ffn.forward(self.ffn_norm.forward(hidden))  # the residual is dropped


class FeedForwardResidualDropped(MutantBackend):
    """The feed-forward branch replaces the residual stream instead of adding to it.

    Rule: VALUE-STAGES.
    """

    name = "feed-forward-residual-dropped"
    model_class = model_with("NoFeedForwardResidual", block_class=_NoFeedForwardResidual)


class _GainOnlyNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        return ops.mul(x, self.gain.tensor)


class NormWithoutNormalization(MutantBackend):
    """Every RMSNorm only multiplies by its gain (no 1/rms).

    Rules: DEPTH-ZERO-FORMULA, VALUE-STAGES.
    """

    name = "norm-without-normalization"
    model_class = model_with("GainOnlyNorm", norm_class=_GainOnlyNorm)
