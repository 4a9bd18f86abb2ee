"""The compliance matrix: its table, the README section it replaces, and the check."""

from __future__ import annotations

import io
import time

import pytest

from conformance.report import Report, RuleResult, SuiteIdentity
from conformance.runner import THREAD_VARIABLES
from conformance.tools.matrix import (
    END_MARKER,
    START_MARKER,
    Column,
    MatrixError,
    check_statuses,
    read_statuses,
    render_html,
    render_markdown,
    replace_section,
    run_matrix,
)
from spec.rules import RULES


def _column(backend: str, statuses: dict[str, str], reasons: dict[str, str]) -> Column:
    identity = SuiteIdentity(backend, "1.0", "float32", ["stages"], "0.1.0", "ci")
    rules = [
        RuleResult(rule.id, str(rule.category), rule.statement, statuses.get(rule.id, "passed"))
        for rule in RULES
    ]
    for result in rules:
        if result.status != "passed":
            result.message = f"[{result.id}] went wrong\nsecond line"
    return Column(backend, Report(status=0, identity=identity, rules=rules), 1.5, reasons)


COLUMNS = [
    _column("good", {}, {}),
    _column(
        "engine",
        {"ERR-CONTEXT-LIMIT": "xfailed", "GRAD-ORACLE": "skipped"},
        {"ERR-CONTEXT-LIMIT": "tokens past the context are accepted"},
    ),
]


def test_the_table_has_a_row_per_rule_and_a_column_per_backend() -> None:
    text = render_markdown(COLUMNS, "ci")
    assert "| rule | good | engine |" in text
    assert "| ERR-CONTEXT-LIMIT | pass | known |" in text
    assert "| GRAD-ORACLE | pass | skip |" in text
    # Each non-passing cell that is no skip gets its reason and its message's first line.
    assert (
        "- engine / ERR-CONTEXT-LIMIT (xfailed): known: tokens past the context are accepted. "
        "[ERR-CONTEXT-LIMIT] went wrong" in text
    )
    assert "second line" not in text


def test_the_recorded_statuses_are_read_back_and_checked() -> None:
    readme = f"intro\n{START_MARKER}\nold\n{END_MARKER}\nrest\n"
    updated = replace_section(readme, render_markdown(COLUMNS, "ci"))
    assert updated.startswith("intro\n") and updated.endswith(f"{END_MARKER}\nrest\n")
    assert read_statuses(updated)[("engine", "ERR-CONTEXT-LIMIT")] == "known"
    assert check_statuses(COLUMNS, updated) == []
    changed = [COLUMNS[0], _column("engine", {"ERR-CONTEXT-LIMIT": "failed"}, {})]
    assert check_statuses(changed, updated) == [
        "engine / ERR-CONTEXT-LIMIT: recorded known, now **FAIL**",
        "engine / GRAD-ORACLE: recorded skip, now pass",
    ]


def test_a_file_without_the_markers_is_refused() -> None:
    with pytest.raises(MatrixError, match="matrix:start"):
        replace_section("no markers here", "table", where="README.md")
    with pytest.raises(MatrixError, match="no matrix table"):
        read_statuses("nothing")


def test_the_html_page_escapes_every_message() -> None:
    page = render_html([_column("<b>", {"VALUE-LOGITS": "failed"}, {})], "ci")
    assert "<b>" not in page.replace("<body>", "")
    assert "&lt;b&gt;" in page and "background:#ef9a9a" in page


# Each fake suite's (start, end), as perf_counter read them.
SPANS: dict[str, tuple[float, float]] = {}


def _fake_suites(
    monkeypatch: pytest.MonkeyPatch, delays: dict[str, float]
) -> list[tuple[str, object]]:
    """``run_suite`` replaced: each adapter's report after its delay; calls recorded."""
    import conformance.runner

    calls: list[tuple[str, object]] = []
    SPANS.clear()

    def fake_run_suite(adapter: str, **options: object) -> Report:
        calls.append((adapter, options.get("environment")))
        if delays[adapter] < 0:
            raise RuntimeError(f"{adapter} broke")
        started = time.perf_counter()
        time.sleep(delays[adapter])
        SPANS[adapter] = (started, time.perf_counter())
        return _column(adapter, {}, {}).report

    monkeypatch.setattr(conformance.runner, "run_suite", fake_run_suite)
    return calls


def test_side_by_side_runs_overlap_and_keep_the_order_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    delays = {"slow": 0.6, "quick": 0.3, "third": 0.2}
    calls = _fake_suites(monkeypatch, delays)
    stream = io.StringIO()
    columns = run_matrix([(name, None) for name in delays], stream=stream, jobs=2)
    assert [column.adapter for column in columns] == ["slow", "quick", "third"]
    # Quick and third started while slow ran (read off their spans, not off the wall time,
    # which a loaded machine stretches: one after another they would start after it ended).
    slow_ended = SPANS["slow"][1]
    assert SPANS["quick"][0] < slow_ended and SPANS["third"][0] < slow_ended
    # Suites side by side compute on one thread each.
    assert all(environment == dict.fromkeys(THREAD_VARIABLES, "1") for _, environment in calls)
    # The last summary to arrive is slow's: side by side, each summary names its adapter.
    assert stream.getvalue().splitlines()[-1].startswith("   slow: ")


def test_one_at_a_time_leaves_the_thread_counts_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_suites(monkeypatch, {"only": 0.0})
    run_matrix([("only", None)], jobs=1)
    assert calls == [("only", None)]


def test_a_run_that_breaks_is_raised_to_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_suites(monkeypatch, {"fine": 0.0, "broken": -1.0})
    with pytest.raises(RuntimeError, match="broken broke"):
        run_matrix([("fine", None), ("broken", None)], jobs=2)
    with pytest.raises(ValueError, match="jobs must be at least 1"):
        run_matrix([("fine", None)], jobs=0)
