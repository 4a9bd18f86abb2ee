"""VALUE-LARGE-IDS: its IDs, its readings of narrower copies, and the hints it gives."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.runner import run_suite
from conformance.test_large_ids import NO_ROW, READINGS, _rows_looked_up, _selections
from spec.formats import Precision
from spec.scale import LARGE_IDS, scale_shape
from spec.tolerances import scale_tolerance

# The first ID each narrower copy changes.
LIMITS = {"8 bits": 256, "bfloat16": 257, "float16": 2049, "int16": 32768, "16 bits": 65536}


def test_the_shape_holds_ids_past_every_narrower_copys_limit() -> None:
    shape = scale_shape("large-ids")
    tokens, targets = shape.tokens_and_targets()
    assert tokens.shape == targets.shape == (shape.batch, shape.positions)
    assert tokens.tolist() == [list(row) for row in LARGE_IDS[:2]]
    vocabulary = shape.config.vocabulary_size
    for ids in (tokens, targets):
        assert ids.min() >= 0 and ids.max() < vocabulary
        for limit in LIMITS.values():  # each limit passed by tokens and by targets alike
            assert np.any((ids >= limit) & (ids < 2 * limit)), limit
    assert vocabulary - 1 in tokens and vocabulary - 1 in targets  # the last row too
    assert shape.variant == "spread"


@pytest.mark.parametrize(
    ("reading", "wanted", "read"),
    [
        ("ID kept in 8 bits", 257, 1),
        ("ID held in bfloat16", 257, 256),
        ("ID held in bfloat16", 129, 129),
        ("ID held in float16", 2049, 2048),
        ("ID held in float16", 65535, -1),  # infinity: no row at all
        ("ID kept in a signed 16-bit integer", 32768, -32768),
        ("ID kept in 16 bits", 65537, 1),
        ("ID kept in 16 bits", 65535, 65535),
    ],
)
def test_each_reading_is_the_narrower_copy_it_names(reading: str, wanted: int, read: int) -> None:
    assert READINGS[reading](np.array([wanted], dtype=np.int64)).tolist() == [read]


def test_every_reading_changes_some_id_of_the_shape() -> None:
    tokens, targets = scale_shape("large-ids").tokens_and_targets()
    for name, reading in READINGS.items():
        assert not np.array_equal(reading(tokens), tokens), name
        assert not np.array_equal(reading(targets), targets), name


def test_the_shape_has_bounds_at_every_precision() -> None:
    for precision in Precision:
        bound = scale_tolerance(precision, "large-ids")
        assert 0 < bound.logits < 2, precision  # a wrong row moves logits by ~10 here


def _failure(adapter: str) -> str:
    report = run_suite(adapter, profile="ci", rules=["VALUE-LARGE-IDS"])
    rule = report.rule("VALUE-LARGE-IDS")
    assert rule.status == "failed", report.output[-2000:]
    return rule.message


def test_a_token_kept_in_16_bits_is_named_with_its_position_and_row() -> None:
    message = _failure("conformance.tools.mutants.inputs:TokenIdsKeptInUint16")
    assert "rows the lookup selected=5 of 24 positions another row" in message
    assert "[0, 0]: ID 65537 read as row 1" in message
    assert "the rows are those of each ID kept in 16 bits" in message


def test_a_target_kept_in_int16_is_named_by_the_loss() -> None:
    message = _failure("conformance.tools.mutants.inputs:TargetIdsKeptInInt16")
    assert message.startswith("[VALUE-LARGE-IDS] loss=")
    assert "the loss is that of each ID kept in a signed 16-bit integer" in message


def test_a_lookup_that_is_no_row_is_not_named_as_the_row_nearest_it() -> None:
    """A lookup scaled after the read (Gemma's sqrt(d), copied into a port) is near some
    row of a 70,001-row table by chance; naming that row would send the reader to the IDs."""
    table = np.random.default_rng(0).normal(size=(500, 8))
    ids = np.array([[3, 257, 499]])
    exact, wrong_row = table[ids], table[[[3, 1, 499]]]
    rounded = exact.astype(np.float32).astype(np.float64)  # a float32 port's lookup
    assert _rows_looked_up(table, rounded, 1e-6).tolist() == ids.tolist()
    assert _rows_looked_up(table, wrong_row, 1e-6).tolist() == [[3, 1, 499]]
    scaled = _rows_looked_up(table, exact * np.sqrt(8), 1e-6)
    assert scaled.tolist() == [[NO_ROW] * 3]
    assert "[0, 1]: ID 257 read as no row of the table" in _selections(ids, scaled)
    assert "[0, 1]: ID 257 read as row 1" in _selections(ids, np.array([[3, 1, 499]]))
