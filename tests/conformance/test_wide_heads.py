"""VALUE-WIDE-HEADS: its shape, its bounds, and where a failure says the error lies."""

from __future__ import annotations

import inspect

import numpy as np

from conformance.runner import run_suite
from conformance.test_wide_heads import SHAPE_NAME, positions_off
from spec.formats import Precision
from spec.scale import scale_shape
from spec.strategies import configs
from spec.tolerances import scale_tolerance


def test_the_shape_is_wider_and_longer_than_any_generated_case() -> None:
    shape = scale_shape(SHAPE_NAME)
    config = shape.config
    assert config.model_width // config.heads == 128
    assert shape.positions == 80 and shape.positions % 64 != 0  # one tile and part of another
    assert config.feed_forward_width % 64 != 0
    drawn_at_most = inspect.signature(configs).parameters["max_head_width"].default
    assert config.model_width // config.heads >= 16 * drawn_at_most


def test_the_shape_has_bounds_at_every_precision() -> None:
    for precision in Precision:
        bound = scale_tolerance(precision, SHAPE_NAME)
        assert 0 < bound.stages < 1, precision


def test_positions_off_names_the_positions_past_the_bound_and_those_within() -> None:
    exact = np.zeros((2, 80, 3))
    got = exact.copy()
    got[1, 64:, 2] = 0.5
    assert positions_off(got, exact, 0.1) == "positions 64-79 of 80 off (positions 0-63 within)"
    got[0, 3, 0] = np.nan  # not finite counts as off
    assert positions_off(got, exact, 0.1) == (
        "positions 3, 64-79 of 80 off (positions 0-2, 4-63 within)"
    )
    got[:, :, :] = 1.0
    got[0, 0, 0] = 0.0
    got[1, 0, :] = 0.0
    assert positions_off(got, exact, 0.1) == "positions 0-79 of 80 off"
    got[:, 0, :] = 0.0
    assert positions_off(got, exact, 0.1) == "positions 1-79 of 80 off (position 0 within)"
    assert positions_off(exact, exact, 0.1) == ""
    assert positions_off(got[:, :40], exact, 0.1) == ""  # another shape: the shape check speaks


def test_a_rope_over_the_first_64_features_fails_with_where_it_is_off() -> None:
    adapter = "conformance.tools.mutants.numerics:RopeRotatesSixtyFourFeaturesAtMost"
    report = run_suite(adapter, profile="ci", rules=["VALUE-WIDE-HEADS"])
    (rule,) = [rule for rule in report.rules if rule.id == "VALUE-WIDE-HEADS"]
    assert rule.status == "failed", report.output[-2000:]
    assert rule.message.startswith("[VALUE-WIDE-HEADS] stage block-0")
    # Position 0 is rotated by angle 0 either way, and attends to itself only.
    assert "positions 1-79 of 80 off (position 0 within)" in rule.message
    assert "RoPE over part of a head" in rule.message
