"""The compliance matrix: every shipped adapter checked in one command, rule by rule.

``decoder-conformance matrix`` runs the suite against a list of adapters (each with the
known failures it ships, :mod:`conformance.known_failures`), one after the other, and
writes the result as Markdown (a status table, rules down and backends across, then one
line per cell that did not pass: its reason and the first line of its message) and as
HTML (the same table, each cell's message on hover). ``--readme FILE`` puts the Markdown
between the markers ``<!-- matrix:start -->`` and ``<!-- matrix:end -->`` of FILE;
``--check FILE`` compares this run's statuses with the matrix FILE holds and exits 1 where
they differ, so a README cannot claim a matrix the code no longer produces.
"""

from __future__ import annotations

import html
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from conformance.files import write_atomically
from conformance.known_failures import FOLDER as KNOWN_FAILURES
from conformance.profiles import runs_rule
from conformance.report import Report, RuleResult, first_line
from conformance.session import ListedTests
from spec.rules import RULES, Rule

__all__ = [
    "DEFAULT_ADAPTERS",
    "END_MARKER",
    "START_MARKER",
    "Column",
    "MatrixError",
    "check_statuses",
    "known_reasons",
    "read_statuses",
    "render_html",
    "render_markdown",
    "replace_section",
    "run_matrix",
]

START_MARKER = "<!-- matrix:start -->"
END_MARKER = "<!-- matrix:end -->"
# (adapter, backend command): every shipped adapter that checks a real implementation.
# hf-llama-claims-float64 is left out: it declares a precision it does not have, on purpose,
# to show the suite catching that; it is no backend a user would run.
REFERENCE_SERVER = "python -m conformance.adapters.reference_server"
DEFAULT_ADAPTERS: tuple[tuple[str, str | None], ...] = (
    ("reference", None),
    ("subprocess", REFERENCE_SERVER),
    ("emulated-float32", None),
    ("emulated-float32-loop", None),
    ("emulated-bfloat16", None),
    ("emulated-float16", None),
    ("torch", None),
    ("torch-float32", None),
    ("torch-bfloat16", None),
    ("torch-float16", None),
    ("hf-llama", None),
    ("hf-llama-bfloat16", None),
    ("jax", None),
    ("jax-float32", None),
    ("onnxruntime", None),
    ("onnxruntime-float32", None),
    ("llama-cpp", None),
    ("llama-cpp-f16-cache", None),
)
_SHORT = {
    "passed": "pass",
    "failed": "**FAIL**",
    "xfailed": "known",
    "xpassed": "xpass",
    "skipped": "skip",
    "untested": "\u2013",
}
_ROW = re.compile(r"^\| `?([A-Z0-9-]+)`? \|(.*)\|\s*$")


class MatrixError(Exception):
    """A matrix that cannot be read or written as asked."""


@dataclass
class Column:
    """One adapter's run: its report, how long it took, and the reasons it ships."""

    adapter: str
    report: Report
    seconds: float
    reasons: dict[str, str] = field(default_factory=dict)  # rule ID -> known failure's reason

    @property
    def title(self) -> str:
        identity = self.report.identity
        return identity.backend if identity is not None else self.adapter

    def status(self, rule_id: str) -> str:
        try:
            return self.report.rule(rule_id).status
        except KeyError:
            return "untested"


def known_reasons(adapter: str, report: Report) -> dict[str, str]:
    """Rule ID -> reason, from the adapter's known-failures file (entries are rule IDs or
    test-id prefixes; a prefix names the rule whose tests it matches)."""
    path = KNOWN_FAILURES / f"{adapter}.txt"
    if not path.is_file():
        return {}
    listed = ListedTests.read(path)
    reasons: dict[str, str] = {}
    for result in report.rules:
        # A report names a test by its path; the listed entries by the file's name alone.
        lines = (listed.line_for(result.id, t.test.rsplit("/", 1)[-1]) for t in result.results)
        number = next((line for line in lines if line is not None), None)
        if number is not None:
            reasons[result.id] = listed.reasons.get(number, "")
    return reasons


