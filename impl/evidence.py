"""The evidence behind the seed's report and trace, gathered from one deterministic run.

Nothing here prints a constant where a measurement belongs: shapes, logits, the loss,
the tying decomposition, the error probes, causality, the gradient checks and the
replay all come from running the reference model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from impl.errors import DecoderModelError
from impl.model import DecoderModel
from impl.tape import Array
from spec.config import FIXTURE, DecoderConfig, Fixture
from spec.errors import ErrorKind
from spec.gradcheck import central_difference_checks, seed_probe
from spec.parameters import EMBEDDING_NAME, FINAL_NORM_NAME, parameter_count, parameter_names
from spec.recipe import SplitMix64

__all__ = ["Evidence", "RunRecord", "collect_evidence", "fixture_for", "run_fixture"]

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
    lookup_and_head: bool


@dataclass
class Evidence:
    """Everything the report and the trace state about one fixture."""

    run: RunRecord
    predictions: list[int]
    decomposition_error: float
    bias_free: bool
    stable_order: bool
    depths_valid: bool
    configuration_errors: bool
    context_limit: bool
    vocabulary_errors: bool
    target_errors: bool
    prefix_bitwise: list[bool]
    suffix_changed: bool
    table_checks: int
    gain_checks: int
    tolerance: float
    gradcheck_passed: bool
    stack_gradients: int
    replay_bitwise: bool


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


def run_fixture(fixture: Fixture) -> RunRecord:
    """Build the model for ``(config, seed)`` and run forward, loss and backward once."""
    model = DecoderModel.from_seed(fixture.config, fixture.seed)
    forward = model.forward(fixture.tokens)
    loss = model.loss(fixture.tokens, fixture.targets)
    loss.backward()
    table = model.tied_embedding.tensor
    return RunRecord(
        config=fixture.config,
        seed=fixture.seed,
        tokens=np.asarray(fixture.tokens),
        targets=np.asarray(fixture.targets),
        stages=[(name, stage.value) for name, stage in forward.stages()],
        logits=forward.logits.value,
        loss=float(loss.value),
        parameter_names=model.parameter_names(),
        parameter_count=model.parameter_count(),
        gradients=model.gradients(),
        tied_name=model.tied_embedding.name,
        lookup_and_head=forward.lookup_table.is_same_node(table)
        and forward.head_table.is_same_node(table),
    )


def _refusal_kind(action: Callable[..., object], *arguments: object) -> ErrorKind | None:
    """The kind of error ``action(*arguments)`` raises, or None when it succeeds."""
    try:
        action(*arguments)
    except DecoderModelError as error:
        return error.kind
    return None


def _depths_valid(fixture: Fixture) -> bool:
    """Depths 0, 1 and 2 build, keep ``[B, T, d]`` through every stage, and count right."""
    config = fixture.config
    batch, length = np.asarray(fixture.tokens).shape
    hidden_shape = (batch, length, config.model_width)
    for layers in (0, 1, 2):
        depth_config = dataclasses.replace(config, layers=layers)
        model = DecoderModel.from_seed(depth_config, fixture.seed)
        forward = model.forward(fixture.tokens)
        stages = forward.stages()
        if len(stages) != layers + 2 or any(stage.shape != hidden_shape for _, stage in stages):
            return False
        if forward.logits.shape != (batch, length, config.vocabulary_size):
            return False
        if model.parameter_names() != parameter_names(depth_config):
            return False
        if model.parameter_count() != parameter_count(depth_config):
            return False
        if layers == 0 and not _matches_depth_zero_formula(model, fixture, forward.logits.value):
            return False
    return True


def _matches_depth_zero_formula(model: DecoderModel, fixture: Fixture, logits: Array) -> bool:
    """At depth 0 the logits are ``RMSNorm(E[z]) E^T``, written out in plain numpy."""
    table = model.tied_embedding.tensor.value
    gain = model.final_norm.gain.tensor.value
    rows = table[np.asarray(fixture.tokens)]
    mean_square = (rows * rows).mean(axis=-1, keepdims=True)
    normalized = rows * np.exp(-0.5 * np.log(mean_square + fixture.config.rms_epsilon)) * gain
    return bool(np.allclose(normalized @ table.T, logits, rtol=1e-13, atol=1e-13))


def _configuration_errors(fixture: Fixture) -> bool:
    """Each configuration rule, broken alone at depths 0 and N, gets its kind; nothing is drawn."""
    config = fixture.config
    nan = float("nan")
    probes: list[tuple[dict[str, Any], ErrorKind]] = [
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
        # Precedence: the earliest rule wins when several are broken.
        ({"vocabulary_size": 0, "heads": 0}, ErrorKind.EMPTY_VOCABULARY),
        ({"heads": 0, "rope_base": nan}, ErrorKind.ZERO_HEAD_COUNT),
    ]
    stream = SplitMix64(fixture.seed)
    for layers in (0, config.layers):
        for changes, expected in probes:
            broken = dataclasses.replace(config, layers=layers, **changes)
            if _refusal_kind(DecoderModel.initialize, broken, stream) != expected:
                return False
    return stream.state == fixture.seed


def _input_probes(fixture: Fixture, model: DecoderModel) -> tuple[bool, bool, bool]:
    """Context limit, vocabulary-input and target errors, each with its kind."""
    config = fixture.config
    tokens = np.asarray(fixture.tokens)
    targets = np.asarray(fixture.targets)
    batch = tokens.shape[0]
    full = np.zeros((batch, config.context), dtype=np.int64)
    too_long = np.zeros((batch, config.context + 1), dtype=np.int64)
    context_limit = (
        _refusal_kind(model.forward, full) is None
        and _refusal_kind(model.forward, too_long) is ErrorKind.CONTEXT_LENGTH_EXCEEDED
    )
    out_of_range = tokens.copy()
    out_of_range.flat[-1] = config.vocabulary_size
    negative = tokens.copy()
    negative.flat[0] = -1
    vocabulary = all(
        _refusal_kind(model.forward, bad) is ErrorKind.TOKEN_ID_OUT_OF_BOUNDS
        for bad in (out_of_range, negative)
    )
    missing = targets.reshape(-1)[:-1]
    bad_target = targets.copy()
    bad_target.flat[-1] = config.vocabulary_size
    target = (
        _refusal_kind(model.loss, tokens, missing) is ErrorKind.TARGET_COUNT_MISMATCH
        and _refusal_kind(model.loss, tokens, bad_target) is ErrorKind.TARGET_ID_OUT_OF_BOUNDS
    )
    return context_limit, vocabulary, target


def _causality(fixture: Fixture, model: DecoderModel, logits: Array) -> tuple[list[bool], bool]:
    """Change only the last token of every sequence and compare full-length runs."""
    tokens = np.asarray(fixture.tokens)
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % fixture.config.vocabulary_size
    after = model.forward(changed).logits.value
    length = tokens.shape[1]
    prefix = [
        logits[:, position].tobytes() == after[:, position].tobytes()
        for position in range(length - 1)
    ]
    suffix = bool(np.all(np.any(logits[:, -1] != after[:, -1], axis=-1)))
    return prefix, suffix


def _probe_parameters(
    fixture: Fixture, model: DecoderModel
) -> tuple[DecoderConfig, list[tuple[str, Array]]]:
    """The zero-block probe: the seed's published probe, or the model's own table and gain."""
    if fixture.probe_table:
        return seed_probe()
    config = dataclasses.replace(fixture.config, layers=0)
    table = model.tied_embedding.tensor.value.copy()
    gain = model.final_norm.gain.tensor.value.copy()
    return config, [(EMBEDDING_NAME, table), (FINAL_NORM_NAME, gain)]


def _probe_loss(
    config: DecoderConfig, parameters: list[tuple[str, Array]], fixture: Fixture
) -> float:
    probe = DecoderModel.from_parameters(config, parameters)
    return float(probe.loss(fixture.probe_tokens, fixture.probe_targets).value)


def _probe_gradients(
    config: DecoderConfig,
    parameters: list[tuple[str, Array]],
    fixture: Fixture,
    *,
    lookup: bool,
    head: bool,
) -> dict[str, Array]:
    """The probe's table and gain gradients with the lookup or the head use detached."""
    probe = DecoderModel.from_parameters(config, parameters)
    loss = probe.loss(
        fixture.probe_tokens, fixture.probe_targets, detach_lookup=not lookup, detach_head=not head
    )
    loss.backward()
    return {
        p.name: np.zeros(p.shape) if p.tensor.grad is None else p.tensor.grad
        for p in probe.parameters()
    }


