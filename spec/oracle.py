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
    "OracleRun",
    "oracle_forward",
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

    def mean_loss(self) -> Any:
        """The loss as an ``mpf``; a ``ValueError`` when the run had no targets."""
        if self.loss is None:
            raise ValueError("this oracle run had no targets, so it has no loss")
        return self.loss


def _rms_norm(x: MpArray, gain: MpArray, epsilon: Any) -> MpArray:
    width = x.shape[-1]
    mean_square = (x * x).sum(axis=-1, keepdims=True) / width
    result: MpArray = x / _sqrt(mean_square + epsilon) * gain
    return result


def _rope(x: MpArray, base: Any) -> MpArray:
    """Rotate interleaved pairs (2j, 2j+1) at position p by ``p * base^(-2j/hw)``."""
    length, head_width = x.shape[-2], x.shape[-1]
    positions = np.arange(length).reshape(length, 1)
    exponents = np.array(
        [mpmath.mpf(-2 * j) / head_width for j in range(head_width // 2)], dtype=object
    )
    angles = positions * np.array([base**e for e in exponents], dtype=object)
    cos, sin = _cos(angles), _sin(angles)
    rotated = np.empty_like(x)
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated[..., 0::2] = even * cos - odd * sin
    rotated[..., 1::2] = even * sin + odd * cos
    return rotated


def _attention(
    x: MpArray, weights: Mapping[str, MpArray], prefix: str, config: DecoderConfig
) -> MpArray:
    batch, length, width = x.shape
    heads, head_width = config.heads, width // config.heads
    base = mpmath.mpf(config.rope_base)

    def split(projected: MpArray) -> MpArray:
        return projected.reshape(batch, length, heads, head_width).transpose(0, 2, 1, 3)

    query = _rope(split(x @ weights[f"{prefix}.query.weight"]), base)
    key = _rope(split(x @ weights[f"{prefix}.key.weight"]), base)
    value = split(x @ weights[f"{prefix}.value.weight"])
    scores = (query @ key.transpose(0, 1, 3, 2)) / mpmath.sqrt(head_width)
    visible = np.tril(np.ones((length, length), dtype=bool))
    exponentials = np.where(visible, _exp(np.where(visible, scores, 0)), mpmath.mpf(0))
    probabilities = exponentials / exponentials.sum(axis=-1, keepdims=True)
    mixed = (probabilities @ value).transpose(0, 2, 1, 3).reshape(batch, length, width)
    result: MpArray = mixed @ weights[f"{prefix}.output.weight"]
    return result


def _swiglu(x: MpArray, weights: Mapping[str, MpArray], prefix: str) -> MpArray:
    gate = x @ weights[f"{prefix}.gate.weight"]
    silu = gate / (1 + _exp(-gate))
    result: MpArray = (silu * (x @ weights[f"{prefix}.up.weight"])) @ weights[
        f"{prefix}.down.weight"
    ]
    return result


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
    ids = np.asarray(tokens, dtype=np.intp)
    with precision(digits):
        weights = {name: to_mp(value) for name, value in named.items()}
        epsilon = mpmath.mpf(config.rms_epsilon)
        table = weights[EMBEDDING_NAME]
        hidden = table[ids]
        outputs = [hidden]
        for layer in range(config.layers):
            prefix = f"blocks.{layer}"
            normed = _rms_norm(hidden, weights[f"{prefix}.attention_norm.gain"], epsilon)
            hidden = hidden + _attention(normed, weights, f"{prefix}.attention", config)
            normed = _rms_norm(hidden, weights[f"{prefix}.ffn_norm.gain"], epsilon)
            hidden = hidden + _swiglu(normed, weights, f"{prefix}.ffn")
            outputs.append(hidden)
        final = _rms_norm(hidden, weights[FINAL_NORM_NAME], epsilon)
        outputs.append(final)
        logits: MpArray = final @ table.T
        loss = None
        if targets is not None:
            rows = logits.reshape(-1, config.vocabulary_size)
            picked = rows[np.arange(rows.shape[0]), np.asarray(targets, dtype=np.intp).reshape(-1)]
            log_normalizers = _log(_exp(rows).sum(axis=-1))
            loss = (log_normalizers - picked).sum() / rows.shape[0]
    return OracleRun(
        digits, list(zip(stage_names(config.layers), outputs, strict=True)), logits, loss
    )
