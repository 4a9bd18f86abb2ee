"""Mutants in validation: configuration precedence, context and vocabulary bounds, targets."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import ForwardOutput, LossOutput, Parameters, Refusal
from conformance.adapters.reference import refusals
from conformance.tools.mutants.base import MutantBackend, mutant
from impl import ops
from impl.errors import (
    ContextLengthExceeded,
    InvalidRmsEpsilon,
    TargetCountMismatch,
    TargetIdOutOfBounds,
)
from impl.layers import NamedParameter
from impl.model import DecoderModel
from impl.tape import Tensor
from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.parameters import parameter_layout
from spec.recipe import SplitMix64
from spec.rules import RuleCategory
from spec.validation import (
    broken_config_rules,
    config_violation,
    loss_violation,
    rebuild_violation,
)


@mutant("ERR-CONFIG-ORDER")
class DivisibilityCheckedFirst(MutantBackend):
    """The width-divisible-by-heads rule checked before every other configuration rule.

    A zero vocabulary together with 6 % 4 reports the wrong kind.
    """

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


@mutant("ERR-CONFIG-DEPTH0")
class DepthZeroUnvalidated(MutantBackend):
    """A zero-block configuration is not validated (heads, feed-forward, context, RoPE, epsilon)."""

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


@mutant("ERR-CONFIG-KIND")
class NegativeEpsilonAccepted(MutantBackend):
    """A negative RMSNorm epsilon is accepted (its magnitude used)."""

    model_class = _NegativeEpsilonModel


@mutant("ERR-CONTEXT-LIMIT", RuleCategory.CONFIGURATION)
class ContextOffByOne(MutantBackend):
    """A sequence as long as the context is refused (>= for >)."""

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


@mutant("ERR-TOKEN-ID")
class TokenIdsWrapAround(MutantBackend):
    """Out-of-vocabulary token IDs wrap around instead of being refused."""

    model_class = _WrappingLookupModel


class _UncheckedTargetsModel(DecoderModel):
    def validate_targets(self, targets: npt.ArrayLike, batch: int, length: int) -> Any:
        array = np.asarray(targets)
        if array.dtype.kind in "iu" and array.size:
            targets = np.clip(array, 0, self.config.vocabulary_size - 1)
        return super().validate_targets(targets, batch, length)


@mutant("ERR-TARGET-ID")
class TargetIdsClipped(MutantBackend):
    """Out-of-vocabulary target IDs are clipped into range."""

    model_class = _UncheckedTargetsModel


def _as_int32(ids: npt.ArrayLike) -> npt.ArrayLike:
    """Integer arrays cast to int32, which wraps 2**32 to 0; anything else left to be refused."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        return ids.astype(np.int32)
    return ids


@mutant("ERR-TOKEN-ID", RuleCategory.INPUTS)
class IdsCastToInt32BeforeTheirChecks(MutantBackend):
    """Token and target IDs are cast to int32 before they are checked, so 2**32 reads as ID 0.

    The cast an engine whose token type is int32 (llama.cpp's llama_token) invites.
    """

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        return super().forward(model, _as_int32(tokens), shape)

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        return super().loss(model, _as_int32(tokens), _as_int32(targets), **detach)


IGNORED_TARGET = -100


