"""How the float64 reference's own error grows with size, and what that gives at scale.

At the ``scale`` profile's shapes the float64 reference is the oracle, which holds only if
its own error there is small. This study measures it where mpmath reaches: from a base
configuration, one feature at a time (width, depth, positions, vocabulary) is swept over
sizes the oracle computes in seconds, with several seeds of the ``varied`` parameters at
each point. For stages, logits and loss, the exponents of

    error <= c * u * (depth + 1)^a * width^b * positions^p * vocabulary^v

are fitted by least squares to ``log(error / u)`` over every measured run (clamped at 0),
and ``c`` is ``SAFETY`` times the largest ``error / (u f)`` measured. The fit is then
evaluated at each scale shape (:func:`spec.tolerances.reference_bound`): an extrapolation,
stated as one, from sizes a sweep can certify to sizes only the reference reaches.

``decoder-conformance tolerances derive --growth [--write]`` runs the study; ``--write``
stores it in ``spec/derived_tolerances.json`` under ``reference_growth``.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.tools.tolerance_derivation import ORACLE_DIGITS, fit_quantity
from impl.model import DecoderModel
from spec.config import DecoderConfig
from spec.formats import Precision, number_format
from spec.oracle import oracle_forward, to_float64
from spec.tolerances import Quantity, scaled_error
from spec.variants import scenario_parameters

__all__ = [
    "BASE",
    "SEEDS",
    "GrowthPoint",
    "fit_growth",
    "growth_document",
    "measure_growth",
    "render_growth",
    "render_scale_bounds",
    "sweep",
]

# Width 32 (4 heads of 8), SwiGLU 64, 2 blocks, 32 positions, vocabulary 64: about 2 s of
# oracle per run, so each sweep can go 3 to 8 times past it in one direction.
BASE = DecoderConfig(64, 32, 4, 64, 2, 32)
BASE_POSITIONS = 32
SEEDS = 3
SAFETY = 4.0
FORWARD_QUANTITIES = (Quantity.STAGES, Quantity.LOGITS, Quantity.LOSS)


@dataclass(frozen=True)
class GrowthPoint:
    """One measured run: which sweep, the configuration, the length and the errors."""

    sweep: str
    config: DecoderConfig
    positions: int
    seed: int
    errors: dict[str, float]
    seconds: float

    def features(self) -> tuple[float, float, float, float]:
        return (
            float(self.config.layers + 1),
            float(self.config.model_width),
            float(self.positions),
            float(self.config.vocabulary_size),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "sweep": self.sweep,
            "config": self.config.as_dict(),
            "positions": self.positions,
            "seed": self.seed,
            "errors": self.errors,
            "seconds": round(self.seconds, 2),
        }


def sweep() -> list[tuple[str, DecoderConfig, int]]:
    """The configurations measured: the base, then one feature varied at a time."""
    points: list[tuple[str, DecoderConfig, int]] = [("base", BASE, BASE_POSITIONS)]
    for width in (8, 16, 64, 96):
        config = dataclasses.replace(BASE, model_width=width, feed_forward_width=2 * width)
        points.append(("width", config, BASE_POSITIONS))
    for layers in (0, 1, 4, 8, 16):
        points.append(("depth", dataclasses.replace(BASE, layers=layers), BASE_POSITIONS))
    for positions in (8, 128, 256):
        config = dataclasses.replace(BASE, context=positions)
        points.append(("positions", config, positions))
    for vocabulary in (16, 512, 4096):
        config = dataclasses.replace(BASE, vocabulary_size=vocabulary)
        points.append(("vocabulary", config, BASE_POSITIONS))
    return points


def _errors(config: DecoderConfig, positions: int, seed: int) -> dict[str, float]:
    parameters = scenario_parameters(config, seed, "varied")
    rng = np.random.Generator(np.random.PCG64(seed))
    tokens = rng.integers(0, config.vocabulary_size, size=(1, positions))
    targets = rng.integers(0, config.vocabulary_size, size=(1, positions))
    exact = oracle_forward(config, parameters, tokens, targets, digits=ORACLE_DIGITS)
    model = DecoderModel.from_parameters(config, parameters)
    result = model.forward(tokens)
    stages = dict(result.stages())
    stage_error = max(
        float(np.max(scaled_error(stages[name].value, to_float64(values))))
        for name, values in exact.stages
    )
    logits = float(np.max(scaled_error(result.logits.value, to_float64(exact.logits))))
    loss = float(scaled_error(model.loss(tokens, targets).value, float(exact.mean_loss())))
    return {"stages": stage_error, "logits": logits, "loss": loss}


def measure_growth(
    seeds: int = SEEDS, progress: Callable[[str], None] | None = None
) -> list[GrowthPoint]:
    """The reference's worst scaled error per forward quantity at every sweep point."""
    say = progress or (lambda text: None)
    measured = []
    for name, config, positions in sweep():
        for offset in range(seeds):
            seed = 1000 * (offset + 1) + positions + config.model_width + config.layers
            started = time.perf_counter()
            errors = _errors(config, positions, seed)
            seconds = time.perf_counter() - started
            measured.append(GrowthPoint(name, config, positions, seed, errors, seconds))
            say(
                f"{name:<10} d={config.model_width:<3} N={config.layers:<2} T={positions:<3} "
                f"V={config.vocabulary_size:<4} seed {seed}: "
                + ", ".join(f"{q} {e:.2e}" for q, e in errors.items())
                + f" ({seconds:.1f} s)"
            )
    return measured


