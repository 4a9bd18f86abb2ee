"""Odd widths: every size past a tile, none a multiple of 4.

Generated widths stop at 32 (heads of at most 8, four heads), and the fixed cases past that
are powers of two or their multiples (heads of 128, width 256), so code that is right on whole
groups of 4, 8, 16 or 32 lanes and wrong on the last, partial group is judged by no other
value rule: an RMSNorm that sums its squares in lanes and drops the remainder, a RoPE that
rotates pairs in groups and leaves the last ones as they are, a product whose inner loop or
tile skips the tail. Here the model is ``spec.scale``'s ``odd-widths`` shape (heads of 70, so
35 RoPE pairs, width 210, SwiGLU 333, vocabulary 131, 67 positions, one block; a fraction of
a second), the float64 reference is the oracle, and the bounds are the ones measured at that
shape for the declared precision.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from conformance.adapter import Backend
from conformance.checks import Judge
from conformance.scale import POSITION_TILE, check_against_the_reference, pattern_advice

SHAPE_NAME = "odd-widths"
TILE = POSITION_TILE


def advice(flagged: npt.NDArray[np.bool_]) -> str:
    """What the pattern of positions off (``True`` where off) points at."""
    return pattern_advice(
        flagged,
        rope="over a head's 35 pairs (a loop over groups of pairs that leaves the last, "
        "partial group unrotated?)",
        otherwise="no other value rule sends a width past 32 that is no multiple of 4 (here "
        "heads of 70, width 210, SwiGLU 333, vocabulary 131): where VALUE-WIDE-HEADS passes, "
        "look for the last, partial group of a vectorized loop or tile over features "
        "(RMSNorm's sum of squares, a product's inner dimension) or over the vocabulary",
    )


@pytest.mark.rule("VALUE-ODD-WIDTHS")
def test_odd_widths_match_the_reference(backend: Backend, judge: Judge) -> None:
    """Stages, logits, loss and gradients with every size past a tile and none a multiple
    of 4 against the float64 reference."""
    check_against_the_reference(backend, judge, SHAPE_NAME, advice)
