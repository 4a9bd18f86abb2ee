"""Gradients over a long sequence: the backward pass at 4715 positions.

Every other gradient the suite checks is taken over at most 80 positions, and the ``scale``
profile's long shape is 8,192 positions, a whole number of every power-of-two tile. So a
backward pass that is right on whole tiles or chunks and wrong on the last, partial one
passed every rule: an attention backward in key tiles of 128 that leaves the partial last
tile's key and value gradients at 0, and a loss whose backward weights each chunk of 1,024
rows by one over the chunks' count times its own length (a mean of chunk means: right when
every chunk is whole) while its value is right. Here the model is ``spec.scale``'s
``long-gradients`` shape (one block, width 16, one head, 4715 positions: 36 tiles of 128 and
107 positions more; a second or two), the float64 reference is the oracle, and the bounds
are the ones measured at that shape for the declared precision. The weight gradients are
sums over all 4715 positions, so they also see a sum kept in a precision narrower than the
one declared.
"""

from __future__ import annotations

import pytest

from conformance.adapter import Backend
from conformance.checks import Judge
from conformance.scale import check_loss_and_gradients

SHAPE_NAME = "long-gradients"

# Gradients that see neither attention's backward (they come before it on the way back from
# the loss): the final norm's gain and the feed-forward half of the block.
_AFTER_ATTENTION = (
    "final_norm.gain",
    ".ffn_norm.gain",
    ".ffn.gate.weight",
    ".ffn.up.weight",
    ".ffn.down.weight",
)


def advice(off: set[str]) -> str:
    """What the set of gradients off points at."""
    names = ", ".join(sorted(off))
    if "final_norm.gain" in off:
        return (
            f"off: {names}; final_norm.gain's gradient sees nothing but the final RMSNorm and "
            "the loss's backward, so look at the loss's backward over 4715 rows: each row's "
            "weight is 1/4715 (a loss taken in chunks of rows whose backward weights a chunk by "
            "its own length, or leaves out or double counts the last, partial chunk)"
        )
    attention = any(".attention." in name for name in off)
    if attention and not any(name.endswith(_AFTER_ATTENTION) for name in off):
        return (
            f"off: {names}; every gradient after attention on the way back (the final norm's "
            "and the feed-forward half's) is within, so look at attention's backward past the "
            "first tiles: the last, partial tile of keys or queries (its dK, dV, dQ) of a "
            "kernel tiled in 64, 128 or 256 positions"
        )
    return (
        f"off: {names}; every weight gradient here is a sum over 4715 positions: look for one "
        "kept in a precision narrower than the one declared, or taken in tiles or chunks of "
        "positions whose last, partial one is mishandled"
    )


@pytest.mark.rule("GRAD-LONG-CONTEXT")
def test_gradients_over_a_long_sequence_match_the_reference(backend: Backend, judge: Judge) -> None:
    """The loss and every gradient over 4715 positions against the float64 reference."""
    check_loss_and_gradients(backend, judge, SHAPE_NAME, advice)
