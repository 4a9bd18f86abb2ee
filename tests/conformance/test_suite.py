"""The conformance suite itself: rule coverage, verdicts, reports, adapters and faults."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import conformance
from conformance.profiles import runs_rule
from conformance.report import Report
from conformance.runner import run_suite
from spec.rules import RULES

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_SERVER = f"{sys.executable} -m conformance.adapters.reference_server"


def command_line(*arguments: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``decoder-conformance run --profile ci ...`` in a fresh interpreter."""
    command = [sys.executable, "-m", "conformance.cli", "run", "--profile", "ci", *arguments]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=cwd or ROOT, timeout=600, check=False
    )


def statuses(report: Report) -> dict[str, str]:
    return {rule.id: rule.status for rule in report.rules}


def conformance_tests() -> dict[str, list[str]]:
    """Test function name -> the rule IDs its marks name."""
    found: dict[str, list[str]] = {}
    for info in pkgutil.iter_modules(conformance.__path__):
        if not info.name.startswith("test_"):
            continue
        module = importlib.import_module(f"conformance.{info.name}")
        for name in dir(module):
            function = getattr(module, name)
            if name.startswith("test_") and callable(function):
                marks = getattr(function, "pytestmark", [])
                found[f"{info.name}.{name}"] = [
                    mark.args[0] for mark in marks if mark.name == "rule"
                ]
    return found


def test_every_rule_has_a_test_and_every_test_one_rule() -> None:
    tests = conformance_tests()
    without_rule = [name for name, rules in tests.items() if len(rules) != 1]
    assert not without_rule, f"tests naming no rule or several: {without_rule}"
    covered = {rules[0] for rules in tests.values()}
    missing = [rule.id for rule in RULES if rule.id not in covered]
    assert not missing, f"rules without a conformance test: {missing}"
    assert covered <= {rule.id for rule in RULES}