def fit_growth(points: Iterable[GrowthPoint], safety: float = SAFETY) -> dict[str, Any]:
    """Per forward quantity: the fitted exponents, the coefficient and the ratios."""
    chosen = list(points)
    unit = number_format(Precision.FLOAT64).unit_roundoff
    features = np.log(np.asarray([point.features() for point in chosen]))
    return {
        str(quantity): fit_quantity(
            features,
            np.asarray([point.errors[str(quantity)] for point in chosen]) / unit,
            safety,
        )
        for quantity in FORWARD_QUANTITIES
    }


def growth_document(points: list[GrowthPoint], command: str) -> dict[str, Any]:
    """What ``derived_tolerances.json`` keeps under ``reference_growth``."""
    return {
        "command": command,
        "written": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "base": {**BASE.as_dict(), "positions": BASE_POSITIONS},
        "seeds": len({point.seed for point in points if point.sweep == "base"}),
        "safety": SAFETY,
        "oracle_digits": ORACLE_DIGITS,
        "quantities": fit_growth(points),
        "points": [point.as_dict() for point in points],
    }


def render_growth(growth: dict[str, Any]) -> str:
    """The study as text: the sweep's worst error per point, the fit, and the extrapolated
    bound of the reference's own error at every scale shape."""
    from spec.scale import SCALE_SHAPES
    from spec.tolerances import reference_bound

    lines = [
        "the float64 reference against the "
        f"{growth['oracle_digits']}-digit mpmath oracle, one feature swept at a time from "
        f"the base {_describe_base(growth['base'])} ({growth['seeds']} seeds a point; worst "
        "scaled error over the seeds):",
        f"  {'sweep':<10} {'depth':>5} {'width':>5} {'T':>5} {'V':>5} "
        + " ".join(f"{q:>9}" for q in FORWARD_QUANTITIES),
    ]
    worst: dict[tuple[Any, ...], dict[str, float]] = {}
    for point in growth["points"]:
        config = point["config"]
        key = (point["sweep"], config["layers"], config["model_width"], point["positions"],
               config["vocabulary_size"])  # fmt: skip
        table = worst.setdefault(key, dict.fromkeys(map(str, FORWARD_QUANTITIES), 0.0))
        for quantity, error in point["errors"].items():
            table[quantity] = max(table[quantity], error)
    for (sweep_name, layers, width, positions, vocabulary), errors in worst.items():
        lines.append(
            f"  {sweep_name:<10} {layers:>5} {width:>5} {positions:>5} {vocabulary:>5} "
            + " ".join(f"{errors[str(q)]:>9.2e}" for q in FORWARD_QUANTITIES)
        )
    lines.append(
        "fit: error <= c * u * (depth+1)^a * width^b * positions^p * vocabulary^v, "
        f"c = {growth['safety']:g} x the worst error / (u f):"
    )
    models = list(growth["quantities"])
    for quantity, fitted in growth["quantities"].items():
        exponents = fitted["exponents"]
        lines.append(
            f"  {quantity:<9} a {exponents['depth']:.2f}  b {exponents['width']:.2f}  "
            f"p {exponents['positions']:.2f}  v {exponents['vocabulary']:.2f}  "
            f"worst {fitted['worst_ratio']:.3g} u f  median {fitted['median_ratio']:.3g} u f  "
            f"c {fitted['coefficient']:.3g}  ({fitted['samples']} runs)"
        )
    lines.append("extrapolated to the scale shapes (the reference's own error bound):")
    for name, shape in SCALE_SHAPES.items():
        own = reference_bound(shape.config, shape.positions, growth)
        bounds = ", ".join(f"{quantity} {own[Quantity(quantity)]:.2e}" for quantity in models)
        lines.append(f"  {name}: {bounds}")
    return "\n".join(lines)


