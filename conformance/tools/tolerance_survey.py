"""Measure a backend's errors against the mpmath oracle, and derive tolerances from them.

``decoder-conformance tolerances derive`` runs :func:`survey` over generated configurations
and prints, per stage, the distribution of the largest scaled error of each configuration,
and the tolerance that distribution implies: the maximum times a safety margin, rounded up
to a power of ten.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st

from conformance.adapter import Backend, Capability
from spec import strategies
from spec.config import FIXTURE, DecoderConfig
from spec.gradcheck import central_difference_checks, seed_probe
from spec.oracle import oracle_forward, to_float64
from spec.oracle_gradients import oracle_gradients
from spec.recipe import initial_parameters
from spec.tolerances import Tolerance, scaled_error

__all__ = [
    "SAFETY_MARGIN",
    "SeedCheckAccount",
    "Survey",
    "account_for_seed_check",
    "render_survey",
    "survey",
    "survey_cases",
]

SAFETY_MARGIN = 100.0
STAGE_CLASSES = ("embedding", "blocks", "final-norm", "logits", "loss", "gradients")


IdArray = npt.NDArray[np.int64]
Case = tuple[DecoderConfig, int, IdArray, IdArray]


def survey_cases() -> st.SearchStrategy[Case]:
    """Configurations a little beyond the suite's (depth 0-3, 1-4 heads, head widths 2-8,
    contexts up to 8, RoPE bases down to 10), each with a seed, tokens and targets."""

    @st.composite
    def build(draw: st.DrawFn) -> Case:
        config = draw(
            strategies.configs(
                max_vocabulary=12,
                max_heads=4,
                max_head_width=8,
                max_feed_forward=16,
                max_layers=3,
                max_context=8,
                rope_bases=(10000.0, 100.0, 10.0),
            )
        )
        tokens, targets = draw(strategies.runs(config))
        return config, draw(st.integers(0, 2**64 - 1)), tokens, targets

    return build()


@dataclass
class Survey:
    """Per stage class, the largest scaled error of each measured configuration."""

    backend: str
    precision: str
    errors: dict[str, list[float]] = field(
        default_factory=lambda: {name: [] for name in STAGE_CLASSES}
    )

    def derived(self, stage: str) -> float | None:
        """The tolerance one stage's errors imply (None without measurements)."""
        return _power_above(self.errors[stage])

    def derived_tolerance(self) -> tuple[float | None, float | None]:
        """The value tolerance (every forward stage, logits and loss) and the gradient one."""
        forward = [value for stage in STAGE_CLASSES[:-1] for value in self.errors[stage]]
        return _power_above(forward), _power_above(self.errors["gradients"])


def _power_above(errors: list[float]) -> float | None:
    """``max(errors) x SAFETY_MARGIN`` rounded up to a power of ten."""
    if not errors:
        return None
    worst = max(*errors, float(np.finfo(np.float64).eps))
    return float(10.0 ** math.ceil(math.log10(worst * SAFETY_MARGIN)))


def survey(backend: Backend, *, configs: int = 100, seed: int = 0) -> Survey:
    """Errors of ``backend`` against the oracle over ``configs`` generated configurations."""
    measured = Survey(backend.name, str(backend.precision))
    for config, parameter_seed, tokens, targets in strategies.sample(
        survey_cases(), configs, seed_value=seed
    ):
        parameters = initial_parameters(config, parameter_seed)
        exact = oracle_forward(config, parameters, tokens, targets, digits=40)
        model = backend.build(config, parameters)
        output = backend.forward(model, tokens)
        if output.stages is not None:
            got = dict(output.stages)
            for name, values in exact.stages:
                stage = "blocks" if name.startswith("block-") else name
                measured.errors[stage].append(
                    float(np.max(scaled_error(got[name], to_float64(values))))
                )
        measured.errors["logits"].append(
            float(np.max(scaled_error(output.logits, to_float64(exact.logits))))
        )
        loss = backend.loss(model, tokens, targets)
        measured.errors["loss"].append(float(scaled_error(loss.loss, float(exact.mean_loss()))))
        if Capability.GRADIENTS in backend.capabilities and loss.gradients is not None:
            oracle = oracle_gradients(config, parameters, tokens, targets, digits=40)
            worst = max(
                float(np.max(scaled_error(loss.gradients[name], value)))
                for name, value in oracle.gradients.items()
            )
            measured.errors["gradients"].append(worst)
    return measured


