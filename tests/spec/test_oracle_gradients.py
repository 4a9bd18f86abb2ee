"""Oracle gradients: the adjoint certified by central differences; the reference against it."""

from __future__ import annotations

import numpy as np
import pytest

from impl.model import DecoderModel
from spec.config import FIXTURE, DecoderConfig
from spec.oracle_gradients import oracle_gradients
from spec.recipe import initial_parameters
from spec.tolerances import Precision, scaled_error, tolerance_for

FLOAT64 = tolerance_for(Precision.FLOAT64)

# (config, seed, tokens, targets): the fixture and five more, depth 0 to 3.
CASES = [
    (FIXTURE.config, FIXTURE.seed, [[0, 1, 2]], [[1, 2, 3]]),
    (
        DecoderConfig(6, 8, 1, 6, 0, 5, rms_epsilon=1e-5),
        0,
        [[0, 5, 3], [2, 2, 1]],
        [[1, 1, 0], [5, 4, 3]],
    ),
    (
        DecoderConfig(7, 8, 4, 12, 1, 6),
        7,
        [[1, 6, 2, 0], [3, 3, 4, 5]],
        [[6, 2, 0, 1], [3, 4, 5, 6]],
    ),
    (
        DecoderConfig(5, 12, 2, 8, 2, 5, rope_base=500.0),
        2**64 - 1,
        [[4, 3, 2, 1, 0]],
        [[3, 2, 1, 0, 4]],
    ),
    (
        DecoderConfig(9, 12, 3, 16, 3, 4),
        123,
        [[8, 0, 4, 4], [2, 5, 6, 3]],
        [[0, 4, 4, 1], [5, 6, 3, 0]],
    ),
    (
        DecoderConfig(5, 16, 2, 6, 1, 7, rope_base=10.0, rms_epsilon=0.0),
        99,
        [[1, 2, 3, 4]],
        [[2, 3, 4, 0]],
    ),
]


@pytest.mark.parametrize(
    ("config", "seed", "tokens", "targets"), CASES, ids=[f"case{i}" for i in range(len(CASES))]
)
def test_reference_gradients_agree_with_the_oracle_on_every_scalar(
    config, seed, tokens, targets
) -> None:  # type: ignore[no-untyped-def]
    parameters = initial_parameters(config, seed)
    exact = oracle_gradients(config, parameters, tokens, targets)
    assert exact.max_error_estimate() < 1e-40
    model = DecoderModel.from_parameters(config, parameters)
    model.loss(tokens, targets).backward()
    scalars = 0
    for name, gradient in model.gradients().items():
        assert gradient is not None
        error = float(np.max(scaled_error(gradient, exact.gradients[name])))
        bound = FLOAT64.at(config, np.asarray(tokens).shape[1]).gradients
        assert error <= bound, f"{name}: scaled error {error:.2e} over {bound:.3g}"
        scalars += gradient.size
    if config == FIXTURE.config:
        assert scalars == 264


def test_adjoint_is_certified_by_central_differences_on_every_scalar() -> None:
    """Two methods that share no code agree on every scalar of a two-block model."""
    config = DecoderConfig(3, 4, 2, 3, 2, 3, rope_base=50.0)
    parameters = initial_parameters(config, 5)
    tokens, targets = [[2, 0, 1]], [[0, 1, 2]]
    adjoint = oracle_gradients(config, parameters, tokens, targets)
    central = oracle_gradients(config, parameters, tokens, targets, method="central", digits=40)
    assert central.max_error_estimate() < 1e-20
    for name, value in adjoint.gradients.items():
        assert np.max(np.abs(value - central.gradients[name])) <= 1e-20, name


def test_adjoint_matches_central_differences_on_a_sample_of_the_fixture() -> None:
    parameters = initial_parameters(FIXTURE.config, FIXTURE.seed)
    adjoint = oracle_gradients(FIXTURE.config, parameters, FIXTURE.tokens, FIXTURE.targets)
    central = oracle_gradients(
        FIXTURE.config,
        parameters,
        FIXTURE.tokens,
        FIXTURE.targets,
        method="central",
        digits=40,
        max_per_tensor=2,
    )
    for name, value in adjoint.gradients.items():
        sampled = ~np.isnan(central.gradients[name])
        assert sampled.sum() == min(2, value.size)
        assert np.max(np.abs(value[sampled] - central.gradients[name][sampled])) <= 1e-20, name
