"""Error taxonomy: every way a decoder call can be refused, grouped by category.

The kinds mirror the failures the seed's ``DecoderModelError`` names, plus the few a
dynamically typed language adds (a float where an integer belongs, a non-integer token
array). Implementations report a kind by its string value, so the values are stable.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["CONFIG_RULE_ORDER", "ErrorCategory", "ErrorKind"]


class ErrorCategory(StrEnum):
    """The broad class of a refusal, in the order a caller usually meets them."""

    CONFIGURATION = "configuration"
    RESOURCE = "resource"
    PARAMETER_LAYOUT = "parameter-layout"
    TOKEN_SHAPE = "token-shape"
    CONTEXT = "context"
    VOCABULARY_INPUT = "vocabulary-input"
    TARGET_SHAPE = "target-shape"
    TARGET_ID = "target-id"
    NUMERIC = "numeric"
    TAPE = "tape"


class ErrorKind(StrEnum):
    """One specific refusal; ``kind.category`` gives its category."""

    # Configuration, checked in this order even when the depth is zero.
    CONFIG_FIELD_TYPE = "config-field-type"
    EMPTY_VOCABULARY = "empty-vocabulary"
    ZERO_MODEL_WIDTH = "zero-model-width"
    ZERO_HEAD_COUNT = "zero-head-count"
    MODEL_WIDTH_NOT_DIVISIBLE = "model-width-not-divisible"
    ODD_HEAD_WIDTH = "odd-head-width"
    ZERO_FEED_FORWARD_WIDTH = "zero-feed-forward-width"
    ZERO_CONTEXT_CAPACITY = "zero-context-capacity"
    INVALID_ROPE_BASE = "invalid-rope-base"
    INVALID_RMS_EPSILON = "invalid-rms-epsilon"
    # Resources: sizes whose products cannot be represented or allocated.
    PARAMETER_ALLOCATION_FAILED = "parameter-allocation-failed"
    # Rebuilding from a named parameter list.
    PARAMETER_COUNT_MISMATCH = "parameter-count-mismatch"
    PARAMETER_NAME_MISMATCH = "parameter-name-mismatch"
    PARAMETER_SHAPE_MISMATCH = "parameter-shape-mismatch"
    PARAMETER_DTYPE = "parameter-dtype"
    PARAMETER_NOT_FINITE = "parameter-not-finite"
    # Token arrays.
    TOKEN_DTYPE = "token-dtype"
    TOKEN_RANK = "token-rank"
    EMPTY_BATCH = "empty-batch"
    EMPTY_TOKENS = "empty-tokens"
    CONTEXT_LENGTH_EXCEEDED = "context-length-exceeded"
    TOKEN_COUNT_OVERFLOW = "token-count-overflow"
    TOKEN_COUNT_MISMATCH = "token-count-mismatch"
    TOKEN_ID_OUT_OF_BOUNDS = "token-id-out-of-bounds"
    # Targets of the loss.
    TARGET_DTYPE = "target-dtype"
    TARGET_COUNT_MISMATCH = "target-count-mismatch"
    TARGET_ID_OUT_OF_BOUNDS = "target-id-out-of-bounds"
    # Numerics: RMSNorm with epsilon 0 over a row whose mean square is exactly 0.
    RMS_ZERO_MEAN_SQUARE = "rms-zero-mean-square"
    # Misuse of the autodiff tape.
    BACKWARD_SEED_SHAPE = "backward-seed-shape"
    GRAPH_RELEASED = "graph-released"

    @property
    def category(self) -> ErrorCategory:
        """The category this kind belongs to."""
        return _CATEGORY_OF[self]


# The configuration rules in the order they are checked, once every field has its type.
CONFIG_RULE_ORDER: tuple[ErrorKind, ...] = (
    ErrorKind.EMPTY_VOCABULARY,
    ErrorKind.ZERO_MODEL_WIDTH,
    ErrorKind.ZERO_HEAD_COUNT,
    ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE,
    ErrorKind.ODD_HEAD_WIDTH,
    ErrorKind.ZERO_FEED_FORWARD_WIDTH,
    ErrorKind.ZERO_CONTEXT_CAPACITY,
    ErrorKind.INVALID_ROPE_BASE,
    ErrorKind.INVALID_RMS_EPSILON,
)

_CATEGORY_OF: dict[ErrorKind, ErrorCategory] = {
    **{
        kind: ErrorCategory.CONFIGURATION
        for kind in (ErrorKind.CONFIG_FIELD_TYPE, *CONFIG_RULE_ORDER)
    },
    ErrorKind.PARAMETER_ALLOCATION_FAILED: ErrorCategory.RESOURCE,
    **{
        kind: ErrorCategory.PARAMETER_LAYOUT
        for kind in (
            ErrorKind.PARAMETER_COUNT_MISMATCH,
            ErrorKind.PARAMETER_NAME_MISMATCH,
            ErrorKind.PARAMETER_SHAPE_MISMATCH,
            ErrorKind.PARAMETER_DTYPE,
            ErrorKind.PARAMETER_NOT_FINITE,
        )
    },
    **{
        kind: ErrorCategory.TOKEN_SHAPE
        for kind in (
            ErrorKind.TOKEN_DTYPE,
            ErrorKind.TOKEN_RANK,
            ErrorKind.EMPTY_BATCH,
            ErrorKind.EMPTY_TOKENS,
            ErrorKind.TOKEN_COUNT_OVERFLOW,
            ErrorKind.TOKEN_COUNT_MISMATCH,
        )
    },
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: ErrorCategory.CONTEXT,
    ErrorKind.TOKEN_ID_OUT_OF_BOUNDS: ErrorCategory.VOCABULARY_INPUT,
    ErrorKind.TARGET_DTYPE: ErrorCategory.TARGET_SHAPE,
    ErrorKind.TARGET_COUNT_MISMATCH: ErrorCategory.TARGET_SHAPE,
    ErrorKind.TARGET_ID_OUT_OF_BOUNDS: ErrorCategory.TARGET_ID,
    ErrorKind.RMS_ZERO_MEAN_SQUARE: ErrorCategory.NUMERIC,
    ErrorKind.BACKWARD_SEED_SHAPE: ErrorCategory.TAPE,
    ErrorKind.GRAPH_RELEASED: ErrorCategory.TAPE,
}
