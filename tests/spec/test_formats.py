"""Number formats: rounding, accepted dtypes, and what a format can hold."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from spec.formats import (
    Precision,
    accepted_dtypes,
    held_in_format,
    number_format,
    representable,
    round_to,
)


@pytest.mark.parametrize(
    ("precision", "unit"),
    [("float64", 2.0**-53), ("float32", 2.0**-24), ("bfloat16", 2.0**-8), ("float16", 2.0**-11)],
)
def test_unit_roundoffs(precision: str, unit: float) -> None:
    assert number_format(precision).unit_roundoff == unit


def test_rounding_matches_the_dtypes() -> None:
    values = np.array([np.pi, -1e-3, 1 + 2.0**-9, 300.7])
    assert np.array_equal(round_to(values, "float32"), values.astype(np.float32).astype(float))
    assert np.array_equal(
        round_to(values, "bfloat16"), values.astype(ml_dtypes.bfloat16).astype(float)
    )
    assert np.array_equal(round_to(values, "float16"), values.astype(np.float16).astype(float))
    assert np.array_equal(round_to(values, "float64"), values)
    assert round_to(np.array([257.0]), "bfloat16")[0] == 256.0  # positions stop being integers


def test_accepted_dtypes() -> None:
    assert accepted_dtypes(Precision.FLOAT64) == ("float64",)
    assert accepted_dtypes(Precision.FLOAT32) == ("float32", "float64")
    assert accepted_dtypes(Precision.BFLOAT16) == ("bfloat16", "float64", "float32")
    assert "float16" not in accepted_dtypes(Precision.BFLOAT16)


def test_representable() -> None:
    tiny = [np.full(3, 1e-15)]
    assert representable(tiny, "bfloat16") and not representable(tiny, "float16")
    assert not representable([np.array([1e5])], "float16")
    assert representable([np.zeros(3), np.array([1.0, 1e-9])], "float16")


def test_unknown_precision() -> None:
    with pytest.raises(KeyError, match="known: float64, float32, bfloat16, float16"):
        number_format("float8")


def test_held_in_format_accepts_either_rounding_and_nothing_else() -> None:
    original = np.array([0.46997, 1 + 2.0**-11 + 2.0**-40, 3.0, -1e-6])
    direct = original.astype(np.float16).astype(float)
    through_float32 = original.astype(np.float32).astype(np.float16).astype(float)
    assert np.all(held_in_format(direct, original, "float16"))
    assert np.all(held_in_format(through_float32, original, "float16"))
    # The other neighbour of 1 + 2^-11 + 2^-40 is 1 + 2^-10; one step further is not.
    assert held_in_format(np.array([1 + 2.0**-10]), original[1:2], "float16")[0]
    assert not held_in_format(np.array([1 + 2.0**-9]), original[1:2], "float16")[0]
    assert not held_in_format(np.array([3.0 + 2.0**-9]), np.array([3.0]), "float16")[0]
    assert not held_in_format(np.array([0.1]), np.array([0.1]), "float16")[0]  # not a float16
    assert held_in_format(np.array([0.1]), np.array([0.1]), "float64")[0]


def test_bfloat16_facts_agree_with_ml_dtypes() -> None:
    form, info = number_format("bfloat16"), ml_dtypes.finfo(ml_dtypes.bfloat16)
    assert form.unit_roundoff == float(info.eps) / 2
    assert form.smallest_normal == float(info.smallest_normal)
    assert form.largest == float(info.max)
    assert form.digits == int(info.nmant) + 1
    assert form.smallest_subnormal == float(info.smallest_subnormal)
