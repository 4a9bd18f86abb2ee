"""The evidence record behind the seed's report and trace: what one run of a fixture shows.

A record is plain data (numbers, arrays, flags); :mod:`spec.trace` renders it in the seed's
formats. The reference fills it from its own run (:mod:`impl.evidence`); any backend fills
it through the adapter protocol (:mod:`conformance.trace`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from spec.config import FIXTURE, DecoderConfig, Fixture
from spec.errors import ErrorKind
from spec.gradcheck import seed_probe
from spec.parameters import EMBEDDING_NAME, FINAL_NORM_NAME

__all__ = [
    "GRADCHECK_SAMPLES",
    "Evidence",
    "InputProbes",
    "RunRecord",
    "causality",
    "configuration_probes",
    "depth_zero_logits",
    "fixture_for",
    "input_probes",
    "last_token_changed",
    "probe_parameters",
]

Array = npt.NDArray[np.float64]

# Coordinates checked per tensor by the central-difference probe; the seed's 5x4 table
# and 4-gain probe are checked whole, larger probes at evenly spaced coordinates.
GRADCHECK_SAMPLES = 64


@dataclass
class RunRecord:
    """Forward, loss and gradients of one model on one batch."""

    config: DecoderConfig
    seed: int
    tokens: Array
    targets: Array
    stages: list[tuple[str, Array]]
    logits: Array
    loss: float
    parameter_names: list[str]
    parameter_count: int
    gradients: dict[str, Array | None]
    tied_name: str
    lookup_and_head: bool | None  # None: not observable for this backend


@dataclass
class Evidence:
    """Everything the report and the trace state about one fixture; None where a backend
    lacks the capability that would show it (rendered as ``unavailable``)."""

    run: RunRecord
    predictions: list[int]
    decomposition_error: float | None
    bias_free: bool
    stable_order: bool
    depths_valid: bool | None
    configuration_errors: bool | None
    context_limit: bool | None
    vocabulary_errors: bool | None
    target_errors: bool | None
    prefix_bitwise: list[bool]
    suffix_changed: bool
    table_checks: int
    gain_checks: int
    tolerance: float
    gradcheck_passed: bool | None
    stack_gradients: int | None
    replay_bitwise: bool | None


@dataclass(frozen=True)
class InputProbes:
    """The inputs the evidence refuses or accepts: a full and a too-long sequence, token IDs
    of V and -1, one target too few, a target ID of V."""

    full: npt.NDArray[np.int64]
    too_long: npt.NDArray[np.int64]
    out_of_range: npt.NDArray[np.int64]
    negative: npt.NDArray[np.int64]
    missing_target: npt.NDArray[np.int64]
    bad_target: npt.NDArray[np.int64]


def configuration_probes(config: DecoderConfig) -> list[tuple[dict[str, Any], ErrorKind]]:
    """Each configuration rule broken alone, then two broken together (the earliest wins)."""
    nan = float("nan")
    return [
        ({"vocabulary_size": 0}, ErrorKind.EMPTY_VOCABULARY),
        ({"model_width": 0}, ErrorKind.ZERO_MODEL_WIDTH),
        ({"heads": 0}, ErrorKind.ZERO_HEAD_COUNT),
        ({"heads": config.model_width + 1}, ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE),
        ({"model_width": 6, "heads": 2}, ErrorKind.ODD_HEAD_WIDTH),
        ({"feed_forward_width": 0}, ErrorKind.ZERO_FEED_FORWARD_WIDTH),
        ({"context": 0}, ErrorKind.ZERO_CONTEXT_CAPACITY),
        ({"rope_base": 0.0}, ErrorKind.INVALID_ROPE_BASE),
        ({"rope_base": nan}, ErrorKind.INVALID_ROPE_BASE),
        ({"rms_epsilon": -1e-6}, ErrorKind.INVALID_RMS_EPSILON),
        ({"rms_epsilon": float("inf")}, ErrorKind.INVALID_RMS_EPSILON),
        ({"vocabulary_size": 0, "heads": 0}, ErrorKind.EMPTY_VOCABULARY),
        ({"heads": 0, "rope_base": nan}, ErrorKind.ZERO_HEAD_COUNT),
    ]


def input_probes(fixture: Fixture) -> InputProbes:
    """The fixture's inputs, each broken one way."""
    config = fixture.config
    tokens = np.asarray(fixture.tokens, dtype=np.int64)
    targets = np.asarray(fixture.targets, dtype=np.int64)
    batch = tokens.shape[0]
    out_of_range, negative, bad_target = tokens.copy(), tokens.copy(), targets.copy()
    out_of_range.flat[-1] = config.vocabulary_size
    negative.flat[0] = -1
    bad_target.flat[-1] = config.vocabulary_size
    return InputProbes(
        full=np.zeros((batch, config.context), dtype=np.int64),
        too_long=np.zeros((batch, config.context + 1), dtype=np.int64),
        out_of_range=out_of_range,
        negative=negative,
        missing_target=targets.reshape(-1)[:-1],
        bad_target=bad_target,
    )


def last_token_changed(fixture: Fixture) -> npt.NDArray[np.int64]:
    """The fixture's tokens with only the last one of every sequence changed."""
    changed = np.asarray(fixture.tokens, dtype=np.int64).copy()
    changed[:, -1] = (changed[:, -1] + 1) % fixture.config.vocabulary_size
    return changed


def causality(before: Array, after: Array) -> tuple[list[bool], bool]:
    """Whether each earlier logit row stayed bitwise the same, and whether the last moved."""
    prefix = [
        before[:, position].tobytes() == after[:, position].tobytes()
        for position in range(before.shape[1] - 1)
    ]
    return prefix, bool(np.all(np.any(before[:, -1] != after[:, -1], axis=-1)))


def depth_zero_logits(config: DecoderConfig, table: Array, gain: Array, tokens: Any) -> Array:
    """``RMSNorm(E[z]) E^T`` written out in plain numpy (the seed's zero-block formula)."""
    rows = table[np.asarray(tokens)]
    mean_square = (rows * rows).mean(axis=-1, keepdims=True)
    normalized = rows * np.exp(-0.5 * np.log(mean_square + config.rms_epsilon)) * gain
    result: Array = normalized @ table.T
    return result


def probe_parameters(
    fixture: Fixture, table: Array, gain: Array
) -> tuple[DecoderConfig, list[tuple[str, Array]]]:
    """The zero-block probe: the seed's published one, or a model's own table and gain."""
    if fixture.probe_table:
        return seed_probe()
    config = dataclasses.replace(fixture.config, layers=0)
    return config, [(EMBEDDING_NAME, table.copy()), (FINAL_NORM_NAME, gain.copy())]


def fixture_for(
    config: DecoderConfig,
    seed: int,
    tokens: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
) -> Fixture:
    """A fixture for any run; the seed's published probe belongs to the seed's config only.

    Elsewhere the zero-block gradient probe is built from the model's own initial table and
    final gain, and runs on the given tokens and targets.
    """
    rows = tuple(tuple(row) for row in tokens)
    target_rows = tuple(tuple(row) for row in targets)
    if config == FIXTURE.config:
        return dataclasses.replace(FIXTURE, seed=seed, tokens=rows, targets=target_rows)
    return dataclasses.replace(
        FIXTURE,
        config=config,
        seed=seed,
        tokens=rows,
        targets=target_rows,
        probe_table=(),
        probe_gain=(),
        probe_tokens=rows,
        probe_targets=target_rows,
    )
