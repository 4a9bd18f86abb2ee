"""A case's own conditioning widens its bounds, never narrows them."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings

from conformance.cases import Scenario, scenarios, score_scale
from conformance.conditioning import CONDITION_FACTOR, case_bounds
from conformance.tools.mutants.base import model_with
from conformance.tools.mutants.composed import ComposedAttention
from conformance.tools.tolerance_derivation import DerivationCase, emulation_errors
from impl.tape import Tensor
from spec.config import FIXTURE, DecoderConfig
from spec.formats import Precision
from spec.oracle import oracle_forward, to_float64
from spec.tolerances import Quantity, tolerance_for

# A recipe case where RMSNorm amplifies rounding: a correct float32 gradient is 1.4e-4 off
# (torch), three times the model's bound for its configuration.
ILL_CONDITIONED = Scenario(
    DecoderConfig(3, 4, 2, 2, 2, 5), 6976, np.array([[2, 1, 0, 0, 0]]), np.array([[0, 1, 0, 0, 0]])
)
WELL_CONDITIONED = Scenario(
    FIXTURE.config, FIXTURE.seed, np.array(FIXTURE.tokens), np.array(FIXTURE.targets)
)


def test_an_ill_conditioned_case_gets_the_room_its_arithmetic_needs() -> None:
    model = tolerance_for("float32")
    general = model.at(ILL_CONDITIONED.config, 5)
    widened = case_bounds(model, ILL_CONDITIONED)
    assert widened.gradients > 1.4e-4 > general.gradients
    case = DerivationCase(
        ILL_CONDITIONED.config, 6976, "recipe", ILL_CONDITIONED.tokens, ILL_CONDITIONED.targets
    )
    emulated = emulation_errors(case, Precision.FLOAT32)
    assert widened.gradients >= CONDITION_FACTOR * emulated[Quantity.GRADIENTS]


def test_bounds_are_never_narrowed() -> None:
    for precision in Precision:
        model = tolerance_for(precision)
        for scenario in (ILL_CONDITIONED, WELL_CONDITIONED):
            general = model.at(scenario.config, scenario.tokens.shape[1])
            widened = case_bounds(model, scenario)
            for quantity in Quantity:
                assert getattr(widened, str(quantity)) >= getattr(general, str(quantity))


def _attention_seen(scenario: Scenario) -> list[tuple[np.ndarray, float]]:
    """Each block's scores in the reference, with their largest ``sum_i |q_i k_i| / sqrt(hw)``
    (after RoPE)."""
    seen: list[tuple[np.ndarray, float]] = []

    class Recorded(ComposedAttention):
        def scores(self, query: Tensor, key: Tensor) -> Tensor:
            result = super().scores(query, key)
            terms = np.abs(query.value) @ np.swapaxes(np.abs(key.value), -1, -2)
            seen.append((result.value, float(np.max(terms)) / math.sqrt(query.shape[-1])))
            return result

    model = model_with("Recorded", attention_class=Recorded).from_parameters(
        scenario.config, scenario.parameters()
    )
    model.forward(scenario.tokens)
    return seen


@settings(max_examples=30, deadline=None)
@given(scenario=scenarios(min_layers=1, variants=("recipe", "sharp")))
def test_the_scores_scale_bounds_every_score_and_its_terms(scenario: Scenario) -> None:
    run = oracle_forward(scenario.config, scenario.parameters(), scenario.tokens, digits=30)
    stages = [(name, to_float64(value)) for name, value in run.stages]
    bound = score_scale(scenario.config, scenario.parameters(), stages)
    assert max(terms for _, terms in _attention_seen(scenario)) <= bound * (1 + 1e-9)


def test_the_fixed_sharp_case_has_scores_past_exp_range_in_both_directions() -> None:
    from conformance.test_values import SHARP_ROWS

    first_block = _attention_seen(SHARP_ROWS)[0][0]
    alone = first_block[0, :, 0, 0]  # sequence 0, position 0 (it sees only itself), per head
    assert alone.min() < -745 and alone.max() > 709.8, alone


def test_the_fixed_hot_cases_have_gate_inputs_past_exp_range_in_float32_both_ways() -> None:
    """VALUE-LARGE-GATES's cases: inputs past +-88.7 (exp overflows in float32) in each."""
    from conformance.test_values import HOT_CASES
    from impl.layers import SwiGLU

    inputs: list[np.ndarray] = []

    class Recorded(SwiGLU):
        def forward(self, x: Tensor) -> Tensor:
            inputs.append(self.gate.forward(x).value)
            return super().forward(x)

    for name, scenario in HOT_CASES.items():
        inputs.clear()
        model = model_with("Recorded", feed_forward_class=Recorded).from_parameters(
            scenario.config, scenario.parameters()
        )
        model.forward(scenario.tokens)
        gates = np.concatenate([values.ravel() for values in inputs])
        assert (gates > 88.7).sum() >= 30 and (gates < -88.7).sum() >= 30, name
