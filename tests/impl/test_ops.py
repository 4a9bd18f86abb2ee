"""The plain derivative rules: each VJP against central differences, each value by its formula."""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from impl import ops
from impl.tape import Tensor
from tests.helpers import assert_gradients_match

small = st.integers(min_value=1, max_value=4)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


@given(
    batch=small,
    rows=small,
    width=small,
    broadcast=st.sampled_from(["row", "column", "same"]),
    seed=seeds,
)
def test_add_broadcasts(batch: int, rows: int, width: int, broadcast: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    left = rng.normal(size=(batch, rows, width))
    right_shape = {"row": (width,), "column": (1, rows, 1), "same": (batch, rows, width)}[broadcast]
    assert_gradients_match(ops.add, [left, rng.normal(size=right_shape)], seed)


@given(batch=small, rows=small, inner=small, columns=small, seed=seeds)
def test_matmul_with_shared_weight(
    batch: int, rows: int, inner: int, columns: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    inputs = [rng.normal(size=(batch, rows, inner)), rng.normal(size=(inner, columns))]
    assert_gradients_match(ops.matmul, inputs, seed)


@given(batch=small, heads=small, length=small, width=small, seed=seeds)
def test_batched_matmul(batch: int, heads: int, length: int, width: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    inputs = [
        rng.normal(size=(batch, heads, length, width)),
        rng.normal(size=(batch, heads, width, length)),
    ]
    assert_gradients_match(ops.matmul, inputs, seed)


def test_matmul_refuses_a_vector() -> None:
    with pytest.raises(ValueError, match="rank >= 2"):
        ops.matmul(Tensor(np.ones(3)), Tensor(np.ones((3, 2))))


@given(shape=st.tuples(small, small, small, small), seed=seeds)
def test_transpose_and_reshape(shape: tuple[int, int, int, int], seed: int) -> None:
    value = np.random.default_rng(seed).normal(size=shape)
    assert_gradients_match(lambda x: ops.transpose(x, 1, 2), [value], seed)
    flat_shape = (shape[0], shape[1] * shape[2] * shape[3])
    assert_gradients_match(lambda x: ops.reshape(x, flat_shape), [value], seed)
    # A reshape of a transposed (non-contiguous) value copies, and its gradient follows.
    assert_gradients_match(lambda x: ops.reshape(ops.transpose(x, 1, 2), flat_shape), [value], seed)


@given(vocabulary=small, width=small, batch=small, length=small, seed=seeds)
def test_gather_rows_accumulates_repeated_ids(
    vocabulary: int, width: int, batch: int, length: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocabulary, size=(batch, length)).astype(np.intp)
    table = rng.normal(size=(vocabulary, width))
    assert_gradients_match(lambda t: ops.gather_rows(t, ids), [table], seed)


@given(batch=small, heads=small, length=small, pairs=small, seed=seeds)
def test_rotary(batch: int, heads: int, length: int, pairs: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    angles = rng.uniform(-4.0, 4.0, size=(length, pairs))
    value = rng.normal(size=(batch, heads, length, 2 * pairs))
    assert_gradients_match(lambda x: ops.rotary(x, np.cos(angles), np.sin(angles)), [value], seed)


def test_rotary_pairs_interleaved_neighbours() -> None:
    """Features (0, 1) rotate together, not (0, hw/2) as in the rotate-half layout."""
    value = np.array([[[[1.0, 0.0, 0.0, 0.0]]]])
    angle = np.array([[np.pi / 2, 0.0]])
    rotated = ops.rotary(Tensor(value), np.cos(angle), np.sin(angle)).value
    np.testing.assert_allclose(rotated[0, 0, 0], [0.0, 1.0, 0.0, 0.0], atol=1e-15)


@given(
    batch=small,
    length=small,
    width=st.sampled_from([2, 4, 6]),
    epsilon=st.sampled_from([1e-6, 0.25]),
    seed=seeds,
)
def test_rms_norm(batch: int, length: int, width: int, epsilon: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, gain = rng.normal(size=(batch, length, width)), rng.normal(size=width)
    assert_gradients_match(lambda a, b: ops.rms_norm(a, b, epsilon), [x, gain], seed)
    expected = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + epsilon) * gain
    np.testing.assert_allclose(ops.rms_norm(Tensor(x), Tensor(gain), epsilon).value, expected)


@given(shape=st.tuples(small, small, small), seed=seeds)
def test_swiglu(shape: tuple[int, int, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    # Wide gates reach both tails of the sigmoid.
    gate, up = rng.normal(scale=6.0, size=shape), rng.normal(size=shape)
    assert_gradients_match(ops.swiglu, [gate, up], seed)
    expected = gate / (1.0 + np.exp(-gate)) * up
    # Both sides round five times or so, each relative (the sigmoid has no cancellation in
    # either tail): the worst of 5.4 million sampled elements was 1.97 eps |expected|. The
    # tanh form once used here failed this bound (it loses all relative accuracy below -37).
    eps = np.finfo(np.float64).eps
    error = np.abs(ops.swiglu(Tensor(gate), Tensor(up)).value - expected)
    assert np.all(error <= 3 * eps * np.abs(expected))


@given(batch=small, heads=small, length=small, width=small, seed=seeds)
def test_causal_attention(batch: int, heads: int, length: int, width: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(scale=2.0, size=(batch, heads, length, width)) for _ in range(3))
    assert_gradients_match(ops.causal_attention, [q, k, v], seed)
    # Row t is a convex combination of the values at positions 0 .. t only.
    attended = ops.causal_attention(Tensor(q), Tensor(k), Tensor(v)).value
    np.testing.assert_array_equal(attended[..., 0, :], v[..., 0, :])
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(width)
    for t in range(length):
        visible = np.exp(scores[..., t, : t + 1] - scores[..., t, : t + 1].max(-1, keepdims=True))
        weights = visible / visible.sum(-1, keepdims=True)
        expected = (weights[..., None] * v[..., : t + 1, :]).sum(-2)
        np.testing.assert_allclose(attended[..., t, :], expected, rtol=1e-12, atol=1e-14)


@given(batch=small, length=small, vocabulary=small, seed=seeds)
def test_indexed_mean_nll(batch: int, length: int, vocabulary: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, vocabulary, size=batch * length).astype(np.intp)
    logits = rng.normal(scale=3.0, size=(batch, length, vocabulary))
    assert_gradients_match(lambda x: ops.indexed_mean_nll(x, targets), [logits], seed)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probabilities = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    expected = -log_probabilities.reshape(-1, vocabulary)[np.arange(batch * length), targets].mean()
    value = float(ops.indexed_mean_nll(Tensor(logits), targets).value)
    assert value == pytest.approx(expected, rel=1e-14, abs=1e-14)


def test_loss_of_huge_logits_stays_finite() -> None:
    """The row maximum is subtracted before exp: logits of 1e3 do not overflow."""
    logits = np.array([[[1000.0, 0.0, -1000.0]]])
    loss = ops.indexed_mean_nll(Tensor(logits, requires_grad=True), np.array([1], dtype=np.intp))
    assert float(loss.value) == pytest.approx(1000.0, rel=1e-15)


def test_sigmoid_saturates_without_overflow() -> None:
    with np.errstate(all="raise"):
        values = ops.sigmoid(np.array([-1e4, -746.0, 0.0, 40.0, 1e4]))
    np.testing.assert_array_equal(values, [0.0, 0.0, 0.5, 1.0, 1.0])


def test_sigmoid_is_accurate_relative_to_its_value_in_both_tails() -> None:
    """Against mpmath from -700 to 700: at most 1.23 eps relative measured; 2 eps allowed.
    (tanh(u / 2) would cancel: relative error 9e-9 at -20, and 0 returned below -37.)"""
    gates = np.concatenate([np.linspace(-700.0, 700.0, 2801), [-40.0, -20.0, -1e-3, 1e-3]])
    exact = np.array([float(1 / (1 + mpmath.exp(-mpmath.mpf(float(u))))) for u in gates])
    relative = np.abs(ops.sigmoid(gates) - exact) / exact
    assert relative.max() <= 2 * np.finfo(np.float64).eps
