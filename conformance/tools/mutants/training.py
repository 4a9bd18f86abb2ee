"""Mutants in the loss, the initialization recipe, determinism, and backward-only bugs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import LossOutput
from conformance.adapters.reference import dense_gradients, refusals
from conformance.tools.mutants import composed as c
from conformance.tools.mutants.base import MutantBackend, model_with, mutant
from impl import ops
from impl.layers import RMSNorm, SwiGLU
from impl.model import DecoderModel
from impl.tape import Array, Tensor
from spec.config import DecoderConfig
from spec.recipe import SplitMix64
from spec.rules import RuleCategory


def _scaled(output: LossOutput, factor: float) -> LossOutput:
    """The loss and every gradient multiplied by ``factor``."""
    gradients = {name: g * factor for name, g in (output.gradients or {}).items()}
    return LossOutput(output.loss * factor, gradients)


@mutant("LOSS-MEAN-NLL")
class LossSummedNotAveraged(MutantBackend):
    """The loss sums over positions instead of averaging (its gradients scale too)."""

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        return _scaled(output, float(np.asarray(targets).size))


@mutant("LOSS-MEAN-NLL")
class LossAveragedPerSequence(MutantBackend):
    """The loss averages per sequence, then sums over the batch."""

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        return _scaled(output, float(np.asarray(tokens).shape[0]) if np.ndim(tokens) == 2 else 1.0)


_LOSS_CHUNK = 1024


@mutant("LOSS-MEAN-NLL")
class LossDropsAPartialLastChunk(MutantBackend):
    """Past 1024 positions the loss is taken in chunks of 1024 and a partial last chunk is left
    out of the mean (the value reported; its gradients are the full mean's, as when a fused
    loss drives the backward pass and a chunked one the number)."""

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        length = np.shape(tokens)[-1] if np.ndim(tokens) == 2 else 0
        if length <= _LOSS_CHUNK or length % _LOSS_CHUNK == 0:
            return output
        kept = _LOSS_CHUNK * (length // _LOSS_CHUNK)
        logits = np.asarray(self.forward(model, tokens).logits, dtype=np.float64)[:, :kept]
        chosen = np.asarray(targets, dtype=np.intp)[:, :kept].reshape(-1)
        loss = ops.indexed_mean_nll(Tensor(logits), chosen).value  # the reference's own rule
        return LossOutput(float(loss), output.gradients)


class _ColumnMajorInit(DecoderModel):
    @classmethod
    def initialize(cls, config: DecoderConfig, stream: SplitMix64) -> DecoderModel:
        model = super().initialize(config, stream)
        # Same draws, but each matrix filled column by column instead of row by row.
        entries = [(n, v.reshape(v.shape[::-1]).T if v.ndim == 2 else v) for n, v in model.state()]
        return cls.from_parameters(config, entries)


@mutant("INIT-RECIPE")
class XavierFilledColumnMajor(MutantBackend):
    """Xavier matrices filled column by column instead of row by row."""

    model_class = _ColumnMajorInit


class _StreamAdvancedFirst(DecoderModel):
    @classmethod
    def initialize(cls, config: DecoderConfig, stream: SplitMix64) -> DecoderModel:
        stream.next_u64()  # a draw "to warm up" before the configuration is validated
        return super().initialize(config, stream)


@mutant("INIT-STREAM-ADVANCE", RuleCategory.TRANSACTIONS)
class StreamAdvancedBeforeValidation(MutantBackend):
    """The stream is drawn from before validation (and so also on a refusal).

    Caught by INIT-STREAM-ADVANCE (one draw too many) and TXN-INIT.
    """

    model_class = _StreamAdvancedFirst


@mutant("DET-REPEAT")
class GradientsAccumulateAcrossCalls(MutantBackend):
    """Gradients are not reset between loss calls, so a second call returns twice as much."""

    def loss(
        self,
        model: Any,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        with refusals():
            value = model.loss(
                tokens, targets, detach_lookup=detach_lookup, detach_head=detach_head
            )
        value.backward()  # no zero_grad before or after
        return LossOutput(float(value.value), dense_gradients(model))


class _NoisyAttention(c.ComposedAttention):
    generator = np.random.default_rng()

    def scores(self, query: Tensor, key: Tensor) -> Tensor:
        scores = super().scores(query, key)
        jitter = self.generator.normal(scale=1e-15, size=scores.shape)
        return _plus_constant(scores, jitter)  # like a nondeterministic parallel reduction


def _plus_constant(x: Tensor, constant: Array) -> Tensor:
    """``x + constant`` for a constant array.  VJP: ``g``."""
    return Tensor.from_operation(x.value + constant, (x,), lambda g: (g,), "add_noise")


@mutant("DET-REPEAT")
class NondeterministicScores(MutantBackend):
    """Attention scores carry 1e-15 run-to-run noise, as an unordered reduction would."""

    model_class = model_with("NoisyAttention", attention_class=_NoisyAttention)


class _ConstantScaleNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        mean_square = c.mean(c.mul(x, x), axis=-1)
        inverse = c.exp(c.scale(c.log(c.shift(mean_square, self.epsilon)), -0.5))
        return c.mul(c.mul(x, inverse.detach()), self.gain.tensor)


@mutant("GRAD-ORACLE")
class RmsBackwardWithoutMeanTerm(MutantBackend):
    """RMSNorm backward without its mean-square term: 1/rms treated as a constant.

    The forward is exact.
    """

    model_class = model_with("ConstantScaleNorm", norm_class=_ConstantScaleNorm)


def _silu_with_wrong_derivative(x: Tensor) -> Tensor:
    sigmoid = 1.0 / (1.0 + np.exp(-np.clip(x.value, -700, 700)))
    return Tensor.from_operation(x.value * sigmoid, (x,), lambda g: (g * sigmoid,), "silu")


class _WrongSiluBackward(SwiGLU):
    def forward(self, x: Tensor) -> Tensor:
        hidden = c.mul(_silu_with_wrong_derivative(self.gate.forward(x)), self.up.forward(x))
        return self.down.forward(hidden)


@mutant("GRAD-ORACLE")
class SiluBackwardIsSigmoid(MutantBackend):
    """SiLU backward uses sigmoid(u), not sigmoid(u)(1 + u(1 - sigmoid(u))).

    The forward is exact.
    """

    model_class = model_with("WrongSiluBackward", feed_forward_class=_WrongSiluBackward)


def _softmax_without_sum_term(scores: Tensor) -> Tensor:
    masked = np.where(c.future_mask(scores.shape[-1]), -np.inf, scores.value)
    shifted = np.exp(masked - masked.max(axis=-1, keepdims=True))
    weights = shifted / shifted.sum(axis=-1, keepdims=True)

    def vjp(g: Array) -> tuple[Array]:
        return (weights * g,)  # missing "- sum(g * weights)"

    return Tensor.from_operation(weights, (scores,), vjp, "causal_softmax")


class _SoftmaxBackwardWithoutSum(c.ComposedAttention):
    def weights(self, scores: Tensor) -> Tensor:
        return _softmax_without_sum_term(scores)


@mutant("GRAD-ORACLE")
class SoftmaxBackwardWithoutSumTerm(MutantBackend):
    """Softmax backward without its sum term, - sum(g p); the forward is exact."""

    model_class = model_with(
        "SoftmaxBackwardWithoutSum", attention_class=_SoftmaxBackwardWithoutSum
    )


def _softmax_recomputed_without_maximum(scores: Tensor) -> Tensor:
    blocked = c.future_mask(scores.shape[-1])
    forward = c.masked_softmax(scores, blocked, -np.inf)

    def vjp(g: Array) -> tuple[Array]:
        # The slip: the weights recomputed from the scores, as a fused kernel's backward does,
        # but without the row maximum the forward subtracted.
        recomputed = c.weights_without_maximum(scores.value, blocked)
        return (c.softmax_gradient(recomputed, blocked, g),)

    return Tensor.from_operation(forward.value, (scores,), vjp, "causal_softmax")


class _BackwardWithoutRowMaximum(c.ComposedAttention):
    def weights(self, scores: Tensor) -> Tensor:
        return _softmax_recomputed_without_maximum(scores)


@mutant("VALUE-LARGE-SCORES", RuleCategory.GRADIENTS)
class AttentionBackwardWithoutRowMaximum(MutantBackend):
    """The softmax backward recomputes its weights without the row maximum; the forward is exact.

    Right wherever exp(score) stays in range; at scores in the thousands the gradients are NaN.
    """

    model_class = model_with(
        "BackwardWithoutRowMaximum", attention_class=_BackwardWithoutRowMaximum
    )


@mutant("GRAD-ORACLE")
class OutputWeightGradientTransposed(MutantBackend):
    """The attention output matrix's gradient transposed (a backward-only bug)."""

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        gradients = {
            n: g.T.copy() if n.endswith("attention.output.weight") else g
            for n, g in (output.gradients or {}).items()
        }
        return LossOutput(output.loss, gradients)


