"""The scale profile: its selection, its bounds, and that its rules catch precision bugs.

Run at the ``smoke`` shape (seconds); the shapes of real size are the maintainers' run
(README, 'Scale').
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.profiles import runs_rule
from conformance.runner import run_suite
from conformance.scale import runs_at
from spec.formats import Precision
from spec.rules import RULES, RuleCategory, rules_in
from spec.scale import DEFAULT_SCALE_SHAPES, SCALE_SHAPES, scale_shape
from spec.tolerances import (
    FLOAT64_SCALE_FACTOR,
    MissingScaleBound,
    Quantity,
    reference_bound,
    scale_tolerance,
    tolerance_for,
)

HERE = Path(__file__).resolve().parent
MUTANTS = HERE / "scale_mutants.py"
SCALE_RULES = [rule.id for rule in rules_in(RuleCategory.SCALE)]


def _statuses(adapter: str, *shapes: str) -> dict[str, str]:
    """Every rule of the scale profile's report (its rules and the adapter contract only)."""
    report = run_suite(adapter, profile="scale", scale_shapes=shapes or ("smoke",))
    assert report.error == "", report.output[-2000:]
    statuses = {rule.id: rule.status for rule in report.rules}
    assert set(statuses) == {"ADAPTER-CONTRACT", *SCALE_RULES}
    assert report.identity is not None and report.identity.scale_shapes == list(shapes or ["smoke"])
    return statuses


def test_the_scale_profile_runs_the_scale_rules_and_nothing_else() -> None:
    for rule in RULES:
        at_scale = rule.category is RuleCategory.SCALE
        assert runs_rule("scale", rule.id) == (at_scale or rule.id == "ADAPTER-CONTRACT")
        assert runs_rule("ci", rule.id) == (not at_scale)


def test_the_reference_passes_every_scale_rule_at_the_smoke_shape() -> None:
    statuses = _statuses("reference")
    assert statuses == {"ADAPTER-CONTRACT": "passed", **dict.fromkeys(SCALE_RULES, "passed")}


def test_torch_float32_passes_and_a_float16_rope_table_fails_scale_stages() -> None:
    pytest.importorskip("torch")
    assert set(_statuses("torch-float32").values()) == {"passed"}
    broken = _statuses(f"{MUTANTS}:RopeTablesInFloat16")
    assert broken["SCALE-STAGES"] == "failed"
    assert broken["SCALE-CAUSALITY"] == broken["SCALE-TYING"] == "passed"  # only values move


def test_a_float16_softmax_fails_scale_stages() -> None:
    pytest.importorskip("torch")
    assert _statuses(f"{MUTANTS}:SoftmaxInFloat16")["SCALE-STAGES"] == "failed"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mutant", "needs", "shape", "failing"),
    [
        # RoPE on at most 64 features of a head: only wide-heads' heads of 128 are wider.
        ("RopeRotatesAtMostSixtyFourFeatures", "torch", "wide-heads", "SCALE-STAGES"),
        # torch's float16 cross_entropy sums 128,256 exponentials past 65,504: the loss is inf.
        ("LossInFloat16", "torch", "wide-vocabulary", "SCALE-LOGITS"),
        # rsqrt's backward in float16 overflows for rows of RMS below 0.025 (about 2 minutes).
        ("RmsNormInFloat16", "torch", "smollm2-135m", "SCALE-GRADIENTS"),
        # RoPE frequencies rounded to bfloat16: angles off by radians late in 8,192 positions.
        ("hf_llama_frequencies_in_bfloat16", "transformers", "long-context", "SCALE-STAGES"),
    ],
)
def test_16_bit_bugs_only_a_real_shape_reaches_fail_there(
    mutant: str, needs: str, shape: str, failing: str
) -> None:
    """The shipped torch-float16 and hf-llama-bfloat16 adapters had these bugs and passed
    every rule of the ci profile."""
    pytest.importorskip(needs)
    statuses = _statuses(f"{MUTANTS}:{mutant}", shape)
    assert statuses[failing] == "failed"
    assert statuses["SCALE-CAUSALITY"] == statuses["SCALE-TYING"] == "passed"


