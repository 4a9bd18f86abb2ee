"""Golden files: current, in agreement with the oracle, tamper-evident, and written atomically."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pytest_regressions.common import perform_regression_check

import conformance.golden as golden_module
from conformance.adapters.reference import ReferenceBackend
from conformance.golden import (
    check_golden,
    compute_record,
    golden_directory,
    load_golden,
    regenerate,
)
from spec.golden import GOLDEN_CASES, GoldenCase, decode_record, encode_record
from spec.oracle import oracle_forward, to_float64
from spec.oracle_gradients import oracle_gradients
from spec.recipe import initial_parameters
from spec.tolerances import scaled_error

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden"
NAMES = [case.name for case in GOLDEN_CASES]


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=NAMES)
def test_golden_file_is_current(
    case: GoldenCase, lazy_datadir: Any, original_datadir: Path, request: pytest.FixtureRequest
) -> None:
    """pytest-regressions: ``pytest --force-regen`` rewrites a golden file that moved."""
    fresh = encode_record(compute_record(ReferenceBackend(), case))

    def check(obtained: Path, expected: Path) -> None:
        got = decode_record(obtained.read_text(), str(obtained))
        stored = decode_record(expected.read_text(), str(expected))
        assert got.case == stored.case, f"{expected.name}: case inputs changed"
        where, drift = golden_module._first_difference(stored, got)
        assert drift <= golden_module.STALE_THRESHOLD, (
            f"{expected.name}: {where} moved by {drift:.2e}"
        )

    perform_regression_check(
        datadir=lazy_datadir,
        original_datadir=original_datadir,
        request=request,
        check_fn=check,
        dump_fn=lambda path: _write_atomically(path, fresh),
        extension=".json",
        fullpath=GOLDEN / "cases" / f"{case.name}.json",
    )


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=NAMES)
def test_golden_values_agree_with_the_oracle(case: GoldenCase) -> None:
    record = load_golden(case.name, GOLDEN)
    parameters = initial_parameters(case.config, case.seed)
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


def test_golden_check_and_provenance() -> None:
    problems, _ = check_golden(GOLDEN, recompute=ReferenceBackend())
    assert problems == []
    record = load_golden("seed-fixture", GOLDEN)
    assert record.provenance["backend"].startswith("reference ")
    assert set(record.provenance) == {"generator", "backend", "numpy", "python"}


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "golden"
    shutil.copytree(GOLDEN, copy)
    return copy


def _edit_one_digit(path: Path) -> tuple[str, str]:
    """Change the last digit of the first logit; return the old and new text."""
    text = path.read_text()
    values = text.index('"values"', text.index('"logits"'))
    match = re.compile(r"-?\d+\.\d+(?:e-?\d+)?").search(text, values)
    assert match is not None
    old = match.group(0)
    new = old[:-1] + ("1" if old[-1] != "1" else "2")
    path.write_text(text[: match.start()] + new + text[match.end() :])
    return old, new


def test_one_changed_digit_is_named_by_golden_check(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    target = copy / "cases" / "epsilon-zero.json"
    _, new = _edit_one_digit(target)
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "golden", "check", "--directory", str(copy)],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert "hand-edited" in result.stderr and "epsilon-zero.json" in result.stderr
    assert (
        "case epsilon-zero" in result.stderr
        and f"logits[0, 0, 0] reads {new}, but its exact value is" in result.stderr
    )


def test_one_changed_digit_fails_the_conformance_tests(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    _edit_one_digit(copy / "cases" / "epsilon-zero.json")
    report = tmp_path / "report.json"
    environment = {**os.environ, golden_module.ENVIRONMENT_VARIABLE: str(copy)}
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "run", "--profile", "ci", "--json", str(report),
         "--pytest-args", "-k golden"],
        capture_output=True, text=True, cwd=ROOT, env=environment, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    rule = next(r for r in json.loads(report.read_text())["rules"] if r["id"] == "GOLDEN-VALUES")
    assert rule["status"] == "failed"
    assert "epsilon-zero.json: case epsilon-zero: logits[0, 0, 0] reads" in rule["message"]


def test_broken_reference_names_the_first_deviating_stage(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "run", "--profile", "ci", "--json", str(report),
         "--adapter", "conformance.mutants.numerics:RopeOnValues", "--pytest-args", "-k golden"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    rule = next(r for r in json.loads(report.read_text())["rules"] if r["id"] == "GOLDEN-VALUES")
    assert rule["status"] == "failed"
    assert ": stage block-0[" in rule["message"] and "scaled error" in rule["message"]


def test_regeneration_is_reference_only_and_atomic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = _copy(tmp_path)
    before = {path.name: path.read_bytes() for path in (copy / "cases").glob("*.json")}

    class Impostor(ReferenceBackend):
        name = "impostor"

    with pytest.raises(PermissionError, match="only the reference backend may regenerate"):
        regenerate(Impostor(), copy)
    calls = {"count": 0}
    original = golden_module.encode_record

    def interrupted(record: Any) -> str:
        calls["count"] += 1
        if calls["count"] == 5:
            raise KeyboardInterrupt("interrupted mid-regeneration")
        return original(record)

    monkeypatch.setattr(golden_module, "encode_record", interrupted)
    with pytest.raises(KeyboardInterrupt):
        regenerate(ReferenceBackend(), copy)
    after = {path.name: path.read_bytes() for path in (copy / "cases").glob("*.json")}
    assert after == before
    assert [p.name for p in copy.iterdir() if p.name.startswith(".cases-regen")] == []
    monkeypatch.setattr(golden_module, "encode_record", original)
    regenerate(ReferenceBackend(), copy)
    assert {path.name: path.read_bytes() for path in (copy / "cases").glob("*.json")} == before


def test_the_suite_finds_the_shipped_golden_directory() -> None:
    assert golden_directory() == GOLDEN.resolve() or os.environ.get(
        golden_module.ENVIRONMENT_VARIABLE
    )