def run_matrix(
    adapters: Sequence[tuple[str, str | None]],
    *,
    profile: str = "ci",
    stream: TextIO | None = None,
    json_dir: Path | None = None,
    jobs: int = 1,
) -> list[Column]:
    """Run the suite against each adapter, with the known failures it ships; ``jobs``
    adapters at a time (each then computing on one thread unless the environment sets a
    thread count), the columns in the order given."""
    from conformance.runner import run_suite, thread_environment

    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    # Suites running side by side share the cores: one thread each, as run -n does, where
    # the environment does not set a count.
    environment = {k: v for k, v in thread_environment(1).items() if k not in os.environ}
    lock = threading.Lock()

    def say(text: str) -> None:
        if stream is not None:
            with lock:
                stream.write(text)
                stream.flush()

    def run_one(adapter: str, command: str | None) -> Column:
        xfails = KNOWN_FAILURES / f"{adapter}.txt"
        say(f"== {adapter} (profile {profile})\n")
        started = time.perf_counter()
        report = run_suite(
            adapter,
            profile=profile,
            backend_command=command,
            xfails_file=xfails if xfails.is_file() else None,
            json_report=None if json_dir is None else json_dir / f"{adapter}.json",
            environment=environment if jobs > 1 else None,
        )
        seconds = time.perf_counter() - started
        summary = ", ".join(f"{n} {s}" for s, n in report.summary.items() if n)
        trouble = f"; {first_line(report.error)}" if report.error else ""
        # Side by side, a summary may not follow its own header: it names its adapter.
        name = f"{adapter}: " if jobs > 1 else ""
        say(f"   {name}{summary or 'no result'} in {seconds:.0f} s{trouble}\n")
        return Column(adapter, report, seconds, known_reasons(adapter, report))

    if jobs == 1:
        return [run_one(adapter, command) for adapter, command in adapters]
    return _side_by_side(run_one, list(adapters), jobs)


def _side_by_side(
    run_one: Callable[[str, str | None], Column],
    adapters: list[tuple[str, str | None]],
    jobs: int,
) -> list[Column]:
    """``run_one`` for each adapter on ``jobs`` daemon threads, the columns in order. On an
    interrupt this thread raises at once and the process may end: each suite's process
    group ends with it (the runner's leash), so nothing is left running or waited for."""
    columns: list[Column | None] = [None] * len(adapters)
    failures: list[BaseException] = []
    pending = iter(range(len(adapters)))
    lock = threading.Lock()

    def work() -> None:
        while not failures:
            with lock:
                index = next(pending, None)
            if index is None:
                return
            try:
                columns[index] = run_one(*adapters[index])
            except BaseException as error:  # handed to the calling thread
                failures.append(error)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(timeout=0.5)  # woken often: an interrupt is taken at once
    if failures:
        raise failures[0]
    return [column for column in columns if column is not None]


def _describe(column: Column) -> str:
    identity = column.report.identity
    if identity is None:
        return f"`{column.adapter}`: did not start ({first_line(column.report.error)})"
    departures = f"; departs: {', '.join(identity.departures)}" if identity.departures else ""
    return (
        f"`{column.adapter}`: {identity.backend_version}; precision {identity.precision}; "
        f"capabilities: {', '.join(identity.capabilities) or 'none'}{departures}"
    )


