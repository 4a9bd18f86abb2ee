"""The report and trace: byte for byte against the seed's published outputs, and live.

The second half breaks the reference on purpose (monkeypatching one operation) and
checks that the matching evidence line turns false: the lines are measurements.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conformance.cli import main
from impl import ops
from impl.evidence import collect_evidence, run_fixture
from impl.tape import Tensor
from spec.config import FIXTURE
from spec.trace import render_report, render_trace

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "golden" / "seed"
SHARED = ROOT.parent / "shared" / "reference"
FILES = ("ch32-report.expected.txt", "ch32-trace.expected.txt")


def run_cli(capsys: pytest.CaptureFixture[str], *arguments: str) -> tuple[int, str, str]:
    status = main(list(arguments))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_report_equals_published_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    status, output, _ = run_cli(capsys, "report")
    assert status == 0
    assert output.encode() == (GOLDEN / FILES[0]).read_bytes()


def test_trace_equals_published_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    status, output, _ = run_cli(capsys, "trace")
    assert status == 0
    assert output.encode() == (GOLDEN / FILES[1]).read_bytes()
    assert len(output.splitlines()) == 28


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared/reference is not beside this checkout")
@pytest.mark.parametrize("name", FILES)
def test_golden_copies_equal_the_shared_reference(name: str) -> None:
    assert (GOLDEN / name).read_bytes() == (SHARED / name).read_bytes()


def test_json_trace_round_trips_every_float(capsys: pytest.CaptureFixture[str]) -> None:
    status, output, _ = run_cli(capsys, "trace", "--format", "json")
    assert status == 0
    document = json.loads(output)
    run = run_fixture(FIXTURE)
    assert document["loss"] == run.loss
    assert np.array(document["logits"]).tobytes() == run.logits.ravel().tobytes()
    for stage, (name, values) in zip(document["stages"], run.stages, strict=True):
        assert stage["name"] == name and stage["shape"] == list(values.shape)
        assert np.array(stage["values"]).tobytes() == values.ravel().tobytes()
    assert document["parameter_names"] == run.parameter_names
    assert document["parameter_count"] == 264
    for name, gradient in run.gradients.items():
        assert gradient is not None
        assert np.array(document["gradients"][name]).tobytes() == gradient.ravel().tobytes()
    assert set(document) >= {"config", "tokens", "targets", "stages", "logits", "loss", "gradients"}


def test_trace_accepts_any_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    status, output, _ = run_cli(
        capsys, "trace", "--vocab", "7", "--width", "8", "--heads", "4", "--ffn", "3",
        "--layers", "3", "--context", "5", "--rope-base", "500", "--epsilon", "1e-5",
        "--seed", "18446744073709551615", "--tokens", "0,1,2;6,5,4", "--targets", "1,2,3;5,4,3",
    )  # fmt: skip
    assert status == 0, output
    lines = output.splitlines()
    assert lines[1].startswith(
        "config batch=2 tokens=3 vocabulary=7 model_width=8 layers=3 heads=4"
    )
    assert "rope_base=500.0 rms_epsilon=1e-05 seed=18446744073709551615" in lines[1]
    assert "stage name=block-2 shape=[2,3,8] batch=1 token=2 values=" in output
    assert "parameters tensors=29 " in output
    assert "causality prefix_0_bitwise=true prefix_1_bitwise=true suffix_changed=true" in output
    assert "passed=true stack_gradients=29/29" in output
    assert lines[-1] == "END_DECODER_MODEL_TRACE"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["trace", "--heads", "3"], "decoder model width 4 must be divisible by head count 3"),
        (["trace", "--heads", "two"], "argument --heads: 'two' is not an integer"),
        (["trace", "--layers", "-1"], "argument --layers: '-1' is negative"),
        (["trace", "--tokens", "0,1"], "--targets is required with --tokens"),
        (
            ["trace", "--tokens", "0,x", "--targets", "1,2"],
            "--tokens: row 0 has 'x', which is not an integer",
        ),
        (
            ["trace", "--tokens", "0,1;2", "--targets", "1,2;3"],
            "every row needs the same number of IDs",
        ),
        (
            ["trace", "--tokens", "0,1,2,3,4", "--targets", "1,1,1,1,1"],
            "exceeds context capacity 4",
        ),
        (["trace", "--targets", "1,2"], "decoder loss needs 3 targets"),
        (["trace", "--seed", str(2**64)], "--seed must be at most 2**64-1"),
        (["trace", "--format", "xml"], "argument --format: invalid choice"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_options_give_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    status, output, error = run_cli(capsys, *arguments)
    assert status == 2
    assert output == ""
    assert error.count("\n") == 1 and "Traceback" not in error
    assert error.startswith("decoder-conformance")
    assert message in error


def _non_causal_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Softmax attention without its causal mask (forward only: the trace needs no backward)."""
    scores = query.value @ np.swapaxes(key.value, -1, -2) / np.sqrt(query.shape[-1])
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return Tensor(weights @ value.value)


def test_causality_line_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "causal_attention", _non_causal_attention)
    trace = render_trace(collect_evidence(FIXTURE))
    assert "causality prefix_0_bitwise=false prefix_1_bitwise=false suffix_changed=true" in trace


def test_gradcheck_and_decomposition_lines_are_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transpose whose backward drops its gradient: the head role vanishes from the table."""
    original = ops.transpose

    def transpose_without_gradient(a: Tensor, axis1: int, axis2: int) -> Tensor:
        result = original(a, axis1, axis2)
        if a.shape == (5, 4):
            return result.detach()
        return result

    monkeypatch.setattr(ops, "transpose", transpose_without_gradient)
    report = render_report(collect_evidence(FIXTURE))
    assert "gradcheck=tied_table:20 final_norm:4 total:24 tolerance:0.000020 passed:false" in report


def test_target_error_line_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    from impl import model as model_module

    monkeypatch.setattr(
        model_module.DecoderModel,
        "validate_targets",
        lambda self, t, b, n: np.zeros(b * n, dtype=np.intp),
    )
    report = render_report(collect_evidence(FIXTURE))
    assert "target_errors:false" in report
