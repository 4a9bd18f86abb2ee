"""Rule-by-rule results: gathered from test reports, rendered as a table, JSON or Markdown.

JSON schema (``schema_version`` 2)::

    {
      "schema": "decoder-conformance-report", "schema_version": 2,
      "backend": str, "backend_version": str, "precision": str, "capabilities": [str],
      "departures": [str],
      "suite_version": str, "profile": str, "examples": int, "seed": int | null,
      "scale_shapes": [str],
      "environment": {"python": str, "numpy": str, "hypothesis": str, "pytest": str,
                      "platform": str},
      "contract": {"checked": bool, "violations": [str]},
      "summary": {"passed": int, "failed": int, "skipped": int, "xfailed": int,
                  "xpassed": int, "untested": int},
      "rules": [{"id": str, "category": str, "statement": str, "status": str,
                 "duration": float, "tests": int, "message": str,
                 "results": [{"test": str, "outcome": str, "duration": float}],
                 "reproduction": str | null,
                 "closest_to_bound": {"fraction": float, "check": str, "test": str} | null}],
      "coverage": {"calls": {str: int}, "kinds_requested": {str: int},
                   "token_inputs": {str: int}, "parameter_dtypes": {str: int},
                   "models_with_other_gains": int, "models_with_unit_gains": int,
                   "largest_logit": float, "longest_sequence": int,
                   "largest_position": int, "size_ranges": {str: [int, int]},
                   "rope_bases": [float], "rms_epsilons": [float]}
    }

``status`` is one of ``passed``, ``failed``, ``skipped``, ``xfailed`` (listed as expected to
fail, and at least one test did; ``message`` then starts with how many passed), ``xpassed``
(listed as expected, yet every test passed), and ``untested`` (no test ran). ``message``
holds the first failure in collection order (under pytest-xdist too), or the skip reason, or
is empty; ``results`` keep that order. ``seed`` is null for a derandomized run (profile
``ci``), whose examples are fixed per test. ``reproduction`` is a script that reruns the
first failing test and exits 1 while it fails. ``closest_to_bound``
is the largest ``error / tolerance`` of the rule's passing tolerance checks, the check and the
test (:mod:`conformance.margins`; null for a rule with none). ``coverage`` is what
the run sent (:mod:`conformance.coverage`); a reader accepts a report without it.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conformance.coverage import InputCoverage
from conformance.margins import describe_closest
from conformance.protocol import printable
from spec.rules import RULES

__all__ = [
    "OUTCOMES",
    "STATUSES",
    "Report",
    "ReportError",
    "RuleResult",
    "RuleTally",
    "SuiteIdentity",
    "TestResult",
    "clean_message",
    "first_line",
    "render_json",
    "render_markdown",
    "render_table",
    "terminal_safe",
]

SCHEMA = "decoder-conformance-report"
SCHEMA_VERSION = 2
STATUSES = ("passed", "failed", "skipped", "xfailed", "xpassed", "untested")
OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed")
DETAIL_WIDTH = 120

# A rule's own first line: "[RULE-ID] what=got, but should be ..." or an adapter error.
_OWN_LINE = re.compile(r"^(\[[A-Z0-9]+(?:-[A-Z0-9]+)+\] |adapter error in )", re.M)
_WORKER_BANNER = re.compile(r"^\[gw\d+\] \S+ -- Python .*\n?", re.M)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def clean_message(text: str) -> str:
    """A test's failure text, the same for the same failure in every run: no worker banner,
    no object addresses, starting at the rule's own line when there is one."""
    text = _ADDRESS.sub("", _WORKER_BANNER.sub("", text))
    own = _OWN_LINE.search(text)
    return (text[own.start() :] if own else text).strip()


def first_line(message: str, width: int | None = None) -> str:
    """The first line of a message, cut to ``width`` with an ellipsis."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    if width is not None and len(line) > width:
        return line[: width - 1] + "\u2026"
    return line


def terminal_safe(text: str) -> str:
    """``text`` on one line with control characters (newlines, terminal escapes,
    bidirectional overrides) shown as escapes, not obeyed."""
    return printable(text, one_line=True)


def _fenced(text: str, language: str) -> list[str]:
    """A Markdown code block that ``text`` cannot close early (the fence is longer than
    any run of backticks in it), with control characters escaped."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}{language}", printable(text).rstrip(), fence]