def _escape(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _note(column: Column, result: RuleResult) -> str | None:
    if result.status in ("passed", "untested"):
        return None
    if result.status == "skipped":
        return None  # the skip reasons are capabilities, shown in the backends' list
    reason = column.reasons.get(result.id)
    lead = f"known: {reason}. " if reason else ""
    return (
        f"- {column.title} / {result.id} ({result.status}): {lead}{first_line(result.message, 160)}"
    )


def rules_of(profile: str) -> list[Rule]:
    """The matrix's rows: the rules ``profile`` runs (the SCALE rules only at ``scale``)."""
    return [rule for rule in RULES if runs_rule(profile, rule.id)]


def render_markdown(columns: Sequence[Column], profile: str) -> str:
    """The matrix as Markdown: the status table, the backends, then every cell that did not
    pass (skips aside: those are the capabilities a backend lacks)."""
    lines = [
        f"Profile `{profile}`. pass: every test passed; known: a failure the adapter ships "
        "with its reason (below); skip: the backend lacks a capability the rule needs; "
        "**FAIL**: an unexpected failure.",
        "",
        "| rule | " + " | ".join(column.title for column in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for rule in rules_of(profile):
        cells = [_SHORT[column.status(rule.id)] for column in columns]
        lines.append(f"| {rule.id} | " + " | ".join(cells) + " |")
    lines += ["", "Backends:", ""]
    lines += [f"- {_describe(column)}" for column in columns]
    notes = [
        note
        for column in columns
        for result in column.report.rules
        if (note := _note(column, result)) is not None
    ]
    if notes:
        lines += ["", "Cells that did not pass:", "", *(_escape(note) for note in notes)]
    return "\n".join(lines) + "\n"


def render_html(columns: Sequence[Column], profile: str) -> str:
    """The matrix as a standalone HTML page: coloured cells, each message on hover."""
    colours = {
        "passed": "#c8e6c9",
        "failed": "#ef9a9a",
        "xfailed": "#ffe082",
        "xpassed": "#b3e5fc",
        "skipped": "#eeeeee",
        "untested": "#ffffff",
    }
    head = "".join(
        f"<th title='{html.escape(_describe(c), quote=True)}'>{html.escape(c.title)}</th>"
        for c in columns
    )
    rows = []
    for rule in rules_of(profile):
        cells = []
        for column in columns:
            status = column.status(rule.id)
            try:
                message = column.report.rule(rule.id).message
            except KeyError:
                message = ""
            reason = column.reasons.get(rule.id, "")
            hover = html.escape(" | ".join(p for p in (reason, first_line(message)) if p), True)
            cells.append(
                f"<td style='background:{colours[status]}' title='{hover}'>"
                f"{html.escape(_SHORT[status].strip('*'))}</td>"
            )
        rows.append(
            f"<tr><th title='{html.escape(rule.statement, True)}'>{rule.id}</th>"
            + "".join(cells)
            + "</tr>"
        )
    times = "".join(f"<li>{html.escape(_describe(c))}: {c.seconds:.0f} s</li>" for c in columns)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        "<title>decoder-conformance compliance matrix</title>"
        "<style>table{border-collapse:collapse;font:12px sans-serif}"
        "td,th{border:1px solid #999;padding:2px 6px}</style></head><body>"
        f"<h1>Compliance matrix (profile {html.escape(profile)})</h1>"
        f"<table><tr><th>rule</th>{head}</tr>{''.join(rows)}</table>"
        f"<ul>{times}</ul></body></html>\n"
    )


def replace_section(text: str, section: str, *, where: str = "the file") -> str:
    """``text`` with what lies between the matrix markers replaced by ``section``."""
    start, end = text.find(START_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        raise MatrixError(f"{where} has no '{START_MARKER}' ... '{END_MARKER}' section")
    return text[: start + len(START_MARKER)] + "\n" + section + text[end:]


def read_statuses(text: str) -> dict[tuple[str, str], str]:
    """(backend, rule) -> status word, from the matrix table in ``text``."""
    start, end = text.find(START_MARKER), text.find(END_MARKER)
    section = text[start:end] if 0 <= start < end else text
    backends: list[str] = []
    statuses: dict[tuple[str, str], str] = {}
    for line in section.splitlines():
        if line.startswith("| rule |"):
            backends = [cell.strip() for cell in line.strip().strip("|").split("|")[1:]]
            continue
        found = _ROW.match(line)
        if found and backends:
            cells = [cell.strip() for cell in found.group(2).split("|")]
            for backend, cell in zip(backends, cells, strict=False):
                statuses[(backend, found.group(1))] = cell
    if not statuses:
        raise MatrixError("no matrix table found")
    return statuses


def check_statuses(columns: Sequence[Column], text: str, profile: str = "ci") -> list[str]:
    """Where this run's statuses differ from the matrix in ``text``: one line each."""
    recorded = read_statuses(text)
    differences = []
    for column in columns:
        for rule in rules_of(profile):
            now = _SHORT[column.status(rule.id)]
            before = recorded.get((column.title, rule.id))
            if before != now:
                differences.append(f"{column.title} / {rule.id}: recorded {before}, now {now}")
    return differences


def write_outputs(
    columns: Sequence[Column],
    profile: str,
    *,
    markdown: Path | None = None,
    html_file: Path | None = None,
    readme: Path | None = None,
) -> str:
    """Write the requested files (each atomically) and return the Markdown."""
    text = render_markdown(columns, profile)
    if markdown is not None:
        write_atomically(markdown, text)
    if html_file is not None:
        write_atomically(html_file, render_html(columns, profile))
    if readme is not None:
        current = readme.read_text(encoding="utf-8")
        write_atomically(readme, replace_section(current, text, where=str(readme)))
    return text
