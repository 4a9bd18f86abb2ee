"""A torch port whose attention streams over keys, as flash attention does: keys in tiles,
a running row maximum, the exponentials' sum and the weighted values rescaled whenever the
maximum grows. Correct, but its sums come in another order than a plain softmax's, and at
long lengths a tile ends partial. ``ForgetsTheRescale`` is the classic bug of such kernels:
the running output is not rescaled when a later tile raises the maximum (the denominator is),
which only shows once a row spans more than one tile."""

from __future__ import annotations

import math
import types

import torch

from conformance.adapters.torch_backend import (
    Attention,
    TorchDecoder,
    TorchFloat16Backend,
    TorchFloat32Backend,
    working_dtype,
)
from spec.config import DecoderConfig

KEY_TILE = 64


def streamed_attention(self: Attention, x: torch.Tensor, *, rescale_output: bool) -> torch.Tensor:
    work = working_dtype(x.dtype)  # 16-bit ports keep their running sums in float32
    query, key, value = (part.to(work) for part in self.projected(x))
    length = x.shape[1]
    rows = torch.arange(length)[:, None]
    maximum = torch.full((*query.shape[:-1], 1), -math.inf, dtype=work)
    total = torch.zeros((*query.shape[:-1], 1), dtype=work)
    mixed = torch.zeros_like(query)
    for start in range(0, length, KEY_TILE):
        stop = min(start + KEY_TILE, length)
        scores = query @ key[:, :, start:stop].transpose(-1, -2) / math.sqrt(query.shape[-1])
        scores = scores.masked_fill(torch.arange(start, stop)[None, :] > rows, -math.inf)
        grown = torch.maximum(maximum, scores.amax(-1, keepdim=True))
        # A row with no visible key yet keeps a maximum of -inf: shift it by 0, not by -inf.
        shift = torch.where(torch.isinf(grown), torch.zeros_like(grown), grown)
        weights = torch.exp(scores - shift)
        correction = torch.exp(maximum - shift)
        total = total * correction + weights.sum(-1, keepdim=True)
        kept = mixed * correction if rescale_output else mixed
        mixed = kept + weights @ value[:, :, start:stop]
        maximum = grown
    return self.merged((mixed / total).to(x.dtype))


def _streamed(module: TorchDecoder, *, rescale_output: bool) -> TorchDecoder:
    for block in module.blocks:
        attention = block.attention
        attention.forward = types.MethodType(  # type: ignore[method-assign]
            lambda own, x: streamed_attention(own, x, rescale_output=rescale_output), attention
        )
    return module


class StreamingFloat32(TorchFloat32Backend):
    name = "torch-float32-streaming-attention"
    rescale_output = True

    def build(self, config: DecoderConfig, parameters):  # type: ignore[no-untyped-def]
        config, module = super().build(config, parameters)
        return config, _streamed(module, rescale_output=self.rescale_output)


class StreamingFloat16(TorchFloat16Backend):
    name = "torch-float16-streaming-attention"

    def build(self, config: DecoderConfig, parameters):  # type: ignore[no-untyped-def]
        config, module = super().build(config, parameters)
        return config, _streamed(module, rescale_output=True)


class ForgetsTheRescale(StreamingFloat32):
    name = "torch-float32-streaming-attention-without-rescale"
    rescale_output = False
