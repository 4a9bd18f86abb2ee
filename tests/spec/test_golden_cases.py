"""Golden cases: what they cover, their stored numbers against the oracle, the file format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conformance.golden import load_golden
from spec.golden import GOLDEN_CASES, GoldenCase, GoldenError, decode_record
from spec.oracle import oracle_forward, to_float64
from spec.oracle_gradients import oracle_gradients
from spec.tolerances import scaled_error

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
NAMES = [case.name for case in GOLDEN_CASES]


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=NAMES)
def test_golden_values_agree_with_the_oracle(case: GoldenCase) -> None:
    record = load_golden(case.name, GOLDEN)
    parameters = case.parameters()
    exact = oracle_forward(case.config, parameters, case.tokens, case.targets)
    for (name, stored), (_, truth) in zip(record.stages, exact.stages, strict=True):
        assert np.max(scaled_error(stored, to_float64(truth))) <= 1e-13, name
    assert np.max(scaled_error(record.logits, to_float64(exact.logits))) <= 1e-13
    assert scaled_error(record.loss, float(exact.mean_loss())) <= 1e-13
    gradients = oracle_gradients(case.config, parameters, case.tokens, case.targets).gradients
    for name, stored in record.gradients:
        assert np.max(scaled_error(stored, gradients[name])) <= 1e-13, name


def test_matrix_covers_what_the_issue_asks() -> None:
    configs = [case.config for case in GOLDEN_CASES]
    assert len(GOLDEN_CASES) >= 12
    assert {c.layers for c in configs} >= {0, 1, 2, 3}
    assert {c.heads for c in configs} >= {1, 2, 3, 4}
    assert {c.model_width // c.heads for c in configs} >= {2, 4, 6, 8}
    assert any(c.feed_forward_width < c.model_width for c in configs)
    assert any(c.feed_forward_width > c.model_width for c in configs)
    assert {len(case.tokens) for case in GOLDEN_CASES} >= {1, 2, 3}
    lengths = {(len(case.tokens[0]), case.config.context) for case in GOLDEN_CASES}
    assert any(t == 1 for t, _ in lengths) and any(t == ctx for t, ctx in lengths)
    assert any(t < ctx for t, ctx in lengths)
    assert {0, 2**64 - 1} <= {case.seed for case in GOLDEN_CASES}


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("[1, 2]", "not a JSON object"),
        ('"golden"', "not a JSON object"),
        ("null", "not a JSON object"),
        ('{"format": "decoder-conformance-golden", "format_version": 1, "case": []}', "malformed"),
        (
            '{"format": "decoder-conformance-golden", "format_version": 1, "expected": 7}',
            "malformed",
        ),
        ("{", "not JSON"),
    ],
)
def test_a_golden_file_that_is_no_object_is_a_golden_error(text: str, complaint: str) -> None:
    with pytest.raises(GoldenError, match=complaint):
        decode_record(text, "broken.json")
