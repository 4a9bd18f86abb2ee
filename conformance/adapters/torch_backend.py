"""A PyTorch backend: a plain ``torch.nn.Module`` written from the spec, in float64, float32,
bfloat16 or float16.

Parameters keep the spec's names and layouts (``x @ W`` with ``W`` stored ``[in, out]``), so
``named_parameters()`` is the stable list. The table is one ``Parameter`` used for the lookup
and, transposed, for the head; autograd adds both contributions. Like most framework code the
module itself validates nothing: the adapter checks inputs with :mod:`spec.validation` first
and turns a violation into a refusal, and builds parameters with :mod:`spec.recipe`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from conformance.adapter import (
    BackendBase,
    Capability,
    FloatArray,
    ForwardOutput,
    LossOutput,
    Parameters,
    Refusal,
    refuse,
    refuse_parameters_past_the_bound,
)
from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.recipe import SplitMix64, initial_parameters
from spec.tolerances import Precision
from spec.validation import (
    config_violation,
    loss_violation,
    rebuild_violation,
    seed_violation,
    token_violation,
)

__all__ = [
    "TorchBackend",
    "TorchBfloat16Backend",
    "TorchDecoder",
    "TorchFloat16Backend",
    "TorchFloat32Backend",
    "as_forward_output",
    "mean_nll",
    "product",
    "rotary_tables",
    "working_dtype",
]


def as_forward_output(
    stages: list[tuple[str, torch.Tensor]], logits: torch.Tensor
) -> ForwardOutput:
    """Stages and logits of a torch forward pass as float64 numpy copies."""
    return ForwardOutput(
        logits=logits.double().numpy().copy(),
        stages=[(name, value.double().numpy().copy()) for name, value in stages],
    )


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where a 16-bit module does the steps that overflow or lose too much in its own
    format (the RoPE angles, RMSNorm, the loss): float32; float32 and float64 work as they are."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def mean_nll(logits: torch.Tensor, targets: npt.ArrayLike, vocabulary_size: int) -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` (aligned with positions, not shifted).

    16-bit logits are widened to float32 first, as transformers' causal-LM loss does: torch's
    float16 ``cross_entropy`` on CPU sums the exponentials in float16, so over 65,504 or more
    near-uniform logits (a 128,256-entry vocabulary) the sum overflows and the loss is ``inf``.
    """
    labels = torch.as_tensor(np.asarray(targets, dtype=np.int64).reshape(-1))
    widened = logits.to(working_dtype(logits.dtype))
    return nn.functional.cross_entropy(widened.reshape(-1, vocabulary_size), labels)


_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


class _WidenedProduct(torch.autograd.Function):
    """``a @ b`` of 16-bit operands as the float32 product of their values, rounded to their
    format once; the backward likewise, from the saved 16-bit operands."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return (a.float() @ b.float()).to(a.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = ctx.saved_tensors
        upstream = g.float()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = (upstream @ b.float().transpose(-1, -2)).to(a.dtype)
        if ctx.needs_input_grad[1]:
            if b.dim() == 2:  # a weight shared by every row: one product over all rows
                rows = a.reshape(-1, a.shape[-1]).float()
                grad_b = (rows.T @ upstream.reshape(-1, upstream.shape[-1])).to(b.dtype)
            else:
                grad_b = (a.float().transpose(-1, -2) @ upstream).to(b.dtype)
        return grad_a, grad_b


_widened_product = cast(Callable[[torch.Tensor, torch.Tensor], torch.Tensor], _WidenedProduct.apply)


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``b`` 2-D, or of ``a``'s batch shape).

    In float16 and bfloat16 this is what torch's own CPU kernel computes, each entry a
    float32 sum of products rounded once to the format (as GPU tensor cores do), but through
    float32 matrix products: on a CPU without 16-bit matrix instructions torch multiplies
    16-bit matrices 50 times slower than float32 ones (measured here, AVX2: 1.3 against 66
    GFLOP/s at 512 x 576 x 1,536), which made the scale profile on torch-float16 take 19
    minutes instead of about 2.
    """
    if a.dtype in _SIXTEEN_BIT:
        return _widened_product(a, b)
    return a @ b


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * gain`` over the last axis.

    A 16-bit input is normalized in float32 and rounded before the gain, as transformers'
    LlamaRMSNorm does: in float16 the backward of ``rsqrt`` multiplies by ``rsqrt^3``, which
    overflows for a row whose RMS is below 0.025 (NaN and ``inf`` gradients at SmolLM2-135M's
    shape).
    """

    def __init__(self, width: int, epsilon: float) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.epsilon = epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = x.to(working_dtype(x.dtype))
        mean_square = (work * work).mean(dim=-1, keepdim=True)
        if self.epsilon == 0.0 and bool((mean_square == 0).any()):
            # The spec's refusal, where rsqrt would give inf and then NaN.
            row = int(torch.nonzero(mean_square.reshape(-1) == 0)[0])
            raise Refusal(
                ErrorKind.RMS_ZERO_MEAN_SQUARE,
                f"RMSNorm row {row} has mean square 0 and epsilon is 0",
                {"row": row},
            )
        return (work * torch.rsqrt(mean_square + self.epsilon)).to(x.dtype) * self.gain


class Linear(nn.Module):
    """Bias-free ``x @ W`` with ``W`` stored ``[in, out]``, as the spec names it."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(inputs, outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(x, self.weight)


