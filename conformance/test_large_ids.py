"""Large IDs: a vocabulary of 70,001 entries, and IDs that a narrower copy would change.

Every other rule's vocabulary has at most 64 entries, so an ID kept in 8 or 16 bits, or
carried in a bfloat16 or float16 array (a pipeline that casts every input to the model's
dtype), never changes there. Here the tokens and targets (``spec.scale.LARGE_IDS``) sit just
past each of those limits, the model is ``spec.scale``'s ``large-ids`` shape, and the float64
reference is the oracle, at the bounds measured at that shape for the declared precision.
The table is the ``spread`` variant's, so that two rows always differ by more than a 16-bit
format resolves, and a failure names the row an ID selected and the narrower copy that
explains it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from conformance.adapter import Backend, Capability, FloatArray
from conformance.checks import Case, Judge
from spec.formats import Precision, round_to
from spec.parameters import EMBEDDING_NAME
from spec.scale import ScaleShape, scale_shape
from spec.tolerances import MissingScaleBound, Tolerance, scale_tolerance
from spec.variants import scenario_parameters

IdArray = npt.NDArray[np.int64]
SHAPE_NAME = "large-ids"


def _through(precision: Precision) -> Callable[[IdArray], IdArray]:
    def read(ids: IdArray) -> IdArray:
        rounded = round_to(ids.astype(np.float64), precision)
        # Infinity (float16 past 65,519) reads as no ID at all: -1 matches no row.
        return np.where(np.isfinite(rounded), rounded, -1).astype(np.int64)

    return read


# How a port's narrower copy of an ID reads it, named as a failure's hint names it.
READINGS: dict[str, Callable[[IdArray], IdArray]] = {
    "ID kept in 8 bits": lambda ids: ids % 2**8,
    "ID held in bfloat16": _through(Precision.BFLOAT16),
    "ID held in float16": _through(Precision.FLOAT16),
    "ID kept in a signed 16-bit integer": lambda ids: (ids + 2**15) % 2**16 - 2**15,
    "ID kept in 16 bits": lambda ids: ids % 2**16,
}


@functools.cache
def _reference_run(
    name: str,
) -> tuple[list[tuple[str, FloatArray]], FloatArray, float, dict[str, FloatArray]]:
    """The float64 reference's stages, logits, loss and gradients at the shape."""
    from conformance.adapters.reference import ReferenceBackend  # the oracle, by its adapter

    shape = scale_shape(name)
    tokens, targets = shape.tokens_and_targets()
    oracle = ReferenceBackend()
    model = oracle.build(shape.config, scenario_parameters(shape.config, shape.seed, shape.variant))
    forward = oracle.forward(model, tokens)
    loss = oracle.loss(model, tokens, targets)
    return forward.stages or [], forward.logits, loss.loss, loss.gradients or {}


def _bound(backend: Backend) -> Tolerance:
    try:
        return scale_tolerance(backend.precision, SHAPE_NAME)
    except MissingScaleBound as missing:  # no verdict either way: the bound is not known
        pytest.skip(str(missing))


def _case(shape: ScaleShape, call: str) -> Case:
    tokens, targets = shape.tokens_and_targets()
    return Case(shape.config, shape.seed, tokens, targets, call=call, variant=shape.variant)


def _rows_looked_up(table: FloatArray, lookup: FloatArray) -> IdArray:
    """For each position's lookup, the table row nearest it (largest elementwise distance)."""
    flat = lookup.reshape(-1, table.shape[1])
    return np.array(
        [int(np.argmin(np.max(np.abs(table - row), axis=1))) for row in flat], dtype=np.int64
    ).reshape(lookup.shape[:-1])


def _selections(wanted: IdArray, read: IdArray) -> str:
    """``[b, t]: ID v read as row r``, for the first few positions that read another row."""
    wrong = np.argwhere(read != wanted)
    shown = [
        f"{[int(i) for i in index]}: ID {int(wanted[tuple(index)])} read as row "
        f"{int(read[tuple(index)])}"
        for index in wrong[:4]
    ]
    more = f", and {len(wrong) - len(shown)} more" if len(wrong) > len(shown) else ""
    return f"{len(wrong)} of {wanted.size} positions another row (" + "; ".join(shown) + more + ")"


