"""The deterministic initialization recipe: SplitMix64 and the Xavier draw order.

Everything here follows ``RECIPE.md``. Draws are generated with vectorized uint64
arithmetic (SplitMix64's output depends only on its counter), so initializing a large
model costs no Python loop per scalar, and the stream advances exactly one step per scalar.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig
from spec.parameters import parameter_layout

__all__ = ["GOLDEN_GAMMA", "SplitMix64", "initial_parameters", "xavier_limit"]

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_UNIT = 2.0**-53

FloatArray = npt.NDArray[np.float64]


def _mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class SplitMix64:
    """A SplitMix64 stream whose whole state is one unsigned 64-bit integer."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        if not 0 <= seed <= _MASK64:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {seed}")
        self._state = seed

    @property
    def state(self) -> int:
        """The current state; equal states produce equal futures."""
        return self._state

    def clone(self) -> SplitMix64:
        """An independent stream at the same state."""
        return SplitMix64(self._state)

    def adopt(self, other: SplitMix64) -> None:
        """Move to ``other``'s state: commits a trial clone once its work has succeeded."""
        self._state = other.state

    def next_u64(self) -> int:
        """The next 64-bit output."""
        return int(self.next_u64_block(1)[0])

    def next_u64_block(self, count: int) -> npt.NDArray[np.uint64]:
        """The next ``count`` outputs, as if ``next_u64`` were called ``count`` times."""
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        steps = np.arange(1, count + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            states = np.uint64(self._state) + steps * np.uint64(GOLDEN_GAMMA)
            outputs = _mix(states)
        self._state = (self._state + count * GOLDEN_GAMMA) & _MASK64
        return outputs

    def next_units(self, count: int) -> FloatArray:
        """The next ``count`` uniform floats in [0, 1), 53 random bits each."""
        return (self.next_u64_block(count) >> np.uint64(11)).astype(np.float64) * _UNIT


def xavier_limit(fan_in: int, fan_out: int) -> float:
    """Xavier-uniform bound ``sqrt(6 / (fan_in + fan_out))``."""
    return math.sqrt(6.0 / (fan_in + fan_out))


def _xavier(stream: SplitMix64, fan_in: int, fan_out: int) -> FloatArray:
    limit = xavier_limit(fan_in, fan_out)
    units = stream.next_units(fan_in * fan_out)
    return (limit * (2.0 * units - 1.0)).reshape(fan_in, fan_out)


def initial_parameters(
    config: DecoderConfig, stream: SplitMix64 | int
) -> list[tuple[str, FloatArray]]:
    """Initial named parameters for ``config``, drawing matrices from ``stream`` in order.

    ``stream`` may be a seed, which starts a fresh stream.

    Gains are ones and draw nothing; matrices are Xavier-uniform ``[fan_in, fan_out]`` filled
    row-major. The configuration is assumed valid; the stream advances by the matrix scalars.
    """
    if not isinstance(stream, SplitMix64):
        stream = SplitMix64(stream)
    parameters: list[tuple[str, FloatArray]] = []
    for name, shape in parameter_layout(config):
        if len(shape) == 1:
            parameters.append((name, np.ones(shape, dtype=np.float64)))
        else:
            parameters.append((name, _xavier(stream, shape[0], shape[1])))
    return parameters
