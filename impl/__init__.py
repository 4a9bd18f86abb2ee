"""The numpy float64 reference implementation with its own reverse-mode autodiff tape."""

from __future__ import annotations

from impl.errors import DecoderModelError
from impl.layers import NamedParameter
from impl.model import DecoderModel, ForwardResult
from impl.tape import Tensor

__all__ = ["DecoderModel", "DecoderModelError", "ForwardResult", "NamedParameter", "Tensor"]
