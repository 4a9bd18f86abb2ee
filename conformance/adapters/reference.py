"""The reference backend: the numpy float64 implementation in :mod:`impl`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt

from conformance import __version__
from conformance.adapter import (
    BackendBase,
    Capability,
    FloatArray,
    ForwardOutput,
    LossOutput,
    Parameters,
    Refusal,
)
from impl.errors import DecoderModelError
from impl.model import DecoderModel
from spec.config import DecoderConfig
from spec.recipe import SplitMix64
from spec.tolerances import Precision

__all__ = ["ReferenceBackend", "dense_gradients", "refusals", "release_buffers"]


@contextmanager
def refusals() -> Iterator[None]:
    """Turn the reference's exceptions into protocol refusals with their details."""
    try:
        yield
    except DecoderModelError as error:
        raise Refusal(error.kind, str(error), _details(error)) from error


def _details(error: DecoderModelError) -> dict[str, Any]:
    details = dict(error.details())
    source = details.pop("source", None)
    if isinstance(source, DecoderModelError):
        details.update(_details(source))
    return details


def dense_gradients(model: DecoderModel) -> dict[str, FloatArray]:
    """Every parameter's accumulated gradient; one the loss never reached is zero, not None."""
    return {
        p.name: np.zeros(p.shape) if p.tensor.grad is None else p.tensor.grad.copy()
        for p in model.parameters()
    }


class ReferenceBackend(BackendBase):
    """Every capability, float64, over :class:`impl.model.DecoderModel`."""

    name = "reference"
    version = __version__
    precision = Precision.FLOAT64
    capabilities = frozenset(Capability)
    # A variant of the reference (a mutant, a port under study) swaps the model class.
    model_class: type[DecoderModel] = DecoderModel

    def build(self, config: DecoderConfig, parameters: Parameters) -> DecoderModel:
        with refusals():
            return self.model_class.from_parameters(config, parameters)

    def build_seeded(self, config: DecoderConfig, seed: int) -> DecoderModel:
        with refusals():
            return self.model_class.from_seed(config, seed)

    def initialize(self, config: DecoderConfig, stream: SplitMix64) -> DecoderModel:
        with refusals():
            return self.model_class.initialize(config, stream)

    def parameters(self, model: DecoderModel) -> list[tuple[str, FloatArray]]:
        return model.state()

    def forward(
        self, model: DecoderModel, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        with refusals():
            result = model.forward(tokens, shape)
        return ForwardOutput(
            logits=result.logits.value.copy(),
            stages=[(name, stage.value.copy()) for name, stage in result.stages()],
        )

    def loss(
        self,
        model: DecoderModel,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        with refusals():
            value = model.loss(
                tokens, targets, detach_lookup=detach_lookup, detach_head=detach_head
            )
        model.zero_grad()
        value.backward(retain_graph=False)
        # A parameter the loss does not reach has gradient zero, not "none".
        gradients = dense_gradients(model)
        model.zero_grad()
        return LossOutput(loss=float(value.value), gradients=gradients)


def release_buffers() -> None:
    """Drop the reference's cached buffers that nothing refers to (``impl.kernels.buffers``):
    gigabytes after a pass at a scale shape."""
    from impl.kernels import buffers

    buffers.release()