@dataclass
class SuiteIdentity:
    """Who was checked, by which suite, with which profile, seed and environment."""

    backend: str
    backend_version: str
    precision: str
    capabilities: list[str]
    suite_version: str
    profile: str
    examples: int = 0
    seed: int | None = None
    environment: dict[str, str] = field(default_factory=dict)
    departures: list[str] = field(default_factory=list)
    scale_shapes: list[str] = field(default_factory=list)  # the scale profile's shapes

    def describe_profile(self) -> str:
        """``profile ci, 15 examples a property, derandomized``, or the scale shapes."""
        if self.scale_shapes:
            return f"profile {self.profile}, shapes {', '.join(self.scale_shapes)}"
        seed = "derandomized" if self.seed is None else f"seed {self.seed}"
        return f"profile {self.profile}, {self.examples} examples a property, {seed}"


@dataclass
class TestResult:
    """One test's final outcome."""

    test: str
    outcome: str
    duration: float


@dataclass
class RuleResult:
    """The outcome of one rule over all of its tests."""

    id: str
    category: str
    statement: str
    status: str = "untested"
    duration: float = 0.0
    tests: int = 0
    message: str = ""
    results: list[TestResult] = field(default_factory=list)
    reproduction: str | None = None
    # The passing checks' closest approach to their bounds: fraction, check, test.
    closest: dict[str, Any] | None = None

    def count(self, outcome: str) -> int:
        """How many of the rule's tests ended in ``outcome``."""
        return sum(1 for result in self.results if result.outcome == outcome)

    def first_failed_test(self) -> str | None:
        """The first test that failed (or xfailed), for its reproduction."""
        for result in self.results:
            if result.outcome in ("failed", "xfailed"):
                return result.test
        return None


def _status(result: RuleResult) -> str:
    """Failed if any test failed; listed failures that partly pass are still xfailed."""
    for status in ("failed", "xfailed", "xpassed", "passed", "skipped"):
        if result.count(status):
            return status
    return "untested"


@dataclass
class RuleTally:
    """Accumulates test outcomes per rule, in registry order (the rules of the profile:
    :func:`for_profile`)."""

    results: dict[str, RuleResult] = field(
        default_factory=lambda: {
            r.id: RuleResult(r.id, str(r.category), r.statement) for r in RULES
        }
    )

    @classmethod
    def for_profile(cls, profile: str) -> RuleTally:
        """A tally of the rules ``profile`` runs (the SCALE rules only at ``scale``)."""
        from conformance.profiles import runs_rule

        chosen = [r for r in RULES if runs_rule(profile, r.id)]
        return cls({r.id: RuleResult(r.id, str(r.category), r.statement) for r in chosen})

    # Per rule and outcome: the message of the earliest test in collection order, with
    # that test's place.
    _messages: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)
    coverage: InputCoverage = field(default_factory=InputCoverage)
    # Each test's place in the collection: pytest-xdist workers report in the order they
    # finish, and a rule's message and reproduction must not depend on which came first.
    _places: dict[str, int] = field(default_factory=dict)

    def order_tests(self, tests: Sequence[str]) -> None:
        """Name the collection order; a test not in it (the contract check) comes first."""
        self._places = {test: place for place, test in enumerate(tests)}

    def _place(self, test: str) -> int:
        return self._places.get(test, -1)

    def record(
        self, rule_id: str, outcome: str, duration: float, message: str, test: str = ""
    ) -> None:
        """Fold one test's outcome into its rule, keeping the rule's tests in collection
        order and, per outcome, the message of the first."""
        result = self.results[rule_id]
        result.duration += duration
        result.tests += 1
        place = self._place(test)
        # After the tests of the same place: equal places keep their arrival order.
        bisect.insort(
            result.results,
            TestResult(test, outcome, round(duration, 6)),
            key=lambda kept: self._place(kept.test),
        )
        messages = self._messages.setdefault(rule_id, {})
        if message and outcome != "passed":
            earliest = messages.get(outcome)
            if earliest is None or place < earliest[0]:
                messages[outcome] = (place, message)
        result.status = _status(result)
        own = messages.get(result.status, (0, ""))[1]
        if result.status == "xfailed" and result.count("xpassed"):
            passed = result.count("xpassed")
            own = f"{passed} of {result.count('xfailed') + passed} passed; {own}"
        result.message = own

    def note_closest(self, rule_id: str, closest: dict[str, Any], test: str) -> None:
        """One test's closest approach to a bound (:mod:`conformance.margins`), kept if
        it is the rule's closest so far (on a tie, the earlier test in collection order)."""
        result = self.results.get(rule_id)
        fraction = float(closest.get("fraction", -1.0))
        if result is None:
            return
        if result.closest:
            kept = result.closest["fraction"]
            earlier = self._place(result.closest["test"]) <= self._place(test)
            if kept > fraction or (kept == fraction and earlier):
                return
        result.closest = {
            "fraction": fraction,
            "check": str(closest.get("check", "")),
            "test": test,
        }

    def summary(self) -> dict[str, int]:
        """How many rules ended in each status."""
        counts = dict.fromkeys(STATUSES, 0)
        for result in self.results.values():
            counts[result.status] += 1
        return counts


