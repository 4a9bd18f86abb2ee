"""Helpers shared by the project's tests: central differences and a scaled comparison."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

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


def scaled_error(actual: Array, expected: Array) -> float:
    """Largest ``|a - e| / max(1, |a|, |e|)`` over all coordinates."""
    scale = np.maximum(1.0, np.maximum(np.abs(actual), np.abs(expected)))
    return float(np.max(np.abs(actual - expected) / scale, initial=0.0))
