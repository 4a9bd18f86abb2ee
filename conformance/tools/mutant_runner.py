"""Run the suite against every mutant and the correct controls; report a kill matrix."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from conformance.report import Report
from conformance.runner import run_suite, thread_environment
from conformance.tools.mutants import CONTROLS, MUTANTS, Mutant
from spec.rules import rule

__all__ = ["MutantResult", "render_matrix", "run_catalogue"]


@dataclass
class MutantResult:
    """What the suite said about one backend."""

    name: str
    expected: str  # "killed" for a mutant, "passes" for a control
    verdict: str  # "killed", "survived", "passes", or "error"
    first_failed_rule: str
    seconds: float
    detail: str = ""
    related: bool = True

    @property
    def as_expected(self) -> bool:
        """Killed by a related rule (a mutant), or passing (a control)."""
        if self.expected == "killed":
            return self.verdict == "killed" and self.related
        return self.verdict == "passes"


def _run_one(adapter: str, backend_command: str | None) -> tuple[Report, float]:
    started = time.perf_counter()
    report = run_suite(
        adapter,
        profile="ci",
        backend_command=None
        if backend_command is None
        else backend_command.format(python=sys.executable),
        shrink=False,
        environment=thread_environment(1),  # several suites share the cores
        timeout=900,
    )
    return report, time.perf_counter() - started


def _judge_mutant(mutant: Mutant) -> MutantResult:
    """The whole suite runs; the killing rule is the first failed rule related to the mistake.

    Rules run in registry order, so when no related rule fails the first failure is named
    and the mutant is marked as killed for the wrong reason.
    """
    report, seconds = _run_one(mutant.adapter, None)
    failed = report.failed()
    if report.status == 1 and failed:
        related = [r for r in failed if rule(r.id).category in mutant.related]
        killer = (related or failed)[0]
        lines = killer.message.strip().splitlines()
        detail = f"{len(failed)} rules failed; {lines[0] if lines else ''}"
        return MutantResult(
            mutant.name, "killed", "killed", killer.id, seconds, detail, bool(related)
        )
    verdict = "survived" if report.status == 0 else "error"
    detail = report.output[-2000:] if verdict == "error" else ""
    return MutantResult(mutant.name, "killed", verdict, "-", seconds, detail)


def _judge_control(name: str, adapter: str, command: str | None) -> MutantResult:
    report, seconds = _run_one(adapter, command)
    failed = [r.id for r in report.failed()]
    verdict = "passes" if report.status == 0 else ("killed" if failed else "error")
    first = failed[0] if failed else "-"
    detail = report.output[-2000:] if report.status else ""
    return MutantResult(name, "passes", verdict, first, seconds, detail)


def run_catalogue(
    *, workers: int = 2, only: list[str] | None = None, controls: bool = True
) -> list[MutantResult]:
    """Judge every mutant (and, with ``controls``, the correct backends), ``workers`` at once."""
    unknown = sorted(set(only or []) - {m.name for m in MUTANTS})
    if unknown:
        raise KeyError(
            f"no mutant named {', '.join(unknown)}; see decoder-conformance mutants --list"
        )
    chosen = [m for m in MUTANTS if not only or m.name in only]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        jobs = [pool.submit(_judge_mutant, mutant) for mutant in chosen]
        if controls:
            jobs += [pool.submit(_judge_control, *control) for control in CONTROLS]
        return [job.result() for job in jobs]


def render_matrix(results: list[MutantResult], wall_seconds: float) -> str:
    """One line per backend, then the kill rate and the time."""
    width = max((len(r.name) for r in results), default=10)
    header = f"{'BACKEND':<{width}}  {'EXPECTED':<8}  {'VERDICT':<8}  {'KILLED BY':<24}"
    lines = [f"{header}  {'TIME':>6}"]
    for r in results:
        flag = "" if r.as_expected else "  <-- unexpected"
        if r.verdict == "killed" and not r.related:
            flag += " (unrelated rule)"
        row = f"{r.name:<{width}}  {r.expected:<8}  {r.verdict:<8}  {r.first_failed_rule:<24}"
        lines.append(f"{row}  {r.seconds:>5.1f}s{flag}")
    mutants = [r for r in results if r.expected == "killed"]
    controls = [r for r in results if r.expected == "passes"]
    killed = sum(1 for r in mutants if r.verdict == "killed")
    related = sum(1 for r in mutants if r.as_expected)
    for r in results:
        if r.verdict == "error":
            lines.append(f"{r.name}: the run itself failed:\n{r.detail.strip()[-1200:]}")
    lines.append(
        f"{killed}/{len(mutants)} mutants killed ({100 * killed / max(1, len(mutants)):.0f}%), "
        f"{related} by a related rule; controls passing: "
        f"{sum(1 for r in controls if r.as_expected)}/{len(controls)}; "
        f"wall time {wall_seconds:.0f} s"
    )
    return "\n".join(lines) + "\n"
