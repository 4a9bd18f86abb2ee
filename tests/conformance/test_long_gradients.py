"""GRAD-LONG-CONTEXT: its shape, its bounds, and what a failure says."""

from __future__ import annotations

import pytest

from conformance.cases import scenarios
from conformance.runner import run_suite
from conformance.test_long_gradients import SHAPE_NAME, advice
from spec.formats import Precision
from spec.scale import SCALE_SHAPES, scale_shape
from spec.strategies import sample
from spec.tolerances import scale_tolerance

TILES = tuple(2**k for k in range(1, 13))  # 2 .. 4096 positions


def test_the_shape_ends_every_power_of_two_tile_in_a_partial_one() -> None:
    shape = scale_shape(SHAPE_NAME)
    assert shape.positions > max(TILES)
    assert all(shape.positions % tile for tile in TILES)
    assert shape.batch == 1 and shape.config.layers == 1
    assert shape.config.context == shape.positions


def test_no_other_gradient_is_taken_over_a_partial_tile_past_128_positions() -> None:
    """Why the rule exists: the drawn gradient cases are short, the fixed shapes past 80
    positions are whole tiles of 128 (and whole chunks of 1024)."""
    drawn = sample(scenarios(max_layers=3), 300, seed_value=0)
    assert max(scenario.tokens.shape[1] for scenario in drawn) <= 128
    for name, shape in SCALE_SHAPES.items():
        if name != SHAPE_NAME and shape.positions > 128:
            assert shape.positions % 128 == 0, name
            assert shape.positions <= 1024 or shape.positions % 1024 == 0, name


def test_the_shape_has_bounds_at_every_precision() -> None:
    for precision in Precision:
        bound = scale_tolerance(precision, SHAPE_NAME)
        for quantity in (bound.loss, bound.gradients):
            assert 0 < quantity < 1, precision


@pytest.mark.parametrize(
    ("off", "points_at"),
    [
        (
            {"final_norm.gain", "blocks.0.ffn.up.weight", "token_embedding.weight"},
            "the loss's backward",
        ),
        ({"blocks.0.attention.key.weight", "token_embedding.weight"}, "attention's backward"),
        ({"blocks.0.ffn.down.weight"}, "a precision narrower"),
        ({"token_embedding.weight"}, "a precision narrower"),
    ],
)
def test_the_advice_follows_the_gradients_off(off: set[str], points_at: str) -> None:
    told = advice(off)
    assert points_at in told
    assert all(name in told for name in off)


@pytest.mark.parametrize(
    ("mutant", "points_at"),
    [
        ("AttentionBackwardDropsAPartialKeyTile", "look at attention's backward past the first"),
        ("LossBackwardWeighsChunksEqually", "look at the loss's backward over 4715 rows"),
    ],
)
def test_a_backward_wrong_on_a_partial_tile_or_chunk_fails_with_advice(
    mutant: str, points_at: str
) -> None:
    """Both pass every other rule of ci (the mutant catalogue checks that they fail this one;
    here, that the failure says where to look)."""
    adapter = f"conformance.tools.mutants.training:{mutant}"
    report = run_suite(adapter, profile="ci", rules=["GRAD-LONG-CONTEXT"])
    rule = report.rule("GRAD-LONG-CONTEXT")
    assert rule.status == "failed", report.output[-2000:]
    assert rule.message.startswith("[GRAD-LONG-CONTEXT] gradient of")
    assert points_at in rule.message
