"""The state of one conformance run: the backend, the expected failures, the rule tally."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conformance import __version__
from conformance.adapter import Backend, BackendLoadError, BackendOptions, load_backend
from conformance.files import write_atomically
from conformance.profiles import active_profile
from conformance.report import RuleTally, SuiteIdentity, render_json, render_markdown, render_table
from spec.rules import RULES

__all__ = [
    "DEFAULT_ADAPTER",
    "ENVIRONMENT_VARIABLE",
    "ExpectedFailures",
    "SuiteSession",
    "outcome",
    "stable_id",
]

DEFAULT_ADAPTER = "reference"
ENVIRONMENT_VARIABLE = "DECODER_CONFORMANCE_ADAPTER"
_RULE_IDS = {rule.id for rule in RULES}


def stable_id(item: pytest.Item) -> str:
    """``test_module.py::test_name[params]``: the same wherever the suite is installed."""
    return f"{Path(str(item.path)).name}::{item.name}"


@dataclass
class ExpectedFailures:
    """An expected-failures file: one test-id prefix or rule ID per line, ``#`` comments."""

    path: Path
    entries: list[tuple[int, str]] = field(default_factory=list)
    matched: set[int] = field(default_factory=set)

    @classmethod
    def read(cls, path: Path) -> ExpectedFailures:
        """Parse the file; an unreadable file is a usage error naming the path."""
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise pytest.UsageError(f"--xfails-file {path}: {error.strerror or error}") from error
        entries = []
        for number, line in enumerate(text.splitlines(), start=1):
            content = line.split("#", 1)[0].strip()
            if content:
                entries.append((number, content))
        return cls(path, entries)

    def reason_for(self, item: pytest.Item, rule_id: str) -> str | None:
        """Why ``item`` is expected to fail, when some line matches it."""
        identity = stable_id(item)
        for number, entry in self.entries:
            if entry == rule_id or identity.startswith(entry):
                self.matched.add(number)
                return f"listed in {self.path.name} line {number}: {entry}"
        return None

    def unmatched(self) -> list[tuple[int, str]]:
        """Lines that matched no test: probably stale."""
        return [(number, entry) for number, entry in self.entries if number not in self.matched]


class SuiteSession:
    """Loads the backend once, on first use, and keeps the run's results."""

    def __init__(self, config: pytest.Config) -> None:
        self.adapter = (
            config.getoption("adapter") or os.environ.get(ENVIRONMENT_VARIABLE) or DEFAULT_ADAPTER
        )
        self.options = BackendOptions(
            backend_command=config.getoption("backend_command"),
            timeout=config.getoption("backend_timeout"),
        )
        xfails = config.getoption("xfails_file")
        self.expected_failures = ExpectedFailures.read(Path(xfails)) if xfails else None
        self.tally = RuleTally()
        self.ran = False
        self._backend: Backend | None = None

    @property
    def backend(self) -> Backend:
        """The backend under test; a failure to load it ends the run with one clear message."""
        if self._backend is None:
            try:
                self._backend = load_backend(self.adapter, self.options)
            except BackendLoadError as error:
                pytest.exit(f"decoder-conformance: {error}", returncode=4)
        return self._backend

    def identity(self) -> SuiteIdentity:
        """The report header's facts."""
        backend = self.backend
        return SuiteIdentity(
            backend=backend.name,
            backend_version=backend.version,
            precision=str(backend.precision),
            capabilities=sorted(str(c) for c in backend.capabilities),
            suite_version=__version__,
            profile=active_profile(),
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

    # ------------------------------------------------------------------ pytest hooks
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Fold each conformance test's final outcome into its rule."""
        rule_id = dict(report.user_properties).get("rule")
        verdict = outcome(report) if rule_id is not None else None
        if verdict is None:
            return
        self.ran = True
        message = report.longreprtext if verdict in ("failed", "xpassed") else _skip_reason(report)
        self.tally.record(str(rule_id), verdict, report.duration, message)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """The rule table after pytest's own summary."""
        if self.ran:
            terminalreporter.section("decoder-conformance rules")
            terminalreporter.write(render_table(self.tally, self.identity()))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Write the JSON and Markdown reports (on the controller only, under xdist)."""
        if hasattr(session.config, "workerinput") or not self.ran:
            return
        for option, render in (
            ("conformance_json", render_json),
            ("conformance_markdown", render_markdown),
        ):
            target = session.config.getoption(option)
            if target:
                write_atomically(Path(target), render(self.tally, self.identity()))

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
