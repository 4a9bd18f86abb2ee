"""The autodiff tape: every operation's derivative rule against central differences."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from impl import ops
from impl.errors import BackwardSeedShape
from impl.tape import Tensor
from spec.errors import ErrorKind
from tests.helpers import CENTRAL_DIFFERENCE_TOLERANCE, Array, central_difference, scaled_error

small = st.integers(min_value=1, max_value=4)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


def assert_gradients_match(
    operation: Callable[..., Tensor], inputs: Sequence[Array], seed: int
) -> None:
    """Tape gradients of ``sum(w * operation(inputs))`` equal central differences."""
    rng = np.random.default_rng(seed)
    leaves = [Tensor(value, requires_grad=True) for value in inputs]
    output = operation(*leaves)
    weights = rng.normal(size=output.shape)
    output.backward(weights)
    for position, leaf in enumerate(leaves):

        def weighted(candidate: Array, position: int = position) -> float:
            arguments = [Tensor(value) for value in inputs]
            arguments[position] = Tensor(candidate)
            return float(np.sum(weights * operation(*arguments).value))

        numerical = central_difference(weighted, np.array(inputs[position], dtype=np.float64))
        assert leaf.grad is not None, f"input {position} received no gradient"
        error = scaled_error(leaf.grad, numerical)
        assert error <= CENTRAL_DIFFERENCE_TOLERANCE, (
            f"gradient of input {position}: scaled error {error:.3e}, "
            f"but should be <= {CENTRAL_DIFFERENCE_TOLERANCE:.0e}"
        )


@given(
    batch=small,
    rows=small,
    width=small,
    broadcast=st.sampled_from(["row", "column", "same"]),
    seed=seeds,
)
def test_add_and_mul_broadcast(
    batch: int, rows: int, width: int, broadcast: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    left = rng.normal(size=(batch, rows, width))
    right_shape = {"row": (width,), "column": (1, rows, 1), "same": (batch, rows, width)}[broadcast]
    right = rng.normal(size=right_shape)
    assert_gradients_match(ops.add, [left, right], seed)
    assert_gradients_match(ops.mul, [left, right], seed)


@given(shape=st.tuples(small, small), constant=st.floats(-3, 3), seed=seeds)
def test_constant_operations(shape: tuple[int, int], constant: float, seed: int) -> None:
    value = np.random.default_rng(seed).normal(size=shape)
    assert_gradients_match(lambda x: ops.add_constant(x, constant), [value], seed)
    assert_gradients_match(lambda x: ops.scale(x, constant), [value], seed)
    assert_gradients_match(lambda x: ops.divide(x, constant + 4.0), [value], seed)


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


@given(shape=st.tuples(small, small, small, small), seed=seeds)
def test_transpose_reshape_and_mean(shape: tuple[int, int, int, int], seed: int) -> None:
    value = np.random.default_rng(seed).normal(size=shape)
    assert_gradients_match(lambda x: ops.transpose(x, 1, 2), [value], seed)
    flat_shape = (shape[0], shape[1] * shape[2] * shape[3])
    assert_gradients_match(lambda x: ops.reshape(x, flat_shape), [value], seed)
    assert_gradients_match(lambda x: ops.mean(x, axis=-1), [value], seed)
    assert_gradients_match(lambda x: ops.mean(x, axis=1), [value], seed)


@given(shape=st.tuples(small, small), seed=seeds)
def test_log_exp_and_silu(shape: tuple[int, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    assert_gradients_match(ops.log, [rng.uniform(0.5, 3.0, size=shape)], seed)
    assert_gradients_match(ops.exp, [rng.normal(size=shape)], seed)
    # Wide inputs reach both branches of the stable sigmoid and its saturated tails.
    assert_gradients_match(ops.silu, [rng.normal(scale=6.0, size=shape)], seed)


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


@given(batch=small, heads=small, length=small, seed=seeds)
def test_causal_softmax(batch: int, heads: int, length: int, seed: int) -> None:
    scores = np.random.default_rng(seed).normal(scale=2.0, size=(batch, heads, length, length))
    assert_gradients_match(ops.causal_softmax, [scores], seed)
    weights = ops.causal_softmax(Tensor(scores)).value
    assert np.all(
        weights[..., np.triu_indices(length, k=1)[0], np.triu_indices(length, k=1)[1]] == 0.0
    )
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-14)


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


def test_leaf_used_twice_receives_the_sum() -> None:
    table = Tensor(np.array([[1.0, 2.0], [3.0, -1.0]]), requires_grad=True)
    ids = np.array([[0, 1]], dtype=np.intp)
    looked_up = ops.gather_rows(table, ids)  # (1, 2, 2)
    logits = ops.matmul(looked_up, ops.transpose(table, 0, 1))
    ops.indexed_mean_nll(logits, np.array([1, 0], dtype=np.intp)).backward()
    assert table.grad is not None

    def loss_of(candidate: Array) -> float:
        rows = Tensor(candidate)
        value = ops.matmul(ops.gather_rows(rows, ids), ops.transpose(rows, 0, 1))
        return float(ops.indexed_mean_nll(value, np.array([1, 0], dtype=np.intp)).value)

    numerical = central_difference(loss_of, table.value.copy())
    assert scaled_error(table.grad, numerical) <= CENTRAL_DIFFERENCE_TOLERANCE


def test_detach_cuts_one_path_and_identity_is_not_equality() -> None:
    leaf = Tensor(np.array([2.0, -3.0]), requires_grad=True)
    detached = leaf.detach()
    ops.mean(ops.mul(leaf, detached), axis=0).backward()
    assert leaf.grad is not None
    np.testing.assert_array_equal(leaf.grad, leaf.value / 2)
    assert detached.grad is None
    assert leaf.is_same_node(leaf)
    assert not leaf.is_same_node(detached)
    assert not leaf.is_same_node(Tensor(leaf.value, requires_grad=True))
    np.testing.assert_array_equal(detached.value, leaf.value)


def test_backward_accumulates_across_calls_until_zeroed() -> None:
    leaf = Tensor(np.array([1.5]), requires_grad=True)
    square = ops.mul(leaf, leaf)
    square.backward()
    square.backward()
    assert leaf.grad is not None
    np.testing.assert_array_equal(leaf.grad, [6.0])
    leaf.zero_grad()
    assert leaf.grad is None


def test_values_are_read_only() -> None:
    leaf = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(ValueError, match="read-only"):
        leaf.value[0] = 2.0


@pytest.mark.parametrize(
    ("seed", "expected", "actual"),
    [(None, (2,), None), (np.ones(3), (2,), (3,))],
    ids=["non-scalar-root-without-seed", "misshaped-seed"],
)
def test_backward_seed_shape_is_refused_and_changes_nothing(
    seed: Array | None, expected: tuple[int, ...], actual: tuple[int, ...] | None
) -> None:
    leaf = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    ops.mean(ops.mul(leaf, leaf), axis=0).backward()
    before = None if leaf.grad is None else leaf.grad.copy()
    with pytest.raises(BackwardSeedShape) as caught:
        ops.mul(leaf, leaf).backward(seed)
    assert caught.value.kind is ErrorKind.BACKWARD_SEED_SHAPE
    assert (caught.value.expected, caught.value.actual) == (expected, actual)
    assert before is not None and leaf.grad is not None
    np.testing.assert_array_equal(leaf.grad, before)


@given(
    batch=small,
    length=small,
    width=st.sampled_from([2, 4, 6]),
    epsilon=st.sampled_from([1e-6, 0.25]),
    seed=seeds,
)
def test_fused_rms_norm(batch: int, length: int, width: int, epsilon: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x, gain = rng.normal(size=(batch, length, width)), rng.normal(size=width)
    assert_gradients_match(lambda a, b: ops.rms_norm(a, b, epsilon), [x, gain], seed)
    composed = ops.mul(
        ops.mul(
            Tensor(x),
            ops.exp(
                ops.scale(
                    ops.log(
                        ops.add_constant(ops.mean(ops.mul(Tensor(x), Tensor(x)), axis=-1), epsilon)
                    ),
                    -0.5,
                )
            ),
        ),
        Tensor(gain),
    )
    assert (
        ops.rms_norm(Tensor(x), Tensor(gain), epsilon).value.tobytes() == composed.value.tobytes()
    )


@given(shape=st.tuples(small, small, small), seed=seeds)
def test_fused_swiglu_product(shape: tuple[int, int, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    gate, up = rng.normal(scale=4.0, size=shape), rng.normal(size=shape)
    assert_gradients_match(ops.swiglu_product, [gate, up], seed)
    composed = ops.mul(ops.silu(Tensor(gate)), Tensor(up)).value
    assert ops.swiglu_product(Tensor(gate), Tensor(up)).value.tobytes() == composed.tobytes()


@given(batch=small, heads=small, length=small, width=small, seed=seeds)
def test_fused_causal_attention(batch: int, heads: int, length: int, width: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(batch, heads, length, width)) for _ in range(3))
    assert_gradients_match(ops.causal_attention, [q, k, v], seed)
    scores = ops.divide(ops.matmul(Tensor(q), ops.transpose(Tensor(k), 2, 3)), np.sqrt(width))
    composed = ops.matmul(ops.causal_softmax(scores), Tensor(v)).value
    fused = ops.causal_attention(Tensor(q), Tensor(k), Tensor(v)).value
    assert np.max(np.abs(fused - composed)) <= 1e-14
