"""A case's own conditioning widens its bounds, never narrows them."""

from __future__ import annotations

import numpy as np

from conformance.cases import Scenario
from conformance.conditioning import CONDITION_FACTOR, case_bounds
from conformance.tools.tolerance_derivation import DerivationCase, emulation_errors
from spec.config import FIXTURE, DecoderConfig
from spec.formats import Precision
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
