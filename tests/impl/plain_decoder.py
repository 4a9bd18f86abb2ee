"""An independent plain-numpy decoder written from RECIPE.md, for cross-checking ``impl``.

It shares no code with ``impl``: no tape, no layers. Every operation is analytic and
written so that it also runs on complex128 values, which gives exact-to-rounding
gradients by the complex-step method: for a real function f,
``f'(x) = Im f(x + i h) / h + O(h^2)`` with no subtraction, so h = 1e-30 leaves only
float64 rounding. Comparisons (the softmax shift) use the real part, which is exact for
a shift-invariant operation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig

Values = npt.NDArray[np.complex128] | npt.NDArray[np.float64]
COMPLEX_STEP = 1e-30


@dataclass
class PlainRun:
    """Stages, logits and mean loss of one plain forward pass."""

    stages: list[Values]
    logits: Values
    loss: Values


def _rms_norm(x: Values, gain: Values, epsilon: float) -> Values:
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    return x * np.exp(-0.5 * np.log(mean_square + epsilon)) * gain


def _rope(x: Values, base: float) -> Values:
    """Interleaved pairs: (2j, 2j+1) rotated by position * base^(-2j/hw)."""
    length, head_width = x.shape[-2], x.shape[-1]
    frequencies = base ** (-2.0 * np.arange(head_width // 2) / head_width)
    angles = np.arange(length)[:, None] * frequencies
    cos, sin = np.cos(angles), np.sin(angles)
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = np.empty_like(x)
    rotated[..., 0::2] = even * cos - odd * sin
    rotated[..., 1::2] = even * sin + odd * cos
    return rotated


def _attention(x: Values, weights: dict[str, Values], prefix: str, config: DecoderConfig) -> Values:
    batch, length, width = x.shape
    heads, head_width = config.heads, width // config.heads

    def heads_first(projected: Values) -> Values:
        return projected.reshape(batch, length, heads, head_width).transpose(0, 2, 1, 3)

    query = _rope(heads_first(x @ weights[f"{prefix}.query.weight"]), config.rope_base)
    key = _rope(heads_first(x @ weights[f"{prefix}.key.weight"]), config.rope_base)
    value = heads_first(x @ weights[f"{prefix}.value.weight"])
    scores = query @ key.transpose(0, 1, 3, 2) / np.sqrt(head_width)
    allowed = np.tril(np.ones((length, length), dtype=bool))
    shift = np.max(np.where(allowed, scores.real, -np.inf), axis=-1, keepdims=True)
    exponentials = np.where(allowed, np.exp(np.where(allowed, scores, 0.0) - shift), 0.0)
    probabilities = exponentials / exponentials.sum(axis=-1, keepdims=True)
    mixed = (probabilities @ value).transpose(0, 2, 1, 3).reshape(batch, length, width)
    return mixed @ weights[f"{prefix}.output.weight"]


def _swiglu(x: Values, weights: dict[str, Values], prefix: str) -> Values:
    gate = x @ weights[f"{prefix}.gate.weight"]
    silu = gate / (1.0 + np.exp(-gate))
    return (silu * (x @ weights[f"{prefix}.up.weight"])) @ weights[f"{prefix}.down.weight"]


def plain_forward(
    config: DecoderConfig,
    weights: dict[str, Values],
    tokens: npt.NDArray[np.intp],
    targets: npt.NDArray[np.intp],
) -> PlainRun:
    """Embedding, pre-norm blocks, final norm, tied ``E^T`` head and mean NLL."""
    table = weights["token_embedding.weight"]
    hidden = table[tokens]
    stages = [hidden]
    for layer in range(config.layers):
        prefix = f"blocks.{layer}"
        normed = _rms_norm(hidden, weights[f"{prefix}.attention_norm.gain"], config.rms_epsilon)
        hidden = hidden + _attention(normed, weights, f"{prefix}.attention", config)
        normed = _rms_norm(hidden, weights[f"{prefix}.ffn_norm.gain"], config.rms_epsilon)
        hidden = hidden + _swiglu(normed, weights, f"{prefix}.ffn")
        stages.append(hidden)
    final = _rms_norm(hidden, weights["final_norm.gain"], config.rms_epsilon)
    stages.append(final)
    logits = final @ table.T
    rows = logits.reshape(-1, config.vocabulary_size)
    shift = rows.real.max(axis=-1, keepdims=True)
    log_normalizer = shift[:, 0] + np.log(np.exp(rows - shift).sum(axis=-1))
    picked = rows[np.arange(rows.shape[0]), targets.reshape(-1)]
    return PlainRun(stages, logits, np.mean(log_normalizer - picked))


def complex_step_gradients(
    config: DecoderConfig,
    weights: dict[str, npt.NDArray[np.float64]],
    tokens: npt.NDArray[np.intp],
    targets: npt.NDArray[np.intp],
) -> dict[str, npt.NDArray[np.float64]]:
    """d loss / d every parameter scalar, one complex-step forward pass per scalar."""
    gradients: dict[str, npt.NDArray[np.float64]] = {}
    for name, value in weights.items():
        gradient = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            perturbed: dict[str, Values] = dict(weights)
            shifted = value.astype(np.complex128)
            shifted[index] += 1j * COMPLEX_STEP
            perturbed[name] = shifted
            loss = plain_forward(config, perturbed, tokens, targets).loss
            gradient[index] = float(np.imag(loss)) / COMPLEX_STEP
        gradients[name] = gradient
    return gradients
