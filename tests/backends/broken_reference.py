"""The reference with one forward mistake: RoPE also rotates the values."""

from __future__ import annotations

import math

from conformance.adapters.reference import ReferenceBackend
from impl import ops
from impl.layers import CausalSelfAttention
from impl.model import DecoderModel
from impl.tape import Tensor


class RopeOnValuesAttention(CausalSelfAttention):
    """Attention whose value heads are rotated like queries and keys."""

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        batch, tokens, width = x.shape
        query = self.rope.forward(self._split_heads(self.query.forward(x)), offset)
        key = self.rope.forward(self._split_heads(self.key.forward(x)), offset)
        value = self.rope.forward(self._split_heads(self.value.forward(x)), offset)  # the mistake
        scores = ops.divide(
            ops.matmul(query, ops.transpose(key, 2, 3)), math.sqrt(width // self.heads)
        )
        mixed = ops.matmul(ops.causal_softmax(scores), value)
        merged = ops.reshape(ops.transpose(mixed, 1, 2), (batch, tokens, width))
        return self.output.forward(merged)


class RopeOnValues(ReferenceBackend):
    """RoPE applied to values: position 0 is untouched, later positions drift."""

    name = "rope-on-values"
    model_class = type(
        "RopeOnValuesModel", (DecoderModel,), {"attention_class": RopeOnValuesAttention}
    )
