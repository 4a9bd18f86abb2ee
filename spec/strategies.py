"""Hypothesis strategies: valid inputs built by construction, invalid ones aimed at each rule.

Valid configurations draw the head count and an even head width and multiply, instead of
filtering, so failures shrink to small readable cases. Every strategy takes keyword-only
bounds, checked when the strategy is created.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from spec.config import DecoderConfig
from spec.errors import CONFIG_RULE_ORDER, ErrorKind
from spec.parameters import parameter_layout

__all__ = [
    "CONFIG_RULE_ORDER",
    "config_rule_pairs",
    "configs",
    "configs_breaking",
    "invalid_configs",
    "invalid_token_inputs",
    "perturbed_parameter_lists",
    "runs",
    "sample",
    "token_batches",
]

IdArray = npt.NDArray[np.int64]
ParameterList = list[tuple[str, Any]]
Drawn = TypeVar("Drawn")


def sample(strategy: st.SearchStrategy[Drawn], count: int, *, seed_value: int = 0) -> list[Drawn]:
    """``count`` examples of ``strategy``, the same ones for the same seed and hypothesis.

    For measurements outside a test (the tolerance survey): the same generators as the
    suite's properties, without a second, hand-rolled one. Not for use inside ``@given``.
    """
    _check_positive(count=count)
    drawn: list[Drawn] = []

    @seed(seed_value)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: Drawn) -> None:
        drawn.append(example)

    collect()
    return drawn


def _check_bounds(**bounds: tuple[int, int]) -> None:
    for name, (low, high) in bounds.items():
        if low > high:
            raise ValueError(f"min_{name}={low} is larger than max_{name}={high}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")


def configs(
    *,
    max_vocabulary: int = 9,
    max_heads: int = 4,
    max_head_width: int = 8,
    max_feed_forward: int = 12,
    min_layers: int = 0,
    max_layers: int = 3,
    max_context: int = 6,
    rope_bases: Sequence[float] = (10000.0, 100.0, 3.5),
    epsilons: Sequence[float] = (1e-6, 1e-5, 0.0),
) -> st.SearchStrategy[DecoderConfig]:
    """Valid configurations: width = heads x even head width, every bound inclusive."""
    _check_positive(
        max_vocabulary=max_vocabulary,
        max_heads=max_heads,
        max_feed_forward=max_feed_forward,
        max_context=max_context,
    )
    if max_head_width < 2:
        raise ValueError(f"max_head_width={max_head_width} must be at least 2 (RoPE pairs)")
    _check_bounds(layers=(min_layers, max_layers))
    if min_layers < 0:
        raise ValueError(f"min_layers={min_layers} must be at least 0")
    if not rope_bases or not epsilons:
        raise ValueError("rope_bases and epsilons must each offer at least one value")

    @st.composite
    def build(draw: st.DrawFn) -> DecoderConfig:
        heads = draw(st.integers(1, max_heads))
        head_width = 2 * draw(st.integers(1, max_head_width // 2))
        return DecoderConfig(
            vocabulary_size=draw(st.integers(1, max_vocabulary)),
            model_width=heads * head_width,
            heads=heads,
            feed_forward_width=draw(st.integers(1, max_feed_forward)),
            layers=draw(st.integers(min_layers, max_layers)),
            context=draw(st.integers(1, max_context)),
            rope_base=draw(st.sampled_from(list(rope_bases))),
            rms_epsilon=draw(st.sampled_from(list(epsilons))),
        )

    return build()


def token_batches(
    config: DecoderConfig, *, max_batch: int = 3, full_context: bool | None = None
) -> st.SearchStrategy[IdArray]:
    """``[B, T]`` valid token IDs; ``full_context=True`` forces T = context (late RoPE angles)."""
    _check_positive(max_batch=max_batch)

    @st.composite
    def build(draw: st.DrawFn) -> IdArray:
        batch = draw(st.integers(1, max_batch))
        if full_context is None:
            length = draw(st.one_of(st.integers(1, config.context), st.just(config.context)))
        else:
            length = config.context if full_context else draw(st.integers(1, config.context))
        ids = st.integers(0, config.vocabulary_size - 1)
        cells = draw(st.lists(ids, min_size=batch * length, max_size=batch * length))
        return np.asarray(cells, dtype=np.int64).reshape(batch, length)

    return build()


def runs(
    config: DecoderConfig, *, max_batch: int = 3
) -> st.SearchStrategy[tuple[IdArray, IdArray]]:
    """``(tokens, targets)`` pairs of equal ``[B, T]`` shape."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[IdArray, IdArray]:
        tokens = draw(token_batches(config, max_batch=max_batch))
        ids = st.integers(0, config.vocabulary_size - 1)
        cells = draw(st.lists(ids, min_size=tokens.size, max_size=tokens.size))
        return tokens, np.asarray(cells, dtype=np.int64).reshape(tokens.shape)

    return build()


