"""The specification against the seed's own worked answers, and its rule registry."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conformance.cli import main
from spec.config import FIXTURE, DecoderConfig
from spec.errors import ErrorCategory, ErrorKind
from spec.parameters import NAME_PATTERN, parameter_count, parameter_layout, parameter_names
from spec.recipe import DRAW_BLOCK_SCALARS, InvalidSeedError, SplitMix64, initial_parameters
from spec.rules import RULES, RuleCategory, rule, rules_in
from spec.shapes import logits_shape, stage_shapes
from spec.validation import (
    config_violation,
    loss_violation,
    rebuild_violation,
    seed_violation,
    token_violation,
)

EXERCISE = DecoderConfig(
    vocabulary_size=40, model_width=12, heads=2, feed_forward_width=32, layers=3, context=8
)


def test_fixture_counts() -> None:
    assert parameter_count(FIXTURE.config) == 264
    assert parameter_count(FIXTURE.config, tied=False) == 284


def test_exercise_counts() -> None:
    """V=40, d=12, f=32, N=3: 5748 tied scalars; an untied head adds 480."""
    assert parameter_count(EXERCISE) == 5748
    assert parameter_count(EXERCISE, tied=False) - parameter_count(EXERCISE) == 480


def test_first_tenth_and_last_names_of_a_two_block_model() -> None:
    names = parameter_names(FIXTURE.config)
    assert (names[0], names[9], names[-1]) == (
        "token_embedding.weight",
        "blocks.0.ffn.down.weight",
        "final_norm.gain",
    )


def test_names_follow_the_grammar_and_are_unique() -> None:
    for layers in range(4):
        names = parameter_names(DecoderConfig(5, 4, 2, 4, layers, 4))
        assert len(names) == 2 + 9 * layers == len(set(names))
        assert all(NAME_PATTERN.fullmatch(name) for name in names)
        assert not any("bias" in name or "lm_head" in name for name in names)


def test_layout_shapes_add_up_to_the_count() -> None:
    layout = parameter_layout(EXERCISE)
    total = 0
    for _, shape in layout:
        size = 1
        for extent in shape:
            size *= extent
        total += size
    assert total == parameter_count(EXERCISE)


def test_exercise_shapes() -> None:
    """B=2, T=6, d=12, V=40: every stage [2, 6, 12], logits [2, 6, 40]."""
    config = DecoderConfig(
        vocabulary_size=40, model_width=12, heads=3, feed_forward_width=32, layers=3, context=6
    )
    assert {shape for _, shape in stage_shapes(config, 2, 6)} == {(2, 6, 12)}
    assert len(stage_shapes(config, 2, 6)) == 3 + 2
    assert logits_shape(config, 2, 6) == (2, 6, 40)


@pytest.mark.parametrize(
    ("violation", "category"),
    [
        (lambda: config_violation(DecoderConfig(5, 4, 0, 4, 2, 4)), ErrorCategory.CONFIGURATION),
        (lambda: token_violation(FIXTURE.config, [[0, 1, 2, 3, 4]]), ErrorCategory.CONTEXT),
        (lambda: token_violation(FIXTURE.config, [[0, 1, 5]]), ErrorCategory.VOCABULARY_INPUT),
        (lambda: loss_violation(FIXTURE.config, [[0, 1, 2]], [[1, 2]]), ErrorCategory.TARGET_SHAPE),
    ],
    ids=["zero-heads", "token-length-above-capacity", "token-id-V", "one-missing-target"],
)
def test_seed_examples_classify(violation, category: ErrorCategory) -> None:  # type: ignore[no-untyped-def]
    found = violation()
    assert found is not None and found.kind.category is category


@pytest.mark.parametrize(
    ("tokens", "targets", "shape", "kind"),
    [
        ([[0, 5, 1]], [[1]], None, ErrorKind.TARGET_COUNT_MISMATCH),
        ([[0, 5, 1]], [[1, 7, 2]], None, ErrorKind.TARGET_ID_OUT_OF_BOUNDS),
        ([[0, 5, 1]], [[1.0, 2.0, 3.0]], None, ErrorKind.TARGET_DTYPE),
        ([[0, 5, 1]], [[1, 2, 3]], None, ErrorKind.TOKEN_ID_OUT_OF_BOUNDS),
        ([[0, 1, 2, 3, 4]], [[9]], None, ErrorKind.CONTEXT_LENGTH_EXCEEDED),
        ([0, 5, 1], [9], (1, 3), ErrorKind.TARGET_COUNT_MISMATCH),
        ([[0.5, 5, 1]], [[9]], None, ErrorKind.TOKEN_DTYPE),
        ([[0, 1], [2, 3]], [[1, 2, 3, 4]], None, None),  # counted, not shaped
    ],
)
def test_loss_violation_follows_the_seeds_order(
    tokens: object, targets: object, shape: tuple[int, int] | None, kind: ErrorKind | None
) -> None:
    """Token shape, then target dtype, count and IDs, and only then the token IDs."""
    found = loss_violation(FIXTURE.config, tokens, targets, shape)
    assert (found.kind if found else None) is kind


def test_token_count_overflows_the_seeds_unsigned_64_bit_size() -> None:
    config = DecoderConfig(5, 4, 2, 4, 0, 2**62)
    assert token_violation(config, [0], (3, 2**62)).kind is ErrorKind.TOKEN_COUNT_MISMATCH  # type: ignore[union-attr]
    assert token_violation(config, [0], (4, 2**62)).kind is ErrorKind.TOKEN_COUNT_OVERFLOW  # type: ignore[union-attr]


def test_every_error_kind_has_a_category() -> None:
    assert all(isinstance(kind.category, ErrorCategory) for kind in ErrorKind)


def test_the_taxonomy_lists_categories_in_the_order_a_builder_meets_them() -> None:
    """Configuration, then the seed, then the resources (the parameters' memory)."""
    order = list(ErrorCategory)
    assert order[:3] == [ErrorCategory.CONFIGURATION, ErrorCategory.SEED, ErrorCategory.RESOURCE]
    assert ErrorKind.INVALID_SEED.category is ErrorCategory.SEED
    assert ErrorKind.ACTIVATION_ALLOCATION_FAILED.category is ErrorCategory.RESOURCE


@pytest.mark.parametrize(
    "value",
    [10**400, -(10**400), 2**1024 - 2**970, -(2**1024 - 2**970), 10**5000],
    # pytest cannot name a 5000-digit parameter itself: Python refuses to print it.
    ids=["1e400", "-1e400", "just-past-float64", "just-past-negative", "1e5000"],
)
@pytest.mark.parametrize("field", ["rope_base", "rms_epsilon"])
def test_a_real_float64_cannot_hold_is_a_wrong_typed_field(field: str, value: int) -> None:
    found = config_violation(DecoderConfig(5, 4, 2, 4, 2, 4, **{field: value}))
    assert found is not None and found.kind is ErrorKind.CONFIG_FIELD_TYPE
    assert found.details == {"field": field, "actual": value}


def test_the_largest_int_that_rounds_to_a_finite_float_is_a_real() -> None:
    assert config_violation(DecoderConfig(5, 4, 2, 4, 2, 4, rope_base=2**1024 - 2**970 - 1)) is None


@pytest.mark.parametrize(
    ("seed", "valid"),
    [
        (0, True),
        (2**64 - 1, True),
        (np.uint64(7), True),
        (-1, False),
        (2**64, False),
        ("7", False),
        (7.0, False),
        (True, False),
        (None, False),
        (np.int64(-1), False),
    ],
)
def test_seeds_are_unsigned_64_bit_integers(seed: object, valid: bool) -> None:
    found = seed_violation(seed)
    assert (found is None) is valid
    if valid:
        assert SplitMix64(seed).state == int(seed)  # type: ignore[arg-type, call-overload]
        return
    assert found is not None and found.kind is ErrorKind.INVALID_SEED
    with pytest.raises(InvalidSeedError) as caught:
        SplitMix64(seed)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError) and caught.value.kind is ErrorKind.INVALID_SEED
    assert str(caught.value).startswith("SplitMix64 seed must be an integer in [0, 2**64 - 1]")


