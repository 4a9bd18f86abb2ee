"""Shapes: every stage keeps [B, T, d], logits are [B, T, V], parameters have their shapes."""

from __future__ import annotations

import pytest
from hypothesis import given

from conformance.adapter import Backend
from conformance.cases import Scenario, scenarios
from conformance.checks import Judge
from conformance.profiles import suite_settings
from spec.parameters import parameter_layout
from spec.shapes import logits_shape, stage_names

SHAPE_RULES = {
    "embedding": "SHAPE-EMBEDDING",
    "final-norm": "SHAPE-FINAL-NORM",
}


def _stages(backend: Backend, scenario: Scenario) -> dict[str, tuple[int, ...]]:
    output = backend.forward(scenario.build(backend), scenario.tokens)
    return {name: tuple(values.shape) for name, values in output.stages or []}


def _expected(scenario: Scenario) -> tuple[int, int, int]:
    batch, length = scenario.tokens.shape
    return (batch, length, scenario.config.model_width)


@pytest.mark.rule("SHAPE-EMBEDDING")
@suite_settings()
@given(scenario=scenarios())
def test_lookup_shape(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    shapes = _stages(backend, scenario)
    got = shapes.get("embedding", "missing")
    judge.on(scenario.case()).check(
        got == _expected(scenario), "embedding shape", got, _expected(scenario)
    )


@pytest.mark.rule("SHAPE-BLOCKS")
@suite_settings()
@given(scenario=scenarios())
def test_every_block_keeps_the_residual_shape(
    backend: Backend, judge: Judge, scenario: Scenario
) -> None:
    shapes = _stages(backend, scenario)
    check = judge.on(scenario.case())
    expected_names = stage_names(scenario.config.layers)
    check.check(list(shapes) == expected_names, "stage names", list(shapes), expected_names)
    for name in expected_names[1:-1]:
        check.check(
            shapes[name] == _expected(scenario), f"{name} shape", shapes[name], _expected(scenario)
        )


@pytest.mark.rule("SHAPE-FINAL-NORM")
@suite_settings()
@given(scenario=scenarios())
def test_final_norm_shape(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    got = _stages(backend, scenario).get("final-norm", "missing")
    judge.on(scenario.case()).check(
        got == _expected(scenario), "final-norm shape", got, _expected(scenario)
    )


@pytest.mark.rule("SHAPE-LOGITS")
@suite_settings()
@given(scenario=scenarios())
def test_logits_shape(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    got = tuple(backend.forward(scenario.build(backend), scenario.tokens).logits.shape)
    expected = logits_shape(scenario.config, *scenario.tokens.shape)
    judge.on(scenario.case()).check(got == expected, "logits shape", got, expected)


@pytest.mark.rule("SHAPE-PARAMETERS")
@suite_settings()
@given(scenario=scenarios())
def test_parameter_shapes(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    listed = {
        name: tuple(value.shape) for name, value in backend.parameters(scenario.build(backend))
    }
    check = judge.on(scenario.case("backend.parameters(model)"))
    for name, shape in parameter_layout(scenario.config):
        got = listed.get(name, "missing")
        check.check(got == shape, f"shape of {name}", got, shape)
