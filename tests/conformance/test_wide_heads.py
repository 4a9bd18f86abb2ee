"""VALUE-WIDE-HEADS: its shape, its bounds, and where a failure says the error lies."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cases import suite_configs
from conformance.checks import positions_off, spans
from conformance.runner import run_suite
from conformance.test_wide_heads import SHAPE_NAME, TILE, advice
from spec.formats import Precision
from spec.scale import scale_shape
from spec.strategies import sample
from spec.tolerances import scale_tolerance


def test_the_shape_is_wider_and_longer_than_any_generated_case() -> None:
    shape = scale_shape(SHAPE_NAME)
    config = shape.config
    assert config.head_width == 128
    assert TILE < shape.positions < 2 * TILE  # one tile and part of another
    assert config.feed_forward_width % TILE != 0
    drawn = sample(suite_configs(max_layers=3), 300, seed_value=0)
    assert max(c.head_width for c in drawn) <= 8 < config.head_width
    assert max(c.model_width for c in drawn) < config.model_width


def test_the_shape_has_bounds_at_every_precision() -> None:
    for precision in Precision:
        bound = scale_tolerance(precision, SHAPE_NAME)
        for quantity in (bound.stages, bound.logits, bound.loss, bound.gradients):
            assert 0 < quantity < 1, precision


def test_spans_join_consecutive_indices() -> None:
    assert spans([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert spans([]) == ""


def test_positions_off_names_the_positions_past_the_bound_and_those_within() -> None:
    exact = np.zeros((2, 80, 3))
    got = exact.copy()
    got[1, 64:, 2] = 0.5
    assert positions_off(got, exact, 0.1) == "positions 64-79 of 80 off (positions 0-63 within)"
    got[0, 3, 0] = np.nan  # not finite counts as off
    assert positions_off(got, exact, 0.1) == (
        "positions 3, 64-79 of 80 off (positions 0-2, 4-63 within)"
    )
    got[:] = 1.0
    assert positions_off(got, exact, 0.1) == "positions 0-79 of 80 off"
    got[:, 0, :] = 0.0
    assert positions_off(got, exact, 0.1) == "positions 1-79 of 80 off (position 0 within)"
    one = exact.copy()
    one[0, 5, 1] = 1.0
    assert positions_off(one, exact, 0.1) == "position 5 of 80 off (positions 0-4, 6-79 within)"
    assert positions_off(exact, exact, 0.1) == ""
    assert positions_off(got[:, :40], exact, 0.1) == ""  # another shape: the shape check speaks
    assert positions_off(np.zeros((2, 0, 3)), np.zeros((2, 0, 3)), 0.1) == ""


@pytest.mark.parametrize(
    ("off", "points_at"),
    [
        (range(1, 80), "RoPE"),
        (range(64, 80), "a tile of 64 positions"),
        (range(80), "no other value rule sends heads wider than 8"),
        ([3, 70], "no other value rule sends heads wider than 8"),
    ],
)
def test_the_advice_follows_the_pattern_of_positions_off(off: range, points_at: str) -> None:
    flagged = np.zeros(80, dtype=bool)
    flagged[list(off)] = True
    assert points_at in advice(flagged)


def test_a_rope_over_the_first_64_features_fails_with_where_it_is_off() -> None:
    adapter = "conformance.tools.mutants.numerics:RopeRotatesAtMostSixtyFourFeatures"
    report = run_suite(adapter, profile="ci", rules=["VALUE-WIDE-HEADS"])
    rule = report.rule("VALUE-WIDE-HEADS")
    assert rule.status == "failed", report.output[-2000:]
    assert rule.message.startswith("[VALUE-WIDE-HEADS] stage block-0")
    assert "positions 1-79 of 80 off (position 0 within)" in rule.message
    assert "look at RoPE (over only part of a head of 128?)" in rule.message