@pytest.mark.parametrize(
    "mutant",
    ["RopeTablesInBfloat16", "SoftmaxAccumulatedInFloat16", "Float32AccumulationInFloat64"],
)
def test_the_catalogues_precision_bugs_fail_scale_stages(mutant: str) -> None:
    """Float32 bugs against a float32 bound measured at the shape, and float32 products in a
    float64 backend against twice the reference's own extrapolated bound."""
    statuses = _statuses(f"conformance.tools.mutants.precision:{mutant}")
    assert statuses["SCALE-STAGES"] == "failed"
    assert statuses["SCALE-CAUSALITY"] == "passed"


def test_an_unknown_shape_is_a_usage_error_naming_the_known_ones() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "run", "--profile", "scale",
         "--scale-shape", "gpt-5"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--scale-shape gpt-5: no such shape" in result.stderr
    assert "smollm2-135m" in result.stderr
    assert "Traceback" not in result.stderr


def test_pytest_itself_refuses_an_unknown_shape() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs",
         "conformance.test_scale", "--conformance-profile", "scale", "--scale-shape", "gpt-5"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout[-2000:]
    assert "no such shape" in result.stderr


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--scale-shape", "smoke"], "--scale-shape goes with --profile scale"),
        (["--profile", "scale", "-n", "2"], "runs on one process"),
        (["--rule", "SCALE-*"], "run only at --profile scale"),
        (["--profile", "scale", "--rule", "VALUE-LOGITS"], "at every profile but scale"),
    ],
)
def test_scale_options_out_of_place_are_refused(arguments: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "run", *arguments],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_the_shapes_are_the_models_they_name() -> None:
    smol = scale_shape("smollm2-135m").config
    assert (smol.vocabulary_size, smol.model_width, smol.heads, smol.feed_forward_width) == (
        49152, 576, 9, 1536,
    )  # fmt: skip
    assert (smol.layers, smol.head_width, smol.rope_base) == (30, 64, 100000.0)
    assert scale_shape("long-context").positions == 8192
    assert scale_shape("wide-vocabulary").config.vocabulary_size == 128256
    assert set(DEFAULT_SCALE_SHAPES) <= set(SCALE_SHAPES)
    with pytest.raises(KeyError, match="smollm2-135m"):
        scale_shape("nope")


def test_a_shape_is_a_function_of_its_fields() -> None:
    shape = scale_shape("smoke")
    first, second = shape.tokens_and_targets(), shape.tokens_and_targets()
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
    assert first[0].shape == (shape.batch, shape.positions)
    other = dataclasses.replace(shape, seed=shape.seed + 1).tokens_and_targets()
    assert not np.array_equal(first[0], other[0])


def test_every_shape_has_a_measured_bound_at_every_narrow_precision() -> None:
    for name in SCALE_SHAPES:
        float32, float16, bfloat16 = (
            scale_tolerance(precision, name)
            for precision in (Precision.FLOAT32, Precision.FLOAT16, Precision.BFLOAT16)
        )
        # Measured, not assumed: the formats' unit roundoffs order the bounds.
        assert 0 < float32.stages < float16.stages < bfloat16.stages, name
        assert 0 < float32.logits < float16.logits < bfloat16.logits, name
        assert float32.stages < 1e-2 and float32.logits < 1e-3, name


