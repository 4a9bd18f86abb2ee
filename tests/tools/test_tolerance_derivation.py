"""The error models: fitted from measurements, committed with provenance, and holding on
cases they were not fitted to."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conformance.adapter import ForwardOutput
from conformance.adapters.emulated import EmulatedFloat32
from conformance.contract import check_contract
from conformance.tools import tolerance_derivation as derivation
from spec.config import DecoderConfig
from spec.formats import Precision
from spec.tolerances import DOCUMENT, Quantity, tolerance_for, tolerance_models

# The largest configuration the suite's scenarios draw (conformance.cases.suite_configs):
# three heads of width 6, two blocks, context 5, vocabulary 7, feed-forward width 8.
LARGEST_SUITE_CONFIG = DecoderConfig(7, 18, 3, 8, 2, 5)


def test_committed_models_hold_on_cases_they_were_not_fitted_to() -> None:
    measured = derivation.measure(derivation.derivation_cases(12, 97))
    for precision, model in tolerance_models().items():
        use = derivation.held_out_use(measured, model)
        assert max(use.values()) <= 1.0, (precision, use)


def test_the_fit_recovers_a_known_growth() -> None:
    measured = derivation.Measurement()
    rng = np.random.default_rng(0)
    unit = 2.0**-24
    for _ in range(200):
        layers, width, length = int(rng.integers(0, 4)), int(rng.integers(2, 30)), 4
        case = derivation.DerivationCase(
            DecoderConfig(5, width, 1, 4, layers, length),
            0,
            "recipe",
            np.zeros((1, length), dtype=np.int64),
            np.zeros((1, length), dtype=np.int64),
        )
        error = unit * (layers + 1) * width**0.5 * float(rng.uniform(0.5, 1.0))
        measured.add(Precision.FLOAT32, case, dict.fromkeys(Quantity, error))
    fitted = derivation.fit(measured, Precision.FLOAT32)["logits"]
    assert fitted["exponents"]["depth"] == pytest.approx(1.0, abs=0.1)
    assert fitted["exponents"]["width"] == pytest.approx(0.5, abs=0.1)
    assert fitted["coefficient"] == pytest.approx(
        derivation.SAFETY * fitted["worst_ratio"], rel=0.01
    )


def test_float32_is_at_least_ten_times_tighter_than_the_old_flat_bound() -> None:
    """Issue 20: the old float32 tolerance was 1e-3 for every quantity and configuration."""
    bound = tolerance_for(Precision.FLOAT32).at(LARGEST_SUITE_CONFIG, 5)
    for quantity in Quantity:
        assert getattr(bound, str(quantity)) < 1e-4, quantity


def test_bounds_grow_with_the_configuration_and_shrink_with_the_format() -> None:
    small, large = DecoderConfig(5, 4, 1, 4, 0, 3), LARGEST_SUITE_CONFIG
    for model in tolerance_models().values():
        assert model.at(small, 3).stages <= model.at(large, 5).stages
    ordered = [tolerance_for(p).at(large, 5).logits for p in ("float64", "float32", "float16")]
    assert ordered == sorted(ordered) and tolerance_for("bfloat16").at(large, 5).logits > ordered[2]


def test_the_table_carries_its_provenance() -> None:
    made = DOCUMENT["provenance"]
    assert made["command"].startswith("decoder-conformance tolerances derive --configs ")
    assert {"written", "numpy", "python"} <= set(made)
    for entry in DOCUMENT["precisions"].values():
        assert "oracle" in entry["derivation"] and entry["safety"] == derivation.SAFETY


def test_every_scale_bound_is_credited_to_exactly_one_command() -> None:
    credited: dict[tuple[str, str], int] = {}
    for entry in DOCUMENT["provenance"]["scale"]:
        assert entry["command"].startswith("decoder-conformance tolerances derive --scale")
        for shape in entry["shapes"]:
            key = (entry["precision"], shape)
            credited[key] = credited.get(key, 0) + 1
    bounds = {
        (precision, case.removeprefix("scale:"))
        for precision, entry in DOCUMENT["precisions"].items()
        for case in entry.get("cases", {})
        if case.startswith("scale:")
    }
    assert set(credited) == bounds and set(credited.values()) == {1}


def test_a_new_scale_derivation_replaces_the_credit_for_what_it_measured() -> None:
    first = derivation.record_scale_provenance(
        [], ["float32", "bfloat16"], ["smoke", "long-context"], "derive A", "2026-01-01"
    )
    second = derivation.record_scale_provenance(
        first, ["float32"], ["long-context"], "derive B", "2026-01-02"
    )
    assert [(e["precision"], e["shapes"], e["command"]) for e in second] == [
        ("float32", ["smoke"], "derive A"),
        ("bfloat16", ["smoke", "long-context"], "derive A"),
        ("float32", ["long-context"], "derive B"),
    ]
    third = derivation.record_scale_provenance(
        second, ["float32"], ["smoke", "long-context"], "derive C", "2026-01-03"
    )
    assert [(e["precision"], e["command"]) for e in third] == [
        ("bfloat16", "derive A"),
        ("float32", "derive C"),
    ]
    assert first[0]["shapes"] == ["smoke", "long-context"]  # the earlier list is not edited
    legacy = [{"command": "derive --scale --write", "written": "2025-12-31"}]
    assert derivation.record_scale_provenance(legacy, ["float16"], ["smoke"], "D", "x") == [
        {"precision": "float16", "shapes": ["smoke"], "command": "D", "written": "x"}
    ]


def test_measuring_a_scale_shape_leaves_none_of_its_buffers_for_the_next() -> None:
    from impl.kernels import buffers

    buffers.release()
    before = buffers.cached_bytes()
    measured = derivation.calibrated_scale_cases(Precision.BFLOAT16, ["smoke"], seeds=1)
    assert set(measured) == {"scale:smoke"}
    # Left cached, they added up over seeds and shapes: 19.1 GB for two formats' scale
    # bounds in one command, against 12.7 GB handed back after each seed.
    assert buffers.cached_bytes() == before


def test_tolerances_show_prints_every_precision_and_quantity() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "tolerances", "show"],
        capture_output=True,
        text=True,
        check=True,
    )
    for precision in Precision:
        for quantity in Quantity:
            assert any(
                line.split()[:2] == [str(precision), str(quantity)]
                for line in result.stdout.splitlines()
            )
    assert "spec/derived_tolerances.json, written" in result.stdout


class _Float16Arrays(EmulatedFloat32):
    """Declares float32 and hands back float16 arrays."""

    name = "float16-arrays"

    def forward(self, model, tokens, shape=None):  # type: ignore[no-untyped-def]
        output = super().forward(model, tokens, shape)
        return ForwardOutput(
            logits=output.logits.astype(np.float16),
            stages=[(name, value.astype(np.float16)) for name, value in output.stages or []],
        )


def test_float16_arrays_declared_float32_break_the_contract() -> None:
    messages = [str(violation) for violation in check_contract(_Float16Arrays())]
    assert any(
        "has dtype float16, but the backend declares float32; return float32 or float64" in m
        for m in messages
    ), messages


def test_parameters_held_in_another_format_name_it() -> None:
    from conformance.tools.mutants.precision import Float16WorkDeclaredFloat32

    messages = [str(violation) for violation in check_contract(Float16WorkDeclaredFloat32())]
    assert any(
        "(they are the values rounded to float16: declare float16, or hold float32)" in m
        for m in messages
    ), messages


def test_fixed_cases_are_judged_at_bounds_measured_on_their_own_configuration() -> None:
    from conformance.test_values import LONG_CONFIG
    from spec.golden import GOLDEN_CASES

    for precision in ("float32", "bfloat16", "float16"):
        model = tolerance_for(precision)
        long = model.at(LONG_CONFIG, LONG_CONFIG.context, case="long-context").logits
        assert long < model.at(LONG_CONFIG, LONG_CONFIG.context).logits
        for case in GOLDEN_CASES:
            if case.variant == "large":
                continue
            tokens = len(case.tokens[0])
            fixed = model.at(case.config, tokens, case=f"golden:{case.name}")
            general = model.at(case.config, tokens)
            for quantity in Quantity:
                assert getattr(fixed, str(quantity)) <= getattr(general, str(quantity))
    # Where the model extrapolates to thousands of positions, the measured bound is what
    # catches RoPE angles computed in bfloat16 (row 1023 off by 1.4) in a bfloat16 backend.
    long_bound = tolerance_for("bfloat16").at(LONG_CONFIG, LONG_CONFIG.context, case="long-context")
    assert long_bound.logits < 1.4
    assert tolerance_for("float64").cases == {}
