"""Tolerances per precision and per configuration, and how they were derived.

Errors are measured as the *scaled error* ``|got - exact| / max(1, |exact|)`` per element,
against the mpmath oracle (values) or exact gradients. For each declared precision and each
quantity (stages, logits, loss, gradients) the tolerance is an error model

    tolerance = c * u * f(config),   f = (depth + 1)^a * width^b * positions^p * vocabulary^v

with ``u`` the format's unit roundoff, the exponents fitted (least squares on the logarithm)
to the errors a correct implementation at that precision shows over thousands of generated
configurations, and ``c`` the largest measured ``error / (u f)`` times a stated safety
factor. The instrument is :mod:`impl.emulation` (the reference's formulas with every
operation rounded to the format) and, for float64, the reference itself;
``decoder-conformance tolerances derive`` measures it again and (``--write``) writes
``spec/derived_tolerances.json``, which this module reads; ``tolerances show`` prints it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources
from typing import Any

import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig
from spec.formats import Precision, number_format

__all__ = [
    "DOCUMENT",
    "FLOAT64_SCALE_FACTOR",
    "TABLE",
    "Growth",
    "MissingScaleBound",
    "Precision",
    "Quantity",
    "QuantityModel",
    "Tolerance",
    "ToleranceModel",
    "model_from_entry",
    "reference_bound",
    "scale_tolerance",
    "scaled_error",
    "tolerance_for",
    "tolerance_models",
]


class Quantity(StrEnum):
    """What a tolerance bounds."""

    STAGES = "stages"
    LOGITS = "logits"
    LOSS = "loss"
    GRADIENTS = "gradients"


@dataclass(frozen=True)
class Growth:
    """``f = (depth + 1)^depth * width^width * positions^positions * vocabulary^vocabulary``."""

    depth: float
    width: float
    positions: float
    vocabulary: float

    def __call__(self, config: DecoderConfig, positions: int) -> float:
        return float(
            (config.layers + 1) ** self.depth
            * config.model_width**self.width
            * max(1, positions) ** self.positions
            * config.vocabulary_size**self.vocabulary
        )


@dataclass(frozen=True)
class QuantityModel:
    """One quantity's error model at one precision, with the figures it was fitted from."""

    coefficient: float
    growth: Growth
    worst_ratio: float
    median_ratio: float
    samples: int


@dataclass(frozen=True)
class Tolerance:
    """The largest acceptable scaled error of each quantity, for one configuration."""

    stages: float
    logits: float
    loss: float
    gradients: float

    @property
    def values(self) -> float:
        """The forward values' tolerance where a check mixes stages, logits and loss."""
        return max(self.stages, self.logits, self.loss)


@dataclass(frozen=True)
class ToleranceModel:
    """Every quantity's error model for one declared precision."""

    precision: Precision
    unit_roundoff: float
    safety: float
    quantities: Mapping[Quantity, QuantityModel]
    derivation: str
    # Bounds measured for the suite's fixed cases (the golden cases, the long sequence):
    # 6 x the emulation's largest error over eight seeds of that very configuration.
    cases: Mapping[str, Mapping[Quantity, float]] = field(default_factory=dict)

    def bound(self, quantity: Quantity | str, config: DecoderConfig, positions: int) -> float:
        """``c * u * f(config, positions)`` for one quantity."""
        model = self.quantities[Quantity(quantity)]
        return model.coefficient * self.unit_roundoff * model.growth(config, positions)

    def at(
        self, config: DecoderConfig, positions: int | None = None, *, case: str | None = None
    ) -> Tolerance:
        """Every quantity's tolerance for ``config`` over sequences of ``positions`` tokens
        (the whole context when not given); for a fixed ``case`` of the suite with a bound
        measured on its own configuration, the tighter of the two."""
        length = config.context if positions is None else positions
        measured = self.cases.get(case, {}) if case is not None else {}
        bounds = {
            quantity: min(self.bound(quantity, config, length), measured.get(quantity, np.inf))
            for quantity in Quantity
        }
        return Tolerance(
            stages=bounds[Quantity.STAGES],
            logits=bounds[Quantity.LOGITS],
            loss=bounds[Quantity.LOSS],
            gradients=bounds[Quantity.GRADIENTS],
        )


def model_from_entry(precision: Precision, entry: Mapping[str, Any]) -> ToleranceModel:
    """The error model one entry of :data:`spec.derived_tolerances.TABLE` describes."""
    quantities = {
        Quantity(name): QuantityModel(
            coefficient=float(fitted["coefficient"]),
            growth=Growth(**{key: float(value) for key, value in fitted["exponents"].items()}),
            worst_ratio=float(fitted["worst_ratio"]),
            median_ratio=float(fitted["median_ratio"]),
            samples=int(fitted["samples"]),
        )
        for name, fitted in entry["quantities"].items()
    }
    cases = {
        name: {Quantity(quantity): float(bound) for quantity, bound in bounds.items()}
        for name, bounds in entry.get("cases", {}).items()
    }
    return ToleranceModel(
        precision=precision,
        unit_roundoff=number_format(precision).unit_roundoff,
        safety=float(entry["safety"]),
        quantities=quantities,
        derivation=str(entry["derivation"]),
        cases=cases,
    )


