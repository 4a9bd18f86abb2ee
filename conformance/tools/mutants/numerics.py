"""Mutants in the forward numerics: masks, RoPE, attention, RMSNorm, SwiGLU, residuals."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from conformance.adapters.emulated import EmulatedBackend
from conformance.tools.mutants import composed as c
from conformance.tools.mutants.base import MutantBackend, model_with, mutant
from impl import ops
from impl.emulation import EmulatedModel
from impl.layers import (
    CausalSelfAttention,
    DecoderBlock,
    NamedParameter,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
)
from impl.tape import Array, Tensor
from spec.formats import Precision
from spec.rules import RuleCategory


class _SeesNextToken(c.ComposedAttention):
    def weights(self, scores: Tensor) -> Tensor:
        return c.masked_softmax(scores, c.future_mask(scores.shape[-1], 2), -math.inf)


@mutant("CAUSAL-PREFIX-BITWISE")
class MaskSeesNextToken(MutantBackend):
    """The causal mask lets position t see t + 1 (it starts one diagonal too late)."""

    model_class = model_with("SeesNextToken", attention_class=_SeesNextToken)


class _HidesDiagonal(c.ComposedAttention):
    def weights(self, scores: Tensor) -> Tensor:
        return c.masked_softmax(scores, c.future_mask(scores.shape[-1], 0), -math.inf)


@mutant("CAUSAL-PREFIX-BITWISE")
class MaskHidesDiagonal(MutantBackend):
    """The causal mask hides the diagonal too: position 0 sees nothing, its row is NaN.

    Every later row is finite and still causal, so only a rule that refuses non-finite
    values can see it: a NaN compares unequal to itself and bitwise equal to its copy.
    """

    model_class = model_with("HidesDiagonal", attention_class=_HidesDiagonal)


class _FiniteMask(c.ComposedAttention):
    def weights(self, scores: Tensor) -> Tensor:
        return c.masked_softmax(scores, c.future_mask(scores.shape[-1]), -30.0)


@mutant("CAUSAL-PREFIX-BITWISE")
class MaskWithFiniteFill(MutantBackend):
    """Future scores set to -30 instead of -inf (a 1e-13 leak).

    A subtle mask error: every value moves by about e^-30, far below any value tolerance,
    but the earlier rows are no longer bitwise unchanged.
    """

    model_class = model_with("FiniteMask", attention_class=_FiniteMask)


_WINDOW = 4096  # Mistral 7B's sliding window, and Llama 2's context


def _future_or_too_old(length: int) -> npt.NDArray[np.bool_]:
    """``[T, T]``: True for the keys after a query and those _WINDOW or more positions back."""
    return c.future_mask(length) | ~c.future_mask(length, 1 - _WINDOW)


class _WindowOfKeys(c.ComposedAttention):
    def weights(self, scores: Tensor) -> Tensor:
        return c.masked_softmax(scores, _future_or_too_old(scores.shape[-1]), -math.inf)


@mutant("CAUSAL-LONG-REACH")
class AttentionSlidingWindow(MutantBackend):
    """Each position attends to the last 4096 keys only (a sliding window carried over from
    Mistral): the same as full attention on every sequence of up to 4096 tokens."""

    model_class = model_with("WindowOfKeys", attention_class=_WindowOfKeys)


class _EmulatedWindowOfKeys(EmulatedModel):
    def _hidden_keys(self, tokens: int) -> npt.NDArray[np.bool_]:
        return _future_or_too_old(tokens)


@mutant("CAUSAL-LONG-REACH")
class AttentionWindowInBfloat16(EmulatedBackend):
    """A bfloat16 backend whose positions attend to the last 4096 keys only (Mistral's window).

    Not a precision bug, and one a bound sees only where the dropped keys happen to matter:
    at 4608 positions they moved row 4607 by 0.055 of its scale, under the bfloat16 bound
    there (0.99), so only the precision-free CAUSAL-LONG-REACH failed; at 4715 positions they
    move row 4714 by 1.43, and VALUE-LONG-CONTEXT fails too.
    """

    precision = Precision.BFLOAT16
    emulation_class = _EmulatedWindowOfKeys


_PREFILL_CHUNK = 1024


def _future_outside_the_chunk(length: int) -> npt.NDArray[np.bool_]:
    """``[T, T]``: the keys after a query, except, past the first chunk, those in its own."""
    chunk = np.arange(length) // _PREFILL_CHUNK
    own_chunk = (chunk[:, None] == chunk[None, :]) & (chunk[:, None] > 0)
    hidden: npt.NDArray[np.bool_] = c.future_mask(length) & ~own_chunk
    return hidden


class _EmulatedChunkSeesAhead(EmulatedModel):
    def _hidden_keys(self, tokens: int) -> npt.NDArray[np.bool_]:
        return _future_outside_the_chunk(tokens)


@mutant("CAUSAL-PREFIX-BITWISE")
class PrefillChunkSeesAheadInBfloat16(EmulatedBackend):
    """A bfloat16 backend whose prefill in chunks of 1024 drops the mask after the first chunk.

    Code that skips the causal mask whenever its key/value cache holds keys, as if every later
    call decoded one token: past position 1024 a row sees the rest of its chunk. Every drawn
    sequence is shorter than a chunk, and at 4715 positions the leak moved no sampled row
    past the bfloat16 bound (VALUE-LONG-CONTEXT at 31% of it), so only the bitwise check on
    the long sequence sees it.
    """

    precision = Precision.BFLOAT16
    emulation_class = _EmulatedChunkSeesAhead


def _first_chunk_from_sequence_zero(x: Tensor) -> Tensor:
    """``x`` with every sequence's first chunk of positions replaced by sequence 0's."""
    value = x.value.copy()
    value[1:, :_PREFILL_CHUNK] = value[:1, :_PREFILL_CHUNK]

    def vjp(g: Array) -> tuple[Array]:
        grad = g.copy()
        grad[0, :_PREFILL_CHUNK] += g[1:, :_PREFILL_CHUNK].sum(axis=0)
        grad[1:, :_PREFILL_CHUNK] = 0.0
        return (grad,)

    return Tensor.from_operation(value, (x,), vjp, "first_chunk_from_sequence_zero")


class _CacheWithoutSequence(CausalSelfAttention):
    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] > 1 and x.shape[1] > _PREFILL_CHUNK:
            x = _first_chunk_from_sequence_zero(x)
        return super().forward(x)


@mutant("BATCH-INDEPENDENCE")
class LongBatchSharesTheFirstChunk(MutantBackend):
    """Several sequences past 1024 positions: a prefill in chunks whose cache holds sequence 0's
    first chunk for every sequence (a cache indexed by position, not by sequence)."""

    model_class = model_with("CacheWithoutSequence", attention_class=_CacheWithoutSequence)


class _OneTokenShortcut(CausalSelfAttention):
    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-2] == 1:
            return self.value.forward(x)
        return super().forward(x)


@mutant("VALUE-STAGES")
class SingleTokenSkipsOutputProjection(MutantBackend):
    """At one token, attention returns its values without the output projection.

    A decoding shortcut: the softmax over one key is 1, so the attention is the values, but
    they still go through the output projection. Right on every longer sequence.
    """

    model_class = model_with("OneTokenShortcut", attention_class=_OneTokenShortcut)


class _OneTokenEachSharesTheFirst(CausalSelfAttention):
    def forward(self, x: Tensor) -> Tensor:
        attended = super().forward(x)
        if x.shape[-2] != 1 or x.shape[0] == 1:
            return attended

        def vjp(g: Array) -> tuple[Array]:
            first = np.zeros_like(g)
            first[:1] = g.sum(axis=0, keepdims=True)
            return (first,)

        shared = np.broadcast_to(attended.value[:1], attended.shape).copy()
        return Tensor.from_operation(shared, (attended,), vjp, "first_sequence_for_all")


@mutant("VALUE-STAGES")
class BatchedSingleTokensShareTheFirstAttention(MutantBackend):
    """With several sequences of one token each, every sequence gets the first one's attention.

    A batched decoding path that reads one sequence's slot for all; right whenever a batch
    holds one sequence or sequences of two tokens or more.
    """

    model_class = model_with("OneTokenEach", attention_class=_OneTokenEachSharesTheFirst)


class _SoftmaxWithoutRowMaximum(c.ComposedAttention):
    def weights(self, scores: Tensor) -> Tensor:
        blocked = c.future_mask(scores.shape[-1])
        return c.softmax_of(scores, c.weights_without_maximum(scores.value, blocked), blocked)


@mutant("VALUE-LARGE-SCORES")
class AttentionSoftmaxWithoutRowMaximum(MutantBackend):
    """Attention weights are exp(score) / sum(exp(score)), without subtracting the row maximum.

    Exact in real arithmetic and within float64 rounding at ordinary scores; above 709 exp
    overflows (inf / inf), and a row whose scores are all below -745 is 0 / 0.
    """

    model_class = model_with("SoftmaxWithoutRowMaximum", attention_class=_SoftmaxWithoutRowMaximum)


class _MaximumOverFutureKeys(c.ComposedAttention):
    def weights(self, scores: Tensor) -> Tensor:
        blocked = c.future_mask(scores.shape[-1])
        # The slip: the maximum is taken before the mask, over keys the row never sees.
        with np.errstate(invalid="ignore"):
            powers = np.exp(scores.value - scores.value.max(axis=-1, keepdims=True))
            powers = np.where(blocked, 0.0, powers)
            return c.softmax_of(scores, powers / powers.sum(axis=-1, keepdims=True), blocked)


@mutant("VALUE-LARGE-SCORES", RuleCategory.CAUSALITY)
class AttentionMaximumOverFutureKeys(MutantBackend):
    """The softmax subtracts the row maximum taken before the causal mask, future keys included.

    Any shift is exact in real arithmetic, but a future score far above the visible ones
    underflows every visible weight to 0 (0 / 0), and the row's roundings depend on the future.
    """

    model_class = model_with("MaximumOverFutureKeys", attention_class=_MaximumOverFutureKeys)


class _KeysOneAhead(CausalSelfAttention):
    def forward(self, x: Tensor) -> Tensor:
        query = self.rope.forward(self.split_heads(self.query.forward(x)))
        key = self.split_heads(self.key.forward(x))
        cos, sin = self.rope.tables(key.shape[-2] + 1)
        key = ops.rotary(key, cos[1:], sin[1:])  # the slip: keys rotated for t + 1
        value = self.split_heads(self.value.forward(x))
        return self.output.forward(self.merge_heads(self.attend(query, key, value)))


@mutant("VALUE-STAGES")
class RopeKeysOneAhead(MutantBackend):
    """Keys rotated one position ahead of queries.

    (Shifting both by the same amount would change nothing: RoPE sees only the difference.)
    """

    model_class = model_with("KeysOneAhead", attention_class=_KeysOneAhead)


class _RotateHalf(RotaryEmbedding):
    def forward(self, x: Tensor) -> Tensor:
        width = x.shape[-1]
        half = width // 2
        # Put feature j beside feature j + hw/2, rotate neighbours, and put them back.
        order = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
        gather = Tensor(np.eye(width)[:, order])
        rotated = super().forward(ops.matmul(x, gather))
        return ops.matmul(rotated, ops.transpose(gather, 0, 1))


@mutant("VALUE-STAGES")
class RopeRotateHalfPairs(MutantBackend):
    """RoPE pairs features j and j + hw/2 ("rotate half") instead of 2j and 2j + 1."""

    model_class = model_with("RotateHalf", rope_class=_RotateHalf)


class _HalfFrequencies(RotaryEmbedding):
    def __init__(self, head_width: int, base: float) -> None:
        super().__init__(head_width, base)
        self.inverse_frequency = base ** (-1.0 * np.arange(head_width // 2) / head_width)


@mutant("VALUE-STAGES")
class RopeFrequencyExponentHalved(MutantBackend):
    """RoPE frequencies base^(-j/hw) instead of base^(-2j/hw)."""

    model_class = model_with("HalfFrequencies", rope_class=_HalfFrequencies)


class _Float32Frequencies(RotaryEmbedding):
    def __init__(self, head_width: int, base: float) -> None:
        super().__init__(head_width, base)
        self.inverse_frequency = self.inverse_frequency.astype(np.float32).astype(np.float64)


@mutant("VALUE-STAGES")
class RopeFrequenciesInFloat32(MutantBackend):
    """RoPE frequencies rounded to float32 (about 1e-7)."""

    model_class = model_with("Float32Frequencies", rope_class=_Float32Frequencies)


class _RotaryOfSixtyFourFeatures(RotaryEmbedding):
    def __init__(self, head_width: int, base: float) -> None:
        super().__init__(head_width, base)
        self.inverse_frequency[32:] = 0.0  # angle 0 past the 32nd pair: left as it is


@mutant("VALUE-WIDE-HEADS")
class RopeRotatesAtMostSixtyFourFeatures(MutantBackend):
    """RoPE rotates only the first 64 features of a head, as a rotary width carried over from
    a model with heads of 64 does; every generated head is at most 8 wide."""

    model_class = model_with("RotaryOfSixtyFourFeatures", rope_class=_RotaryOfSixtyFourFeatures)


# A vectorized loop's group: lanes of features, or RoPE pairs, handled a group at a time.
_GROUP = 32
_PAIR_GROUP = 16


class _PairsInWholeGroups(RotaryEmbedding):
    def __init__(self, head_width: int, base: float) -> None:
        super().__init__(head_width, base)
        pairs = head_width // 2
        if pairs > _PAIR_GROUP:
            # angle 0 for the pairs past the last whole group: left as they are
            self.inverse_frequency[_PAIR_GROUP * (pairs // _PAIR_GROUP) :] = 0.0


@mutant("VALUE-ODD-WIDTHS")
class RopeSkipsTheLastPartialGroupOfPairs(MutantBackend):
    """RoPE rotates pairs in groups of 16 and leaves a last, partial group as it is (heads
    wider than 32); every generated head has at most 4 pairs, the wide heads 64."""

    model_class = model_with("PairsInWholeGroups", rope_class=_PairsInWholeGroups)


class _SquaresInWholeLanes(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        width = x.shape[-1]
        if width <= _GROUP:  # narrow rows take the plain loop
            return super().forward(x)
        summed = np.zeros(width)
        summed[: _GROUP * (width // _GROUP)] = 1.0  # the remainder's squares never added
        mean_square = c.mean(c.mul(c.mul(x, Tensor(summed)), x), axis=-1)
        inverse = c.exp(c.scale(c.log(c.shift(mean_square, self.epsilon)), -0.5))
        return c.mul(c.mul(x, inverse), self.gain.tensor)


@mutant("VALUE-ODD-WIDTHS")
class RmsNormSumsWholeLanesOnly(MutantBackend):
    """RMSNorm sums its squares in lanes of 32 and drops the last, partial group (rows wider
    than 32); every generated row is at most 32 wide, the wide heads' 256."""

    model_class = model_with("SquaresInWholeLanes", norm_class=_SquaresInWholeLanes)


class _RopeOnValues(CausalSelfAttention):
    def forward(self, x: Tensor) -> Tensor:
        query = self.rope.forward(self.split_heads(self.query.forward(x)))
        key = self.rope.forward(self.split_heads(self.key.forward(x)))
        value = self.rope.forward(self.split_heads(self.value.forward(x)))  # the mistake
        return self.output.forward(self.merge_heads(self.attend(query, key, value)))


@mutant("VALUE-STAGES")
class RopeOnValues(MutantBackend):
    """RoPE applied to the values too, as well as to queries and keys."""

    model_class = model_with("RopeOnValuesModel", attention_class=_RopeOnValues)


class _EpsilonOutsideRoot(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        root = c.exp(c.scale(c.log(c.mean(c.mul(x, x), axis=-1)), 0.5))
        inverse = c.exp(c.scale(c.log(c.shift(root, self.epsilon)), -1.0))
        return c.mul(c.mul(x, inverse), self.gain.tensor)


@mutant("VALUE-STAGES", RuleCategory.DEPTH)
class RmsEpsilonOutsideRoot(MutantBackend):
    """RMSNorm's epsilon added outside the square root (about 1e-6).

    ``x / (sqrt(mean(x^2)) + eps)`` instead of ``x / sqrt(mean(x^2) + eps)``: with
    eps = 1e-6 the values move by about 1e-6 relative, a tiny effect.
    """

    model_class = model_with("EpsilonOutsideRoot", norm_class=_EpsilonOutsideRoot)


class _NormOverTokens(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        mean_square = c.mean(c.mul(x, x), axis=-2)  # over positions, not features
        inverse = c.exp(c.scale(c.log(c.shift(mean_square, self.epsilon)), -0.5))
        return c.mul(c.mul(x, inverse), self.gain.tensor)


@mutant("CAUSAL-PREFIX-BITWISE", RuleCategory.BATCH)
class RmsOverTokenAxis(MutantBackend):
    """RMSNorm's mean taken over positions instead of features.

    A later token then changes earlier rows (CAUSAL-PREFIX-BITWISE), and every value moves.
    """

    model_class = model_with("NormOverTokens", norm_class=_NormOverTokens)


class _GainOnlyNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        return c.mul(x, self.gain.tensor)


@mutant("DEPTH-ZERO-FORMULA", RuleCategory.VALUES)
class NormWithoutNormalization(MutantBackend):
    """RMSNorm only multiplies by its gain (no 1/rms)."""

    model_class = model_with("GainOnlyNorm", norm_class=_GainOnlyNorm)


class _ScaledByModelWidth(c.ComposedAttention):
    def scores(self, query: Tensor, key: Tensor) -> Tensor:
        width = query.shape[-1] * self.heads
        return c.divide(ops.matmul(query, ops.transpose(key, 2, 3)), math.sqrt(width))


@mutant("VALUE-STAGES")
class AttentionScaledByModelWidth(MutantBackend):
    """Scores divided by sqrt(d), not sqrt(hw)."""

    model_class = model_with("ScaledByModelWidth", attention_class=_ScaledByModelWidth)


class _HeadsInterleaved(CausalSelfAttention):
    def split_heads(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        per_head = ops.reshape(x, (batch, tokens, width // self.heads, self.heads))  # (B,T,hw,H)
        return ops.transpose(ops.transpose(per_head, 2, 3), 1, 2)

    def merge_heads(self, x: Tensor) -> Tensor:
        batch, heads, tokens, head_width = x.shape
        back = ops.transpose(ops.transpose(x, 1, 2), 2, 3)  # (B, T, hw, H)
        return ops.reshape(back, (batch, tokens, heads * head_width))


@mutant("VALUE-STAGES")
class HeadsStrided(MutantBackend):
    """Heads take strided, not contiguous, features (head h gets h, h + H, h + 2H and on)."""

    model_class = model_with("HeadsStrided", attention_class=_HeadsInterleaved)


class _SigmoidGate(SwiGLU):
    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate.forward(x)
        sigmoid = ops.sigmoid(gate.value)
        activated = Tensor.from_operation(
            sigmoid, (gate,), lambda g: (g * sigmoid * (1.0 - sigmoid),), "sigmoid"
        )
        return self.down.forward(c.mul(activated, self.up.forward(x)))


@mutant("VALUE-STAGES")
class GateSigmoidNotSilu(MutantBackend):
    """The SwiGLU gate uses sigmoid(u) instead of SiLU, u sigmoid(u)."""

    model_class = model_with("SigmoidGate", feed_forward_class=_SigmoidGate)


class _SiluOnUp(SwiGLU):
    def forward(self, x: Tensor) -> Tensor:
        return self.down.forward(c.mul(self.gate.forward(x), c.silu(self.up.forward(x))))


@mutant("VALUE-STAGES")
class SiluOnUpBranch(MutantBackend):
    """SiLU applied to the up branch instead of the gate."""

    model_class = model_with("SiluOnUp", feed_forward_class=_SiluOnUp)


class _PostNorm(DecoderBlock):
    def forward(self, x: Tensor) -> Tensor:
        hidden = self.attention_norm.forward(ops.add(x, self.attention.forward(x)))
        return self.ffn_norm.forward(ops.add(hidden, self.ffn.forward(hidden)))


@mutant("VALUE-STAGES")
class PostNormBlocks(MutantBackend):
    """Blocks normalize after the residual add (post-norm) instead of before."""

    model_class = model_with("PostNorm", block_class=_PostNorm)


class _NoFeedForwardResidual(DecoderBlock):
    def forward(self, x: Tensor) -> Tensor:
        hidden = ops.add(x, self.attention.forward(self.attention_norm.forward(x)))
        return self.ffn.forward(self.ffn_norm.forward(hidden))  # the residual is dropped


@mutant("VALUE-STAGES")
class FeedForwardResidualDropped(MutantBackend):
    """The feed-forward output replaces the stream: its residual is dropped."""

    model_class = model_with("NoFeedForwardResidual", block_class=_NoFeedForwardResidual)


class _HardCodedEpsilon(RMSNorm):
    def __init__(self, gain: NamedParameter, epsilon: float) -> None:
        super().__init__(gain, 1e-6)


@mutant("VALUE-STAGES")
class RmsEpsilonHardCoded(MutantBackend):
    """RMSNorm uses epsilon 1e-6 whatever the configuration says (a copied default).

    Only an epsilon far from 1e-6 shows it, or an epsilon of 0 over tiny mean squares.
    """

    model_class = model_with("HardCodedEpsilon", norm_class=_HardCodedEpsilon)