_CONFIG_ORDER_WITH_TYPES = (ErrorKind.CONFIG_FIELD_TYPE, *CONFIG_RULE_ORDER)

# The fields each configuration rule reads: a wrong-typed field chosen outside them leaves
# that rule broken beside the type error.
_RULE_FIELDS: dict[ErrorKind, frozenset[str]] = {
    ErrorKind.EMPTY_VOCABULARY: frozenset({"vocabulary_size"}),
    ErrorKind.ZERO_MODEL_WIDTH: frozenset({"model_width"}),
    ErrorKind.ZERO_HEAD_COUNT: frozenset({"heads"}),
    ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE: frozenset({"model_width", "heads"}),
    ErrorKind.ODD_HEAD_WIDTH: frozenset({"model_width", "heads"}),
    ErrorKind.ZERO_FEED_FORWARD_WIDTH: frozenset({"feed_forward_width"}),
    ErrorKind.ZERO_CONTEXT_CAPACITY: frozenset({"context"}),
    ErrorKind.INVALID_ROPE_BASE: frozenset({"rope_base"}),
    ErrorKind.INVALID_RMS_EPSILON: frozenset({"rms_epsilon"}),
}


def _break(
    config: DecoderConfig, kind: ErrorKind, draw: st.DrawFn, *, keep: frozenset[str] = frozenset()
) -> DecoderConfig:
    """``config`` with rule ``kind`` broken and every other field untouched (a type error
    never lands on a field in ``keep``)."""
    replace = dataclasses.replace
    if kind is ErrorKind.EMPTY_VOCABULARY:
        return replace(config, vocabulary_size=0)
    if kind is ErrorKind.ZERO_MODEL_WIDTH:
        return replace(config, model_width=0)
    if kind is ErrorKind.ZERO_HEAD_COUNT:
        return replace(config, heads=0)
    if kind is ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE:
        return replace(config, heads=config.model_width + draw(st.integers(1, 3)))
    if kind is ErrorKind.ODD_HEAD_WIDTH:
        return replace(config, model_width=config.heads * (2 * draw(st.integers(0, 3)) + 1))
    if kind is ErrorKind.ZERO_FEED_FORWARD_WIDTH:
        return replace(config, feed_forward_width=0)
    if kind is ErrorKind.ZERO_CONTEXT_CAPACITY:
        return replace(config, context=0)
    if kind is ErrorKind.INVALID_ROPE_BASE:
        bad_bases = [0.0, -1.0, -1e-300, float("inf"), float("-inf"), float("nan")]
        return replace(config, rope_base=draw(st.sampled_from(bad_bases)))
    if kind is ErrorKind.INVALID_RMS_EPSILON:
        bad_epsilons = [-1e-6, -5e-324, float("inf"), float("-inf"), float("nan")]
        return replace(config, rms_epsilon=draw(st.sampled_from(bad_epsilons)))
    if kind is ErrorKind.CONFIG_FIELD_TYPE:
        fields = [f.name for f in dataclasses.fields(DecoderConfig) if f.name not in keep]
        field = draw(st.sampled_from(fields))
        integer_field = field not in ("rope_base", "rms_epsilon")
        wrong: list[object] = [True, "4", None]
        if integer_field:
            wrong += [float(getattr(config, field)), -1]
        return replace(config, **{field: draw(st.sampled_from(wrong))})
    raise ValueError(f"{kind} is not a configuration rule")


def invalid_configs(
    kind: ErrorKind | None = None, *, also_break_later: bool = True
) -> st.SearchStrategy[tuple[DecoderConfig, ErrorKind]]:
    """``(config, expected kind)``: rule ``kind`` (any rule when None) broken, earlier ones kept.

    With ``also_break_later`` some later rules are broken too, so the pair also tests the
    precedence: the expected kind is still the earliest broken rule.
    """
    order = _CONFIG_ORDER_WITH_TYPES
    if kind is not None and kind not in order:
        raise ValueError(f"kind={kind} is not a configuration rule; choose from {list(order)}")

    @st.composite
    def build(draw: st.DrawFn) -> tuple[DecoderConfig, ErrorKind]:
        config = draw(configs())
        target = kind if kind is not None else draw(st.sampled_from(order))
        later = list(order[order.index(target) + 1 :])
        extra = (
            draw(st.lists(st.sampled_from(later), unique=True, max_size=2))
            if also_break_later and later
            else []
        )
        # Later rules first, so the target's own change has the last word on shared fields;
        # a type error goes to a field none of them reads.
        for other in sorted(extra, key=order.index, reverse=True):
            config = _break(config, other, draw)
        kept = frozenset().union(*(_RULE_FIELDS[other] for other in extra))
        return _break(config, target, draw, keep=kept), target

    return build()


