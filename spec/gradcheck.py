"""The seed's own gradient check: its zero-block probe model and its central differences.

The seed checks all 20 coordinates of a 5x4 table and all 4 of a final gain, on a
zero-block model built from them, with step ``h = 1e-6``: the numerical derivative is
``(f(x + h) - f(x - h)) / ((x + h) - (x - h))`` (the spacing-weighted mean of the two
one-sided slopes), and an analytic value ``a`` passes against the numerical ``n`` when
``|a / s - n / s| <= 2e-5`` with ``s = max(1, |a|, |n|)`` (RECIPE.md, "Gradient check used by
the seed"). The reference's evidence, the suite's GRAD-SEED-CHECK and the tolerance survey
all run this one check, each with its own loss function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from spec.config import FIXTURE, DecoderConfig
from spec.parameters import EMBEDDING_NAME, FINAL_NORM_NAME

__all__ = ["CoordinateCheck", "central_difference_checks", "sampled_indices", "seed_probe"]

FloatArray = npt.NDArray[np.float64]
NamedArrays = list[tuple[str, FloatArray]]


def seed_probe() -> tuple[DecoderConfig, NamedArrays]:
    """The seed's probe: a zero-block model of the fixture's sizes over its published 5x4
    table and final gain (probe tokens and targets: ``FIXTURE.probe_tokens``/``_targets``)."""
    config = dataclasses.replace(FIXTURE.config, layers=0)
    table = np.asarray(FIXTURE.probe_table, dtype=np.float64).reshape(
        config.vocabulary_size, config.model_width
    )
    gain = np.asarray(FIXTURE.probe_gain, dtype=np.float64)
    return config, [(EMBEDDING_NAME, table), (FINAL_NORM_NAME, gain)]


def sampled_indices(size: int, samples: int | None) -> npt.NDArray[np.intp]:
    """Every flat index of a tensor, or ``samples`` evenly spaced ones when it is larger."""
    if samples is None or size <= samples:
        return np.arange(size, dtype=np.intp)
    return np.unique(np.linspace(0, size - 1, samples).round().astype(np.intp))


@dataclass(frozen=True)
class CoordinateCheck:
    """One coordinate of the seed's check: both derivatives, the scaled gap, the verdict."""

    name: str
    index: tuple[int, ...]
    analytic: float
    numerical: float
    error: float
    passed: bool


def central_difference_checks(
    parameters: Sequence[tuple[str, FloatArray]],
    analytic: Mapping[str, FloatArray],
    loss_of: Callable[[NamedArrays], Any],
    *,
    step: float = FIXTURE.gradient_step,
    tolerance: float = FIXTURE.gradient_tolerance,
    samples: int | None = None,
) -> list[CoordinateCheck]:
    """The seed's check of ``analytic`` at every (or ``samples`` evenly spaced) coordinate of
    every tensor, in order.

    ``loss_of(shifted parameters)`` is the loss at ``x +- h``: a float, or an mpmath number,
    whose difference is then taken at the ambient mpmath precision. A tensor missing from
    ``analytic`` is checked as NaN, so every one of its coordinates fails.
    """
    checks = []
    for position, (name, values) in enumerate(parameters):
        gradient = np.asarray(analytic.get(name, np.full(values.shape, np.nan)), dtype=np.float64)
        for flat in sampled_indices(values.size, samples):
            index = tuple(int(i) for i in np.unravel_index(int(flat), values.shape))
            point = float(values[index])
            above, below = point + step, point - step
            losses = []
            for shifted_value in (above, below):
                shifted = [(n, np.array(v, dtype=np.float64)) for n, v in parameters]
                shifted[position][1][index] = shifted_value
                losses.append(loss_of(shifted))
            numerical = float((losses[0] - losses[1]) / (above - below))
            exact = float(gradient[index])
            scale = max(1.0, abs(exact), abs(numerical))
            error = abs(exact / scale - numerical / scale)
            checks.append(
                CoordinateCheck(name, index, exact, numerical, error, bool(error <= tolerance))
            )
    return checks
