"""Run the suite against every mutant and the correct controls; report a kill matrix."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from conformance.report import Report
from conformance.repro import script_name
from conformance.runner import run_suite, thread_environment
from conformance.tools.mutants import CONTROLS, MUTANTS, Mutant
from spec.rules import RULES, RuleCategory, rule

__all__ = [
    "MutantResult",
    "ReproductionCheck",
    "check_reproductions",
    "judge_control",
    "judge_mutant",
    "killer_scripts",
    "render_matrix",
    "run_catalogue",
]


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


def _run_one(
    adapter: str,
    backend_command: str | None,
    repro_dir: Path | None = None,
    stop_on: frozenset[RuleCategory] = frozenset(),
) -> tuple[Report, float]:
    """The ci profile against ``adapter``; with ``stop_on``, only the rules of those
    categories, ending at the first failure."""
    started = time.perf_counter()
    report = run_suite(
        adapter,
        profile="ci",
        rules=[r.id for r in RULES if r.category in stop_on],
        stop_on_categories=sorted(category.value for category in stop_on),
        backend_command=None
        if backend_command is None
        else backend_command.format(python=sys.executable),
        shrink=False,
        # The catalogue measures the rules: the contract pre-pass would name
        # ADAPTER-CONTRACT for a mutant whose bug it meets first (a refused valid input).
        contract_check=False,
        environment=thread_environment(1),  # several suites share the cores
        timeout=900,
        repro_dir=repro_dir,
    )
    return report, time.perf_counter() - started


def judge_mutant(
    mutant: Mutant, repro_root: Path | None = None, whole_suite: bool = False
) -> MutantResult:
    """The killing rule is the first failed rule related to the mistake.

    Rules run in registry order and do not depend on one another, so (unless
    ``whole_suite``) only the related categories' rules run, ending at the first failure:
    the same rule, in a third to a half of the time. When none of them fails, the whole
    suite runs, the first failure is named, and the mutant is marked as killed for the
    wrong reason.
    """
    repro_dir = None if repro_root is None else repro_root / mutant.name
    report, seconds = None, 0.0
    if not whole_suite:
        report, seconds = _run_one(mutant.adapter, None, repro_dir, mutant.related)
    if report is None or report.status == 0:  # no related rule failed
        report, more = _run_one(mutant.adapter, None, repro_dir)
        seconds += more
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


def judge_control(name: str, adapter: str, command: str | None) -> MutantResult:
    """A correct backend (one of ``CONTROLS``) through every rule: it should pass them all."""
    report, seconds = _run_one(adapter, command)
    failed = [r.id for r in report.failed()]
    verdict = "passes" if report.status == 0 else ("killed" if failed else "error")
    first = failed[0] if failed else "-"
    detail = report.output[-2000:] if report.status else ""
    return MutantResult(name, "passes", verdict, first, seconds, detail)


def run_catalogue(
    *,
    workers: int = 2,
    only: list[str] | None = None,
    controls: bool = True,
    repro_root: Path | None = None,
    whole_suite: bool = False,
) -> list[MutantResult]:
    """Judge every mutant (and, with ``controls``, the correct backends), ``workers`` at once;
    with ``repro_root``, each mutant's reproduction scripts go to ``repro_root/NAME``. A
    mutant's run ends at its first related failure unless ``whole_suite`` (then every rule
    runs, and ``repro_root`` gets a script for each failed rule, not only the killer's)."""
    unknown = sorted(set(only or []) - {m.name for m in MUTANTS})
    if unknown:
        raise KeyError(
            f"no mutant named {', '.join(unknown)}; see decoder-conformance mutants --list"
        )
    chosen = [m for m in MUTANTS if not only or m.name in only]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        jobs = [pool.submit(judge_mutant, mutant, repro_root, whole_suite) for mutant in chosen]
        if controls:
            jobs += [pool.submit(judge_control, *control) for control in CONTROLS]
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


@dataclass(frozen=True)
class ReproductionCheck:
    """One reproduction script run against its mutant and against the reference."""

    script: Path
    against_mutant: int  # exit status: 1 while the rule fails
    against_reference: int  # exit status: 0, the rule holds
    output: str

    @property
    def as_expected(self) -> bool:
        """Fails against the bug, passes against the reference."""
        return self.against_mutant == 1 and self.against_reference == 0


def _run_script(script: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *arguments],
        capture_output=True,
        text=True,
        # The check reads the exit status only, which shrinking never changes (it picks
        # which failing example is reported), and shrinking can double a run.
        env={**os.environ, **thread_environment(1), "DECODER_CONFORMANCE_NO_SHRINK": "1"},
        timeout=900,
        check=False,
    )


def _reference_key(script: Path) -> str:
    """What a script's run against the reference depends on: its rerun call (the test, the
    profile, its examples, any backend command) less the adapter ``--adapter`` replaces.
    Scripts of different mutants killed in the same test share it."""
    text = script.read_text(encoding="utf-8")
    call = text[text.rindex("sys.exit(") :]
    kept = [line for line in call.splitlines() if not line.strip().startswith("adapter=")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:32]


def _check_script(script: Path, reference_passes: Path) -> ReproductionCheck:
    """Against the mutant, then against the reference unless the same rerun passed there
    already (a file named by its key in ``reference_passes``)."""
    mutant = _run_script(script)
    passed = reference_passes / _reference_key(script)
    if passed.exists():
        reference_status = 0
        reference_output = f"(the same rerun passed against the reference: {passed.name})"
    else:
        reference = _run_script(script, "--adapter", "reference")
        reference_status = reference.returncode
        reference_output = "\n".join([reference.stdout[-800:], reference.stderr[-800:]])
        if reference_status == 0:
            passed.touch()
    output = "\n".join([mutant.stdout[-800:], mutant.stderr[-800:], reference_output])
    return ReproductionCheck(script, mutant.returncode, reference_status, output)


def killer_scripts(results: list[MutantResult], repro_root: Path) -> list[Path]:
    """The reproduction of each killed mutant's killing rule."""
    return [
        repro_root / r.name / script_name(r.first_failed_rule)
        for r in results
        if r.expected == "killed" and r.verdict == "killed"
    ]


def check_reproductions(
    repro_root: Path,
    *,
    scripts: list[Path] | None = None,
    workers: int = 2,
    reference_passes: Path | None = None,
) -> list[ReproductionCheck]:
    """Run ``scripts`` (default: every script under ``repro_root``, as written by
    :func:`run_catalogue`) against its mutant and against the reference, ``workers`` at
    once. A rerun that passed against the reference is not run there again: the same test
    with the same examples (profile ``ci`` fixes them) computes the same thing whichever
    mutant's script asks. ``reference_passes`` keeps those passes across calls (one
    directory per run of the code under test; default: this call's own)."""
    chosen = sorted(repro_root.glob("*/reproduce-*.py")) if scripts is None else scripts
    with tempfile.TemporaryDirectory(prefix="reference-passes-") as scratch:
        kept = Path(scratch) if reference_passes is None else reference_passes
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return list(pool.map(lambda script: _check_script(script, kept), chosen))
