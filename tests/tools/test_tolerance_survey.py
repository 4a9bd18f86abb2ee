"""The tolerance survey: the committed float64 table still holds; the seed check's reach."""

from __future__ import annotations

from conformance.adapters.reference import ReferenceBackend
from conformance.tools.tolerance_survey import account_for_seed_check, survey
from spec.tolerances import Precision, tolerance_for

FLOAT64 = tolerance_for(Precision.FLOAT64)


def test_committed_float64_table_still_holds() -> None:
    measured = survey(ReferenceBackend(), configs=12, seed=1)
    values, gradients = measured.derived_tolerance()
    assert values is not None and values <= FLOAT64.values
    assert gradients is not None and gradients <= FLOAT64.gradients


def test_seed_check_account() -> None:
    """The step-1e-6 differences are off by ~1e-10; the 2e-5 bound lets errors under 2e-5 pass."""
    account = account_for_seed_check(ReferenceBackend())
    assert account.coordinates == 24
    assert account.numerical_error_max < 1e-8
    assert account.analytic_error_max < 1e-15
    assert 1.9e-5 < account.smallest_caught <= 2e-5
