"""Measure a backend's errors against the mpmath oracle, judged by the derived tolerances.

``decoder-conformance tolerances derive --adapter NAME`` runs :func:`survey` over the suite's
scenarios and prints, per quantity, the errors, the share of each case's derived bound they
use, and the ratio of the derived bound to torch.testing's default criterion on the same
elements (the derivation itself is :mod:`conformance.tools.tolerance_derivation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st

from conformance.adapter import Backend, Capability
from conformance.cases import Scenario, scenarios
from spec import strategies
from spec.config import FIXTURE
from spec.formats import Precision
from spec.gradcheck import central_difference_checks, seed_probe
from spec.oracle import oracle_forward, to_float64
from spec.oracle_gradients import oracle_gradients
from spec.tolerances import Quantity, scaled_error, tolerance_for

__all__ = [
    "TORCH_TESTING",
    "SeedCheckAccount",
    "Survey",
    "account_for_seed_check",
    "render_survey",
    "survey",
    "survey_cases",
]

# torch.testing.assert_close's defaults, (rtol, atol): |got - exact| <= atol + rtol |exact|.
TORCH_TESTING: dict[Precision, tuple[float, float]] = {
    Precision.FLOAT64: (1e-7, 1e-7),
    Precision.FLOAT32: (1.3e-6, 1e-5),
    Precision.BFLOAT16: (1.6e-2, 1e-5),
    Precision.FLOAT16: (1e-3, 1e-5),
}


def survey_cases() -> st.SearchStrategy[Scenario]:
    """The suite's own scenarios: recipe and varied parameters, full contexts."""
    return scenarios(full_context=True)


@dataclass
class Survey:
    """Per quantity and measured case: the largest scaled error, the share of the derived
    bound it uses, and the derived bound over torch.testing's default criterion."""

    backend: str
    precision: str
    errors: dict[Quantity, list[float]] = field(
        default_factory=lambda: {quantity: [] for quantity in Quantity}
    )
    use: dict[Quantity, list[float]] = field(
        default_factory=lambda: {quantity: [] for quantity in Quantity}
    )
    against_torch: dict[Quantity, list[float]] = field(
        default_factory=lambda: {quantity: [] for quantity in Quantity}
    )

    def add(
        self,
        quantity: Quantity,
        pairs: list[tuple[npt.ArrayLike, npt.ArrayLike]],
        bound: float,
    ) -> None:
        """Record one case: ``pairs`` of (got, exact) arrays judged at ``bound``."""
        rtol, atol = TORCH_TESTING[Precision(self.precision)]
        worst, ratios = 0.0, []
        for got, exact in pairs:
            exact_array = np.asarray(exact, dtype=np.float64)
            worst = max(worst, float(np.max(scaled_error(got, exact_array), initial=0.0)))
            # The absolute error each criterion allows, element by element.
            derived = bound * np.maximum(1.0, np.abs(exact_array))
            ratios.append(np.ravel(derived / (atol + rtol * np.abs(exact_array))))
        self.errors[quantity].append(worst)
        self.use[quantity].append(worst / bound)
        self.against_torch[quantity].append(float(np.median(np.concatenate(ratios))))


def survey(backend: Backend, *, configs: int = 100, seed: int = 0) -> Survey:
    """``backend``'s errors against the oracle over ``configs`` of the suite's scenarios,
    each judged at the derived tolerance of its configuration."""
    measured = Survey(backend.name, str(backend.precision))
    model = tolerance_for(backend.precision)
    for scenario in strategies.sample(survey_cases(), configs, seed_value=seed):
        config, tokens, targets = scenario.config, scenario.tokens, scenario.targets
        parameters = scenario.parameters()
        bound = model.at(config, tokens.shape[1])
        exact = oracle_forward(config, parameters, tokens, targets, digits=40)
        built = backend.build(config, parameters)
        output = backend.forward(built, tokens)
        if output.stages is not None:
            got = dict(output.stages)
            measured.add(
                Quantity.STAGES,
                [(got[name], to_float64(values)) for name, values in exact.stages],
                bound.stages,
            )
        measured.add(Quantity.LOGITS, [(output.logits, to_float64(exact.logits))], bound.logits)
        loss = backend.loss(built, tokens, targets)
        measured.add(Quantity.LOSS, [(loss.loss, float(exact.mean_loss()))], bound.loss)
        if Capability.GRADIENTS in backend.capabilities and loss.gradients is not None:
            oracle = oracle_gradients(config, parameters, tokens, targets, digits=40)
            measured.add(
                Quantity.GRADIENTS,
                [(loss.gradients[name], value) for name, value in oracle.gradients.items()],
                bound.gradients,
            )
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


def render_survey(measured: Survey, account: SeedCheckAccount | None = None) -> str:
    """Per quantity: the errors, the share of the derived bound they use, and how the derived
    bound compares with torch.testing's default criterion on the same elements."""
    rtol, atol = TORCH_TESTING[Precision(measured.precision)]
    lines = [
        f"backend {measured.backend} ({measured.precision}): largest scaled error "
        "|got - exact| / max(1, |exact|) per case, against the 40-digit oracle, each case "
        "judged at its configuration's derived tolerance;",
        f"vs torch.testing: the derived bound over atol + rtol |exact| "
        f"(rtol {rtol:g}, atol {atol:g}), median over a case's elements",
        f"{'quantity':<10} {'cases':>5} {'max error':>9} {'median':>9} {'max use':>8} "
        f"{'vs torch.testing median':>24} {'worst':>8}",
    ]
    for quantity in Quantity:
        errors = measured.errors[quantity]
        if not errors:
            lines.append(f"{quantity!s:<10} {0:>5} {'-':>9}")
            continue
        ratios = np.asarray(measured.against_torch[quantity])
        lines.append(
            f"{quantity!s:<10} {len(errors):>5} {max(errors):>9.1e} {np.median(errors):>9.1e} "
            f"{max(measured.use[quantity]):>8.3f} {np.median(ratios):>24.3g} {ratios.max():>8.3g}"
        )
    worst_use = max((max(values) for values in measured.use.values() if values), default=0.0)
    verdict = "holds" if worst_use <= 1 else "DOES NOT HOLD"
    lines.append(f"the derived tolerances {verdict} (largest use {worst_use:.3f})")
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
