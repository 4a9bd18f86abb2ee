"""The model's mathematics in mpmath: the ground truth float64 results are measured against.

Written plainly from the formulas, in exact arithmetic's terms (``1/sqrt`` rather than the
recipe's float64 ``exp(-0.5 log)``, which is the same function), at a chosen precision.
Tensors are numpy object arrays of ``mpf``, so the code reads like the float64 version while
every operation runs in mpmath. Parameters enter exactly: every float64 is an exact ``mpf``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mpmath
import numpy as np
import numpy.typing as npt
from mpmath.libmp import to_float

from spec.config import DecoderConfig
from spec.parameters import EMBEDDING_NAME, FINAL_NORM_NAME
from spec.shapes import stage_names

__all__ = [
    "DEFAULT_DIGITS",
    "BlockCache",
    "NormCache",
    "OracleRun",
    "oracle_forward",
    "oracle_forward_exact",
    "oracle_rows",
    "precision",
    "relative_error",
    "to_float64",
    "to_mp",
]

DEFAULT_DIGITS = 50

MpArray = npt.NDArray[np.object_]
_exp = np.frompyfunc(mpmath.exp, 1, 1)
_log = np.frompyfunc(mpmath.log, 1, 1)
_sqrt = np.frompyfunc(mpmath.sqrt, 1, 1)
_cos = np.frompyfunc(mpmath.cos, 1, 1)
_sin = np.frompyfunc(mpmath.sin, 1, 1)
_to_mpf = np.frompyfunc(mpmath.mpf, 1, 1)
_nearest_float = np.frompyfunc(lambda value: to_float(mpmath.mpf(value)._mpf_, rnd="n"), 1, 1)


@contextmanager
def precision(digits: int) -> Iterator[None]:
    """Work at ``digits`` significant decimal digits, restoring the previous precision."""
    if digits < 16:
        raise ValueError(f"digits={digits} is below float64's 16; the oracle would be no oracle")
    with mpmath.workdps(digits):
        yield


def to_mp(values: npt.ArrayLike) -> MpArray:
    """Float64 values as exact ``mpf`` (every binary64 number is representable)."""
    array = np.asarray(values, dtype=np.float64)
    result: MpArray = np.asarray(_to_mpf(array), dtype=object).reshape(array.shape)
    return result


def to_float64(values: MpArray | Any) -> npt.NDArray[np.float64]:
    """Round every ``mpf`` to the nearest float64 (ties to even)."""
    array = np.asarray(values, dtype=object)
    with np.errstate(invalid="ignore"):  # an mpf NaN (an unsampled coordinate) stays NaN
        return np.asarray(_nearest_float(array), dtype=np.float64).reshape(array.shape)


def relative_error(actual: npt.ArrayLike, exact: MpArray) -> npt.NDArray[np.float64]:
    """``|actual - exact| / max(|exact|, tiny)`` per element, computed in mpmath."""
    difference = to_mp(actual) - exact
    scale = np.maximum(np.abs(to_float64(exact)), np.finfo(np.float64).tiny)
    return np.abs(to_float64(difference)) / scale


@dataclass
class OracleRun:
    """Every stage, the logits and (with targets) the loss, as ``mpf`` object arrays."""

    digits: int
    stages: list[tuple[str, MpArray]]
    logits: MpArray
    loss: Any | None
    weights: dict[str, MpArray]
    ids: npt.NDArray[np.intp]
    blocks: list[BlockCache]
    final_norm: NormCache

    def mean_loss(self) -> Any:
        """The loss as an ``mpf``; a ``ValueError`` when the run had no targets."""
        if self.loss is None:
            raise ValueError("this oracle run had no targets, so it has no loss")
        return self.loss


@dataclass
class NormCache:
    """What an RMSNorm's derivative needs: its input, gain and inverse root."""

    x: MpArray
    gain: MpArray
    inverse_root: MpArray


def rms_norm(x: MpArray, gain: MpArray, epsilon: Any) -> tuple[MpArray, NormCache]:
    """``x / sqrt(mean(x^2) + eps) * gain`` over the last axis."""
    width = x.shape[-1]
    inverse_root = 1 / _sqrt((x * x).sum(axis=-1, keepdims=True) / width + epsilon)
    result: MpArray = x * inverse_root * gain
    return result, NormCache(x, gain, inverse_root)


