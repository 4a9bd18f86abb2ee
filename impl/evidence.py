"""The evidence behind the seed's report and trace, gathered from one deterministic run.

Nothing here prints a constant where a measurement belongs: shapes, logits, the loss,
the tying decomposition, the error probes, causality, the gradient checks and the
replay all come from running the reference model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from impl import resources
from impl.errors import ActivationAllocationFailed, DecoderModelError
from impl.model import DecoderModel
from impl.tape import Array
from spec.config import DecoderConfig, Fixture
from spec.errors import ErrorKind
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
from spec.parameters import EMBEDDING_NAME, parameter_count, parameter_names
from spec.recipe import SplitMix64

__all__ = ["collect_evidence", "require_probe_memory", "run_fixture"]


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
    expected = depth_zero_logits(fixture.config, table, gain, fixture.tokens)
    return bool(np.allclose(expected, logits, rtol=1e-13, atol=1e-13))


def _configuration_errors(fixture: Fixture) -> bool:
    """Each configuration rule, broken alone at depths 0 and N, gets its kind; nothing is drawn."""
    config = fixture.config
    stream = SplitMix64(fixture.seed)
    for layers in (0, config.layers):
        for changes, expected in configuration_probes(config):
            broken = dataclasses.replace(config, layers=layers, **changes)
            if _refusal_kind(DecoderModel.initialize, broken, stream) != expected:
                return False
    return stream.state == fixture.seed


def require_probe_memory(fixture: Fixture) -> None:
    """Refuse, before any probe is built, a fixture whose context probe (a forward pass over
    a sequence as long as the context, and its token arrays) needs more than the bound."""
    config = fixture.config
    batch = np.asarray(fixture.tokens).shape[0]
    tokens = 2 * batch * (config.context + 1) * np.dtype(np.int64).itemsize
    needed = resources.forward_bytes(config, batch, config.context) + tokens
    bound = resources.memory_limit()
    if needed > bound.bytes:
        raise ActivationAllocationFailed(
            operation="the trace's context probe (a forward pass)",
            batch=batch,
            tokens=config.context,
            needed_bytes=needed,
            limit_bytes=bound.bytes,
            limit_source=bound.source,
        )


def _input_probes(fixture: Fixture, model: DecoderModel) -> tuple[bool, bool, bool]:
    """Context limit, vocabulary-input and target errors, each with its kind."""
    probes = input_probes(fixture)
    tokens = np.asarray(fixture.tokens)
    context_limit = (
        _refusal_kind(model.forward, probes.full) is None
        and _refusal_kind(model.forward, probes.too_long) is ErrorKind.CONTEXT_LENGTH_EXCEEDED
    )
    vocabulary = all(
        _refusal_kind(model.forward, bad) is ErrorKind.TOKEN_ID_OUT_OF_BOUNDS
        for bad in (probes.out_of_range, probes.negative)
    )
    target = (
        _refusal_kind(model.loss, tokens, probes.missing_target) is ErrorKind.TARGET_COUNT_MISMATCH
        and _refusal_kind(model.loss, tokens, probes.bad_target)
        is ErrorKind.TARGET_ID_OUT_OF_BOUNDS
    )
    return context_limit, vocabulary, target


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
    """Run the fixture and every probe the report and trace describe.

    The fixture's own run comes first (it checks the configuration, the seed, the tokens
    and the targets in the seed's order); the context probe's memory is checked next,
    before any probe is built.
    """
    run = run_fixture(fixture)
    require_probe_memory(fixture)
    model = DecoderModel.from_seed(fixture.config, fixture.seed)
    replay = DecoderModel.from_seed(fixture.config, fixture.seed).forward(fixture.tokens)
    predictions = [int(row.argmax()) for row in run.logits.reshape(-1, run.logits.shape[-1])]
    context_limit, vocabulary, target = _input_probes(fixture, model)
    after = model.forward(last_token_changed(fixture)).logits.value
    prefix, suffix = causality(run.logits, after)

    probe_config, probe = probe_parameters(
        fixture, model.tied_embedding.tensor.value, model.final_norm.gain.tensor.value
    )
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
