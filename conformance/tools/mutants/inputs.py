"""Mutants in validation: configuration precedence, context and vocabulary bounds, targets."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import LossOutput, Parameters, Refusal
from conformance.adapters.reference import refusals
from conformance.mutants.base import MutantBackend
from impl.errors import ContextLengthExceeded, InvalidRmsEpsilon
from impl.layers import NamedParameter
from impl.model import DecoderModel
from impl.tape import Tensor
from spec.config import DecoderConfig
from spec.errors import ErrorKind


class DivisibilityCheckedFirst(MutantBackend):
    """Checks "width divisible by heads" before every other configuration rule.

    Rule: ERR-CONFIG-ORDER (a zero vocabulary together with 6 % 4 reports the wrong kind).
    """

    name = "divisibility-checked-first"

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        sizes_are_ints = all(
            isinstance(v, int) and not isinstance(v, bool)
            for v in (config.model_width, config.heads)
        )
        if sizes_are_ints and config.heads > 0 and config.model_width % config.heads:
            raise Refusal(ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE, "checked first")
        return super().build(config, parameters)


class _SkipsValidationAtDepthZero(DecoderModel):
    @classmethod
    def from_parameters(cls, config: DecoderConfig, parameters: Any) -> DecoderModel:
        if config.layers == 0:  # an empty stack "cannot go wrong", so nothing is validated
            leaves = [
                NamedParameter(str(n), Tensor(np.asarray(v, dtype=float), requires_grad=True))
                for n, v in parameters
            ]
            return cls(config, leaves)
        return super().from_parameters(config, parameters)


class DepthZeroUnvalidated(MutantBackend):
    """A zero-block model skips the head, feed-forward, context, RoPE and epsilon rules.

    Rule: ERR-CONFIG-DEPTH0.
    """

    name = "depth-zero-unvalidated"
    model_class = _SkipsValidationAtDepthZero


class _NegativeEpsilonModel(DecoderModel):
    @classmethod
    def from_parameters(cls, config: DecoderConfig, parameters: Any) -> DecoderModel:
        try:
            return super().from_parameters(config, parameters)
        except InvalidRmsEpsilon as error:
            if np.isfinite(error.value):  # only NaN and infinity are refused
                magnitude = dataclasses.replace(config, rms_epsilon=abs(error.value))
                return super().from_parameters(magnitude, parameters)
            raise


class NegativeEpsilonAccepted(MutantBackend):
    """A negative RMSNorm epsilon is accepted (its magnitude used). Rule: ERR-CONFIG-KIND."""

    name = "negative-epsilon-accepted"
    model_class = _NegativeEpsilonModel


class ContextOffByOne(MutantBackend):
    """Refuses a sequence exactly as long as the context (``>=`` for ``>``).

    Rule: ERR-CONTEXT-LIMIT.
    """

    name = "context-off-by-one"

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> Any:
        length = (shape or np.asarray(tokens).shape)[-1] if np.ndim(tokens) or shape else 0
        if length == model.config.context:
            raise Refusal(
                ErrorKind.CONTEXT_LENGTH_EXCEEDED,
                str(ContextLengthExceeded(tokens=length, context=model.config.context)),
            )
        return super().forward(model, tokens, shape)


class _WrappingLookupModel(DecoderModel):
    def validate_tokens(self, tokens: npt.ArrayLike, shape: Any = None) -> Any:
        array = np.asarray(tokens)
        if array.dtype.kind in "iu" and array.size:
            tokens = array % self.config.vocabulary_size  # out-of-range IDs wrap around
        return super().validate_tokens(tokens, shape)


class TokenIdsWrapAround(MutantBackend):
    """Token IDs outside [0, V) wrap around instead of being refused. Rule: ERR-TOKEN-ID."""

    name = "token-ids-wrap-around"
    model_class = _WrappingLookupModel


class _UncheckedTargetsModel(DecoderModel):
    def validate_targets(self, targets: npt.ArrayLike, batch: int, length: int) -> Any:
        array = np.asarray(targets)
        if array.dtype.kind in "iu" and array.size:
            targets = np.clip(array, 0, self.config.vocabulary_size - 1)
        return super().validate_targets(targets, batch, length)


class TargetIdsClipped(MutantBackend):
    """Out-of-range target IDs are clipped into range. Rule: ERR-TARGET-ID."""

    name = "target-ids-clipped"
    model_class = _UncheckedTargetsModel


class TokenIdsCheckedBeforeTargets(MutantBackend):
    """The loss checks token IDs before its targets (the order RECIPE.md once stated; the
    seed checks the targets first and looks the IDs up only in its forward pass).

    Rule: ERR-LOSS-ORDER (a bad token ID with too few targets reports the token ID).
    """

    name = "token-ids-checked-before-targets"

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        with refusals():
            model.validate_tokens(tokens)
        return super().loss(model, tokens, targets, **detach)
