"""The one way to run the suite: :func:`run_suite` checks a backend and returns a :class:`Report`.

The command line, the reproduction scripts, the mutant catalogue and the project's own tests
all call it. Each run is a fresh ``python -m pytest`` process with the suite's plugin: the
hypothesis profile is chosen before the rule tests are imported, one backend's state cannot
leak into the next run, and the caller's working directory is on the import path, so
``my_backend:MyBackend`` finds ``my_backend.py`` there. A run that cannot start (an adapter
that cannot be loaded) ends with one line in ``Report.error`` and status 2.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TextIO

import conformance
from conformance.profiles import PROFILES
from conformance.report import Report, ReportError

__all__ = [
    "LEASH_VARIABLE",
    "THREAD_VARIABLES",
    "RunTerminated",
    "follow_leash",
    "run_suite",
    "thread_environment",
]

# The variables that set a compute thread count: the reference's own (which it reads first),
# then those of OpenMP, OpenBLAS and MKL, which numpy, torch and most engines read.
THREAD_VARIABLES = (
    "DECODER_CONFORMANCE_THREADS",
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
)
# The plugin's first line once the backend is loaded and its contract checked.
_STARTED = f"decoder-conformance {conformance.__version__}: checking "
# The read end of a pipe only this process writes to: the run ends itself when it reads end
# of file, which the kernel delivers however this process ends (SIGKILL included).
LEASH_VARIABLE = "DECODER_CONFORMANCE_LEASH_FD"


class RunTerminated(SystemExit):
    """The process running the suite received SIGTERM; the run was stopped first, and the
    process exits with status 143 (128 + SIGTERM), as it would have without the handler."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


@contextlib.contextmanager
def _terminate_as_exception() -> Iterator[None]:
    """SIGTERM raises :class:`RunTerminated` (main thread only, where Python delivers
    signals), so the run is stopped before this process ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_terminate(number: int, frame: object) -> None:
        raise RunTerminated

    previous = signal.signal(signal.SIGTERM, on_terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def follow_leash() -> None:
    """In the run's own process: end the run's process group when the process that started
    it is gone (the leash reads end of file), so a killed ``run`` leaves nothing behind."""
    value = os.environ.pop(LEASH_VARIABLE, "")  # popped: a worker must not read another fd
    if not value.isdigit():
        return
    descriptor = int(value)
    try:
        if not stat.S_ISFIFO(os.fstat(descriptor).st_mode):
            return
    except OSError:
        return

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(descriptor, 4096):
                pass
        # The starter closed its end or died: end this run, its workers and its backends'
        # keepers, which end their backends in turn.
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGTERM)

    threading.Thread(target=watch, name="decoder-conformance-leash", daemon=True).start()


def thread_environment(threads: int) -> dict[str, str]:
    """Every thread-count variable set to ``threads``."""
    return dict.fromkeys(THREAD_VARIABLES, str(threads))


def _targets(tests: Sequence[str] | None) -> list[str]:
    """The package, or the files of the given node IDs (``conformance/test_x.py::test_y``)."""
    if not tests:
        return ["--pyargs", "conformance"]
    parent = Path(conformance.__file__).resolve().parent.parent
    return [str(parent / test) for test in tests]


def _pytest_arguments(
    adapter: str | None,
    profile: str,
    report_path: Path,
    error_path: Path,
    *,
    tests: Sequence[str] | None,
    options: Mapping[str, str | os.PathLike[str] | None],
    flags: Sequence[str],
    workers: int,
    pytest_args: Sequence[str],
) -> list[str]:
    package_parent = Path(conformance.__file__).resolve().parent.parent
    arguments = [
        # The user's own pytest configuration must not change what the suite checks.
        "-c", os.devnull, "--rootdir", str(package_parent), "-p", "no:cacheprovider",
        "-p", "no:randomly", *_targets(tests), "-q",
        "--conformance-profile", profile,
        "--conformance-json", str(report_path),
        "--conformance-error-file", str(error_path),
    ]  # fmt: skip
    if adapter:
        arguments += ["--adapter", adapter]
    for flag, value in options.items():
        if value is not None and value != "":
            arguments += [flag, os.fspath(value)]
    arguments += list(flags)
    if workers:
        # Work stealing evens out the long tail of oracle-heavy properties.
        arguments += ["-n", str(workers), "--dist", "worksteal"]
    return arguments + list(pytest_args)


class _Output:
    """The child's output, kept whole, passed on to ``stream`` once the run has started."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.lines: list[str] = []
        self.started = False
        self.held = 0  # lines kept back until the run started (or until the end)

    def add(self, line: str) -> None:
        self.lines.append(line)
        if self.stream is None:
            return
        if not self.started and line.startswith(_STARTED):
            self.started = True
            self.stream.writelines(self.lines[self.held :])
            self.held = len(self.lines)
            self.stream.flush()
        elif self.started:
            self.stream.write(line)
            self.stream.flush()

    def finish(self, *, show_held: bool) -> str:
        if self.stream is not None and not self.started and show_held:
            self.stream.writelines(self.lines)
            self.stream.flush()
        return "".join(self.lines)


