"""The tolerance survey: correct backends stay within their derived bounds; the seed check's
reach."""

from __future__ import annotations

from conformance.adapters.emulated import EmulatedBfloat16
from conformance.adapters.reference import ReferenceBackend
from conformance.tools.tolerance_survey import account_for_seed_check, render_survey, survey
from spec.tolerances import Quantity


def test_the_reference_stays_within_its_derived_bounds() -> None:
    measured = survey(ReferenceBackend(), configs=12, seed=1)
    for quantity in Quantity:
        assert len(measured.use[quantity]) == 12
        assert max(measured.use[quantity]) <= 1.0, quantity
    assert "holds" in render_survey(measured)


def test_a_bfloat16_backend_is_judged_at_bfloat16() -> None:
    """Its errors are far above float64's and within its own bounds; torch.testing's default
    bfloat16 criterion (rtol 1.6e-2, atol 1e-5) is tighter than what it needs."""
    measured = survey(EmulatedBfloat16(), configs=8, seed=2)
    assert max(measured.errors[Quantity.LOGITS]) > 1e-4
    assert max(max(values) for values in measured.use.values()) <= 1.0
    assert min(measured.against_torch[Quantity.STAGES]) > 1.0


def test_seed_check_account() -> None:
    """The step-1e-6 differences are off by ~1e-10; the 2e-5 bound lets errors under 2e-5 pass."""
    account = account_for_seed_check(ReferenceBackend())
    assert account.coordinates == 24
    assert account.numerical_error_max < 1e-8
    assert account.analytic_error_max < 1e-15
    assert 1.9e-5 < account.smallest_caught <= 2e-5
