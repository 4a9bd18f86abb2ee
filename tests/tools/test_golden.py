"""Golden regeneration and checking: current files, edits named, reference only, atomic."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pytest_regressions.common import perform_regression_check

import conformance.tools.golden as golden_module
from conformance.adapters.reference import ReferenceBackend
from conformance.files import write_atomically
from conformance.golden import load_golden
from conformance.tools.golden import check_golden, compute_record, regenerate
from spec.golden import GOLDEN_CASES, GoldenCase, decode_record, encode_record

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "golden"
NAMES = [case.name for case in GOLDEN_CASES]


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
        where, drift = golden_module.first_difference(stored, got)
        assert drift <= golden_module.STALE_THRESHOLD, (
            f"{expected.name}: {where} moved by {drift:.2e}"
        )

    perform_regression_check(
        datadir=lazy_datadir,
        original_datadir=original_datadir,
        request=request,
        check_fn=check,
        dump_fn=lambda path: write_atomically(path, fresh),
        extension=".json",
        fullpath=GOLDEN / "cases" / f"{case.name}.json",
    )


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
