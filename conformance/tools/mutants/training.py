"""Mutants in the loss, the initialization recipe, determinism, and backward-only bugs."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import LossOutput
from conformance.adapters.reference import dense_gradients, refusals
from conformance.mutants.base import MutantBackend, model_with
from impl import ops
from impl.layers import CausalSelfAttention, RMSNorm, SwiGLU
from impl.model import DecoderModel
from impl.tape import Array, Tensor
from spec.config import DecoderConfig
from spec.recipe import SplitMix64


def _scaled(output: LossOutput, factor: float) -> LossOutput:
    """The loss and every gradient multiplied by ``factor``."""
    gradients = {name: g * factor for name, g in (output.gradients or {}).items()}
    return LossOutput(output.loss * factor, gradients)


class LossSummedNotAveraged(MutantBackend):
    """The loss sums over positions instead of averaging (gradients scale too).

    Rule: LOSS-MEAN-NLL.
    """

    name = "loss-summed-not-averaged"

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        return _scaled(output, float(np.asarray(targets).size))


class LossAveragedPerSequence(MutantBackend):
    """Averages within each sequence, then sums over the batch. Rule: LOSS-MEAN-NLL."""

    name = "loss-averaged-per-sequence"

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        return _scaled(output, float(np.asarray(tokens).shape[0]) if np.ndim(tokens) == 2 else 1.0)


class _ColumnMajorInit(DecoderModel):
    @classmethod
    def initialize(cls, config: DecoderConfig, stream: SplitMix64) -> DecoderModel:
        model = super().initialize(config, stream)
        # Same draws, but each matrix filled column by column instead of row by row.
        entries = [(n, v.reshape(v.shape[::-1]).T if v.ndim == 2 else v) for n, v in model.state()]
        return cls.from_parameters(config, entries)


class XavierFilledColumnMajor(MutantBackend):
    """Fills each Xavier matrix in column-major order. Rule: INIT-RECIPE."""

    name = "xavier-filled-column-major"
    model_class = _ColumnMajorInit


class _StreamAdvancedFirst(DecoderModel):
    @classmethod
    def initialize(cls, config: DecoderConfig, stream: SplitMix64) -> DecoderModel:
        stream.next_u64()  # a draw "to warm up" before the configuration is validated
        return super().initialize(config, stream)


class StreamAdvancedBeforeValidation(MutantBackend):
    """Draws from the caller's stream before validating (and so also on refusal).

    Rules: TXN-INIT, INIT-STREAM-ADVANCE.
    """

    name = "stream-advanced-before-validation"
    model_class = _StreamAdvancedFirst


class GradientsAccumulateAcrossCalls(MutantBackend):
    """Gradients are not reset between loss calls, so a second call returns twice as much.

    Rule: DET-REPEAT.
    """

    name = "gradients-accumulate-across-calls"

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


class _NoisyAttention(CausalSelfAttention):
    generator = np.random.default_rng()
    _attend = CausalSelfAttention._attend_composed

    def _scores(self, query: Tensor, key: Tensor) -> Tensor:
        scores = super()._scores(query, key)
        jitter = Tensor(self.generator.normal(scale=1e-15, size=scores.shape))
        return ops.add(scores, jitter)  # like a nondeterministic parallel reduction


class NondeterministicScores(MutantBackend):
    """Attention scores carry run-to-run noise of 1e-15, as an unordered reduction would.

    Rule: DET-REPEAT.
    """

    name = "nondeterministic-scores"
    model_class = model_with("NoisyAttention", attention_class=_NoisyAttention)


def _rms_without_mean_term(norm: RMSNorm, x: Tensor) -> Tensor:
    mean_square = ops.mean(ops.mul(x, x), axis=-1)
    inverse = ops.exp(ops.scale(ops.log(ops.add_constant(mean_square, norm.epsilon)), -0.5))
    return ops.mul(ops.mul(x, inverse.detach()), norm.gain.tensor)


class _ConstantScaleNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        return _rms_without_mean_term(self, x)


class RmsBackwardWithoutMeanTerm(MutantBackend):
    """RMSNorm's backward treats 1/rms as a constant; the forward is exact. Rule: GRAD-ORACLE."""

    name = "rms-backward-without-mean-term"
    model_class = model_with("ConstantScaleNorm", norm_class=_ConstantScaleNorm)


def _silu_with_wrong_derivative(x: Tensor) -> Tensor:
    sigmoid = 1.0 / (1.0 + np.exp(-np.clip(x.value, -700, 700)))
    return Tensor.from_operation(x.value * sigmoid, (x,), lambda g: (g * sigmoid,), "silu")


class _WrongSiluBackward(SwiGLU):
    def forward(self, x: Tensor) -> Tensor:
        hidden = ops.mul(_silu_with_wrong_derivative(self.gate.forward(x)), self.up.forward(x))
        return self.down.forward(hidden)


class SiluBackwardIsSigmoid(MutantBackend):
    """SiLU's backward uses sigmoid(u) instead of sigmoid(u)(1 + u(1 - sigmoid(u))).

    The forward is exact. Rule: GRAD-ORACLE.
    """

    name = "silu-backward-is-sigmoid"
    model_class = model_with("WrongSiluBackward", feed_forward_class=_WrongSiluBackward)


def _softmax_without_sum_term(scores: Tensor) -> Tensor:
    length = scores.shape[-1]
    masked = np.where(np.triu(np.ones((length, length), dtype=bool), k=1), -np.inf, scores.value)
    shifted = np.exp(masked - masked.max(axis=-1, keepdims=True))
    weights = shifted / shifted.sum(axis=-1, keepdims=True)

    def vjp(g: Array) -> tuple[Array]:
        return (weights * g,)  # missing "- sum(g * weights)"

    return Tensor.from_operation(weights, (scores,), vjp, "causal_softmax")


class _SoftmaxBackwardWithoutSum(CausalSelfAttention):
    _attend = CausalSelfAttention._attend_composed

    def _weights(self, scores: Tensor) -> Tensor:
        return _softmax_without_sum_term(scores)


class SoftmaxBackwardWithoutSumTerm(MutantBackend):
    """The softmax backward drops its ``- sum(g * p)`` term; the forward is exact.

    Rule: GRAD-ORACLE.
    """

    name = "softmax-backward-without-sum-term"
    model_class = model_with(
        "SoftmaxBackwardWithoutSum", attention_class=_SoftmaxBackwardWithoutSum
    )


class OutputWeightGradientTransposed(MutantBackend):
    """Reports each attention output matrix's gradient transposed (a backward-only bug).

    Rule: GRAD-ORACLE.
    """

    name = "output-weight-gradient-transposed"

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        gradients = {
            n: g.T.copy() if n.endswith("attention.output.weight") else g
            for n, g in (output.gradients or {}).items()
        }
        return LossOutput(output.loss, gradients)
