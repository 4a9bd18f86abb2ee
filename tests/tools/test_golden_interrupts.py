"""A golden regeneration killed at any instant leaves the whole old case set or the whole new one.

The kill test runs ``golden regen`` as a subprocess and SIGKILLs it at reproducible random
instants; the fallback tests put a directory in the state a portable (two-rename) swap leaves
when killed between its renames, and check that ``check`` and ``regen`` both recover from it.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import conformance.tools.golden as golden_module
from conformance.adapters.reference import ReferenceBackend
from conformance.golden import golden_directory
from conformance.tools.golden import check_golden, regenerate
from spec.golden import GOLDEN_CASES, decode_record, encode_record

ROOT = Path(__file__).resolve().parents[2]
DEFINED = sorted(f"{case.name}.json" for case in GOLDEN_CASES)
# check_golden requires provenance["backend"] to name the reference; "generator" is free to
# differ, so it marks the old set while keeping every file intact and current.
OLD_GENERATOR = "decoder-conformance golden regen (old set, test_golden_interrupts)"
TRIALS = 20
SEED = 20240917
# Generous bounds for a loaded two-core machine: a regen or a check takes well under a second.
SUBPROCESS_TIMEOUT = 120.0


def _golden(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conformance.cli", "golden", *arguments],
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=SUBPROCESS_TIMEOUT,
    )  # fmt: skip


def _old_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A golden directory whose case files all carry OLD_GENERATOR, and a spare of its set."""
    copy = tmp_path / "golden"
    shutil.copytree(golden_directory(), copy)
    for path in (copy / "cases").glob("*.json"):
        record = decode_record(path.read_text(encoding="utf-8"), str(path))
        record.provenance["generator"] = OLD_GENERATOR
        path.write_text(encode_record(record), encoding="utf-8")
    spare = tmp_path / "old-cases"
    shutil.copytree(copy / "cases", spare)
    return copy, spare


def _generators(cases: Path) -> set[str]:
    return {
        decode_record(path.read_text(encoding="utf-8"), str(path)).provenance["generator"]
        for path in cases.glob("*.json")
    }


def _leftovers(copy: Path) -> list[Path]:
    return sorted(path for path in copy.iterdir() if path.name.startswith(".cases-"))


@pytest.mark.slow
def test_a_killed_regen_leaves_the_whole_old_set_or_the_whole_new_one(tmp_path: Path) -> None:
    copy, spare = _old_copy(tmp_path)
    cases = copy / "cases"
    command = [sys.executable, "-m", "conformance.cli", "golden", "regen", "--directory", str(copy)]
    started = time.perf_counter()
    assert _golden("regen", "--directory", str(copy)).returncode == 0
    duration = time.perf_counter() - started
    (new_generator,) = _generators(cases)
    assert new_generator != OLD_GENERATOR
    random_instants = random.Random(SEED)
    outcomes: Counter[str] = Counter()
    for trial in range(TRIALS):
        if _generators(cases) != {OLD_GENERATOR}:  # the last trial (or the timing run) won
            shutil.rmtree(cases)
            shutil.copytree(spare, cases)
        delay = random_instants.uniform(0.0, duration)
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            time.sleep(delay)  # sleep, not wait(timeout=): wait polls in steps of up to 50 ms
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
            else:
                outcomes["finished before the kill"] += 1
            process.wait(timeout=SUBPROCESS_TIMEOUT)
        finally:
            if process.poll() is None:  # only if the wait above timed out
                process.kill()
                process.wait()
        where = f"trial {trial}, killed {delay:.3f} s into a {duration:.3f} s regen"
        check = _golden("check", "--directory", str(copy))
        assert check.returncode == 0, f"{where}: {check.stdout}{check.stderr}"
        assert sorted(path.name for path in cases.iterdir()) == DEFINED, where
        generators = _generators(cases)
        assert generators in ({OLD_GENERATOR}, {new_generator}), f"{where}: mixed {generators}"
        for leftover in _leftovers(copy):
            assert f"note: leftover temporary directory {leftover} " in check.stdout, where
        outcomes["all-old" if generators == {OLD_GENERATOR} else "all-new"] += 1
        outcomes["checked with a leftover present"] += bool(_leftovers(copy))
    print(f"{TRIALS} kills within {duration:.3f} s: {dict(outcomes)}")
    # A complete regen sweeps whatever the killed ones left.
    assert _golden("regen", "--directory", str(copy)).returncode == 0
    assert _leftovers(copy) == []
    check = _golden("check", "--directory", str(copy))
    assert check.returncode == 0 and "note:" not in check.stdout, check.stdout


def _killed_between_the_renames(copy: Path) -> Path:
    """The state a portable swap leaves when killed after ``cases`` moved aside: no ``cases``,
    the old set under ``.cases-old-*``, the complete new set still under ``.cases-new-*``."""
    moved_aside = copy / ".cases-old-k1ll"
    os.rename(copy / "cases", moved_aside)
    staging = copy / ".cases-new-k1ll"
    shutil.copytree(moved_aside, staging)
    return moved_aside


def test_check_restores_the_old_set_after_a_fallback_swap_killed_halfway(tmp_path: Path) -> None:
    copy, spare = _old_copy(tmp_path)
    moved_aside = _killed_between_the_renames(copy)
    problems, notes = check_golden(copy)
    assert problems == []
    assert notes[0] == (
        f"restored {copy / 'cases'} from {moved_aside}, where a golden regen killed in the "
        "middle of its swap had left the previous case set"
    )
    assert notes[1].startswith(f"leftover temporary directory {copy / '.cases-new-k1ll'} ")
    assert len(notes) == 2
    assert not moved_aside.exists()
    assert sorted(path.name for path in (copy / "cases").iterdir()) == DEFINED
    for path in spare.iterdir():
        assert (copy / "cases" / path.name).read_bytes() == path.read_bytes()


def test_regen_restores_then_replaces_after_a_fallback_swap_killed_halfway(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    copy, _ = _old_copy(tmp_path)
    moved_aside = _killed_between_the_renames(copy)
    with caplog.at_level(logging.WARNING, logger=golden_module.__name__):
        regenerate(ReferenceBackend(), copy)
    assert [record.getMessage() for record in caplog.records] == [
        f"restored {copy / 'cases'} from {moved_aside}, where a golden regen killed in the "
        "middle of its swap had left the previous case set"
    ]
    assert sorted(path.name for path in copy.iterdir()) == ["cases", "seed"]
    assert OLD_GENERATOR not in _generators(copy / "cases")
    assert check_golden(copy) == ([], [])


def test_a_fallback_swap_interrupted_between_its_renames_is_recovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real fallback, stopped where a kill would hurt most: ``cases`` moved aside."""
    copy, _ = _old_copy(tmp_path)
    monkeypatch.setattr(golden_module, "_exchange", lambda *_: False)
    rename = os.rename

    def stop_before_the_second_rename(source: str | Path, target: str | Path) -> None:
        if Path(source).name.startswith(".cases-new-"):
            raise KeyboardInterrupt("killed between the two renames")
        rename(source, target)

    monkeypatch.setattr(os, "rename", stop_before_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        regenerate(ReferenceBackend(), copy)
    monkeypatch.setattr(os, "rename", rename)
    assert not (copy / "cases").exists()
    problems, notes = check_golden(copy)
    assert problems == [] and notes[0].startswith(f"restored {copy / 'cases'} from ")
    assert _generators(copy / "cases") == {OLD_GENERATOR}
