"""What a user meets first: naming an adapter, the contract check, adapter errors, selecting
and steering a run, deterministic messages, reproductions and the trace of any backend."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.report import Report
from conformance.runner import run_suite

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_TRACE = ROOT / "golden" / "seed" / "ch32-trace.expected.txt"

BROKEN_ADAPTER = '''from conformance.adapter import BackendBase, Capability


class Broken(BackendBase):
    """Every method raises IndexError, as a RoPE indexing slip would."""

    name = "broken"
    version = "1"
    capabilities = frozenset(Capability)

    def build(self, config, parameters):
        return [][1]

    def build_seeded(self, config, seed):
        return [][1]

    def initialize(self, config, stream):
        return [][1]

    def parameters(self, model):
        return [][1]

    def forward(self, model, tokens, shape=None):
        return [][1]

    def loss(self, model, tokens, targets, **detach):
        return [][1]
'''

TENSOR_RETURNING = '''import numpy as np

from conformance.adapters.reference import ReferenceBackend


class Tensorish:
    """Not a numpy array: what a framework tensor looks like to the suite."""

    def __init__(self, value):
        self.value = value

    def detach(self):
        return self


class ListGradients(ReferenceBackend):
    name = "list-gradients"

    def loss(self, model, tokens, targets, **detach):
        out = super().loss(model, tokens, targets, **detach)
        out.gradients = list(out.gradients.items())
        return out


class UncheckedSeeded(ReferenceBackend):
    name = "unchecked-seeded"

    def build_seeded(self, config, seed):
        head_width = config.model_width // config.heads  # no validation before this
        return super().build_seeded(config, seed)


class TensorLogits(ReferenceBackend):
    name = "tensor-logits"

    def forward(self, model, tokens, shape=None):
        out = super().forward(model, tokens, shape)
        out.logits = Tensorish(out.logits)
        return out
'''


def cli(*arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``decoder-conformance ...`` in a fresh interpreter, from ``cwd``."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    return subprocess.run(
        [sys.executable, "-m", "conformance.cli", *arguments],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environment,
        timeout=600,
        check=False,
    )


def messages(report: Report) -> dict[str, str]:
    return {rule.id: rule.message for rule in report.rules}


# -- naming an adapter -----------------------------------------------------------------------


def test_a_module_in_the_working_directory_and_a_file_path_both_load(tmp_path: Path) -> None:
    (tmp_path / "ports").mkdir()
    (tmp_path / "ports" / "mine.py").write_text(
        "from conformance.adapters.reference import ReferenceBackend as Mine\n"
    )
    (tmp_path / "here.py").write_text(
        "from conformance.adapters.reference import ReferenceBackend as Here\n"
    )
    for adapter, cwd in (("here:Here", tmp_path), ("ports/mine.py:Mine", tmp_path),
                         (str(tmp_path / "ports" / "mine.py") + ":Mine", ROOT)):  # fmt: skip
        result = cli("check-adapter", "--adapter", adapter, cwd=cwd)
        assert result.returncode == 0, (adapter, result.stdout, result.stderr)
        assert "the adapter contract holds" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("adapter", "expected"),
    [
        ("missing_module:Backend", "no module missing_module in "),
        ("./missing_file.py:Backend", "no file missing_file.py"),
        ("./here.py", "name the class too: FILE.py:CLASS"),
        ("here.py:Nothing", "here.py has no attribute 'Nothing'"),
        ("broken_import:Backend", "importing broken_import failed: ModuleNotFoundError: No "
         "module named 'not_installed_anywhere' (broken_import.py:2)"),
        ("broken_import.py:Backend", "importing broken_import.py failed: ModuleNotFoundError"),
    ],
)  # fmt: skip
def test_an_adapter_that_cannot_load_is_one_line_and_exit_2(
    tmp_path: Path, adapter: str, expected: str
) -> None:
    (tmp_path / "here.py").write_text("VALUE = 1\n")
    (tmp_path / "broken_import.py").write_text("# an adapter\nimport not_installed_anywhere\n")
    result = cli("run", "--profile", "ci", "--adapter", adapter, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("decoder-conformance: adapter") or "no adapter named" in lines[0]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr


# -- the contract ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("adapter", "expected"),
    [
        (
            "tensorish:ListGradients",
            "loss: gradients is list; with 'gradients' declared return a dict {name: array}",
        ),
        (
            "tensorish:UncheckedSeeded",
            "build_seeded: a configuration with zero heads raised ZeroDivisionError (tensorish.py:",
        ),
        (
            "tensorish:TensorLogits",
            "forward: logits is a tensorish.Tensorish; return a numpy array, e.g. "
            "tensor.detach().cpu().numpy()",
        ),
    ],
)
def test_check_adapter_names_the_method_and_what_to_return(
    tmp_path: Path, adapter: str, expected: str
) -> None:
    (tmp_path / "tensorish.py").write_text(TENSOR_RETURNING)
    result = cli("check-adapter", "--adapter", adapter, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert expected in result.stdout, result.stdout


def test_a_broken_contract_stops_the_suite_unless_asked(tmp_path: Path) -> None:
    (tmp_path / "tensorish.py").write_text(TENSOR_RETURNING)
    stopped = run_suite("tensorish:ListGradients", profile="ci", cwd=tmp_path)
    assert stopped.status == 1
    assert stopped.rule("ADAPTER-CONTRACT").status == "failed"
    assert "gradients is list" in stopped.rule("ADAPTER-CONTRACT").message
    assert stopped.rule("VALUE-LOGITS").status == "untested"
    anyway = run_suite(
        "tensorish:ListGradients", profile="ci", cwd=tmp_path, contract_check=False,
        rules=["VALUE-LOGITS", "ADAPTER-CONTRACT"],
    )  # fmt: skip
    assert anyway.rule("VALUE-LOGITS").status == "passed"
    assert anyway.rule("ADAPTER-CONTRACT").status == "failed"


# -- adapter errors and deterministic messages -----------------------------------------------


def test_an_adapter_that_raises_is_reported_fast_with_its_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "broken_adapter.py").write_text(BROKEN_ADAPTER)
    report = run_suite(
        "broken_adapter.py:Broken", profile="ci", cwd=tmp_path, contract_check=False, timeout=120
    )
    assert report.status == 1
    failed = report.failed()
    assert len(failed) == len(report.rules)
    for rule in failed:
        first = rule.message.splitlines()[0]
        assert "IndexError: list index out of range (broken_adapter.py:" in first, (rule.id, first)
        assert re.search(r"adapter error in \w+: IndexError", first), (rule.id, first)
    contract = run_suite("broken_adapter.py:Broken", profile="ci", cwd=tmp_path)
    assert "adapter error in build: IndexError" in contract.rule("ADAPTER-CONTRACT").message


REFUSING_ADAPTER = '''from conformance.adapter import Refusal
from conformance.adapters.reference import ReferenceBackend


class RefusesEveryForward(ReferenceBackend):
    """A context check against a capacity it read as 0: every forward is refused."""

    name = "refusing"

    def forward(self, model, tokens, shape=None):
        raise Refusal("context-length-exceeded", "at most 0 positions")
'''


def test_a_refusal_of_a_valid_call_is_reported_as_one(tmp_path: Path) -> None:
    """Not as a traceback: the rule's message names the refusal, its kind and the call."""
    (tmp_path / "refusing_adapter.py").write_text(REFUSING_ADAPTER)
    report = run_suite(
        "refusing_adapter.py:RefusesEveryForward", profile="ci", cwd=tmp_path,
        contract_check=False, rules=["VALUE-LOGITS"],
    )  # fmt: skip
    first, second = report.rule("VALUE-LOGITS").message.splitlines()[:2]
    assert first.startswith(
        "the backend refused a call the spec answers: "
        "Refusal(context-length-exceeded): at most 0 positions; call: forward(model of "
    ), first
    assert "nothing in this call breaks a rule of the spec" in second


