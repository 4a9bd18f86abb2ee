"""A generated case's own conditioning, measured: the bound widened where even the emulation
of the declared precision is far off.

The error model (:mod:`spec.tolerances`) bounds what a correct implementation shows over a
configuration; some cases are conditioned much worse than the model's thousand samples saw
(a recipe case at depth 2 and width 4 puts a correct float32 gradient 1.4e-4 off, three
times its model bound). :func:`case_bounds` measures the case's conditioning at the declared
precision two ways against the float64 reference: the error of :mod:`impl.emulation` on the
very case, and the error that rounding the parameters to the format causes by itself (the
float64 reference over rounded parameters). Per quantity, the bound is the larger of the
model's and ``CONDITION_FACTOR`` times the larger of the two. It only ever widens a bound,
and only where the case itself is shown to need it, in the manner of FlashAttention's tests
(the tested kernel against a plain implementation at the same precision).

``CONDITION_FACTOR`` is 16: on that case correct backends measured up to 7.4 times the
larger of the two (torch float16: gradient 0.61 against 0.093 from rounding alone; torch
float32: 1.4e-4 against 3.3e-5).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from conformance.cases import Scenario
from conformance.tools.tolerance_derivation import (
    CASE_SAFETY,
    DerivationCase,
    conditioning_errors,
    worst_over_seeds,
)
from spec.config import DecoderConfig
from spec.formats import Precision, number_format
from spec.tolerances import Quantity, Tolerance, ToleranceModel

__all__ = ["CONDITION_FACTOR", "case_bounds", "fixed_case_logits_bound"]

CONDITION_FACTOR = 16.0


def case_bounds(model: ToleranceModel, scenario: Scenario) -> Tolerance:
    """The tolerance of ``scenario`` at the model's precision, widened by its conditioning."""
    general = model.at(scenario.config, scenario.tokens.shape[1])
    if not scenario.representable(model.precision):
        return general
    precision = Precision(model.precision)
    case = DerivationCase(
        scenario.config, scenario.seed, scenario.variant, scenario.tokens, scenario.targets
    )
    emulated, rounded = conditioning_errors(case, precision)
    widened = {
        quantity: max(
            getattr(general, str(quantity)),
            CONDITION_FACTOR * max(emulated[quantity], rounded[quantity]),
        )
        for quantity in Quantity
    }
    return Tolerance(
        stages=widened[Quantity.STAGES],
        logits=widened[Quantity.LOGITS],
        loss=widened[Quantity.LOSS],
        gradients=widened[Quantity.GRADIENTS],
    )


def fixed_case_logits_bound(
    model: ToleranceModel, config: DecoderConfig, seed: int, variant: str, tokens: npt.ArrayLike
) -> float:
    """A fixed case's logits bound, calibrated at run time as the suite's fixed cases are
    (``tolerances derive``): the tighter of the model's bound and CASE_SAFETY x the
    emulations' largest logits error (float32: both summation orders, so twice the runs) over
    CALIBRATION_SEEDS seeds of the configuration and tokens (every sequence), never under
    CASE_SAFETY x 4 u. Float64: the model's."""
    ids = np.asarray(tokens)
    general = model.at(config, ids.shape[1]).logits
    precision = Precision(model.precision)
    if precision is Precision.FLOAT64:
        return general
    rows = tuple(range(ids.shape[1]))
    # emulation_errors reads the given rows of the first sequence: each sequence on its own.
    worst = max(
        worst_over_seeds(
            DerivationCase(config, seed, variant, sequence[None, :], sequence[None, :]),
            precision,
            rows,
        )[Quantity.LOGITS]
        for sequence in ids
    )
    floor = CASE_SAFETY * 4 * number_format(precision).unit_roundoff
    return min(general, max(CASE_SAFETY * worst, floor))
