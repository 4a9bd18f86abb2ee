"""The mpmath oracle: the seed's published numbers, float64 agreement, precision stability."""

from __future__ import annotations

import re
from pathlib import Path

import mpmath
import numpy as np
import pytest

from impl.model import DecoderModel
from spec.config import FIXTURE, DecoderConfig
from spec.oracle import oracle_forward, precision, relative_error, to_float64, to_mp
from spec.recipe import SplitMix64, initial_parameters

TRACE = Path(__file__).resolve().parents[2] / "golden" / "seed" / "ch32-trace.expected.txt"


def published(prefix: str) -> list[list[str]]:
    """The six-decimal value lists of every trace line that starts with ``prefix``."""
    rows = []
    for line in TRACE.read_text().splitlines():
        if line.startswith(prefix):
            match = re.search(r"values=\[([^\]]*)\]", line)
            assert match is not None
            rows.append(match.group(1).split(","))
    return rows


@pytest.fixture(scope="module")
def fixture_parameters() -> list[tuple[str, np.ndarray]]:  # type: ignore[type-arg]
    return initial_parameters(FIXTURE.config, SplitMix64(FIXTURE.seed))


def test_oracle_reproduces_published_logits_and_loss(fixture_parameters) -> None:  # type: ignore[no-untyped-def]
    run = oracle_forward(FIXTURE.config, fixture_parameters, FIXTURE.tokens, FIXTURE.targets)
    logits = to_float64(run.logits).reshape(-1, 5)
    assert [[f"{value:.6f}" for value in row] for row in logits] == published("logits ")
    stages = np.concatenate([to_float64(values).reshape(-1, 4) for _, values in run.stages])
    assert [[f"{value:.6f}" for value in row] for row in stages] == published("stage ")
    loss_line = next(line for line in TRACE.read_text().splitlines() if line.startswith("loss "))
    assert f"loss mean={float(run.loss):.6f}" == loss_line


@pytest.mark.parametrize(
    ("config", "seed", "tokens", "targets"),
    [
        (FIXTURE.config, FIXTURE.seed, FIXTURE.tokens, FIXTURE.targets),
        (
            DecoderConfig(7, 12, 3, 5, 3, 4, rope_base=77.0),
            0,
            [[6, 0, 3, 3], [1, 2, 5, 4]],
            [[0, 3, 3, 1], [2, 5, 4, 6]],
        ),
        (DecoderConfig(4, 8, 1, 16, 0, 3, rms_epsilon=0.0), 2**64 - 1, [[3, 2]], [[2, 1]]),
    ],
    ids=["seed-fixture", "depth3-rope77", "depth0-epsilon0"],
)
def test_oracle_agrees_with_float64_reference(config, seed, tokens, targets) -> None:  # type: ignore[no-untyped-def]
    model = DecoderModel.from_seed(config, seed)
    run = oracle_forward(config, model.state(), tokens, targets)
    forward = model.forward(tokens)
    for (name, exact), (_, stage) in zip(run.stages, forward.stages(), strict=True):
        assert np.max(np.abs(stage.value - to_float64(exact))) <= 1e-12, name
    assert np.max(np.abs(forward.logits.value - to_float64(run.logits))) <= 1e-12
    assert abs(float(model.loss(tokens, targets).value) - float(run.loss)) <= 1e-12


def test_oracle_is_stable_when_precision_rises(fixture_parameters) -> None:  # type: ignore[no-untyped-def]
    at_50 = oracle_forward(
        FIXTURE.config, fixture_parameters, FIXTURE.tokens, FIXTURE.targets, digits=50
    )
    at_60 = oracle_forward(
        FIXTURE.config, fixture_parameters, FIXTURE.tokens, FIXTURE.targets, digits=60
    )
    with precision(70):
        logits_gap = max(
            abs(a - b) for a, b in zip(at_50.logits.ravel(), at_60.logits.ravel(), strict=True)
        )
        loss_gap = abs(at_50.loss - at_60.loss)
    assert logits_gap < mpmath.mpf("1e-40")
    assert loss_gap < mpmath.mpf("1e-40")


def test_conversions_are_exact_and_correctly_rounded() -> None:
    values = np.array([0.1, -2.5e-300, 1e300, 0.0, 2.0**-1074])
    assert to_float64(to_mp(values)).tobytes() == values.tobytes()
    with precision(40):
        third = to_mp(np.ones(1)) / 3
        assert to_float64(third)[0] == 1.0 / 3.0
        assert relative_error(np.array([1.0 / 3.0]), third)[0] <= 2.0**-53


def test_precision_restores_and_refuses_too_few_digits() -> None:
    before = mpmath.mp.dps
    with precision(80):
        assert mpmath.mp.dps == 80
    assert mpmath.mp.dps == before
    with pytest.raises(ValueError, match="digits=10 is below float64's 16"), precision(10):
        pass
