"""The reference against an independent plain float64 computation, to 1e-12.

Configurations span depth 0 to 3, one to four heads, head widths 2 to 8, batches larger
than one and sequences shorter than (and equal to) the context. Gradients of every
parameter scalar come from the complex-step method in ``tests/plain_decoder.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from impl.model import DecoderModel
from spec.config import FIXTURE, DecoderConfig
from tests.helpers import max_symmetric_error
from tests.impl.plain_decoder import complex_step_gradients, plain_forward

# Both sides compute in float64 with differently ordered sums; measured differences are
# ~1e-15. 1e-12 is the bound and leaves a margin for deeper configurations.
AGREEMENT = 1e-12

CASES = [
    pytest.param(FIXTURE.config, FIXTURE.seed, [[0, 1, 2]], [[1, 2, 3]], id="seed-fixture"),
    pytest.param(
        DecoderConfig(6, 8, 1, 6, 0, 5, rms_epsilon=1e-5),
        0,
        [[0, 5, 3], [2, 2, 1]],
        [[1, 1, 0], [5, 4, 3]],
        id="depth0-one-head-hw8-batch2",
    ),
    pytest.param(
        DecoderConfig(7, 8, 4, 12, 1, 6),
        7,
        [[1, 6, 2, 0], [3, 3, 4, 5], [0, 1, 2, 3]],
        [[6, 2, 0, 1], [3, 4, 5, 6], [1, 2, 3, 4]],
        id="depth1-four-heads-hw2-batch3",
    ),
    pytest.param(
        DecoderConfig(5, 12, 2, 8, 2, 5, rope_base=500.0),
        2**64 - 1,
        [[4, 3, 2, 1, 0], [0, 0, 1, 1, 2]],
        [[3, 2, 1, 0, 4], [0, 1, 1, 2, 2]],
        id="depth2-hw6-full-context",
    ),
    pytest.param(
        DecoderConfig(9, 12, 3, 16, 3, 8),
        123,
        [[8, 0, 4, 4, 1, 7], [2, 5, 6, 3, 0, 1]],
        [[0, 4, 4, 1, 7, 2], [5, 6, 3, 0, 1, 8]],
        id="depth3-three-heads-hw4-ffn-wider",
    ),
    pytest.param(
        DecoderConfig(5, 16, 2, 6, 1, 7, rope_base=10.0, rms_epsilon=0.0),
        99,
        [[1, 2, 3, 4]],
        [[2, 3, 4, 0]],
        id="depth1-hw8-ffn-narrower-epsilon0",
    ),
]


@pytest.mark.parametrize(("config", "seed", "tokens", "targets"), CASES)
def test_reference_matches_plain_computation(
    config: DecoderConfig, seed: int, tokens: list[list[int]], targets: list[list[int]]
) -> None:
    model = DecoderModel.from_seed(config, seed)
    token_ids = np.asarray(tokens, dtype=np.intp)
    target_ids = np.asarray(targets, dtype=np.intp)
    weights = dict(model.state())
    plain = plain_forward(config, weights, token_ids, target_ids)

    forward = model.forward(tokens)
    for (name, stage), expected in zip(forward.stages(), plain.stages, strict=True):
        error = max_symmetric_error(stage.value, np.real(expected))
        assert error <= AGREEMENT, f"stage {name}: scaled error {error:.2e}, but should be <= 1e-12"
    error = max_symmetric_error(forward.logits.value, np.real(plain.logits))
    assert error <= AGREEMENT, f"logits: scaled error {error:.2e}, but should be <= 1e-12"

    loss = model.loss(tokens, targets)
    error = max_symmetric_error(np.asarray(loss.value), np.asarray(np.real(plain.loss)))
    assert error <= AGREEMENT, f"loss: scaled error {error:.2e}, but should be <= 1e-12"

    loss.backward()
    expected_gradients = complex_step_gradients(config, weights, token_ids, target_ids)
    for name, gradient in model.gradients().items():
        assert gradient is not None, f"{name} received no gradient"
        error = max_symmetric_error(gradient, expected_gradients[name])
        assert error <= AGREEMENT, (
            f"gradient of {name}: scaled error {error:.2e}, but should be <= 1e-12"
        )