def test_a_float64_backend_gets_twice_the_references_extrapolated_bound() -> None:
    shape = scale_shape("smollm2-135m")
    own = reference_bound(shape.config, shape.positions)
    bound = scale_tolerance(Precision.FLOAT64, shape.name)
    assert bound.stages == FLOAT64_SCALE_FACTOR * own[Quantity.STAGES]
    assert bound.gradients == FLOAT64_SCALE_FACTOR * own[Quantity.GRADIENTS]
    # The reference is an oracle for float32 there only if its own error is far below.
    float32 = scale_tolerance(Precision.FLOAT32, shape.name)
    assert own[Quantity.LOGITS] < 1e-3 * float32.logits


def test_a_missing_bound_says_how_to_measure_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from spec import tolerances

    model = tolerance_for(Precision.BFLOAT16)
    cases = {name: bounds for name, bounds in model.cases.items() if name != "scale:smoke"}
    replaced = dataclasses.replace(model, cases=cases)
    monkeypatch.setitem(tolerances._MODELS, Precision.BFLOAT16, replaced)
    with pytest.raises(MissingScaleBound, match="--scale-shape smoke --precision bfloat16"):
        scale_tolerance(Precision.BFLOAT16, "smoke")


def test_the_shapes_reference_run_is_the_reference_model() -> None:
    from impl.model import DecoderModel
    from spec.variants import scenario_parameters

    shape = scale_shape("smoke")
    tokens, targets = shape.tokens_and_targets()
    run = runs_at("smoke", object()).reference()  # type: ignore[arg-type]
    model = DecoderModel.from_parameters(
        shape.config, scenario_parameters(shape.config, shape.seed, shape.variant)
    )
    assert np.array_equal(run.logits, model.forward(tokens).logits.value)
    assert run.loss == float(model.loss(tokens, targets).value)
    assert [name for name, _ in run.stages] == [name for name, _ in model.forward(tokens).stages()]
    assert len(run.gradients) == 2 + 9 * shape.config.layers


def test_a_dropped_model_is_let_go_and_built_again_from_the_same_parameters() -> None:
    """SCALE-TYING builds its changed model after dropping the shape's own: the suite keeps no
    reference to the first, and a rule that runs later (in a random order) gets it rebuilt."""
    import gc
    import weakref

    from conformance.adapters.reference import ReferenceBackend

    class CountingBackend(ReferenceBackend):
        def __init__(self) -> None:
            super().__init__()
            self.built: list[list[tuple[str, np.ndarray]]] = []

        def build(self, config, parameters):  # type: ignore[no-untyped-def]
            self.built.append([(name, np.array(value)) for name, value in parameters])
            return super().build(config, parameters)

    backend = CountingBackend()
    runs = runs_at("smoke", backend)
    first = runs.model()
    forward = runs.forward()
    gone = weakref.ref(first)
    del first
    runs.drop_model()
    gc.collect()
    assert gone() is None
    again = runs.forward()
    assert again is forward  # the answers taken are kept, not recomputed
    rebuilt = runs.model()
    assert len(backend.built) == 2
    for (name, value), (same, rebuilt_value) in zip(*backend.built, strict=True):
        assert name == same and np.array_equal(value, rebuilt_value)
    assert np.array_equal(backend.forward(rebuilt, runs.tokens).logits, forward.logits)


def test_tolerances_show_prints_the_growth_fit_and_the_scale_bounds() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "tolerances", "show"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    growth, _, bounds = result.stdout.partition("scale shapes (spec/scale.py)")
    assert "extrapolated to the scale shapes" in growth
    for name in SCALE_SHAPES:
        assert f"  {name}: stages" in growth
        assert f"  {name} (V=" in bounds
    float32 = scale_tolerance(Precision.FLOAT32, "smollm2-135m")
    assert f"float32   stages {float32.stages:.3g}" in bounds
    assert "headroom" in bounds


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--precision", "float32"], "go with --scale"),
        (["--scale", "--configs", "10"], "do not go with them"),
        (["--scale", "--scale-shape", "nope"], "no such shape"),
    ],
)
def test_derive_refuses_scale_options_out_of_place(arguments: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "tolerances", "derive", *arguments],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
