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


def test_every_power_of_two_tiling_ends_in_a_partial_tile_with_sampled_rows() -> None:
    """A kernel right on whole tiles of 2^k positions and wrong on a shorter last one is seen
    only when the length is no multiple of the tile, and only in rows of that last tile."""
    length = LONG_CONFIG.context
    for tile in (2**k for k in range(1, 13)):
        assert length % tile, tile
        last_tile_start = length - length % tile
        assert any(row >= last_tile_start for row in LONG_ROWS), tile
    assert {4607, 4608} <= set(LONG_ROWS)  # both sides of the 128-, 256- and 512-tile edge
    assert length % 512 > 64  # a tail of many rows, not one


def test_rows_off_from_a_common_length_on_name_what_ends_there() -> None:
    assert long_rows_hint([]) == ""
    assert long_rows_hint([4096, 4607, 4608, 4714]) == (
        "rows 4096, 4607, 4608, 4714 of the sampled 12 off, every one from 4096 on and none "
        "before: "
        "something of 4096 positions ends there (a RoPE table wrapped or capped, a cache, "
        "an attention window)"
    )
    from_2048 = [row for row in LONG_ROWS if row >= 2048]
    assert "every one from 2048 on and none before" in long_rows_hint(from_2048)
    # Not every row past the length, or some before it: no length is named.
    assert long_rows_hint([4607, 4714]) == "rows 4607, 4714 of the sampled 12 off"
    # Only rows of the partial last tile: the tile is named.
    assert long_rows_hint([4714]) == (
        "row 4714 of the sampled 12 off, none before 4608: 4715 positions end in a partial tile "
        "(4608 + 107 for tiles of 128, 256 or 512), where a kernel or a prefill chunk right on "
        "whole tiles goes wrong on the last, shorter one; or the last row lost its first keys "
        "(an attention window: see CAUSAL-LONG-REACH)"
    )
    assert long_rows_hint(list(LONG_ROWS)) == (
        f"rows {', '.join(map(str, LONG_ROWS))} of the sampled 12 off"
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
    """CAUSAL-LONG-REACH asks only that the last row changes, at every precision: the change
    it makes must be far larger than a 16-bit format could round away."""
    assert LONG_CONFIG.layers == 1  # nothing but attention carries the first keys to the row
    assert LONG_CONFIG.context - FAR_KEYS == 4096  # exactly the keys a 4096-key window drops
    before, after = _last_row_moves(ReferenceBackend())
    assert np.max(np.abs(after - before)) > np.max(np.abs(before))  # 1.65 times
    for precision in (Precision.FLOAT16, Precision.BFLOAT16):
        emulated = type("Emulated", (EmulatedBackend,), {"precision": precision})()
        before, after = _last_row_moves(emulated)
        digits = number_format(precision).digits
        step = 2.0 ** (np.floor(np.log2(np.abs(before))) - (digits - 1))  # one ulp
        assert np.all(np.abs(after - before) >= 32 * step), precision  # 72 and 540 measured


@pytest.mark.parametrize("mutant", ["AttentionSlidingWindow", "AttentionWindowInBfloat16"])
def test_a_window_of_4096_keys_fails_at_every_precision(mutant: str) -> None:
    """The reach rule needs no bound; the long sequence's last row also moves past the
    bfloat16 bound (1.43 against 0.986), so VALUE-LONG-CONTEXT fails at both precisions."""
    adapter = f"conformance.tools.mutants.numerics:{mutant}"
    report = run_suite(adapter, profile="ci", rules=["CAUSAL-LONG-REACH", "VALUE-LONG-CONTEXT"])
    statuses = {rule.id: rule for rule in report.rules}
    reach = statuses["CAUSAL-LONG-REACH"]
    assert reach.status == "failed", report.output[-2000:]
    assert reach.message.startswith(
        "[CAUSAL-LONG-REACH] logit row 4714 with tokens 0-618 set to 5=bitwise unchanged"
    )
    assert "an attention window of at most 4096 keys" in reach.message
    assert statuses["VALUE-LONG-CONTEXT"].status == "failed"


def test_a_mask_dropped_after_the_first_prefill_chunk_fails_only_the_bitwise_rule() -> None:
    """Rows 1024 and on see the rest of their chunk of 1024: in bfloat16 the leak stays within
    the long sequence's value bound, and only the bitwise prefix check on it fails."""
    adapter = "conformance.tools.mutants.numerics:PrefillChunkSeesAheadInBfloat16"
    report = run_suite(adapter, profile="ci", rules=["CAUSAL-PREFIX-BITWISE", "VALUE-LONG-CONTEXT"])
    prefix = report.rule("CAUSAL-PREFIX-BITWISE")
    assert prefix.status == "failed", report.output[-2000:]
    assert prefix.message.startswith(
        "[CAUSAL-PREFIX-BITWISE] logit rows 0-4699 with tokens 4700-4714 changed="
    )
    assert "(the first 4096, the last 4698)" in prefix.message  # the chunk that holds 4700
    assert "dropped after a chunked prefill's first chunk" in prefix.message
    assert report.rule("VALUE-LONG-CONTEXT").status == "passed"


def test_a_loss_that_drops_a_partial_last_chunk_is_named() -> None:
    adapter = "conformance.tools.mutants.training:LossDropsAPartialLastChunk"
    report = run_suite(adapter, profile="ci", rules=["LOSS-MEAN-NLL"])
    rule = report.rule("LOSS-MEAN-NLL")
    assert rule.status == "failed", report.output[-2000:]
    assert "the loss is the mean over positions 0-4095 only" in rule.message
    assert "chunks of 1024 or 2048 or 4096 positions" in rule.message


def test_a_long_batch_that_shares_a_cache_fails_batch_independence() -> None:
    adapter = "conformance.tools.mutants.numerics:LongBatchSharesTheFirstChunk"
    report = run_suite(adapter, profile="ci", rules=["BATCH-INDEPENDENCE"])
    rule = report.rule("BATCH-INDEPENDENCE")
    assert rule.status == "failed", report.output[-2000:]
    assert rule.message.startswith("[BATCH-INDEPENDENCE] logits of long sequence 1 run alone")
