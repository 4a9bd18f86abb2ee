"""The emulated precisions: the reference's arithmetic rounded to a format."""

from __future__ import annotations

import numpy as np
import pytest

from impl.emulation import EmulatedModel
from impl.errors import DecoderModelError
from impl.model import DecoderModel
from spec.config import DecoderConfig
from spec.formats import round_to
from spec.variants import scenario_parameters

CONFIG = DecoderConfig(9, 8, 2, 6, 2, 5)
TOKENS = np.array([[1, 4, 0, 8, 2], [3, 3, 7, 5, 6]])
TARGETS = np.array([[4, 0, 8, 2, 1], [3, 7, 5, 6, 0]])


def _models(precision: str) -> tuple[DecoderModel, EmulatedModel]:
    reference = DecoderModel.from_parameters(CONFIG, scenario_parameters(CONFIG, 3, "varied"))
    return reference, EmulatedModel(reference, precision)


def test_float64_emulation_agrees_with_the_reference() -> None:
    reference, emulated = _models("float64")
    expected = reference.forward(TOKENS).logits.value
    np.testing.assert_allclose(emulated.forward(TOKENS).logits.value, expected, rtol=1e-13)
    loss = reference.loss(TOKENS, TARGETS)
    loss.backward()
    got, gradients = emulated.loss_and_gradients(TOKENS, TARGETS)
    assert abs(got - float(loss.value)) < 1e-14
    for parameter in reference.parameters():
        assert parameter.tensor.grad is not None
        np.testing.assert_allclose(gradients[parameter.name], parameter.tensor.grad, atol=1e-14)


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float16"])
def test_every_output_is_held_in_the_format(precision: str) -> None:
    reference, emulated = _models(precision)
    result = emulated.forward(TOKENS)
    for _, stage in [*result.stages, ("logits", result.logits)]:
        assert np.array_equal(stage.value, round_to(stage.value, precision))
    loss, gradients = emulated.loss_and_gradients(TOKENS, TARGETS)
    assert loss == float(round_to(np.array(loss), precision))
    for value in gradients.values():
        assert np.array_equal(value, round_to(value, precision))
    exact = reference.forward(TOKENS).logits.value
    error = np.max(np.abs(result.logits.value - exact))
    assert 0 < error < 0.5  # rounded, but still the same model


def test_refusals_are_the_references() -> None:
    _, emulated = _models("bfloat16")
    with pytest.raises(DecoderModelError) as refused:
        emulated.forward(np.array([[1, 9]]))
    assert refused.value.kind == "token-id-out-of-bounds"
    with pytest.raises(DecoderModelError) as refused:
        emulated.loss_and_gradients(TOKENS, TARGETS[:, :2])
    assert refused.value.kind == "target-count-mismatch"


def test_float16_norms_rows_whose_squares_overflow_the_format() -> None:
    """The ``loud`` variant's residual rows have RMS in the hundreds: every square of an entry
    past 256 is past float16's largest number, yet a port that squares in float32 (as the
    emulation does) is as close to the reference there as anywhere."""
    config = DecoderConfig(6, 8, 2, 8, 2, 5)  # VALUE-LOGITS's loud case
    reference = DecoderModel.from_parameters(config, scenario_parameters(config, 3, "loud"))
    table = reference.parameters()[0].tensor.value
    assert np.sqrt(np.mean(table**2, axis=1)).min() > 256
    tokens = TOKENS % config.vocabulary_size
    got = EmulatedModel(reference, "float16").forward(tokens).logits.value
    exact = reference.forward(tokens).logits.value
    assert np.all(np.isfinite(got))
    assert np.max(np.abs(got - exact)) < 0.05 * np.max(np.abs(exact))