def _pump(process: subprocess.Popen[str], output: _Output) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        output.add(line)


def _stop(process: subprocess.Popen[str], first: signal.Signals) -> None:
    """Signal the run's whole process group, then kill what is left of it.

    The signal is sent twice, 5 s apart, before the kill: Python drops an interrupt that
    lands while a ``__del__`` or a garbage-collection callback runs ("Exception ignored
    in"), and a run that lost it would go on testing until killed, its summary lost."""
    for _ in range(2):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, first)
        try:
            process.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _run_to_the_end(
    command: list[str],
    variables: dict[str, str],
    cwd: str | os.PathLike[str] | None,
    output: _Output,
    timeout: float | None,
) -> int | None:
    """Run ``command`` on a leash, its output into ``output``; its exit status, or None
    when it ran past ``timeout`` and was stopped. An interrupt or SIGTERM stops it first."""
    leash_read, leash = os.pipe()
    variables[LEASH_VARIABLE] = str(leash_read)
    try:
        process = subprocess.Popen(
            command,
            env=variables,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            encoding="utf-8",
            errors="replace",
            pass_fds=(leash_read,),
            start_new_session=True,  # its own process group: stopped whole
        )
    finally:
        os.close(leash_read)
    reader = threading.Thread(target=_pump, args=(process, output), daemon=True)
    reader.start()
    try:
        with _terminate_as_exception():
            return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(process, signal.SIGTERM)
        return None
    except (KeyboardInterrupt, RunTerminated) as stopped:
        _stop(process, signal.SIGINT if isinstance(stopped, KeyboardInterrupt) else signal.SIGTERM)
        raise
    finally:
        os.close(leash)
        reader.join(timeout=10)
        if not reader.is_alive() and process.stdout is not None:
            process.stdout.close()  # read to its end (a reader still blocked keeps it)


