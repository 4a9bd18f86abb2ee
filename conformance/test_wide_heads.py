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

import numpy as np
import numpy.typing as npt
import pytest

from conformance.adapter import Backend
from conformance.checks import Judge
from conformance.scale import POSITION_TILE, check_against_the_reference, pattern_advice

SHAPE_NAME = "wide-heads"
TILE = POSITION_TILE


def advice(flagged: npt.NDArray[np.bool_]) -> str:
    """What the pattern of positions off (``True`` where off) points at."""
    return pattern_advice(
        flagged,
        rope="(over only part of a head of 128?) and the attention weights",
        otherwise="no other value rule sends heads wider than 8 or widths past 32: where "
        "VALUE-STAGES passes, look for code that depends on them (RoPE over part of a head, a "
        "kernel chosen for wide heads)",
    )


@pytest.mark.rule("VALUE-WIDE-HEADS")
def test_wide_heads_match_the_reference(backend: Backend, judge: Judge) -> None:
    """Stages, logits, loss and gradients with heads of width 128 over 80 positions against
    the float64 reference."""
    check_against_the_reference(backend, judge, SHAPE_NAME, advice)
