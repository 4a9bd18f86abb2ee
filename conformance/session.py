"""The state of one conformance run: the backend, its contract, the listed tests, the tally.

The backend is loaded, and its adapter contract checked, once, before the first test (in
the controller under pytest-xdist, which hands the contract's verdict to its workers). A
backend that cannot be loaded ends the run with one line and status 2; a broken contract
fails ``ADAPTER-CONTRACT`` (and the rule each violation breaks) and no other test runs,
unless ``--no-contract-check`` asks for them anyway.
"""

from __future__ import annotations

import fnmatch
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, NoReturn

import pytest

from conformance import __version__
from conformance.adapter import (
    Backend,
    BackendLoadError,
    BackendOptions,
    declared_departures,
    load_backend,
)
from conformance.coverage import PROPERTY as COVERAGE_PROPERTY
from conformance.coverage import RECORDER as COVERAGE_RECORDER
from conformance.coverage import render_coverage
from conformance.files import write_atomically
from conformance.guard import GuardedBackend
from conformance.margins import PROPERTY as MARGIN_PROPERTY
from conformance.profiles import SCALE_PROFILE, active
from conformance.report import (
    RuleTally,
    SuiteIdentity,
    clean_message,
    render_json,
    render_markdown,
    render_table,
    terminal_safe,
)
from conformance.repro import reproduction_script, write_scripts
from spec.rules import RULES

__all__ = [
    "CONTRACT_RULE",
    "DEFAULT_ADAPTER",
    "ENVIRONMENT_VARIABLE",
    "ListedTests",
    "SuiteSession",
    "is_suite_run",
    "outcome",
    "stable_id",
]

DEFAULT_ADAPTER = "reference"
ENVIRONMENT_VARIABLE = "DECODER_CONFORMANCE_ADAPTER"
CONTRACT_RULE = "ADAPTER-CONTRACT"
_RULE_IDS = {rule.id for rule in RULES}
_WORKER_KEY = "decoder_conformance_contract"


def stable_id(item: pytest.Item) -> str:
    """``test_module.py::test_name[params]``: the same wherever the suite is installed."""
    return f"{Path(str(item.path)).name}::{item.name}"


def is_suite_run(config: pytest.Config) -> bool:
    """Whether this pytest run is aimed at the conformance suite (not the project's tests)."""
    import conformance

    package = Path(conformance.__file__).resolve().parent
    for argument in config.args:
        target = str(argument).split("::")[0]
        if target == "conformance" or target.startswith("conformance."):
            return True
        path = Path(target).resolve()
        if path == package or package in path.parents:
            return True
    return False


@dataclass
class ListedTests:
    """An xfails or skips file: one test-id prefix or rule ID per line, ``#`` comments. A
    comment after an entry is its reason, shown with every test it matches."""

    path: Path
    option: str
    entries: list[tuple[int, str]] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)
    matched: set[int] = field(default_factory=set)

    @classmethod
    def read(cls, path: Path, option: str = "--xfails-file") -> ListedTests:
        """Parse the file; an unreadable file is a usage error naming the path."""
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or error
            raise pytest.UsageError(f"{option} {path}: {reason}") from error
        entries, reasons = [], {}
        for number, line in enumerate(text.splitlines(), start=1):
            content, _, comment = line.partition("#")
            if content.strip():
                entries.append((number, content.strip()))
                if comment.strip():
                    reasons[number] = comment.strip()
        return cls(path, option, entries, reasons)

    def line_for(self, rule_id: str, identity: str) -> int | None:
        """The first line that lists the test ``identity`` (:func:`stable_id`) of a rule."""
        for number, entry in self.entries:
            is_glob = any(character in entry for character in "*?[")
            if (
                entry == rule_id
                or identity.startswith(entry)
                or (is_glob and fnmatch.fnmatchcase(rule_id, entry))
            ):
                return number
        return None

    def reason_for(self, item: pytest.Item, rule_id: str) -> str | None:
        """Why ``item`` is listed, when some line matches it."""
        number = self.line_for(rule_id, stable_id(item))
        if number is None:
            return None
        self.matched.add(number)
        reason = self.reasons.get(number)
        listed = f"listed in {self.path.name} line {number}: {dict(self.entries)[number]}"
        return f"{reason} ({listed})" if reason else listed

    def unmatched(self) -> list[tuple[int, str]]:
        """Lines that matched no test: probably stale."""
        return [(number, entry) for number, entry in self.entries if number not in self.matched]


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