# Written by ``decoder-conformance tolerances derive --write``; package data, not code.
DOCUMENT: dict[str, Any] = json.loads(
    resources.files("spec").joinpath("derived_tolerances.json").read_text(encoding="utf-8")
)
TABLE: dict[str, Any] = DOCUMENT["precisions"]

_MODELS: dict[Precision, ToleranceModel] = {
    Precision(name): model_from_entry(Precision(name), entry) for name, entry in TABLE.items()
}


def tolerance_models() -> dict[Precision, ToleranceModel]:
    """The committed error model of every precision."""
    return dict(_MODELS)


def tolerance_for(precision: Precision | str) -> ToleranceModel:
    """The error model of a precision; a ``KeyError`` names the known ones."""
    try:
        return _MODELS[Precision(precision)]
    except (ValueError, KeyError):
        known = ", ".join(str(p) for p in Precision)
        raise KeyError(f"no tolerance for precision {precision!r}; known: {known}") from None


class MissingScaleBound(LookupError):
    """No bound was measured for this precision at this scale shape."""


def reference_bound(
    config: DecoderConfig, positions: int, growth: Mapping[str, Any] | None = None
) -> dict[Quantity, float]:
    """The float64 reference's own error bound (stages, logits, loss) at ``config`` over
    ``positions`` tokens: the growth fitted by ``tolerances derive --growth`` over the sizes
    mpmath reaches (DOCUMENT["reference_growth"]), extrapolated to this size; gradients from
    the float64 error model (fitted over the 1000 generated cases), likewise extrapolated."""
    growth = DOCUMENT.get("reference_growth") if growth is None else growth
    if growth is None:
        raise MissingScaleBound(
            "spec/derived_tolerances.json has no reference_growth: run "
            "`decoder-conformance tolerances derive --growth --write`"
        )
    unit = number_format(Precision.FLOAT64).unit_roundoff
    bounds = {
        Quantity(name): float(fitted["coefficient"])
        * unit
        * Growth(**{key: float(value) for key, value in fitted["exponents"].items()})(
            config, positions
        )
        for name, fitted in growth["quantities"].items()
    }
    bounds[Quantity.GRADIENTS] = _MODELS[Precision.FLOAT64].bound(
        Quantity.GRADIENTS, config, positions
    )
    return bounds


# A float64 backend and the reference may each be off by the reference's bound, in opposite
# directions: their difference is held to twice it.
FLOAT64_SCALE_FACTOR = 2.0


def scale_tolerance(precision: Precision | str, name: str) -> Tolerance:
    """Every quantity's tolerance at scale shape ``name`` (``spec.scale``), judged against
    the float64 reference: for float32, bfloat16 and float16 the bound measured at the shape
    itself (``tolerances derive --scale``: 6 x the emulation's worst over its seeds); for
    float64, twice the reference's own extrapolated bound (:func:`reference_bound`)."""
    from spec.scale import scale_shape

    shape = scale_shape(name)
    chosen = tolerance_for(precision)
    if chosen.precision is Precision.FLOAT64:
        bounds = reference_bound(shape.config, shape.positions)
        return Tolerance(**{str(q): FLOAT64_SCALE_FACTOR * bound for q, bound in bounds.items()})
    measured = chosen.cases.get(f"scale:{name}")
    if measured is None:
        raise MissingScaleBound(
            f"no {chosen.precision} bound was measured at scale shape {name!r}; a maintainer "
            f"measures it with `decoder-conformance tolerances derive --scale --scale-shape "
            f"{name} --precision {chosen.precision} --write` (minutes; it rewrites "
            "spec/derived_tolerances.json)"
        )
    if any(q not in measured for q in Quantity):
        raise MissingScaleBound(f"the {chosen.precision} bound at {name!r} lacks a quantity")
    return Tolerance(**{str(q): measured[q] for q in Quantity})


def scaled_error(got: npt.ArrayLike, exact: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """``|got - exact| / max(1, |exact|)`` elementwise (NaN where either side is not finite)."""
    got_array = np.asarray(got, dtype=np.float64)
    exact_array = np.asarray(exact, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        error = np.abs(got_array - exact_array) / np.maximum(1.0, np.abs(exact_array))
    result: npt.NDArray[np.float64] = np.where(
        np.isfinite(got_array) & np.isfinite(exact_array), error, np.nan
    )
    return result
