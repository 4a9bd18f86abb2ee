"""VALUE-ODD-WIDTHS: its shape, its bounds, and what a failure says."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cases import DEEP_BLOCKS, suite_configs
from conformance.runner import run_suite
from conformance.test_odd_widths import SHAPE_NAME, TILE, advice
from conformance.test_values import LONG_CONFIG
from spec.formats import Precision
from spec.scale import SCALE_SHAPES, scale_shape
from spec.strategies import sample
from spec.tolerances import scale_tolerance

GROUPS = (4, 8, 16, 32, 64)  # lanes and tiles a vectorized port works in


def test_every_size_is_past_a_tile_and_ends_in_a_partial_group() -> None:
    shape = scale_shape(SHAPE_NAME)
    config = shape.config
    sizes = {
        "head width": config.head_width,
        "RoPE pairs": config.head_width // 2,
        "model width": config.model_width,
        "feed-forward width": config.feed_forward_width,
        "vocabulary": config.vocabulary_size,
        "positions": shape.positions,
    }
    for name, size in sizes.items():
        assert size > 32, name
        assert all(size % group for group in GROUPS), name
    assert TILE < shape.positions < 2 * TILE


def test_no_other_value_case_has_wide_rows_or_heads_in_partial_groups() -> None:
    """The other value rules' rows (model width), heads and RoPE pairs: generated ones stop at
    32, the fixed ones past 32 are whole groups of 32. (wide-heads' SwiGLU of 344 and
    vocabulary of 97 are not: a product's inner tail is seen there as well.)"""
    drawn = sample(suite_configs(max_layers=3), 300, seed_value=0)
    assert max(c.model_width for c in drawn) <= 32
    assert max(c.head_width for c in drawn) <= 8
    for name in ("wide-heads", "large-ids"):
        config = SCALE_SHAPES[name].config
        for width in (config.model_width, config.head_width, config.head_width // 2):
            assert width <= 32 or width % 32 == 0, (name, width)
    for config in (LONG_CONFIG, DEEP_BLOCKS.config):
        assert config.model_width <= 32


def test_the_shape_has_bounds_at_every_precision() -> None:
    for precision in Precision:
        bound = scale_tolerance(precision, SHAPE_NAME)
        for quantity in (bound.stages, bound.logits, bound.loss, bound.gradients):
            assert 0 < quantity < 1, precision


@pytest.mark.parametrize(
    ("off", "points_at"),
    [
        (range(1, 67), "look at RoPE over a head's 35 pairs"),
        (range(64, 67), "a tile of 64 positions"),
        (range(67), "the last, partial group of a vectorized loop or tile over features"),
        ([3, 60], "the last, partial group of a vectorized loop or tile over features"),
    ],
)
def test_the_advice_follows_the_pattern_of_positions_off(off: range, points_at: str) -> None:
    flagged = np.zeros(67, dtype=bool)
    flagged[list(off)] = True
    assert points_at in advice(flagged)


@pytest.mark.parametrize(
    ("mutant", "positions", "points_at"),
    [
        (
            "RopeSkipsTheLastPartialGroupOfPairs",
            "positions 1-66 of 67 off (position 0 within)",
            "look at RoPE over a head's 35 pairs",
        ),
        (
            "RmsNormSumsWholeLanesOnly",
            "positions 0-66 of 67 off",
            "RMSNorm's sum of squares",
        ),
    ],
)
def test_a_partial_group_dropped_fails_this_rule_alone(
    mutant: str, positions: str, points_at: str
) -> None:
    """Both pass every other rule of ci (the mutant catalogue checks that they fail this one;
    here, that the failure says where)."""
    adapter = f"conformance.tools.mutants.numerics:{mutant}"
    report = run_suite(adapter, profile="ci", rules=["VALUE-ODD-WIDTHS", "VALUE-WIDE-HEADS"])
    statuses = {rule.id: rule for rule in report.rules}
    rule = statuses["VALUE-ODD-WIDTHS"]
    assert rule.status == "failed", report.output[-2000:]
    assert rule.message.startswith("[VALUE-ODD-WIDTHS] stage block-0")
    assert positions in rule.message
    assert points_at in rule.message
    assert statuses["VALUE-WIDE-HEADS"].status == "passed"
