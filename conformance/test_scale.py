"""Scale: the rules at the size of real models, with the float64 reference as the oracle.

Run by ``--profile scale`` only (``conformance.profiles.runs_rule``), once per shape of
:mod:`spec.scale` (``--scale-shape NAME``, repeatable; by default DEFAULT_SCALE_SHAPES).
Each bound is the declared precision's, measured at the shape itself
(:func:`spec.tolerances.scale_tolerance`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from conformance.adapter import Backend
from conformance.checks import Judge, positions_off
from conformance.scale import ShapeRuns, runs_at, shape_bound
from spec.parameters import EMBEDDING_NAME, parameter_count, parameter_names
from spec.scale import DEFAULT_SCALE_SHAPES
from spec.tolerances import Tolerance
from spec.variants import scenario_parameters


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "shape_name" not in metafunc.fixturenames:
        return
    # Unknown names were refused when the run was configured (conformance.plugin).
    names = metafunc.config.getoption("scale_shape", None) or list(DEFAULT_SCALE_SHAPES)
    metafunc.parametrize("shape_name", list(dict.fromkeys(names)))


def _runs(backend: Backend, shape_name: str) -> tuple[ShapeRuns, Tolerance]:
    """A value rule's runs and bound; the reference runs first, so its activations are gone
    before the backend's model exists (the value rules come first in a shape's order)."""
    bound = shape_bound(backend, shape_name)
    runs = runs_at(shape_name, backend)
    runs.reference()
    return runs, bound


@pytest.mark.rule("SCALE-STAGES")
def test_stages_match_the_reference_at_scale(
    backend: Backend, judge: Judge, shape_name: str
) -> None:
    runs, bound = _runs(backend, shape_name)
    got = dict(runs.forward().stages or [])
    judge.on(runs.case()).close_each(
        "stage",
        got,
        runs.reference().stages,
        bound.stages,
        # The positions off and within: an error from some position on points at a table,
        # cache or tile that ends there.
        hint=lambda stage, exact: positions_off(stage, exact, bound.stages),
    )


@pytest.mark.rule("SCALE-LOGITS")
def test_logits_and_loss_match_the_reference_at_scale(
    backend: Backend, judge: Judge, shape_name: str
) -> None:
    runs, bound = _runs(backend, shape_name)
    got, exact = runs.forward().logits, runs.reference().logits
    judge.on(runs.case()).close(
        "logits", got, exact, bound.logits, hint=lambda: positions_off(got, exact, bound.logits)
    )
    judge.on(runs.case("backend.loss(model, tokens, targets)")).close(
        "loss", runs.loss().loss, runs.reference().loss, bound.loss
    )


@pytest.mark.rule("SCALE-GRADIENTS")
def test_gradients_match_the_reference_at_scale(
    backend: Backend, judge: Judge, shape_name: str
) -> None:
    runs, bound = _runs(backend, shape_name)
    check = judge.on(runs.case("backend.loss(model, tokens, targets).gradients"))
    check.close_each(
        "gradient of", runs.loss().gradients, runs.reference().gradients.items(), bound.gradients
    )


def _late_position(positions: int) -> int:
    return positions - 1 - positions // 4


@pytest.mark.rule("SCALE-CAUSALITY")
def test_a_late_token_changes_no_earlier_row_at_scale(
    backend: Backend, judge: Judge, shape_name: str
) -> None:
    """Prefix rows bitwise, over hundreds to thousands of positions: a mask applied after
    a blocked kernel, or a cache indexed past its length, leaks at sizes like these."""
    runs = runs_at(shape_name, backend)
    position = _late_position(runs.shape.positions)
    changed = runs.tokens.copy()
    changed[0, position] = (changed[0, position] + 1) % runs.shape.config.vocabulary_size
    before = np.asarray(runs.forward().logits)
    after = np.asarray(backend.forward(runs.model(), changed).logits)
    vocabulary = runs.shape.config.vocabulary_size
    call = (
        f"changed = tokens.copy(); changed[0, {position}] = (changed[0, {position}] + 1) % "
        f"{vocabulary}\nbackend.forward(model, tokens), backend.forward(model, changed)"
    )
    check = judge.on(runs.case(call, position=position))
    check.same_bits(
        f"logits rows 0-{position - 1} of sequence 0", after[0, :position], before[0, :position]
    )
    check.check(
        not np.array_equal(after[0, position], before[0, position]),
        f"logits row {position} of sequence 0 after its token changed",
        "unchanged",
        "changed",
    )


# Sequences this long at most are run as a batch of two when a shape has one sequence.
_PAIR_LENGTH = 1024


@pytest.mark.rule("SCALE-BATCH")
def test_a_sequence_alone_matches_the_batch_at_scale(
    backend: Backend, judge: Judge, shape_name: str
) -> None:
    bound = shape_bound(backend, shape_name)
    runs = runs_at(shape_name, backend)
    model = runs.model()
    if runs.shape.batch > 1:
        together = np.asarray(runs.forward().logits)
        tokens = runs.tokens
        setup = ""
    else:
        length = min(_PAIR_LENGTH, runs.shape.positions)
        first = runs.tokens[0, :length]
        tokens = np.stack([first, first[::-1]])
        together = np.asarray(backend.forward(model, tokens).logits)
        setup = f"tokens = np.stack([tokens[0, :{length}], tokens[0, :{length}][::-1]])\n"
    last = tokens.shape[0] - 1
    alone = np.asarray(backend.forward(model, tokens[last : last + 1]).logits)
    call = f"{setup}backend.forward(model, tokens), backend.forward(model, tokens[{last}:])"
    check = judge.on(runs.case(call))
    check.close(f"logits of sequence {last} run alone", alone[0], together[last], bound.logits)


def _looked_up_late(sequence: npt.NDArray[np.int64]) -> tuple[int, int]:
    """A token of the sequence and its first position, the first one past position 0 found
    from the middle on (so rows 0 .. first-1 never look it up)."""
    for position in range(len(sequence) // 2, len(sequence)):
        row = int(sequence[position])
        first = int(np.argmax(sequence == row))
        if first > 0:
            return row, first
    return int(sequence[0]), 0  # every token already at position 0: only one sequence ID


@pytest.mark.rule("SCALE-TYING")
def test_one_table_serves_both_roles_at_scale(
    backend: Backend, judge: Judge, shape_name: str
) -> None:
    """The stable names and count at a real model's depth, then one table row changed: its
    logit column moves in rows that never looked it up, and nothing else there does; where
    it is first looked up, that row moves too."""
    runs = runs_at(shape_name, backend)
    config = runs.shape.config
    check = judge.on(runs.case("backend.parameters(model)"))
    named = backend.parameters(runs.model())
    names = [name for name, _ in named]
    expected = parameter_names(config)
    check.check(names == expected, "parameter names", names, "the 2 + 9N stable names in order")
    count = sum(int(np.size(value)) for _, value in named)
    formula = f"{parameter_count(config)} (Vd + N(4d^2 + 3df + 2d) + d: one table, no head)"
    check.check(count == parameter_count(config), "parameter scalars", count, formula)
    del named
    before = np.asarray(runs.forward().logits)[0]
    runs.drop_model()  # the changed model is built while only the answers above are held
    row, first_use = _looked_up_late(runs.tokens[0])
    scaled = np.where(np.arange(config.vocabulary_size) == row, -1.5, 1.0)[:, None]
    shape = runs.shape
    parameters = [
        (name, value * scaled if name == EMBEDDING_NAME else value)
        for name, value in scenario_parameters(config, shape.seed, shape.variant)
    ]
    changed = backend.forward(backend.build(config, parameters), runs.tokens)
    del parameters
    after = np.asarray(changed.logits)[0]
    call = (
        f"parameters = [(n, v * np.where(np.arange({config.vocabulary_size}) == {row}, -1.5, "
        f"1.0)[:, None] if n == {EMBEDDING_NAME!r} else v) for n, v in parameters]\n"
        "backend.forward(model, tokens), backend.forward(backend.build(config, parameters), "
        "tokens)"
    )
    check = judge.on(runs.case(call, row=row))
    others = np.arange(config.vocabulary_size) != row
    if first_use > 0:
        check.same_bits(
            f"logits rows 0-{first_use - 1}, columns other than {row}, after table row {row} "
            "changed",
            after[:first_use, others],
            before[:first_use, others],
        )
        check.check(
            not np.array_equal(after[:first_use, row], before[:first_use, row]),
            f"logit column {row} in rows 0-{first_use - 1} after table row {row} changed",
            "unchanged (the head does not read the table)",
            "changed",
        )
    check.check(
        not np.array_equal(after[first_use, others], before[first_use, others]),
        f"logits row {first_use} (token {row}), columns other than {row}, after table row "
        f"{row} changed",
        "unchanged (the lookup does not read the table)",
        "changed",
    )
