"""Two backends whose forward pass is right and whose gradients are wrong in one way each."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from conformance.adapter import LossOutput
from conformance.adapters.reference import ReferenceBackend
from impl import ops
from impl.layers import RMSNorm
from impl.model import DecoderModel
from impl.tape import Tensor


class HeadlessTableGradient(ReferenceBackend):
    """The tied table receives only its lookup-role gradient (as if the head were a copy)."""

    name = "headless-table-gradient"

    def loss(
        self,
        model: Any,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        return super().loss(model, tokens, targets, detach_lookup=detach_lookup, detach_head=True)


class ConstantScaleNorm(RMSNorm):
    """RMSNorm whose backward treats the inverse root as a constant: no mean-square term."""

    def forward(self, x: Tensor) -> Tensor:
        mean_square = ops.mean(ops.mul(x, x), axis=-1)
        inverse_root = ops.exp(
            ops.scale(ops.log(ops.add_constant(mean_square, self.epsilon)), -0.5)
        )
        return ops.mul(ops.mul(x, inverse_root.detach()), self.gain.tensor)


class NormWithoutMeanTerm(ReferenceBackend):
    """The reference with that RMSNorm in every block and at the end."""

    name = "norm-without-mean-term"
    model_class = type(
        "NormWithoutMeanTermModel", (DecoderModel,), {"norm_class": ConstantScaleNorm}
    )
