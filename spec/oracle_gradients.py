"""Oracle gradients: d loss / d every parameter scalar, in mpmath, with an error estimate.

Two independent methods:

- ``adjoint`` (the default): the chain rule written out by hand over the oracle's own
  intermediates, in exact arithmetic's terms. One forward and one backward pass give every
  scalar. Its error estimate is the disagreement between two precisions (the method has no
  truncation error, only rounding).
- ``central``: central differences of the oracle's loss at high precision, with steps h and
  2h; the estimate is ``|D(h) - D(2h)|`` and the value the Richardson combination. It
  shares nothing with the adjoint, so the project's tests use it to certify the adjoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mpmath
import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig
from spec.oracle import (
    DEFAULT_DIGITS,
    BlockCache,
    MpArray,
    NormCache,
    merge_heads,
    oracle_forward,
    oracle_forward_exact,
    precision,
    rotate_pairs,
    split_heads,
    to_float64,
    to_mp,
)
from spec.parameters import EMBEDDING_NAME, FINAL_NORM_NAME

__all__ = ["OracleGradients", "oracle_gradients"]

FloatArray = npt.NDArray[np.float64]
_exp = np.frompyfunc(mpmath.exp, 1, 1)


@dataclass
class OracleGradients:
    """Every parameter's gradient rounded to float64, and an estimate of its own error."""

    method: str
    digits: int
    gradients: dict[str, FloatArray]
    error_estimate: dict[str, FloatArray]

    def max_error_estimate(self) -> float:
        """The largest estimated error over all scalars."""
        return max(
            (float(np.max(e, initial=0.0)) for e in self.error_estimate.values()), default=0.0
        )


def _sum_rows(x: MpArray) -> MpArray:
    """Sum over every axis but the last."""
    result: MpArray = x.reshape(-1, x.shape[-1]).sum(axis=0)
    return result


def _weight_gradient(inputs: MpArray, upstream: MpArray) -> MpArray:
    """``d(x @ W)/dW`` contracted with the upstream gradient: ``x^T @ g`` over all rows."""
    result: MpArray = inputs.reshape(-1, inputs.shape[-1]).T @ upstream.reshape(
        -1, upstream.shape[-1]
    )
    return result


def _rms_backward(cache: NormCache, upstream: MpArray) -> tuple[MpArray, MpArray]:
    """Gradients of ``y = x r g`` with ``r = (mean(x^2) + eps)^(-1/2)``: for x and for g."""
    width = cache.x.shape[-1]
    gain_gradient = _sum_rows(upstream * cache.x * cache.inverse_root)
    scaled = upstream * cache.gain
    projection = (scaled * cache.x).sum(axis=-1, keepdims=True) / width
    x_gradient: MpArray = cache.inverse_root * scaled - cache.x * cache.inverse_root**3 * projection
    return x_gradient, gain_gradient


def _block_backward(
    upstream: MpArray,
    cache: BlockCache,
    weights: Mapping[str, MpArray],
    layer: int,
    config: DecoderConfig,
) -> tuple[MpArray, dict[str, MpArray]]:
    """Gradient for the block's input and for its nine parameters."""

    def w(name: str) -> MpArray:
        return weights[f"blocks.{layer}.{name}"]

    grads: dict[str, MpArray] = {}
    heads, head_width = config.heads, config.model_width // config.heads
    # Feed-forward branch: out = h + (silu(gate) * up) @ W_down.
    grads["ffn.down.weight"] = _weight_gradient(cache.product, upstream)
    product_gradient = upstream @ w("ffn.down.weight").T
    silu = cache.gate * cache.sigmoid
    up_gradient = product_gradient * silu
    gate_gradient = (
        product_gradient * cache.up * cache.sigmoid * (1 + cache.gate * (1 - cache.sigmoid))
    )
    grads["ffn.gate.weight"] = _weight_gradient(cache.ffn_input, gate_gradient)
    grads["ffn.up.weight"] = _weight_gradient(cache.ffn_input, up_gradient)
    ffn_input_gradient = gate_gradient @ w("ffn.gate.weight").T + up_gradient @ w("ffn.up.weight").T
    hidden_from_ffn, grads["ffn_norm.gain"] = _rms_backward(cache.ffn_norm, ffn_input_gradient)
    hidden_gradient = upstream + hidden_from_ffn
    # Attention branch: h = x + merge(softmax(q k^T / sqrt(hw)) v) @ W_out.
    grads["attention.output.weight"] = _weight_gradient(cache.mixed, hidden_gradient)
    mixed_gradient = split_heads(hidden_gradient @ w("attention.output.weight").T, heads)
    probability_gradient = mixed_gradient @ cache.value.transpose(0, 1, 3, 2)
    value_gradient = cache.probabilities.transpose(0, 1, 3, 2) @ mixed_gradient
    p = cache.probabilities
    score_gradient = p * (
        probability_gradient - (probability_gradient * p).sum(axis=-1, keepdims=True)
    )
    score_gradient = score_gradient / mpmath.sqrt(head_width)
    query_gradient = score_gradient @ cache.key
    key_gradient = score_gradient.transpose(0, 1, 3, 2) @ cache.query
    # A rotation's transpose rotates by the opposite angle.
    query_gradient = merge_heads(rotate_pairs(query_gradient, cache.cos, -cache.sin))
    key_gradient = merge_heads(rotate_pairs(key_gradient, cache.cos, -cache.sin))
    value_gradient = merge_heads(value_gradient)
    for name, gradient in (
        ("query", query_gradient),
        ("key", key_gradient),
        ("value", value_gradient),
    ):
        grads[f"attention.{name}.weight"] = _weight_gradient(cache.normed, gradient)
    normed_gradient = (
        query_gradient @ w("attention.query.weight").T
        + key_gradient @ w("attention.key.weight").T
        + value_gradient @ w("attention.value.weight").T
    )
    input_from_attention, grads["attention_norm.gain"] = _rms_backward(
        cache.attention_norm, normed_gradient
    )
    return hidden_gradient + input_from_attention, grads


