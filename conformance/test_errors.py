"""Refusals: configuration, tokens, targets and parameter lists, each with its kind and order."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapter import Backend, Capability, Refusal, call_build_seeded
from conformance.cases import Scenario, scenarios
from conformance.checks import Case, Judge
from conformance.coverage import RECORDER
from conformance.guard import AdapterFault
from conformance.profiles import suite_settings
from spec.config import FIXTURE, DecoderConfig
from spec.errors import ErrorCategory, ErrorKind
from spec.oracle import oracle_rows, to_float64
from spec.parameters import EMBEDDING_NAME
from spec.recipe import initial_parameters
from spec.strategies import (
    CONFIG_RULE_ORDER,
    config_rule_pairs,
    configs_breaking,
    invalid_configs,
    invalid_token_inputs,
    perturbed_parameter_lists,
)
from spec.tolerances import ToleranceModel
from spec.validation import config_violation, rebuild_violation, token_violation
from spec.variants import scenario_parameters

CONFIG_KINDS = (ErrorKind.CONFIG_FIELD_TYPE, *CONFIG_RULE_ORDER)
TOKEN_SHAPE_KINDS = (
    ErrorKind.TOKEN_DTYPE,
    ErrorKind.TOKEN_RANK,
    ErrorKind.EMPTY_BATCH,
    ErrorKind.EMPTY_TOKENS,
)


def _refuse_build(
    backend: Backend, judge: Judge, config: DecoderConfig, expected: ErrorKind
) -> None:
    # Configuration is checked before anything else, so the parameter list does not matter.
    judge.on(Case(config, call="backend.build(config, [])")).refused(
        lambda: backend.build(config, []), expected
    )
    if Capability.SEEDED_INIT in backend.capabilities:
        seeded = judge.on(Case(config, call="backend.build_seeded(config, 0)"))
        seeded.refused(lambda: call_build_seeded(backend, config, 0), expected)


@pytest.mark.rule("ERR-CONFIG-KIND")
@pytest.mark.parametrize("kind", CONFIG_KINDS, ids=str)
@suite_settings()
@given(data=st.data())
def test_each_configuration_rule_has_its_kind(
    backend: Backend, judge: Judge, kind: ErrorKind, data: st.DataObject
) -> None:
    config, expected = data.draw(invalid_configs(kind, also_break_later=False))
    _refuse_build(backend, judge, config, expected)


@pytest.mark.rule("ERR-CONFIG-ORDER")
@pytest.mark.parametrize(("earlier", "later"), config_rule_pairs(), ids=str)
@suite_settings(cost=5)
@given(data=st.data())
def test_first_broken_configuration_rule_wins(
    backend: Backend, judge: Judge, earlier: ErrorKind, later: ErrorKind, data: st.DataObject
) -> None:
    """Every pair of configuration rules, broken together: the earlier one is reported."""
    config = data.draw(configs_breaking(earlier, later))
    expected = config_violation(config)
    assert expected is not None  # the spec itself must see a violation here
    _refuse_build(backend, judge, config, expected.kind)


@pytest.mark.rule("ERR-CONFIG-DEPTH0")
@suite_settings()
@given(pair=invalid_configs())
def test_zero_block_configuration_is_validated(
    backend: Backend, judge: Judge, pair: tuple[DecoderConfig, ErrorKind]
) -> None:
    config, expected = pair
    if (
        isinstance(config.layers, int)
        and config.layers >= 0
        and expected is not ErrorKind.CONFIG_FIELD_TYPE
    ):
        config = dataclasses.replace(config, layers=0)
    _refuse_build(backend, judge, config, expected)


@pytest.mark.rule("CONFIG-VALID-BUILDS")
@suite_settings()
@given(scenario=scenarios())
def test_valid_configurations_build_and_run(
    backend: Backend, judge: Judge, scenario: Scenario
) -> None:
    check = judge.on(scenario.case())
    model = scenario.build(backend, exercise_departures=True)  # depth 0 is this rule's subject
    logits = backend.forward(model, scenario.tokens).logits
    check.check(bool(np.all(np.isfinite(logits))), "logits all finite", False, True)


@pytest.mark.rule("ERR-TOKEN-SHAPE")
@suite_settings()
@given(scenario=scenarios(), data=st.data())
def test_malformed_token_arrays_are_refused(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    tokens, shape, expected = data.draw(
        invalid_token_inputs(scenario.config, kinds=TOKEN_SHAPE_KINDS)
    )
    model = scenario.build(backend)
    check = judge.on(
        dataclasses.replace(
            scenario.case("backend.forward(model, tokens, shape)"),
            tokens=tokens,
            notes={"shape": shape},
        )
    )
    check.refused(lambda: backend.forward(model, tokens, shape), expected)
    # A declared shape that is no pair of non-negative integers: numpy's reshape would infer
    # a -1 and run, and a float size of a whole number would pass for one.
    flat = scenario.tokens.reshape(-1)
    batch, length = scenario.tokens.shape
    for bad_shape in [(-1, length), (batch, -1), (float(batch), length), (batch, length + 0.5)]:
        case = scenario.case("backend.forward(model, tokens, shape)")
        shape_check = judge.on(dataclasses.replace(case, tokens=flat, notes={"shape": bad_shape}))
        shape_check.refused(
            functools.partial(backend.forward, model, flat, bad_shape),
            ErrorKind.TOKEN_DTYPE,
            what=f"refusal kind for shape={bad_shape}",
            reason="a declared shape holds non-negative integers",
        )


@pytest.mark.rule("ERR-CONTEXT-LIMIT")
@suite_settings()
@given(scenario=scenarios(), extra=st.integers(1, 3))
def test_context_capacity_is_enforced(
    backend: Backend, judge: Judge, scenario: Scenario, extra: int
) -> None:
    config, model = scenario.config, scenario.build(backend)
    full = np.zeros((scenario.tokens.shape[0], config.context), dtype=np.int64)
    try:
        backend.forward(model, full)
    except Exception as error:  # exactly as long as the context must be accepted
        judge.on(dataclasses.replace(scenario.case(), tokens=full)).fail(
            f"forward at the full context of {config.context}", repr(error), "accepted"
        )
    too_long = np.zeros((scenario.tokens.shape[0], config.context + extra), dtype=np.int64)
    check = judge.on(dataclasses.replace(scenario.case(), tokens=too_long))
    check.refused(
        lambda: backend.forward(model, too_long),
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        tokens=config.context + extra,
        context=config.context,
    )


def out_of_vocabulary_ids(vocabulary: int) -> list[int]:
    """IDs outside [0, V): V and past it, -1 (numpy indexing wraps it to the last row) and
    2**32 (a cast to int32, llama.cpp's token type, reads it as ID 0)."""
    return [vocabulary, vocabulary + 3, 2**32, -1]


@pytest.mark.rule("ERR-TOKEN-ID")
@suite_settings()
@given(scenario=scenarios(), data=st.data())
def test_out_of_vocabulary_token_names_its_position(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    """Every kind of bad ID is tried, at one or two drawn positions (the first is named)."""
    positions = sorted(
        data.draw(st.sets(st.integers(0, scenario.tokens.size - 1), min_size=1, max_size=2))
    )
    model = scenario.build(backend)
    for bad_id in out_of_vocabulary_ids(scenario.config.vocabulary_size):
        tokens = scenario.tokens.copy()
        tokens.flat[positions] = bad_id
        check = judge.on(dataclasses.replace(scenario.case(bad_id=bad_id), tokens=tokens))
        refusal = check.refused(
            functools.partial(backend.forward, model, tokens),
            ErrorKind.TOKEN_ID_OUT_OF_BOUNDS,
            position=positions[0],
        )
        check.check(
            refusal.kind.category is ErrorCategory.VOCABULARY_INPUT,
            "category",
            refusal.kind.category,
            ErrorCategory.VOCABULARY_INPUT,
        )


@pytest.mark.rule("ERR-TOKEN-ORDER")
@suite_settings()
@given(scenario=scenarios(), data=st.data())
def test_token_checks_run_in_order(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    tokens, shape, expected = data.draw(invalid_token_inputs(scenario.config))
    model = scenario.build(backend)
    for bad, bad_shape, kind in [(tokens, shape, expected), *_token_rule_pairs(scenario)]:
        case = scenario.case("backend.forward(model, tokens, shape)")
        check = judge.on(dataclasses.replace(case, tokens=bad, notes={"shape": bad_shape}))
        check.refused(functools.partial(backend.forward, model, bad, bad_shape), kind)


def _token_rule_pairs(scenario: Scenario) -> list[tuple[Any, tuple[int, int] | None, ErrorKind]]:
    """Inputs that break two token rules at once, with the earlier rule's kind: every pair of
    dtype, rank, batch, length, context, overflow, count and ID that one input can break
    (an empty batch or sequence holds no IDs and cannot overflow; a sequence cannot be empty
    and too long), so a port that checks any two of them the other way round fails."""
    config, tokens = scenario.config, scenario.tokens
    vocabulary, context = config.vocabulary_size, config.context
    batch, length = tokens.shape
    bad_ids = tokens.copy()
    bad_ids.flat[-1] = vocabulary
    bad_flat = bad_ids.reshape(-1)
    one_id = np.array([vocabulary], dtype=np.int64)  # one bad ID, as a flat array
    floats = np.full(3, 0.5)  # non-integer IDs, flat
    # B*T past 2**64 - 1, with T within the context, or past it.
    overflowing = (2**64 // context + 1, context)
    overflowing_and_long = (2**64 // (context + 1) + 1, context + 1)
    dtype, rank = ErrorKind.TOKEN_DTYPE, ErrorKind.TOKEN_RANK
    return [
        (bad_ids.astype(np.float64), None, dtype),  # dtype before ID
        (floats, None, dtype),  # dtype before rank
        (floats, (0, 3), dtype),  # dtype before batch
        (floats, (3, 0), dtype),  # dtype before length
        (np.full((batch, context + 1), 0.5), None, dtype),  # dtype before context
        (floats, overflowing, dtype),  # dtype before overflow
        (floats, (batch, length + 1), dtype),  # dtype before count
        (bad_flat, None, rank),  # rank before ID
        (np.zeros((1, batch, context + 1), dtype=np.int64), None, rank),  # rank before context
        (np.zeros((0, 0), dtype=np.int64), None, ErrorKind.EMPTY_BATCH),  # batch before length
        (np.zeros((0, context + 1), dtype=np.int64), None, ErrorKind.EMPTY_BATCH),  # .. context
        (one_id, (0, length), ErrorKind.EMPTY_BATCH),  # batch before count
        (one_id, (batch, 0), ErrorKind.EMPTY_TOKENS),  # length before count
        (np.full((batch, context + 1), vocabulary), None, ErrorKind.CONTEXT_LENGTH_EXCEEDED),
        (one_id, overflowing_and_long, ErrorKind.CONTEXT_LENGTH_EXCEEDED),  # before overflow
        (bad_flat, (batch, context + 1), ErrorKind.CONTEXT_LENGTH_EXCEEDED),  # before count
        (one_id, overflowing, ErrorKind.TOKEN_COUNT_OVERFLOW),  # overflow before count and ID
        # One ID more than B*T, the last of them out of range: the count first.
        (np.concatenate([bad_flat, one_id]), (batch, length), ErrorKind.TOKEN_COUNT_MISMATCH),
    ]


# Token inputs of every other type: what the spec refuses (bool, floats, ragged rows,
# strings) must be refused with token-dtype, and what it accepts (any integer dtype, nested
# lists of ints) must give the int64 logits.
TOKEN_INPUT_TYPES: dict[str, Callable[[np.ndarray[Any, Any]], Any]] = {
    "bool": lambda ids: ids.astype(bool),
    "int8": lambda ids: ids.astype(np.int8),
    "int32": lambda ids: ids.astype(np.int32),
    "uint64": lambda ids: ids.astype(np.uint64),
    "float32": lambda ids: ids.astype(np.float32),
    "nested-lists": lambda ids: ids.tolist(),
    "ragged": lambda ids: [ids[0].tolist(), [*ids[0].tolist(), 0]],
    "strings": lambda ids: ids.astype(str),
}


# The types of TOKEN_INPUT_TYPES the spec accepts: their IDs give the int64 IDs' answers.
ACCEPTED_INPUT_TYPES = [
    kind
    for kind, convert in TOKEN_INPUT_TYPES.items()
    if token_violation(FIXTURE.config, convert(np.zeros((1, 1), np.int64))) is None
]
assert ACCEPTED_INPUT_TYPES, "an empty list would drop the loss's type checks as a skip"


@pytest.mark.rule("ERR-TOKEN-SHAPE")
@pytest.mark.parametrize("kind_of_input", ACCEPTED_INPUT_TYPES)
def test_loss_takes_ids_of_every_accepted_type(
    backend: Backend, judge: Judge, tolerance: ToleranceModel, kind_of_input: str
) -> None:
    """The loss takes token and target IDs of every type the forward pass takes (any integer
    dtype, nested lists) as their int64 values: torch's cross_entropy refuses int32
    targets, so a port that hands them on unconverted fails here."""
    config = FIXTURE.config
    tokens = np.array([[0, 1, 2], [3, 4, 0]], dtype=np.int64)
    targets = np.array([[1, 2, 3], [4, 0, 1]], dtype=np.int64)
    convert = TOKEN_INPUT_TYPES[kind_of_input]
    model = backend.build(config, initial_parameters(config, FIXTURE.seed))
    call = (
        "backend.loss(model, tokens, targets)  # as nested lists"
        if kind_of_input == "nested-lists"
        else "import numpy as np\n"
        f"backend.loss(model, np.array(tokens, dtype=np.{kind_of_input}), "
        f"np.array(targets, dtype=np.{kind_of_input}))"
    )
    judge.on(Case(config, FIXTURE.seed, tokens, targets, call=call)).close(
        f"loss of {kind_of_input} token and target IDs",
        backend.loss(model, convert(tokens), convert(targets)).loss,
        backend.loss(model, tokens, targets).loss,
        tolerance.at(config, tokens.shape[1]).loss,
    )


@pytest.mark.rule("ERR-TOKEN-SHAPE")
@pytest.mark.parametrize("kind_of_input", list(TOKEN_INPUT_TYPES))
def test_token_inputs_of_every_type(
    backend: Backend, judge: Judge, tolerance: ToleranceModel, kind_of_input: str
) -> None:
    config = FIXTURE.config
    ids = np.asarray(FIXTURE.tokens, dtype=np.int64)
    tokens = TOKEN_INPUT_TYPES[kind_of_input](ids)
    model = backend.build(config, initial_parameters(config, FIXTURE.seed))
    check = judge.on(Case(config, FIXTURE.seed, tokens, notes={"input": kind_of_input}))
    expected = token_violation(config, tokens)
    if expected is not None:
        check.refused(lambda: backend.forward(model, tokens), expected.kind)
        return
    check.close(
        f"logits of {kind_of_input} token IDs",
        backend.forward(model, tokens).logits,
        backend.forward(model, ids).logits,
        tolerance.at(config, ids.shape[1]).logits,
    )


@pytest.mark.rule("ERR-TARGET-COUNT")
@suite_settings()
@given(scenario=scenarios(), change=st.sampled_from([-1, 1]))
def test_targets_must_be_one_per_token(
    backend: Backend, judge: Judge, scenario: Scenario, change: int
) -> None:
    flat = scenario.targets.reshape(-1)
    targets = flat[:-1] if change < 0 else np.concatenate([flat, flat[:1]])
    model = scenario.build(backend)
    check = judge.on(
        dataclasses.replace(scenario.case("backend.loss(model, tokens, targets)"), targets=targets)
    )
    refusal = check.refused(
        lambda: backend.loss(model, scenario.tokens, targets), ErrorKind.TARGET_COUNT_MISMATCH
    )
    check.check(
        refusal.kind.category is ErrorCategory.TARGET_SHAPE,
        "category",
        refusal.kind.category,
        ErrorCategory.TARGET_SHAPE,
    )


@pytest.mark.rule("ERR-TARGET-COUNT")
@suite_settings()
@given(scenario=scenarios())
def test_targets_are_counted_not_shaped(
    backend: Backend, judge: Judge, scenario: Scenario, tolerance: ToleranceModel
) -> None:
    """The seed takes its targets as one flat list: B*T IDs in one row are one target per
    token, in row-major order, and give the loss of the same IDs shaped [B, T]. A port that
    demands the tokens' shape, or reads a flat row position-major, fails here."""
    model = scenario.build(backend)
    flat = scenario.targets.reshape(-1)
    check = judge.on(
        dataclasses.replace(
            scenario.case(
                "import numpy as np\n"
                "backend.loss(model, np.array(tokens), np.array(targets))  # targets: one flat row"
            ),
            targets=flat,
        )
    )
    check.close(
        "loss with the targets as one flat row of B*T IDs",
        backend.loss(model, scenario.tokens, flat).loss,
        backend.loss(model, scenario.tokens, scenario.targets).loss,
        tolerance.at(scenario.config, scenario.tokens.shape[1]).loss,
    )


@pytest.mark.rule("ERR-TARGET-ID")
@suite_settings()
@given(scenario=scenarios(), data=st.data())
def test_out_of_vocabulary_target_names_its_position(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    """Every kind of bad ID is tried at one or two drawn positions (the first is named), and
    -100 too: PyTorch's cross_entropy skips such targets (its ignore_index) without a word."""
    positions = sorted(
        data.draw(st.sets(st.integers(0, scenario.targets.size - 1), min_size=1, max_size=2))
    )
    model = scenario.build(backend)
    for bad_id in [*out_of_vocabulary_ids(scenario.config.vocabulary_size), -100]:
        targets = scenario.targets.copy()
        targets.flat[positions] = bad_id
        check = judge.on(
            dataclasses.replace(
                scenario.case("backend.loss(model, tokens, targets)", bad_id=bad_id),
                targets=targets,
            )
        )
        check.refused(
            functools.partial(backend.loss, model, scenario.tokens, targets),
            ErrorKind.TARGET_ID_OUT_OF_BOUNDS,
            position=positions[0],
        )


# The seed's loss validates the token shape, then its targets, and only then runs the forward
# pass, whose embedding lookup checks the token IDs.
SEED_LOSS_ORDER = (
    "the seed's loss order: token dtype and shape (rank, batch, length, context, overflow, "
    "count), then target dtype, target count, target IDs, and only then token IDs"
)


def _loss_rule_pairs(
    scenario: Scenario, data: st.DataObject
) -> list[tuple[str, Any, Any, ErrorKind]]:
    """Loss inputs that break two rules at once, labelled, with the kind the seed reports."""
    config, tokens, targets = scenario.config, scenario.tokens, scenario.targets
    vocabulary = config.vocabulary_size
    bad_tokens = tokens.copy()
    bad_tokens.flat[data.draw(st.integers(0, tokens.size - 1), label="bad token position")] = (
        data.draw(st.sampled_from([vocabulary, vocabulary + 2, -1]), label="bad token ID")
    )
    flat_targets = targets.reshape(-1)
    short_targets = flat_targets[:-1]
    long_targets = np.concatenate([flat_targets, flat_targets[:1]])
    bad_targets = targets.copy()
    bad_targets.flat[data.draw(st.integers(0, targets.size - 1), label="bad target position")] = (
        data.draw(st.sampled_from([vocabulary, vocabulary + 5, -1]), label="bad target ID")
    )
    bad_short_targets = short_targets.copy()
    if bad_short_targets.size:
        bad_short_targets[0] = vocabulary
    too_long = np.zeros((tokens.shape[0], config.context + 1), dtype=np.int64)
    # One fewer (two when there is one target: an empty float array holds no non-integer).
    wrong_count_floats = np.full(targets.size - 1 or 2, 0.5)
    return [
        ("a bad token ID with too few targets", bad_tokens, short_targets,
         ErrorKind.TARGET_COUNT_MISMATCH),
        ("a bad token ID with too many targets", bad_tokens, long_targets,
         ErrorKind.TARGET_COUNT_MISMATCH),
        ("a bad token ID with a bad target ID", bad_tokens, bad_targets,
         ErrorKind.TARGET_ID_OUT_OF_BOUNDS),
        ("a bad token ID with float targets", bad_tokens, targets.astype(np.float64),
         ErrorKind.TARGET_DTYPE),
        ("a bad token ID with valid targets", bad_tokens, targets,
         ErrorKind.TOKEN_ID_OUT_OF_BOUNDS),
        ("too few targets, one of them bad", tokens, bad_short_targets,
         ErrorKind.TARGET_COUNT_MISMATCH),
        ("non-integer targets out of range", tokens, np.full(targets.shape, vocabulary + 0.5),
         ErrorKind.TARGET_DTYPE),
        ("non-integer targets of the wrong count", tokens, wrong_count_floats,
         ErrorKind.TARGET_DTYPE),
        ("non-integer targets, one too many", tokens, long_targets.astype(np.float64),
         ErrorKind.TARGET_DTYPE),
        ("an empty batch with non-integer targets", tokens[:0], np.full(3, 0.5),
         ErrorKind.EMPTY_BATCH),
        ("empty sequences with a bad target ID", tokens[:, :0], np.array([vocabulary]),
         ErrorKind.EMPTY_TOKENS),
        ("a too-long sequence with too few targets", too_long, short_targets,
         ErrorKind.CONTEXT_LENGTH_EXCEEDED),
        ("float tokens with a bad target ID", bad_tokens.astype(np.float64), bad_targets,
         ErrorKind.TOKEN_DTYPE),
        ("flat tokens with too few targets", tokens.reshape(-1), short_targets,
         ErrorKind.TOKEN_RANK),
    ]  # fmt: skip


@pytest.mark.rule("ERR-LOSS-ORDER")
@suite_settings()
@given(scenario=scenarios(), data=st.data())
def test_loss_checks_token_shape_then_targets_then_token_ids(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    model = scenario.build(backend)
    for label, tokens, targets, expected in _loss_rule_pairs(scenario, data):
        check = judge.on(
            dataclasses.replace(
                scenario.case("backend.loss(model, tokens, targets)"),
                tokens=tokens,
                targets=targets,
            )
        )
        check.refused(
            functools.partial(backend.loss, model, tokens, targets),
            expected,
            what=f"refusal kind for {label}",
            reason=SEED_LOSS_ORDER,
        )


@pytest.mark.rule("ERR-SEED-EXAMPLES")
def test_seed_examples_are_classified(backend: Backend, judge: Judge) -> None:
    config = FIXTURE.config
    model = backend.build(
        config,
        Scenario(
            config, FIXTURE.seed, np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64)
        ).parameters(),
    )
    zero_heads = dataclasses.replace(config, heads=0)
    examples: list[tuple[str, Case, Callable[[], object], ErrorCategory]] = [
        (
            "zero heads",
            Case(zero_heads, call="backend.build(config, [])"),
            lambda: backend.build(zero_heads, []),
            ErrorCategory.CONFIGURATION,
        ),
        (
            "token length above capacity",
            Case(config, FIXTURE.seed, [[0, 1, 2, 3, 4]]),
            lambda: backend.forward(model, [[0, 1, 2, 3, 4]]),
            ErrorCategory.CONTEXT,
        ),
        (
            "token ID V",
            Case(config, FIXTURE.seed, [[0, 1, 5]]),
            lambda: backend.forward(model, [[0, 1, 5]]),
            ErrorCategory.VOCABULARY_INPUT,
        ),
        (
            "one missing target",
            Case(
                config, FIXTURE.seed, [[0, 1, 2]], [[1, 2]], "backend.loss(model, tokens, targets)"
            ),
            lambda: backend.loss(model, [[0, 1, 2]], [[1, 2]]),
            ErrorCategory.TARGET_SHAPE,
        ),
    ]
    for label, case, action, category in examples:
        check = judge.on(case)
        try:
            action()
        except Exception as error:
            kind = getattr(error, "kind", None)
            got = (
                kind.category
                if isinstance(kind, ErrorKind)
                else f"{type(error).__name__} without a kind"
            )
            check.check(got == category, f"category of {label}", got, category)
        else:
            check.fail(f"category of {label}", "no refusal", category)


def _rebuild_refusal(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject, kinds: set[ErrorKind]
) -> None:
    entries, expected = data.draw(
        perturbed_parameter_lists(scenario.config, scenario.parameters(), kinds=kinds)
    )
    check = judge.on(
        scenario.case(
            "backend.build(config, entries)",
            entries=[(name, np.asarray(value).shape) for name, value in entries],
        )
    )
    violation = rebuild_violation(scenario.config, entries)
    assert violation is not None and violation.kind is expected  # the spec sees the same
    # The index a refusal names is part of it (a count mismatch names none).
    index = {"index": violation.details["index"]} if "index" in violation.details else {}
    check.refused(lambda: backend.build(scenario.config, entries), expected, **index)


def _refused_first_of_two(
    backend: Backend,
    judge: Judge,
    scenario: Scenario,
    *,
    changes: dict[int, Any],
    expected: ErrorKind,
    index: int,
    label: str,
) -> None:
    """A parameter list with two tensors changed (by index), each breaking its own rule: the
    rule checked first over the whole list is reported, at its index, wherever the other is."""
    entries = [(name, np.asarray(value)) for name, value in scenario.parameters()]
    for at, change in changes.items():
        entries[at] = (entries[at][0], change(entries[at][1]))
    case = scenario.case(
        "backend.build(config, entries)",
        entries=[(name, value.shape, str(value.dtype)) for name, value in entries],
    )
    judge.on(case).refused(
        lambda: backend.build(scenario.config, entries),
        expected,
        what=f"refusal kind for {label}",
        reason=REBUILD_ORDER,
        index=index,
    )


REBUILD_ORDER = (
    "the rebuild order: configuration, tensor count, every name, then every shape, every "
    "dtype, every value, each over the whole list (the first tensor breaking the rule)"
)


def _misshaped(value: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.zeros(tuple(size + 1 for size in value.shape))


def _complex(value: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return value.astype(np.complex128)


def _with_nan(value: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    broken = value.astype(np.float64)
    broken.flat[0] = np.nan
    return broken


@pytest.mark.rule("ERR-REBUILD-COUNT")
@suite_settings()
@given(scenario=scenarios(), data=st.data())
def test_parameter_count_is_checked(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    _rebuild_refusal(backend, judge, scenario, data, {ErrorKind.PARAMETER_COUNT_MISMATCH})


@pytest.mark.rule("ERR-REBUILD-NAMES")
@suite_settings()
@given(scenario=scenarios(), data=st.data())
def test_parameter_names_are_checked_before_shapes(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    _rebuild_refusal(backend, judge, scenario, data, {ErrorKind.PARAMETER_NAME_MISMATCH})
    # A wrong name late in the list beats a wrong shape early in it.
    entries = [(name, np.asarray(value)) for name, value in scenario.parameters()]
    entries[0] = (entries[0][0], np.zeros((1, 1)))
    entries[-1] = ("lm_head.weight", entries[-1][1])
    check = judge.on(scenario.case("backend.build(config, entries)"))
    check.refused(
        lambda: backend.build(scenario.config, entries),
        ErrorKind.PARAMETER_NAME_MISMATCH,
        index=len(entries) - 1,
    )


@pytest.mark.rule("ERR-REBUILD-SHAPES")
@suite_settings()
@given(scenario=scenarios(), data=st.data())
def test_parameter_shapes_are_checked(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    _rebuild_refusal(backend, judge, scenario, data, {ErrorKind.PARAMETER_SHAPE_MISMATCH})
    # A wrong shape late in the list beats a wrong dtype or a NaN early in it.
    last = len(scenario.parameters()) - 1
    shape = ErrorKind.PARAMETER_SHAPE_MISMATCH
    for early, what in ((_complex, "a complex tensor"), (_with_nan, "a NaN")):
        label = f"{what} at index 0 and a wrong shape at index {last}"
        changes = {0: early, last: _misshaped}
        _refused_first_of_two(
            backend, judge, scenario, changes=changes, expected=shape, index=last, label=label
        )


@pytest.mark.rule("ERR-REBUILD-VALUES")
@suite_settings()
@given(scenario=scenarios(), data=st.data())
def test_non_finite_parameters_are_refused(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    _rebuild_refusal(backend, judge, scenario, data, {ErrorKind.PARAMETER_NOT_FINITE})


@pytest.mark.rule("ERR-RMS-ZERO")
@suite_settings()
@given(scenario=scenarios())
def test_a_zero_row_with_epsilon_zero_is_refused(
    backend: Backend, judge: Judge, scenario: Scenario
) -> None:
    """The embedding row of the first token is all zeros: with epsilon 0 the first RMSNorm
    (a block's, or the final one at depth 0) would divide by zero; with epsilon > 0 it is
    an ordinary input."""
    scenario.reject_departures(backend)
    token = int(scenario.tokens.flat[0])
    entries = [
        (name, value.copy() if name == EMBEDDING_NAME else value)
        for name, value in scenario.parameters()
    ]
    entries[0][1][token] = 0.0
    for epsilon in (0.0, 1e-6):
        config = dataclasses.replace(scenario.config, rms_epsilon=epsilon)
        model = backend.build(config, entries)
        check = judge.on(
            dataclasses.replace(
                scenario.case(), config=config, notes={"zeroed_embedding_row": token}
            )
        )
        if epsilon == 0.0:
            check.refused(
                functools.partial(backend.forward, model, scenario.tokens),
                ErrorKind.RMS_ZERO_MEAN_SQUARE,
            )
        else:
            check.finite("logits", backend.forward(model, scenario.tokens).logits)


@pytest.mark.rule("ERR-SEED-RANGE")
@pytest.mark.parametrize("seed", [-1, 2**64, 2**70], ids=["minus-one", "2**64", "2**70"])
def test_a_seed_outside_the_u64_range_is_refused(backend: Backend, judge: Judge, seed: int) -> None:
    config = FIXTURE.config
    judge.on(Case(config, call=f"backend.build_seeded(config, {seed})")).refused(
        lambda: call_build_seeded(backend, config, seed), ErrorKind.INVALID_SEED
    )
    # The configuration comes first: a bad configuration with a bad seed is a config error.
    broken = dataclasses.replace(config, heads=0)
    judge.on(Case(broken, call=f"backend.build_seeded(config, {seed})")).refused(
        lambda: call_build_seeded(backend, broken, seed), ErrorKind.ZERO_HEAD_COUNT
    )


# Parameter values of the wrong type, each at a drawn index: the spec accepts any integer or
# floating array as its values, and refuses the rest with parameter-dtype at the first index.
PARAMETER_DTYPES = ("complex128", "bool", "int64", "float32")


@pytest.mark.rule("ERR-REBUILD-DTYPES")
@pytest.mark.parametrize("dtype", PARAMETER_DTYPES)
@suite_settings(cost=3)
@given(scenario=scenarios(), data=st.data())
def test_parameters_of_other_dtypes(
    backend: Backend, judge: Judge, scenario: Scenario, dtype: str, data: st.DataObject
) -> None:
    scenario.reject_departures(backend)
    entries = scenario.parameters()
    if dtype in ("complex128", "bool"):
        # A wrong dtype late in the list beats a NaN early in it.
        last = len(entries) - 1
        changes = {0: _with_nan, last: lambda value: value.astype(dtype)}
        label = f"a NaN at index 0 and a {dtype} tensor at index {last}"
        kind = ErrorKind.PARAMETER_DTYPE
        _refused_first_of_two(
            backend, judge, scenario, changes=changes, expected=kind, index=last, label=label
        )
    index = data.draw(st.integers(0, len(entries) - 1), label="index")
    name, value = entries[index]
    # Rounded away from zero, so no row becomes all zeros (with epsilon 0 that row's norm
    # would be refused, which is not what this rule is about).
    away = np.where(value >= 0, np.ceil(value * 4), np.floor(value * 4))
    entries[index] = (name, away.astype(dtype))
    check = judge.on(
        dataclasses.replace(
            scenario.case("backend.build(config, parameters)"),
            notes={"index": index, "dtype": dtype},
        )
    )
    expected = rebuild_violation(scenario.config, entries)
    if expected is not None:
        check.refused(lambda: backend.build(scenario.config, entries), expected.kind, index=index)
        return
    check.finite(
        "logits", backend.forward(backend.build(scenario.config, entries), scenario.tokens).logits
    )


# Sizes past any machine. 2**70 parameter scalars cannot be held anywhere; a plain
# attention over 2**18 positions needs 2**36 scores (512 GiB), so a backend either refuses the
# pass as a resource failure or computes it, and then its first rows must be right.
HUGE_CONFIG = DecoderConfig(2**40, 2**30, 1, 1, 0, 1)
ROOMY_CONFIG = DecoderConfig(3, 2, 1, 2, 1, 2**18)
# What a backend that computes that pass is told when it runs past the request timeout:
# an attention that streams over keys needs no 512 GiB, only time (measured here on 2 cores,
# rows of 2**18 positions: numpy row by row about 5 minutes, torch in key tiles of 64 about
# 20 minutes).
STREAMING_HINT = (
    "At 2^18 positions an attention that streams over keys (flash attention, memory linear "
    "in the length) computes all 2^35 causal scores instead of refusing: minutes to hours. "
    "Raise --backend-timeout to let it finish, or list ERR-RESOURCES in --skips-file."
)


@pytest.mark.rule("ERR-RESOURCES")
def test_sizes_past_any_machine_are_refused_as_resources(
    backend: Backend, judge: Judge, tolerance: ToleranceModel
) -> None:
    if Capability.SEEDED_INIT in backend.capabilities:
        judge.on(Case(HUGE_CONFIG, call="backend.build_seeded(config, 0)")).refused(
            lambda: call_build_seeded(backend, HUGE_CONFIG, 0),
            ErrorKind.PARAMETER_ALLOCATION_FAILED,
        )
    parameters = scenario_parameters(ROOMY_CONFIG, 18, "varied")
    model = backend.build(ROOMY_CONFIG, parameters)
    tokens = np.zeros((1, ROOMY_CONFIG.context), dtype=np.int64)
    tokens[0, 1::3] = 1
    check = judge.on(Case(ROOMY_CONFIG, 18, tokens, variant="varied"))
    try:
        logits = backend.forward(model, tokens).logits
    except AdapterFault as fault:
        if "did not answer 'forward'" not in str(fault):
            raise
        first, _, rest = str(fault).partition("\n")
        raise AdapterFault("\n".join(filter(None, (first, STREAMING_HINT, rest)))) from None
    except Refusal as refusal:
        check.check(
            refusal.kind is ErrorKind.ACTIVATION_ALLOCATION_FAILED,
            "refusal kind",
            f"{refusal.kind} ({refusal.message})",
            f"{ErrorKind.ACTIVATION_ALLOCATION_FAILED}, or the logits",
        )
        return
    finally:
        RECORDER.requested(ErrorKind.ACTIVATION_ALLOCATION_FAILED)
    rows = (0, 1, 2, 3)
    exact = to_float64(oracle_rows(ROOMY_CONFIG, parameters, tokens[0], rows))
    bound = tolerance.at(ROOMY_CONFIG, len(rows)).logits
    for row, expected in zip(rows, exact, strict=True):
        check.close(f"logits row {row}", np.asarray(logits)[0, row], expected, bound)
