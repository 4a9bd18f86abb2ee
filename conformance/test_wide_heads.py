"""Wide heads: the head width of most real models, over more positions than a 64-wide tile.

Every generated head is at most 8 wide (the mpmath oracle's cost), and every drawn sequence
is short, so code that depends on the head width past that, or on positions past a tile of
64, is judged by no other value rule: a RoPE that rotates only the first 16, 32 or 64
features of a head (a rotary width carried over from another model), an attention kernel
chosen for heads of 128, a tile whose last, partial block is mishandled. Here the model is
``spec.scale``'s ``wide-heads`` shape (two heads of width 128 over 80 positions, width 256,
SwiGLU 344, one block; a fraction of a second), the float64 reference is the oracle, and the
bounds are the ones measured at that shape for the declared precision, as the scale
profile's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from conformance.adapter import Backend, Capability
from conformance.checks import Judge, describe_positions, off_at_each_position
from conformance.scale import runs_at, shape_bound

SHAPE_NAME = "wide-heads"
TILE = 64  # the position tile engines' attention kernels commonly use


def advice(flagged: npt.NDArray[np.bool_]) -> str:
    """What the pattern of positions off (``True`` where off) points at."""
    if not flagged[0] and flagged[1:].all():
        return (
            "position 0 is right and every later one off: position 0 attends to itself alone, "
            "at RoPE angle 0, so look at RoPE (over only part of a head of 128?) and the "
            "attention weights"
        )
    if flagged.size > TILE and not flagged[:TILE].any():
        return (
            f"only positions from {TILE} on are off: look for a tile of {TILE} positions "
            "(its last, partial block)"
        )
    return (
        "no other value rule sends heads wider than 8 or widths past 32: where VALUE-STAGES "
        "passes, look for code that depends on them (RoPE over part of a head, a kernel "
        "chosen for wide heads)"
    )


def _hint(tolerance: float) -> Callable[[npt.ArrayLike, npt.ArrayLike], str]:
    def hint(got: npt.ArrayLike, exact: npt.ArrayLike) -> str:
        flagged = off_at_each_position(got, exact, tolerance)
        if flagged is None or not flagged.any():
            return ""
        return f"{describe_positions(flagged)}; {advice(flagged)}"

    return hint


@pytest.mark.rule("VALUE-WIDE-HEADS")
def test_wide_heads_match_the_reference(backend: Backend, judge: Judge) -> None:
    """Stages, logits, loss and gradients with heads of width 128 over 80 positions against
    the float64 reference."""
    bound = shape_bound(backend, SHAPE_NAME)
    runs = runs_at(SHAPE_NAME, backend)  # the reference runs first: its activations go first
    reference = runs.reference()

    output = runs.forward()
    check = judge.on(runs.case())
    if output.stages is not None:
        check.close_each(
            "stage", dict(output.stages), reference.stages, bound.stages, hint=_hint(bound.stages)
        )
    check.close(
        "logits",
        output.logits,
        reference.logits,
        bound.logits,
        hint=lambda: _hint(bound.logits)(output.logits, reference.logits),
    )

    result = runs.loss()
    check = judge.on(runs.case("backend.loss(model, tokens, targets)"))
    check.close("loss", result.loss, reference.loss, bound.loss)
    if Capability.GRADIENTS in backend.capabilities:
        check.close_each(
            "gradient of", result.gradients, reference.gradients.items(), bound.gradients
        )
