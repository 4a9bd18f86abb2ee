"""Determinism, the initialization recipe, transactional refusals and rebuilding."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from conformance.adapter import (
    Backend,
    Capability,
    FloatArray,
    call_build_seeded,
    call_initialize,
)
from conformance.cases import Scenario, scenarios
from conformance.checks import Case, Judge
from conformance.profiles import suite_settings
from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.formats import held_in_format, round_to
from spec.parameters import parameter_layout
from spec.recipe import GOLDEN_GAMMA, SplitMix64, initial_parameters
from spec.strategies import invalid_configs, invalid_token_inputs
from spec.tolerances import ToleranceModel


def _bytes(listed: list[tuple[str, FloatArray]]) -> list[tuple[str, bytes]]:
    return [(name, np.asarray(value, dtype=np.float64).tobytes()) for name, value in listed]


@pytest.mark.rule("DET-REPLAY")
@suite_settings()
@given(scenario=scenarios())
def test_same_seed_same_model(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    first = call_build_seeded(backend, scenario.config, scenario.seed)
    second = call_build_seeded(backend, scenario.config, scenario.seed)
    check = judge.on(scenario.case("backend.build_seeded(config, seed)"))
    check.check(
        _bytes(backend.parameters(first)) == _bytes(backend.parameters(second)),
        "parameters bitwise equal",
        False,
        True,
    )
    check.same_bits(
        "logits of the second model",
        backend.forward(second, scenario.tokens).logits,
        backend.forward(first, scenario.tokens).logits,
    )


@pytest.mark.rule("DET-REPEAT")
@suite_settings()
@given(scenario=scenarios())
def test_same_call_same_answer(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    model = scenario.build(backend)
    check = judge.on(scenario.case())
    first, second = (backend.forward(model, scenario.tokens).logits for _ in range(2))
    check.same_bits("logits of a repeated forward", second, first)
    one, two = (backend.loss(model, scenario.tokens, scenario.targets) for _ in range(2))
    loss_check = judge.on(scenario.case("backend.loss(model, tokens, targets)"))
    loss_check.same_bits("loss of a repeated call", np.float64(two.loss), np.float64(one.loss))
    if Capability.GRADIENTS in backend.capabilities:
        for name, gradient in (one.gradients or {}).items():
            again = (two.gradients or {}).get(name)
            if again is None:
                loss_check.fail(f"gradient of {name} on a repeated call", "missing", "present")
            loss_check.same_bits(
                f"gradient of {name} on a repeated call (not accumulated)",
                np.asarray(again),
                np.asarray(gradient),
            )


@pytest.mark.rule("INIT-RECIPE")
@suite_settings()
@given(scenario=scenarios())
def test_initialization_follows_the_recipe(
    backend: Backend, judge: Judge, scenario: Scenario
) -> None:
    model = call_build_seeded(backend, scenario.config, scenario.seed)
    got = dict(backend.parameters(model))
    check = judge.on(scenario.case("backend.parameters(backend.build_seeded(config, seed))"))
    for name, expected in initial_parameters(scenario.config, scenario.seed):
        value = got.get(name)
        if value is None:
            check.fail(f"parameter {name}", "missing", "present")
        # The recipe is exact: in the backend's precision it must match to the last bit
        # (rounded to nearest, directly or through float32: spec.formats.held_in_format).
        held = np.asarray(value, dtype=np.float64)
        if held.shape == expected.shape and np.all(
            held_in_format(held, expected, backend.precision)
        ):
            continue
        check.close(f"initial {name}", value, round_to(expected, backend.precision), 0.0)


@pytest.mark.rule("INIT-STREAM-ADVANCE")
@suite_settings()
@given(scenario=scenarios())
def test_stream_advances_by_the_matrix_scalars(
    backend: Backend, judge: Judge, scenario: Scenario
) -> None:
    stream = SplitMix64(scenario.seed)
    call_initialize(backend, scenario.config, stream)
    draws = sum(
        int(np.prod(shape)) for _, shape in parameter_layout(scenario.config) if len(shape) == 2
    )
    expected = (scenario.seed + draws * GOLDEN_GAMMA) % 2**64
    judge.on(scenario.case("backend.initialize(config, stream)")).check(
        stream.state == expected, "stream state", stream.state, f"{expected} ({draws} draws)"
    )


@pytest.mark.rule("TXN-INIT")
@suite_settings()
@given(pair=invalid_configs(), seed=st.integers(0, 2**64 - 1))
def test_refused_construction_leaves_the_stream(
    backend: Backend, judge: Judge, pair: tuple[DecoderConfig, ErrorKind], seed: int
) -> None:
    config, expected = pair
    stream = SplitMix64(seed)
    check = judge.on(Case(config, call=f"backend.initialize(config, SplitMix64({seed}))"))
    check.refused(lambda: call_initialize(backend, config, stream), expected)
    check.check(stream.state == seed, "stream state after a refusal", stream.state, seed)


@pytest.mark.rule("TXN-CALL")
@suite_settings()
@given(scenario=scenarios(), data=st.data())
def test_refused_calls_change_nothing(
    backend: Backend, judge: Judge, scenario: Scenario, data: st.DataObject
) -> None:
    model = scenario.build(backend)
    parameters_before = _bytes(backend.parameters(model))
    result_before = backend.loss(model, scenario.tokens, scenario.targets)
    bad_tokens, shape, kind = data.draw(invalid_token_inputs(scenario.config))
    bad_targets = scenario.targets.copy()
    bad_targets.flat[-1] = scenario.config.vocabulary_size
    check = judge.on(
        dataclasses.replace(
            scenario.case("backend.loss(model, tokens, targets)"), notes={"bad_tokens": bad_tokens}
        )
    )
    check.refused(lambda: backend.forward(model, bad_tokens, shape), kind)
    check.refused(
        lambda: backend.loss(model, scenario.tokens, bad_targets), ErrorKind.TARGET_ID_OUT_OF_BOUNDS
    )
    check.check(
        _bytes(backend.parameters(model)) == parameters_before,
        "parameters after refused calls bitwise unchanged",
        False,
        True,
    )
    result_after = backend.loss(model, scenario.tokens, scenario.targets)
    check.same_bits(
        "loss after refused calls", np.float64(result_after.loss), np.float64(result_before.loss)
    )
    for name, gradient in (result_before.gradients or {}).items():
        again = np.asarray((result_after.gradients or {}).get(name))
        check.same_bits(f"gradient of {name} after refused calls", again, np.asarray(gradient))


def _strided(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The same values as a view that skips every other element of its last axis."""
    return np.repeat(values, 2, axis=-1)[..., ::2]


