"""GRAD-ORACLE names the first wrong gradient of a backend whose backward pass is wrong."""

from __future__ import annotations

import re

import pytest

from conformance.runner import run_suite


@pytest.mark.parametrize(
    ("backend", "first_wrong"),
    [
        (
            "conformance.tools.mutants.structure:HiddenCopiedHead",
            "gradient of token_embedding.weight[",
        ),
        (
            "conformance.tools.mutants.training:RmsBackwardWithoutMeanTerm",
            "gradient of token_embedding.weight[",
        ),
    ],
    ids=["table-without-output-role", "rmsnorm-without-mean-term"],
)
def test_wrong_gradients_are_caught_by_the_oracle_rule(backend: str, first_wrong: str) -> None:
    report = run_suite(backend, profile="ci", pytest_args=["-k", "gradients_match_the_oracle"])
    assert report.status == 1, report.output[-2000:]
    rule = report.rule("GRAD-ORACLE")
    assert rule.status == "failed"
    assert f"[GRAD-ORACLE] {first_wrong}" in rule.message
    assert "but should be" in rule.message
    assert re.search(r"within \d(\.\d+)?e-1[0-9]", rule.message), "a float64 gradient bound"
