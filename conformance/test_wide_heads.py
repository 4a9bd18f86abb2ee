"""Wide heads: the head width of most real models, over more positions than a 64-wide tile.

Every generated head is at most 8 wide (the mpmath oracle's cost), and every drawn sequence
is short, so code that depends on the head width past that, or on positions past a tile of
64, is judged by no other value rule: a RoPE that rotates only the first 16, 32 or 64
features of a head (a rotary width carried over from another model), an attention kernel
chosen for heads of 128, a tile whose last, partial block is mishandled. Here the model is
``spec.scale``'s ``wide-heads`` shape (two heads of width 128 over 80 positions, width 256,
SwiGLU 344, one block: a second), the float64 reference is the oracle, and the bounds are the
ones measured at that shape for the declared precision, as the scale profile's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from conformance.adapter import Backend, Capability
from conformance.checks import Judge
from conformance.scale import runs_at, shape_bound
from spec.tolerances import scaled_error

SHAPE_NAME = "wide-heads"


def _spans(positions: npt.NDArray[np.intp]) -> str:
    """``0-63, 70`` for sorted positions."""
    spans: list[str] = []
    start = previous = int(positions[0])
    for position in (*(int(p) for p in positions[1:]), None):
        if position is not None and position == previous + 1:
            previous = position
            continue
        spans.append(f"{start}" if start == previous else f"{start}-{previous}")
        if position is not None:
            start = previous = position
    return ", ".join(spans)


def positions_off(got: npt.ArrayLike, exact: npt.ArrayLike, tolerance: float) -> str:
    """Which positions (axis 1 of ``[B, T, ...]``) of ``got`` are past ``tolerance``, and
    which are within: ``positions 64-79 of 80 off (0-63 within)``; nothing when the shapes
    differ or none is off."""
    got_array = np.asarray(got, dtype=np.float64)
    exact_array = np.asarray(exact, dtype=np.float64)
    if got_array.shape != exact_array.shape or got_array.ndim < 2:
        return ""
    errors = scaled_error(got_array, exact_array)
    off_at = ~(errors <= tolerance)  # NaN (not finite) counts as off
    per_position = off_at.reshape(*off_at.shape[:2], -1).any(axis=(0, 2))
    off = np.flatnonzero(per_position)
    if off.size == 0:
        return ""
    within = np.flatnonzero(~per_position)
    noun = "position" if within.size == 1 else "positions"
    kept = f" ({noun} {_spans(within)} within)" if within.size else ""
    return f"positions {_spans(off)} of {per_position.size} off{kept}"


def _hint(tolerance: float) -> Callable[[npt.ArrayLike, npt.ArrayLike], str]:
    def hint(got: npt.ArrayLike, exact: npt.ArrayLike) -> str:
        where = positions_off(got, exact, tolerance)
        return (
            (f"{where}; " if where else "")
            + "heads of width 128 and positions past 64 are sent by no other value rule: look "
            "for code that depends on the head width (RoPE over part of a head, a kernel for "
            "wide heads) or on the position (a tile of 64)"
        )

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
    logits_hint = _hint(bound.logits)
    check.close(
        "logits",
        output.logits,
        reference.logits,
        bound.logits,
        hint=logits_hint(output.logits, reference.logits),
    )

    result = runs.loss()
    check = judge.on(runs.case("backend.loss(model, tokens, targets)"))
    check.close("loss", result.loss, reference.loss, bound.loss)
    if Capability.GRADIENTS in backend.capabilities:
        check.close_each(
            "gradient of", result.gradients, reference.gradients.items(), bound.gradients
        )
