"""The tied decoder: lookup, N pre-norm causal blocks, final RMSNorm, and ``E^T``.

``logits = RMSNorm(B_N(... B_1(E[z]) ...)) @ E^T``: the head is the transpose of the one
``token_embedding.weight`` leaf, so backward adds the lookup-role and output-role
gradients on that leaf. There is no ``lm_head`` and no bias anywhere.

Validation here is written out on its own, not derived from :mod:`spec.validation`: the
suite judges this reference against ``spec.validation``, so the two are independent
readings of the seed's order, and ``tests/impl/test_fuzz.py`` holds them together on every
entry point. They share the seed's facts (the field kinds, the overflow bound).

Resources come last: once every input rule holds, an entry point estimates the bytes it
would allocate (:mod:`impl.resources`) and refuses above the memory bound before
allocating anything (``parameter-allocation-failed`` when building a model,
``activation-allocation-failed`` before a forward pass or a loss).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeGuard

import numpy as np
import numpy.typing as npt

from impl import ops, resources
from impl.errors import (
    ActivationAllocationFailed,
    ConfigFieldType,
    ContextLengthExceeded,
    DecoderModelError,
    EmptyBatch,
    EmptyTokens,
    EmptyVocabulary,
    FinalNormFailure,
    InvalidRmsEpsilon,
    InvalidRopeBase,
    InvalidSeed,
    ModelWidthNotDivisible,
    OddHeadWidth,
    ParameterAllocationFailed,
    ParameterCountMismatch,
    ParameterDtype,
    ParameterNameMismatch,
    ParameterNotFinite,
    ParameterShapeMismatch,
    ResourceReason,
    TargetCountMismatch,
    TargetDtype,
    TargetIdOutOfBounds,
    TokenCountMismatch,
    TokenCountOverflow,
    TokenDtype,
    TokenIdOutOfBounds,
    TokenRank,
    ZeroContextCapacity,
    ZeroFeedForwardWidth,
    ZeroHeadCount,
    ZeroModelWidth,
)
from impl.layers import (
    CausalSelfAttention,
    DecoderBlock,
    NamedParameter,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
)
from impl.tape import Array, Tensor
from spec.config import REAL_FIELDS, SIZE_FIELDS, DecoderConfig
from spec.parameters import (
    EMBEDDING_NAME,
    FINAL_NORM_NAME,
    parameter_count,
    parameter_layout,
    tensor_count,
)
from spec.recipe import SplitMix64, initial_parameters
from spec.validation import MAX_INDEX, MAX_SEED

__all__ = [
    "MAX_PARAMETER_SCALARS",
    "DecoderModel",
    "ForwardResult",
    "validate_config",
    "validate_seed",
]

IndexArray = npt.NDArray[np.intp]
ParameterEntry = NamedParameter | tuple[str, npt.ArrayLike]

# 2**31 float64 scalars are 16 GiB; anything larger is refused before allocating.
MAX_PARAMETER_SCALARS = 2**31
# The smallest int whose float64 rounds past the largest finite float (round half to even
# at 2**1024 - 2**970 goes up to 2**1024): ``float()`` overflows from here on.
_FLOAT64_OVERFLOW = 2**1024 - 2**970


def _is_integer(value: object) -> TypeGuard[int | np.integer[Any]]:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_float64_real(value: object) -> bool:
    """A real number a float64 can hold: any numpy real, a float, an int below the overflow."""
    if isinstance(value, bool | np.bool_):
        return False
    if isinstance(value, int):
        return abs(value) < _FLOAT64_OVERFLOW
    return isinstance(value, float | np.integer | np.floating)


def validate_seed(seed: object) -> int:
    """``seed`` as a Python int, or :class:`InvalidSeed` (an integer in [0, 2**64 - 1])."""
    if not _is_integer(seed) or not 0 <= int(seed) <= MAX_SEED:
        raise InvalidSeed(field="seed", expected="an integer in [0, 2**64 - 1]", actual=seed)
    return int(seed)


def _validate_stream(stream: object) -> None:
    """A SplitMix64 whose state is a 64-bit unsigned integer, or :class:`InvalidSeed`."""
    if not isinstance(stream, SplitMix64):
        raise InvalidSeed(field="stream", expected="a spec.recipe.SplitMix64", actual=stream)
    state = stream.state
    if not _is_integer(state) or not 0 <= state <= MAX_SEED:
        raise InvalidSeed(
            field="stream state", expected="an integer in [0, 2**64 - 1]", actual=state
        )


def _require_parameter_memory(config: DecoderConfig) -> int:
    """The bytes building ``config``'s parameters needs, or the refusal when they cannot be
    had: more than 2**31 scalars, or more bytes than the memory bound."""
    scalars = parameter_count(config)
    if scalars > MAX_PARAMETER_SCALARS:
        raise ParameterAllocationFailed(scalars=scalars, limit=MAX_PARAMETER_SCALARS)
    needed = resources.parameter_bytes(config)
    bound = resources.memory_limit()
    if needed > bound.bytes:
        raise ParameterAllocationFailed(
            scalars=scalars,
            limit=MAX_PARAMETER_SCALARS,
            reason="memory-limit",
            needed_bytes=needed,
            limit_bytes=bound.bytes,
            limit_source=bound.source,
        )
    return needed


def _require_working_memory(
    operation: str, batch: int, length: int, needed: int
) -> resources.MemoryLimit:
    """The memory bound, once ``needed`` bytes of a pass fit under it; refused otherwise."""
    bound = resources.memory_limit()
    if needed > bound.bytes:
        raise _ran_out(operation, batch, length, needed, bound, reason="memory-limit")
    return bound


def _ran_out(
    operation: str,
    batch: int,
    length: int,
    needed: int,
    bound: resources.MemoryLimit,
    *,
    reason: ResourceReason = "out-of-memory",
) -> ActivationAllocationFailed:
    """The refusal of a pass: above the bound, or (by default) a MemoryError in a pass that
    fitted the estimate (a busy machine)."""
    return ActivationAllocationFailed(
        operation=operation,
        batch=batch,
        tokens=length,
        needed_bytes=needed,
        limit_bytes=bound.bytes,
        limit_source=bound.source,
        reason=reason,
    )


def _out_of_memory(config: DecoderConfig, needed: int) -> ParameterAllocationFailed:
    """The refusal for a MemoryError while allocating parameters that passed the estimate."""
    return ParameterAllocationFailed(
        scalars=parameter_count(config),
        limit=MAX_PARAMETER_SCALARS,
        reason="out-of-memory",
        needed_bytes=needed,
    )


def validate_config(config: DecoderConfig) -> None:
    """Refuse the first invalid field, in the recipe's order, even when ``layers == 0``."""
    if not isinstance(config, DecoderConfig):
        raise ConfigFieldType(field="config", expected="a DecoderConfig", actual=config)
    for field in SIZE_FIELDS:
        value = getattr(config, field)
        if not _is_integer(value) or value < 0:
            raise ConfigFieldType(field=field, expected="a non-negative integer", actual=value)
    for field in REAL_FIELDS:
        value = getattr(config, field)
        if not _is_float64_real(value):
            raise ConfigFieldType(
                field=field, expected="a real number representable as a float64", actual=value
            )
    # Python ints from here on: a numpy size next to a huge Python int would overflow.
    width, heads = int(config.model_width), int(config.heads)
    if int(config.vocabulary_size) == 0:
        raise EmptyVocabulary()
    if width == 0:
        raise ZeroModelWidth()
    if heads == 0:
        raise ZeroHeadCount()
    if width % heads:
        raise ModelWidthNotDivisible(model_width=width, heads=heads)
    if (width // heads) % 2:
        raise OddHeadWidth(head_width=width // heads)
    if int(config.feed_forward_width) == 0:
        raise ZeroFeedForwardWidth()
    if int(config.context) == 0:
        raise ZeroContextCapacity()
    rope_base, epsilon = float(config.rope_base), float(config.rms_epsilon)
    if not math.isfinite(rope_base) or rope_base <= 0:
        raise InvalidRopeBase(value=config.rope_base)
    if not math.isfinite(epsilon) or epsilon < 0:
        raise InvalidRmsEpsilon(value=config.rms_epsilon)


def _first_out_of_range(ids: npt.NDArray[Any], vocabulary_size: int) -> int | None:
    """Flat position of the first ID outside ``[0, vocabulary_size)``, or None."""
    outside = np.flatnonzero((ids < 0) | (ids >= vocabulary_size))
    return int(outside[0]) if outside.size else None


def _as_array(values: object) -> npt.NDArray[np.generic] | None:
    """``values`` as an array, or None when it is ragged or otherwise not array-like."""
    try:
        return np.asarray(values)
    except (ValueError, TypeError):
        return None


def _integer_ids_problem(values: object) -> tuple[npt.NDArray[np.generic] | None, str | None]:
    """``values`` as an integer array, or what is wrong with it ("a ragged sequence", ...)."""
    array = _as_array(values)
    if array is None:
        return None, "a ragged sequence"
    # An empty Python list arrives as float64; it holds no non-integer ID.
    if array.dtype.kind not in "iu" and array.size:
        return None, f"dtype {array.dtype}"
    return array, None


@dataclass(frozen=True)
class ForwardResult:
    """Every stage of one forward pass, and the two table nodes the pass used."""

    embedding: Tensor
    blocks: list[Tensor]
    final_norm: Tensor
    logits: Tensor
    lookup_table: Tensor
    head_table: Tensor

    def stages(self) -> list[tuple[str, Tensor]]:
        """The residual-stream stages by name: embedding, block-i, final-norm."""
        named = [("embedding", self.embedding)]
        named.extend((f"block-{layer}", block) for layer, block in enumerate(self.blocks))
        named.append(("final-norm", self.final_norm))
        return named


class DecoderModel:
    """A tied-embedding decoder-only transformer over float64 numpy arrays.

    Build one with :meth:`from_seed`, :meth:`initialize` or :meth:`from_parameters`.
    """

    # The layer classes: a variant model (a port under study, a deliberately broken one)
    # subclasses a layer at one of its documented extension points (impl.layers) and sets it
    # here on a subclass, keeping everything else.
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm
    rope_class: ClassVar[type[RotaryEmbedding]] = RotaryEmbedding
    attention_class: ClassVar[type[CausalSelfAttention]] = CausalSelfAttention
    feed_forward_class: ClassVar[type[SwiGLU]] = SwiGLU
    block_class: ClassVar[type[DecoderBlock]] = DecoderBlock

    def __init__(self, config: DecoderConfig, parameters: Sequence[NamedParameter]) -> None:
        """Assemble the layers over already validated leaves in the stable order (use the
        class methods); each layer finds its leaves by name."""
        self.config = config
        self._parameters = list(parameters)
        named = {parameter.name: parameter for parameter in self._parameters}
        self.token_embedding = named[EMBEDDING_NAME]
        rope = self.rope_class(config.head_width, float(config.rope_base))
        self.blocks = [self._block(layer, named, rope) for layer in range(config.layers)]
        self.final_norm = self.norm_class(named[FINAL_NORM_NAME], float(config.rms_epsilon))

    def _block(
        self, layer: int, named: Mapping[str, NamedParameter], rope: RotaryEmbedding
    ) -> DecoderBlock:
        def leaf(suffix: str) -> NamedParameter:
            return named[f"blocks.{layer}.{suffix}"]

        epsilon = float(self.config.rms_epsilon)
        attention = self.attention_class(
            leaf("attention.query.weight"),
            leaf("attention.key.weight"),
            leaf("attention.value.weight"),
            leaf("attention.output.weight"),
            heads=self.config.heads,
            rope=rope,
        )
        feed_forward = self.feed_forward_class(
            leaf("ffn.gate.weight"), leaf("ffn.up.weight"), leaf("ffn.down.weight")
        )
        return self.block_class(
            layer,
            self.norm_class(leaf("attention_norm.gain"), epsilon),
            attention,
            self.norm_class(leaf("ffn_norm.gain"), epsilon),
            feed_forward,
        )

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_seed(cls, config: DecoderConfig, seed: int) -> DecoderModel:
        """Initial parameters for ``(config, seed)`` by the SplitMix64/Xavier recipe.

        Checked in order: the configuration, the seed (an integer in [0, 2**64 - 1]), the
        parameters' memory; the configuration first, as the seed's program does.
        """
        validate_config(config)
        return cls.initialize(config, SplitMix64(validate_seed(seed)))

    @classmethod
    def initialize(cls, config: DecoderConfig, stream: SplitMix64) -> DecoderModel:
        """Draw every matrix from ``stream``; on any failure the stream is left untouched.

        Checked in order: the configuration, the stream, the parameters' memory.
        """
        validate_config(config)
        _validate_stream(stream)
        needed = _require_parameter_memory(config)
        trial = stream.clone()
        try:
            drawn = initial_parameters(config, trial)
            leaves = _leaves(drawn)
        except MemoryError as error:
            raise _out_of_memory(config, needed) from error
        model = cls(config, leaves)
        stream.adopt(trial)
        return model

    @classmethod
    def from_parameters(
        cls,
        config: DecoderConfig,
        parameters: Mapping[str, npt.ArrayLike] | Sequence[ParameterEntry],
    ) -> DecoderModel:
        """Rebuild from a stable-order named parameter list, copying every value.

        Checked in order: configuration; tensor count; the name at each index; each
        tensor's shape; its dtype (real numbers); its values (finite); the memory the copies
        and their gradients need.
        """
        validate_config(config)
        entries = list(parameters.items()) if isinstance(parameters, Mapping) else list(parameters)
        # Counted before the layout is listed: a huge depth must not build a huge list.
        if len(entries) != tensor_count(config.layers):
            raise ParameterCountMismatch(expected=tensor_count(config.layers), actual=len(entries))
        layout = parameter_layout(config)
        named: list[tuple[str, object]] = []
        for index, (entry, (expected_name, _)) in enumerate(zip(entries, layout, strict=True)):
            name, value = _split_entry(entry)
            if name != expected_name:
                raise ParameterNameMismatch(
                    index=index, expected=expected_name, actual=name if name is not None else entry
                )
            named.append((expected_name, value))
        arrays: list[npt.NDArray[np.generic]] = []
        for index, ((name, value), (_, shape)) in enumerate(zip(named, layout, strict=True)):
            array = _as_array(value)
            if array is None:
                raise ParameterDtype(index=index, name=name, dtype="ragged or non-numeric sequence")
            if array.shape != shape:
                raise ParameterShapeMismatch(
                    index=index, name=name, expected=shape, actual=array.shape
                )
            arrays.append(array)
        for index, ((name, _), array) in enumerate(zip(named, arrays, strict=True)):
            if array.dtype.kind not in "iuf":
                raise ParameterDtype(index=index, name=name, dtype=str(array.dtype))
        for index, ((name, _), array) in enumerate(zip(named, arrays, strict=True)):
            values = array.astype(np.float64, copy=False)
            bad = np.flatnonzero(~np.isfinite(values))
            if bad.size:
                position = int(bad[0])
                raise ParameterNotFinite(
                    index=index,
                    name=name,
                    position=position,
                    value=float(values.reshape(-1)[position]),
                )
        needed = _require_parameter_memory(config)
        try:
            leaves = [
                NamedParameter(name, Tensor(array, requires_grad=True))
                for (name, _), array in zip(named, arrays, strict=True)
            ]
        except MemoryError as error:
            raise _out_of_memory(config, needed) from error
        return cls(config, leaves)

    # ------------------------------------------------------------------- inspection
    def parameters(self) -> list[NamedParameter]:
        """Every parameter in the stable order (2 + 9N tensors)."""
        return list(self._parameters)

    def parameter_names(self) -> list[str]:
        """The stable name list."""
        return [parameter.name for parameter in self._parameters]

    def parameter_count(self) -> int:
        """Scalars owned by the model (the tied table counted once)."""
        return sum(parameter.tensor.value.size for parameter in self._parameters)

    def state(self) -> list[tuple[str, Array]]:
        """``(name, copy of value)`` pairs that :meth:`from_parameters` accepts."""
        return [(p.name, p.tensor.value.copy()) for p in self._parameters]

    def gradients(self) -> dict[str, Array | None]:
        """The accumulated gradient of every parameter (None where nothing reached it)."""
        return {
            p.name: None if p.tensor.grad is None else p.tensor.grad.copy()
            for p in self._parameters
        }

    def zero_grad(self) -> None:
        """Forget every accumulated gradient."""
        for parameter in self._parameters:
            parameter.tensor.zero_grad()

    @property
    def tied_embedding(self) -> NamedParameter:
        """The one table used for both lookup and the vocabulary projection."""
        return self.token_embedding

    # ---------------------------------------------------------------------- running
    def validate_tokens(
        self, tokens: npt.ArrayLike, shape: Sequence[int] | None = None
    ) -> IndexArray:
        """The ``[B, T]`` index array for ``tokens``, or the first rule it breaks.

        ``tokens`` is a ``[B, T]`` array, or flat IDs with an explicit ``shape``.
        Order: dtype; rank; batch; tokens; context; B*T overflow; ID count; ID range.
        """
        flat, batch, length = self._validate_token_shape(tokens, shape)
        return self._checked_token_ids(flat, batch, length)

    def _validate_token_shape(
        self, tokens: npt.ArrayLike, shape: Sequence[int] | None
    ) -> tuple[npt.NDArray[np.generic], int, int]:
        """The flat IDs, batch and length, once every rule before the ID range holds."""
        array, problem = _integer_ids_problem(tokens)
        if array is None:
            raise TokenDtype(what="token IDs", expected="an integer array", actual=str(problem))
        if shape is None:
            dims: tuple[int, ...] = tuple(array.shape)
        else:
            if not all(_is_integer(size) and size >= 0 for size in shape):
                raise TokenDtype(
                    what="token shape", expected="non-negative integers", actual=repr(tuple(shape))
                )
            dims = tuple(int(size) for size in shape)
        if len(dims) != 2:
            raise TokenRank(rank=len(dims))
        batch, length = dims
        if batch == 0:
            raise EmptyBatch()
        if length == 0:
            raise EmptyTokens()
        if length > self.config.context:
            raise ContextLengthExceeded(tokens=length, context=self.config.context)
        if batch * length > MAX_INDEX:
            raise TokenCountOverflow(batch=batch, tokens=length)
        if array.size != batch * length:
            raise TokenCountMismatch(expected=batch * length, actual=int(array.size))
        return array.reshape(-1), batch, length

    def _checked_token_ids(
        self, flat: npt.NDArray[np.generic], batch: int, length: int
    ) -> IndexArray:
        """The ``[B, T]`` index array, once every ID is inside the vocabulary."""
        position = _first_out_of_range(flat, self.config.vocabulary_size)
        if position is not None:
            raise TokenIdOutOfBounds(
                position=position,
                id=int(flat[position]),
                vocabulary_size=self.config.vocabulary_size,
            )
        return flat.astype(np.intp).reshape(batch, length)

    def validate_targets(self, targets: npt.ArrayLike, batch: int, length: int) -> IndexArray:
        """The flat target indices, or the first rule they break (dtype, count, range).

        Targets are counted, not shaped: the seed takes them as one flat list, so any array
        of ``batch * length`` IDs is one target per token.
        """
        array, problem = _integer_ids_problem(targets)
        if array is None:
            raise TargetDtype(expected="an integer array", actual=str(problem))
        expected = batch * length
        if array.size != expected:
            raise TargetCountMismatch(
                expected=expected, actual=int(array.size), shape=tuple(array.shape)
            )
        flat = array.reshape(-1)
        position = _first_out_of_range(flat, self.config.vocabulary_size)
        if position is not None:
            raise TargetIdOutOfBounds(
                position=position,
                id=int(flat[position]),
                vocabulary_size=self.config.vocabulary_size,
            )
        return flat.astype(np.intp)

    def forward(
        self,
        tokens: npt.ArrayLike,
        shape: Sequence[int] | None = None,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> ForwardResult:
        """Every stage for ``[B, T]`` token IDs; logits are ``[B, T, V]``.

        ``detach_lookup`` / ``detach_head`` cut one use of the tied table off the tape,
        so each role's gradient contribution can be measured on its own.
        """
        ids = self.validate_tokens(tokens, shape)
        batch, length = ids.shape
        needed = resources.forward_bytes(self.config, batch, length)
        bound = _require_working_memory("a forward pass", batch, length, needed)
        try:
            return self._forward(ids, detach_lookup=detach_lookup, detach_head=detach_head)
        except MemoryError as error:
            raise _ran_out("a forward pass", batch, length, needed, bound) from error

    def _forward(self, ids: IndexArray, *, detach_lookup: bool, detach_head: bool) -> ForwardResult:
        table = self.token_embedding.tensor
        lookup_table = table.detach() if detach_lookup else table
        head_table = table.detach() if detach_head else table
        embedding = ops.gather_rows(lookup_table, ids)  # (B, T, d)
        hidden = embedding
        block_outputs: list[Tensor] = []
        for block in self.blocks:
            hidden = block.forward(hidden)  # (B, T, d)
            block_outputs.append(hidden)
        try:
            normalized = self.final_norm.forward(hidden)  # (B, T, d)
        except DecoderModelError as error:
            raise FinalNormFailure(source=error) from error
        logits = ops.matmul(normalized, ops.transpose(head_table, 0, 1))  # (B, T, V)
        return ForwardResult(embedding, block_outputs, normalized, logits, lookup_table, head_table)

    def loss(
        self,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        shape: Sequence[int] | None = None,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> Tensor:
        """Mean over all B*T positions of ``-log softmax(logits[b, t])[targets[b, t]]``.

        Checked in the seed's order: the token shape rules, then the targets (dtype, count,
        range), and only then the token IDs, as the seed's forward pass looks them up; last
        the working memory of the loss and of the backward pass it exists for.
        """
        flat, batch, length = self._validate_token_shape(tokens, shape)
        target_ids = self.validate_targets(targets, batch, length)
        ids = self._checked_token_ids(flat, batch, length)
        operation = "a loss and its backward pass"
        needed = resources.loss_bytes(self.config, batch, length)
        bound = _require_working_memory(operation, batch, length, needed)
        try:
            result = self._forward(ids, detach_lookup=detach_lookup, detach_head=detach_head)
            return ops.indexed_mean_nll(result.logits, target_ids)
        except MemoryError as error:
            raise _ran_out(operation, batch, length, needed, bound) from error


def _leaves(drawn: list[tuple[str, Array]]) -> list[NamedParameter]:
    """Each drawn matrix copied into its leaf, the drawn one dropped as soon as it is copied,
    so at most one matrix exists twice."""
    drawn.reverse()
    leaves: list[NamedParameter] = []
    while drawn:
        name, value = drawn.pop()
        leaves.append(NamedParameter(name, Tensor(value, requires_grad=True)))
        del value
    return leaves


def _split_entry(entry: object) -> tuple[str | None, object]:
    """``(name, value)`` of one parameter-list entry; name None when it has none."""
    if isinstance(entry, NamedParameter):
        return entry.name, entry.tensor.value
    if isinstance(entry, tuple | list) and len(entry) == 2 and isinstance(entry[0], str):
        return entry[0], entry[1]
    return None, None
