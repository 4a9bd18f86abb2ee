"""A correct float32 port may add its sums in any order: the bounds of the shapes with long
sums (70,001 logits a row, 4,715 positions) are calibrated with recursive summation too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from conformance.adapter import FloatArray, LossOutput
from conformance.adapters.reference import ReferenceBackend
from conformance.runner import run_suite
from conformance.tools.tolerance_derivation import (
    CASE_SAFETY,
    DerivationCase,
    emulation_errors,
    instruments,
)
from impl.emulation import EmulatedModel, RecursiveSumsModel
from impl.model import DecoderModel
from spec.formats import Precision
from spec.scale import scale_shape
from spec.tolerances import Quantity, scale_tolerance, scaled_error
from spec.variants import scenario_parameters


@dataclass(frozen=True)
class LongRowRuns:
    """Large-ids (70,001 logits a row) under the float64 reference and both float32
    instruments: one run each, shared by the tests below."""

    case: DerivationCase
    exact: LossOutput
    pairwise: tuple[float, dict[str, FloatArray]]
    recursive: tuple[float, dict[str, FloatArray]]


@pytest.fixture(scope="module")
def long_row() -> LongRowRuns:
    shape = scale_shape("large-ids")
    tokens, targets = shape.tokens_and_targets()
    case = DerivationCase(shape.config, shape.seed, shape.variant, tokens, targets)
    reference = DecoderModel.from_parameters(
        case.config, scenario_parameters(case.config, case.seed, case.variant)
    )
    return LongRowRuns(
        case,
        ReferenceBackend().loss(reference, tokens, targets),
        EmulatedModel(reference, Precision.FLOAT32).loss_and_gradients(tokens, targets),
        RecursiveSumsModel(reference, Precision.FLOAT32).loss_and_gradients(tokens, targets),
    )


def _worst_gradient(gradients: dict[str, FloatArray], exact: LossOutput) -> float:
    assert exact.gradients is not None
    return max(
        float(np.max(scaled_error(value, exact.gradients[name])))
        for name, value in gradients.items()
    )


def test_recursive_sums_lose_more_than_pairwise_ones_over_a_long_row(long_row: LongRowRuns) -> None:
    """The second instrument measures something the first does not: at 70,001 logits a row
    its loss is farther from the float64 reference's."""
    exact = long_row.exact.loss
    pairwise, recursive = long_row.pairwise[0], long_row.recursive[0]
    assert abs(recursive - exact) > 5 * abs(pairwise - exact)  # 20x measured


def test_float32_calibration_takes_the_larger_error_of_both_orders(long_row: LongRowRuns) -> None:
    assert instruments(Precision.FLOAT32) == (EmulatedModel, RecursiveSumsModel)
    assert instruments(Precision.BFLOAT16) == (EmulatedModel,)
    pairwise = _worst_gradient(long_row.pairwise[1], long_row.exact)
    recursive = _worst_gradient(long_row.recursive[1], long_row.exact)
    assert recursive > 5 * pairwise  # 7.3e-6 against 2.9e-7 or less
    both = emulation_errors(long_row.case, Precision.FLOAT32)
    assert both[Quantity.GRADIENTS] == recursive
    # The committed bound: CASE_SAFETY x the worst over eight seeds of both instruments.
    assert scale_tolerance(Precision.FLOAT32, "large-ids").gradients >= CASE_SAFETY * recursive


def test_a_float32_port_that_sums_in_loops_passes_the_long_sums() -> None:
    """The loop-summing port is float32's second instrument, so it stays within 1/CASE_SAFETY
    of the bounds calibrated with it: under half means the bounds were derived with it and the
    adapter runs it. (Against the bounds calibrated on pairwise sums alone it used up to 5.2
    times VALUE-LARGE-IDS's gradient bound.)"""
    rules = ["VALUE-LARGE-IDS", "GRAD-LONG-CONTEXT"]
    report = run_suite("emulated-float32-loop", profile="ci", rules=rules)
    for rule_id in rules:
        rule = report.rule(rule_id)
        assert rule.status == "passed", rule.message
        assert rule.closest is not None
        assert rule.closest["fraction"] < 0.5, rule.closest