def _counts_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{count} {status}" for status, count in counts.items() if count)


def _status_text(result: RuleResult) -> str:
    if result.status == "xfailed" and result.count("xpassed"):
        passed = result.count("xpassed")
        return f"xfailed, {passed} of {passed + result.count('xfailed')} passed"
    return result.status


def _detail(result: RuleResult) -> str:
    """A rule's first line: its failure or skip, or how close a pass came to its bound."""
    if result.status != "passed":
        return first_line(result.message, DETAIL_WIDTH)
    return (
        "" if result.closest is None else first_line(describe_closest(result.closest), DETAIL_WIDTH)
    )


def render_table(tally: RuleTally, identity: SuiteIdentity) -> str:
    """A plain-text table: one rule per line, then the counts."""
    results = list(tally.results.values())
    id_width = max(len(r.id) for r in results)
    status_width = max(8, *(len(_status_text(r)) for r in results))
    lines = [
        f"decoder-conformance {identity.suite_version}: backend "
        f"{terminal_safe(identity.backend)} {terminal_safe(identity.backend_version)} "
        f"({identity.precision}), profile {identity.profile}",
        f"{'RULE':<{id_width}}  {'STATUS':<{status_width}}  {'TIME':>7}  DETAIL",
    ]
    untested = [r for r in results if r.status == "untested"]
    # A selection (--rule, -k) leaves most rules untested: one line says so instead of dozens.
    shown = (
        results
        if not untested or len(untested) == len(results)
        else [r for r in results if r.status != "untested"]
    )
    for result in shown:
        detail = _detail(result)
        lines.append(
            f"{result.id:<{id_width}}  {_status_text(result):<{status_width}}  "
            f"{result.duration:>6.2f}s  {terminal_safe(detail)}".rstrip()
        )
    if len(shown) < len(results):
        lines.append(
            f"({len(untested)} rules untested: not selected, or not run after a broken "
            "contract or a --stop-on-category stop; the JSON and Markdown reports list them)"
        )
    lines.append(_counts_line(tally.summary()))
    return "\n".join(lines) + "\n"


def _departures_clause(identity: SuiteIdentity) -> str:
    if not identity.departures:
        return ""
    return f"declared departures: {', '.join(identity.departures)}; "


def _document(
    tally: RuleTally, identity: SuiteIdentity, contract: list[str] | None
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "backend": identity.backend,
        "backend_version": identity.backend_version,
        "precision": identity.precision,
        "capabilities": identity.capabilities,
        "departures": identity.departures,
        "suite_version": identity.suite_version,
        "profile": identity.profile,
        "examples": identity.examples,
        "seed": identity.seed,
        "scale_shapes": identity.scale_shapes,
        "environment": identity.environment,
        "contract": {"checked": contract is not None, "violations": list(contract or [])},
        "summary": tally.summary(),
        "coverage": tally.coverage.as_dict(),
        "rules": [
            {
                "id": r.id,
                "category": r.category,
                "statement": r.statement,
                "status": r.status,
                "duration": round(r.duration, 6),
                "tests": r.tests,
                "message": r.message,
                "results": [
                    {"test": t.test, "outcome": t.outcome, "duration": t.duration}
                    for t in r.results
                ],
                "reproduction": r.reproduction,
                "closest_to_bound": r.closest,
            }
            for r in tally.results.values()
        ],
    }


def render_json(
    tally: RuleTally, identity: SuiteIdentity, contract: list[str] | None = None
) -> str:
    """The report as JSON (schema in this module's docstring)."""
    return json.dumps(_document(tally, identity, contract), indent=2) + "\n"


def _cell(text: str) -> str:
    return terminal_safe(text).replace("|", "\\|")


