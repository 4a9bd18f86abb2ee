"""llama.cpp through its protocol server: layout, stages, refusals, and an abort survived.

The whole suite runs against it in CI (``decoder-conformance run --adapter llama-cpp``);
these are the quick checks of the adapter's own parts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conformance.adapter import Refusal
from conformance.adapters.reference import ReferenceBackend
from spec.config import FIXTURE, DecoderConfig
from spec.errors import ErrorKind
from spec.published import PUBLISHED_LOGITS
from spec.recipe import initial_parameters

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from conformance.adapters.llama_cpp import LlamaCppBackend
from conformance.adapters.llama_cpp_server import LlamaCppEngine

# Square matrices (width = feed-forward width) load whether or not they are transposed, so
# only the values show a layout error; three heads of width 2 and two blocks exercise RoPE.
SQUARE = DecoderConfig(7, 6, 3, 6, 2, 5)


@pytest.fixture(scope="module")
def engine() -> LlamaCppEngine:
    return LlamaCppEngine()


def test_seed_logits_within_float32_of_the_published_digits(engine: LlamaCppEngine) -> None:
    model = engine.build(FIXTURE.config, initial_parameters(FIXTURE.config, FIXTURE.seed))
    logits = engine.forward(model, FIXTURE.tokens).logits[0]
    published = np.array(PUBLISHED_LOGITS, dtype=np.float64)
    assert np.max(np.abs(logits - published)) <= 0.5e-6 + 2e-6


def test_stages_and_logits_follow_the_reference(engine: LlamaCppEngine) -> None:
    parameters = initial_parameters(SQUARE, 3)
    tokens = np.array([[1, 4, 6, 0, 2], [3, 3, 5, 1, 0]])
    got = engine.forward(engine.build(SQUARE, parameters), tokens)
    reference = ReferenceBackend()
    expected = reference.forward(reference.build(SQUARE, parameters), tokens)
    assert [name for name, _ in got.stages or []] == [name for name, _ in expected.stages or []]
    for (name, value), (_, exact) in zip(got.stages or [], expected.stages or [], strict=True):
        assert np.max(np.abs(value - exact)) < 1e-5, name
    assert np.max(np.abs(got.logits - expected.logits)) < 1e-5


def test_an_invalid_token_is_refused_at_the_position_llama_cpp_names(
    engine: LlamaCppEngine,
) -> None:
    model = engine.build(SQUARE, initial_parameters(SQUARE, 3))
    with pytest.raises(Refusal) as refused:
        engine.forward(model, np.array([[1, 2], [3, 2**40]]))
    assert refused.value.kind is ErrorKind.TOKEN_ID_OUT_OF_BOUNDS
    assert refused.value.details == {"position": 3, "id": 2**40}


def test_the_loss_is_the_mean_nll_of_llama_cpp_logits(engine: LlamaCppEngine) -> None:
    model = engine.build(SQUARE, initial_parameters(SQUARE, 3))
    tokens, targets = np.array([[1, 4, 6]]), np.array([[4, 6, 0]])
    logits = engine.forward(model, tokens).logits.reshape(-1, SQUARE.vocabulary_size)
    log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    expected = -np.mean(log_softmax[np.arange(3), targets.reshape(-1)])
    assert engine.loss(model, tokens, targets).loss == pytest.approx(expected, abs=1e-12)


def test_an_abort_costs_one_call_and_the_next_gets_a_fresh_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """... and leaves no model file behind: llama.cpp aborts while loading it."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the server's temporary files go here
    backend = LlamaCppBackend()
    try:
        with pytest.raises(Exception, match=r"SIGABRT[\s\S]*n_layer_all > 0"):
            depth0 = DecoderConfig(5, 4, 2, 4, 0, 4)
            backend.build(depth0, initial_parameters(depth0, 1))
        backend.begin_test()  # as the suite does between tests
        model = backend.build(SQUARE, initial_parameters(SQUARE, 3))
        assert backend.forward(model, np.array([[1, 2]])).logits.shape == (1, 2, 7)
    finally:
        backend.close()
    assert list(tmp_path.iterdir()) == []
