"""Rule-by-rule results: the tally's worst-outcome rule, the renderers, the report read back."""

from __future__ import annotations

import json

import pytest

from conformance.report import (
    Report,
    ReportError,
    RuleTally,
    SuiteIdentity,
    render_json,
    render_markdown,
    render_table,
)
from spec.rules import RULES

IDENTITY = SuiteIdentity(
    "my|backend", "1.0", "float64", ["stages"], "0.1.0", "ci", 15, None, {"python": "3.11"}
)


def test_a_rule_takes_its_worst_outcome_and_first_message() -> None:
    tally = RuleTally()
    tally.record("SHAPE-LOGITS", "passed", 0.5, "")
    tally.record("SHAPE-LOGITS", "failed", 0.25, "first failure")
    tally.record("SHAPE-LOGITS", "failed", 0.25, "second failure")
    tally.record("SHAPE-LOGITS", "passed", 0.0, "")
    result = tally.results["SHAPE-LOGITS"]
    assert (result.status, result.tests, result.duration, result.message) == (
        "failed",
        4,
        1.0,
        "first failure",
    )


def test_the_first_test_in_collection_order_gives_the_message_whatever_finishes_first() -> None:
    """Under pytest-xdist a later test can finish first; the message must not change."""
    tally = RuleTally()
    tally.order_tests(["t.py::hypothesis_drawn", "t.py::long_context", "t.py::third"])
    tally.record("CAUSAL-PREFIX-BITWISE", "failed", 0.0, "long context", "t.py::long_context")
    tally.record("CAUSAL-PREFIX-BITWISE", "passed", 0.0, "", "t.py::third")
    tally.record("CAUSAL-PREFIX-BITWISE", "failed", 0.0, "drawn", "t.py::hypothesis_drawn")
    result = tally.results["CAUSAL-PREFIX-BITWISE"]
    assert result.message == "drawn"
    assert result.first_failed_test() == "t.py::hypothesis_drawn"
    assert [r.test for r in result.results] == [
        "t.py::hypothesis_drawn",
        "t.py::long_context",
        "t.py::third",
    ]
    # Equally close approaches to a bound: the earlier test's is kept, whichever came first.
    closest = {"fraction": 0.5, "check": "logits"}
    tally.note_closest("CAUSAL-PREFIX-BITWISE", closest, "t.py::third")
    tally.note_closest("CAUSAL-PREFIX-BITWISE", closest, "t.py::long_context")
    tally.note_closest("CAUSAL-PREFIX-BITWISE", closest, "t.py::third")
    assert result.closest is not None and result.closest["test"] == "t.py::long_context"
    # The contract check is no collected test: it stays first.
    tally.record("CAUSAL-PREFIX-BITWISE", "failed", 0.0, "contract", "contract")
    assert result.message == "contract" and result.results[0].test == "contract"


@pytest.mark.parametrize(
    ("outcomes", "status"),
    [
        (["skipped", "skipped"], "skipped"),
        (["skipped", "passed"], "passed"),
        (["xfailed", "passed"], "xfailed"),
        (["xfailed", "xpassed"], "xfailed"),
        (["xpassed", "xpassed"], "xpassed"),
        (["xpassed", "failed"], "failed"),
        ([], "untested"),
    ],
)
def test_the_severity_order(outcomes: list[str], status: str) -> None:
    tally = RuleTally()
    for outcome in outcomes:
        tally.record("PARAM-COUNT", outcome, 0.0, outcome)
    assert tally.results["PARAM-COUNT"].status == status


def test_the_summary_counts_every_rule_once() -> None:
    tally = RuleTally()
    tally.record("SHAPE-LOGITS", "failed", 0.0, "x")
    tally.record("PARAM-COUNT", "skipped", 0.0, "needs capability 'stages'")
    summary = tally.summary()
    assert summary["failed"] == 1 and summary["skipped"] == 1
    assert summary["untested"] == len(RULES) - 2
    assert sum(summary.values()) == len(RULES)


def _tally() -> RuleTally:
    tally = RuleTally()
    for rule in RULES:
        tally.record(rule.id, "passed", 0.01, "")
    tally.record("SHAPE-LOGITS", "failed", 0.5, "[SHAPE-LOGITS] shape | bad\nreproduce with: ...")
    return tally


def test_the_table_has_a_line_per_rule_with_the_first_line_of_a_failure() -> None:
    text = render_table(_tally(), IDENTITY)
    lines = text.splitlines()
    assert lines[0].startswith("decoder-conformance 0.1.0: backend my|backend 1.0 (float64)")
    assert len(lines) == 2 + len(RULES) + 1
    (failed,) = [line for line in lines if line.startswith("SHAPE-LOGITS ")]
    assert "failed" in failed and failed.endswith("[SHAPE-LOGITS] shape | bad")
    assert lines[-1] == f"{len(RULES) - 1} passed, 1 failed"


