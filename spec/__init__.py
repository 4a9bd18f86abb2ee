"""The executable specification of the tied decoder; it imports no implementation."""

from __future__ import annotations

from spec.config import FIXTURE, DecoderConfig, Fixture
from spec.errors import ErrorCategory, ErrorKind

__all__ = ["FIXTURE", "DecoderConfig", "ErrorCategory", "ErrorKind", "Fixture"]
