"""Mutants from bugs public trackers record in implementations of exactly this model.

Each names the report it follows; the catalogue's test kills each at ``ci``. Several hide
from a suite whose inputs are too gentle: gains at 1, logits below 709, sequences of a few
tokens. The rules that catch them send the inputs that expose them (``spec.variants``,
``VALUE-LARGE-LOGITS``, ``VALUE-LONG-CONTEXT``).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import LossOutput
from conformance.tools.mutants import composed as c
from conformance.tools.mutants.base import MutantBackend, model_with, mutant
from conformance.tools.mutants.structure import HiddenCopiedHead
from impl.layers import RMSNorm, RotaryEmbedding, SwiGLU
from impl.tape import Tensor
from spec.rules import RuleCategory

_WRAP = 2048  # a table sized for 2048 positions, as a port copied from a shorter model


class _EpsilonOnTheRoot(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        root = c.exp(c.scale(c.log(c.mean(c.mul(x, x), axis=-1)), 0.5))
        inverse = c.exp(c.scale(c.log(c.shift(root, self.epsilon)), -1.0))
        return c.mul(c.mul(x, inverse), self.gain.tensor)


@mutant("VALUE-STAGES")
class RmsEpsilonAddedToTheRoot(MutantBackend):
    """RMSNorm divides by sqrt(mean(x^2)) + eps, not sqrt(mean(x^2) + eps) (gpt-neox#1342)."""

    model_class = model_with("EpsilonOnTheRoot", norm_class=_EpsilonOnTheRoot)


class _GateUpSwapped(SwiGLU):
    def forward(self, x: Tensor) -> Tensor:
        hidden = c.mul(c.silu(self.up.forward(x)), self.gate.forward(x))
        return self.down.forward(hidden)


@mutant("VALUE-STAGES")
class SwigluGateAndUpSwapped(MutantBackend):
    """SwiGLU applies SiLU to the up projection instead of the gate (mlx-lm#767)."""

    model_class = model_with("GateUpSwapped", feed_forward_class=_GateUpSwapped)


class _GainTwice(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        return c.mul(super().forward(x), self.gain.tensor)


@mutant("VALUE-STAGES")
class RmsGainAppliedTwice(MutantBackend):
    """Every RMSNorm multiplies by its gain twice: invisible while every gain is 1."""

    model_class = model_with("GainTwice", norm_class=_GainTwice)


class _Float32Table(RotaryEmbedding):
    def tables(self, end: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        positions = np.arange(end, dtype=np.float32)[:, None]
        angles = positions * self.inverse_frequency.astype(np.float32)
        return np.cos(angles).astype(np.float64), np.sin(angles).astype(np.float64)


@mutant("VALUE-LONG-CONTEXT")
class RopeTableInFloat32(MutantBackend):
    """RoPE angles and tables computed in float32 in a float64 model (gpt-neox#1003)."""

    model_class = model_with("Float32Table", rope_class=_Float32Table)


class _WrappedPositions(RotaryEmbedding):
    def tables(self, end: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        positions = (np.arange(end) % _WRAP).astype(np.float64)[:, None]
        angles = positions * self.inverse_frequency
        return np.cos(angles), np.sin(angles)


@mutant("VALUE-LONG-CONTEXT")
class RopePositionsWrapped(MutantBackend):
    """RoPE positions wrap at 2048 (a table sized for a shorter model, indexed modulo)."""

    model_class = model_with("WrappedPositions", rope_class=_WrappedPositions)


class _CappedPositions(RotaryEmbedding):
    def tables(self, end: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        positions = np.minimum(np.arange(end), _WRAP - 1).astype(np.float64)[:, None]
        angles = positions * self.inverse_frequency
        return np.cos(angles), np.sin(angles)


@mutant("VALUE-LONG-CONTEXT")
class RopePositionsCapped(MutantBackend):
    """RoPE positions past 2047 reuse position 2047's angles (a clamped table lookup)."""

    model_class = model_with("CappedPositions", rope_class=_CappedPositions)


@mutant("VALUE-LARGE-LOGITS", RuleCategory.LOSS)
class LossWithoutMaxSubtraction(MutantBackend):
    """The loss takes log(sum(exp(row))) without subtracting the row maximum first.

    Exact for logits below ~709; past them exp overflows and the loss is inf.
    """

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        logits = self.forward(model, tokens).logits
        rows = logits.reshape(-1, logits.shape[-1])
        picked = rows[np.arange(rows.shape[0]), np.asarray(targets).reshape(-1)]
        with np.errstate(over="ignore"):
            naive = float(np.mean(np.log(np.exp(rows).sum(axis=-1)) - picked))
        return LossOutput(naive, output.gradients)


@mutant("LOSS-MEAN-NLL")
class LossAveragedPerMicroBatch(MutantBackend):
    """The batch is split into micro-batches of 2 sequences whose mean losses are averaged
    (transformers#34191): right only when every micro-batch holds as many tokens."""

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        output = super().loss(model, tokens, targets, **detach)
        ids = np.asarray(tokens)
        if ids.ndim != 2 or ids.shape[0] <= 2 or ids.shape[0] % 2 == 0:
            return output
        wanted = np.asarray(targets).reshape(ids.shape)
        means = [
            super(LossAveragedPerMicroBatch, self)
            .loss(model, ids[start : start + 2], wanted[start : start + 2], **detach)
            .loss
            for start in range(0, ids.shape[0], 2)
        ]
        return LossOutput(float(np.mean(means)), output.gradients)


@mutant("TIE-GRADIENT-SUM")
class TableGradientWithoutLookupRole(MutantBackend):
    """The table's gradient leaves out its lookup role: the lookup is detached in every loss.

    Its full gradient is still the sum of its two measured roles (0 + the output role).
    """

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        return super().loss(model, tokens, targets, **{**detach, "detach_lookup": True})


class _BaseIgnored(RotaryEmbedding):
    def __init__(self, head_width: int, base: float) -> None:
        super().__init__(head_width, 10000.0)


@mutant("VALUE-STAGES")
class RopeBaseIgnored(MutantBackend):
    """RoPE uses base 10000 whatever the configuration says (a hard-coded constant)."""

    model_class = model_with("BaseIgnored", rope_class=_BaseIgnored)


class _BatchStatisticsNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        mean_square = c.mean(c.mean(c.mul(x, x), axis=-1), axis=0)  # over the batch too
        inverse = c.exp(c.scale(c.log(c.shift(mean_square, self.epsilon)), -0.5))
        return c.mul(c.mul(x, inverse), self.gain.tensor)


@mutant("BATCH-INDEPENDENCE", RuleCategory.VALUES)
class RmsStatisticsOverTheBatch(MutantBackend):
    """RMSNorm's mean square is averaged over the batch too, so a row depends on its batch."""

    model_class = model_with("BatchStatisticsNorm", norm_class=_BatchStatisticsNorm)


@mutant("TIE-OUTPUT-ROLE", RuleCategory.TYING)
class TieLostOnRebuild(HiddenCopiedHead):
    """A model built from a parameter list loses its tie (pytorch#188346); a seeded one keeps it.

    A rebuild copies the table into a private head, as loading a state dict into a model
    whose tie was never re-established does.
    """

    def __init__(self) -> None:
        super().__init__()
        self._seeded: weakref.WeakSet[Any] = weakref.WeakSet()

    def build_seeded(self, config: Any, seed: int) -> Any:
        model = super().build_seeded(config, seed)
        self._seeded.add(model)
        return model

    def loss(
        self, model: Any, tokens: npt.ArrayLike, targets: npt.ArrayLike, **detach: bool
    ) -> LossOutput:
        if model in self._seeded:
            return MutantBackend.loss(self, model, tokens, targets, **detach)
        return super().loss(model, tokens, targets, **detach)
