"""A correct float32 port may add its sums in any order: the bounds of the shapes with long
sums (70,001 logits a row, 4,715 positions) are calibrated with recursive summation too."""

from __future__ import annotations

import numpy as np

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


def _large_ids_case() -> DerivationCase:
    shape = scale_shape("large-ids")
    tokens, targets = shape.tokens_and_targets()
    return DerivationCase(shape.config, shape.seed, shape.variant, tokens, targets)


def test_recursive_sums_lose_more_than_pairwise_ones_over_a_long_row() -> None:
    """The second instrument measures something the first does not: at 70,001 logits a row
    its loss is farther from the float64 reference's."""
    case = _large_ids_case()
    reference = DecoderModel.from_parameters(
        case.config, scenario_parameters(case.config, case.seed, case.variant)
    )
    exact = ReferenceBackend().loss(reference, case.tokens, case.targets).loss
    pairwise = EmulatedModel(reference, Precision.FLOAT32).loss_and_gradients(
        case.tokens, case.targets
    )[0]
    recursive = RecursiveSumsModel(reference, Precision.FLOAT32).loss_and_gradients(
        case.tokens, case.targets
    )[0]
    assert abs(recursive - exact) > 5 * abs(pairwise - exact)  # 20x measured


def test_float32_calibration_takes_the_larger_error_of_both_orders() -> None:
    assert instruments(Precision.FLOAT32) == (EmulatedModel, RecursiveSumsModel)
    assert instruments(Precision.BFLOAT16) == (EmulatedModel,)
    case = _large_ids_case()
    reference = DecoderModel.from_parameters(
        case.config, scenario_parameters(case.config, case.seed, case.variant)
    )
    exact = ReferenceBackend().loss(reference, case.tokens, case.targets)
    each = []
    for model in (EmulatedModel, RecursiveSumsModel):
        gradients = model(reference, Precision.FLOAT32).loss_and_gradients(
            case.tokens, case.targets
        )[1]
        each.append(
            max(
                float(np.max(scaled_error(gradients[name], (exact.gradients or {})[name])))
                for name in gradients
            )
        )
    pairwise, recursive = each
    assert recursive > 5 * pairwise  # 7.3e-6 against 2.9e-7 or less
    both = emulation_errors(case, Precision.FLOAT32)
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
