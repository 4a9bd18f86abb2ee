"""Error taxonomy: every way a decoder call can be refused, grouped by category.

The kinds mirror the failures the seed's ``DecoderModelError`` names, plus the few a
dynamically typed language adds (a float where an integer belongs, a non-integer token
array, a seed that is no 64-bit unsigned integer). Implementations report a kind by its
string value, so the values are stable.

The order in which an entry point checks its inputs:

- building from a seed: the configuration, then the seed (or stream), then the resources
  the parameters need, and only then is anything drawn;
- rebuilding from a parameter list: the configuration, then the parameter layout (count,
  names, shapes, dtypes, values), then the resources;
- a forward pass: the token shape (dtype, rank, batch, length, context, overflow, count),
  then the token IDs, then the working memory (resource), last before computing; the loss:
  the token shape, the targets, the token IDs, then the working memory;
- numeric refusals come while computing, tape refusals from ``backward``.
"""

from __future__ import annotations

import operator
from enum import StrEnum
from typing import SupportsIndex

__all__ = [
    "ADAPTER_KINDS",
    "CONFIG_RULE_ORDER",
    "ErrorCategory",
    "ErrorKind",
    "describe_bytes",
    "describe_count",
    "describe_value",
]


class ErrorCategory(StrEnum):
    """The broad class of a refusal, in the order a caller usually meets them (resources
    twice: the parameters' when a model is built, the working memory's before a pass)."""

    CONFIGURATION = "configuration"
    SEED = "seed"
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
    # The seed (or a stream's state), checked after the configuration: SplitMix64's state
    # is one unsigned 64-bit integer.
    INVALID_SEED = "invalid-seed"
    # Resources: sizes whose products cannot be represented or allocated. The parameters'
    # are checked when a model is built; the working memory's after every input check of a
    # forward pass or loss, last before computing.
    PARAMETER_ALLOCATION_FAILED = "parameter-allocation-failed"
    ACTIVATION_ALLOCATION_FAILED = "activation-allocation-failed"
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
    ErrorKind.INVALID_SEED: ErrorCategory.SEED,
    ErrorKind.PARAMETER_ALLOCATION_FAILED: ErrorCategory.RESOURCE,
    ErrorKind.ACTIVATION_ALLOCATION_FAILED: ErrorCategory.RESOURCE,
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


# An int with more digits than this is shown by its magnitude: a message stays one readable
# line, and Python refuses to turn an int of more than 4300 digits into a string at all.
_SHOWN_DIGITS = 40


def describe_count(value: SupportsIndex) -> str:
    """An int (numpy's too) for an error message: its digits, or a huge one by its
    magnitude (``about 10^400``)."""
    count = operator.index(value)
    # bit_length * log10(2) counts the digits without converting (exact to one digit).
    digits = int(abs(count).bit_length() * 0.30103) + 1
    if digits <= _SHOWN_DIGITS:
        return str(count)
    return f"about {'-' if count < 0 else ''}10^{digits - 1}"


def describe_value(value: object) -> str:
    """``value`` for an error message: its type name and repr, a huge int by its magnitude
    (``int of about 10^400``)."""
    if isinstance(value, int) and not isinstance(value, bool):  # numpy ints print as they are
        shown = describe_count(value)
        return f"int {shown}" if shown.lstrip("-").isdigit() else f"int of {shown}"
    return f"{type(value).__name__} {value!r}"


_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def describe_bytes(count: int) -> str:
    """``count`` bytes for a message: ``512 bytes``, ``7.2 TiB``, ``about 10^40 bytes``."""
    if count < 1024:
        return f"{count} bytes"
    for power, unit in enumerate(_BYTE_UNITS, start=1):
        if count < 1024 ** (power + 1):
            return f"{count / 1024**power:.1f} {unit}"
    # Past 1024 EiB only the magnitude means anything (and the int may not fit a float).
    return f"about 10^{int(count.bit_length() * 0.30103)} bytes"


# The kinds a backend is asked for through an adapter: all but the reference tape's own.
ADAPTER_KINDS: tuple[ErrorKind, ...] = tuple(
    kind for kind in ErrorKind if kind.category is not ErrorCategory.TAPE
)
