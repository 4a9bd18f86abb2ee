"""A catalogue of deliberately broken backends the suite must reject.

Each mutant differs from the reference in exactly one way a real implementer could get
wrong. Its class is its entry (:func:`conformance.tools.mutants.base.mutant`): the name, the
mistake (the docstring's first line), the rule expected to catch it, and the rule
categories whose rules count as catching it for the right reason. The modules are imported
here in the catalogue's order: validation, structure, forward numerics, training, state
kept between calls, the bugs public trackers report, and precision bugs (each at the
precision where it is one).
"""

from __future__ import annotations

from conformance.tools.mutants import (
    history,
    inputs,
    numerics,
    precision,
    reported,
    structure,
    training,
)
from conformance.tools.mutants.base import MUTANTS, Mutant

__all__ = ["CONTROLS", "MUTANTS", "Mutant", "mutant_named"]

# The catalogue's order: by topic, then as each module defines its mutants (a stable sort).
_ORDER = [
    module.__name__
    for module in (inputs, structure, numerics, training, history, reported, precision)
]
MUTANTS.sort(key=lambda entry: _ORDER.index(entry.adapter.partition(":")[0]))

# Correct backends: a suite that rejects them is as broken as one that accepts the mutants.
CONTROLS: tuple[tuple[str, str, str | None], ...] = (
    ("reference", "reference", None),
    (
        "reference-over-subprocess",
        "subprocess",
        "{python} -m conformance.adapters.reference_server",
    ),
)


def mutant_named(name: str) -> Mutant:
    """The catalogue entry of that name; a ``KeyError`` lists the known names."""
    for entry in MUTANTS:
        if entry.name == name:
            return entry
    raise KeyError(f"no mutant named {name!r}; see decoder-conformance mutants --list")
