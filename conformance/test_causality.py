"""Causality and batch independence: what a logit row may depend on."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapter import Backend, FloatArray
from conformance.cases import IdArray, Scenario, must_differ, scenarios
from conformance.checks import Case, Judge, positions_off
from conformance.profiles import suite_settings
from conformance.test_values import LONG_CONFIG, LONG_SEED, long_inputs, long_targets
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


def _long_logits(
    backend: Backend, judge: Judge, change: Callable[[IdArray], IdArray], call: str
) -> tuple[Judge, FloatArray, FloatArray]:
    """The judge bound to the long sequence (``call`` its reproduction), and the logits of its
    sequence 0 as drawn and after ``change``, their shapes checked."""
    tokens, parameters = long_inputs()
    changed = change(tokens)
    check = judge.on(Case(LONG_CONFIG, LONG_SEED, tokens, call=call, variant="varied"))
    model = backend.build(LONG_CONFIG, parameters)
    rows = [np.asarray(backend.forward(model, ids).logits) for ids in (tokens, changed)]
    shape = (1, LONG_CONFIG.context, LONG_CONFIG.vocabulary_size)
    for logits in rows:
        check.check(logits.shape == shape, "logits shape", list(logits.shape), list(shape))
    return check, rows[0][0], rows[1][0]


# VALUE-LONG-CONTEXT's sequence with its tokens from LATE_KEYS on changed: rows before them
# may not move. A kernel that takes a tiled or chunked path only past some length (a prefill in
# chunks of 1024 queries whose causal mask is dropped after the first chunk, as code that skips
# the mask whenever a key/value cache holds keys does; a mask applied per tile of keys) lets a
# row see the later keys of its own tile or chunk only at lengths the drawn sequences never
# reach. 4700 is no multiple of 8, so every tile of 8 or more positions holding 4700 also holds
# rows before it. Bitwise, so a leak too small for any value bound still fails.
LATE_KEYS = 4700


def late_keys_changed(tokens: IdArray) -> IdArray:
    """``tokens`` with every token from LATE_KEYS on replaced by the next ID."""
    changed = tokens.copy()
    changed[:, LATE_KEYS:] = (changed[:, LATE_KEYS:] + 1) % LONG_CONFIG.vocabulary_size
    return changed


@pytest.mark.rule("CAUSAL-PREFIX-BITWISE")
def test_long_rows_do_not_see_later_keys(backend: Backend, judge: Judge) -> None:
    last = LONG_CONFIG.context - 1
    call = (
        "changed_tokens = tokens.copy()\n"
        f"changed_tokens[:, {LATE_KEYS}:] = (changed_tokens[:, {LATE_KEYS}:] + 1) % "
        f"{LONG_CONFIG.vocabulary_size}\n"
        f"before = backend.forward(model, tokens).logits[0, :{LATE_KEYS}]\n"
        f"after = backend.forward(model, changed_tokens).logits[0, :{LATE_KEYS}]\n"
        "# the rule: rows before the changed tokens are bitwise the same\n"
        "print(before.tobytes() == after.tobytes())"
    )
    check, before, after = _long_logits(backend, judge, late_keys_changed, call)
    before, after = before[:LATE_KEYS], after[:LATE_KEYS]
    changed_keys = f"tokens {LATE_KEYS}-{last} changed"
    check.finite(f"logit rows 0-{LATE_KEYS - 1}", before)
    check.finite(f"logit rows 0-{LATE_KEYS - 1} with {changed_keys}", after)
    moved = np.flatnonzero(np.any(before != after, axis=-1))
    if moved.size == 0:
        return
    worst = float(np.max(np.abs(before[moved] - after[moved])))
    check.fail(
        f"logit rows 0-{LATE_KEYS - 1} with {changed_keys}",
        f"{moved.size} rows changed (the first {moved[0]}, the last {moved[-1]}) "
        f"by up to {worst:.3e}",
        f"bitwise unchanged: a row that moves sees keys after it, at a length the drawn "
        f"sequences never reach (a causal mask applied per tile or chunk of positions, or one "
        f"dropped after a chunked prefill's first chunk); the first moved row, {moved[0]}, "
        f"is {LATE_KEYS - moved[0]} positions before the first changed key",
    )


# VALUE-LONG-CONTEXT's sequence with its first FAR_KEYS tokens set to FAR_TOKEN: for its last
# row those are the keys 4096 or more positions back, which a window of 4096 keys (Mistral's)
# hides. With one block nothing else carries them to that row, so a windowed backend gives
# the row bitwise unchanged, at any precision. Token 5 draws the row's attention (chosen by
# measurement over the 7 tokens): the reference's row moves by 3.2, 1.65 times its largest
# logit, and each of its 7 logits moves by at least 72 bfloat16 steps in the bfloat16
# emulation (tests/conformance/test_long_context.py).
FAR_KEYS = LONG_CONFIG.context - 4096
FAR_TOKEN = 5


def far_keys_changed(tokens: IdArray) -> IdArray:
    """``tokens`` with the first FAR_KEYS of every sequence set to FAR_TOKEN."""
    changed = tokens.copy()
    changed[:, :FAR_KEYS] = FAR_TOKEN
    return changed


@pytest.mark.rule("CAUSAL-LONG-REACH")
def test_the_last_row_sees_the_first_keys(backend: Backend, judge: Judge) -> None:
    last = LONG_CONFIG.context - 1
    call = (
        "changed_tokens = tokens.copy()\n"
        f"changed_tokens[:, :{FAR_KEYS}] = {FAR_TOKEN}\n"
        f"before = backend.forward(model, tokens).logits[0, {last}]\n"
        f"after = backend.forward(model, changed_tokens).logits[0, {last}]\n"
        "# the rule: the last row moves when the first keys change\n"
        "print((before != after).any())"
    )
    check, before, after = _long_logits(backend, judge, far_keys_changed, call)
    before, after = before[last], after[last]
    changed_keys = f"tokens 0-{FAR_KEYS - 1} set to {FAR_TOKEN}"
    check.finite(f"logit row {last}", before)
    check.finite(f"logit row {last} with {changed_keys}", after)
    check.check(
        bool(np.any(before != after)),
        f"logit row {last} with {changed_keys}",
        "bitwise unchanged",
        f"changed (the float64 reference's row moves by about 3): a row of {LONG_CONFIG.context} "
        f"positions that does not see the keys {last - FAR_KEYS + 1} or more positions back "
        "is an attention window of at most 4096 keys (a sliding_window carried over from "
        "Mistral), or a cache that keeps only the last 4096 positions",
    )


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


@pytest.mark.rule("BATCH-INDEPENDENCE")
def test_long_sequences_in_one_batch_do_not_see_each_other(
    backend: Backend, judge: Judge, tolerance: ToleranceModel
) -> None:
    """Two sequences of 4715 positions in one batch, each against itself run alone: a batched
    path taken only past some length (a prefill in chunks, a key/value cache indexed without
    the sequence) is seen only where a batch holds long sequences; the drawn batches are a
    few positions long. Bounded by the long sequence's own logits bound."""
    tokens, parameters = long_inputs()
    sequences = (tokens, long_targets())  # the targets serve as a second, unrelated sequence
    batch = np.concatenate(sequences)
    call = (
        "together = backend.forward(model, tokens).logits  # two sequences of 4715 positions\n"
        "alone = [backend.forward(model, tokens[i : i + 1]).logits[0] for i in range(2)]"
    )
    check = judge.on(Case(LONG_CONFIG, LONG_SEED, batch, call=call, variant="varied"))
    model = backend.build(LONG_CONFIG, parameters)
    together = np.asarray(backend.forward(model, batch).logits)
    shape = (2, LONG_CONFIG.context, LONG_CONFIG.vocabulary_size)
    check.check(together.shape == shape, "logits shape", list(together.shape), list(shape))
    bound = tolerance.at(LONG_CONFIG, LONG_CONFIG.context, case="long-context").logits
    for row, ids in enumerate(sequences):
        alone = np.asarray(backend.forward(model, ids).logits)
        check.close(
            f"logits of long sequence {row} run alone",
            alone[0],
            together[row],
            bound,
            hint=functools.partial(positions_off, alone, together[row : row + 1], bound),
        )