class _IgnoredTargetsModel(DecoderModel):
    def loss(
        self,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        shape: Sequence[int] | None = None,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> Tensor:
        array = np.asarray(targets)
        if array.dtype.kind not in "iu" or not np.any(array == IGNORED_TARGET):
            return super().loss(
                tokens, targets, shape, detach_lookup=detach_lookup, detach_head=detach_head
            )
        flat, batch, length = self._validate_token_shape(tokens, shape)
        kept = array.reshape(-1) != IGNORED_TARGET
        target_ids = self.validate_targets(np.where(kept, array.reshape(-1), 0), batch, length)
        ids = self._checked_token_ids(flat, batch, length)
        logits = self._forward(ids, detach_lookup=detach_lookup, detach_head=detach_head).logits
        rows = ops.reshape(logits, (batch * length, self.config.vocabulary_size))
        # PyTorch's mean: over the positions whose targets are kept.
        return ops.indexed_mean_nll(ops.gather_rows(rows, np.flatnonzero(kept)), target_ids[kept])


@mutant("ERR-TARGET-ID")
class TargetsOfMinus100Ignored(MutantBackend):
    """Targets of -100 are skipped, as PyTorch's cross_entropy (ignore_index) does, not refused."""

    model_class = _IgnoredTargetsModel


@mutant("ERR-LOSS-ORDER")
class TokenIdsCheckedBeforeTargets(MutantBackend):
    """The loss checks token IDs before its targets.

    The order RECIPE.md once stated; the seed checks the targets first and looks the IDs up
    only in its forward pass, so a bad token ID with too few targets is a target-count error.
    """

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        with refusals():
            model.validate_tokens(tokens)
        return super().loss(model, tokens, targets, **detach)


def _in_memory_order(values: Any) -> Any:
    """An array's elements as its memory holds them, read back as if in C order: what a
    pointer to a view's buffer gives native code. Anything else is left as it is."""
    if not isinstance(values, np.ndarray) or values.ndim < 2:
        return values
    return values.ravel(order="K").reshape(values.shape)


@mutant("REBUILD-MEMORY-LAYOUT")
class ParametersReadInMemoryOrder(MutantBackend):
    """Each parameter matrix is read from its buffer in memory order, as a ctypes pointer would.

    Right for C-ordered arrays; a Fortran-ordered matrix is read transposed and scrambled.
    """

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        if not isinstance(parameters, list):
            return super().build(config, parameters)
        read = [
            (entry[0], _in_memory_order(entry[1])) if isinstance(entry, tuple) else entry
            for entry in parameters
        ]
        return super().build(config, read)


@mutant("REBUILD-MEMORY-LAYOUT")
class TokensReadInMemoryOrder(MutantBackend):
    """Token and target IDs are read from their buffers in memory order (scrambled if Fortran)."""

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> Any:
        return super().forward(model, _in_memory_order(tokens), shape)

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        return super().loss(model, _in_memory_order(tokens), _in_memory_order(targets), **detach)


class _TokensIn16BitsModel(DecoderModel):
    def _checked_token_ids(
        self, flat: npt.NDArray[np.generic], batch: int, length: int
    ) -> npt.NDArray[np.intp]:
        checked = super()._checked_token_ids(flat, batch, length)
        return checked.astype(np.uint16).astype(np.intp)  # checked first, then narrowed


@mutant("VALUE-LARGE-IDS")
class TokenIdsKeptInUint16(MutantBackend):
    """Token IDs are kept in uint16 once checked, so ID 65,536 looks up row 0.

    A token buffer sized for GPT-2's 50,257 entries (uint16, as nanoGPT's data files hold
    them) in a model whose vocabulary outgrew it.
    """

    model_class = _TokensIn16BitsModel


class _TargetsInInt16Model(DecoderModel):
    def validate_targets(
        self, targets: npt.ArrayLike, batch: int, length: int
    ) -> npt.NDArray[np.intp]:
        checked = super().validate_targets(targets, batch, length)
        # numpy reads a negative index from the end of the row: no error, another column.
        return checked.astype(np.int16).astype(np.intp)


@mutant("VALUE-LARGE-IDS")
class TargetIdsKeptInInt16(MutantBackend):
    """Target IDs are kept in int16 once checked, so the loss reads ID 32,768 as -32,768.

    numpy's negative indexing then reads another logit of the row, without an error.
    """

    model_class = _TargetsInInt16Model


def _declared_dims(tokens: object, shape: Sequence[int] | None) -> tuple[int, ...] | None:
    """The dimensions a port reads off its token input before checking it, or None."""
    if shape is not None:
        return tuple(int(size) for size in shape)
    return tuple(tokens.shape) if isinstance(tokens, np.ndarray) else None


@mutant("ERR-TOKEN-ORDER")
class EmptySequencesCheckedBeforeAnEmptyBatch(MutantBackend):
    """Empty sequences are checked before an empty batch, so [0, 0] token IDs are empty-tokens."""

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> Any:
        dims = _declared_dims(tokens, shape)
        if dims is not None and len(dims) == 2 and dims[1] == 0:
            raise Refusal(ErrorKind.EMPTY_TOKENS, "token sequences must not be empty")
        return super().forward(model, tokens, shape)


@mutant("ERR-TOKEN-ORDER")
class TokenCountOverflowCheckedBeforeTheContext(MutantBackend):
    """B*T's overflow is checked before the context capacity, as a size guard before any rule.

    A batch of too-long sequences whose count also overflows is token-count-overflow.
    """

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> Any:
        dims = _declared_dims(tokens, shape)
        if dims is not None and len(dims) == 2 and dims[0] * dims[1] > 2**64 - 1:
            batch, length = dims
            details = {"batch": batch, "tokens": length}
            raise Refusal(ErrorKind.TOKEN_COUNT_OVERFLOW, f"{batch} x {length} overflows", details)
        return super().forward(model, tokens, shape)


class _TargetsCountedFirstModel(DecoderModel):
    def validate_targets(self, targets: npt.ArrayLike, batch: int, length: int) -> Any:
        if isinstance(targets, np.ndarray) and targets.size != batch * length:
            raise TargetCountMismatch(
                expected=batch * length, actual=int(targets.size), shape=tuple(targets.shape)
            )
        return super().validate_targets(targets, batch, length)


@mutant("ERR-LOSS-ORDER")
class TargetsCountedBeforeTheirDtype(MutantBackend):
    """The loss counts its targets before it checks their dtype: float targets, too few, are
    a target-count error."""

    model_class = _TargetsCountedFirstModel


class _LastBadTargetModel(DecoderModel):
    def validate_targets(self, targets: npt.ArrayLike, batch: int, length: int) -> Any:
        try:
            return super().validate_targets(targets, batch, length)
        except TargetIdOutOfBounds:
            flat = np.asarray(targets).reshape(-1)
            outside = np.flatnonzero((flat < 0) | (flat >= self.config.vocabulary_size))
            last = int(outside[-1])  # the loop kept overwriting the position it reports
            raise TargetIdOutOfBounds(
                position=last, id=int(flat[last]), vocabulary_size=self.config.vocabulary_size
            ) from None


@mutant("ERR-TARGET-ID")
class LastBadTargetNamed(MutantBackend):
    """A target-ID refusal names the last out-of-range target's position, not the first."""

    model_class = _LastBadTargetModel


@mutant("ERR-REBUILD-SHAPES")
class MisshapedParameterNamesItsBlock(MutantBackend):
    """A wrong shape or a non-finite value is refused naming the tensor's block number, not its
    index in the list (the check loops over blocks)."""

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        try:
            return super().build(config, parameters)
        except Refusal as refusal:
            by_value = (ErrorKind.PARAMETER_SHAPE_MISMATCH, ErrorKind.PARAMETER_NOT_FINITE)
            if refusal.kind not in by_value:
                raise
            name = parameter_layout(config)[refusal.details["index"]][0]
            if not name.startswith("blocks."):
                raise
            details = {**refusal.details, "index": int(name.split(".")[1])}
            raise Refusal(refusal.kind, refusal.message, details) from None


@mutant("ERR-REBUILD-DTYPES")
class ParameterValuesCheckedBeforeDtypes(MutantBackend):
    """The tensors' values are checked for NaN and infinity before their dtypes.

    A NaN in the table beside a complex final gain is parameter-not-finite.
    """

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        entries = list(parameters)
        found = rebuild_violation(config, entries)
        if found is not None and found.kind is ErrorKind.PARAMETER_DTYPE:
            for index, (_, value) in enumerate(entries):
                array = np.asarray(value)
                if array.dtype.kind in "iuf":
                    outside = np.flatnonzero(~np.isfinite(array.astype(np.float64)))
                    if outside.size:
                        details = {"index": index, "position": int(outside[0])}
                        raise Refusal(ErrorKind.PARAMETER_NOT_FINITE, "not finite", details)
        return super().build(config, entries)


class _ConfigurationCheckedOwnWay(MutantBackend):
    """Shared by the configuration-order mutants: their own check runs before the reference's."""

    def first_check(self, config: DecoderConfig) -> None:
        raise NotImplementedError

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        self.first_check(config)
        return super().build(config, parameters)

    def build_seeded(self, config: DecoderConfig, seed: int) -> Any:
        self.first_check(config)
        return super().build_seeded(config, seed)

    def initialize(self, config: DecoderConfig, stream: SplitMix64) -> Any:
        self.first_check(config)
        return super().initialize(config, stream)


@mutant("ERR-CONFIG-ORDER")
class ConfigurationFieldTypesCheckedLast(_ConfigurationCheckedOwnWay):
    """Field types are checked after the value rules: a zero vocabulary beside a float width is
    empty-vocabulary, not config-field-type."""

    def first_check(self, config: DecoderConfig) -> None:
        found = config_violation(config)
        if found is not None and found.kind is ErrorKind.CONFIG_FIELD_TYPE:
            broken = broken_config_rules(config)
            if broken:
                raise Refusal(broken[0], f"refused: {broken[0]}")


@mutant("ERR-CONFIG-ORDER")
class OddHeadWidthCheckedBeforeDivisibility(_ConfigurationCheckedOwnWay):
    """The head width's parity is checked before the width's divisibility by the head count.

    Width 6 over 4 heads is odd-head-width (6 // 4 = 1), not model-width-not-divisible.
    """

    def first_check(self, config: DecoderConfig) -> None:
        found = config_violation(config)
        divisibility = found is not None and found.kind is ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE
        if divisibility and (config.model_width // config.heads) % 2:
            raise Refusal(ErrorKind.ODD_HEAD_WIDTH, "head width must be even")


@mutant("ERR-TOKEN-SHAPE")
class DeclaredShapeAppliedByReshape(MutantBackend):
    """A declared shape is applied with numpy's reshape, which infers a -1 and takes 2.0 for 2.

    Flat IDs with shape (-1, T) run as (B, T) instead of being refused.
    """

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> Any:
        if shape is None or not isinstance(tokens, np.ndarray):
            return super().forward(model, tokens, shape)
        try:
            reshaped = tokens.reshape(tuple(int(size) for size in shape))
        except (TypeError, ValueError):
            return super().forward(model, tokens, shape)
        return super().forward(model, reshaped)


def _valid_loss_ids(model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike) -> bool:
    """Whether the spec accepts this loss call (the reference refuses it otherwise)."""
    return loss_violation(model.config, tokens, targets) is None


@mutant("ERR-TARGET-COUNT")
class TargetsMustBeShapedLikeTheTokens(MutantBackend):
    """The loss refuses targets whose shape is not the tokens' [B, T], though the seed counts
    them (one flat list): B*T IDs in one row are a target-count refusal."""

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        if _valid_loss_ids(model, tokens, targets) and np.shape(targets) != np.shape(tokens):
            raise Refusal(
                ErrorKind.TARGET_COUNT_MISMATCH,
                f"targets must have the tokens' shape {list(np.shape(tokens))}, "
                f"got {list(np.shape(targets))}",
            )
        return super().loss(model, tokens, targets, **detach)


@mutant("ERR-TARGET-COUNT")
class FlatTargetsReadSequenceMinor(MutantBackend):
    """Flat targets are laid out [T, B] (position-major, as a time-first training loop keeps
    them): target b*T + t is read as target t*B + b. [B, T] targets are right."""

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        if _valid_loss_ids(model, tokens, targets) and np.ndim(targets) == 1:
            batch, length = np.shape(tokens)
            targets = np.asarray(targets).reshape(length, batch).T
        return super().loss(model, tokens, targets, **detach)


@mutant("ERR-TOKEN-SHAPE")
class TargetsHandedOnUnconverted(MutantBackend):
    """Targets reach the loss kernel in the dtype they came in, and it takes only int64, as
    torch's cross_entropy does ("expected scalar type Long but found Int")."""

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        found = np.asarray(targets).dtype
        if _valid_loss_ids(model, tokens, targets) and found != np.int64:
            raise RuntimeError(f"expected scalar type Long but found {found}")
        return super().loss(model, tokens, targets, **detach)
