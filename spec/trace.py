"""The seed's formats: an evidence record as the 14-line learner report, the trace, or JSON.

Floats print with six decimals (the decomposition error with twelve), as the seed's
program prints them; JSON floats use ``repr``, which round-trips every float64 exactly.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from spec.config import FIXTURE, DecoderConfig
from spec.evidence import Array, Evidence, RunRecord

__all__ = ["render_report", "render_trace", "trace_json"]

NEXT_STEP = "train this decoder and select a state with validation loss only"


def _decimals(values: Array | list[float]) -> str:
    return "[" + ",".join(f"{float(value):.6f}" for value in np.ravel(values)) + "]"


def _integers(values: Array | list[int]) -> str:
    return "[" + ",".join(str(int(value)) for value in np.ravel(values)) + "]"


def _shape(shape: tuple[int, ...], separator: str) -> str:
    return "[" + separator.join(str(size) for size in shape) + "]"


UNAVAILABLE = "unavailable"  # the backend lacks the capability that would show it


def _flag(value: bool | None) -> str:
    if value is None:
        return UNAVAILABLE
    return "true" if value else "false"


def _decimal(value: float | None, digits: int) -> str:
    return UNAVAILABLE if value is None else f"{value:.{digits}f}"


def _evidence_fields(evidence: Evidence) -> dict[str, str]:
    """The values shared by the report's and the trace's closing lines."""
    run = evidence.run
    vocabulary_by_width = run.config.vocabulary_size * run.config.model_width
    untied = run.parameter_count + vocabulary_by_width
    prefixes = " ".join(
        f"prefix_{position}_bitwise{{sep}}{_flag(flag)}"
        for position, flag in enumerate(evidence.prefix_bitwise)
    )
    return {
        "tying": (
            f"name{{sep}}{run.tied_name} lookup_and_head{{sep}}{_flag(run.lookup_and_head)} "
            f"gradient_roles{{sep}}lookup+output "
            f"decomposition_error{{sep}}{_decimal(evidence.decomposition_error, 12)}"
        ),
        "parameters": (
            f"tensors{{sep}}{len(run.parameter_names)} scalars{{sep}}{run.parameter_count} "
            f"untied_scalars{{sep}}{untied} saved{{sep}}{untied - run.parameter_count} "
            f"bias_free{{sep}}{_flag(evidence.bias_free)} "
            f"stable_order{{sep}}{_flag(evidence.stable_order)}"
        ),
        "depths": (
            f"zero_one_two{{sep}}{_flag(evidence.depths_valid)} "
            f"configuration_errors{{sep}}{_flag(evidence.configuration_errors)} "
            f"context_limit{{sep}}{_flag(evidence.context_limit)} "
            f"vocabulary_errors{{sep}}{_flag(evidence.vocabulary_errors)} "
            f"target_errors{{sep}}{_flag(evidence.target_errors)}"
        ),
        "causality": (
            (prefixes + " " if prefixes else "")
            + f"suffix_changed{{sep}}{_flag(evidence.suffix_changed)}"
        ),
        "gradcheck": (
            f"tied_table{{sep}}{evidence.table_checks} final_norm{{sep}}{evidence.gain_checks} "
            f"total{{sep}}{evidence.table_checks + evidence.gain_checks} "
            f"tolerance{{sep}}{evidence.tolerance:.6f} "
            f"passed{{sep}}{_flag(evidence.gradcheck_passed)} "
            f"stack_gradients{{sep}}"
            f"{UNAVAILABLE if evidence.stack_gradients is None else evidence.stack_gradients}"
            f"/{len(run.parameter_names)}"
        ),
        "replay": f"bitwise{{sep}}{_flag(evidence.replay_bitwise)}",
    }


def _closing_lines(evidence: Evidence, joiner: str, separator: str) -> list[str]:
    return [
        f"{key}{joiner}{text.replace('{sep}', separator)}"
        for key, text in _evidence_fields(evidence).items()
    ]


def render_report(evidence: Evidence) -> str:
    """The learner report: the seed's 14 lines for its two-block fixture."""
    run = evidence.run
    config = run.config
    batch, length = run.tokens.shape
    stage_shapes = " ".join(
        f"{name.replace('-', '_')}:{_shape(values.shape, ', ')}" for name, values in run.stages
    )
    predictions = " ".join(
        f"token_{position}:{prediction}" for position, prediction in enumerate(evidence.predictions)
    )
    second_row = run.logits.reshape(-1, config.vocabulary_size)[min(1, batch * length - 1)]
    lines = [
        "chapter=32-decoder-model",
        f"config=batch:{batch} tokens:{length} vocabulary:{config.vocabulary_size} "
        f"model_width:{config.model_width} layers:{config.layers} heads:{config.heads} "
        f"head_width:{config.head_width} feed_forward_width:{config.feed_forward_width} "
        f"context:{config.context}",
        f"shape={stage_shapes} logits:{_shape(run.logits.shape, ', ')}",
        f"token_1_logits={_decimals(second_row)}",
        f"targets={_integers(run.targets)} mean_loss:{run.loss:.6f}",
        f"prediction={predictions}",
        *_closing_lines(evidence, "=", ":"),
        f"next={NEXT_STEP}",
    ]
    return "\n".join(lines) + "\n"


