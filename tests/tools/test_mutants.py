"""The mutant catalogue: every mutant registered and killed by a related rule; controls pass."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import conformance.tools.mutants as catalogue
from conformance.adapter import BackendBase, load_backend
from conformance.report import Report, RuleResult
from conformance.repro import reproduction_script
from conformance.tools import mutant_runner
from conformance.tools.mutant_runner import (
    check_reproductions,
    judge_control,
    judge_mutant,
    killer_scripts,
    run_catalogue,
)
from conformance.tools.mutants import CONTROLS, MUTANTS, Mutant, mutant_named
from conformance.tools.mutants.base import MutantBackend
from spec.rules import RULES, RuleCategory, rule


def _mutant_classes() -> list[type[BackendBase]]:
    """Every backend class the catalogue's modules define (helpers start with _)."""
    found = []
    for info in pkgutil.iter_modules(catalogue.__path__):
        module = importlib.import_module(f"{catalogue.__name__}.{info.name}")
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BackendBase)
                and value is not MutantBackend
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found.append(value)
    return found


def test_every_mutant_class_is_registered_once_and_loads() -> None:
    registered = {entry.adapter for entry in MUTANTS}
    defined = {f"{cls.__module__}:{cls.__qualname__}" for cls in _mutant_classes()}
    assert defined == registered, f"defined but not registered: {sorted(defined - registered)}"
    assert len({entry.name for entry in MUTANTS}) == len(MUTANTS)
    for entry in MUTANTS:
        backend = load_backend(entry.adapter)
        assert backend.name == entry.name
        assert entry.mistake and entry.mistake == inspect.getdoc(type(backend)).splitlines()[
            0
        ].rstrip(".")  # type: ignore[union-attr]
        assert rule(entry.rule).category in entry.related


def test_the_catalogue_reaches_every_part_of_the_model() -> None:
    assert {rule(entry.rule).category for entry in MUTANTS} >= {
        RuleCategory.CONFIGURATION, RuleCategory.INPUTS, RuleCategory.SHAPES,
        RuleCategory.PARAMETERS, RuleCategory.TYING, RuleCategory.CAUSALITY,
        RuleCategory.DEPTH, RuleCategory.VALUES, RuleCategory.LOSS,
        RuleCategory.INITIALIZATION, RuleCategory.DETERMINISM, RuleCategory.GRADIENTS,
    }  # fmt: skip


def test_an_unknown_mutant_is_named() -> None:
    with pytest.raises(KeyError, match="no mutant named 'frobnicated'"):
        mutant_named("frobnicated")
    with pytest.raises(KeyError, match="no mutant named frobnicated"):
        run_catalogue(only=["frobnicated"])


def _judged_with(
    monkeypatch: pytest.MonkeyPatch, failing: set[str]
) -> tuple[mutant_runner.MutantResult, list[list[str]]]:
    """``judge_mutant`` on a mutant related to the parameters, against a stand-in suite in
    which exactly the rules ``failing`` fail; also the rules each run was asked for."""
    asked: list[list[str]] = []

    def suite(
        adapter: str, *, rules: list[str], stop_on_categories: list[str], **_: object
    ) -> Report:
        asked.append(list(rules))
        assert stop_on_categories == (["parameters"] if rules else [])
        chosen = [r for r in RULES if not rules or r.id in rules]
        results = [
            RuleResult(r.id, r.category.value, r.statement,
                       "failed" if r.id in failing else "passed", message=f"{r.id} broke")
            for r in chosen
        ]  # fmt: skip
        return Report(status=1 if any(r.status == "failed" for r in results) else 0, rules=results)

    monkeypatch.setattr(mutant_runner, "run_suite", suite)
    entry = Mutant("stand-in", "stand_in:Backend", "a stand-in", "PARAM-NAMES",
                   frozenset({RuleCategory.PARAMETERS}))  # fmt: skip
    return judge_mutant(entry), asked


def test_a_mutant_run_asks_for_its_related_rules_only(monkeypatch: pytest.MonkeyPatch) -> None:
    result, asked = _judged_with(monkeypatch, {"ERR-CONFIG-KIND", "PARAM-NAMES"})
    assert asked == [[r.id for r in RULES if r.category is RuleCategory.PARAMETERS]]
    assert (result.verdict, result.first_failed_rule, result.as_expected) == (
        "killed", "PARAM-NAMES", True)  # fmt: skip


def test_without_a_related_failure_the_whole_suite_names_the_killer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result, asked = _judged_with(monkeypatch, {"ERR-CONFIG-KIND"})
    assert len(asked) == 2 and asked[1] == []  # then every rule
    assert (result.verdict, result.first_failed_rule, result.related) == (
        "killed", "ERR-CONFIG-KIND", False)  # fmt: skip
    assert not result.as_expected
    survived, _ = _judged_with(monkeypatch, set())
    assert (survived.verdict, survived.as_expected) == ("survived", False)


@pytest.fixture(scope="session")
def reference_passes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reruns that passed against the reference in this run, shared by its
    pytest-xdist workers (whose own directories lie in one directory of the run)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    directory = base / "reference-passes"
    directory.mkdir(exist_ok=True)
    return directory


