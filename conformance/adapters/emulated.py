"""Emulated precisions: the reference's formulas with every operation rounded to a format.

``emulated-float32``, ``emulated-bfloat16`` and ``emulated-float16`` run
:class:`impl.emulation.EmulatedModel`, the instrument the tolerances are derived with, as
backends: correct implementations at each precision that need nothing beyond numpy and
``ml_dtypes``. They keep the reference's validation and refusals (the float64 model is
built first, then rounded) and every capability. ``emulated-float32-loop`` runs
:class:`impl.emulation.RecursiveSumsModel`, the second float32 instrument: the same port
with every row sum added one term after another.
"""

from __future__ import annotations

import numpy.typing as npt

from conformance.adapter import FloatArray, ForwardOutput, LossOutput, Parameters
from conformance.adapters.reference import ReferenceBackend, refusals
from impl.emulation import EmulatedModel, RecursiveSumsModel
from impl.model import DecoderModel
from spec.config import DecoderConfig
from spec.formats import Precision
from spec.recipe import SplitMix64

__all__ = [
    "EmulatedBackend",
    "EmulatedBfloat16",
    "EmulatedFloat16",
    "EmulatedFloat32",
    "EmulatedFloat32Loop",
]


class EmulatedBackend(ReferenceBackend):
    """Every capability, in the precision a subclass declares: the reference's model is
    built (its validation and refusals), then held and run in that precision."""

    name = "emulated"
    precision = Precision.FLOAT32
    # A variant (a precision mutant) swaps the model class or computes in another format
    # than it declares.
    emulation_class: type[EmulatedModel] = EmulatedModel
    arithmetic: Precision | None = None

    def _wrap(self, reference: DecoderModel) -> EmulatedModel:
        return self.emulation_class(reference, self.arithmetic or self.precision)

    def build(self, config: DecoderConfig, parameters: Parameters) -> EmulatedModel:  # type: ignore[override]
        return self._wrap(super().build(config, parameters))

    def build_seeded(self, config: DecoderConfig, seed: int) -> EmulatedModel:  # type: ignore[override]
        return self._wrap(super().build_seeded(config, seed))

    def initialize(self, config: DecoderConfig, stream: SplitMix64) -> EmulatedModel:  # type: ignore[override]
        return self._wrap(super().initialize(config, stream))

    def parameters(self, model: EmulatedModel) -> list[tuple[str, FloatArray]]:  # type: ignore[override]
        return [(name, leaf.value.copy()) for name, leaf in model.leaves.items()]

    def forward(  # type: ignore[override]
        self, model: EmulatedModel, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        with refusals():
            result = model.forward(tokens, shape)
        return ForwardOutput(
            logits=result.logits.value.copy(),
            stages=[(name, stage.value.copy()) for name, stage in result.stages],
        )

    def loss(  # type: ignore[override]
        self,
        model: EmulatedModel,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        with refusals():
            loss, gradients = model.loss_and_gradients(
                tokens, targets, detach_lookup=detach_lookup, detach_head=detach_head
            )
        return LossOutput(loss=loss, gradients=gradients)


class EmulatedFloat32(EmulatedBackend):
    """float32: numpy's own float32 arithmetic."""

    name = "emulated-float32"
    precision = Precision.FLOAT32


class EmulatedFloat32Loop(EmulatedBackend):
    """float32 with every row sum added in a plain loop, one term after another (softmax
    denominators over 70,001 logits or 4,715 keys, the loss's mean): a correct port whose
    sums lose more to rounding than numpy's pairwise ones, which the bounds must admit."""

    name = "emulated-float32-loop"
    precision = Precision.FLOAT32
    emulation_class = RecursiveSumsModel


class EmulatedBfloat16(EmulatedBackend):
    """bfloat16 storage, float32 accumulation."""

    name = "emulated-bfloat16"
    precision = Precision.BFLOAT16


class EmulatedFloat16(EmulatedBackend):
    """float16 storage, float32 accumulation."""

    name = "emulated-float16"
    precision = Precision.FLOAT16