def _other_layout(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Matrices in Fortran (column-major) order, vectors as strided views."""
    return np.asfortranarray(values) if values.ndim == 2 else _strided(values)


# The failing calls as Python a user can run after the case's own lines (which define
# ``backend``, ``config``, ``model``, ``tokens`` and ``targets``).
_LAID_OUT_BUILD = """import numpy as np
laid_out = [
    (name, np.asfortranarray(v) if np.ndim(v) == 2 else np.repeat(v, 2)[::2])
    for name, v in backend.parameters(model)
]
backend.forward(backend.build(config, laid_out), tokens)"""
_TOKEN_LAYOUTS = {
    "Fortran order": "np.asfortranarray(np.array({}))",
    "strided views": "np.repeat(np.array({}), 2, axis=-1)[:, ::2]",
}


# Two sequences of three tokens: Fortran order and C order differ only with both axes > 1.
LAYOUT_CASE = Scenario(
    DecoderConfig(5, 4, 2, 6, 2, 4),
    seed=21,
    tokens=np.array([[1, 4, 0], [3, 3, 2]]),
    targets=np.array([[4, 0, 2], [3, 2, 1]]),
    variant="varied",
)


@pytest.mark.rule("REBUILD-MEMORY-LAYOUT")
@suite_settings()
@given(scenario=scenarios())
@example(scenario=LAYOUT_CASE)
def test_memory_layout_does_not_change_a_result(
    backend: Backend, judge: Judge, scenario: Scenario, tolerance: ToleranceModel
) -> None:
    """A port that hands a view's raw memory to native code (a ctypes pointer, a buffer
    read in memory order) reads a Fortran-ordered matrix transposed and a strided view's
    gaps; the same values in C order must give the same results, within twice the
    backend's bound, since a kernel may take another path for another layout."""
    parameters = scenario.parameters()
    bound = tolerance.at(scenario.config, scenario.tokens.shape[1])
    plain = scenario.build(backend)
    expected = backend.forward(plain, scenario.tokens).logits
    expected_loss = backend.loss(plain, scenario.tokens, scenario.targets).loss
    laid_out = [(name, _other_layout(value)) for name, value in parameters]
    check = judge.on(scenario.case(_LAID_OUT_BUILD))
    model = backend.build(scenario.config, laid_out)
    check.close(
        "logits with matrices in Fortran order and gains strided",
        backend.forward(model, scenario.tokens).logits,
        expected,
        2 * bound.logits,
    )
    for layout, tokens, targets in (
        ("Fortran order", np.asfortranarray(scenario.tokens), np.asfortranarray(scenario.targets)),
        ("strided views", _strided(scenario.tokens), _strided(scenario.targets)),
    ):
        ids, wanted = (_TOKEN_LAYOUTS[layout].format(name) for name in ("tokens", "targets"))
        check = judge.on(
            scenario.case(
                f"import numpy as np\nbackend.forward(model, {ids})\n"
                f"backend.loss(model, {ids}, {wanted})"
            )
        )
        check.close(
            f"logits of token IDs in {layout}",
            backend.forward(plain, tokens).logits,
            expected,
            2 * bound.logits,
        )
        check.close(
            f"loss of token and target IDs in {layout}",
            backend.loss(plain, tokens, targets).loss,
            expected_loss,
            2 * bound.loss,
        )


@pytest.mark.rule("REBUILD-ROUNDTRIP")
@suite_settings()
@given(scenario=scenarios())
def test_rebuild_from_own_parameters(backend: Backend, judge: Judge, scenario: Scenario) -> None:
    model = scenario.build(backend)
    rebuilt = backend.build(scenario.config, backend.parameters(model))
    judge.on(scenario.case("backend.build(config, backend.parameters(model))")).same_bits(
        "logits after a rebuild",
        backend.forward(rebuilt, scenario.tokens).logits,
        backend.forward(model, scenario.tokens).logits,
    )