def rotary_tables(
    length: int, head_width: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of every angle, ``[T, hw/2]``, stored in ``dtype``.

    The angles are computed in float32 at least: positions above 256 are not even integers
    in bfloat16, and a table computed in a 16-bit format is off by up to 0.78 at position
    1857 (EleutherAI/gpt-neox#1003).
    """
    work = working_dtype(dtype)
    exponents = torch.arange(head_width // 2, dtype=work) * (-2.0 / head_width)
    angles = torch.arange(length, dtype=work)[:, None] * torch.pow(
        torch.tensor(base, dtype=work), exponents
    )
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the interleaved pairs (2j, 2j+1) of ``x [B, H, T, hw]``."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE on queries and keys."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        width = config.model_width
        self.query, self.key = Linear(width, width), Linear(width, width)
        self.value, self.output = Linear(width, width), Linear(width, width)
        self.heads, self.base = config.heads, config.rope_base

    def projected(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries, rotated keys and values of ``x [B, T, d]``, each ``[B, H, T, hw]``."""
        batch, length, width = x.shape
        head_width = width // self.heads

        def split(y: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, H, T, hw)
            return y.view(batch, length, self.heads, head_width).transpose(1, 2)

        cos, sin = rotary_tables(length, head_width, self.base, x.dtype)
        query = rotate_interleaved(split(self.query(x)), cos, sin)
        key = rotate_interleaved(split(self.key(x)), cos, sin)
        return query, key, split(self.value(x))

    def merged(self, mixed: torch.Tensor) -> torch.Tensor:
        """The output projection of the heads' mixed values ``[B, H, T, hw]``."""
        batch, _, length, _ = mixed.shape
        result: torch.Tensor = self.output(mixed.transpose(1, 2).reshape(batch, length, -1))
        return result

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query, key, value = self.projected(x)
        length = x.shape[1]
        scores = product(query, key.transpose(-1, -2)) / math.sqrt(query.shape[-1])
        future = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return self.merged(product(weights, value))


class FeedForward(nn.Module):
    """SwiGLU: ``down(silu(x @ W_gate) * (x @ W_up))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up, self.down = (
            Linear(width, hidden),
            Linear(width, hidden),
            Linear(hidden, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down(nn.functional.silu(self.gate(x)) * self.up(x))
        return result


class Block(nn.Module):
    """Pre-norm decoder block."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.model_width, config.rms_epsilon)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.model_width, config.rms_epsilon)
        self.ffn = FeedForward(config.model_width, config.feed_forward_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = x + self.attention(self.attention_norm(x))
        result: torch.Tensor = hidden + self.ffn(self.ffn_norm(hidden))
        return result


class Embedding(nn.Module):
    """The token table, ``[V, d]``."""

    def __init__(self, vocabulary: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocabulary, width))


class TorchDecoder(nn.Module):
    """Lookup, N blocks, final RMSNorm, and the tied head ``E^T``: one Parameter, two uses."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.token_embedding = Embedding(config.vocabulary_size, config.model_width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.final_norm = RMSNorm(config.model_width, config.rms_epsilon)

    def forward(
        self, ids: torch.Tensor, *, detach_lookup: bool = False, detach_head: bool = False
    ) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
        table = self.token_embedding.weight
        hidden = (table.detach() if detach_lookup else table)[ids]
        stages = [("embedding", hidden)]
        for layer, block in enumerate(self.blocks):
            hidden = block(hidden)
            stages.append((f"block-{layer}", hidden))
        normalized = self.final_norm(hidden)
        stages.append(("final-norm", normalized))
        return stages, product(normalized, (table.detach() if detach_head else table).T)


@contextlib.contextmanager
def _allocation_refused(ids: torch.Tensor) -> Iterator[None]:
    """A pass the allocator cannot hold is the spec's resource refusal, not a crash."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if "allocate" not in str(error):
            raise
        raise Refusal(
            ErrorKind.ACTIVATION_ALLOCATION_FAILED,
            f"a pass over {list(ids.shape)} tokens ran out of memory: {error}",
            {"batch": int(ids.shape[0]), "tokens": int(ids.shape[-1])},
        ) from None


class TorchBackend(BackendBase):
    """PyTorch in float64, every capability."""

    name = "torch"
    precision = Precision.FLOAT64
    capabilities = frozenset(Capability)
    dtype = torch.float64

    def __init__(self) -> None:
        self.version = torch.__version__

    def build(
        self, config: DecoderConfig, parameters: Parameters
    ) -> tuple[DecoderConfig, TorchDecoder]:
        entries = list(parameters)
        refuse(rebuild_violation(config, entries))
        module = TorchDecoder(config).to(self.dtype)
        with torch.no_grad():
            for parameter, (_, value) in zip(module.parameters(), entries, strict=True):
                parameter.copy_(
                    torch.as_tensor(np.asarray(value, dtype=np.float64), dtype=self.dtype)
                )
        return config, module

    def build_seeded(self, config: DecoderConfig, seed: int) -> tuple[DecoderConfig, TorchDecoder]:
        refuse(config_violation(config))
        refuse(seed_violation(seed))
        refuse_parameters_past_the_bound(config)
        return self.build(config, initial_parameters(config, seed))

    def initialize(
        self, config: DecoderConfig, stream: SplitMix64
    ) -> tuple[DecoderConfig, TorchDecoder]:
        refuse(config_violation(config))
        refuse_parameters_past_the_bound(config)
        trial = stream.clone()
        model = self.build(config, initial_parameters(config, trial))
        stream.adopt(trial)
        return model

    def parameters(self, model: tuple[DecoderConfig, TorchDecoder]) -> list[tuple[str, FloatArray]]:
        return [
            (name, p.detach().double().numpy().copy()) for name, p in model[1].named_parameters()
        ]

    def _ids(
        self,
        model: tuple[DecoderConfig, TorchDecoder],
        tokens: npt.ArrayLike,
        shape: tuple[int, int] | None,
    ) -> torch.Tensor:
        config = model[0]
        refuse(token_violation(config, tokens, shape))
        array = np.asarray(tokens, dtype=np.int64)
        return torch.as_tensor(array.reshape(shape) if shape is not None else array)

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        ids = self._ids(model, tokens, shape)
        with torch.no_grad(), _allocation_refused(ids):
            stages, logits = model[1](ids)
        return as_forward_output(stages, logits)

    def loss(
        self,
        model: Any,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        config, module = model
        refuse(loss_violation(config, tokens, targets))
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        module.zero_grad(set_to_none=True)
        with _allocation_refused(ids):
            _, logits = module(ids, detach_lookup=detach_lookup, detach_head=detach_head)
            loss = mean_nll(logits, targets, config.vocabulary_size)
            torch.autograd.backward([loss])
        gradients = {
            name: np.zeros(tuple(p.shape)) if p.grad is None else p.grad.double().numpy().copy()
            for name, p in module.named_parameters()
        }
        module.zero_grad(set_to_none=True)
        return LossOutput(loss=float(loss.item()), gradients=gradients)


class TorchFloat32Backend(TorchBackend):
    """The same module in float32."""

    name = "torch-float32"
    precision = Precision.FLOAT32
    dtype = torch.float32


class TorchBfloat16Backend(TorchBackend):
    """The same module in bfloat16 (torch accumulates its products and sums in float32)."""

    name = "torch-bfloat16"
    precision = Precision.BFLOAT16
    dtype = torch.bfloat16


class TorchFloat16Backend(TorchBackend):
    """The same module in float16."""

    name = "torch-float16"
    precision = Precision.FLOAT16
    dtype = torch.float16
