"""Helpers shared by the project's tests: central differences and a symmetric comparison."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from impl.tape import Tensor

Array = npt.NDArray[np.float64]

# Central differences with step h on O(1) functions: truncation error ~ h^2 |f'''| / 6
# ~ 1e-12, rounding error ~ eps |f| / h ~ 1e-10. A scaled bound of 1e-6 leaves a margin
# of more than 1000x while still catching any wrong derivative term of size >= 1e-6.
CENTRAL_DIFFERENCE_STEP = 1e-6
CENTRAL_DIFFERENCE_TOLERANCE = 1e-6


def central_difference(function: Callable[[Array], float], point: Array) -> Array:
    """Numerical gradient of a scalar ``function`` at ``point``, one coordinate at a time."""
    gradient = np.zeros_like(point)
    for index in np.ndindex(point.shape):
        above, below = point.copy(), point.copy()
        above[index] += CENTRAL_DIFFERENCE_STEP
        below[index] -= CENTRAL_DIFFERENCE_STEP
        spacing = above[index] - below[index]
        gradient[index] = (function(above) - function(below)) / spacing
    return gradient


def max_symmetric_error(actual: Array, expected: Array) -> float:
    """Largest ``|a - e| / max(1, |a|, |e|)``: the seed's comparison, for two approximations
    of which neither is exact (unlike ``spec.tolerances.scaled_error``, which scales by the
    exact side only)."""
    scale = np.maximum(1.0, np.maximum(np.abs(actual), np.abs(expected)))
    return float(np.max(np.abs(actual - expected) / scale, initial=0.0))


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
        error = max_symmetric_error(leaf.grad, numerical)
        assert error <= CENTRAL_DIFFERENCE_TOLERANCE, (
            f"gradient of input {position}: scaled error {error:.3e}, "
            f"but should be <= {CENTRAL_DIFFERENCE_TOLERANCE:.0e}"
        )
