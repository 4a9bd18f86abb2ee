"""Rule-by-rule results: gathered from test reports, rendered as a table, JSON or Markdown.

JSON schema (``schema_version`` 1)::

    {
      "schema": "decoder-conformance-report", "schema_version": 1,
      "backend": str, "backend_version": str, "precision": str, "capabilities": [str],
      "suite_version": str, "profile": str,
      "summary": {"passed": int, "failed": int, "skipped": int, "xfailed": int,
                  "xpassed": int, "untested": int},
      "rules": [{"id": str, "category": str, "statement": str, "status": str,
                 "duration": float, "tests": int, "message": str}]
    }

``status`` is one of ``passed``, ``failed``, ``skipped``, ``xfailed`` (failed, but listed as
expected), ``xpassed`` (listed as expected, yet passed) and ``untested`` (no test ran).
``message`` holds the first failure, or the skip reason, or is empty.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from spec.rules import RULES

__all__ = [
    "STATUSES",
    "Report",
    "ReportError",
    "RuleResult",
    "RuleTally",
    "SuiteIdentity",
    "render_json",
    "render_markdown",
    "render_table",
]

STATUSES = ("passed", "failed", "skipped", "xfailed", "xpassed", "untested")
# When a rule's tests end differently, the worst outcome is the rule's.
_SEVERITY = {"failed": 5, "xpassed": 4, "xfailed": 3, "passed": 2, "skipped": 1, "untested": 0}


@dataclass
class SuiteIdentity:
    """Who was checked, by which suite, at which profile."""

    backend: str
    backend_version: str
    precision: str
    capabilities: list[str]
    suite_version: str
    profile: str


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


@dataclass
class RuleTally:
    """Accumulates test outcomes per rule, in registry order."""

    results: dict[str, RuleResult] = field(
        default_factory=lambda: {
            r.id: RuleResult(r.id, str(r.category), r.statement) for r in RULES
        }
    )

    def record(self, rule_id: str, outcome: str, duration: float, message: str) -> None:
        """Fold one test's outcome into its rule."""
        result = self.results[rule_id]
        result.duration += duration
        result.tests += 1
        if _SEVERITY[outcome] > _SEVERITY[result.status] or (
            result.status == "untested" and outcome == "skipped"
        ):
            result.status = outcome
            if outcome != "passed":
                result.message = message
        elif outcome == result.status and not result.message and outcome != "passed":
            result.message = message

    def summary(self) -> dict[str, int]:
        """How many rules ended in each status."""
        counts = dict.fromkeys(STATUSES, 0)
        for result in self.results.values():
            counts[result.status] += 1
        return counts


class ReportError(ValueError):
    """A JSON report that does not follow the schema."""


@dataclass
class Report:
    """What one run of the suite found: who was checked, every rule's result, the verdict.

    ``status`` is the run's exit status: 0 when no rule failed, 1 when one did, anything else
    when the run itself could not complete (pytest's usage errors, an adapter that cannot
    be loaded: 4). ``output`` is what the run printed, when it was captured.
    """

    status: int
    identity: SuiteIdentity | None = None
    rules: list[RuleResult] = field(default_factory=list)
    output: str = ""

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
            if document.get("schema") != "decoder-conformance-report":
                raise ReportError(f"not a decoder-conformance report: {text[:80]!r}")
            identity = SuiteIdentity(
                backend=str(document["backend"]),
                backend_version=str(document["backend_version"]),
                precision=str(document["precision"]),
                capabilities=[str(c) for c in document["capabilities"]],
                suite_version=str(document["suite_version"]),
                profile=str(document["profile"]),
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
                )
                for r in document["rules"]
            ]
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            if isinstance(error, ReportError):
                raise
            raise ReportError(f"malformed report ({type(error).__name__}: {error})") from None
        return cls(status, identity, rules, output)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else ""


def render_table(tally: RuleTally, identity: SuiteIdentity) -> str:
    """A plain-text table: one rule per line, then the counts."""
    results = list(tally.results.values())
    id_width = max(len(r.id) for r in results)
    lines = [
        f"decoder-conformance {identity.suite_version}: backend {identity.backend} "
        f"{identity.backend_version} ({identity.precision}), profile {identity.profile}",
        f"{'RULE':<{id_width}}  {'STATUS':<8}  {'TIME':>7}  DETAIL",
    ]
    for result in results:
        detail = _first_line(result.message) if result.status != "passed" else ""
        lines.append(
            f"{result.id:<{id_width}}  {result.status:<8}  {result.duration:>6.2f}s  {detail}"[:220]
        )
    counts = tally.summary()
    lines.append(", ".join(f"{count} {status}" for status, count in counts.items() if count))
    return "\n".join(lines) + "\n"


def _document(tally: RuleTally, identity: SuiteIdentity) -> dict[str, Any]:
    return {
        "schema": "decoder-conformance-report",
        "schema_version": 1,
        "backend": identity.backend,
        "backend_version": identity.backend_version,
        "precision": identity.precision,
        "capabilities": identity.capabilities,
        "suite_version": identity.suite_version,
        "profile": identity.profile,
        "summary": tally.summary(),
        "rules": [
            {
                "id": r.id,
                "category": r.category,
                "statement": r.statement,
                "status": r.status,
                "duration": round(r.duration, 6),
                "tests": r.tests,
                "message": r.message,
            }
            for r in tally.results.values()
        ],
    }


def render_json(tally: RuleTally, identity: SuiteIdentity) -> str:
    """The report as JSON (schema in this module's docstring)."""
    return json.dumps(_document(tally, identity), indent=2) + "\n"


def render_markdown(tally: RuleTally, identity: SuiteIdentity) -> str:
    """The report as a Markdown table."""
    lines = [
        f"# Conformance report: {identity.backend} {identity.backend_version}",
        "",
        f"Precision {identity.precision}; "
        f"capabilities: {', '.join(identity.capabilities) or 'none'}; "
        f"suite {identity.suite_version}; profile {identity.profile}.",
        "",
        "| rule | category | status | time (s) | detail |",
        "|---|---|---|---:|---|",
    ]
    for r in tally.results.values():
        detail = _first_line(r.message).replace("|", "\\|") if r.status != "passed" else ""
        lines.append(f"| `{r.id}` | {r.category} | {r.status} | {r.duration:.2f} | {detail} |")
    counts = tally.summary()
    lines += ["", ", ".join(f"{count} {status}" for status, count in counts.items() if count)]
    return "\n".join(lines) + "\n"
