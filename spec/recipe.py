"""The deterministic initialization recipe: SplitMix64 and the Xavier draw order.

Everything here follows ``RECIPE.md``. Draws are generated with vectorized uint64
arithmetic (SplitMix64's output depends only on its counter), so initializing a large
model costs no Python loop per scalar, and the stream advances exactly one step per scalar.
A matrix is drawn in blocks of :data:`DRAW_BLOCK_SCALARS`, so the draw's temporaries stay
a few MiB however large the matrix (the values are the same as in one block).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig
from spec.errors import ErrorKind, describe_value
from spec.parameters import parameter_layout
from spec.validation import seed_violation

__all__ = [
    "DRAW_BLOCK_SCALARS",
    "GOLDEN_GAMMA",
    "InvalidSeedError",
    "SplitMix64",
    "initial_parameters",
    "xavier_limit",
]

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_UNIT = 2.0**-53
# Scalars drawn at once: each block's uint64 and float64 temporaries are about 8 x 512 KiB.
DRAW_BLOCK_SCALARS = 1 << 16

FloatArray = npt.NDArray[np.float64]


def _mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class InvalidSeedError(ValueError):
    """A seed SplitMix64 cannot hold: no integer, a bool, or outside [0, 2**64 - 1].

    ``kind`` is :attr:`ErrorKind.INVALID_SEED`, as the reference's own refusal
    (``impl.errors.InvalidSeed``) reports it; a ValueError like every refusal.
    """

    kind = ErrorKind.INVALID_SEED

    def __init__(self, seed: object) -> None:
        super().__init__(seed)
        self.field = "seed"
        self.actual = seed

    def __str__(self) -> str:
        shown = describe_value(self.actual)
        return f"SplitMix64 seed must be an integer in [0, 2**64 - 1], got {shown}"


class SplitMix64:
    """A SplitMix64 stream whose whole state is one unsigned 64-bit integer."""

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        """A stream at state ``seed``, an integer (numpy's too) in [0, 2**64 - 1]; anything
        else is an :class:`InvalidSeedError`."""
        if seed_violation(seed) is not None:
            raise InvalidSeedError(seed)
        self._state = int(seed)

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
    values = np.empty(fan_in * fan_out)
    # Block by block: the same draws in the same order as one call, with bounded temporaries.
    for start in range(0, values.size, DRAW_BLOCK_SCALARS):
        block = values[start : start + DRAW_BLOCK_SCALARS]
        block[:] = limit * (2.0 * stream.next_units(block.size) - 1.0)
    return values.reshape(fan_in, fan_out)


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