def _config_line(run: RunRecord) -> str:
    config = run.config
    batch, length = run.tokens.shape
    line = (
        f"config batch={batch} tokens={length} vocabulary={config.vocabulary_size} "
        f"model_width={config.model_width} layers={config.layers} heads={config.heads} "
        f"feed_forward_width={config.feed_forward_width} context={config.context}"
    )
    # The seed's line omits the constants it never varies; record them when they differ.
    reference = FIXTURE.config
    if config.rope_base != reference.rope_base:
        line += f" rope_base={config.rope_base!r}"
    if config.rms_epsilon != reference.rms_epsilon:
        line += f" rms_epsilon={config.rms_epsilon!r}"
    if run.seed != FIXTURE.seed:
        line += f" seed={run.seed}"
    return line


def _row_label(batch: int, row: int, length: int) -> str:
    position = row % length
    return f"token={position}" if batch == 1 else f"batch={row // length} token={position}"


def render_trace(evidence: Evidence) -> str:
    """The ``DECODER_MODEL_TRACE_V1`` evidence record (28 lines for the seed's fixture)."""
    run = evidence.run
    batch, length = run.tokens.shape
    lines = [
        "DECODER_MODEL_TRACE_V1",
        _config_line(run),
        f"tokens shape={_shape(run.tokens.shape, ',')} values={_integers(run.tokens)}",
        f"targets values={_integers(run.targets)}",
    ]
    for name, values in run.stages:
        rows = values.reshape(batch * length, -1)
        lines.extend(
            f"stage name={name} shape={_shape(values.shape, ',')} "
            f"{_row_label(batch, row, length)} values={_decimals(rows[row])}"
            for row in range(batch * length)
        )
    logit_rows = run.logits.reshape(batch * length, -1)
    lines.extend(
        f"logits {_row_label(batch, row, length)} values={_decimals(logit_rows[row])}"
        for row in range(batch * length)
    )
    lines.append(f"predictions values={_integers(evidence.predictions)}")
    lines.append(f"loss mean={run.loss:.6f}")
    lines.extend(_closing_lines(evidence, " ", "="))
    lines.append("END_DECODER_MODEL_TRACE")
    return "\n".join(lines) + "\n"


def _config_dict(config: DecoderConfig) -> dict[str, Any]:
    fields = config.as_dict()
    fields["head_width"] = config.head_width
    return fields


def trace_json(run: RunRecord) -> str:
    """One JSON object: config, tokens, targets, stages, logits, loss, parameters, gradients."""
    document = {
        "format": "decoder-model-trace-json",
        "format_version": 1,
        "config": _config_dict(run.config),
        "seed": run.seed,
        "tokens": run.tokens.tolist(),
        "targets": run.targets.tolist(),
        "stages": [
            {"name": name, "shape": list(values.shape), "values": values.ravel().tolist()}
            for name, values in run.stages
        ],
        "logits": run.logits.ravel().tolist(),
        "logits_shape": list(run.logits.shape),
        "loss": run.loss,
        "parameter_count": run.parameter_count,
        "parameter_names": run.parameter_names,
        "gradients": {
            name: None if gradient is None else gradient.ravel().tolist()
            for name, gradient in run.gradients.items()
        },
    }
    return json.dumps(document, allow_nan=False) + "\n"
