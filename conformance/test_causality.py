"""Causality and batch independence: what a logit row may depend on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapter import Backend
from conformance.cases import IdArray, Scenario, must_differ, scenarios
from conformance.checks import Judge
from conformance.profiles import suite_settings
from spec.tolerances import ToleranceModel


def _change_one_position(scenario: Scenario, data: st.DataObject) -> tuple[int, IdArray]:
    """A drawn position, and the tokens with every sequence's token there changed."""
    position = data.draw(st.integers(0, scenario.tokens.shape[1] - 1), label="changed position")
    shift = data.draw(st.integers(1, scenario.config.vocabulary_size - 1), label="id shift")
    changed = scenario.tokens.copy()
    changed[:, position] = (changed[:, position] + shift) % scenario.config.vocabulary_size
    return position, changed


@pytest.mark.rule("CAUSAL-PREFIX-BITWISE")
@suite_settings()
@given(scenario=scenarios(min_vocabulary=2, full_context=True), data=st.data())
def test_changing_token_t_leaves_earlier_rows_bitwise_unchanged(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    """Full-length runs (no truncation) so a mask that lets position t see t+1 shows."""
    position, changed = _change_one_position(scenario, data)
    model = scenario.build(backend)
    before = backend.forward(model, scenario.tokens).logits
    after = backend.forward(model, changed).logits
    call = (
        "before = backend.forward(model, tokens).logits\n"
        "after = backend.forward(model, changed_tokens).logits\n"
        "# the rule: rows before changed_position are bitwise the same\n"
        "print(before[:, :changed_position].tobytes() == after[:, :changed_position].tobytes())"
    )
    check = judge.on(scenario.case(call, changed_position=position, changed_tokens=changed))
    check.finite("logits", before)
    check.finite(f"logits after changing token {position}", after)
    for earlier in range(position):
        same = before[:, earlier].tobytes() == after[:, earlier].tobytes()
        worst = float(np.max(np.abs(before[:, earlier] - after[:, earlier])))
        check.check(
            same,
            f"logit row {earlier} after changing token {position}",
            f"changed by up to {worst:.3e}",
            "bitwise unchanged",
        )


@pytest.mark.rule("CAUSAL-POSITION-CHANGES")
@suite_settings()
@given(scenario=scenarios(min_vocabulary=2), data=st.data())
def test_changing_token_t_changes_row_t(
    backend: Backend,
    judge: Judge,
    scenario: Scenario,
    tolerance: ToleranceModel,
    data: st.DataObject,
) -> None:
    position, changed = _change_one_position(scenario, data)
    model = scenario.build(backend)
    before = backend.forward(model, scenario.tokens).logits[:, position]
    after = backend.forward(model, changed).logits[:, position]
    call = (
        "before = backend.forward(model, tokens).logits[:, changed_position]\n"
        "after = backend.forward(model, changed_tokens).logits[:, changed_position]\n"
        "# the rule: row changed_position moves in every sequence\n"
        "print((before != after).any(axis=-1).all())"
    )
    check = judge.on(scenario.case(call, changed_position=position, changed_tokens=changed))
    check.finite(f"logit row {position}", before)
    check.finite(f"logit row {position} after changing token {position}", after)
    # Every sequence whose exact row moves by more than twice the tolerance (all of them
    # at float64 and float32; a 16-bit format may round a smaller move away).
    parameters = scenario.parameters()
    bound = tolerance.at(scenario.config, scenario.tokens.shape[1]).logits
    exact_moves = must_differ(
        scenario.config, (parameters, scenario.tokens), (parameters, changed), bound
    )[:, position]
    moved = bool(np.all(np.any(before != after, axis=-1)[np.any(exact_moves, axis=-1)]))
    check.check(moved, f"logit row {position} changed in every sequence", moved, True)


@pytest.mark.rule("BATCH-INDEPENDENCE")
@suite_settings()
@given(scenario=scenarios(max_batch=3), data=st.data())
def test_sequences_do_not_see_each_other(
    backend: Backend,
    judge: Judge,
    scenario: Scenario,
    tolerance: ToleranceModel,
    data: st.DataObject,
) -> None:
    model = scenario.build(backend)
    together = backend.forward(model, scenario.tokens).logits
    row = data.draw(st.integers(0, scenario.tokens.shape[0] - 1))
    alone = backend.forward(model, scenario.tokens[row : row + 1]).logits
    check = judge.on(scenario.case(row=row))
    bound = tolerance.at(scenario.config, scenario.tokens.shape[1]).logits
    check.close(f"logits of sequence {row} run alone", alone[0], together[row], bound)
