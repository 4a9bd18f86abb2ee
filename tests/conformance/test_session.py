"""The session's bookkeeping: which phase decides a test's outcome, and the xfails file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conformance.session import ListedTests, outcome


def report(when: str, result: str, **extra: Any) -> pytest.TestReport:
    made = pytest.TestReport("conformance/test_x.py::test_y", ("x", 1, "y"), {}, result, None, when)
    for name, value in extra.items():
        setattr(made, name, value)
    return made


@pytest.mark.parametrize(
    ("when", "result", "extra", "expected"),
    [
        ("setup", "passed", {}, None),
        ("setup", "skipped", {}, "skipped"),
        ("setup", "failed", {}, "failed"),
        ("call", "passed", {}, "passed"),
        ("call", "failed", {}, "failed"),
        ("call", "skipped", {}, "skipped"),
        ("teardown", "passed", {}, None),
        ("teardown", "failed", {}, "failed"),
        ("call", "skipped", {"wasxfail": "listed"}, "xfailed"),
        ("call", "passed", {"wasxfail": "listed"}, "xpassed"),
        ("setup", "skipped", {"wasxfail": "listed"}, "xfailed"),
        ("setup", "passed", {"wasxfail": "listed"}, None),
    ],
)
def test_the_phase_that_decides_an_outcome(
    when: str, result: str, extra: dict[str, Any], expected: str | None
) -> None:
    assert outcome(report(when, result, **extra)) == expected


def test_an_xfails_file_matches_rule_ids_and_test_prefixes(tmp_path: Path) -> None:
    path = tmp_path / "xfails.txt"
    path.write_text("# known\nSHAPE-LOGITS  # by rule\n\ntest_values.py::test_logits\nstale::x\n")
    listed = ListedTests.read(path)
    assert listed.entries == [
        (2, "SHAPE-LOGITS"),
        (4, "test_values.py::test_logits"),
        (5, "stale::x"),
    ]


def test_an_unreadable_xfails_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(pytest.UsageError, match="--xfails-file"):
        ListedTests.read(tmp_path / "missing.txt")
