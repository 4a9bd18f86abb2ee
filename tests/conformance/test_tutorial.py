"""The README's tutorial, run as written: a Meta-style PyTorch Llama passes every rule it does
not skip, and each documented bug fails the rule the README names first."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conformance.profiles import runs_rule
from conformance.report import Report
from conformance.runner import run_suite
from spec.rules import RULES

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = "llama_backend:LlamaBackend"

# The two bugs of the README, each one line of the tutorial's code replaced.
ROPE_LAYOUT_FORGOTTEN = (
    "llama_backend.py",
    "CONVENTION = dataclasses.replace(META_LLAMA, rotate_half=True)",
    "CONVENTION = META_LLAMA",
)
HEAD_COPIED_NOT_TIED = (
    "llama.py",
    "self.output.weight = self.tok_embeddings.weight  # the tied head",
    "self.output.weight = nn.Parameter(self.tok_embeddings.weight.detach().clone())",
)


def readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {marker} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"README.md must hold a python block after <!-- {marker} -->"
    return match.group(1)


def tutorial(
    folder: Path,
    bug: tuple[str, str, str] | None = None,
    *,
    first: str | None = None,
    also: tuple[str, ...] = (),
) -> Report:
    """The tutorial's files saved in ``folder`` and checked from there, at ``ci`` (a bug's
    run without shrinking: the same rules fail, sooner). With ``first``, only the rules up
    to it in registry order (the rules that could fail before it) and ``also`` run."""
    files = {"llama.py": readme_block("tutorial-model"),
             "llama_backend.py": readme_block("tutorial-adapter")}  # fmt: skip
    if bug is not None:
        name, correct, broken = bug
        assert files[name].count(correct) == 1, f"the README's {name} must hold {correct!r}"
        files[name] = files[name].replace(correct, broken)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    rules: list[str] = []
    if first is not None:
        ids = [r.id for r in RULES if runs_rule("ci", r.id)]
        rules = [*ids[: ids.index(first) + 1], *also]
    return run_suite(
        ADAPTER, profile="ci", cwd=folder, environment={"PYTHONPATH": path},
        shrink=bug is None, rules=rules,
    )  # fmt: skip


def test_the_tutorial_passes_every_rule_it_does_not_skip(tmp_path: Path) -> None:
    report = tutorial(tmp_path)
    assert report.status == 0, report.output[-3000:]
    assert report.summary["failed"] == report.summary["untested"] == 0
    skipped = [rule for rule in report.rules if rule.status == "skipped"]
    assert all("needs capability" in rule.message for rule in skipped)
    assert report.rule("VALUE-STAGES").status == "passed"
    assert report.rule("TIE-OUTPUT-ROLE").status == "passed"
    assert report.summary["passed"] == 40, report.summary  # the README says so


def test_forgetting_the_rope_layout_fails_value_stages_first_with_the_hint(
    tmp_path: Path,
) -> None:
    report = tutorial(
        tmp_path, ROPE_LAYOUT_FORGOTTEN, first="VALUE-STAGES", also=("VALUE-SEED-FIXTURE",)
    )
    assert report.status == 1
    assert report.failed()[0].id == "VALUE-STAGES", [rule.id for rule in report.failed()]
    assert report.rule("VALUE-SEED-FIXTURE").status == "passed"  # head width 2 cannot tell
    assert "RoPE on rotate-half pairs" in report.rule("VALUE-STAGES").message
    assert "conformance.layouts.to_rotate_half" in report.rule("VALUE-STAGES").message


def test_a_copied_head_fails_tie_output_role_first(tmp_path: Path) -> None:
    report = tutorial(
        tmp_path, HEAD_COPIED_NOT_TIED, first="TIE-OUTPUT-ROLE", also=("VALUE-LOGITS",)
    )
    assert report.status == 1
    assert report.failed()[0].id == "TIE-OUTPUT-ROLE", [rule.id for rule in report.failed()]
    assert report.rule("VALUE-LOGITS").status == "passed"