def test_markdown_escapes_table_cells_and_lists_each_failure() -> None:
    text = render_markdown(_tally(), IDENTITY)
    assert "| `SHAPE-LOGITS` | shapes | failed | 0.51 | [SHAPE-LOGITS] shape \\| bad |" in text
    assert text.startswith("# Conformance report: my\\|backend 1.0\n")
    failures = text[text.index("## Failures") :]
    assert "### `SHAPE-LOGITS` (failed)" in failures
    assert "```text\n[SHAPE-LOGITS] shape | bad\nreproduce with: ...\n```" in failures


def test_a_listed_rule_that_partly_passes_stays_xfailed_and_says_so() -> None:
    tally = RuleTally()
    for _ in range(13):
        tally.record("VALUE-STAGES", "xfailed", 0.0, "[VALUE-STAGES] off", "t")
    tally.record("VALUE-STAGES", "xpassed", 0.0, "", "u")
    result = tally.results["VALUE-STAGES"]
    assert result.status == "xfailed"
    assert result.message == "1 of 14 passed; [VALUE-STAGES] off"
    assert "xfailed, 1 of 14 passed" in render_table(tally, IDENTITY)


def test_the_detail_is_the_rule_s_own_first_line_cut_with_an_ellipsis() -> None:
    tally = RuleTally()
    tally.record("SHAPE-LOGITS", "failed", 0.0, "[SHAPE-LOGITS] " + "x" * 300, "t")
    (line,) = [row for row in render_table(tally, IDENTITY).splitlines() if "SHAPE-LOGITS" in row]
    assert line.endswith("\u2026") and len(line) < 200


def test_json_reads_back_into_the_same_report() -> None:
    tally = _tally()
    text = render_json(tally, IDENTITY)
    document = json.loads(text)
    assert document["schema"] == "decoder-conformance-report" and document["schema_version"] == 2
    report = Report.from_json(text, status=1, output="printed")
    assert report.identity == IDENTITY
    assert [r.id for r in report.rules] == [rule.id for rule in RULES]
    assert report.summary == tally.summary()
    assert [r.id for r in report.failed()] == ["SHAPE-LOGITS"]
    assert report.rule("SHAPE-LOGITS").message.startswith("[SHAPE-LOGITS] shape | bad")
    with pytest.raises(KeyError, match="no rule 'NO-SUCH'"):
        report.rule("NO-SUCH")


@pytest.mark.parametrize(
    "text",
    ["[]", "{}", '{"schema": "decoder-conformance-report"}', "not json", '{"schema": 1}'],
)
def test_a_report_that_breaks_the_schema_is_refused(text: str) -> None:
    with pytest.raises(ReportError):
        Report.from_json(text, status=0)


def test_a_passing_rule_shows_and_keeps_its_closest_approach_to_its_bound() -> None:
    tally = RuleTally()
    tally.record("VALUE-LOGITS", "passed", 0.1, "", "test_a")
    tally.note_closest("VALUE-LOGITS", {"fraction": 0.12, "check": "logits: a"}, "test_a")
    tally.note_closest("VALUE-LOGITS", {"fraction": 0.47, "check": "logits: b"}, "test_b")
    tally.note_closest("VALUE-LOGITS", {"fraction": 0.3, "check": "logits: c"}, "test_c")
    closest = tally.results["VALUE-LOGITS"].closest
    assert closest == {"fraction": 0.47, "check": "logits: b", "test": "test_b"}
    line = next(x for x in render_table(tally, IDENTITY).splitlines() if "VALUE-LOGITS" in x)
    assert "closest to its bound: 47% (logits: b)" in line
    assert "closest to its bound: 47%" in render_markdown(tally, IDENTITY)
    back = Report.from_json(render_json(tally, IDENTITY), status=0)
    assert back.rule("VALUE-LOGITS").closest == closest
    assert back.rule("VALUE-STAGES").closest is None


def test_a_failed_rule_shows_its_failure_not_its_margin() -> None:
    tally = RuleTally()
    tally.record("VALUE-LOGITS", "failed", 0.1, "[VALUE-LOGITS] logits=1, but should be 2")
    tally.note_closest("VALUE-LOGITS", {"fraction": 0.5, "check": "logits"}, "test_a")
    line = next(x for x in render_table(tally, IDENTITY).splitlines() if "VALUE-LOGITS" in x)
    assert "closest" not in line and "should be 2" in line