class SuiteSession:
    """Loads the backend once, checks its contract, and keeps the run's results."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.adapter = (
            config.getoption("adapter") or os.environ.get(ENVIRONMENT_VARIABLE) or DEFAULT_ADAPTER
        )
        self.options = BackendOptions(
            backend_command=config.getoption("backend_command"),
            timeout=config.getoption("backend_timeout"),
        )
        xfails = config.getoption("xfails_file")
        skips = config.getoption("skips_file")
        self.expected_failures = ListedTests.read(Path(xfails)) if xfails else None
        self.skips = ListedTests.read(Path(skips), "--skips-file") if skips else None
        self.rule_patterns: list[str] = list(config.getoption("rule") or [])
        from spec.scale import DEFAULT_SCALE_SHAPES

        chosen = config.getoption("scale_shape") or list(DEFAULT_SCALE_SHAPES)
        self.scale_shapes: list[str] = list(dict.fromkeys(chosen))
        self.contract_enabled = not config.getoption("no_contract_check")
        self.contract: list[dict[str, Any]] | None = None  # None: not checked
        self.tally = RuleTally.for_profile(active().name)
        self.ran = False
        self.interrupted = False
        self._backend: Backend | None = None
        self._guarded: GuardedBackend | None = None

    # ------------------------------------------------------------------ the backend
    @property
    def backend(self) -> GuardedBackend:
        """The backend under test, as the rule tests see it."""
        if self._guarded is None:
            self._guarded = GuardedBackend(self._load())
        return self._guarded

    def _load(self) -> Backend:
        if self._backend is None:
            try:
                self._backend = load_backend(self.adapter, self.options)
            except BackendLoadError as error:
                self._fail_to_start(f"decoder-conformance: {error}", status=2)
        return self._backend

    def _fail_to_start(self, line: str, *, status: int) -> NoReturn:
        """End the run before any test, with one line on stderr (and in the error file)."""
        line = terminal_safe(line)
        error_file = self.config.getoption("conformance_error_file")
        if error_file:
            Path(error_file).write_text(line + "\n", encoding="utf-8")
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        pytest.exit(line, returncode=status)

    def identity(self) -> SuiteIdentity:
        """The report header's facts."""
        backend = self._load()
        selection = active()
        return SuiteIdentity(
            backend=str(backend.name),
            backend_version=str(backend.version),
            precision=str(backend.precision),
            capabilities=sorted(str(c) for c in backend.capabilities),
            departures=sorted(str(d) for d in declared_departures(backend)),
            suite_version=__version__,
            profile=selection.name,
            examples=selection.examples,
            seed=None if selection.derandomized else selection.seed,
            scale_shapes=self.scale_shapes if selection.name == SCALE_PROFILE else [],
            environment={
                "python": platform.python_version(),
                "numpy": _package_version("numpy"),
                "hypothesis": _package_version("hypothesis"),
                "pytest": _package_version("pytest"),
                "platform": platform.platform(terse=True),
            },
        )

    @staticmethod
    def rule_of(item: pytest.Item) -> str:
        """The one rule a conformance test names; anything else is a usage error."""
        markers = list(item.iter_markers("rule"))
        if len(markers) != 1 or len(markers[0].args) != 1:
            raise pytest.UsageError(
                f"{item.nodeid} must name exactly one rule with @pytest.mark.rule"
            )
        rule_id = markers[0].args[0]
        if rule_id not in _RULE_IDS:
            raise pytest.UsageError(f"{item.nodeid} names unknown rule {rule_id!r}")
        return str(rule_id)

    def selected(self, rule_id: str) -> bool:
        """Whether ``--rule`` (IDs or globs such as ``ERR-*``) lets the rule run."""
        return not self.rule_patterns or any(
            fnmatch.fnmatchcase(rule_id, pattern.upper()) for pattern in self.rule_patterns
        )

    # ------------------------------------------------------------------ the contract
    @property
    def contract_broken(self) -> bool:
        """Whether the contract was checked here (or in the controller) and failed."""
        return bool(self.contract) and self.contract_enabled

    def contract_lines(self) -> list[str]:
        """The contract's violations, checked now unless they were before the run."""
        if self.contract is None:
            from conformance.contract import check_contract

            self.contract = [{"line": str(v), "rule": v.rule} for v in check_contract(self._load())]
        return [entry["line"] for entry in self.contract]

    def check_contract(self) -> None:
        """Check the adapter contract once, and fold a broken one into the tally."""
        from conformance.contract import check_contract

        found = check_contract(self._load())
        self.contract = [{"line": str(v), "rule": v.rule} for v in found]
        if not found:
            return
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        text = "\n".join(f"  {v}" for v in found)
        self.tally.record(
            CONTRACT_RULE,
            "failed",
            0.0,
            f"[{CONTRACT_RULE}] adapter contract: {found[0]}{more}\n{text}",
            "contract",
        )
        for violation in found:
            if violation.rule is not None:
                self.tally.record(
                    violation.rule,
                    "failed",
                    0.0,
                    f"[{violation.rule}] adapter contract: {violation}",
                    "contract",
                )
        self.ran = True

    def announce(self, terminal: Any) -> None:
        """The line that says what is checked, and what the contract check found."""
        identity = self.identity()
        if self.contract is None:
            contract = "not checked (--no-contract-check)"
        elif not self.contract:
            contract = "ok"
        else:
            count = len(self.contract)
            contract = f"{count} violation{'s' if count > 1 else ''}"
            if self.contract_enabled:
                contract += ", so no rule test runs (--no-contract-check runs them anyway)"
        terminal.write_line(
            f"decoder-conformance {identity.suite_version}: checking "
            f"{terminal_safe(identity.backend)} {terminal_safe(identity.backend_version)} "
            f"({identity.precision}); {identity.describe_profile()}; adapter contract: {contract}"
        )
        terminal.write_line(f"capabilities: {', '.join(identity.capabilities) or 'none'}")
        if identity.departures:
            terminal.write_line(
                f"declared departures from the seed: {', '.join(identity.departures)} "
                "(the rules about them still run them)"
            )
        for entry in self.contract or []:
            terminal.write_line(f"  contract: {terminal_safe(entry['line'])}")

    # ------------------------------------------------------------------ pytest hooks
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Load the backend and check its contract before anything runs."""
        config = session.config
        if not is_suite_run(config):
            return
        worker = getattr(config, "workerinput", None)
        if worker is not None:
            self.contract = json.loads(worker.get(_WORKER_KEY, "null"))
            return
        self._load()
        if self.contract_enabled:
            self.check_contract()
        terminal = config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:
            self.announce(terminal)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """Hand the contract's verdict to an xdist worker."""
        node.workerinput[_WORKER_KEY] = json.dumps(self.contract)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        """The workers' collection order, which the controller never sees otherwise."""
        self.tally.order_tests(ids)

    @pytest.hookimpl(tryfirst=True)
    def pytest_keyboard_interrupt(self) -> None:
        """Remember the interrupt before any other plugin's hook can fail on it: pytest
        passes ``session.exitstatus`` on only after every such hook has returned (its
        terminal reporter has been seen to raise TypeError rendering the traceback)."""
        self.interrupted = True

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Fold each conformance test's final outcome into its rule, and what it sent into
        the run's coverage."""
        properties = dict(report.user_properties)
        share = properties.get(COVERAGE_PROPERTY)
        if isinstance(share, dict):
            self.tally.coverage.merge(share)
        rule_id = properties.get("rule")
        closest = properties.get(MARGIN_PROPERTY)
        if rule_id is not None and isinstance(closest, dict):
            self.tally.note_closest(str(rule_id), closest, report.nodeid)
        verdict = outcome(report) if rule_id is not None else None
        if verdict is None:
            return
        self.ran = True
        text = report.longreprtext if verdict in ("failed", "xfailed") else _skip_reason(report)
        if verdict == "xpassed":
            text = ""
        self.tally.record(
            str(rule_id), verdict, report.duration, clean_message(text), report.nodeid
        )

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """The rule table after pytest's own summary."""
        if self.ran:
            self.tally.coverage.merge(COVERAGE_RECORDER.take())  # the controller's own calls
            terminalreporter.section("decoder-conformance rules")
            terminalreporter.write(render_table(self.tally, self.identity()))
            if self.interrupted:
                terminalreporter.write_line(
                    "interrupted: only the tests that ended before the interrupt are counted "
                    "above; this is not a verdict"
                )
            terminalreporter.section("decoder-conformance input coverage")
            at_scale = active().name == SCALE_PROFILE
            coverage = self.tally.coverage.as_dict()
            terminalreporter.write(render_coverage(coverage, refusals_asked=not at_scale))

    def _reproductions(self) -> dict[str, str]:
        scripts = {}
        selection = active()
        for result in self.tally.results.values():
            test = result.first_failed_test()
            if test is None or test == "contract":
                continue
            result.reproduction = reproduction_script(
                rule_id=result.id,
                message=result.message,
                test=test,
                adapter=self.adapter,
                backend_command=self.options.backend_command,
                backend_timeout=self.options.timeout,
                profile=selection.name,
                max_examples=selection.max_examples,
                seed=selection.seed,
            )
            scripts[result.id] = result.reproduction
        return scripts

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Reproductions, the JSON and Markdown reports (on the controller only)."""
        if hasattr(session.config, "workerinput") or not self.ran:
            return
        if self.interrupted or session.exitstatus == pytest.ExitCode.INTERRUPTED:
            # A partial report would look complete: the old files stay as they were.
            session.exitstatus = pytest.ExitCode.INTERRUPTED
            notice = "interrupted: no report or reproduction written (earlier ones are untouched)"
            terminal = session.config.pluginmanager.get_plugin("terminalreporter")
            if terminal is not None:  # print() is still captured here
                terminal.write_line("\n" + notice)  # past the progress dots
            else:
                sys.stderr.write(notice + "\n")
            return
        if self.contract_broken:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        scripts = self._reproductions()
        repro_dir = session.config.getoption("repro_dir")
        if repro_dir and scripts:
            write_scripts(Path(repro_dir), scripts)
        contract = None if self.contract is None else [entry["line"] for entry in self.contract]
        for option, render in (
            ("conformance_json", render_json),
            ("conformance_markdown", render_markdown),
        ):
            target = session.config.getoption(option)
            if target:
                write_atomically(Path(target), render(self.tally, self.identity(), contract))

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        """Let a backend that owns resources (a process, a device) release them."""
        close = getattr(self._backend, "close", None)
        if callable(close):
            close()


def outcome(report: pytest.TestReport) -> str | None:
    """A test's final outcome, from the one phase report that decides it (else None)."""
    if hasattr(report, "wasxfail"):
        if report.skipped:
            return "xfailed"
        return "xpassed" if report.when == "call" else None
    if report.when == "setup":
        if report.skipped:
            return "skipped"
        return "failed" if report.failed else None
    if report.when == "call":
        if report.passed:
            return "passed"
        return "skipped" if report.skipped else "failed"
    return "failed" if report.failed else None


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr: Any = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return report.longreprtext
