"""Golden regeneration and checking: current files, edits named, reference only, atomic."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from pytest_regressions.common import perform_regression_check

import conformance.tools.golden as golden_module
from conformance.adapters.reference import ReferenceBackend
from conformance.files import write_atomically
from conformance.golden import load_golden
from conformance.tools.golden import (
    GoldenDirectoryError,
    check_golden,
    compute_record,
    regenerate,
)
from spec.golden import GOLDEN_CASES, GoldenCase, GoldenError, decode_record, encode_record

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


def _copy(tmp_path: Path, name: str = "golden") -> Path:
    copy = tmp_path / name
    shutil.copytree(GOLDEN, copy)
    return copy


def _case_bytes(directory: Path) -> dict[str, bytes]:
    """Every case file under ``directory``, by name."""
    return {path.name: path.read_bytes() for path in (directory / "cases").glob("*.json")}


def _regenerated_here(tmp_path: Path) -> dict[str, bytes]:
    """The case files a plain regeneration writes on this machine. Not the committed bytes:
    OpenBLAS picks its float64 kernel by CPU (Haswell on AMD EPYC, SkylakeX with AVX-512),
    and the kernels sum products in different orders, so regenerated values can differ from
    the committed ones in the last bit; ``golden check`` judges those at its tolerance."""
    copy = _copy(tmp_path, "golden-regenerated-here")
    regenerate(ReferenceBackend(), copy)
    return _case_bytes(copy)


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
    before = _case_bytes(copy)

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
    after = _case_bytes(copy)
    assert after == before
    assert [p.name for p in copy.iterdir() if p.name.startswith(".cases-")] == []
    monkeypatch.setattr(golden_module, "encode_record", original)
    regenerate(ReferenceBackend(), copy)
    assert _case_bytes(copy) == _regenerated_here(tmp_path)


# Files a check must report as hand-edited, never crash on: nesting deeper than the stack,
# an integer longer than int() converts, nothing at all.
HOSTILE_TEXTS = {
    "deep-nesting": "[" * 100000,
    "5000-digit-number": "1" * 5000,
    "empty": "",
    "5000-digit-seed": '{"case": {"seed": ' + "7" * 5000 + "}}",
}


@pytest.mark.parametrize("text", HOSTILE_TEXTS.values(), ids=HOSTILE_TEXTS.keys())
def test_a_hostile_file_is_reported_as_hand_edited(text: str, tmp_path: Path) -> None:
    with pytest.raises(GoldenError) as raised:
        decode_record(text, "hostile.json")
    assert raised.value.source == "hostile.json"
    copy = _copy(tmp_path)
    target = copy / "cases" / "epsilon-zero.json"
    target.write_text(text)
    problems, _ = check_golden(copy)
    assert [(p.path, p.kind) for p in problems] == [(str(target), "hand-edited")]


def test_check_notes_leftovers_and_regen_removes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = _copy(tmp_path)
    # What interrupted runs leave: a staging set, an old set, and the previous tool's staging.
    names = [".cases-new-ab12", ".cases-old-cd34", ".cases-regen-4242"]
    for name in names:
        (copy / name).mkdir()
        shutil.copy(copy / "cases" / "seed-fixture.json", copy / name)
    problems, notes = check_golden(copy)
    assert problems == []
    for name in names:
        assert any(
            note.startswith(f"leftover temporary directory {copy / name} ")
            and note.endswith("delete it or run golden regen")
            for note in notes
        ), notes
    # The staging directory is made before leftovers are swept: the sweep must spare it.
    staging = copy / ".cases-new-this-run"

    def predictable_staging(prefix: str, dir: Path) -> str:
        assert prefix == ".cases-new-" and Path(dir) == copy
        staging.mkdir()
        return str(staging)

    monkeypatch.setattr(tempfile, "mkdtemp", predictable_staging)
    regenerate(ReferenceBackend(), copy)
    assert sorted(p.name for p in copy.iterdir()) == ["cases", "seed"]
    assert check_golden(copy) == ([], [])


def test_golden_check_on_the_shipped_directory_notes_nothing() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "golden", "check", "--no-recompute"],
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "note:" not in result.stdout


def test_an_unwritable_directory_fails_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(*_: Any) -> Any:
        raise AssertionError("a case was computed before the directory was checked")

    monkeypatch.setattr(golden_module, "compute_record", no_work)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for directory in (blocker / "golden", blocker):
        with pytest.raises(GoldenDirectoryError, match=re.escape(str(directory))) as raised:
            regenerate(ReferenceBackend(), directory)
        assert isinstance(raised.value, PermissionError)
        assert isinstance(raised.value.__cause__, OSError)
    assert blocker.read_text() == "not a directory"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_golden_regen_into_proc_is_one_line_and_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "golden", "regen", "--directory", "/proc/x"],
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "/proc/x" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def _two_directories(tmp_path: Path) -> tuple[Path, Path]:
    first, second = tmp_path / "first", tmp_path / "second"
    for directory in (first, second):
        directory.mkdir()
        (directory / "marker").write_text(directory.name)
    return first, second


@pytest.mark.skipif(sys.platform != "linux", reason="renameat2 is Linux's")
def test_renameat2_exchanges_through_libc_and_the_system_call(tmp_path: Path) -> None:
    first, second = _two_directories(tmp_path)
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "renameat2"):
        assert golden_module._renameat2_from_libc(libc, bytes(first), bytes(second)) == 0
        assert (first / "marker").read_text() == "second"
    if platform.machine() in golden_module._RENAMEAT2_SYSCALL:
        status = golden_module._renameat2_by_syscall(libc, bytes(first), bytes(second))
        assert status == 0, os.strerror(status or 0)
        assert (first / "marker").read_text() == "first"
    assert golden_module._exchange(first, second)
    assert (first / "marker").read_text() == "second"
    with pytest.raises(FileNotFoundError):
        golden_module._exchange(tmp_path / "absent", second)


def test_regen_without_the_exchange_uses_two_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    expected = _regenerated_here(tmp_path)
    copy = _copy(tmp_path)
    monkeypatch.setattr(golden_module, "_exchange", lambda *_: False)
    with caplog.at_level(logging.WARNING):
        regenerate(ReferenceBackend(), copy)
    assert caplog.records == []
    assert sorted(p.name for p in copy.iterdir()) == ["cases", "seed"]
    assert _case_bytes(copy) == expected


def test_regen_into_a_new_directory(tmp_path: Path) -> None:
    target = tmp_path / "fresh" / "golden"
    assert regenerate(ReferenceBackend(), target) == NAMES
    assert sorted(p.name for p in target.iterdir()) == ["cases"]
    assert check_golden(target) == ([], [])