@pytest.mark.slow
def test_messages_are_the_same_in_two_runs_and_under_two_workers(tmp_path: Path) -> None:
    """A failing backend and a raising one: no addresses, no worker banners, same text."""
    (tmp_path / "broken_adapter.py").write_text(BROKEN_ADAPTER)
    runs = {}
    for name, adapter, extra in (
        ("mask", "conformance.tools.mutants.numerics:MaskSeesNextToken", {}),
        ("raising", "broken_adapter.py:Broken", {"contract_check": False}),
    ):
        # Not VALUE-LARGE-LOGITS: its shrinking alone takes 30 s a run, in messages of the
        # same shape as VALUE-LOGITS'.
        chosen = {
            "rules": ["CAUSAL-*", "VALUE-STAGES", "VALUE-LOGITS", "VALUE-LONG-CONTEXT",
                      "VALUE-SEED-FIXTURE", "TIE-*", "DET-REPEAT", "ERR-TOKEN-ID"]
        }  # fmt: skip
        runs[name] = [
            messages(run_suite(adapter, profile="ci", cwd=tmp_path, workers=workers,
                               **chosen, **extra))  # type: ignore[arg-type]
            for workers in (0, 0, 2)
        ]  # fmt: skip
    for name, (first, second, parallel) in runs.items():
        assert first == second == parallel, name
        text = "\n".join(first.values())
        assert not re.search(r"0x[0-9a-f]{6,}", text), name
        assert "[gw" not in text and "linux -- Python" not in text, name
        assert any(first.values()), name