def test_a_huge_depth_is_counted_before_its_layout_is_listed() -> None:
    found = rebuild_violation(DecoderConfig(5, 4, 2, 4, 2**40, 4), [])
    assert found is not None and found.kind is ErrorKind.PARAMETER_COUNT_MISMATCH
    assert found.details == {"expected": 2 + 9 * 2**40, "actual": 0}


def test_blocked_draws_equal_one_draw() -> None:
    """A matrix larger than a draw block holds the same values as drawn in one piece."""
    config = DecoderConfig(DRAW_BLOCK_SCALARS // 4 + 3, 8, 2, 4, 0, 4)
    table = initial_parameters(config, 5)[0][1]
    stream = SplitMix64(5)
    limit = (6.0 / sum(table.shape)) ** 0.5
    whole = (limit * (2.0 * stream.next_units(table.size) - 1.0)).reshape(table.shape)
    assert table.tobytes() == whole.tobytes()


def test_rule_registry_is_well_formed() -> None:
    ids = [entry.id for entry in RULES]
    assert len(ids) == len(set(ids))
    for entry in RULES:
        assert re.fullmatch(r"[A-Z0-9]+(-[A-Z0-9]+)+", entry.id), entry.id
        assert "\n" not in entry.statement and len(entry.statement) <= 140, entry.id
        assert entry.statement.endswith("."), entry.id
        assert entry.source, entry.id
    assert all(rules_in(category) for category in RuleCategory)
    for required in (
        "SHAPE-LOGITS",
        "PARAM-COUNT",
        "TIE-SINGLE-LEAF",
        "CAUSAL-PREFIX-BITWISE",
        "ERR-CONFIG-ORDER",
    ):
        assert rule(required).id == required
    with pytest.raises(KeyError, match="no rule 'NOPE'"):
        rule("NOPE")


def test_rules_command_lists_every_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules"]) == 0
    table = capsys.readouterr().out
    assert all(entry.id in table and entry.statement in table for entry in RULES)
    assert table.rstrip().endswith(f"{len(RULES)} rules")
    assert main(["rules", "--format", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)["rules"]
    assert [item["id"] for item in listed] == [entry.id for entry in RULES]
    assert set(listed[0]) == {"id", "category", "statement", "source", "needs"}
