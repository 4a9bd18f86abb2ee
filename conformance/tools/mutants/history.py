"""Mutants whose results depend on the calls made before: caches sized by an earlier call,
and buffers handed to the caller that the next call overwrites."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import FloatArray, ForwardOutput, LossOutput
from conformance.tools.mutants.base import MutantBackend, model_with, mutant
from impl.layers import RotaryEmbedding
from impl.tape import Array


class _TablesExtendedFromZero(RotaryEmbedding):
    def tables(self, end: int) -> tuple[Array, Array]:
        held = self._cos.shape[0]
        if end > held:
            # The mistake: the new rows are computed for positions 0 .. end - held - 1.
            angles = np.arange(end - held, dtype=np.float64)[:, None] * self.inverse_frequency
            self._cos = np.concatenate([self._cos, np.cos(angles)])
            self._sin = np.concatenate([self._sin, np.sin(angles)])
        return self._cos[:end], self._sin[:end]


@mutant("DET-HISTORY")
class RopeTablesExtendedFromPositionZero(MutantBackend):
    """RoPE tables grow on a longer call, but the new rows restart at position 0.

    Right for every model's first call; wrong at the positions a later, longer call adds.
    """

    model_class = model_with("TablesExtendedFromZero", rope_class=_TablesExtendedFromZero)


class _TablesSizedByFirstCall(RotaryEmbedding):
    def tables(self, end: int) -> tuple[Array, Array]:
        if self._cos.shape[0] == 0:
            super().tables(end)
        # The mistake: positions past the first call's length read its last row.
        rows = np.minimum(np.arange(end), self._cos.shape[0] - 1)
        return self._cos[rows], self._sin[rows]


@mutant("DET-HISTORY")
class RopeTablesSizedByFirstCall(MutantBackend):
    """RoPE tables sized by a model's first call; a longer later call clamps to its last row."""

    model_class = model_with("TablesSizedByFirstCall", rope_class=_TablesSizedByFirstCall)


def _into_buffer(buffers: dict[Any, FloatArray], key: Any, value: FloatArray) -> FloatArray:
    """``value`` written into the buffer kept for ``key``, which is returned in its place."""
    buffer = buffers.get(key)
    if buffer is None or buffer.shape != value.shape:
        buffer = buffers[key] = np.empty_like(value)
    np.copyto(buffer, value)
    return buffer


@mutant("DET-HISTORY")
class LogitsBufferReturned(MutantBackend):
    """forward returns views of one buffer per shape, which the next forward overwrites.

    What an adapter returns when it wraps an engine's logits pointer (llama.cpp's
    llama_get_logits) without copying it.
    """

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        output = super().forward(model, tokens, shape)
        buffers: dict[Any, FloatArray] = model.__dict__.setdefault("returned_buffers", {})
        return ForwardOutput(
            _into_buffer(buffers, "logits", output.logits),
            [(name, _into_buffer(buffers, name, v)) for name, v in output.stages or []],
        )


@mutant("DET-HISTORY")
class GradientBuffersReturned(MutantBackend):
    """loss returns each parameter's gradient buffer itself, which the next loss overwrites.

    What ``param.grad.numpy()`` gives in a PyTorch adapter that zeroes gradients in place
    (``zero_grad(set_to_none=False)``) instead of dropping them.
    """

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        buffers: dict[Any, FloatArray] = model.__dict__.setdefault("gradient_buffers", {})
        gradients = {
            name: _into_buffer(buffers, name, value)
            for name, value in (output.gradients or {}).items()
        }
        return LossOutput(output.loss, gradients)


@mutant("DET-HISTORY")
class DetachedRoleStaysDetached(MutantBackend):
    """A table role detached for one loss stays detached for every later loss of that model.

    What switching ``requires_grad`` off for the measurement, and never back on, gives.
    """

    def loss(
        self,
        model: Any,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        detached: dict[str, bool] = model.__dict__.setdefault(
            "detached_roles", {"detach_lookup": False, "detach_head": False}
        )
        detached["detach_lookup"] |= detach_lookup
        detached["detach_head"] |= detach_head
        return super().loss(model, tokens, targets, **detached)


# One table pair per head width for the whole process: the key leaves the base out.
_TABLES_BY_HEAD_WIDTH: dict[int, tuple[Array, Array]] = {}


class _TablesKeptPerProcess(RotaryEmbedding):
    def tables(self, end: int) -> tuple[Array, Array]:
        head_width = 2 * self.inverse_frequency.shape[0]
        kept = _TABLES_BY_HEAD_WIDTH.get(head_width)
        if kept is None or kept[0].shape[0] < end:
            cos, sin = super().tables(end)
            kept = _TABLES_BY_HEAD_WIDTH[head_width] = (cos.copy(), sin.copy())
        return kept[0][:end], kept[1][:end]


@mutant("DET-ISOLATION")
class RopeTablesKeptPerHeadWidth(MutantBackend):
    """RoPE tables are kept per process by head width, so a later model with another base
    reuses the first one's.

    A module-level cache (or a compiled function's) whose key leaves the base out.
    """

    model_class = model_with("TablesKeptPerProcess", rope_class=_TablesKeptPerProcess)
