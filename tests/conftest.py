"""Hypothesis profiles for the project's own tests (``HYPOTHESIS_PROFILE`` selects one)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# The numerical properties run whole models; wall-clock deadlines would only add flakiness.
settings.register_profile(
    "ci",
    max_examples=15,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("default", max_examples=40, deadline=None, print_blob=True)
settings.register_profile("thorough", max_examples=300, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
