"""spec.variants (parameters beyond initialization) and spec.oracle.oracle_rows (the oracle
of a few rows of a long sequence)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.config import DecoderConfig
from spec.oracle import oracle_forward, oracle_rows, to_float64
from spec.parameters import EMBEDDING_NAME, FINAL_NORM_NAME, is_gain_name
from spec.recipe import initial_parameters
from spec.strategies import configs
from spec.variants import HOT_SCALE, LARGE_GAIN, LOUD_SCALE, SHARP_SCALE, scenario_parameters

CONFIG = DecoderConfig(6, 8, 2, 12, 2, 5)


def test_the_recipe_variant_is_the_recipe() -> None:
    for (name, got), (expected_name, expected) in zip(
        scenario_parameters(CONFIG, 7), initial_parameters(CONFIG, 7), strict=True
    ):
        assert name == expected_name and got.tobytes() == expected.tobytes()


def test_varied_gains_leave_one_and_matrices_keep_their_draws() -> None:
    recipe = dict(initial_parameters(CONFIG, 7))
    varied = scenario_parameters(CONFIG, 7, "varied")
    for name, value in varied:
        if is_gain_name(name):
            assert np.all((np.abs(value) >= 0.25) & (np.abs(value) <= 2.0)), name
            assert not np.all(value == 1.0)
        else:  # the recipe's draw times one factor in [0.5, 2]
            factor = value.flat[0] / recipe[name].flat[0]
            assert 0.5 <= factor <= 2.0
            np.testing.assert_allclose(value, recipe[name] * factor, rtol=1e-15)
    signs = np.concatenate([np.sign(v) for n, v in varied if is_gain_name(n)])
    assert {-1.0, 1.0} <= set(signs.tolist())  # both signs occur


def test_variants_are_functions_of_config_seed_and_variant() -> None:
    first = scenario_parameters(CONFIG, 11, "varied")
    again = scenario_parameters(CONFIG, 11, "varied")
    other = scenario_parameters(CONFIG, 12, "varied")
    assert all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(first, again, strict=True))
    assert any(a.tobytes() != b.tobytes() for (_, a), (_, b) in zip(first, other, strict=True))


def test_the_large_variant_scales_only_the_final_gain() -> None:
    varied = dict(scenario_parameters(CONFIG, 3, "varied"))
    large = dict(scenario_parameters(CONFIG, 3, "large"))
    for name, value in large.items():
        expected = varied[name] * (LARGE_GAIN if name == FINAL_NORM_NAME else 1.0)
        assert value.tobytes() == expected.tobytes(), name


def test_the_sharp_variant_scales_only_the_query_and_key_matrices() -> None:
    varied = dict(scenario_parameters(CONFIG, 3, "varied"))
    sharp = dict(scenario_parameters(CONFIG, 3, "sharp"))
    scaled = {name for name in sharp if name.rsplit(".", 2)[-2] in ("query", "key")}
    for name, value in sharp.items():
        factor = SHARP_SCALE if name in scaled else 1.0
        assert value.tobytes() == (varied[name] * factor).tobytes(), name
    assert len(scaled) == 2 * CONFIG.layers


def test_the_hot_variant_scales_only_the_gate_and_down_matrices() -> None:
    varied = dict(scenario_parameters(CONFIG, 3, "varied"))
    hot = dict(scenario_parameters(CONFIG, 3, "hot"))
    factors = {"gate": HOT_SCALE, "down": 1 / HOT_SCALE}
    for name, value in hot.items():
        factor = factors.get(name.rsplit(".", 2)[-2], 1.0)
        assert value.tobytes() == (varied[name] * factor).tobytes(), name
    assert sum(name.rsplit(".", 2)[-2] in factors for name in hot) == 2 * CONFIG.layers


def test_the_loud_variant_scales_the_table_up_and_the_final_gain_down() -> None:
    varied = dict(scenario_parameters(CONFIG, 3, "varied"))
    loud = dict(scenario_parameters(CONFIG, 3, "loud"))
    factors = {EMBEDDING_NAME: LOUD_SCALE, FINAL_NORM_NAME: 1 / LOUD_SCALE}
    for name, value in loud.items():
        assert value.tobytes() == (varied[name] * factors.get(name, 1.0)).tobytes(), name
    # Rows of RMS past 256 (float16's square root of its largest number), and a final gain
    # that float16 still holds as a normal number.
    assert np.sqrt(np.mean(loud[EMBEDDING_NAME] ** 2, axis=1)).min() > 256
    assert np.abs(loud[FINAL_NORM_NAME]).min() > 2.0**-14


def test_the_spread_variant_is_the_recipe_with_the_table_over_its_xavier_bound() -> None:
    config = DecoderConfig(70001, 16, 2, 32, 1, 16)
    recipe = dict(initial_parameters(config, 5))
    spread = dict(scenario_parameters(config, 5, "spread"))
    bound = np.sqrt(6.0 / (70001 + 16))
    for name, value in spread.items():
        if name == EMBEDDING_NAME:
            np.testing.assert_allclose(value, recipe[name] / bound, rtol=1e-15)
            assert 0.99 < np.max(np.abs(value)) <= 1.0  # entries fill [-1, 1]
        else:
            assert value.tobytes() == recipe[name].tobytes(), name


def test_an_unknown_variant_is_named() -> None:
    with pytest.raises(ValueError, match="unknown parameter variant 'trained'"):
        scenario_parameters(CONFIG, 0, "trained")


@settings(max_examples=12, deadline=None)
@given(
    config=configs(max_vocabulary=5, max_heads=2, max_head_width=4, max_layers=2, max_context=6),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_rows_agree_with_the_whole_oracle(
    config: DecoderConfig, seed: int, data: st.DataObject
) -> None:
    """Row by row, bit for bit after rounding: the same formulas over a shorter prefix."""
    length = config.context
    tokens = np.asarray(
        data.draw(
            st.lists(st.integers(0, config.vocabulary_size - 1), min_size=length, max_size=length)
        )
    )
    rows = sorted(data.draw(st.sets(st.integers(0, length - 1), min_size=1, max_size=3)))
    parameters = scenario_parameters(config, seed, "varied")
    whole = to_float64(oracle_forward(config, parameters, tokens[None], digits=30).logits)[0]
    some = to_float64(oracle_rows(config, parameters, tokens, rows, digits=30))
    np.testing.assert_array_equal(some, whole[rows])