# One test per mutant and per control, so that `pytest -m slow -n 2` spreads the catalogue
# over the workers with the other slow tests, and a failure names its mutant.
@pytest.mark.slow
@pytest.mark.parametrize("mutant", [pytest.param(m, id=m.name) for m in MUTANTS])
def test_the_mutant_is_killed_by_a_related_rule_and_its_reproduction_holds(
    mutant: Mutant, tmp_path: Path, reference_passes: Path
) -> None:
    """The reproduction script of the killing rule fails against the mutant and passes against
    the reference (once per test the catalogue's scripts rerun). (Every script of a
    whole-suite run, a few hundred, takes about 20 minutes: ``check_reproductions(root)``.)"""
    result = judge_mutant(mutant, tmp_path)
    assert result.as_expected, (result.verdict, result.first_failed_rule, result.detail[:300])
    (script,) = killer_scripts([result], tmp_path)
    assert script.is_file(), script
    (check,) = check_reproductions(
        tmp_path, scripts=[script], workers=1, reference_passes=reference_passes
    )
    assert check.as_expected, (check.against_mutant, check.against_reference, check.output[-600:])


def _script(directory: Path, test: str, adapter: str, failure: str) -> Path:
    """A reproduction script as the suite writes one, of one mutant's failure in ``test``."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "reproduce-RULE.py"
    script.write_text(
        reproduction_script(
            rule_id="RULE",
            message=failure,
            test=test,
            adapter=adapter,
            backend_command=None,
            backend_timeout=60.0,
            profile="ci",
            max_examples=None,
            seed=None,
        )
    )
    return script


def test_a_rerun_that_passed_against_the_reference_is_not_run_there_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two mutants' scripts of one test differ in adapter and failure only: the reference
    runs it once; a script of another test, or one that failed there, runs again."""
    runs: list[tuple[str, ...]] = []
    failing_on_reference = {"t.py::broken_on_reference"}

    def run_script(script: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
        test = script.read_text().split("rerun(\n        ")[1].split(",")[0].strip("'")
        runs.append((script.parent.name, *arguments))
        status = 1 if not arguments or test in failing_on_reference else 0
        return subprocess.CompletedProcess([], status, "", "")

    monkeypatch.setattr(mutant_runner, "_run_script", run_script)
    scripts = [
        _script(tmp_path / "a", "t.py::one", "m:A", "a failed"),
        _script(tmp_path / "b", "t.py::one", "m:B", "b failed otherwise"),
        _script(tmp_path / "c", "t.py::two", "m:C", "c failed"),
        _script(tmp_path / "d", "t.py::broken_on_reference", "m:D", "d failed"),
        _script(tmp_path / "e", "t.py::broken_on_reference", "m:E", "e failed"),
    ]
    checks = check_reproductions(tmp_path, scripts=scripts, workers=1)
    assert [c.as_expected for c in checks] == [True, True, True, False, False]
    against_reference = [name for name, *arguments in runs if arguments]
    assert against_reference == ["a", "c", "d", "e"]
    # Kept across calls in a directory of the run: the next call runs none of the passes.
    kept = tmp_path / "passes"
    kept.mkdir()
    runs.clear()
    check_reproductions(tmp_path, scripts=scripts[:3], workers=1, reference_passes=kept)
    check_reproductions(tmp_path, scripts=scripts[:3], workers=1, reference_passes=kept)
    assert [name for name, *arguments in runs if arguments] == ["a", "c"]


# The controls themselves, the reference in process and over the subprocess protocol, pass
# every rule of `ci` in tests/conformance/test_suite.py and in CI's compliance matrix; here,
# how a control's run becomes its verdict.
@pytest.mark.parametrize(
    ("status", "failing", "verdict", "first"),
    [(0, set(), "passes", "-"),
     (1, {"TIE-SINGLE-LEAF", "GRAD-ORACLE"}, "killed", "TIE-SINGLE-LEAF"),
     (2, set(), "error", "-")],
)  # fmt: skip
def test_a_control_passes_only_when_its_run_passes_every_rule(
    monkeypatch: pytest.MonkeyPatch, status: int, failing: set[str], verdict: str, first: str
) -> None:
    runs: list[dict[str, object]] = []

    def suite(adapter: str, **options: object) -> Report:
        runs.append({"adapter": adapter, **options})
        results = [
            RuleResult(r.id, r.category.value, r.statement,
                       "failed" if r.id in failing else "passed", message=f"{r.id} broke")
            for r in RULES
        ]  # fmt: skip
        return Report(status=status, rules=results, output="the run's output")

    monkeypatch.setattr(mutant_runner, "run_suite", suite)
    name, adapter, command = CONTROLS[1]
    result = judge_control(name, adapter, command)
    assert (result.verdict, result.first_failed_rule) == (verdict, first)
    assert result.as_expected is (verdict == "passes")
    assert result.detail == ("" if status == 0 else "the run's output")
    (run,) = runs
    assert run["adapter"] == "subprocess" and run["rules"] == [] and run["profile"] == "ci"
    assert run["backend_command"] == f"{sys.executable} -m conformance.adapters.reference_server"


@pytest.mark.slow
def test_the_mutants_command_judges_the_chosen_mutants_two_at_a_time() -> None:
    """The maintainers' command, which the per-mutant tests above bypass: its table, kill
    line and exit status."""
    chosen = ["negative-epsilon-accepted", "depth-zero-unvalidated"]
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "mutants", "--only", *chosen, "--no-controls",
         "--workers", "2"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:])
    rows = {line.split()[0]: line.split()[1:4] for line in result.stdout.splitlines()[1:-1]}
    assert set(rows) == set(chosen)
    for name, (expected, verdict, killer) in rows.items():
        assert (expected, verdict) == ("killed", "killed")
        assert rule(killer).category in mutant_named(name).related, (name, killer)
    assert "2/2 mutants killed (100%), 2 by a related rule; controls passing: 0/0" in result.stdout