@pytest.fixture(scope="module")
def reference_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference through the command line, profile ci, with its JSON report."""
    path = tmp_path_factory.mktemp("reference") / "report.json"
    result = command_line("--json", str(path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return path


def test_reference_passes_every_rule(reference_report: Path) -> None:
    document = json.loads(reference_report.read_text())
    assert {rule["status"] for rule in document["rules"]} == {"passed"}
    assert document["schema"] == "decoder-conformance-report" and document["schema_version"] == 2
    assert document["backend"] == "reference" and document["profile"] == "ci"
    # The SCALE rules are the scale profile's (tests/conformance/test_scale.py runs them).
    assert [rule["id"] for rule in document["rules"]] == [
        rule.id for rule in RULES if runs_rule("ci", rule.id)
    ]
    assert {"id", "category", "statement", "status", "duration", "tests", "message"} <= set(
        document["rules"][0]
    )
    assert document["contract"] == {"checked": True, "violations": []}
    assert document["seed"] is None and document["examples"] == 15
    assert set(document["environment"]) == {"python", "numpy", "hypothesis", "pytest", "platform"}
    first = document["rules"][1]["results"][0]
    assert first["test"].startswith("conformance/test_errors.py::") and first["outcome"] == "passed"


def test_a_ci_run_sends_the_inputs_where_ports_break(reference_report: Path) -> None:
    """Issue 19's floor for what a ci run exercises: every refusal kind an adapter can be
    asked for, gains other than 1, logits in the thousands, positions past 4096, token
    and parameter inputs of every type, a model of more than ten blocks (whose indices
    as text sort out of turn), and heads of width 128."""
    from spec.errors import ADAPTER_KINDS

    coverage = json.loads(reference_report.read_text())["coverage"]
    never = [str(kind) for kind in ADAPTER_KINDS if str(kind) not in coverage["kinds_requested"]]
    assert never == [], f"error kinds no rule asks for: {never}"
    assert coverage["models_with_other_gains"] > 0
    assert coverage["largest_logit"] > 1e3
    assert coverage["largest_position"] > 4096  # past a 4096-entry table or window
    assert {"bool", "int8", "uint64", "float32", "ragged", "strings"} <= set(
        coverage["token_inputs"]
    )
    assert {"complex128", "bool", "int64", "float32"} <= set(coverage["parameter_dtypes"])
    assert coverage["size_ranges"]["layers"] == [0, 12]
    assert coverage["size_ranges"]["head_width"][1] == 128  # VALUE-WIDE-HEADS


def test_coverage_adds_up_across_workers() -> None:
    """Two workers report the same figures as one (each test's share travels in its report)."""
    from conformance.runner import run_suite

    shares = []
    for workers in (0, 2):
        report = run_suite(
            "reference", profile="ci", workers=workers, rules=["ERR-TOKEN-SHAPE", "VALUE-L*"]
        )
        assert report.status == 0, report.output[-2000:]
        shares.append(report.coverage)
    assert shares[0] == shares[1]
    assert shares[0]["kinds_requested"]["token-dtype"] > 0


def test_reference_through_the_subprocess_protocol() -> None:
    report = run_suite("subprocess", profile="ci", backend_command=REFERENCE_SERVER)
    assert report.status == 0, report.output[-3000:]
    assert set(statuses(report).values()) == {"passed"}


def test_two_workers_give_the_same_verdicts(reference_report: Path) -> None:
    report = run_suite(profile="ci", workers=2)
    assert report.status == 0, report.output[-3000:]
    one_process = json.loads(reference_report.read_text())["rules"]
    assert statuses(report) == {rule["id"]: rule["status"] for rule in one_process}


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- example-adapter -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md must hold the example adapter after <!-- example-adapter -->"
    return match.group(1)


def test_readme_example_adapter_passes_what_it_declares(tmp_path: Path) -> None:
    """Saved as my_backend.py and named from its folder, as the README says."""
    (tmp_path / "my_backend.py").write_text(readme_example())
    report = run_suite(
        "my_backend:MyBackend",
        profile="ci",
        cwd=tmp_path,
        environment={
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        },
    )
    assert report.status == 0, report.output[-3000:]
    assert report.rule("VALUE-STAGES").status == "passed"
    assert report.rule("VALUE-SEED-FIXTURE").status == "passed"
    skipped = report.rule("GRAD-FINITE")
    assert skipped.status == "skipped" and "needs capability 'gradients'" in skipped.message
    assert report.summary["failed"] == 0


MUTANT = '''
from conformance.adapter import ForwardOutput
from conformance.adapters.reference import ReferenceBackend


class LeakyMask(ReferenceBackend):
    """Logits of position t also see token t + 1 (adds a scaled copy of the next row)."""

    name = "leaky-mask"

    def forward(self, model, tokens, shape=None):
        out = super().forward(model, tokens, shape)
        logits = out.logits.copy()
        logits[:, :-1] += 1e-3 * out.logits[:, 1:]
        return ForwardOutput(logits=logits, stages=out.stages)
'''


def test_a_broken_backend_fails_with_rule_message_and_reproduction(tmp_path: Path) -> None:
    """Through the command line: its exit status, its printout, its Markdown report."""
    (tmp_path / "leaky.py").write_text(MUTANT)
    markdown = tmp_path / "report.md"
    result = command_line(
        "--adapter", "leaky:LeakyMask", "--markdown", str(markdown),
        "--pytest-args", "-k causal", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[CAUSAL-PREFIX-BITWISE] logit row 0 after changing token" in result.stdout
    assert "but should be bitwise unchanged" in result.stdout
    assert (
        "the failing call, outside the suite:" in result.stdout
        and "backend = load_backend('leaky:LeakyMask')" in result.stdout
    )
    assert "| `CAUSAL-PREFIX-BITWISE` | causality | failed |" in markdown.read_text()


def test_a_causality_reproduction_names_the_changed_position_and_tokens() -> None:
    """The snippet keeps both notes of the case (one used to replace the other)."""
    report = run_suite(
        "conformance.tools.mutants.numerics:MaskSeesNextToken",
        profile="ci",
        pytest_args=["-k", "causal"],
        shrink=False,
    )
    message = report.rule("CAUSAL-PREFIX-BITWISE").message
    assert report.rule("CAUSAL-PREFIX-BITWISE").status == "failed"
    assert re.search(r"^    changed_position = \d+$", message, re.M), message
    assert re.search(r"^    changed_tokens = \[\[", message, re.M), message


def test_the_old_loss_order_fails_only_err_loss_order_naming_the_seeds_order() -> None:
    """Token IDs checked before the targets (RECIPE.md's old order) is the seed's one departure."""
    report = run_suite(
        "conformance.tools.mutants.inputs:TokenIdsCheckedBeforeTargets",
        profile="ci",
        pytest_args=["-k", "errors"],
    )
    assert report.status == 1
    assert [rule.id for rule in report.failed()] == ["ERR-LOSS-ORDER"]
    message = report.rule("ERR-LOSS-ORDER").message
    assert message.startswith("[ERR-LOSS-ORDER] refusal kind for a bad token ID with"), message
    assert "the seed's loss order: token dtype and shape" in message
    assert "then target dtype, target count, target IDs, and only then token IDs" in message


# The faulty backend breaks only the head-detached loss, which TIE-GRADIENT-SUM alone asks
# for; the two bystanders must pass around it.
AFFECTED_AND_BYSTANDERS = "sum_of_both_roles or logits_shape or valid_configurations"


def _live_processes(marker: str) -> list[str]:
    listing = subprocess.run(
        ["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in listing.splitlines() if marker in line and "ps -eo" not in line]


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("crash", "backend process exited with status 3 while answering 'loss'"),
        ("hang", "backend did not answer 'loss' within 2 s (killed)"),
        # A line that cannot be an answer may be a debug print before the answer: the suite
        # waits for the answer, then says what arrived instead.
        (
            "garbage",
            "backend did not answer 'loss' within 2 s (killed); meanwhile it wrote 1 line to "
            "stdout that cannot be an answer",
        ),
        ("broken-json", "backend answered 'loss' with not JSON"),
    ],
)
def test_backend_faults_fail_only_the_affected_test(mode: str, message: str) -> None:
    marker = f"faulty-{uuid.uuid4().hex}"
    report = run_suite(
        "subprocess",
        profile="ci",
        backend_timeout=2,
        backend_command=f"{sys.executable} -m tests.conformance.faulty_backend {mode} {marker}",
        pytest_args=["-k", AFFECTED_AND_BYSTANDERS],
        contract_check=False,  # the faults are the rules' to isolate, test by test
        cwd=ROOT,
    )
    assert report.status == 1, report.output[-3000:]
    assert report.rule("TIE-GRADIENT-SUM").status == "failed"
    assert report.rule("SHAPE-LOGITS").status == report.rule("CONFIG-VALID-BUILDS").status
    assert report.rule("SHAPE-LOGITS").status == "passed"
    failure = report.rule("TIE-GRADIENT-SUM").message
    assert message in failure
    if mode in ("crash", "hang"):
        assert (
            f"faulty backend: {'crashing' if mode == 'crash' else 'hanging'} on purpose" in failure
        )
    assert _live_processes(marker) == [], "a backend process outlived the run"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            ["--adapter", "no-such-adapter"],
            "no adapter named 'no-such-adapter'; registered adapters:",
        ),
        (["--adapter", "nowhere.module:Backend"], "no module nowhere.module in "),
        (["--adapter", "subprocess"], "the subprocess adapter needs --backend-command"),
    ],
)
def test_unusable_adapters_are_explained(arguments: list[str], message: str) -> None:
    result = command_line(*arguments)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr


pytest_plugins = ["pytester"]


def test_plugin_reads_the_environment_and_warns_about_stale_xfails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    xfails = pytester.makefile(
        ".txt", xfails="# expected failures\nSHAPE-LOGITS\nNO-SUCH-TEST::x\n"
    )
    monkeypatch.setenv("DECODER_CONFORMANCE_ADAPTER", "reference")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--pyargs", "conformance", "--conformance-profile", "ci",
        "-k", "logits_shape or parameter_count", "--xfails-file", str(xfails), "-v",
    )  # fmt: skip
    result.stdout.fnmatch_lines(
        [
            "decoder-conformance 0.1.0: checking reference 0.1.0 (float64); profile ci*",
            "capabilities: config-errors, gradients*",
            "*xfails.txt line 3 ('NO-SUCH-TEST::x') matches no test*",
            "*SHAPE-LOGITS*xpassed*",
            "*PARAM-COUNT*passed*",
        ]
    )


def test_an_interrupt_writes_no_report_even_when_a_plugin_fails_on_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pytest hands the interrupted status to sessionfinish only after every
    # pytest_keyboard_interrupt hook returned; its own terminal reporter has raised
    # TypeError there (a traceback entry without a line number), and CI then got a
    # partial report that looked complete.
    pytester.makepyfile(
        failing_on_interrupt="""
import pytest

calls = 0

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    global calls
    calls += 1
    if calls == 2:  # after one test has reported, so there is something to write
        raise KeyboardInterrupt

def pytest_keyboard_interrupt(excinfo):
    raise TypeError("unsupported operand type(s) for -: 'NoneType' and 'int'")
"""
    )
    json_path = pytester.path / "report.json"
    json_path.write_text("old json\n")
    monkeypatch.setenv("DECODER_CONFORMANCE_ADAPTER", "reference")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "failing_on_interrupt", "--pyargs", "conformance",
        "--conformance-profile", "ci", "-k", "parameter_count", "--conformance-json",
        str(json_path),
    )  # fmt: skip
    assert result.ret != pytest.ExitCode.OK, result.stdout.str()[-2000:]
    assert json_path.read_text() == "old json\n"
    result.stdout.fnmatch_lines(
        [
            "interrupted: no report or reproduction written (earlier ones are untouched)",
            "1 passed, * untested",
            "interrupted: only the tests that ended before the interrupt are counted above*",
        ]
    )


