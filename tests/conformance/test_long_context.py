"""VALUE-LONG-CONTEXT: its sampled rows, and what a failure says about the rows off."""

from __future__ import annotations

from conformance.test_values import LONG_CONFIG, LONG_ROWS, long_rows_hint


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
