"""The expected refusal for any input: which error kind comes first, and with what values.

These are the spec's own statements of the validation order in RECIPE.md, written as
ordered tables of checks. They are independent of any implementation, which is why a
backend (the reference included) can be judged against them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from spec.config import REAL_FIELDS, SIZE_FIELDS, DecoderConfig
from spec.errors import ErrorKind
from spec.parameters import parameter_layout, tensor_count

__all__ = [
    "MAX_INDEX",
    "MAX_SEED",
    "Violation",
    "broken_config_rules",
    "config_violation",
    "is_float64_representable",
    "loss_violation",
    "rebuild_violation",
    "seed_violation",
    "token_violation",
]

# The largest token count: the seed counts B*T in its 64-bit unsigned size (usize on a 64-bit
# machine), so a product beyond 2**64 - 1 overflows.
MAX_INDEX = 2**64 - 1
# The largest seed: SplitMix64's whole state is one unsigned 64-bit integer.
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class Violation:
    """The first rule an input breaks: its kind and the values a message should name."""

    kind: ErrorKind
    details: Mapping[str, Any] = field(default_factory=dict)


def _is_size(value: object) -> TypeGuard[int | np.integer[Any]]:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_real(value: object) -> TypeGuard[int | float | np.integer[Any] | np.floating[Any]]:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def is_float64_representable(value: int | float | np.integer[Any] | np.floating[Any]) -> bool:
    """Whether a real converts to a float64 without overflowing (a Python int can be any
    size; the seed's reals are ``f64``, so 10**400 is a wrong-typed field, not a huge one)."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


# Checked in this order once every field has the right type (RECIPE.md).
_CONFIG_CHECKS: tuple[tuple[ErrorKind, Callable[[DecoderConfig], bool]], ...] = (
    (ErrorKind.EMPTY_VOCABULARY, lambda c: c.vocabulary_size == 0),
    (ErrorKind.ZERO_MODEL_WIDTH, lambda c: c.model_width == 0),
    (ErrorKind.ZERO_HEAD_COUNT, lambda c: c.heads == 0),
    (ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE, lambda c: c.model_width % c.heads != 0),
    (ErrorKind.ODD_HEAD_WIDTH, lambda c: (c.model_width // c.heads) % 2 != 0),
    (ErrorKind.ZERO_FEED_FORWARD_WIDTH, lambda c: c.feed_forward_width == 0),
    (ErrorKind.ZERO_CONTEXT_CAPACITY, lambda c: c.context == 0),
    (ErrorKind.INVALID_ROPE_BASE, lambda c: not (math.isfinite(c.rope_base) and c.rope_base > 0)),
    (
        ErrorKind.INVALID_RMS_EPSILON,
        lambda c: not (math.isfinite(c.rms_epsilon) and c.rms_epsilon >= 0),
    ),
)


def config_violation(config: DecoderConfig) -> Violation | None:
    """The first configuration rule ``config`` breaks, or None; depth 0 is no exemption."""
    for name in SIZE_FIELDS:
        value = getattr(config, name)
        if not _is_size(value) or value < 0:
            return Violation(ErrorKind.CONFIG_FIELD_TYPE, {"field": name, "actual": value})
    for name in REAL_FIELDS:
        value = getattr(config, name)
        if not _is_real(value) or not is_float64_representable(value):
            return Violation(ErrorKind.CONFIG_FIELD_TYPE, {"field": name, "actual": value})
    # Python ints from here on: a numpy size next to a huge Python int would overflow.
    exact = dataclasses.replace(
        config, **{name: int(getattr(config, name)) for name in SIZE_FIELDS}
    )
    for kind, broken in _CONFIG_CHECKS:
        if broken(exact):
            return Violation(kind)
    return None


def broken_config_rules(config: DecoderConfig) -> list[ErrorKind]:
    """Every value rule of the configuration that ``config`` breaks, in the documented order,
    whatever comes first (a rule that cannot be evaluated, as divisibility with zero heads or
    a rule over a wrong-typed field, is not counted): which rules a test input breaks at once.
    """
    broken = []
    for kind, rule_broken in _CONFIG_CHECKS:
        try:
            if rule_broken(config):
                broken.append(kind)
        except (TypeError, ValueError, ZeroDivisionError, OverflowError):
            continue
    return broken


def seed_violation(seed: object) -> Violation | None:
    """The seed's refusal, or None: an integer (numpy's too, never a bool) in [0, 2**64 - 1].

    A configuration is checked before its seed, as the seed's program validates its
    configuration before it reads anything else.
    """
    if not _is_size(seed) or not 0 <= int(seed) <= MAX_SEED:
        return Violation(ErrorKind.INVALID_SEED, {"field": "seed", "actual": seed})
    return None


def _first_outside(ids: np.ndarray[Any, Any], vocabulary_size: int) -> int | None:
    flat = ids.reshape(-1)
    bad = np.flatnonzero((flat < 0) | (flat >= vocabulary_size))
    return int(bad[0]) if bad.size else None


def _integer_array(values: object) -> np.ndarray[Any, Any] | None:
    try:
        array = np.asarray(values)
    except (ValueError, TypeError):
        return None
    if array.dtype.kind not in "iu" and array.size:
        return None
    return array


def _token_shape_violation(
    config: DecoderConfig, tokens: object, shape: Sequence[int] | None
) -> tuple[Violation | None, np.ndarray[Any, Any] | None]:
    """The first token rule broken before any ID is looked at, and the ID array when none is."""
    array = _integer_array(tokens)
    if array is None:
        return Violation(ErrorKind.TOKEN_DTYPE), None
    if shape is not None and not all(_is_size(size) and size >= 0 for size in shape):
        return Violation(ErrorKind.TOKEN_DTYPE, {"shape": tuple(shape)}), None
    dims = tuple(array.shape) if shape is None else tuple(int(size) for size in shape)
    if len(dims) != 2:
        return Violation(ErrorKind.TOKEN_RANK, {"rank": len(dims)}), None
    batch, length = dims
    ordered: tuple[tuple[bool, ErrorKind, dict[str, Any]], ...] = (
        (batch == 0, ErrorKind.EMPTY_BATCH, {}),
        (length == 0, ErrorKind.EMPTY_TOKENS, {}),
        (
            length > config.context,
            ErrorKind.CONTEXT_LENGTH_EXCEEDED,
            {"tokens": length, "context": config.context},
        ),
        (
            batch * length > MAX_INDEX,
            ErrorKind.TOKEN_COUNT_OVERFLOW,
            {"batch": batch, "tokens": length},
        ),
        (
            array.size != batch * length,
            ErrorKind.TOKEN_COUNT_MISMATCH,
            {"expected": batch * length, "actual": int(array.size)},
        ),
    )
    for broken, kind, details in ordered:
        if broken:
            return Violation(kind, details), None
    return None, array


def _token_id_violation(config: DecoderConfig, ids: np.ndarray[Any, Any]) -> Violation | None:
    position = _first_outside(ids, config.vocabulary_size)
    if position is None:
        return None
    return Violation(
        ErrorKind.TOKEN_ID_OUT_OF_BOUNDS,
        {"position": position, "id": int(ids.reshape(-1)[position])},
    )


def token_violation(
    config: DecoderConfig, tokens: object, shape: Sequence[int] | None = None
) -> Violation | None:
    """The first token rule broken: dtype, rank, batch, length, context, overflow, count, ID."""
    problem, ids = _token_shape_violation(config, tokens, shape)
    if problem is not None or ids is None:
        return problem
    return _token_id_violation(config, ids)


def loss_violation(
    config: DecoderConfig, tokens: object, targets: object, shape: Sequence[int] | None = None
) -> Violation | None:
    """The seed's loss order: the token shape rules (dtype to count), then target dtype,
    target count, the first bad target ID, and only then the first bad token ID.

    The seed's ``loss`` validates the token shape, then its targets, and only then runs the
    forward pass, whose embedding lookup checks the token IDs. Targets are counted, not
    shaped: the seed receives them as one flat list, so any array of B*T IDs is one target
    per token.
    """
    problem, ids = _token_shape_violation(config, tokens, shape)
    if problem is not None or ids is None:
        return problem
    batch, length = tuple(shape) if shape is not None else ids.shape
    array = _integer_array(targets)
    if array is None:
        return Violation(ErrorKind.TARGET_DTYPE)
    expected = batch * length
    if array.size != expected:
        return Violation(
            ErrorKind.TARGET_COUNT_MISMATCH, {"expected": expected, "actual": int(array.size)}
        )
    position = _first_outside(array, config.vocabulary_size)
    if position is not None:
        return Violation(
            ErrorKind.TARGET_ID_OUT_OF_BOUNDS,
            {"position": position, "id": int(array.reshape(-1)[position])},
        )
    return _token_id_violation(config, ids)


def _as_pair(entry: object) -> tuple[object, object]:
    """``(name, value)`` of a list entry; an entry that is no pair has no name."""
    if isinstance(entry, tuple | list) and len(entry) == 2:
        return entry[0], entry[1]
    return None, None


def rebuild_violation(config: DecoderConfig, listed: Sequence[object]) -> Violation | None:
    """Configuration, tensor count, every name, every shape, every dtype, every value."""
    entries = [_as_pair(entry) for entry in listed]
    problem = config_violation(config)
    if problem is not None:
        return problem
    # Counted before the layout is listed: a huge depth must not build a huge list.
    expected_count = tensor_count(config.layers)
    if len(entries) != expected_count:
        return Violation(
            ErrorKind.PARAMETER_COUNT_MISMATCH, {"expected": expected_count, "actual": len(entries)}
        )
    layout = parameter_layout(config)
    for index, ((name, _), (expected, _)) in enumerate(zip(entries, layout, strict=True)):
        if name != expected:
            return Violation(
                ErrorKind.PARAMETER_NAME_MISMATCH, {"index": index, "expected": expected}
            )
    arrays: list[np.ndarray[Any, Any]] = []
    for index, ((_, value), (name, shape)) in enumerate(zip(entries, layout, strict=True)):
        try:
            array = np.asarray(value)
        except (ValueError, TypeError):
            return Violation(ErrorKind.PARAMETER_DTYPE, {"index": index, "name": name})
        if tuple(array.shape) != shape:
            return Violation(
                ErrorKind.PARAMETER_SHAPE_MISMATCH,
                {"index": index, "expected": shape, "actual": tuple(array.shape)},
            )
        arrays.append(array)
    for index, (array, (name, _)) in enumerate(zip(arrays, layout, strict=True)):
        if array.dtype.kind not in "iuf":
            return Violation(ErrorKind.PARAMETER_DTYPE, {"index": index, "name": name})
    for index, array in enumerate(arrays):
        bad = np.flatnonzero(~np.isfinite(array.astype(np.float64)))
        if bad.size:
            return Violation(
                ErrorKind.PARAMETER_NOT_FINITE, {"index": index, "position": int(bad[0])}
            )
    return None
