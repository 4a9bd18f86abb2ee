"""Building blocks for mutants: the reference with one component or one method replaced."""

from __future__ import annotations

from typing import Any

from conformance.adapters.reference import ReferenceBackend
from impl.model import DecoderModel

__all__ = ["MutantBackend", "model_with"]


def model_with(name: str, **components: Any) -> type[DecoderModel]:
    """A :class:`DecoderModel` subclass with some component classes replaced."""
    return type(name, (DecoderModel,), components)


class MutantBackend(ReferenceBackend):
    """The reference backend, for a mutant to override in exactly one place."""

    name = "mutant"