# -- selecting and steering ------------------------------------------------------------------


def test_rules_are_selected_by_id_glob_and_keyword() -> None:
    by_glob = run_suite(profile="ci", rules=["TIE-*"], contract_check=False)
    ran = {rule.id for rule in by_glob.rules if rule.status != "untested"}
    assert ran == {"TIE-SINGLE-LEAF", "TIE-GRADIENT-SUM", "TIE-OUTPUT-ROLE"}
    by_keyword = run_suite(profile="ci", pytest_args=["-k", "TIE-OUTPUT-ROLE"])
    assert [rule.id for rule in by_keyword.rules if rule.status != "untested"] == [
        "TIE-OUTPUT-ROLE"
    ]
    assert by_keyword.rule("TIE-OUTPUT-ROLE").status == "passed"


def test_a_listed_rule_that_partly_passes_is_xfailed_with_its_count(tmp_path: Path) -> None:
    """The mutant breaks one of ERR-CONFIG-KIND's parametrized tests; the others pass."""
    xfails = tmp_path / "xfails.txt"
    xfails.write_text("ERR-CONFIG-*  # known\n")
    report = run_suite(
        "conformance.tools.mutants.inputs:NegativeEpsilonAccepted",
        profile="ci", rules=["ERR-CONFIG-KIND"], xfails_file=xfails, contract_check=False,
    )  # fmt: skip
    result = report.rule("ERR-CONFIG-KIND")
    assert result.status == "xfailed", result
    match = re.match(r"(\d+) of (\d+) passed", result.message)
    assert match and 0 < int(match.group(1)) < int(match.group(2)), result.message
    assert report.status == 0


def test_a_skips_file_keeps_listed_tests_from_running(tmp_path: Path) -> None:
    skips = tmp_path / "skips.txt"
    skips.write_text("# they hang on this port\nGRAD-ORACLE\ntest_values.py::test_logits\n")
    path = tmp_path / "report.json"
    report = run_suite(
        profile="ci", skips_file=skips, rules=["GRAD-ORACLE", "VALUE-LOGITS"], json_report=path
    )
    assert report.rule("GRAD-ORACLE").status == "skipped"
    assert "listed in skips.txt line 2: GRAD-ORACLE" in report.rule("GRAD-ORACLE").message
    document = json.loads(path.read_text())
    values = next(rule for rule in document["rules"] if rule["id"] == "VALUE-LOGITS")
    assert {r["outcome"] for r in values["results"]} == {"skipped"}, values["results"]


