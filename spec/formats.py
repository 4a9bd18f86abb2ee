"""The four precisions a backend may declare, and the facts about their number formats.

A backend declares the arithmetic it really computes in (:class:`Precision`). The suite
uses each format's unit roundoff ``u`` (half the distance from 1 to the next number) to
scale its tolerances, its range to decide which inputs a format can hold at all (a
float16 model cannot store an embedding table of size 1e-15), and :func:`round_to` to know
how a backend of that precision holds the float64 parameters it is given. bfloat16 comes
from ``ml_dtypes``, the dtype library JAX and TensorFlow use, imported when first needed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "NumberFormat",
    "Precision",
    "accepted_dtypes",
    "held_in_format",
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
    """One floating-point format: the limits the suite relies on, and its numpy dtype."""

    precision: Precision
    unit_roundoff: float
    smallest_normal: float
    largest: float
    digits: int  # significand bits, the implicit one included
    smallest_subnormal: float

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype; bfloat16's comes from ml_dtypes, imported only here, since its
        extension takes up to a second to load and most processes never round to it."""
        if self.precision is Precision.BFLOAT16:
            import ml_dtypes

            bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
            return bfloat16
        return np.dtype(str(self.precision))

    def round(self, values: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """``values`` rounded to the nearest number of this format (as float64)."""
        array = np.asarray(values, dtype=np.float64)
        if self.precision is Precision.FLOAT64:
            return array.copy()
        with np.errstate(over="ignore"):
            rounded: npt.NDArray[np.float64] = array.astype(self.dtype).astype(np.float64)
        return rounded


def _format(precision: Precision) -> NumberFormat:
    if precision is Precision.BFLOAT16:
        # bfloat16 is float32's exponent with 8 significand bits (7 stored).
        return NumberFormat(
            precision=precision,
            unit_roundoff=2.0**-8,
            smallest_normal=2.0**-126,
            largest=(2 - 2.0**-7) * 2.0**127,
            digits=8,
            smallest_subnormal=2.0**-133,
        )
    info = np.finfo(np.dtype(str(precision)))
    return NumberFormat(
        precision=precision,
        unit_roundoff=float(info.eps) / 2,
        smallest_normal=float(info.smallest_normal),
        largest=float(info.max),
        digits=int(info.nmant) + 1,
        smallest_subnormal=float(info.smallest_subnormal),
    )


@functools.cache
def _cached_format(precision: Precision) -> NumberFormat:
    return _format(precision)


def number_format(precision: Precision | str) -> NumberFormat:
    """The format of a declared precision; a ``KeyError`` names the known ones."""
    try:
        return _cached_format(Precision(precision))
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


def held_in_format(
    held: npt.ArrayLike, original: npt.ArrayLike, precision: Precision | str
) -> npt.NDArray[np.bool_]:
    """Elementwise: ``held`` is ``original`` stored in the format, rounded either way a
    backend may round it: to nearest directly, or through float32 first (torch and
    ml_dtypes convert float64 to the 16-bit formats that way, and a tie can then go the
    other way). That is, ``held`` is a number of the format and one of the two of the
    format's numbers around ``original`` (itself where ``original`` is one)."""
    form = number_format(precision)
    held_array = np.asarray(held, dtype=np.float64)
    original_array = np.asarray(original, dtype=np.float64)
    if form.precision is Precision.FLOAT64:
        result: npt.NDArray[np.bool_] = held_array == original_array
        return result
    _, exponent = np.frexp(original_array)
    spacing = np.maximum(np.ldexp(1.0, exponent - form.digits), form.smallest_subnormal)
    with np.errstate(invalid="ignore"):
        near = np.abs(held_array - original_array) < spacing
    result = (form.round(held_array) == held_array) & (near | (held_array == original_array))
    return result


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
