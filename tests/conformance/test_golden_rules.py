"""GOLDEN-VALUES against a backend: an edited file and a broken backend are both named."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from conformance.golden import ENVIRONMENT_VARIABLE, golden_directory
from conformance.runner import run_suite
from spec.golden import GOLDEN_CASES

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


def test_one_changed_digit_fails_the_golden_rule(tmp_path: Path) -> None:
    copy = tmp_path / "golden"
    shutil.copytree(GOLDEN, copy)
    target = copy / "cases" / "epsilon-zero.json"
    text = target.read_text()
    start = text.index('"values"', text.index('"logits"'))
    number = re.compile(r"-?\d+\.\d+(?:e-?\d+)?").search(text, start)
    assert number is not None
    digit = "1" if number.group(0)[-1] != "1" else "2"
    target.write_text(text[: number.end() - 1] + digit + text[number.end() :])
    report = run_suite(
        profile="ci", pytest_args=["-k", "golden"], environment={ENVIRONMENT_VARIABLE: str(copy)}
    )
    assert report.status == 1, report.output[-2000:]
    rule = report.rule("GOLDEN-VALUES")
    assert rule.status == "failed"
    assert "epsilon-zero.json: case epsilon-zero: logits[0, 0, 0] reads" in rule.message


def test_a_broken_backend_is_named_at_its_first_deviating_stage() -> None:
    report = run_suite(
        "conformance.tools.mutants.numerics:RopeOnValues",
        profile="ci",
        pytest_args=["-k", "golden"],
    )
    assert report.status == 1, report.output[-2000:]
    rule = report.rule("GOLDEN-VALUES")
    assert rule.status == "failed"
    assert ": stage block-0[" in rule.message and "scaled error" in rule.message


def test_the_suite_reads_the_shipped_golden_directory_or_the_configured_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    shipped = golden_directory()
    assert shipped == GOLDEN.resolve()
    assert {path.stem for path in (shipped / "cases").glob("*.json")} == {
        case.name for case in GOLDEN_CASES
    }
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, str(tmp_path))
    assert golden_directory() == tmp_path
