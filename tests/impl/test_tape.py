"""The autodiff tape: accumulation on a shared leaf, detach, identity, seeds, released graphs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from impl import ops
from impl.errors import BackwardSeedShape, GraphReleased
from impl.tape import Tensor, unbroadcast
from spec.errors import ErrorKind
from tests.helpers import (
    CENTRAL_DIFFERENCE_TOLERANCE,
    Array,
    central_difference,
    max_symmetric_error,
)


def _tied_loss(table: Tensor) -> Tensor:
    """A one-table model: lookup of rows 0 and 1, then the table's transpose as the head."""
    ids = np.array([[0, 1]], dtype=np.intp)
    looked_up = ops.gather_rows(table, ids)  # (1, 2, 2)
    logits = ops.matmul(looked_up, ops.transpose(table, 0, 1))
    return ops.indexed_mean_nll(logits, np.array([1, 0], dtype=np.intp))


def test_leaf_used_twice_receives_the_sum() -> None:
    table = Tensor(np.array([[1.0, 2.0], [3.0, -1.0]]), requires_grad=True)
    _tied_loss(table).backward()
    assert table.grad is not None
    numerical = central_difference(
        lambda candidate: float(_tied_loss(Tensor(candidate)).value), table.value.copy()
    )
    assert max_symmetric_error(table.grad, numerical) <= CENTRAL_DIFFERENCE_TOLERANCE


def test_detach_cuts_one_path_and_shares_the_value() -> None:
    """d/dx mean(x * stop(x)) is stop(x) / n: the detached use contributes nothing."""
    leaf = Tensor(np.array([2.0, -3.0]), requires_grad=True)
    detached = leaf.detach()
    np.testing.assert_array_equal(detached.value, leaf.value)
    ops.indexed_mean_nll(
        ops.reshape(ops.add(leaf, detached), (1, 1, 2)), np.array([0], dtype=np.intp)
    ).backward()
    assert leaf.grad is not None and detached.grad is None
    full = Tensor(leaf.value, requires_grad=True)
    ops.indexed_mean_nll(
        ops.reshape(ops.add(full, full), (1, 1, 2)), np.array([0], dtype=np.intp)
    ).backward()
    assert full.grad is not None
    # Both uses on the tape give twice the gradient of one use.
    np.testing.assert_allclose(full.grad, 2 * leaf.grad, rtol=1e-15)


def test_an_equal_valued_twin_is_another_node() -> None:
    """Tying is identity: only the node that was used receives a gradient."""
    table = Tensor(np.array([[1.0, 2.0], [3.0, -1.0]]), requires_grad=True)
    twin = Tensor(table.value, requires_grad=True)
    _tied_loss(table).backward()
    assert table.is_same_node(table) and not table.is_same_node(twin)
    assert table.grad is not None and twin.grad is None


def test_backward_accumulates_across_calls_until_zeroed() -> None:
    leaf = Tensor(np.array([[1.5, -0.5]]), requires_grad=True)
    square = ops.matmul(leaf, ops.transpose(leaf, 0, 1))  # x x^T, d/dx = 2x
    square.backward()
    square.backward()
    assert leaf.grad is not None
    np.testing.assert_array_equal(leaf.grad, 4 * leaf.value)
    leaf.zero_grad()
    assert leaf.grad is None


def test_values_are_read_only() -> None:
    leaf = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(ValueError, match="read-only"):
        leaf.value[0] = 2.0


def test_a_leaf_keeps_a_private_copy_of_its_value() -> None:
    source = np.ones(3)
    leaf = Tensor(source, requires_grad=True)
    source[0] = 5.0
    assert leaf.value[0] == 1.0


@pytest.mark.parametrize(
    ("seed", "expected", "actual"),
    [(None, (1, 2), None), (np.ones(3), (1, 2), (3,))],
    ids=["non-scalar-root-without-seed", "misshaped-seed"],
)
def test_backward_seed_shape_is_refused_and_changes_nothing(
    seed: Array | None, expected: tuple[int, ...], actual: tuple[int, ...] | None
) -> None:
    leaf = Tensor(np.array([[1.0, 2.0]]), requires_grad=True)
    ops.matmul(leaf, ops.transpose(leaf, 0, 1)).backward()
    before = None if leaf.grad is None else leaf.grad.copy()
    with pytest.raises(BackwardSeedShape) as caught:
        ops.add(leaf, leaf).backward(seed)
    assert caught.value.kind is ErrorKind.BACKWARD_SEED_SHAPE
    assert (caught.value.expected, caught.value.actual) == (expected, actual)
    assert before is not None and leaf.grad is not None
    np.testing.assert_array_equal(leaf.grad, before)


def test_a_released_graph_refuses_a_second_backward_and_changes_nothing() -> None:
    table = Tensor(np.array([[1.0, 2.0], [3.0, -1.0]]), requires_grad=True)
    loss = _tied_loss(table)
    loss.backward(retain_graph=False)
    assert table.grad is not None
    before = table.grad.copy()
    with pytest.raises(GraphReleased) as caught:
        loss.backward()
    assert caught.value.kind is ErrorKind.GRAPH_RELEASED
    np.testing.assert_array_equal(table.grad, before)


@given(
    shape=st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple),
    extra=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    data=st.data(),
)
def test_unbroadcast_sums_exactly_the_stretched_axes(
    shape: tuple[int, ...], extra: tuple[int, ...], data: st.DataObject
) -> None:
    """Summing back what broadcasting stretched: the adjoint of ``np.broadcast_to``."""
    squeezed = tuple(data.draw(st.sampled_from([size, 1])) for size in shape)
    gradient = np.random.default_rng(0).normal(size=extra + shape)
    summed = unbroadcast(gradient, squeezed)
    assert summed.shape == squeezed
    probe = np.random.default_rng(1).normal(size=squeezed)
    # <g, broadcast(p)> == <unbroadcast(g), p> for every p.
    assert np.sum(gradient * np.broadcast_to(probe, gradient.shape)) == pytest.approx(
        np.sum(summed * probe), rel=1e-12, abs=1e-12
    )