def _describe_base(base: dict[str, Any]) -> str:
    return (
        f"V={base['vocabulary_size']}, d={base['model_width']}, {base['heads']} heads, "
        f"f={base['feed_forward_width']}, N={base['layers']}, T={base['positions']}"
    )


def render_scale_bounds() -> str:
    """Per scale shape: the reference's own extrapolated bound and each precision's bound
    measured at the shape, with how far the first stays below the second."""
    from conformance.tools.tolerance_derivation import CASE_SAFETY, SCALE_SEEDS
    from spec.scale import SCALE_SHAPES
    from spec.tolerances import (
        FLOAT64_SCALE_FACTOR,
        MissingScaleBound,
        Quantity,
        reference_bound,
        scale_tolerance,
    )

    lines = [
        "scale shapes (spec/scale.py), judged against the float64 reference: a float32, "
        "bfloat16 or float16 backend within the bound measured at the shape (tolerances "
        f"derive --scale: {CASE_SAFETY:g} x the emulation's worst over {SCALE_SEEDS} seeds), "
        "a float64 backend within "
        f"{FLOAT64_SCALE_FACTOR:g} x the reference's own extrapolated bound (stages, logits, "
        "loss from the growth fit above; gradients from the float64 model);",
        "headroom: the precision's bound / the reference's own, the smallest over the quantities",
    ]
    for name, shape in SCALE_SHAPES.items():
        config = shape.config
        own = reference_bound(config, shape.positions)
        lines.append(
            f"  {name} (V={config.vocabulary_size}, d={config.model_width}, N={config.layers}, "
            f"{shape.batch} x {shape.positions} tokens): reference "
            + ", ".join(f"{q} {own[q]:.2e}" for q in Quantity)
        )
        for precision in (Precision.FLOAT64, Precision.FLOAT32, Precision.BFLOAT16,
                          Precision.FLOAT16):  # fmt: skip
            try:
                bound = scale_tolerance(precision, name)
            except MissingScaleBound:
                lines.append(f"    {precision:<9} not measured")
                continue
            values = {q: float(getattr(bound, str(q))) for q in Quantity}
            headroom = min(values[q] / own[q] for q in Quantity)
            lines.append(
                f"    {precision:<9} "
                + ", ".join(f"{q} {values[q]:.3g}" for q in Quantity)
                + (f"  (headroom {headroom:.1e})" if precision is not Precision.FLOAT64 else "")
            )
    return "\n".join(lines)
