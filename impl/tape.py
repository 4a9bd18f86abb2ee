"""The reverse-mode autodiff core: tensors that remember how they were made.

A :class:`Tensor` holds a float64 value, the parents it was computed from, and a
vector-Jacobian product (VJP) that maps the gradient of its value to gradients of its
parents. ``backward`` visits the graph once in reverse topological order and *adds*
each contribution into the leaves, so a leaf used twice (the tied table) gets the sum.
The derivative rules themselves live in :mod:`impl.ops`; :func:`unbroadcast` is the one
helper they share, which sums a gradient back to the shape of a broadcast input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from impl.errors import BackwardSeedShape, GraphReleased

__all__ = ["Array", "Tensor", "VectorJacobian", "unbroadcast"]

Array = npt.NDArray[np.float64]
# Maps the gradient of a node's value to one gradient per parent (None: no contribution).
VectorJacobian = Callable[[Array], Sequence[Array | None]]


def unbroadcast(gradient: Array, shape: tuple[int, ...]) -> Array:
    """Sum ``gradient`` down to ``shape``, undoing numpy broadcasting (the VJP of a
    broadcast is a sum over the axes it stretched)."""
    extra = gradient.ndim - len(shape)
    if extra > 0:
        gradient = gradient.sum(axis=tuple(range(extra)))
    stretched = tuple(
        axis for axis, size in enumerate(shape) if size == 1 and gradient.shape[axis] != 1
    )
    if stretched:
        gradient = gradient.sum(axis=stretched, keepdims=True)
    return gradient


def _frozen(value: Array) -> Array:
    value.flags.writeable = False
    return value


class Tensor:
    """A node of the tape: a read-only float64 value and, for leaves, a gradient."""

    __slots__ = ("_parents", "_value", "_vjp", "grad", "op", "requires_grad")

    def __init__(self, value: npt.ArrayLike, *, requires_grad: bool = False) -> None:
        """A leaf holding a private float64 copy of ``value``."""
        self._value = _frozen(np.array(value, dtype=np.float64, copy=True))
        self._parents: tuple[Tensor, ...] = ()
        self._vjp: VectorJacobian | None = None
        self.requires_grad = requires_grad
        self.grad: Array | None = None
        self.op = "leaf" if requires_grad else "constant"

    @classmethod
    def from_operation(
        cls, value: Array, parents: Sequence[Tensor], vjp: VectorJacobian, op: str
    ) -> Tensor:
        """The result of an operation; recorded only when a parent needs a gradient."""
        node = cls.__new__(cls)
        node._value = _frozen(value)
        node.grad = None
        node.op = op
        node.requires_grad = any(parent.requires_grad for parent in parents)
        node._parents = tuple(parents) if node.requires_grad else ()
        node._vjp = vjp if node.requires_grad else None
        return node

    @property
    def value(self) -> Array:
        """The node's value (read-only)."""
        return self._value

    @property
    def shape(self) -> tuple[int, ...]:
        """The value's shape."""
        return tuple(self._value.shape)

    def detach(self) -> Tensor:
        """A constant with the same value, cut off from the tape."""
        node = Tensor.__new__(Tensor)
        node._value = self._value
        node._parents = ()
        node._vjp = None
        node.requires_grad = False
        node.grad = None
        node.op = "detach"
        return node

    def is_same_node(self, other: Tensor) -> bool:
        """Whether both handles refer to the very same node (identity, not equal values)."""
        return self is other

    def zero_grad(self) -> None:
        """Forget the accumulated gradient."""
        self.grad = None

    def backward(self, seed: npt.ArrayLike | None = None, *, retain_graph: bool = True) -> None:
        """Accumulate d(self)/d(leaf), weighted by ``seed``, into every reachable leaf.

        Without a seed the node must be a scalar and the seed is 1. The seed is checked
        before any gradient is touched. ``retain_graph=False`` releases each node's saved
        arrays as soon as its rule has run (less memory; the graph cannot run backward again).
        """
        if seed is None:
            if self._value.size != 1:
                raise BackwardSeedShape(expected=self.shape, actual=None)
            upstream = np.ones_like(self._value)
        else:
            upstream = np.array(seed, dtype=np.float64, copy=True)
            if upstream.shape != self._value.shape:
                raise BackwardSeedShape(expected=self.shape, actual=tuple(upstream.shape))
        if not self.requires_grad:
            return
        # Sums of large gradients go to reused buffers (no page faults at the benchmark
        # sizes); imported here because the fast path itself builds on this module.
        from impl.kernels import buffers

        order = _topological_order(self)
        if any(node._vjp is _released for node in order):
            raise GraphReleased(operation=next(n.op for n in order if n._vjp is _released))
        pending: dict[int, Array] = {id(self): upstream}
        for node in reversed(order):
            gradient = pending.pop(id(node), None)
            if gradient is None:
                continue
            if node._vjp is None:
                node.grad = buffers.copy(gradient) if node.grad is None else node.grad + gradient
                continue
            for parent, contribution in zip(node._parents, node._vjp(gradient), strict=True):
                if contribution is None or not parent.requires_grad:
                    continue
                key = id(parent)
                pending[key] = (
                    contribution if key not in pending else buffers.add(pending[key], contribution)
                )
            if not retain_graph:
                node._vjp = _released
                node._parents = ()

    def __repr__(self) -> str:
        return f"Tensor(op={self.op!r}, shape={list(self.shape)})"


def _released(gradient: Array) -> Sequence[Array | None]:
    """The rule of a node whose saved arrays were released (never called: checked first)."""
    raise AssertionError("a released node's rule was called")


def _topological_order(root: Tensor) -> list[Tensor]:
    """Every node reachable from ``root`` through nodes that need gradients, parents first."""
    order: list[Tensor] = []
    visited: set[int] = set()
    stack: list[tuple[Tensor, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        stack.append((node, True))
        stack.extend(
            (parent, False)
            for parent in node._parents
            if parent.requires_grad and id(parent) not in visited
        )
    return order
