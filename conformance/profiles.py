"""Hypothesis profiles of the conformance suite: ``ci``, ``default``, ``thorough`` and ``scale``.

``scale`` is not a larger ``thorough``: it runs the SCALE rules (and the adapter contract)
at the named shapes of :mod:`spec.scale`, judged against the float64 reference, and none of
the generated properties; the other profiles run everything but the SCALE rules.

The plugin selects one before the test modules are imported; each property then takes its
settings from :func:`suite_settings`, so the project's own tests keep their profiles. A run
is reproducible from its profile, its example count and its seed alone: no example database
is read or written, and each failing property reports one failure, the first it minimized.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings

__all__ = [
    "PROFILES",
    "SCALE_PROFILE",
    "Selection",
    "active",
    "runs_rule",
    "select_profile",
    "suite_settings",
]

# The judge fixture is stateless, so sharing it across examples is safe.
_QUIET_CHECKS = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.function_scoped_fixture,
]


def _profile(examples: int, *, derandomize: bool) -> settings:
    return settings(
        max_examples=examples,
        derandomize=derandomize,
        database=None,
        deadline=None,
        print_blob=True,
        report_multiple_bugs=False,
        suppress_health_check=_QUIET_CHECKS,
    )


PROFILES: dict[str, settings] = {
    # Derandomized and small: the same examples every run, for CI and quick checks.
    "ci": _profile(15, derandomize=True),
    "default": _profile(150, derandomize=False),
    "thorough": _profile(300, derandomize=False),
    # Fixed shapes, no generated examples: one run of each SCALE rule per shape.
    "scale": _profile(1, derandomize=True),
}
SCALE_PROFILE = "scale"
# Rules the scale profile runs besides its own: a broken adapter contract is reported first.
_ALSO_AT_SCALE = frozenset({"ADAPTER-CONTRACT"})


def runs_rule(profile: str, rule_id: str) -> bool:
    """Whether ``profile`` runs the rule: SCALE rules at ``scale`` only, the rest elsewhere."""
    from spec.rules import RuleCategory, rule

    at_scale = rule(rule_id).category is RuleCategory.SCALE
    if profile == SCALE_PROFILE:
        return at_scale or rule_id in _ALSO_AT_SCALE
    return not at_scale


@dataclass(frozen=True)
class Selection:
    """The profile a run uses, and what the command line changed in it."""

    name: str = "default"
    max_examples: int | None = None
    seed: int | None = None

    @property
    def examples(self) -> int:
        """Examples a property of cost 1 runs."""
        return self.max_examples or PROFILES[self.name].max_examples

    @property
    def derandomized(self) -> bool:
        """Whether examples come from each test's own fixed seed (no seed given to ``ci``)."""
        return self.seed is None and PROFILES[self.name].derandomize


_active = Selection()


def select_profile(name: str, *, max_examples: int | None = None, seed: int | None = None) -> None:
    """Make ``name`` (with an example count or a seed, when given) the profile of every
    property defined from now on; a seed turns derandomization off."""
    global _active  # noqa: PLW0603 - one process-wide choice, made once by the plugin
    if name not in PROFILES:
        raise ValueError(f"unknown conformance profile {name!r}; choose from {', '.join(PROFILES)}")
    if max_examples is not None and max_examples < 1:
        raise ValueError(f"max_examples must be at least 1, got {max_examples}")
    _active = Selection(name, max_examples, seed)


def active() -> Selection:
    """The selected profile."""
    return _active


def suite_settings(*, cost: int = 1) -> settings:
    """Settings for one property; ``cost`` > 1 divides the examples of an expensive one.

    ``DECODER_CONFORMANCE_NO_SHRINK=1`` skips shrinking: the same examples run and fail, but
    the first failure is reported as found (the mutant catalogue needs verdicts, not minimal
    counterexamples).
    """
    chosen = PROFILES[_active.name]
    phases = chosen.phases
    if os.environ.get("DECODER_CONFORMANCE_NO_SHRINK") == "1":
        phases = tuple(phase for phase in phases if phase is not Phase.shrink)
    return settings(
        chosen,
        max_examples=max(2, _active.examples // cost),
        derandomize=_active.derandomized,
        phases=phases,
    )