def _adjoint(
    config: DecoderConfig,
    parameters: Mapping[str, npt.ArrayLike],
    tokens: npt.ArrayLike,
    targets: npt.ArrayLike,
    digits: int,
) -> dict[str, MpArray]:
    run = oracle_forward(config, parameters, tokens, targets, digits=digits)
    with precision(digits):
        vocabulary = config.vocabulary_size
        rows = run.logits.reshape(-1, vocabulary)
        exponentials = _exp(rows)
        probabilities = exponentials / exponentials.sum(axis=-1, keepdims=True)
        picked = np.arange(rows.shape[0]), np.asarray(targets, dtype=np.intp).reshape(-1)
        probabilities[picked] -= 1
        logit_gradient = (probabilities / rows.shape[0]).reshape(run.logits.shape)
        table = run.weights[EMBEDDING_NAME]
        final = run.stages[-1][1]
        grads: dict[str, MpArray] = {EMBEDDING_NAME: _weight_gradient(logit_gradient, final)}
        hidden_gradient, grads[FINAL_NORM_NAME] = _rms_backward(
            run.final_norm, logit_gradient @ table
        )
        for layer in reversed(range(config.layers)):
            hidden_gradient, block = _block_backward(
                hidden_gradient, run.blocks[layer], run.weights, layer, config
            )
            grads.update({f"blocks.{layer}.{name}": value for name, value in block.items()})
        lookup = grads[EMBEDDING_NAME]
        flat_ids = run.ids.reshape(-1)
        flat_gradient = hidden_gradient.reshape(-1, config.model_width)
        for row, token in enumerate(flat_ids):  # a token looked up twice adds twice
            lookup[token] = lookup[token] + flat_gradient[row]
    return grads


def _sampled(shape: tuple[int, ...], limit: int | None) -> list[tuple[int, ...]]:
    """Every index of ``shape``, or ``limit`` of them evenly spaced in row-major order."""
    every = list(np.ndindex(shape))
    if limit is None or len(every) <= limit:
        return every
    picks = np.unique(np.linspace(0, len(every) - 1, limit).round().astype(int))
    return [every[i] for i in picks]


def _central(
    config: DecoderConfig,
    parameters: Mapping[str, npt.ArrayLike],
    tokens: npt.ArrayLike,
    targets: npt.ArrayLike,
    *,
    digits: int,
    limit: int | None,
) -> tuple[dict[str, MpArray], dict[str, MpArray]]:
    step = mpmath.mpf(10) ** (-(digits // 3))  # balances truncation h^2 against rounding eps/h
    exact = {name: to_mp(value) for name, value in parameters.items()}
    values: dict[str, MpArray] = {}
    estimates: dict[str, MpArray] = {}
    with precision(digits):
        for name, point in exact.items():
            # Coordinates left out of a sample stay NaN, so no one mistakes them for checked.
            value_out = np.full(point.shape, mpmath.nan, dtype=object)
            estimate_out = np.full(point.shape, mpmath.nan, dtype=object)
            for index in _sampled(point.shape, limit):
                losses = {}
                for offset in (-2, -1, 1, 2):
                    shifted = dict(exact)
                    moved = point.copy()
                    moved[index] = moved[index] + offset * step
                    shifted[name] = moved
                    run = oracle_forward_exact(config, shifted, tokens, targets, digits=digits)
                    losses[offset] = run.mean_loss()
                near = (losses[1] - losses[-1]) / (2 * step)
                far = (losses[2] - losses[-2]) / (4 * step)
                value_out[index] = (4 * near - far) / 3
                estimate_out[index] = abs(near - far)
            values[name], estimates[name] = value_out, estimate_out
    return values, estimates


def oracle_gradients(
    config: DecoderConfig,
    parameters: Mapping[str, npt.ArrayLike] | Sequence[tuple[str, npt.ArrayLike]],
    tokens: npt.ArrayLike,
    targets: npt.ArrayLike,
    *,
    method: str = "adjoint",
    digits: int = DEFAULT_DIGITS,
    max_per_tensor: int | None = None,
) -> OracleGradients:
    """The gradient of the mean loss for every named parameter, rounded to float64.

    ``max_per_tensor`` limits the central method to that many evenly spaced coordinates per
    tensor (the rest are NaN); the adjoint always covers every scalar.
    """
    named = dict(parameters.items()) if isinstance(parameters, Mapping) else dict(parameters)
    if method == "adjoint":
        main = _adjoint(config, named, tokens, targets, digits)
        check = _adjoint(config, named, tokens, targets, digits + 10)
        with precision(digits + 10):
            estimates = {name: np.abs(to_float64(main[name] - check[name])) for name in main}
        values = main
    elif method == "central":
        values, mp_estimates = _central(
            config, named, tokens, targets, digits=digits, limit=max_per_tensor
        )
        estimates = {name: np.abs(to_float64(e)) for name, e in mp_estimates.items()}
    else:
        raise ValueError(f"method={method!r} is not 'adjoint' or 'central'")
    order = list(named)
    return OracleGradients(
        method,
        digits,
        {name: to_float64(values[name]) for name in order},
        {name: estimates[name] for name in order},
    )
