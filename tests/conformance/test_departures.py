"""Declared departures and shipped known failures: what they excuse, and what they do not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.known_failures import FOLDER, known_failures_file, shipped
from conformance.runner import run_suite
from conformance.session import ListedTests
from spec.rules import RULES

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BACKEND = HERE / "departing_backend.py"
RULES_RUN = ["CONFIG-VALID-BUILDS", "DEPTH-ZERO-FORMULA", "SHAPE-LOGITS", "ERR-RMS-ZERO"]


def _statuses(adapter: str, tmp_path: Path) -> tuple[dict[str, str], dict[str, object]]:
    report_path = tmp_path / f"{adapter}.json"
    report = run_suite(
        f"{BACKEND}:{adapter}", profile="ci", rules=RULES_RUN, json_report=report_path
    )
    document = json.loads(report_path.read_text(encoding="utf-8"))
    return {rule.id: rule.status for rule in report.rules if rule.id in RULES_RUN}, document


def test_an_undeclared_departure_fails_every_rule_that_draws_it(tmp_path: Path) -> None:
    statuses, _ = _statuses("CannotBuildDepthZero", tmp_path)
    assert statuses["SHAPE-LOGITS"] == "failed"  # it draws depth 0 too
    assert statuses["ERR-RMS-ZERO"] == "failed"


def test_a_declared_departure_fails_only_the_rules_about_it(tmp_path: Path) -> None:
    statuses, document = _statuses("DeclaresNoDepthZero", tmp_path)
    assert statuses == {
        "CONFIG-VALID-BUILDS": "failed",
        "DEPTH-ZERO-FORMULA": "failed",
        "SHAPE-LOGITS": "passed",
        "ERR-RMS-ZERO": "passed",
    }
    assert document["departures"] == ["no-depth-zero"]
    messages = {rule["id"]: rule["message"] for rule in document["rules"]}  # type: ignore[attr-defined]
    assert "cannot build a model with no blocks" in messages["DEPTH-ZERO-FORMULA"]


def test_an_xfails_comment_is_the_reason_of_its_line(tmp_path: Path) -> None:
    path = tmp_path / "known.txt"
    path.write_text("# heading\nERR-CONTEXT-LIMIT  # the engine does not check the context\n")
    listed = ListedTests.read(path)
    assert listed.entries == [(2, "ERR-CONTEXT-LIMIT")]
    assert listed.reasons == {2: "the engine does not check the context"}


@pytest.mark.parametrize("adapter", shipped())
def test_every_shipped_known_failure_names_a_rule_or_test_and_gives_a_reason(
    adapter: str,
) -> None:
    rule_ids = {rule.id for rule in RULES}
    tests = "\n".join(path.read_text("utf-8") for path in (ROOT / "conformance").glob("test_*.py"))
    listed = ListedTests.read(known_failures_file(adapter))
    assert listed.entries
    for number, entry in listed.entries:
        assert number in listed.reasons, f"{adapter}.txt line {number} gives no reason"
        if "::" in entry:
            assert f"def {entry.split('::')[1].split('[')[0]}(" in tests, entry
        else:
            assert entry in rule_ids, f"{adapter}.txt line {number}: no rule {entry}"


def test_known_failures_for_an_adapter_that_ships_none_is_a_usage_error() -> None:
    assert sorted(path.stem for path in FOLDER.glob("*.txt")) == shipped()
    with pytest.raises(LookupError, match="ships no known failures"):
        known_failures_file("reference")
    for extra in ([], ["--xfails-file", __file__]):
        done = subprocess.run(
            [sys.executable, "-m", "conformance.cli", "run", "--known-failures", *extra],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert "--known-failures" in done.stderr


def test_the_adapters_parameter_bound_is_the_references() -> None:
    from conformance.adapter import MAX_PARAMETER_SCALARS
    from impl.model import MAX_PARAMETER_SCALARS as REFERENCE_BOUND

    assert MAX_PARAMETER_SCALARS == REFERENCE_BOUND