def test_plugin_is_inert_outside_the_suite(pytester: pytest.Pytester) -> None:
    package = pytester.mkpydir("conformance_extra")
    (package / "test_unruled.py").write_text("def test_orphan():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", str(package))
    result.assert_outcomes(passed=1)  # outside the conformance package the plugin is inert


@pytest.mark.parametrize(
    ("given", "pytest_arguments"),
    [
        (["--pytest-args", "-x"], "-x"),
        (["--pytest-args", "-x -k tying"], "-x -k tying"),
        (["--pytest-args=-x"], "-x"),
        (["--pytest-args", "--lf", "-n", "2"], "--lf"),
    ],
)
def test_pytest_arguments_may_start_with_a_dash(given: list[str], pytest_arguments: str) -> None:
    from conformance.cli import attach_pass_through_values, build_parser

    options = build_parser().parse_args(attach_pass_through_values(["run", *given]))
    assert options.pytest_args == pytest_arguments
    assert options.workers == (2 if "-n" in given else 0)


def test_the_readme_capability_table_matches_the_rules() -> None:
    """Each capability's row lists exactly the rules that need it, with their other needs."""
    from spec.rules import Capability

    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- capability-table -->\n((?:\|.*\n)+)", text)
    assert match, "README.md must hold the capability table after <!-- capability-table -->"
    rows = {}
    for line in match.group(1).splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[2]
    assert set(rows) == {str(capability) for capability in Capability}
    for capability in Capability:
        expected = []
        for entry in RULES:
            if capability in entry.needs:
                others = [f"`{need}`" for need in entry.needs if need is not capability]
                expected.append(
                    f"`{entry.id}`" + (f" (with {', '.join(others)})" if others else "")
                )
        assert rows[str(capability)] == ", ".join(expected), capability
    free = [entry.id for entry in RULES if not entry.needs]
    assert f"Without any, {len(free)} rules run: " + ", ".join(f"`{i}`" for i in free) in " ".join(
        text.split()
    )


def test_the_layout_rule_sends_arrays_that_are_not_c_contiguous() -> None:
    """REBUILD-MEMORY-LAYOUT's inputs hold the same values in memory another way: a port
    that reads raw buffers in memory order would see other values."""
    from conformance.test_determinism import LAYOUT_CASE, _other_layout, _strided

    tokens = LAYOUT_CASE.tokens
    for other in (np.asfortranarray(tokens), _strided(tokens)):
        assert not other.flags.c_contiguous
        assert np.array_equal(other, tokens)
    assert not np.array_equal(np.asfortranarray(tokens).ravel(order="K"), tokens.ravel())
    for name, value in LAYOUT_CASE.parameters():
        laid_out = _other_layout(value)
        assert np.array_equal(laid_out, value) and not laid_out.flags.c_contiguous, name
