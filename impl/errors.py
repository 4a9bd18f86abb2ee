"""Exceptions of the reference implementation, one class per spec error kind.

Every exception subclasses ``ValueError`` (so generic callers can catch it), carries its
``kind`` from :class:`spec.errors.ErrorKind`, keeps the offending values as attributes, and
says in its message which field was wrong, what was expected, and what arrived.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from spec.errors import (
    ErrorCategory,
    ErrorKind,
    describe_bytes,
    describe_count,
    describe_value,
)

__all__ = [
    "ActivationAllocationFailed",
    "BackwardSeedShape",
    "BlockFailure",
    "ConfigFieldType",
    "ConfigurationError",
    "ContextLengthExceeded",
    "DecoderModelError",
    "EmptyBatch",
    "EmptyTokens",
    "EmptyVocabulary",
    "FinalNormFailure",
    "GraphReleased",
    "InvalidRmsEpsilon",
    "InvalidRopeBase",
    "InvalidSeed",
    "ModelWidthNotDivisible",
    "OddHeadWidth",
    "ParameterAllocationFailed",
    "ParameterCountMismatch",
    "ParameterDtype",
    "ParameterLayoutError",
    "ParameterNameMismatch",
    "ParameterNotFinite",
    "ParameterShapeMismatch",
    "ResourceError",
    "ResourceReason",
    "RmsZeroMeanSquare",
    "TargetCountMismatch",
    "TargetDtype",
    "TargetIdOutOfBounds",
    "TokenCountMismatch",
    "TokenCountOverflow",
    "TokenDtype",
    "TokenIdOutOfBounds",
    "TokenInputError",
    "TokenRank",
    "ZeroContextCapacity",
    "ZeroFeedForwardWidth",
    "ZeroHeadCount",
    "ZeroModelWidth",
]


@dataclass(eq=False)
class DecoderModelError(ValueError):
    """Base of every refusal; ``kind`` names the spec rule that refused the input."""

    KIND: ClassVar[ErrorKind]

    def __post_init__(self) -> None:
        # Passing the fields to Exception keeps the error picklable (xdist, subprocesses).
        super().__init__(*(getattr(self, field.name) for field in fields(self)))

    @property
    def kind(self) -> ErrorKind:
        """The machine-readable error kind."""
        return self.KIND

    @property
    def category(self) -> ErrorCategory:
        """The category of :attr:`kind`."""
        return self.kind.category

    def details(self) -> dict[str, Any]:
        """The offending values by attribute name."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def message(self) -> str:
        """The human-readable explanation."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.message()


class ConfigurationError(DecoderModelError):
    """A configuration field is out of range; checked before anything is built or drawn."""


@dataclass(eq=False)
class ConfigFieldType(ConfigurationError):
    """A configuration field has the wrong type (a float or bool where an int belongs)."""

    KIND: ClassVar[ErrorKind] = ErrorKind.CONFIG_FIELD_TYPE
    field: str
    expected: str
    actual: object

    def message(self) -> str:
        shown = describe_value(self.actual)
        return f"decoder config field {self.field} must be {self.expected}, got {shown}"


@dataclass(eq=False)
class EmptyVocabulary(ConfigurationError):
    """The vocabulary size is zero."""

    KIND: ClassVar[ErrorKind] = ErrorKind.EMPTY_VOCABULARY

    def message(self) -> str:
        return "decoder vocabulary must contain at least one token, got vocabulary_size=0"


@dataclass(eq=False)
class ZeroModelWidth(ConfigurationError):
    """The model width is zero."""

    KIND: ClassVar[ErrorKind] = ErrorKind.ZERO_MODEL_WIDTH

    def message(self) -> str:
        return "decoder model width must be nonzero, got model_width=0"


@dataclass(eq=False)
class ZeroHeadCount(ConfigurationError):
    """The head count is zero."""

    KIND: ClassVar[ErrorKind] = ErrorKind.ZERO_HEAD_COUNT

    def message(self) -> str:
        return "decoder head count must be nonzero, got heads=0"


@dataclass(eq=False)
class ModelWidthNotDivisible(ConfigurationError):
    """The model width is not a multiple of the head count."""

    KIND: ClassVar[ErrorKind] = ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE
    model_width: int
    heads: int

    def message(self) -> str:
        return (
            f"decoder model width {describe_count(self.model_width)} must be divisible by "
            f"head count {describe_count(self.heads)}"
        )


@dataclass(eq=False)
class OddHeadWidth(ConfigurationError):
    """The per-head width is odd, so RoPE cannot pair its features."""

    KIND: ClassVar[ErrorKind] = ErrorKind.ODD_HEAD_WIDTH
    head_width: int

    def message(self) -> str:
        return (
            f"decoder per-head width must be even for RoPE, got {describe_count(self.head_width)}"
        )


@dataclass(eq=False)
class ZeroFeedForwardWidth(ConfigurationError):
    """The SwiGLU hidden width is zero."""

    KIND: ClassVar[ErrorKind] = ErrorKind.ZERO_FEED_FORWARD_WIDTH

    def message(self) -> str:
        return "decoder feed-forward width must be nonzero, got feed_forward_width=0"


@dataclass(eq=False)
class ZeroContextCapacity(ConfigurationError):
    """The context capacity (maximum positions) is zero."""

    KIND: ClassVar[ErrorKind] = ErrorKind.ZERO_CONTEXT_CAPACITY

    def message(self) -> str:
        return "decoder context capacity must be nonzero, got context=0"


@dataclass(eq=False)
class InvalidRopeBase(ConfigurationError):
    """The RoPE base is not finite or not positive."""

    KIND: ClassVar[ErrorKind] = ErrorKind.INVALID_ROPE_BASE
    value: float

    def message(self) -> str:
        return f"decoder RoPE base must be finite and positive, got {self.value!r}"


@dataclass(eq=False)
class InvalidRmsEpsilon(ConfigurationError):
    """The RMSNorm epsilon is not finite or negative."""

    KIND: ClassVar[ErrorKind] = ErrorKind.INVALID_RMS_EPSILON
    value: float

    def message(self) -> str:
        return f"decoder RMSNorm epsilon must be finite and nonnegative, got {self.value!r}"


@dataclass(eq=False)
class InvalidSeed(DecoderModelError):
    """A seed (or a stream, or a stream's state) that SplitMix64 cannot hold: no integer,
    a bool, or outside [0, 2**64 - 1]; checked after the configuration, before any draw."""

    KIND: ClassVar[ErrorKind] = ErrorKind.INVALID_SEED
    field: str
    expected: str
    actual: object

    def message(self) -> str:
        return f"decoder {self.field} must be {self.expected}, got {describe_value(self.actual)}"


class ResourceError(DecoderModelError):
    """The sizes need more memory than the reference may use; refused before allocating."""


# Why a resource refusal came: the fixed scalar limit, the memory bound (impl.resources),
# or a MemoryError that came anyway (the estimate fitted, the machine was busier).
ResourceReason = Literal["scalar-limit", "memory-limit", "out-of-memory"]


def _limit_text(limit_bytes: int, limit_source: str) -> str:
    return f"the limit is {describe_bytes(limit_bytes)} ({limit_source})"


@dataclass(eq=False)
class ParameterAllocationFailed(ResourceError):
    """The model's parameters cannot be allocated: more scalars than the reference holds
    (``reason="scalar-limit"``), more bytes than the memory bound (``"memory-limit"``), or
    the machine ran out while allocating them anyway (``"out-of-memory"``)."""

    KIND: ClassVar[ErrorKind] = ErrorKind.PARAMETER_ALLOCATION_FAILED
    scalars: int
    limit: int
    reason: ResourceReason = "scalar-limit"
    needed_bytes: int = 0
    limit_bytes: int = 0
    limit_source: str = ""

    def message(self) -> str:
        scalars = describe_count(self.scalars)
        if self.reason == "scalar-limit":
            return (
                f"decoder parameters: {scalars} scalars cannot be allocated; "
                f"at most {self.limit} are allowed"
            )
        needed = describe_bytes(self.needed_bytes)
        if self.reason == "memory-limit":
            return (
                f"decoder parameters: {scalars} scalars (within the {self.limit}-scalar "
                f"limit) need about {needed} with their gradients; "
                f"{_limit_text(self.limit_bytes, self.limit_source)}"
            )
        return (
            f"the machine ran out of memory while allocating the decoder's {scalars} "
            f"parameter scalars (about {needed} with their gradients)"
        )


@dataclass(eq=False)
class ActivationAllocationFailed(ResourceError):
    """A pass's working memory (activations, attention scores, logits, and for a loss its
    backward) is above the memory bound (``reason="memory-limit"``), or the machine ran out
    while computing anyway (``"out-of-memory"``). Checked after every input rule."""

    KIND: ClassVar[ErrorKind] = ErrorKind.ACTIVATION_ALLOCATION_FAILED
    operation: str
    batch: int
    tokens: int
    needed_bytes: int
    limit_bytes: int
    limit_source: str
    reason: ResourceReason = "memory-limit"

    def message(self) -> str:
        shape = f"{describe_count(self.batch)} x {describe_count(self.tokens)} tokens"
        needed = describe_bytes(self.needed_bytes)
        if self.reason == "memory-limit":
            return (
                f"{self.operation} over {shape} needs about {needed} of working memory; "
                f"{_limit_text(self.limit_bytes, self.limit_source)}"
            )
        return (
            f"the machine ran out of memory during {self.operation} over {shape} "
            f"(estimated at about {needed} of working memory; "
            f"{_limit_text(self.limit_bytes, self.limit_source)})"
        )


class ParameterLayoutError(DecoderModelError):
    """A named parameter list does not fit the configuration."""


@dataclass(eq=False)
class ParameterCountMismatch(ParameterLayoutError):
    """The list holds the wrong number of tensors."""

    KIND: ClassVar[ErrorKind] = ErrorKind.PARAMETER_COUNT_MISMATCH
    expected: int
    actual: int

    def message(self) -> str:
        return f"decoder parameter count must be {self.expected}, got {self.actual}"


@dataclass(eq=False)
class ParameterNameMismatch(ParameterLayoutError):
    """The tensor at ``index`` has the wrong name."""

    KIND: ClassVar[ErrorKind] = ErrorKind.PARAMETER_NAME_MISMATCH
    index: int
    expected: str
    actual: object

    def message(self) -> str:
        return (
            f"decoder parameter {self.index} must be named {self.expected!r}, got {self.actual!r}"
        )


@dataclass(eq=False)
class ParameterShapeMismatch(ParameterLayoutError):
    """The tensor at ``index`` has the wrong shape for the configuration."""

    KIND: ClassVar[ErrorKind] = ErrorKind.PARAMETER_SHAPE_MISMATCH
    index: int
    name: str
    expected: tuple[int, ...]
    actual: tuple[int, ...]

    def message(self) -> str:
        return (
            f"decoder parameter {self.index} ({self.name}) must have shape "
            f"{list(self.expected)}, got {list(self.actual)}"
        )


@dataclass(eq=False)
class ParameterDtype(ParameterLayoutError):
    """The tensor at ``index`` is not an array of real numbers."""

    KIND: ClassVar[ErrorKind] = ErrorKind.PARAMETER_DTYPE
    index: int
    name: str
    dtype: str

    def message(self) -> str:
        return (
            f"decoder parameter {self.index} ({self.name}) must hold real numbers "
            f"(integer or floating dtype), got dtype {self.dtype}"
        )


@dataclass(eq=False)
class ParameterNotFinite(ParameterLayoutError):
    """The tensor at ``index`` holds a NaN or an infinity."""

    KIND: ClassVar[ErrorKind] = ErrorKind.PARAMETER_NOT_FINITE
    index: int
    name: str
    position: int
    value: float

    def message(self) -> str:
        return (
            f"decoder parameter {self.index} ({self.name}) must be finite, "
            f"got {self.value!r} at flat position {self.position}"
        )


class TokenInputError(DecoderModelError):
    """A token or target array cannot be used with this model."""


@dataclass(eq=False)
class TokenDtype(TokenInputError):
    """The token IDs (or an explicit token shape) are not integers."""

    KIND: ClassVar[ErrorKind] = ErrorKind.TOKEN_DTYPE
    what: str
    expected: str
    actual: str

    def message(self) -> str:
        return f"decoder {self.what} must be {self.expected}, got {self.actual}"


@dataclass(eq=False)
class TokenRank(TokenInputError):
    """The token shape is not ``[batch, tokens]``."""

    KIND: ClassVar[ErrorKind] = ErrorKind.TOKEN_RANK
    rank: int

    def message(self) -> str:
        return f"decoder token shape must have rank two [batch, tokens], got rank {self.rank}"


@dataclass(eq=False)
class EmptyBatch(TokenInputError):
    """The batch has no sequences."""

    KIND: ClassVar[ErrorKind] = ErrorKind.EMPTY_BATCH

    def message(self) -> str:
        return "decoder batch must be nonempty, got batch=0"


@dataclass(eq=False)
class EmptyTokens(TokenInputError):
    """The sequences have no tokens."""

    KIND: ClassVar[ErrorKind] = ErrorKind.EMPTY_TOKENS

    def message(self) -> str:
        return "decoder token sequence must be nonempty, got tokens=0"


@dataclass(eq=False)
class ContextLengthExceeded(TokenInputError):
    """The sequence is longer than the context capacity."""

    KIND: ClassVar[ErrorKind] = ErrorKind.CONTEXT_LENGTH_EXCEEDED
    tokens: int
    context: int

    def message(self) -> str:
        return (
            f"decoder sequence length {describe_count(self.tokens)} exceeds context capacity "
            f"{describe_count(self.context)}"
        )


@dataclass(eq=False)
class TokenCountOverflow(TokenInputError):
    """``batch * tokens`` does not fit an index."""

    KIND: ClassVar[ErrorKind] = ErrorKind.TOKEN_COUNT_OVERFLOW
    batch: int
    tokens: int

    def message(self) -> str:
        return (
            f"decoder token count overflows for batch {describe_count(self.batch)} "
            f"and length {describe_count(self.tokens)}"
        )


@dataclass(eq=False)
class TokenCountMismatch(TokenInputError):
    """The flat ID list does not hold ``batch * tokens`` IDs."""

    KIND: ClassVar[ErrorKind] = ErrorKind.TOKEN_COUNT_MISMATCH
    expected: int
    actual: int

    def message(self) -> str:
        return (
            f"decoder token shape needs {describe_count(self.expected)} IDs, "
            f"but received {self.actual}"
        )


@dataclass(eq=False)
class TokenIdOutOfBounds(TokenInputError):
    """A token ID is negative or not below the vocabulary size."""

    KIND: ClassVar[ErrorKind] = ErrorKind.TOKEN_ID_OUT_OF_BOUNDS
    position: int
    id: int
    vocabulary_size: int

    def message(self) -> str:
        return (
            f"token ID {self.id} at flat position {self.position} is out of bounds "
            f"for vocabulary size {self.vocabulary_size}"
        )


@dataclass(eq=False)
class TargetDtype(TokenInputError):
    """The target IDs are not integers."""

    KIND: ClassVar[ErrorKind] = ErrorKind.TARGET_DTYPE
    expected: str
    actual: str

    def message(self) -> str:
        return f"decoder target IDs must be {self.expected}, got {self.actual}"


@dataclass(eq=False)
class TargetCountMismatch(TokenInputError):
    """The targets are not one per token (B*T target IDs, in any shape)."""

    KIND: ClassVar[ErrorKind] = ErrorKind.TARGET_COUNT_MISMATCH
    expected: int
    actual: int
    shape: tuple[int, ...]

    def message(self) -> str:
        return (
            f"decoder loss needs {self.expected} targets, one per token, but received "
            f"{self.actual} (target shape {list(self.shape)})"
        )


@dataclass(eq=False)
class TargetIdOutOfBounds(TokenInputError):
    """A target ID is negative or not below the vocabulary size."""

    KIND: ClassVar[ErrorKind] = ErrorKind.TARGET_ID_OUT_OF_BOUNDS
    position: int
    id: int
    vocabulary_size: int

    def message(self) -> str:
        return (
            f"target token ID {self.id} at flat position {self.position} is out of bounds "
            f"for vocabulary size {self.vocabulary_size}"
        )


@dataclass(eq=False)
class RmsZeroMeanSquare(DecoderModelError):
    """RMSNorm with epsilon 0 met a row whose mean square is exactly zero."""

    KIND: ClassVar[ErrorKind] = ErrorKind.RMS_ZERO_MEAN_SQUARE
    row: int

    def message(self) -> str:
        return (
            f"RMSNorm row {self.row} has mean square 0 and epsilon 0, "
            "so its inverse root is undefined"
        )


@dataclass(eq=False)
class BackwardSeedShape(DecoderModelError):
    """``backward`` was called on a non-scalar without a seed, or with a misshaped seed."""

    KIND: ClassVar[ErrorKind] = ErrorKind.BACKWARD_SEED_SHAPE
    expected: tuple[int, ...]
    actual: tuple[int, ...] | None

    def message(self) -> str:
        if self.actual is None:
            return f"backward without a seed needs a scalar root, got shape {list(self.expected)}"
        return (
            f"backward seed must have the root's shape {list(self.expected)}, "
            f"got {list(self.actual)}"
        )


@dataclass(eq=False)
class GraphReleased(DecoderModelError):
    """``backward`` reached a node whose saved arrays an earlier backward released."""

    KIND: ClassVar[ErrorKind] = ErrorKind.GRAPH_RELEASED
    operation: str

    def message(self) -> str:
        return (
            f"backward reached a '{self.operation}' node released by an earlier "
            "backward(retain_graph=False); run the forward pass again"
        )


@dataclass(eq=False)
class _WrappedFailure(DecoderModelError):
    """A component's refusal, reported with the component that raised it."""

    source: DecoderModelError

    @property
    def kind(self) -> ErrorKind:
        return self.source.kind


@dataclass(eq=False)
class BlockFailure(_WrappedFailure):
    """A decoder block refused its input; ``component`` names the sub-layer."""

    layer: int
    component: str

    def message(self) -> str:
        return f"decoder block {self.layer} {self.component}: {self.source}"


@dataclass(eq=False)
class FinalNormFailure(_WrappedFailure):
    """The final RMSNorm refused its input."""

    def message(self) -> str:
        return f"final RMSNorm: {self.source}"