_TOKEN_CHOICES: dict[str, ErrorKind] = {
    "dtype": ErrorKind.TOKEN_DTYPE,
    "rank": ErrorKind.TOKEN_RANK,
    "batch": ErrorKind.EMPTY_BATCH,
    "empty": ErrorKind.EMPTY_TOKENS,
    "context": ErrorKind.CONTEXT_LENGTH_EXCEEDED,
    "count": ErrorKind.TOKEN_COUNT_MISMATCH,
    "id": ErrorKind.TOKEN_ID_OUT_OF_BOUNDS,
}


def _choices(table: dict[str, ErrorKind], kinds: Collection[ErrorKind] | None) -> list[str]:
    chosen = [name for name, kind in table.items() if kinds is None or kind in kinds]
    if not chosen:
        raise ValueError(f"kinds={sorted(kinds or [])} names none of {sorted(set(table.values()))}")
    return chosen


# Pairs no configuration breaks together: a zero width is divisible by any head count and
# has an even quotient, and with zero heads neither rule is defined.
_EXCLUSIVE_PAIRS = frozenset(
    (earlier, later)
    for earlier in (ErrorKind.ZERO_MODEL_WIDTH, ErrorKind.ZERO_HEAD_COUNT)
    for later in (ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE, ErrorKind.ODD_HEAD_WIDTH)
)


def config_rule_pairs() -> list[tuple[ErrorKind, ErrorKind]]:
    """Every ordered pair (earlier, later) of configuration rules that one configuration can
    break together, a field of the wrong type before each value rule included."""
    order = _CONFIG_ORDER_WITH_TYPES
    return [
        (a, b)
        for i, a in enumerate(order)
        for b in order[i + 1 :]
        if (a, b) not in _EXCLUSIVE_PAIRS
    ]


def configs_breaking(first: ErrorKind, second: ErrorKind) -> st.SearchStrategy[DecoderConfig]:
    """Configurations that break both rules; the earlier of the two must be reported."""
    order = _CONFIG_ORDER_WITH_TYPES
    if first not in order or second not in order or first == second:
        raise ValueError(f"{first} and {second} must be two configuration rules")
    later, earlier = sorted((first, second), key=order.index, reverse=True)
    if (earlier, later) in _EXCLUSIVE_PAIRS:
        raise ValueError(f"no configuration breaks both {earlier} and {later}")

    @st.composite
    def build(draw: st.DrawFn) -> DecoderConfig:
        config = draw(configs())
        if {earlier, later} == {ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE, ErrorKind.ODD_HEAD_WIDTH}:
            # Each rule's own break repairs the other; a width of heads * odd + remainder
            # breaks both (6 = 4 * 1 + 2: 6 % 4 != 0 and 6 // 4 is odd).
            heads = draw(st.integers(2, 6))
            quotient = 2 * draw(st.integers(0, 3)) + 1
            width = heads * quotient + draw(st.integers(1, heads - 1))
            return dataclasses.replace(config, heads=heads, model_width=width)
        # The later rule first, so the earlier one's change wins on shared fields; a type
        # error goes to a field the later rule does not read.
        broken = _break(config, later, draw)
        return _break(broken, earlier, draw, keep=_RULE_FIELDS[later])

    return build()


