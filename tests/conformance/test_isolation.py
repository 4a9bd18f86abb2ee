"""DET-ISOLATION: its models, its bound, and what it tells a port that keeps state per process."""

from __future__ import annotations

import dataclasses
import itertools

from conformance.conditioning import fixed_case_logits_bound
from conformance.runner import run_suite
from conformance.test_determinism import ISOLATION_MODELS, ISOLATION_TOKENS
from spec.formats import Precision, number_format
from spec.golden import GOLDEN_CASES
from spec.scale import SCALE_SHAPES
from spec.tolerances import tolerance_for


def test_each_model_differs_from_the_one_before_in_one_thing_of_the_same_shapes() -> None:
    for (_, before, seed_before), (what, after, seed_after) in itertools.pairwise(ISOLATION_MODELS):
        changed = {
            field.name
            for field in dataclasses.fields(before)
            if getattr(before, field.name) != getattr(after, field.name)
        }
        assert len(changed) + (seed_before != seed_after) == 1, what
        assert changed <= {"rope_base", "rms_epsilon"}, what


def test_no_other_rules_model_has_the_isolation_head_width() -> None:
    width = ISOLATION_MODELS[0][1].head_width
    assert width > 8  # generated heads are at most 8 wide (spec.strategies.configs)
    assert all(case.config.head_width != width for case in GOLDEN_CASES)
    assert all(shape.config.head_width != width for shape in SCALE_SHAPES.values())


def test_the_bound_is_the_tighter_of_the_models_and_the_measured_one() -> None:
    _, config, seed = ISOLATION_MODELS[0]
    for precision in (Precision.FLOAT32, Precision.BFLOAT16, Precision.FLOAT16):
        model = tolerance_for(precision)
        bound = fixed_case_logits_bound(model, config, seed, "recipe", ISOLATION_TOKENS)
        general = model.at(config, ISOLATION_TOKENS.shape[1]).logits
        assert 24 * number_format(precision).unit_roundoff <= bound <= general
    float64 = tolerance_for(Precision.FLOAT64)
    assert (
        fixed_case_logits_bound(float64, config, seed, "recipe", ISOLATION_TOKENS)
        == float64.at(config, 5).logits
    )


def test_tables_kept_per_head_width_are_named_as_the_previous_models() -> None:
    report = run_suite(
        "conformance.tools.mutants.history:RopeTablesKeptPerHeadWidth",
        profile="ci",
        rules=["DET-ISOLATION"],
    )
    rule = report.rule("DET-ISOLATION")
    assert rule.status == "failed"
    assert rule.message.startswith("[DET-ISOLATION] logits of model 2 (RoPE base 100)")
    assert "these are the logits of the model before it (RoPE base 10000)" in rule.message
    assert "for config, seed in models:" in rule.message  # the models, in the rule's order
