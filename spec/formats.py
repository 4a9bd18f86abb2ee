"""The four precisions a backend may declare, and the facts about their number formats.

A backend declares the arithmetic it really computes in (:class:`Precision`). The suite
uses each format's unit roundoff ``u`` (half the distance from 1 to the next number) to
scale its tolerances, its range to decide which inputs a format can hold at all (a
float16 model cannot store an embedding table of size 1e-15), and :func:`round_to` to know
how a backend of that precision holds the float64 parameters it is given. bfloat16 comes
from ``ml_dtypes``, the dtype library JAX and TensorFlow use.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

__all__ = [
    "FORMATS",
    "NumberFormat",
    "Precision",
    "accepted_dtypes",
    "number_format",
    "representable",
    "round_to",
]


class Precision(StrEnum):
    """The arithmetic a backend computes in."""

    FLOAT64 = "float64"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


@dataclass(frozen=True)
class NumberFormat:
    """One floating-point format: its numpy dtype and the limits the suite relies on."""

    precision: Precision
    dtype: np.dtype[Any]
    unit_roundoff: float
    smallest_normal: float
    largest: float

    def round(self, values: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """``values`` rounded to the nearest number of this format (as float64)."""
        array = np.asarray(values, dtype=np.float64)
        if self.precision is Precision.FLOAT64:
            return array.copy()
        with np.errstate(over="ignore"):
            rounded: npt.NDArray[np.float64] = array.astype(self.dtype).astype(np.float64)
        return rounded


def _format(precision: Precision, dtype: Any) -> NumberFormat:
    info = ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]
    return NumberFormat(
        precision=precision,
        dtype=np.dtype(dtype),
        unit_roundoff=float(info.eps) / 2,
        smallest_normal=float(info.smallest_normal),
        largest=float(info.max),
    )


FORMATS: dict[Precision, NumberFormat] = {
    Precision.FLOAT64: _format(Precision.FLOAT64, np.float64),
    Precision.FLOAT32: _format(Precision.FLOAT32, np.float32),
    Precision.BFLOAT16: _format(Precision.BFLOAT16, ml_dtypes.bfloat16),
    Precision.FLOAT16: _format(Precision.FLOAT16, np.float16),
}


def number_format(precision: Precision | str) -> NumberFormat:
    """The format of a declared precision; a ``KeyError`` names the known ones."""
    try:
        return FORMATS[Precision(precision)]
    except ValueError:
        known = ", ".join(str(p) for p in Precision)
        raise KeyError(f"no number format for precision {precision!r}; known: {known}") from None


def accepted_dtypes(precision: Precision | str) -> tuple[str, ...]:
    """The dtypes a backend of ``precision`` may return: its own, float64 (widened), and
    float32 for the 16-bit formats (every bfloat16 and float16 value is exact in float32)."""
    declared = Precision(precision)
    names = [str(declared), "float64"]
    if declared in (Precision.BFLOAT16, Precision.FLOAT16):
        names.append("float32")
    return tuple(dict.fromkeys(names))


def round_to(values: npt.ArrayLike, precision: Precision | str) -> npt.NDArray[np.float64]:
    """How a backend of ``precision`` holds float64 ``values``: rounded to its format."""
    return number_format(precision).round(values)


def representable(arrays: Iterable[npt.ArrayLike], precision: Precision | str) -> bool:
    """Whether a format can hold every array: none overflows, and none that has a nonzero
    value lies wholly below the normal range (a float16 table of scale 1e-15 becomes 0)."""
    form = number_format(precision)
    for values in arrays:
        magnitudes = np.abs(np.asarray(values, dtype=np.float64))
        largest = float(np.max(magnitudes, initial=0.0))
        if largest > form.largest or 0 < largest < form.smallest_normal:
            return False
    return True
