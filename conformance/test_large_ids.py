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

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from conformance.adapter import Backend, Capability, FloatArray
from conformance.checks import Judge
from conformance.scale import runs_at, shape_bound
from spec.formats import Precision, round_to
from spec.parameters import EMBEDDING_NAME

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


NO_ROW = -1


def _rows_looked_up(table: FloatArray, lookup: FloatArray, bound: float) -> IdArray:
    """For each position's lookup, the table row nearest it (largest elementwise distance),
    or ``NO_ROW`` where even that one is farther than ``bound`` (scaled): a lookup scaled or
    shifted after the read (Gemma's sqrt(d)) is no row, not the row it happens to be nearest."""
    flat = lookup.reshape(-1, table.shape[1])
    nearest = [int(np.argmin(np.max(np.abs(table - row), axis=1))) for row in flat]
    return np.array(
        [
            row if Judge.within(looked_up, table[row], bound) else NO_ROW
            for row, looked_up in zip(nearest, flat, strict=True)
        ],
        dtype=np.int64,
    ).reshape(lookup.shape[:-1])


def _selections(wanted: IdArray, read: IdArray) -> str:
    """``[b, t]: ID v read as row r``, for the first few positions that read another row."""
    wrong = np.argwhere(read != wanted)
    shown = [
        f"{[int(i) for i in index]}: ID {int(wanted[tuple(index)])} read as "
        + (
            "no row of the table"
            if read[tuple(index)] == NO_ROW
            else f"row {int(read[tuple(index)])}"
        )
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
    bound = shape_bound(backend, SHAPE_NAME)
    runs = runs_at(SHAPE_NAME, backend)  # the scale rules' runs: the reference's first
    reference = runs.reference()
    config, tokens, targets = runs.shape.config, runs.tokens, runs.targets

    output = runs.forward()
    check = judge.on(runs.case())
    got_logits = np.asarray(output.logits, dtype=np.float64)
    if output.stages is not None:
        got = dict(output.stages)
        lookup = np.asarray(got.get("embedding", np.zeros(0)), dtype=np.float64)
        if lookup.shape == (*tokens.shape, config.model_width):
            read = _rows_looked_up(dict(runs.parameters)[EMBEDDING_NAME], lookup, bound.stages)
            readings = _readings_matching(
                lambda ids: np.array_equal(ids, read), tokens, config.vocabulary_size
            )
            check.check(
                np.array_equal(read, tokens),
                "rows the lookup selected",
                _selections(tokens, read),
                "the row of each ID"
                + (f"; {_hint(readings, 'the rows are those')}" if readings else ""),
            )
        check.close_each("stage", got, reference.stages, bound.stages)

    def forward_matches(read: IdArray) -> bool:
        from conformance.adapters.reference import ReferenceBackend

        oracle = ReferenceBackend()
        expected = oracle.forward(oracle.build(config, runs.parameters), read).logits
        return Judge.within(got_logits, expected, bound.logits)

    hint = ""
    if got_logits.shape == reference.logits.shape and not Judge.within(
        got_logits, reference.logits, bound.logits
    ):
        readings = _readings_matching(forward_matches, tokens, config.vocabulary_size)
        hint = _hint(readings, "the logits are those")
    check.close("logits", got_logits, reference.logits, bound.logits, hint=hint)

    result = runs.loss()
    check = judge.on(runs.case("backend.loss(model, tokens, targets)"))

    def loss_matches(read: IdArray) -> bool:
        # The mean NLL of the backend's own (correct) logits at the targets as read.
        rows = got_logits.reshape(-1, config.vocabulary_size)
        top = rows.max(axis=1)
        lse = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
        nll = float(np.mean(lse - rows[np.arange(rows.shape[0]), read.reshape(-1)]))
        return Judge.within(result.loss, nll, bound.loss)

    hint = ""
    if not Judge.within(result.loss, reference.loss, bound.loss) and np.isfinite(result.loss):
        readings = _readings_matching(loss_matches, targets, config.vocabulary_size)
        hint = _hint(readings, "the loss is that")
    check.close("loss", result.loss, reference.loss, bound.loss, hint=hint)
    if Capability.GRADIENTS in backend.capabilities:
        check.close_each(
            "gradient of", result.gradients, reference.gradients.items(), bound.gradients
        )
