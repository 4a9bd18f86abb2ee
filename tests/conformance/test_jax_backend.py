"""The JAX adapters: the seed's logits, the layout, float64 gradients, the x64 guard, the tied
roles and a refusal that changes nothing.

The whole suite runs against them with ``decoder-conformance run --adapter
conformance.adapters.jax_backend:JaxBackend`` (and ``:JaxFloat32Backend``); these are the
quick checks that belong to the project's tests. Every test reuses the fixture's shapes, so
the process compiles each pass once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from conformance.adapter import Backend, FloatArray, Refusal
from conformance.adapters.reference import ReferenceBackend
from spec.config import FIXTURE, DecoderConfig
from spec.errors import ErrorKind
from spec.parameters import EMBEDDING_NAME
from spec.published import PUBLISHED_LOGITS
from spec.recipe import initial_parameters

jax = pytest.importorskip("jax")

from conformance.adapters.jax_backend import (  # noqa: E402 - needs jax, skipped above
    DeclaredDtypeError,
    JaxBackend,
    JaxFloat32Backend,
)

BACKENDS = [JaxBackend(), JaxFloat32Backend()]


def _fixture_model(backend: Backend) -> Any:
    return backend.build(FIXTURE.config, initial_parameters(FIXTURE.config, FIXTURE.seed))


def _scaled_error(got: FloatArray, expected: FloatArray) -> float:
    return float(np.max(np.abs(got - expected) / np.maximum(1.0, np.abs(expected))))


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_seed_logits_to_six_decimals(backend: JaxBackend) -> None:
    logits = backend.forward(_fixture_model(backend), FIXTURE.tokens).logits[0]
    if backend.dtype == np.float64:  # float64 prints exactly the published digits
        assert [[f"{value:.6f}" for value in row] for row in logits] == [
            list(row) for row in PUBLISHED_LOGITS
        ]
    else:  # float32 arithmetic: within half a printed unit plus float32 rounding
        published = np.array(PUBLISHED_LOGITS, dtype=np.float64)
        assert np.max(np.abs(logits - published)) <= 0.5e-6 + 1e-6


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_parameters_round_trip_through_the_backend_layout(backend: JaxBackend) -> None:
    config = DecoderConfig(7, 12, 3, 5, 2, 4)
    parameters = initial_parameters(config, 11)
    listed = backend.parameters(backend.build(config, parameters))
    assert [name for name, _ in listed] == [name for name, _ in parameters]
    for (name, got), (_, expected) in zip(listed, parameters, strict=True):
        assert got.dtype == np.float64, name
        assert got.tobytes() == expected.astype(backend.dtype).astype(np.float64).tobytes(), name


def test_float64_stages_loss_and_gradients_agree_with_the_reference() -> None:
    backend, reference = JaxBackend(), ReferenceBackend()
    model, exact = _fixture_model(backend), _fixture_model(reference)
    got, expected = (
        backend.loss(model, FIXTURE.tokens, FIXTURE.targets),
        reference.loss(exact, FIXTURE.tokens, FIXTURE.targets),
    )
    assert abs(got.loss - expected.loss) <= 1e-12
    assert got.gradients is not None and expected.gradients is not None
    assert list(got.gradients) == list(expected.gradients)
    for name, gradient in expected.gradients.items():
        assert got.gradients[name].dtype == np.float64, name
        assert _scaled_error(got.gradients[name], gradient) <= 1e-12, name
    stages = backend.forward(model, FIXTURE.tokens).stages or []
    for (name, stage), (_, exact_stage) in zip(
        stages, reference.forward(exact, FIXTURE.tokens).stages or [], strict=True
    ):
        assert _scaled_error(stage, exact_stage) <= 1e-12, name


def test_gradients_are_fresh_on_every_call() -> None:
    backend = JaxBackend()
    model = _fixture_model(backend)
    first = backend.loss(model, FIXTURE.tokens, FIXTURE.targets).gradients or {}
    second = backend.loss(model, FIXTURE.tokens, FIXTURE.targets).gradients or {}
    for name, gradient in first.items():
        assert second[name].tobytes() == gradient.tobytes(), name


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_tied_role_gradients_sum_to_the_full_gradient(backend: JaxBackend) -> None:
    model = _fixture_model(backend)
    full, lookup_only, head_only = (
        backend.loss(model, FIXTURE.tokens, FIXTURE.targets, **roles).gradients or {}
        for roles in ({}, {"detach_head": True}, {"detach_lookup": True})
    )
    bound = 1e-12 if backend.dtype == np.float64 else 1e-6
    roles_sum = lookup_only[EMBEDDING_NAME] + head_only[EMBEDDING_NAME]
    assert _scaled_error(roles_sum, full[EMBEDDING_NAME]) <= bound
    assert np.any(lookup_only[EMBEDDING_NAME] != 0) and np.any(head_only[EMBEDDING_NAME] != 0)
    for name, gradient in full.items():  # the other parameters do not depend on the role
        if name != EMBEDDING_NAME:
            assert lookup_only[name].tobytes() == gradient.tobytes(), name
            assert head_only[name].tobytes() == gradient.tobytes(), name


def test_the_x64_guard_refuses_to_compute_float64_as_float32() -> None:
    backend = JaxBackend()
    model = _fixture_model(backend)
    with jax.enable_x64(False):
        with pytest.raises(DeclaredDtypeError, match="jax_enable_x64"):
            _fixture_model(backend)
        with pytest.raises(DeclaredDtypeError, match="jax_enable_x64"):
            backend.forward(model, FIXTURE.tokens)
        with pytest.raises(DeclaredDtypeError, match="jax_enable_x64"):
            backend.loss(model, FIXTURE.tokens, FIXTURE.targets)
    assert backend.forward(model, FIXTURE.tokens).logits.dtype == np.float64


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_a_zero_mean_square_with_epsilon_zero_is_refused_and_changes_nothing(
    backend: JaxBackend,
) -> None:
    config = dataclasses.replace(FIXTURE.config, rms_epsilon=0.0)
    parameters = initial_parameters(config, FIXTURE.seed)
    parameters[0][1][FIXTURE.tokens[0][1]] = 0.0
    model = backend.build(config, parameters)
    before = backend.parameters(model)
    for call in (
        lambda: backend.forward(model, FIXTURE.tokens),
        lambda: backend.loss(model, FIXTURE.tokens, FIXTURE.targets),
    ):
        with pytest.raises(Refusal) as refusal:
            call()
        assert refusal.value.kind is ErrorKind.RMS_ZERO_MEAN_SQUARE
        assert refusal.value.details == {"row": 1, "layer": 0, "component": "attention RMSNorm"}
    for (name, after), (_, value) in zip(backend.parameters(model), before, strict=True):
        assert after.tobytes() == value.tobytes(), name


def test_the_eager_pass_agrees_with_the_compiled_one() -> None:
    class EagerJaxBackend(JaxBackend):
        compiled = False

    compiled, eager = JaxBackend(), EagerJaxBackend()
    got = eager.forward(_fixture_model(eager), FIXTURE.tokens).logits
    expected = compiled.forward(_fixture_model(compiled), FIXTURE.tokens).logits
    assert _scaled_error(got, expected) <= 1e-14


def test_the_version_names_jax_and_jaxlib() -> None:
    assert JaxBackend().version.startswith(f"jax {jax.__version__}, jaxlib ")