def run_suite(
    adapter: str | None = None,
    *,
    profile: str = "default",
    backend_command: str | None = None,
    backend_timeout: float = 60.0,
    xfails_file: str | os.PathLike[str] | None = None,
    skips_file: str | os.PathLike[str] | None = None,
    rules: Sequence[str] = (),
    scale_shapes: Sequence[str] = (),
    stop_on_categories: Sequence[str] = (),
    tests: Sequence[str] | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    json_report: str | os.PathLike[str] | None = None,
    markdown_report: str | os.PathLike[str] | None = None,
    repro_dir: str | os.PathLike[str] | None = None,
    workers: int = 0,
    contract_check: bool = True,
    pytest_args: Sequence[str] = (),
    shrink: bool = True,
    environment: Mapping[str, str] | None = None,
    stream: TextIO | None = None,
    color: bool = False,
    timeout: float | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Report:
    """Check a backend against every rule (or ``rules``, IDs or globs; or ``tests``, node
    IDs) and return the rule-by-rule :class:`Report`; with ``profile="scale"``, the SCALE
    rules at ``scale_shapes`` (names in :data:`spec.scale.SCALE_SHAPES`; when empty,
    :data:`spec.scale.DEFAULT_SCALE_SHAPES`).

    ``adapter`` is a registered name, ``module:attribute`` or ``file.py:attribute``
    (default: ``$DECODER_CONFORMANCE_ADAPTER``, else the reference). The run's output is
    kept in ``Report.output`` and, when ``stream`` is given, written there as it comes.
    A profile that is not derandomized gets a seed (drawn here when none is given), so
    every run can be repeated. ``workers`` > 0 runs on that many processes (pytest-xdist),
    each computing on one thread. ``shrink=False`` reports the first failing example as
    found. With ``stop_on_categories`` (names of :class:`spec.rules.RuleCategory`) the run
    ends at the first failed test of a rule in one of them; it needs ``workers=0``, since
    each pytest-xdist worker would stop on its own. Past ``timeout`` seconds the run is
    stopped (status 124).
    """
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose from {', '.join(PROFILES)}")
    if stop_on_categories and workers:
        raise ValueError("stop_on_categories needs workers=0: each worker would stop alone")
    if seed is None and not PROFILES[profile].derandomize:
        seed = random.SystemRandom().randrange(2**32)
    variables = dict(os.environ)
    if workers:
        for name, value in thread_environment(1).items():
            variables.setdefault(name, value)  # N workers share the cores
    if not shrink:
        variables["DECODER_CONFORMANCE_NO_SHRINK"] = "1"
    variables.update(environment or {})
    flags = [f"--rule={pattern}" for pattern in rules]
    flags += [f"--scale-shape={name}" for name in scale_shapes]
    flags += [f"--stop-on-category={name}" for name in stop_on_categories]
    if not contract_check:
        flags.append("--no-contract-check")
    if color:
        flags.append("--color=yes")
    with tempfile.TemporaryDirectory(prefix="decoder-conformance-") as scratch:
        report_path = Path(json_report) if json_report else Path(scratch) / "report.json"
        error_path = Path(scratch) / "error.txt"
        options = {
            "--conformance-markdown": markdown_report,
            "--xfails-file": xfails_file,
            "--skips-file": skips_file,
            "--backend-command": backend_command,
            "--backend-timeout": str(backend_timeout),
            "--conformance-max-examples": None if max_examples is None else str(max_examples),
            "--hypothesis-seed": None if seed is None else str(seed),
            "--repro-dir": repro_dir,
        }
        command = [
            sys.executable,
            "-m",
            "pytest",
            *_pytest_arguments(
                adapter,
                profile,
                report_path,
                error_path,
                tests=tests,
                options=options,
                flags=flags,
                workers=workers,
                pytest_args=pytest_args,
            ),
        ]
        stale = report_path.stat().st_mtime_ns if report_path.exists() else None
        output = _Output(stream)
        status = _run_to_the_end(command, variables, cwd, output, timeout)
        if status is None:
            text = output.finish(show_held=True)
            return Report(124, output=text, error=f"the run took longer than {timeout:g} s")
        error = error_path.read_text(encoding="utf-8").strip() if error_path.exists() else ""
        text = output.finish(show_held=not error)
        written = report_path.exists() and report_path.stat().st_mtime_ns != stale
        if error or not written:
            return Report(status if status else 3, output=text, error=error)
        try:
            report = Report.from_json(
                report_path.read_text(encoding="utf-8"), status=status, output=text
            )
        except ReportError as problem:
            return Report(3, output=text, error=str(problem))
    # pytest's own failure (a usage error) keeps its status; else the verdict is the rules':
    # 1 when one failed.
    if status in (0, 1):
        report.status = 1 if report.failed() else 0
    return report