def collect_evidence(fixture: Fixture) -> Evidence:
    """Run the fixture and every probe the report and trace describe."""
    run = run_fixture(fixture)
    model = DecoderModel.from_seed(fixture.config, fixture.seed)
    replay = DecoderModel.from_seed(fixture.config, fixture.seed).forward(fixture.tokens)
    predictions = [int(row.argmax()) for row in run.logits.reshape(-1, run.logits.shape[-1])]
    context_limit, vocabulary, target = _input_probes(fixture, model)
    prefix, suffix = _causality(fixture, model, run.logits)

    probe_config, probe = _probe_parameters(fixture, model)
    full = _probe_gradients(probe_config, probe, fixture, lookup=True, head=True)
    lookup_only = _probe_gradients(probe_config, probe, fixture, lookup=True, head=False)
    head_only = _probe_gradients(probe_config, probe, fixture, lookup=False, head=True)
    decomposition = float(
        np.max(
            np.abs(full[EMBEDDING_NAME] - lookup_only[EMBEDDING_NAME] - head_only[EMBEDDING_NAME])
        )
    )
    checks = central_difference_checks(
        probe,
        full,
        lambda shifted: _probe_loss(probe_config, shifted, fixture),
        step=fixture.gradient_step,
        tolerance=fixture.gradient_tolerance,
        samples=GRADCHECK_SAMPLES,
    )
    table_checks = sum(1 for check in checks if check.name == EMBEDDING_NAME)
    stack_gradients = sum(
        1
        for gradient in run.gradients.values()
        if gradient is not None and np.all(np.isfinite(gradient))
    )
    return Evidence(
        run=run,
        predictions=predictions,
        decomposition_error=decomposition,
        bias_free=not any("bias" in name for name in run.parameter_names),
        stable_order=run.parameter_names == parameter_names(fixture.config),
        depths_valid=_depths_valid(fixture),
        configuration_errors=_configuration_errors(fixture),
        context_limit=context_limit,
        vocabulary_errors=vocabulary,
        target_errors=target,
        prefix_bitwise=prefix,
        suffix_changed=suffix,
        table_checks=table_checks,
        gain_checks=len(checks) - table_checks,
        tolerance=fixture.gradient_tolerance,
        gradcheck_passed=all(check.passed for check in checks)
        and stack_gradients == len(run.parameter_names),
        stack_gradients=stack_gradients,
        replay_bitwise=run.logits.tobytes() == replay.logits.value.tobytes(),
    )
