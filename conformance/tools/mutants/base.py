"""The catalogue's one registry, and the building blocks of a mutant.

A mutant is the reference backend wrong in exactly one way. Its class is its whole entry:
:func:`mutant` registers it, names it after the class (``RopeOnValues`` is
``rope-on-values``), takes the mistake from the first line of its docstring, and records
the rule meant to catch it; the rule's category, and any categories given besides, are the
ones whose rules count as catching it for the right reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from conformance.adapter import BackendBase
from conformance.adapters.reference import ReferenceBackend
from impl.model import DecoderModel
from spec.rules import RuleCategory, rule

__all__ = ["MUTANTS", "Mutant", "MutantBackend", "model_with", "mutant"]


@dataclass(frozen=True)
class Mutant:
    """One broken backend: where it lives, what is wrong, and what should notice."""

    name: str
    adapter: str
    mistake: str
    rule: str
    related: frozenset[RuleCategory]


# Filled as the catalogue's modules are imported, in the order they define their mutants.
MUTANTS: list[Mutant] = []


class MutantBackend(ReferenceBackend):
    """The reference backend, for a mutant to override in exactly one place."""

    name = "mutant"


Backend = TypeVar("Backend", bound=type[BackendBase])


def _kebab(class_name: str) -> str:
    return "-".join(part.lower() for part in re.findall(r"[A-Z][a-z]*[0-9]*", class_name))


def mutant(rule_id: str, *also: RuleCategory) -> Callable[[Backend], Backend]:
    """Register a mutant class, caught by ``rule_id`` (or a rule of a category in ``also``)."""
    expected = rule(rule_id)

    def register(backend: Backend) -> Backend:
        doc = (backend.__doc__ or "").strip()
        if not doc:
            raise ValueError(f"mutant {backend.__name__} needs a docstring naming its mistake")
        backend.name = _kebab(backend.__name__)
        MUTANTS.append(
            Mutant(
                name=backend.name,
                adapter=f"{backend.__module__}:{backend.__qualname__}",
                mistake=doc.splitlines()[0].rstrip("."),
                rule=rule_id,
                related=frozenset({expected.category, *also}),
            )
        )
        return backend

    return register


def model_with(name: str, **layers: Any) -> type[DecoderModel]:
    """A :class:`DecoderModel` subclass with some layer classes replaced (``attention_class``,
    ``norm_class``, ``rope_class``, ``feed_forward_class``, ``block_class``)."""
    return type(name, (DecoderModel,), layers)
