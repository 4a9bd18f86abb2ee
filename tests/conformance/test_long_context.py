"""VALUE-LONG-CONTEXT and CAUSAL-LONG-REACH: the long sequence's sampled rows, what a failure
says about the rows off, and the change to its first keys that its last row must see."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.adapter import Backend, FloatArray
from conformance.adapters.emulated import EmulatedBackend
from conformance.adapters.reference import ReferenceBackend
from conformance.runner import run_suite
from conformance.test_causality import FAR_KEYS, far_keys_changed
from conformance.test_values import LONG_CONFIG, LONG_ROWS, long_inputs, long_rows_hint
from spec.formats import Precision, number_format


def test_the_rows_reach_past_2048_and_4096_to_the_last_position() -> None:
    assert tuple(sorted(set(LONG_ROWS))) == LONG_ROWS
    assert {2047, 2048, 4095, 4096} <= set(LONG_ROWS)
    assert LONG_ROWS[-1] == LONG_CONFIG.context - 1 > 4096 + 256  # a window of 4096 drops keys


def test_rows_off_from_a_common_length_on_name_what_ends_there() -> None:
    assert long_rows_hint([]) == ""
    assert long_rows_hint([4096, 4607]) == (
        "rows 4096, 4607 of the sampled 10 off, every one from 4096 on and none before: "
        "something of 4096 positions ends there (a RoPE table wrapped or capped, a cache, "
        "an attention window)"
    )
    from_2048 = [row for row in LONG_ROWS if row >= 2048]
    assert "every one from 2048 on and none before" in long_rows_hint(from_2048)
    # Not every row past the length, or some before it: no length is named.
    assert long_rows_hint([4607]) == "row 4607 of the sampled 10 off"
    assert long_rows_hint(list(LONG_ROWS)) == (
        f"rows {', '.join(map(str, LONG_ROWS))} of the sampled 10 off"
    )


def _last_row_moves(backend: Backend) -> tuple[FloatArray, FloatArray]:
    tokens, parameters = long_inputs()
    model = backend.build(LONG_CONFIG, parameters)
    before, after = (
        np.asarray(backend.forward(model, ids).logits, dtype=np.float64)[0, -1]
        for ids in (tokens, far_keys_changed(tokens))
    )
    return before, after


def test_the_first_keys_move_the_last_row_far_past_any_rounding() -> None:
    """CAUSAL-LONG-REACH asks only that row 4607 changes, at every precision: the change it
    makes must be far larger than a 16-bit format could round away."""
    assert LONG_CONFIG.layers == 1  # nothing but attention carries the first keys to the row
    assert LONG_CONFIG.context - FAR_KEYS == 4096  # exactly the keys a 4096-key window drops
    before, after = _last_row_moves(ReferenceBackend())
    assert np.max(np.abs(after - before)) > 0.25 * np.max(np.abs(before))
    for precision in (Precision.FLOAT16, Precision.BFLOAT16):
        emulated = type("Emulated", (EmulatedBackend,), {"precision": precision})()
        before, after = _last_row_moves(emulated)
        digits = number_format(precision).digits
        step = 2.0 ** (np.floor(np.log2(np.abs(before))) - (digits - 1))  # one ulp
        assert np.all(np.abs(after - before) >= 3 * step), precision


@pytest.mark.parametrize(
    ("mutant", "value_status"),
    [("AttentionSlidingWindow", "failed"), ("AttentionWindowInBfloat16", "passed")],
)
def test_a_window_of_4096_keys_fails_at_every_precision(mutant: str, value_status: str) -> None:
    """The bfloat16 window is within VALUE-LONG-CONTEXT's bound; the reach rule sees it."""
    adapter = f"conformance.tools.mutants.numerics:{mutant}"
    report = run_suite(adapter, profile="ci", rules=["CAUSAL-LONG-REACH", "VALUE-LONG-CONTEXT"])
    statuses = {rule.id: rule for rule in report.rules}
    reach = statuses["CAUSAL-LONG-REACH"]
    assert reach.status == "failed", report.output[-2000:]
    assert reach.message.startswith(
        "[CAUSAL-LONG-REACH] logit row 4607 with tokens 0-511 set to 4=bitwise unchanged"
    )
    assert "an attention window of at most 4096 keys" in reach.message
    assert statuses["VALUE-LONG-CONTEXT"].status == value_status