def _as_indexed(ids: IdArray, vocabulary: int) -> IdArray | None:
    """IDs as numpy indexing reads them (a negative one from the end), or None where one
    would be out of range."""
    if ids.min() < -vocabulary or ids.max() >= vocabulary:
        return None
    return ids % vocabulary


def _readings_matching(
    matches: Callable[[IdArray], bool], ids: IdArray, vocabulary: int
) -> list[str]:
    """The readings of ``ids`` (one ID at least changed, every one indexable) that
    ``matches`` accepts."""
    found = []
    for name, reading in READINGS.items():
        read = _as_indexed(reading(ids), vocabulary)
        if read is not None and not np.array_equal(read, ids) and matches(read):
            found.append(name)
    return found


def _hint(readings: list[str], values: str) -> str:
    """``the logits are those`` (``values``) ``of each ID kept in 16 bits``, or nothing."""
    return f"{values} of each {' or '.join(readings)}" if readings else ""


@pytest.mark.rule("VALUE-LARGE-IDS")
def test_large_ids_select_their_own_rows(backend: Backend, judge: Judge) -> None:
    """Lookup rows, logits, loss and gradients at IDs just past 255, 2,048, 32,767 and 65,535
    (and the last row, 70,000) against the float64 reference."""
    shape = scale_shape(SHAPE_NAME)
    bound = _bound(backend)
    tokens, targets = shape.tokens_and_targets()
    parameters = scenario_parameters(shape.config, shape.seed, shape.variant)
    table = dict(parameters)[EMBEDDING_NAME]
    stages, logits, loss, gradients = _reference_run(SHAPE_NAME)

    model = backend.build(shape.config, parameters)
    output = backend.forward(model, tokens)
    check = judge.on(_case(shape, "backend.forward(model, tokens)"))
    got_logits = np.asarray(output.logits, dtype=np.float64)
    if output.stages is not None:
        got = dict(output.stages)
        lookup = np.asarray(got.get("embedding", np.zeros(0)), dtype=np.float64)
        if lookup.shape == (*tokens.shape, shape.config.model_width):
            read = _rows_looked_up(table, lookup)
            readings = _readings_matching(
                lambda ids: np.array_equal(ids, read), tokens, shape.config.vocabulary_size
            )
            check.check(
                np.array_equal(read, tokens),
                "rows the lookup selected",
                _selections(tokens, read),
                "the row of each ID"
                + (f"; {_hint(readings, 'the rows are those')}" if readings else ""),
            )
        for name, exact in stages:
            if name not in got:
                check.fail(f"stage {name}", "missing", f"shape {list(exact.shape)}")
            check.close(f"stage {name}", got[name], exact, bound.stages)

    def forward_matches(read: IdArray) -> bool:
        from conformance.adapters.reference import ReferenceBackend

        oracle = ReferenceBackend()
        expected = oracle.forward(oracle.build(shape.config, parameters), read).logits
        return Judge.within(got_logits, expected, bound.logits)

    hint = ""
    if got_logits.shape == logits.shape and not Judge.within(got_logits, logits, bound.logits):
        readings = _readings_matching(forward_matches, tokens, shape.config.vocabulary_size)
        hint = _hint(readings, "the logits are those")
    check.close("logits", got_logits, logits, bound.logits, hint=hint)

    result = backend.loss(model, tokens, targets)
    check = judge.on(_case(shape, "backend.loss(model, tokens, targets)"))

    def loss_matches(read: IdArray) -> bool:
        # The mean NLL of the backend's own (correct) logits at the targets as read.
        rows = got_logits.reshape(-1, shape.config.vocabulary_size)
        top = rows.max(axis=1)
        lse = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
        nll = float(np.mean(lse - rows[np.arange(rows.shape[0]), read.reshape(-1)]))
        return Judge.within(result.loss, nll, bound.loss)

    hint = ""
    if not Judge.within(result.loss, loss, bound.loss) and np.isfinite(result.loss):
        readings = _readings_matching(loss_matches, targets, shape.config.vocabulary_size)
        hint = _hint(readings, "the loss is that")
    check.close("loss", result.loss, loss, bound.loss, hint=hint)
    if Capability.GRADIENTS not in backend.capabilities:
        return
    got_gradients = result.gradients or {}
    for name, exact in gradients.items():
        if name not in got_gradients:
            check.fail(f"gradient of {name}", "missing", f"shape {list(exact.shape)}")
        check.close(f"gradient of {name}", got_gradients[name], exact, bound.gradients)
