"""The one way to run the suite: :func:`run_suite` checks a backend and returns a :class:`Report`.

The command line, the mutant catalogue and the project's own tests all call it. Each run
is a fresh ``python -m pytest --pyargs conformance`` process with the suite's plugin: the
hypothesis profile is chosen before the rule tests are imported, one backend's state cannot
leak into the next run, and the caller's working directory is on the import path, so
``--adapter my_backend:MyBackend`` finds ``my_backend.py`` there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import conformance
from conformance.profiles import PROFILES
from conformance.report import Report, ReportError

__all__ = ["THREAD_VARIABLES", "run_suite", "thread_environment"]

# The variables that set a compute thread count: the reference's own (which it reads first),
# then those of OpenMP, OpenBLAS and MKL, which numpy, torch and most engines read.
THREAD_VARIABLES = (
    "DECODER_CONFORMANCE_THREADS",
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
)


def thread_environment(threads: int) -> dict[str, str]:
    """Every thread-count variable set to ``threads``."""
    return dict.fromkeys(THREAD_VARIABLES, str(threads))


def _pytest_arguments(
    adapter: str | None,
    profile: str,
    report_path: Path,
    *,
    backend_command: str | None,
    backend_timeout: float,
    xfails_file: str | os.PathLike[str] | None,
    markdown_report: str | os.PathLike[str] | None,
    workers: int,
    pytest_args: Sequence[str],
) -> list[str]:
    package_parent = Path(conformance.__file__).resolve().parent.parent
    arguments = [
        # The user's own pytest configuration must not change what the suite checks.
        "-c", os.devnull, "--rootdir", str(package_parent), "-p", "no:cacheprovider",
        "-p", "no:randomly",
        "--pyargs", "conformance", "-q",
        "--conformance-profile", profile,
        "--conformance-json", str(report_path),
        "--backend-timeout", str(backend_timeout),
    ]  # fmt: skip
    for flag, value in (
        ("--adapter", adapter),
        ("--conformance-markdown", markdown_report),
        ("--xfails-file", xfails_file),
        ("--backend-command", backend_command),
    ):
        if value:
            arguments += [flag, os.fspath(value)]
    if workers:
        # Work stealing evens out the long tail of oracle-heavy properties.
        arguments += ["-n", str(workers), "--dist", "worksteal"]
    return arguments + list(pytest_args)


def run_suite(
    adapter: str | None = None,
    *,
    profile: str = "default",
    backend_command: str | None = None,
    backend_timeout: float = 60.0,
    xfails_file: str | os.PathLike[str] | None = None,
    json_report: str | os.PathLike[str] | None = None,
    markdown_report: str | os.PathLike[str] | None = None,
    workers: int = 0,
    pytest_args: Sequence[str] = (),
    shrink: bool = True,
    environment: Mapping[str, str] | None = None,
    capture: bool = True,
    timeout: float | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Report:
    """Check a backend against every rule and return the rule-by-rule :class:`Report`.

    ``adapter`` is a registered name or ``module:attribute`` (default: the environment
    variable ``DECODER_CONFORMANCE_ADAPTER``, else the reference). With ``capture`` the run's
    output is kept in ``Report.output``; without it, it goes to this process's terminal.
    ``workers`` > 0 runs on that many processes (pytest-xdist), each computing on one
    thread. ``shrink=False`` reports the first failing example as found, without minimizing
    it (for verdicts, as the mutant catalogue needs). ``environment`` adds variables to the
    run's environment. Past ``timeout`` seconds the run is stopped and reported with status
    124.
    """
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose from {', '.join(PROFILES)}")
    variables = dict(os.environ)
    if workers:
        for name, value in thread_environment(1).items():
            variables.setdefault(name, value)  # N workers share the cores
    if not shrink:
        variables["DECODER_CONFORMANCE_NO_SHRINK"] = "1"
    variables.update(environment or {})
    with tempfile.TemporaryDirectory(prefix="decoder-conformance-") as scratch:
        report_path = Path(json_report) if json_report else Path(scratch) / "report.json"
        command = [
            sys.executable,
            "-m",
            "pytest",
            *_pytest_arguments(
                adapter,
                profile,
                report_path,
                backend_command=backend_command,
                backend_timeout=backend_timeout,
                xfails_file=xfails_file,
                markdown_report=markdown_report,
                workers=workers,
                pytest_args=pytest_args,
            ),
        ]
        stale = report_path.stat().st_mtime_ns if report_path.exists() else None
        try:
            finished = subprocess.run(
                command,
                env=variables,
                cwd=cwd,
                capture_output=capture,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as expired:
            output = _text(expired.stdout) + _text(expired.stderr)
            return Report(124, output=output + f"\nthe run took longer than {timeout:g} s")
        output = (finished.stdout or "") + (finished.stderr or "") if capture else ""
        status = finished.returncode
        written = report_path.exists() and report_path.stat().st_mtime_ns != stale
        if not written:
            return Report(status if status else 3, output=output)
        try:
            report = Report.from_json(
                report_path.read_text(encoding="utf-8"), status=status, output=output
            )
        except ReportError as error:
            return Report(3, output=f"{output}\n{error}")
    # pytest's own failure (a usage error, an unloadable adapter) keeps its status; else
    # the verdict is the rules': 1 when one failed.
    if status in (0, 1):
        report.status = 1 if report.failed() else 0
    return report


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
