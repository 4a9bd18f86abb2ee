"""torch with one precision bug, for the scale profile: fast enough for real shapes.

The mutant catalogue's precision bugs are emulated backends (every operation rounded in
numpy): right for the ci profile, minutes a pass at SmolLM2-135M's shape. These are the same
bugs in the torch module itself. Loaded as ``tests/conformance/scale_mutants.py:NAME``; each
replaces a function of ``conformance.adapters.torch_backend`` in its own process (the suite
runs one adapter a process).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from conformance.adapter import Parameters
from conformance.adapters import torch_backend
from conformance.adapters.torch_backend import TorchFloat16Backend, TorchFloat32Backend
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


def _at_most_64_features_rotated(
    length: int, head_width: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The right tables for the first 32 pairs of a head; past them angle 0 (cos 1, sin 0),
    as a kernel written for heads of width 64 leaves the rest of a wider head unrotated."""
    cos, sin = _right_tables(length, head_width, base, dtype)
    cos, sin = cos.clone(), sin.clone()
    cos[:, 32:], sin[:, 32:] = 1, 0
    return cos, sin


_right_tables = torch_backend.rotary_tables


class RopeRotatesAtMostSixtyFourFeatures(TorchFloat32Backend):
    """torch-float32 whose RoPE rotates at most 64 features of a head: the generated cases'
    heads are at most 8 wide, so only heads of 128 (VALUE-WIDE-HEADS, the scale shape
    wide-heads) see it. The catalogue's ``rope-rotates-at-most-sixty-four-features`` in torch."""

    name = "torch-float32-rope-rotates-at-most-sixty-four-features"

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        torch_backend.rotary_tables = _at_most_64_features_rotated
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


def _rms_norm_in_float16(self: torch_backend.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm on the 16-bit values themselves: autograd's ``rsqrt`` backward overflows."""
    mean_square = (x * x).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(mean_square + self.epsilon) * self.gain


class RmsNormInFloat16(TorchFloat16Backend):
    """torch-float16 whose RMSNorm runs in float16, forward and backward (the torch adapter
    before it normalized in float32)."""

    name = "torch-float16-rms-norm-in-float16"

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        torch_backend.RMSNorm.forward = _rms_norm_in_float16  # type: ignore[method-assign]
        return super().build(config, parameters)


def _cross_entropy_in_float16(
    logits: torch.Tensor, targets: Any, vocabulary_size: int
) -> torch.Tensor:
    labels = torch.as_tensor(np.asarray(targets, dtype=np.int64).reshape(-1))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocabulary_size), labels)


class LossInFloat16(TorchFloat16Backend):
    """torch-float16 whose loss is torch's float16 ``cross_entropy`` (the sum of the
    exponentials overflows past 65,504 near-uniform logits)."""

    name = "torch-float16-loss-in-float16"

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        torch_backend.mean_nll = _cross_entropy_in_float16
        return super().build(config, parameters)


def hf_llama_frequencies_in_bfloat16() -> Any:
    """hf-llama-bfloat16 with its RoPE inverse frequencies rounded to bfloat16, as casting
    the whole module with ``.to`` leaves them (transformers#29496; the adapter did this before
    it kept them in float32). A factory, so the torch mutants load without transformers."""
    from conformance.adapters.hf_llama import HFLlamaBfloat16

    class FrequenciesInBfloat16(HFLlamaBfloat16):
        name = "hf-llama-bfloat16-frequencies-in-bfloat16"

        def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
            built = super().build(config, parameters)
            for module in built[1].modules():
                if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                    module.inv_freq = module.inv_freq.to(torch.bfloat16)
            return built

    return FrequenciesInBfloat16()
