"""torch-float32 with one precision bug, for the scale profile: fast enough for real shapes.

The mutant catalogue's precision bugs are emulated backends (every operation rounded in
numpy): right for the ci profile, minutes a pass at SmolLM2-135M's shape. These are the same
bugs in the torch module itself. Loaded as ``tests/conformance/scale_mutants.py:NAME``; each
replaces a function of ``conformance.adapters.torch_backend`` in its own process (the suite
runs one adapter a process).
"""

from __future__ import annotations

from typing import Any

import torch

from conformance.adapter import Parameters
from conformance.adapters import torch_backend
from conformance.adapters.torch_backend import TorchFloat32Backend
from spec.config import DecoderConfig


def _tables_in_float16(
    length: int, head_width: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions, frequencies and angles in float16: position 2049 is 2048 there, and the
    angle of position 511 is off by up to 0.125 (the catalogue's RoPE-table bug, in float16)."""
    exponents = torch.arange(head_width // 2, dtype=torch.float16) * (-2.0 / head_width)
    frequencies = torch.pow(torch.tensor(base, dtype=torch.float32), exponents.float()).half()
    angles = torch.arange(length, dtype=torch.float32).half()[:, None] * frequencies
    return torch.cos(angles.float()).to(dtype), torch.sin(angles.float()).to(dtype)


class RopeTablesInFloat16(TorchFloat32Backend):
    """torch-float32 whose RoPE positions and angles are computed in float16."""

    name = "torch-float32-rope-tables-in-float16"

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        torch_backend.rotary_tables = _tables_in_float16
        return super().build(config, parameters)


def _softmax_in_float16(scores: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(scores.half(), dim=dim).to(scores.dtype)


class _Float16Softmax:
    """``torch`` as the torch adapter sees it, with a softmax computed in float16."""

    def __getattr__(self, name: str) -> Any:
        return _softmax_in_float16 if name == "softmax" else getattr(torch, name)


class SoftmaxInFloat16(TorchFloat32Backend):
    """torch-float32 whose attention softmax runs in float16 (llama.cpp#10015's bug)."""

    name = "torch-float32-softmax-in-float16"

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        torch_backend.torch = _Float16Softmax()  # type: ignore[assignment]
        return super().build(config, parameters)