def test_a_run_stops_at_the_first_failure_of_a_chosen_category() -> None:
    """The mutant fails CAUSAL-PREFIX-BITWISE and VALUE-STAGES; CAUSAL-POSITION-CHANGES,
    CAUSAL-LONG-REACH and BATCH-INDEPENDENCE, between them, pass."""
    mutant = "conformance.tools.mutants.numerics:MaskSeesNextToken"
    chosen = ["TIE-*", "CAUSAL-*", "BATCH-*", "VALUE-STAGES"]

    def ran(stop_on: list[str]) -> dict[str, str]:
        report = run_suite(
            mutant, profile="ci", rules=chosen, shrink=False, stop_on_categories=stop_on
        )
        assert report.status == 1, report.output[-2000:]
        return {rule.id: rule.status for rule in report.rules if rule.status != "untested"}

    before = dict.fromkeys(["TIE-SINGLE-LEAF", "TIE-GRADIENT-SUM", "TIE-OUTPUT-ROLE"], "passed")
    assert ran(["causality"]) == {**before, "CAUSAL-PREFIX-BITWISE": "failed"}
    # A failure of another category does not stop the run.
    assert ran(["values", "golden"]) == {
        **before, "CAUSAL-PREFIX-BITWISE": "failed", "CAUSAL-POSITION-CHANGES": "passed",
        "CAUSAL-LONG-REACH": "passed", "BATCH-INDEPENDENCE": "passed", "VALUE-STAGES": "failed",
    }  # fmt: skip
    with pytest.raises(ValueError, match="needs workers=0"):
        run_suite(mutant, profile="ci", stop_on_categories=["values"], workers=2)


def test_an_unknown_stop_category_is_a_usage_error_naming_the_known_ones(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs",
         "conformance.test_shapes", "--stop-on-category", "vibes"],
        capture_output=True, text=True, check=False, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr
    assert "--stop-on-category vibes: no such category; known: protocol," in result.stderr


def test_seed_and_max_examples_reach_hypothesis() -> None:
    report = run_suite(profile="default", seed=1234, max_examples=3, rules=["SHAPE-LOGITS"])
    assert report.status == 0
    assert report.identity is not None
    assert report.identity.seed == 1234 and report.identity.examples == 3
    assert "profile default, 3 examples a property, seed 1234;" in report.output


def test_version_and_rule_needs_are_shown(tmp_path: Path) -> None:
    version = cli("--version", cwd=tmp_path)
    assert version.returncode == 0 and re.fullmatch(
        r"decoder-conformance \d+\.\d+\.\d+\n", version.stdout
    )
    table = cli("rules", cwd=tmp_path).stdout
    assert re.search(r"^TIE-GRADIENT-SUM\s+tying\s+gradients, tied-roles\s", table, re.M)


def test_a_normal_run_prints_no_warning() -> None:
    report = run_suite(profile="ci", rules=["SHAPE-*", "PARAM-*"])
    assert report.status == 0
    assert "warning" not in report.output.lower(), report.output


# -- reproductions ---------------------------------------------------------------------------


def run_script(script: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *arguments],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )  # fmt: skip


def test_a_reproduction_script_fails_against_the_bug_and_passes_against_the_reference(
    tmp_path: Path,
) -> None:
    adapter = "conformance.tools.mutants.numerics:RopeOnValues"
    report = run_suite(adapter, profile="ci", rules=["VALUE-STAGES"], repro_dir=tmp_path)
    assert report.rule("VALUE-STAGES").status == "failed"
    script = tmp_path / "reproduce-VALUE-STAGES.py"
    assert script.read_text() == report.rule("VALUE-STAGES").reproduction
    against_bug = run_script(script)
    assert against_bug.returncode == 1, against_bug.stdout + against_bug.stderr
    assert "[VALUE-STAGES]" in against_bug.stdout
    against_reference = run_script(script, "--adapter", "reference")
    assert against_reference.returncode == 0, against_reference.stdout + against_reference.stderr


# -- the trace of any backend ----------------------------------------------------------------


def test_the_trace_of_the_reference_through_its_adapter_is_the_seed_s(tmp_path: Path) -> None:
    result = cli("trace", "--adapter", "reference", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == GOLDEN_TRACE.read_text()
    same = cli("trace", "--adapter", "reference", "--diff", "--width", "8", cwd=tmp_path)
    # The float64 bound derived for the traced configuration (width 8, three tokens).
    assert re.search(r"no departure from the reference beyond \d\S*e-1[3-5]$", same.stdout.rstrip())


def test_trace_diff_names_the_first_departure() -> None:
    result = cli(
        "trace", "--adapter", "conformance.tools.mutants.numerics:RopeOnValues", "--diff",
        "--width", "8", cwd=ROOT,
    )  # fmt: skip
    last = result.stdout.rstrip().splitlines()[-1]
    assert re.fullmatch(
        r"first departure: stage block-0 batch=0 token=\d+ feature=\d+: backend \S+, "
        r"reference \S+ \(scaled error \S+, tolerance \d\S*e-1[3-5]\)",
        last,
    ), last
