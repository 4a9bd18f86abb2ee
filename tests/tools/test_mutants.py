"""The mutant catalogue: every mutant killed by a related rule, every correct backend passing."""

from __future__ import annotations

import importlib
import inspect

import pytest

from conformance.adapter import load_backend
from conformance.mutant_runner import run_catalogue
from conformance.mutants import MUTANTS
from spec.rules import RuleCategory, rule


def test_catalogue_is_large_and_well_described() -> None:
    assert len(MUTANTS) >= 25
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    for mutant in MUTANTS:
        module_name, class_name = mutant.adapter.split(":")
        backend_class = getattr(importlib.import_module(module_name), class_name)
        doc = inspect.getdoc(backend_class) or ""
        assert mutant.rule in doc, f"{mutant.name}: the docstring must name the rule {mutant.rule}"
        assert rule(mutant.rule).category in mutant.related, mutant.name
        assert load_backend(mutant.adapter).name == mutant.name


def test_catalogue_covers_every_kind_of_mistake() -> None:
    categories = {rule(m.rule).category for m in MUTANTS}
    assert categories >= {
        RuleCategory.CONFIGURATION, RuleCategory.INPUTS, RuleCategory.SHAPES,
        RuleCategory.PARAMETERS, RuleCategory.TYING, RuleCategory.CAUSALITY,
        RuleCategory.DEPTH, RuleCategory.VALUES, RuleCategory.LOSS,
        RuleCategory.INITIALIZATION, RuleCategory.DETERMINISM, RuleCategory.GRADIENTS,
    }  # fmt: skip
    mistakes = " ".join(m.mistake for m in MUTANTS)
    for topic in ("RoPE", "RMSNorm", "softmax", "SiLU", "sqrt(d)", "residual", "mask", "copy"):
        assert topic in mistakes, topic
    tiny = [
        m for m in MUTANTS if "1e-7" in m.mistake or "1e-6" in m.mistake or "1e-13" in m.mistake
    ]
    assert len(tiny) >= 3, "mistakes whose effect is tiny must be in the catalogue"


@pytest.mark.slow
def test_every_mutant_is_killed_by_a_related_rule_and_controls_pass() -> None:
    results = run_catalogue(workers=2)
    wrong = [
        (r.name, r.verdict, r.first_failed_rule, r.detail[:300])
        for r in results
        if not r.as_expected
    ]
    assert wrong == []