def rope_tables(length: int, head_width: int, base: Any) -> tuple[MpArray, MpArray]:
    """``cos`` and ``sin`` of ``p * base^(-2j/hw)``, each ``[T, hw/2]``."""
    positions = np.arange(length).reshape(length, 1)
    frequencies = np.array(
        [base ** (mpmath.mpf(-2 * j) / head_width) for j in range(head_width // 2)], dtype=object
    )
    angles = positions * frequencies
    return _cos(angles), _sin(angles)


def rotate_pairs(x: MpArray, cos: MpArray, sin: MpArray) -> MpArray:
    """Rotate the interleaved pairs (2j, 2j+1) of ``x [..., T, hw]``; ``-sin`` rotates back."""
    rotated = np.empty_like(x)
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated[..., 0::2] = even * cos - odd * sin
    rotated[..., 1::2] = even * sin + odd * cos
    return rotated


@dataclass
class BlockCache:
    """The intermediates of one block that its derivative needs."""

    attention_norm: NormCache
    normed: MpArray
    query: MpArray
    key: MpArray
    value: MpArray
    probabilities: MpArray
    mixed: MpArray
    ffn_norm: NormCache
    ffn_input: MpArray
    gate: MpArray
    sigmoid: MpArray
    up: MpArray
    product: MpArray
    cos: MpArray
    sin: MpArray


def split_heads(x: MpArray, heads: int) -> MpArray:
    """``[B, T, d]`` to ``[B, H, T, hw]``."""
    batch, length, width = x.shape
    return x.reshape(batch, length, heads, width // heads).transpose(0, 2, 1, 3)


def merge_heads(x: MpArray) -> MpArray:
    """``[B, H, T, hw]`` to ``[B, T, d]``."""
    batch, heads, length, head_width = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * head_width)


def block_forward(
    x: MpArray, weights: Mapping[str, MpArray], layer: int, config: DecoderConfig, epsilon: Any
) -> tuple[MpArray, BlockCache]:
    """``h = x + attention(norm(x))``, ``y = h + swiglu(norm(h))``, and the intermediates."""

    def w(name: str) -> MpArray:
        return weights[f"blocks.{layer}.{name}"]

    length, head_width = x.shape[1], config.model_width // config.heads
    normed, attention_norm = rms_norm(x, w("attention_norm.gain"), epsilon)
    cos, sin = rope_tables(length, head_width, mpmath.mpf(config.rope_base))
    query = rotate_pairs(split_heads(normed @ w("attention.query.weight"), config.heads), cos, sin)
    key = rotate_pairs(split_heads(normed @ w("attention.key.weight"), config.heads), cos, sin)
    value = split_heads(normed @ w("attention.value.weight"), config.heads)
    scores = (query @ key.transpose(0, 1, 3, 2)) / mpmath.sqrt(head_width)
    visible = np.tril(np.ones((length, length), dtype=bool))
    exponentials = np.where(visible, _exp(np.where(visible, scores, 0)), mpmath.mpf(0))
    probabilities = exponentials / exponentials.sum(axis=-1, keepdims=True)
    mixed = merge_heads(probabilities @ value)
    hidden = x + mixed @ w("attention.output.weight")
    ffn_input, ffn_norm = rms_norm(hidden, w("ffn_norm.gain"), epsilon)
    gate = ffn_input @ w("ffn.gate.weight")
    sigmoid = 1 / (1 + _exp(-gate))
    up = ffn_input @ w("ffn.up.weight")
    product = gate * sigmoid * up
    output: MpArray = hidden + product @ w("ffn.down.weight")
    cache = BlockCache(
        attention_norm, normed, query, key, value, probabilities, mixed,
        ffn_norm, ffn_input, gate, sigmoid, up, product, cos, sin,
    )  # fmt: skip
    return output, cache


def oracle_forward(
    config: DecoderConfig,
    parameters: Mapping[str, npt.ArrayLike] | Sequence[tuple[str, npt.ArrayLike]],
    tokens: npt.ArrayLike,
    targets: npt.ArrayLike | None = None,
    *,
    digits: int = DEFAULT_DIGITS,
) -> OracleRun:
    """Lookup, pre-norm blocks, final RMSNorm, tied ``E^T`` head, and mean NLL, in mpmath.

    Inputs are assumed valid (see :mod:`spec.validation`); the result stays at ``digits``.
    """
    named = dict(parameters.items()) if isinstance(parameters, Mapping) else dict(parameters)
    with precision(digits):
        weights = {name: to_mp(value) for name, value in named.items()}
    return oracle_forward_exact(config, weights, tokens, targets, digits=digits)


def oracle_forward_exact(
    config: DecoderConfig,
    weights: Mapping[str, MpArray],
    tokens: npt.ArrayLike,
    targets: npt.ArrayLike | None = None,
    *,
    digits: int = DEFAULT_DIGITS,
) -> OracleRun:
    """:func:`oracle_forward` over parameters that are already ``mpf`` (any, not only float64)."""
    ids = np.asarray(tokens, dtype=np.intp)
    with precision(digits):
        weights = dict(weights)
        epsilon = mpmath.mpf(config.rms_epsilon)
        table = weights[EMBEDDING_NAME]
        hidden = table[ids]
        outputs = [hidden]
        caches = []
        for layer in range(config.layers):
            hidden, cache = block_forward(hidden, weights, layer, config, epsilon)
            outputs.append(hidden)
            caches.append(cache)
        final, final_cache = rms_norm(hidden, weights[FINAL_NORM_NAME], epsilon)
        outputs.append(final)
        logits: MpArray = final @ table.T
        loss = None
        if targets is not None:
            rows = logits.reshape(-1, config.vocabulary_size)
            picked = rows[np.arange(rows.shape[0]), np.asarray(targets, dtype=np.intp).reshape(-1)]
            log_normalizers = _log(_exp(rows).sum(axis=-1))
            loss = (log_normalizers - picked).sum() / rows.shape[0]
    stages = list(zip(stage_names(config.layers), outputs, strict=True))
    return OracleRun(digits, stages, logits, loss, weights, ids, caches, final_cache)


def oracle_rows(
    config: DecoderConfig,
    parameters: Mapping[str, npt.ArrayLike] | Sequence[tuple[str, npt.ArrayLike]],
    tokens: Sequence[int] | npt.NDArray[np.integer[Any]],
    rows: Sequence[int],
    *,
    digits: int = 30,
) -> MpArray:
    """The logits of some positions of one long sequence, ``[len(rows), V]``, in mpmath.

    Causality makes long sequences affordable: row ``t`` needs only positions ``0 .. t``. Every
    block but the last runs over that whole prefix (its keys and values feed the next); the
    last block, the final norm and the head run for the asked rows alone, each attending over
    its own prefix. For one block over T positions that is O(T d^2) for the keys and values
    and O(T hw) a row, against O(T^2) for :func:`oracle_forward`.
    """
    ids = np.asarray(tokens, dtype=np.intp).reshape(-1)
    wanted = [int(row) for row in rows]
    named = dict(parameters.items()) if isinstance(parameters, Mapping) else dict(parameters)
    with precision(digits):
        weights = {name: to_mp(value) for name, value in named.items()}
        epsilon = mpmath.mpf(config.rms_epsilon)
        prefix = max(wanted) + 1
        hidden = weights[EMBEDDING_NAME][ids[:prefix]]  # [P, d]
        positions = list(range(prefix))
        for layer in range(config.layers):
            last = layer == config.layers - 1
            hidden = _block_rows(
                hidden, weights, layer, config, epsilon=epsilon, rows=wanted if last else positions
            )
        if config.layers == 0:
            hidden = hidden[wanted]
        final, _ = rms_norm(hidden, weights[FINAL_NORM_NAME], epsilon)
        logits: MpArray = final @ weights[EMBEDDING_NAME].T
    return logits


def _distinct_rows(x: MpArray) -> tuple[MpArray, npt.NDArray[np.intp]]:
    """The distinct rows of ``x [P, d]``, in order of first appearance, and for each row of
    ``x`` the index of its copy among them (``distinct[row_of]`` equals ``x``)."""
    index_of: dict[tuple[Any, ...], int] = {}
    firsts: list[int] = []
    row_of = np.empty(x.shape[0], dtype=np.intp)
    for position, row in enumerate(x):
        key = tuple(row)
        if key not in index_of:
            index_of[key] = len(firsts)
            firsts.append(position)
        row_of[position] = index_of[key]
    return x[firsts], row_of


def _block_rows(
    x: MpArray,
    weights: Mapping[str, MpArray],
    layer: int,
    config: DecoderConfig,
    *,
    epsilon: Any,
    rows: Sequence[int],
) -> MpArray:
    """One block's output at ``rows`` of the prefix ``x [P, d]``: ``[len(rows), d]``."""

    def w(name: str) -> MpArray:
        return weights[f"blocks.{layer}.{name}"]

    length, heads = x.shape[0], config.heads
    head_width = config.model_width // heads
    # Norm and projections act row by row, so equal rows give equal results: the first
    # block's rows are table rows, a few distinct ones over thousands of positions.
    distinct, row_of = _distinct_rows(x)
    normed, _ = rms_norm(distinct, w("attention_norm.gain"), epsilon)
    cos, sin = rope_tables(length, head_width, mpmath.mpf(config.rope_base))

    def by_head(y: MpArray) -> MpArray:  # [P, d] -> [H, P, hw]
        return y.reshape(y.shape[0], heads, head_width).transpose(1, 0, 2)

    keys = rotate_pairs(by_head((normed @ w("attention.key.weight"))[row_of]), cos, sin)
    values = by_head((normed @ w("attention.value.weight"))[row_of])
    chosen = list(rows)
    queries = rotate_pairs(
        by_head(normed[row_of[chosen]] @ w("attention.query.weight")), cos[chosen], sin[chosen]
    )
    scale = mpmath.sqrt(head_width)
    mixed = np.empty((len(chosen), heads, head_width), dtype=object)
    for i, row in enumerate(chosen):
        for head in range(heads):
            scores = keys[head, : row + 1] @ queries[head, i] / scale
            weights_row = _exp(scores - max(scores))
            mixed[i, head] = (weights_row @ values[head, : row + 1]) / weights_row.sum()
    hidden = x[chosen] + mixed.reshape(len(chosen), -1) @ w("attention.output.weight")
    ffn_input, _ = rms_norm(hidden, w("ffn_norm.gain"), epsilon)
    gate = ffn_input @ w("ffn.gate.weight")
    product = gate / (1 + _exp(-gate)) * (ffn_input @ w("ffn.up.weight"))
    output: MpArray = hidden + product @ w("ffn.down.weight")
    return output
