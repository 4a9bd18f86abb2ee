"""Tying: one table, two uses, and a gradient that adds both roles on the one leaf."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapter import Backend, FloatArray
from conformance.cases import Scenario, must_differ, scenarios
from conformance.checks import Judge
from conformance.profiles import suite_settings
from spec.parameters import EMBEDDING_NAME
from spec.tolerances import ToleranceModel


@pytest.mark.rule("TIE-SINGLE-LEAF")
@suite_settings()
@given(scenario=scenarios(min_vocabulary=2), data=st.data())
def test_one_table_serves_both_uses(
    backend: Backend,
    judge: Judge,
    scenario: Scenario,
    tolerance: ToleranceModel,
    data: st.DataObject,
) -> None:
    """Change row v of the table: the lookup of v and logit column v must both follow."""
    scenario.reject_departures(backend)
    row = int(scenario.tokens.flat[data.draw(st.integers(0, scenario.tokens.size - 1))])
    entries = scenario.parameters()
    changed = [(name, value.copy()) for name, value in entries]
    changed[0][1][row] += 0.25
    check = judge.on(scenario.case(changed_row=row))
    before = backend.forward(backend.build(scenario.config, entries), scenario.tokens)
    after = backend.forward(backend.build(scenario.config, changed), scenario.tokens)
    # Every position whose exact logit moves by more than twice the tolerance (all of them
    # at float64 and float32; a 16-bit format may round a smaller move away).
    exact_moves = must_differ(
        scenario.config,
        (entries, scenario.tokens),
        (changed, scenario.tokens),
        tolerance.at(scenario.config, scenario.tokens.shape[1]).logits,
    )[..., row]
    differs = before.logits[..., row] != after.logits[..., row]
    moved = bool(np.all(differs[exact_moves]))
    check.check(moved, f"logit column {row} changed at every position", moved, True)
    if before.stages is not None and after.stages is not None:
        looked_up = dict(after.stages)["embedding"][scenario.tokens == row]
        expected = np.broadcast_to(changed[0][1][row], looked_up.shape)
        bound = tolerance.at(scenario.config, scenario.tokens.shape[1]).stages
        check.close(f"lookup of changed row {row}", looked_up, expected, bound)


def _table_gradient(backend: Backend, scenario: Scenario, **detach: bool) -> FloatArray:
    output = backend.loss(scenario.build(backend), scenario.tokens, scenario.targets, **detach)
    assert output.gradients is not None, "a backend with GRADIENTS must return gradients"
    return np.asarray(output.gradients[EMBEDDING_NAME], dtype=np.float64)


@pytest.mark.rule("TIE-GRADIENT-SUM")
@suite_settings()
@given(scenario=scenarios())
def test_table_gradient_is_the_sum_of_both_roles(
    backend: Backend, judge: Judge, scenario: Scenario, tolerance: ToleranceModel
) -> None:
    full = _table_gradient(backend, scenario)
    lookup_role = _table_gradient(backend, scenario, detach_head=True)
    output_role = _table_gradient(backend, scenario, detach_lookup=True)
    check = judge.on(scenario.case("backend.loss(model, tokens, targets)"))
    bound = tolerance.at(scenario.config, scenario.tokens.shape[1]).gradients
    check.close("table gradient", full, lookup_role + output_role, bound)
    # A role missing everywhere keeps the sum right (0 + the output role is the full gradient
    # of such a model), so each role must also be there: with two or more tokens in the
    # vocabulary the loss moves every looked-up row and every row of the head.
    if scenario.config.vocabulary_size > 1:
        used = np.unique(scenario.tokens)
        for role, gradient, rows in (
            ("lookup", lookup_role, used),
            ("output", output_role, np.arange(scenario.config.vocabulary_size)),
        ):
            present = bool(np.any(gradient[rows] != 0))
            check.check(
                present, f"{role}-role gradient of rows {rows.tolist()}", "all zero", "not all zero"
            )
    unused = np.setdiff1d(np.arange(scenario.config.vocabulary_size), scenario.tokens)
    check.close(
        "lookup-role gradient of rows never looked up",
        lookup_role[unused],
        np.zeros_like(lookup_role[unused]),
        0.0,
    )


@pytest.mark.rule("TIE-OUTPUT-ROLE")
@suite_settings()
@given(scenario=scenarios(min_vocabulary=3, max_batch=2), data=st.data())
def test_rows_never_looked_up_receive_the_output_role(
    backend: Backend,
    judge: Judge,
    scenario: Scenario,
    tolerance: ToleranceModel,
    data: st.DataObject,
) -> None:
    """For a row v no token looks up, dL/dE[v] = mean over positions of (p_v - [y = v]) h."""
    vocabulary = scenario.config.vocabulary_size
    unused = data.draw(st.sets(st.integers(0, vocabulary - 1), min_size=1, max_size=vocabulary - 1))
    used = np.array(sorted(set(range(vocabulary)) - unused))
    tokens = used[np.asarray(scenario.tokens) % used.size]
    model = scenario.build(backend)
    output = backend.forward(model, tokens)
    hidden = dict(output.stages or [])["final-norm"].reshape(-1, scenario.config.model_width)
    logits = output.logits.reshape(-1, vocabulary)
    probabilities = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    probabilities[np.arange(logits.shape[0]), scenario.targets.reshape(-1)] -= 1.0
    expected = probabilities.T @ hidden / logits.shape[0]
    gradient = backend.loss(model, tokens, scenario.targets).gradients or {}
    rows = sorted(unused)
    case = scenario.case("backend.loss(model, tokens, targets)", unused_rows=rows)
    check = judge.on(dataclasses.replace(case, tokens=tokens))
    check.close(
        f"table gradient of unused rows {rows}",
        np.asarray(gradient[EMBEDDING_NAME])[rows],
        expected[rows],
        tolerance.at(scenario.config, scenario.tokens.shape[1]).gradients,
    )
