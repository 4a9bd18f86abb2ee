"""How close a passing rule came to its bound: the largest ``error / tolerance`` of the
tolerance checks that passed (:meth:`conformance.checks.Judge.close`).

A port that passes at 95% of its bound passes today and fails on the next seed or the next
compiler; one at 0.1% has room. The report gives each passing rule its closest approach,
with the check and the test where it happened (JSON ``closest_to_bound``).

Each process keeps one :data:`RECORDER`; each test's closest approach travels to the
controller in the test report (``user_properties``), as the input coverage does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROPERTY", "RECORDER", "MarginRecorder", "describe_closest"]

PROPERTY = "closest_to_bound"  # the key of a test report's user property


class MarginRecorder:
    """The closest approach to a bound among one test's passing checks."""

    def __init__(self) -> None:
        self._fraction = -1.0
        self._check = ""

    def note(self, fraction: float, check: str) -> None:
        """A passing check that used ``fraction`` of its bound."""
        if fraction > self._fraction:
            self._fraction, self._check = fraction, check

    def take(self) -> dict[str, Any] | None:
        """The closest approach since the last take (``None`` if no check passed), and a
        fresh start."""
        taken = {"fraction": self._fraction, "check": self._check} if self._fraction >= 0 else None
        self.__init__()  # type: ignore[misc]
        return taken


RECORDER = MarginRecorder()


def describe_closest(closest: dict[str, Any]) -> str:
    """``closest to its bound: 26% (stage blocks.3.output: scaled error 3.1e-05 of 1.2e-04)``."""
    return f"closest to its bound: {100 * float(closest['fraction']):.2g}% ({closest['check']})"