def render_markdown(
    tally: RuleTally, identity: SuiteIdentity, contract: list[str] | None = None
) -> str:
    """The report as Markdown: a table, then every failure with its message and reproduction."""
    lines = [
        f"# Conformance report: {_cell(identity.backend)} {_cell(identity.backend_version)}",
        "",
        f"Precision {identity.precision}; "
        f"capabilities: {', '.join(identity.capabilities) or 'none'}; "
        f"{_departures_clause(identity)}"
        f"suite {identity.suite_version}; {identity.describe_profile()}.",
        "",
        "| rule | category | status | time (s) | detail |",
        "|---|---|---|---:|---|",
    ]
    for r in tally.results.values():
        detail = _cell(_detail(r))
        lines.append(
            f"| `{r.id}` | {r.category} | {_status_text(r)} | {r.duration:.2f} | {detail} |"
        )
    lines += ["", _counts_line(tally.summary())]
    if contract:
        lines += ["", "## Adapter contract", "", *(f"- {_cell(v)}" for v in contract)]
    failures = [r for r in tally.results.values() if r.status in ("failed", "xfailed")]
    if failures:
        lines += ["", "## Failures"]
    for r in failures:
        lines += ["", f"### `{r.id}` ({_status_text(r)})", "", *_fenced(r.message, "text")]
        if r.reproduction:
            lines += ["", "Reproduction:", "", *_fenced(r.reproduction, "python")]
    return "\n".join(lines) + "\n"


class ReportError(ValueError):
    """A JSON report that does not follow the schema."""


def _closest(entry: object) -> dict[str, Any] | None:
    """A rule's ``closest_to_bound`` as read back (absent in older reports)."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise ReportError(f"closest_to_bound must be an object, got {type(entry).__name__}")
    return {
        "fraction": float(entry["fraction"]),
        "check": str(entry["check"]),
        "test": str(entry["test"]),
    }


@dataclass
class Report:
    """What one run of the suite found: who was checked, every rule's result, the verdict.

    ``status`` is the run's exit status: 0 when no rule failed, 1 when one did, 2 when the
    adapter could not be loaded (``error`` says why), anything else when pytest itself could
    not run. ``output`` is what the run printed.
    """

    status: int
    identity: SuiteIdentity | None = None
    rules: list[RuleResult] = field(default_factory=list)
    output: str = ""
    error: str = ""
    contract: list[str] = field(default_factory=list)
    coverage: dict[str, Any] = field(default_factory=dict)

    @property
    def summary(self) -> dict[str, int]:
        """How many rules ended in each status."""
        counts = dict.fromkeys(STATUSES, 0)
        for result in self.rules:
            counts[result.status] += 1
        return counts

    def rule(self, rule_id: str) -> RuleResult:
        """One rule's result; a ``KeyError`` names an unknown ID."""
        for result in self.rules:
            if result.id == rule_id:
                return result
        raise KeyError(f"no rule {rule_id!r} in this report")

    def failed(self) -> list[RuleResult]:
        """The failed rules, in registry order."""
        return [result for result in self.rules if result.status == "failed"]

    @classmethod
    def from_json(cls, text: str, *, status: int, output: str = "") -> Report:
        """The report a :func:`render_json` document describes."""
        try:
            document = json.loads(text)
            if not isinstance(document, dict) or document.get("schema") != SCHEMA:
                raise ReportError(f"not a decoder-conformance report: {text[:80]!r}")
            if document.get("schema_version") != SCHEMA_VERSION:
                raise ReportError(
                    f"report schema version {document.get('schema_version')!r}, "
                    f"but this suite reads {SCHEMA_VERSION}"
                )
            identity = SuiteIdentity(
                backend=str(document["backend"]),
                backend_version=str(document["backend_version"]),
                precision=str(document["precision"]),
                capabilities=[str(c) for c in document["capabilities"]],
                suite_version=str(document["suite_version"]),
                profile=str(document["profile"]),
                examples=int(document["examples"]),
                seed=None if document["seed"] is None else int(document["seed"]),
                environment={str(k): str(v) for k, v in document["environment"].items()},
                departures=[str(d) for d in document.get("departures", [])],
                scale_shapes=[str(s) for s in document.get("scale_shapes", [])],
            )
            rules = [
                RuleResult(
                    id=str(r["id"]),
                    category=str(r["category"]),
                    statement=str(r["statement"]),
                    status=str(r["status"]),
                    duration=float(r["duration"]),
                    tests=int(r["tests"]),
                    message=str(r["message"]),
                    results=[
                        TestResult(str(t["test"]), str(t["outcome"]), float(t["duration"]))
                        for t in r["results"]
                    ],
                    reproduction=None if r["reproduction"] is None else str(r["reproduction"]),
                    closest=_closest(r.get("closest_to_bound")),
                )
                for r in document["rules"]
            ]
            contract = [str(v) for v in document["contract"]["violations"]]
            coverage = document.get("coverage") or {}
            if not isinstance(coverage, dict):
                raise ReportError(f"coverage must be an object, got {type(coverage).__name__}")
        except ReportError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ReportError(f"malformed report ({type(error).__name__}: {error})") from None
        return cls(status, identity, rules, output, contract=contract, coverage=coverage)
