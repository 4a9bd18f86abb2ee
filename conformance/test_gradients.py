"""Gradients: present and finite for every parameter; the seed's own numerical check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given

from conformance.adapter import Backend
from conformance.cases import DEEP_BLOCKS, Scenario, scenarios
from conformance.checks import Case, Judge
from conformance.conditioning import case_bounds
from conformance.profiles import suite_settings
from spec.config import FIXTURE
from spec.gradcheck import central_difference_checks, seed_probe
from spec.oracle import oracle_forward, precision
from spec.oracle_gradients import oracle_gradients
from spec.parameters import parameter_layout
from spec.tolerances import ToleranceModel


@pytest.mark.rule("GRAD-FINITE")
@suite_settings()
@given(scenario=scenarios())
def test_every_parameter_gets_a_finite_gradient(
    backend: Backend, judge: Judge, scenario: Scenario
) -> None:
    gradients = (
        backend.loss(scenario.build(backend), scenario.tokens, scenario.targets).gradients or {}
    )
    check = judge.on(scenario.case("backend.loss(model, tokens, targets).gradients"))
    for name, shape in parameter_layout(scenario.config):
        gradient = gradients.get(name)
        if gradient is None:
            check.fail(f"gradient of {name}", "missing", f"an array of shape {list(shape)}")
        check.check(
            tuple(np.shape(gradient)) == shape,
            f"gradient shape of {name}",
            list(np.shape(gradient)),
            list(shape),
        )
        finite = bool(np.all(np.isfinite(gradient)))
        check.check(finite, f"gradient of {name} all finite", finite, True)


@pytest.mark.rule("GRAD-ORACLE")
@suite_settings(cost=2)
@given(scenario=scenarios(full_context=True))
@example(scenario=DEEP_BLOCKS)
def test_gradients_match_the_oracle(
    backend: Backend, judge: Judge, scenario: Scenario, tolerance: ToleranceModel
) -> None:
    """Parameters are compared in the stable order, so a failure names the first one off."""
    parameters = scenario.parameters()
    exact = oracle_gradients(
        scenario.config, parameters, scenario.tokens, scenario.targets, digits=40
    )
    got = backend.loss(scenario.build(backend), scenario.tokens, scenario.targets).gradients
    judge.on(scenario.case("backend.loss(model, tokens, targets).gradients")).close_each(
        "gradient of", got, exact.gradients.items(), case_bounds(tolerance, scenario).gradients
    )


@pytest.mark.rule("GRAD-SEED-CHECK")
def test_seed_central_difference_check(
    backend: Backend, judge: Judge, tolerance: ToleranceModel
) -> None:
    """All 20 table and 4 gain coordinates of the zero-block probe: step 1e-6, tolerance 2e-5.

    The difference quotient is taken of the oracle's loss at the float64 points x +- h, so
    the check means the same for a float32 backend as for a float64 one. A 16-bit backend
    cannot hold a gradient to 2e-5 (bfloat16's unit roundoff is 3.9e-3): it is held to the
    derived gradient tolerance of its precision where that is the larger.
    """
    config, parameters = seed_probe()
    tokens, targets = FIXTURE.probe_tokens, FIXTURE.probe_targets
    bound = max(FIXTURE.gradient_tolerance, tolerance.at(config, len(tokens[0])).gradients)
    gradients = backend.loss(backend.build(config, parameters), tokens, targets).gradients or {}
    check = judge.on(
        Case(
            config,
            tokens=tokens,
            targets=targets,
            call="backend.loss(backend.build(config, probe), tokens, targets)",
        )
    )
    with precision(30):
        checks = central_difference_checks(
            parameters,
            gradients,
            lambda shifted: oracle_forward(config, shifted, tokens, targets, digits=30).mean_loss(),
            tolerance=bound,
        )
    for coordinate in checks:
        check.check(
            coordinate.passed,
            f"gradient of {coordinate.name}{list(coordinate.index)}",
            f"{coordinate.analytic!r} (scaled error {coordinate.error:.2e})",
            f"{coordinate.numerical!r} within {bound:.2g}",
        )
    check.check(len(checks) == 24, "coordinates checked", len(checks), 24)
