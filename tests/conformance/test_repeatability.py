"""Repeatable verdicts, and nothing lost when a command is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conformance.runner import run_suite

ROOT = Path(__file__).resolve().parents[2]


def _run(*arguments: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "conformance.cli", *arguments]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False
    )


@pytest.mark.slow
def test_ci_profile_gives_identical_verdicts_in_one_process_and_on_two() -> None:
    """Two runs, the second split over two pytest-xdist workers (each test after others). (The
    CI's random-order and main-job runs repeat the profile twice more.)"""
    verdicts = []
    for workers in (0, 2):
        report = run_suite(profile="ci", workers=workers)
        assert report.status == 0, report.output[-2000:]
        verdicts.append({rule.id: (rule.status, rule.tests, rule.message) for rule in report.rules})
    assert all(v == verdicts[0] for v in verdicts[1:])


def test_a_refused_run_leaves_an_existing_report_untouched(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    report.write_text("previous report\n")
    result = _run("run", "--adapter", "no-such-adapter", "--json", str(report))
    assert (
        result.returncode != 0
        and "no adapter named 'no-such-adapter'" in result.stdout + result.stderr
    )
    assert report.read_text() == "previous report\n"
    result = _run("run", "--json", str(tmp_path / "missing-folder" / "report.json"))
    assert result.returncode == 2 and "no folder" in result.stderr


def test_a_refused_regeneration_leaves_the_goldens_untouched(tmp_path: Path) -> None:
    before = {p.name: p.read_bytes() for p in (ROOT / "golden" / "cases").glob("*.json")}
    result = _run("golden", "regen", "--adapter", "conformance.tools.mutants.numerics:RopeOnValues")
    assert result.returncode == 2 and "only the reference backend may regenerate" in result.stderr
    assert {p.name: p.read_bytes() for p in (ROOT / "golden" / "cases").glob("*.json")} == before
