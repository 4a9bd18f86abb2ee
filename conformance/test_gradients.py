"""Gradients: present and finite for every parameter; the seed's own numerical check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given

from conformance.adapter import Backend, Capability, FloatArray
from conformance.cases import Scenario, scenarios
from conformance.checks import Case, Judge
from conformance.profiles import suite_settings
from spec.config import FIXTURE, DecoderConfig
from spec.oracle import oracle_forward, precision
from spec.oracle_gradients import oracle_gradients
from spec.parameters import EMBEDDING_NAME, FINAL_NORM_NAME, parameter_layout
from spec.tolerances import Tolerance


@pytest.mark.rule("GRAD-FINITE")
@pytest.mark.needs(Capability.GRADIENTS)
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
@pytest.mark.needs(Capability.GRADIENTS)
@suite_settings(cost=2)
@given(scenario=scenarios(full_context=True))
def test_gradients_match_the_oracle(
    backend: Backend, judge: Judge, scenario: Scenario, tolerance: Tolerance
) -> None:
    """Parameters are compared in the stable order, so a failure names the first one off."""
    parameters = scenario.parameters()
    exact = oracle_gradients(
        scenario.config, parameters, scenario.tokens, scenario.targets, digits=40
    )
    got = backend.loss(scenario.build(backend), scenario.tokens, scenario.targets).gradients or {}
    check = judge.on(scenario.case("backend.loss(model, tokens, targets).gradients"))
    for name, expected in exact.gradients.items():
        if name not in got:
            check.fail(f"gradient of {name}", "missing", f"shape {list(expected.shape)}")
        check.close(f"gradient of {name}", got[name], expected, tolerance.gradients)


def _probe() -> tuple[DecoderConfig, list[tuple[str, FloatArray]]]:
    config = dataclasses.replace(FIXTURE.config, layers=0)
    table = np.asarray(FIXTURE.probe_table, dtype=np.float64).reshape(
        config.vocabulary_size, config.model_width
    )
    return config, [
        (EMBEDDING_NAME, table),
        (FINAL_NORM_NAME, np.asarray(FIXTURE.probe_gain, dtype=np.float64)),
    ]


@pytest.mark.rule("GRAD-SEED-CHECK")
@pytest.mark.needs(Capability.GRADIENTS)
def test_seed_central_difference_check(backend: Backend, judge: Judge) -> None:
    """All 20 table and 4 gain coordinates of the zero-block probe: step 1e-6, tolerance 2e-5.

    The difference quotient is taken of the oracle's loss at the float64 points x +- h, so
    the check means the same for a float32 backend as for a float64 one.
    """
    config, parameters = _probe()
    step, bound = FIXTURE.gradient_step, FIXTURE.gradient_tolerance
    model = backend.build(config, parameters)
    gradients = backend.loss(model, FIXTURE.probe_tokens, FIXTURE.probe_targets).gradients or {}
    check = judge.on(
        Case(
            config,
            tokens=FIXTURE.probe_tokens,
            targets=FIXTURE.probe_targets,
            call="backend.loss(backend.build(config, probe), tokens, targets)",
        )
    )
    checked = 0
    for index, (name, values) in enumerate(parameters):
        analytic = np.asarray(gradients.get(name, np.full(values.shape, np.nan)), dtype=np.float64)
        for coordinate in np.ndindex(values.shape):
            losses = []
            for sign in (1.0, -1.0):
                shifted = [(n, v.copy()) for n, v in parameters]
                shifted[index][1][coordinate] += sign * step
                run = oracle_forward(
                    config, shifted, FIXTURE.probe_tokens, FIXTURE.probe_targets, digits=30
                )
                losses.append(run.mean_loss())
            above = values[coordinate] + step
            below = values[coordinate] - step
            with precision(30):
                numerical = float((losses[0] - losses[1]) / (above - below))
            exact = float(analytic[coordinate])
            scale = max(1.0, abs(exact), abs(numerical))
            error = abs(exact / scale - numerical / scale)
            check.check(
                error <= bound,
                f"gradient of {name}{list(coordinate)}",
                f"{exact!r} (scaled error {error:.2e})",
                f"{numerical!r} within {bound}",
            )
            checked += 1
    check.check(checked == 24, "coordinates checked", checked, 24)
