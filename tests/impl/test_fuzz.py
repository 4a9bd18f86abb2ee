"""Fuzzing the reference's entry points: the documented kind, a message that explains, no harm.

Each property feeds generated bad input to one entry point and requires either success
(when the spec says the input is valid) or a refusal whose kind is the one
``spec.validation`` expects, with a message, and with the random stream, every parameter
and every gradient exactly as before. Anything else (another exception, a hang, a silent
success on bad input) fails. Run them harder with ``HYPOTHESIS_PROFILE=thorough``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from impl.errors import DecoderModelError
from impl.model import MAX_PARAMETER_SCALARS, DecoderModel
from spec.config import FIXTURE, DecoderConfig
from spec.errors import ErrorKind
from spec.parameters import parameter_count
from spec.recipe import SplitMix64, initial_parameters
from spec.validation import (
    config_violation,
    loss_violation,
    rebuild_violation,
    seed_violation,
    token_violation,
)

CONFIG = FIXTURE.config
# The smallest int float64 cannot hold (it rounds up to 2**1024); one less rounds to the
# largest finite float.
FLOAT64_OVERFLOW = 2**1024 - 2**970
huge_ints = st.one_of(
    st.sampled_from([10**400, -(10**400), 10**5000, FLOAT64_OVERFLOW, -FLOAT64_OVERFLOW]),
    st.integers(FLOAT64_OVERFLOW - 3, FLOAT64_OVERFLOW + 3),
    st.integers(2**1024, 2**4000).map(lambda value: -value if value % 2 else value),
)
weird_sizes = st.one_of(
    st.integers(-3, 12),
    st.integers(2**31, 2**70),
    huge_ints,
    st.sampled_from([True, False, None, "4", 4.0, 2.5, float("nan"), np.int64(4), np.float32(4)]),
)
weird_reals = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    huge_ints,
    st.sampled_from([0, 3, -1, True, None, "1e-6", np.float64(10.0), np.int8(5)]),
)
weird_seeds = st.one_of(
    st.integers(0, 2**64 - 1),
    st.integers(-(2**70), 2**70),
    huge_ints,
    st.sampled_from(
        [True, False, None, "7", 7.0, float("nan"), np.uint64(7), np.int64(-1), np.float64(3)]
    ),
)


def snapshot(model: DecoderModel) -> tuple[list[bytes], list[bytes | None]]:
    values = [p.tensor.value.tobytes() for p in model.parameters()]
    grads = [None if p.tensor.grad is None else p.tensor.grad.tobytes() for p in model.parameters()]
    return values, grads


@pytest.fixture(scope="module")
def trained() -> DecoderModel:
    model = DecoderModel.from_seed(CONFIG, FIXTURE.seed)
    model.loss(FIXTURE.tokens, FIXTURE.targets).backward()
    return model


CONFIG_FIELDS = {
    "vocabulary_size": weird_sizes,
    "model_width": weird_sizes,
    "heads": weird_sizes,
    "feed_forward_width": weird_sizes,
    "layers": weird_sizes,
    "context": weird_sizes,
    "rope_base": weird_reals,
    "rms_epsilon": weird_reals,
}


@given(fields=st.fixed_dictionaries(CONFIG_FIELDS), seed=st.integers(0, 2**64 - 1))
def test_construction(fields: dict[str, Any], seed: int) -> None:
    config = DecoderConfig(**fields)
    expected = config_violation(config)
    stream = SplitMix64(seed)
    if expected is None:
        # A valid configuration either builds (small) or is refused before allocating (huge).
        assume(parameter_count(config) > MAX_PARAMETER_SCALARS or parameter_count(config) < 20_000)
    try:
        DecoderModel.initialize(config, stream)
    except DecoderModelError as error:
        wanted = expected.kind if expected is not None else ErrorKind.PARAMETER_ALLOCATION_FAILED
        assert error.kind is wanted, f"{error.kind} ({error}), but should be {wanted}"
        assert isinstance(error, ValueError) and str(error)
        if error.kind is ErrorKind.CONFIG_FIELD_TYPE:
            assert expected is not None and expected.details["field"] in str(error)
        assert stream.state == seed, "a refused construction advanced the stream"
        return
    assert expected is None, f"built a model from an invalid configuration ({expected.kind})"
    assert parameter_count(config) <= MAX_PARAMETER_SCALARS


@given(
    config=st.one_of(st.just(CONFIG), st.builds(DecoderConfig, **CONFIG_FIELDS)), seed=weird_seeds
)
def test_seeded_construction(config: DecoderConfig, seed: Any) -> None:
    """The configuration first, then the seed; a seed SplitMix64 cannot hold is refused."""
    expected = config_violation(config) or seed_violation(seed)
    if expected is None:
        assume(parameter_count(config) < 20_000)
    try:
        model = DecoderModel.from_seed(config, seed)
    except DecoderModelError as error:
        wanted = expected.kind if expected is not None else ErrorKind.PARAMETER_ALLOCATION_FAILED
        assert error.kind is wanted, f"{error.kind} ({error}), but should be {wanted}"
        assert isinstance(error, ValueError) and str(error)
        return
    assert expected is None, f"built a model breaking {expected.kind}"
    drawn = initial_parameters(config, int(seed))
    for (_, value), (_, expected_value) in zip(model.state(), drawn, strict=True):
        assert np.array_equal(value, expected_value)


@given(seed=weird_seeds)
def test_stream_seeds(seed: Any) -> None:
    """``SplitMix64(seed)`` refuses exactly what ``seed_violation`` refuses, with its kind."""
    expected = seed_violation(seed)
    try:
        stream = SplitMix64(seed)
    except ValueError as error:
        assert expected is not None, f"refused a valid seed: {error}"
        assert getattr(error, "kind", None) is ErrorKind.INVALID_SEED and str(error)
    else:
        assert expected is None, f"accepted a seed breaking {expected.kind}"
        assert stream.state == int(seed)


token_arrays = st.one_of(
    st.integers(0, 3).flatmap(
        lambda rank: st.tuples(*[st.integers(0, 5)] * rank).flatmap(
            lambda shape: st.sampled_from(
                [np.int64, np.int8, np.uint64, np.float64, np.bool_, object]
            ).map(
                lambda dtype, shape=shape: np.asarray(
                    np.random.default_rng(sum(shape)).integers(-2, 8, size=shape)
                ).astype(dtype)
            )
        )
    ),
    st.sampled_from([[[0, 1], [2]], [["a", "b"]], [[2**70, 1]], [], [[]], 3, None]),
    st.just(np.arange(12).reshape(2, 6)[:, ::2] % 5),  # non-contiguous
)
explicit_shapes = st.one_of(
    st.none(),
    st.tuples(st.integers(-1, 4), st.integers(-1, 5)),
    st.just((2**62, 2**62)),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
)


def _call_with_shape(model: DecoderModel, tokens: Any, shape: Any) -> Any:
    return model.forward(tokens, shape)


@given(tokens=token_arrays, shape=explicit_shapes)
def test_forward_tokens(trained: DecoderModel, tokens: Any, shape: Any) -> None:
    expected = token_violation(CONFIG, tokens, shape)
    before = snapshot(trained)
    try:
        result = _call_with_shape(trained, tokens, shape)
    except DecoderModelError as error:
        assert expected is not None, f"refused valid tokens: {error}"
        assert error.kind is expected.kind, f"{error.kind} ({error}), but should be {expected.kind}"
        assert str(error)
    else:
        assert expected is None, f"accepted tokens breaking {expected.kind}"
        batch, length = shape if shape is not None else np.asarray(tokens).shape
        assert result.logits.shape == (batch, length, CONFIG.vocabulary_size)
    assert snapshot(trained) == before


@given(
    targets=st.one_of(
        st.lists(st.integers(-3, 8), min_size=0, max_size=5),
        st.lists(st.lists(st.integers(-1, 6), min_size=3, max_size=3), min_size=1, max_size=2),
        st.sampled_from(
            [[1.0, 2.0, 3.0], [[1, 2], [3]], "abc", [True, False, True], [2**70, 1, 1]]
        ),
    ),
    tokens=st.sampled_from([FIXTURE.tokens, [[0, 1, 5]], [[0, 1]], [[0, 1, 2, 3, 4]]]),
)
def test_loss_targets(trained: DecoderModel, targets: Any, tokens: Any) -> None:
    expected = loss_violation(CONFIG, tokens, targets)
    before = snapshot(trained)
    try:
        value = trained.loss(tokens, targets)
    except DecoderModelError as error:
        assert expected is not None, f"refused valid targets: {error}"
        assert error.kind is expected.kind, f"{error.kind} ({error}), but should be {expected.kind}"
    else:
        assert expected is None, f"accepted targets breaking {expected.kind}"
        assert math.isfinite(float(value.value))
    assert snapshot(trained) == before


def _perturb(entries: list[Any], data: st.DataObject) -> list[Any]:
    choice = data.draw(
        st.sampled_from(
            ["duplicate", "dtype", "nan", "shape", "drop", "extra", "shape-of-entry", "none"]
        )
    )
    index = data.draw(st.integers(0, len(entries) - 1))
    name, value = entries[index]
    if choice == "duplicate":
        entries[index] = (entries[max(0, index - 1)][0], value)
    elif choice == "dtype":
        dtype = data.draw(st.sampled_from([np.complex128, np.bool_, object, "U3"]))
        entries[index] = (name, np.asarray(value).astype(dtype))
    elif choice == "nan":
        broken = np.array(value, dtype=np.float64)
        broken.flat[data.draw(st.integers(0, broken.size - 1))] = data.draw(
            st.sampled_from([np.nan, np.inf, -np.inf])
        )
        entries[index] = (name, broken)
    elif choice == "shape":
        entries[index] = (
            name,
            np.zeros(data.draw(st.lists(st.integers(0, 5), max_size=3)).__len__() * (2,)),
        )
    elif choice == "drop":
        del entries[index]
    elif choice == "extra":
        entries.insert(index, ("lm_head.weight", np.zeros((5, 4))))
    elif choice == "shape-of-entry":
        entries[index] = data.draw(
            st.sampled_from([value, (name,), (name, value, 1), {"name": name}])
        )
    return entries


@given(data=st.data())
def test_rebuild_parameter_lists(data: st.DataObject) -> None:
    entries = _perturb(list(initial_parameters(CONFIG, 3)), data)
    expected = rebuild_violation(CONFIG, entries)
    try:
        DecoderModel.from_parameters(CONFIG, entries)
    except DecoderModelError as error:
        assert expected is not None, f"refused a valid list: {error}"
        assert error.kind is expected.kind, f"{error.kind} ({error}), but should be {expected.kind}"
        assert str(error)
    else:
        assert expected is None, f"accepted a list breaking {expected.kind}"