@dataclass
class SeedCheckAccount:
    """What the seed's step-1e-6 central-difference check can and cannot see."""

    coordinates: int
    numerical_error_max: float
    numerical_error_median: float
    analytic_error_max: float
    smallest_caught: float
    tolerance: float


def account_for_seed_check(backend: Backend) -> SeedCheckAccount:
    """The seed's probe: its own float64 central differences against the oracle gradient."""
    config, parameters = seed_probe()
    tokens, targets = FIXTURE.probe_tokens, FIXTURE.probe_targets
    exact = oracle_gradients(config, parameters, tokens, targets).gradients
    model = backend.build(config, parameters)
    analytic = backend.loss(model, tokens, targets).gradients or {}
    checks = central_difference_checks(
        parameters,
        analytic,
        lambda shifted: backend.loss(backend.build(config, shifted), tokens, targets).loss,
    )
    numerical_errors, analytic_errors, slack = [], [], []
    for check in checks:
        truth = float(exact[check.name][check.index])
        numerical_errors.append(abs(check.numerical - truth))
        analytic_errors.append(abs(check.analytic - truth))
        # An analytic error d passes while |a + d - n| / s <= bound, s = max(1, |a|, |n|):
        # the smallest d that fails is about bound * s minus the numerical error already there.
        scale = max(1.0, abs(truth), abs(check.numerical))
        slack.append(FIXTURE.gradient_tolerance * scale - abs(check.numerical - truth))
    return SeedCheckAccount(
        coordinates=len(checks),
        numerical_error_max=max(numerical_errors),
        numerical_error_median=float(np.median(numerical_errors)),
        analytic_error_max=max(analytic_errors),
        smallest_caught=min(slack),
        tolerance=FIXTURE.gradient_tolerance,
    )


def _format(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def render_survey(
    measured: Survey, committed: Tolerance | None = None, account: SeedCheckAccount | None = None
) -> str:
    """The error distribution per stage and the table it implies."""
    lines = [
        f"backend {measured.backend} ({measured.precision}): largest scaled error "
        "|got - exact| / max(1, |exact|) per configuration, against the 40-digit oracle;",
        f"tolerance = max x {SAFETY_MARGIN:g}, rounded up to a power of ten",
        f"{'stage':<12} {'samples':>7} {'max':>9} {'p99':>9} {'median':>9} {'derived':>9}",
    ]
    for stage in STAGE_CLASSES:
        values = measured.errors[stage]
        if not values:
            lines.append(f"{stage:<12} {0:>7} {'-':>9} {'-':>9} {'-':>9} {'-':>9}")
            continue
        array = np.asarray(values)
        lines.append(
            f"{stage:<12} {array.size:>7} {array.max():>9.1e} {np.percentile(array, 99):>9.1e} "
            f"{np.median(array):>9.1e} {_format(measured.derived(stage)):>9}"
        )
    values_tolerance, gradient_tolerance = measured.derived_tolerance()
    derived = f"values {_format(values_tolerance)}, gradients {_format(gradient_tolerance)}"
    lines.append(f"derived table: {derived}")
    if committed is not None:
        pairs = ((values_tolerance, committed.values), (gradient_tolerance, committed.gradients))
        holds = all(derived is None or derived <= bound for derived, bound in pairs)
        verdict = "holds" if holds else "DOES NOT HOLD"
        lines.append(
            f"committed table ({measured.precision}): values {committed.values:.0e}, "
            f"gradients {committed.gradients:.0e}: {verdict}"
        )
    if account is not None:
        lines += [
            "",
            f"the seed's gradient check on its probe model "
            f"({account.coordinates} coordinates, step 1e-6):",
            f"  central-difference error against the oracle: "
            f"max {account.numerical_error_max:.1e}, median {account.numerical_error_median:.1e}",
            f"  the backend's analytic gradient against the oracle: "
            f"max {account.analytic_error_max:.1e}",
            f"  smallest analytic-gradient error tolerance {account.tolerance:g} is sure to catch: "
            f"{account.smallest_caught:.1e}",
        ]
    return "\n".join(lines) + "\n"
