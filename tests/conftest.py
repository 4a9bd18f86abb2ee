"""Hypothesis profiles for the project's tests, and checks that the run leaves no process and
no temporary file of the project's behind."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from conformance.supervisor import processes_with_environment

# The numerical properties run whole models; wall-clock deadlines would only add flakiness.
settings.register_profile(
    "ci",
    max_examples=15,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("default", max_examples=40, deadline=None, print_blob=True)
settings.register_profile("thorough", max_examples=300, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# Every process the test run starts inherits this marker, so what outlives the run can be found
# at its end, even a descendant that detached itself into a session of its own.
SESSION_VARIABLE = "DECODER_CONFORMANCE_TEST_SESSION"
os.environ.setdefault(SESSION_VARIABLE, uuid.uuid4().hex)
_SURVIVOR_GRACE_SECONDS = 10.0


def _live_processes_of_this_run() -> list[str]:
    found = []
    for pid in processes_with_environment(SESSION_VARIABLE, os.environ[SESSION_VARIABLE]):
        entry = Path("/proc", str(pid))
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError):
            continue  # gone already
        if state != "Z":
            found.append(f"{pid}: {command.decode(errors='replace')[:200]}")
    return found


# Every process of the run (pytest-xdist's workers and every program a test starts) puts its
# temporary files in one folder of the run's own, so what is left there at the end was left
# by the run: a file named for the project (its prefix) fails it.
TEMPORARY_VARIABLE = "DECODER_CONFORMANCE_TEST_TMPDIR"
PREFIXES = ("decoder-conformance-", "hostile-")
if TEMPORARY_VARIABLE not in os.environ:
    os.environ[TEMPORARY_VARIABLE] = tempfile.mkdtemp(prefix="decoder-conformance-tests-")
    os.environ[f"{TEMPORARY_VARIABLE}_OWNER"] = str(os.getpid())
os.environ["TMPDIR"] = os.environ[TEMPORARY_VARIABLE]
tempfile.tempdir = None  # read TMPDIR again


def _report(session: pytest.Session, lines: list[str]) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line("\n".join(lines), red=True, bold=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _check_no_process_survives(session: pytest.Session) -> None:
    if not Path("/proc").is_dir():
        return
    deadline = time.monotonic() + _SURVIVOR_GRACE_SECONDS
    while (left := _live_processes_of_this_run()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        _report(session, [f"{len(left)} process(es) started by the test run outlived it:", *left])


def _check_no_temporary_file_is_left(session: pytest.Session) -> None:
    folder = Path(os.environ[TEMPORARY_VARIABLE])
    if os.environ.get(f"{TEMPORARY_VARIABLE}_OWNER") != str(os.getpid()) or not folder.is_dir():
        return
    left = sorted(entry.name for entry in folder.iterdir() if entry.name.startswith(PREFIXES))
    if left:  # kept, to be looked at
        _report(session, [f"the test run left {len(left)} temporary file(s) in {folder}:", *left])
    else:
        # pytest's tmp_path folders go with it, failed tests' too (a folder a run would leave
        # is one no later run cleans up); `--basetemp DIR` keeps them in DIR instead.
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any process it started is still alive, or it left a temporary file of
    the project's (checked once, by the controller)."""
    if hasattr(session.config, "workerinput"):
        return
    _check_no_process_survives(session)
    _check_no_temporary_file_is_left(session)
