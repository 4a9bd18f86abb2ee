"""Any backend's evidence trace, gathered through the adapter protocol, and its first departure
from the reference's.

``decoder-conformance trace --adapter NAME`` runs a fixture (the seed's, or any
configuration) on a backend and prints the seed's ``DECODER_MODEL_TRACE_V1`` record: every
stage row and logit, the predictions and the loss, then the closing lines as far as the
backend's capabilities show them (``unavailable`` otherwise). Ties are seen through
behaviour here (a changed table row moves both its lookup and its logit column), not through
identity, which an adapter does not expose. ``--diff`` names the first stage, row and
feature at which the backend departs from the reference, with both values.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import Backend, Refusal, call_build_seeded, call_initialize
from spec.config import Fixture
from spec.errors import ErrorCategory, ErrorKind
from spec.evidence import (
    GRADCHECK_SAMPLES,
    Evidence,
    RunRecord,
    causality,
    configuration_probes,
    depth_zero_logits,
    input_probes,
    last_token_changed,
    probe_parameters,
)
from spec.gradcheck import central_difference_checks
from spec.oracle import oracle_forward, precision
from spec.parameters import EMBEDDING_NAME, FINAL_NORM_NAME, parameter_count, parameter_names
from spec.recipe import SplitMix64, initial_parameters
from spec.rules import Capability
from spec.shapes import stage_names
from spec.tolerances import scaled_error, tolerance_for

__all__ = ["Departure", "collect_trace", "first_departure", "run_record"]

Array = npt.NDArray[np.float64]


def _refusal_kind(action: Callable[[], object]) -> ErrorKind | str | None:
    """The kind of Refusal ``action()`` raises, None when it succeeds, or the name of any
    other exception it raises."""
    try:
        action()
    except Refusal as refusal:
        return refusal.kind
    except Exception as error:
        return type(error).__name__
    return None


def run_record(backend: Backend, fixture: Fixture) -> RunRecord:
    """Forward, loss and gradients of ``fixture`` on ``backend`` (the trace's data lines)."""
    return _run(backend, fixture)[0]


def _run(backend: Backend, fixture: Fixture) -> tuple[RunRecord, Any]:
    config = fixture.config
    parameters = initial_parameters(config, fixture.seed)
    model = backend.build(config, parameters)
    forward = backend.forward(model, fixture.tokens)
    loss = backend.loss(model, fixture.tokens, fixture.targets)
    listed = backend.parameters(model)
    record = RunRecord(
        config=config,
        seed=fixture.seed,
        tokens=np.asarray(fixture.tokens),
        targets=np.asarray(fixture.targets),
        stages=[(n, np.asarray(v, dtype=np.float64)) for n, v in forward.stages or []],
        logits=np.asarray(forward.logits, dtype=np.float64),
        loss=float(loss.loss),
        parameter_names=[name for name, _ in listed],
        parameter_count=sum(int(np.asarray(value).size) for _, value in listed),
        gradients={} if loss.gradients is None else dict(loss.gradients),
        tied_name=EMBEDDING_NAME,
        lookup_and_head=_tie_seen(backend, fixture, parameters),
    )
    return record, model


def _tie_seen(backend: Backend, fixture: Fixture, parameters: list[tuple[str, Array]]) -> bool:
    """A changed table row moves both its lookup (when stages show it) and its logit column."""
    row = int(np.asarray(fixture.tokens).flat[0])
    changed = [(name, value.copy()) for name, value in parameters]
    changed[0][1][row] += 0.25
    before = backend.forward(backend.build(fixture.config, parameters), fixture.tokens)
    after = backend.forward(backend.build(fixture.config, changed), fixture.tokens)
    moved = bool(np.all(np.any(before.logits[..., row] != after.logits[..., row], axis=-1)))
    if after.stages is not None:
        looked_up = dict(after.stages)["embedding"][np.asarray(fixture.tokens) == row]
        moved = moved and bool(np.allclose(looked_up, changed[0][1][row], rtol=1e-6, atol=1e-6))
    return moved


def _depths_valid(backend: Backend, fixture: Fixture) -> bool:
    config = fixture.config
    batch, length = np.asarray(fixture.tokens).shape
    for layers in (0, 1, 2):
        depth = dataclasses.replace(config, layers=layers)
        parameters = initial_parameters(depth, fixture.seed)
        model = backend.build(depth, parameters)
        output = backend.forward(model, fixture.tokens)
        listed = backend.parameters(model)
        if output.logits.shape != (batch, length, config.vocabulary_size):
            return False
        if [name for name, _ in listed] != parameter_names(depth):
            return False
        if sum(int(np.asarray(v).size) for _, v in listed) != parameter_count(depth):
            return False
        if output.stages is not None and (
            [name for name, _ in output.stages] != stage_names(layers)
            or any(v.shape != (batch, length, config.model_width) for _, v in output.stages)
        ):
            return False
        if layers == 0:
            tolerance = tolerance_for(backend.precision).at(depth, length).logits
            table, gain = dict(parameters)[EMBEDDING_NAME], dict(parameters)[FINAL_NORM_NAME]
            expected = depth_zero_logits(depth, table, gain, fixture.tokens)
            if not np.all(scaled_error(output.logits, expected) <= tolerance):
                return False
    return True


def _configuration_errors(backend: Backend, fixture: Fixture) -> bool:
    config = fixture.config
    stream = SplitMix64(fixture.seed)
    seeded = Capability.STREAM_INIT in backend.capabilities
    for layers in (0, config.layers):
        for changes, expected in configuration_probes(config):
            broken = dataclasses.replace(config, layers=layers, **changes)
            if _refusal_kind(functools.partial(backend.build, broken, [])) is not expected:
                return False
            initialize = functools.partial(call_initialize, backend, broken, stream)
            if seeded and _refusal_kind(initialize) is not expected:
                return False
    return stream.state == fixture.seed


def _input_errors(backend: Backend, fixture: Fixture, model: Any) -> tuple[bool | None, bool, bool]:
    probes = input_probes(fixture)
    full = _refusal_kind(lambda: backend.forward(model, probes.full))
    context: bool | None
    if isinstance(full, ErrorKind) and full.category is ErrorCategory.RESOURCE:
        # The backend cannot hold a pass as long as the context here: not shown, not failed.
        context = None
    else:
        context = full is None and (
            _refusal_kind(lambda: backend.forward(model, probes.too_long))
            is ErrorKind.CONTEXT_LENGTH_EXCEEDED
        )
    vocabulary = all(
        _refusal_kind(functools.partial(backend.forward, model, bad))
        is ErrorKind.TOKEN_ID_OUT_OF_BOUNDS
        for bad in (probes.out_of_range, probes.negative)
    )
    tokens = fixture.tokens
    target = (
        _refusal_kind(lambda: backend.loss(model, tokens, probes.missing_target))
        is ErrorKind.TARGET_COUNT_MISMATCH
        and _refusal_kind(lambda: backend.loss(model, tokens, probes.bad_target))
        is ErrorKind.TARGET_ID_OUT_OF_BOUNDS
    )
    return context, vocabulary, target


def _gradients(
    backend: Backend, fixture: Fixture, run: RunRecord
) -> tuple[float | None, int, int, bool, int]:
    """The tied decomposition (with tied-roles) and the seed's central-difference check."""
    table = np.asarray(dict(initial_parameters(fixture.config, fixture.seed))[EMBEDDING_NAME])
    gain = np.ones(fixture.config.model_width)
    config, probe = probe_parameters(fixture, table, gain)
    model = backend.build(config, probe)

    def gradients(**detach: bool) -> Mapping[str, Any]:
        output = backend.loss(model, fixture.probe_tokens, fixture.probe_targets, **detach)
        return output.gradients or {}

    full = gradients()
    decomposition = None
    if Capability.TIED_ROLES in backend.capabilities:
        lookup, head = gradients(detach_head=True), gradients(detach_lookup=True)
        decomposition = float(
            np.max(np.abs(full[EMBEDDING_NAME] - lookup[EMBEDDING_NAME] - head[EMBEDDING_NAME]))
        )
    # The difference quotients come from the oracle's loss (as in GRAD-SEED-CHECK), so the
    # check means the same for a float32 backend as for a float64 one.
    with precision(30):
        checks = central_difference_checks(
            probe,
            {name: np.asarray(value, dtype=np.float64) for name, value in full.items()},
            lambda shifted: oracle_forward(
                config, shifted, fixture.probe_tokens, fixture.probe_targets, digits=30
            ).mean_loss(),
            step=fixture.gradient_step,
            tolerance=fixture.gradient_tolerance,
            samples=GRADCHECK_SAMPLES,
        )
    table_checks = sum(1 for check in checks if check.name == EMBEDDING_NAME)
    finite = sum(
        1
        for name in run.parameter_names
        if name in run.gradients and np.all(np.isfinite(np.asarray(run.gradients[name])))
    )
    passed = all(check.passed for check in checks) and finite == len(run.parameter_names)
    return decomposition, table_checks, len(checks) - table_checks, passed, finite


def collect_trace(backend: Backend, fixture: Fixture) -> Evidence:
    """The evidence record of ``fixture`` on ``backend``, as far as its capabilities go."""
    capabilities = set(backend.capabilities)
    run, model = _run(backend, fixture)
    predictions = [int(row.argmax()) for row in run.logits.reshape(-1, run.logits.shape[-1])]
    after = np.asarray(backend.forward(model, last_token_changed(fixture)).logits)
    prefix, suffix = causality(run.logits, after)
    inputs: tuple[bool | None, bool | None, bool | None] = (None, None, None)
    if Capability.INPUT_ERRORS in capabilities:
        inputs = _input_errors(backend, fixture, model)
    decomposition, table_checks, gain_checks = None, 0, 0
    passed: bool | None = None
    finite: int | None = None
    if Capability.GRADIENTS in capabilities:
        decomposition, table_checks, gain_checks, passed, finite = _gradients(backend, fixture, run)
    replay = None
    if Capability.SEEDED_INIT in capabilities:
        seeded = [call_build_seeded(backend, fixture.config, fixture.seed) for _ in range(2)]
        first, second = (backend.forward(model, fixture.tokens) for model in seeded)
        replay = first.logits.tobytes() == second.logits.tobytes() == run.logits.tobytes()
    return Evidence(
        run=run,
        predictions=predictions,
        decomposition_error=decomposition,
        bias_free=not any("bias" in name for name in run.parameter_names),
        stable_order=run.parameter_names == parameter_names(fixture.config),
        depths_valid=_depths_valid(backend, fixture),
        configuration_errors=(
            _configuration_errors(backend, fixture)
            if Capability.CONFIG_ERRORS in capabilities
            else None
        ),
        context_limit=inputs[0],
        vocabulary_errors=inputs[1],
        target_errors=inputs[2],
        prefix_bitwise=prefix,
        suffix_changed=suffix,
        table_checks=table_checks,
        gain_checks=gain_checks,
        tolerance=fixture.gradient_tolerance,
        gradcheck_passed=passed,
        stack_gradients=finite,
        replay_bitwise=replay,
    )


@dataclass(frozen=True)
class Departure:
    """Where a backend's run first leaves the reference's, beyond the backend's tolerance."""

    what: str  # "stage block-0", "logits", "loss"
    row: tuple[int, int]  # (batch, token)
    feature: int
    got: float
    expected: float
    error: float
    tolerance: float

    def __str__(self) -> str:
        batch, token = self.row
        where = f"{self.what} batch={batch} token={token} feature={self.feature}"
        if self.what == "loss":
            where = "loss"
        return (
            f"first departure: {where}: backend {self.got!r}, reference {self.expected!r} "
            f"(scaled error {self.error:.3e}, tolerance {self.tolerance:.3g})"
        )


def first_departure(
    backend_run: RunRecord, reference_run: RunRecord, tolerance: float
) -> Departure | None:
    """The first stage (in order), row and feature beyond ``tolerance``, then the logits and
    the loss; None when the two runs agree."""
    reference_stages = dict(reference_run.stages)
    pairs = [
        (f"stage {n}", v, reference_stages[n])
        for n, v in backend_run.stages
        if n in reference_stages
    ]
    pairs.append(("logits", backend_run.logits, reference_run.logits))
    for what, got, expected in pairs:
        if got.shape != expected.shape:
            return Departure(what, (0, 0), 0, float("nan"), float("nan"), float("inf"), tolerance)
        errors = scaled_error(got, expected)
        over = ~(errors <= tolerance)
        if over.any():
            batch, token, feature = (int(i) for i in np.argwhere(over)[0])
            return Departure(
                what,
                (batch, token),
                feature,
                float(got[batch, token, feature]),
                float(expected[batch, token, feature]),
                float(errors[batch, token, feature]),
                tolerance,
            )
    error = float(scaled_error(backend_run.loss, reference_run.loss))
    if not error <= tolerance:
        return Departure("loss", (0, 0), 0, backend_run.loss, reference_run.loss, error, tolerance)
    return None