_KEY_TILE = 128


def _backward_changed(x: Tensor, change: Callable[[Array], Array], name: str) -> Tensor:
    """``x`` unchanged; on the way back, its gradient passed through ``change``: a bug of the
    backward pass alone."""
    return Tensor.from_operation(x.value, (x,), lambda g: (change(g),), name)


def _gradient_dropped_from(x: Tensor, start: int) -> Tensor:
    """``x`` unchanged; on the way back, the gradient of positions ``start ..`` left at 0."""

    def dropped(g: Array) -> Array:
        kept = g.copy()
        kept[..., start:, :] = 0.0
        return kept

    return _backward_changed(x, dropped, "key_tiles")


class _KeyTilesBackward(c.ComposedAttention):
    def attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        tokens = key.shape[-2]
        if tokens > _KEY_TILE:
            whole = _KEY_TILE * (tokens // _KEY_TILE)
            key, value = _gradient_dropped_from(key, whole), _gradient_dropped_from(value, whole)
        return super().attend(query, key, value)


@mutant("GRAD-LONG-CONTEXT")
class AttentionBackwardDropsAPartialKeyTile(MutantBackend):
    """Attention's backward in key tiles of 128 leaves the last, partial tile's dK and dV at 0.

    The forward is exact; so is every gradient below 129 positions, or at a whole number of
    tiles (8,192 positions).
    """

    model_class = model_with("KeyTilesBackward", attention_class=_KeyTilesBackward)


@mutant("GRAD-LONG-CONTEXT")
class LossBackwardWeighsChunksEqually(MutantBackend):
    """Past 1024 rows the loss's backward is a mean of chunk means: each chunk of 1024 rows
    weighted 1/chunks, a partial last chunk's rows by more than 1/rows.

    The loss's value is the right mean (a fused loss reports it); the gradients are right
    whenever every chunk is whole.
    """

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)  # validation, and the value
        rows = np.size(targets)
        if rows <= _LOSS_CHUNK:
            return output
        weights = np.empty(rows)
        starts = range(0, rows, _LOSS_CHUNK)
        for start in starts:
            chunk = min(_LOSS_CHUNK, rows - start)
            weights[start : start + chunk] = rows / (len(starts) * chunk)
        result = model.forward(tokens, **detach)
        row_weights = weights.reshape((*result.logits.shape[:-1], 1))
        weighted = _backward_changed(result.logits, lambda g: g * row_weights, "chunk_rows")
        loss = ops.indexed_mean_nll(weighted, np.asarray(targets, dtype=np.intp).reshape(-1))
        model.zero_grad()
        loss.backward(retain_graph=False)
        gradients = dense_gradients(model)
        model.zero_grad()
        return LossOutput(output.loss, gradients)