def invalid_token_inputs(
    config: DecoderConfig, *, kinds: Collection[ErrorKind] | None = None
) -> st.SearchStrategy[tuple[Any, tuple[int, int] | None, ErrorKind]]:
    """``(tokens, explicit shape or None, expected kind)`` aimed at one token rule each.

    ``kinds`` limits the rules aimed at (default: every token rule).
    """
    vocabulary, context = config.vocabulary_size, config.context
    choices = _choices(_TOKEN_CHOICES, kinds)

    @st.composite
    def build(draw: st.DrawFn) -> tuple[Any, tuple[int, int] | None, ErrorKind]:
        valid = draw(token_batches(config))
        choice = draw(st.sampled_from(choices))
        if choice == "dtype":
            return valid.astype(np.float64), None, ErrorKind.TOKEN_DTYPE
        if choice == "rank":
            reshaped = valid.reshape(-1) if draw(st.booleans()) else valid[None]
            return reshaped, None, ErrorKind.TOKEN_RANK
        if choice == "batch":
            return np.zeros((0, valid.shape[1]), dtype=np.int64), None, ErrorKind.EMPTY_BATCH
        if choice == "empty":
            return np.zeros((valid.shape[0], 0), dtype=np.int64), None, ErrorKind.EMPTY_TOKENS
        if choice == "context":
            length = context + draw(st.integers(1, 3))
            ids = draw(st.integers(-2, vocabulary + 2))  # even bad IDs: context comes first
            return np.full((valid.shape[0], length), ids), None, ErrorKind.CONTEXT_LENGTH_EXCEEDED
        if choice == "count":
            flat = valid.reshape(-1)
            trimmed = (
                flat[: draw(st.integers(0, flat.size - 1))]
                if draw(st.booleans())
                else np.concatenate([flat, flat[:1]])
            )
            return (
                trimmed,
                (int(valid.shape[0]), int(valid.shape[1])),
                ErrorKind.TOKEN_COUNT_MISMATCH,
            )
        bad = valid.copy()
        position = draw(st.integers(0, bad.size - 1))
        bad.flat[position] = draw(st.sampled_from([-1, vocabulary, vocabulary + 7, -(2**31)]))
        return bad, None, ErrorKind.TOKEN_ID_OUT_OF_BOUNDS

    return build()


_PARAMETER_CHOICES: dict[str, ErrorKind] = {
    "missing": ErrorKind.PARAMETER_COUNT_MISMATCH,
    "extra": ErrorKind.PARAMETER_COUNT_MISMATCH,
    "renamed": ErrorKind.PARAMETER_NAME_MISMATCH,
    "swapped": ErrorKind.PARAMETER_NAME_MISMATCH,
    "misshaped": ErrorKind.PARAMETER_SHAPE_MISMATCH,
    "non-finite": ErrorKind.PARAMETER_NOT_FINITE,
}


def perturbed_parameter_lists(
    config: DecoderConfig,
    entries: Sequence[tuple[str, Any]],
    *,
    kinds: Collection[ErrorKind] | None = None,
) -> st.SearchStrategy[tuple[ParameterList, ErrorKind]]:
    """``(entries, expected kind)``: one tensor missing, added, renamed, swapped, misshaped,
    or holding a non-finite value."""
    layout = parameter_layout(config)
    if [name for name, _ in entries] != [name for name, _ in layout]:
        raise ValueError("entries must be a valid stable-order parameter list for config")
    choices = _choices(_PARAMETER_CHOICES, kinds)
    if choices == ["swapped"] and len(entries) < 2:
        raise ValueError("a swap needs at least two tensors")

    @st.composite
    def build(draw: st.DrawFn) -> tuple[ParameterList, ErrorKind]:
        listed: ParameterList = [
            (name, np.array(value, dtype=np.float64)) for name, value in entries
        ]
        index = draw(st.integers(0, len(listed) - 1))
        name, value = listed[index]
        choice = draw(st.sampled_from(choices))
        if choice == "missing":
            del listed[index]
            return listed, ErrorKind.PARAMETER_COUNT_MISMATCH
        if choice == "extra":
            listed.insert(
                index, ("lm_head.weight", np.zeros((config.vocabulary_size, config.model_width)))
            )
            return listed, ErrorKind.PARAMETER_COUNT_MISMATCH
        if choice == "renamed":
            listed[index] = (
                draw(st.sampled_from([name + "_x", "lm_head.weight", name.upper(), ""])),
                value,
            )
            return listed, ErrorKind.PARAMETER_NAME_MISMATCH
        if choice == "swapped" and len(listed) > 1:
            other = draw(st.integers(0, len(listed) - 1).filter(lambda i: listed[i][0] != name))
            listed[index], listed[other] = listed[other], listed[index]
            return listed, ErrorKind.PARAMETER_NAME_MISMATCH
        if choice == "misshaped":
            grown = (
                tuple(size + 1 for size in value.shape)
                if draw(st.booleans())
                else (*value.shape[::-1], 1)
            )
            listed[index] = (name, np.zeros(grown))
            return listed, ErrorKind.PARAMETER_SHAPE_MISMATCH
        broken = value.copy()
        broken.flat[draw(st.integers(0, broken.size - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf])
        )
        listed[index] = (name, broken)
        return listed, ErrorKind.PARAMETER_NOT_FINITE

    return build()
