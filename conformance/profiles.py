"""Hypothesis profiles of the conformance suite: ``ci``, ``default`` and ``thorough``.

The plugin selects one before the test modules are imported; each property then takes its
settings from :func:`suite_settings`, so the project's own tests keep their profiles.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

__all__ = ["PROFILES", "active_profile", "select_profile", "suite_settings"]

# The judge fixture is stateless, so sharing it across examples is safe.
_QUIET_CHECKS = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.function_scoped_fixture,
]

PROFILES: dict[str, settings] = {
    # Derandomized and small: the same examples every run, for CI and quick checks.
    "ci": settings(
        max_examples=15,
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=_QUIET_CHECKS,
    ),
    "default": settings(
        max_examples=150, deadline=None, print_blob=True, suppress_health_check=_QUIET_CHECKS
    ),
    "thorough": settings(
        max_examples=300, deadline=None, print_blob=True, suppress_health_check=_QUIET_CHECKS
    ),
}

_active = "default"


def select_profile(name: str) -> None:
    """Make ``name`` the profile of every property defined from now on."""
    global _active  # noqa: PLW0603 - one process-wide choice, made once by the plugin
    if name not in PROFILES:
        raise ValueError(f"unknown conformance profile {name!r}; choose from {', '.join(PROFILES)}")
    _active = name


def active_profile() -> str:
    """The selected profile's name."""
    return _active


def suite_settings(*, cost: int = 1) -> settings:
    """Settings for one property; ``cost`` > 1 divides the examples of an expensive one.

    ``DECODER_CONFORMANCE_NO_SHRINK=1`` skips shrinking: the same examples run and fail, but
    the first failure is reported as found (the mutant catalogue needs verdicts, not minimal
    counterexamples).
    """
    chosen = PROFILES[_active]
    phases = chosen.phases
    if os.environ.get("DECODER_CONFORMANCE_NO_SHRINK") == "1":
        phases = tuple(phase for phase in phases if phase is not Phase.shrink)
    return settings(chosen, max_examples=max(2, chosen.max_examples // cost), phases=phases)
