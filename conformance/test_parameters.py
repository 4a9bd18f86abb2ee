"""Parameters: the count, the stable names in order, their grammar, no head and no bias."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given

from conformance.adapter import Backend, FloatArray
from conformance.cases import DEEP_BLOCKS, Scenario, scenarios
from conformance.checks import Judge
from conformance.profiles import suite_settings
from spec.parameters import NAME_PATTERN, parameter_count, parameter_names


def _listed(backend: Backend, scenario: Scenario) -> list[tuple[str, FloatArray]]:
    return backend.parameters(scenario.build(backend))


@pytest.mark.rule("PARAM-COUNT")
@suite_settings()
@given(scenario=scenarios())
def test_parameter_count(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    got = sum(int(np.asarray(value).size) for _, value in _listed(backend, scenario))
    expected = parameter_count(scenario.config)
    untied = parameter_count(scenario.config, tied=False)
    detail = f"{expected} (an untied head would make it {untied})"
    judge.on(scenario.case("backend.parameters(model)")).check(
        got == expected, "parameter scalars", got, detail
    )


@pytest.mark.rule("PARAM-NAMES")
@suite_settings()
@given(scenario=scenarios())
@example(scenario=DEEP_BLOCKS)
def test_stable_names_in_order(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    got = [name for name, _ in _listed(backend, scenario)]
    expected = parameter_names(scenario.config)
    check = judge.on(scenario.case("backend.parameters(model)"))
    check.check(len(got) == len(expected), "parameter tensors", len(got), len(expected))
    for index, (name, wanted) in enumerate(zip(got, expected, strict=True)):
        check.check(name == wanted, f"name {index}", repr(name), repr(wanted))


@pytest.mark.rule("PARAM-NAME-GRAMMAR")
@suite_settings()
@given(scenario=scenarios())
def test_name_grammar_and_uniqueness(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    names = [name for name, _ in _listed(backend, scenario)]
    check = judge.on(scenario.case("backend.parameters(model)"))
    for name in names:
        check.check(
            isinstance(name, str) and NAME_PATTERN.fullmatch(name) is not None,
            "parameter name",
            repr(name),
            "lowercase ASCII letters, digits, '_' and '.' with no empty segment",
        )
    duplicates = sorted({name for name in names if names.count(name) > 1})
    check.check(not duplicates, "duplicated names", duplicates, "none")


@pytest.mark.rule("PARAM-NO-HEAD")
@suite_settings()
@given(scenario=scenarios())
def test_no_output_head_and_no_bias(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    names = [name for name, _ in _listed(backend, scenario)]
    forbidden = [
        name
        for name in names
        if "bias" in name or "head" in name.split(".")[0] or "lm_head" in name
    ]
    judge.on(scenario.case("backend.parameters(model)")).check(
        not forbidden, "head or bias parameters", forbidden, "none"
    )
