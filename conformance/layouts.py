"""Layout converters: the spec's parameters to and from the conventions ports commonly use.

The spec stores every matrix ``[in, out]`` (``y = x @ W``) and rotates RoPE features in
*interleaved* pairs ``(2j, 2j+1)``. Most PyTorch code stores ``nn.Linear`` weights
``[out, in]``; transformers' Llama (and most ports written after it) rotates the *halves*
of each head, pairing feature ``j`` with ``j + hw/2``; Meta's reference Llama rotates
interleaved pairs, as the spec does. A model of either kind computes the same function as
the spec's once its query and key matrices have their output features permuted per head
(scores do not change, since queries and keys move together) and every matrix is
transposed. :class:`Convention` does both, and maps the names.

    from conformance.layouts import HF_LLAMA
    state = HF_LLAMA.export(config, parameters)      # {transformers name: array}
    parameters = HF_LLAMA.load(config, state)        # [(spec name, array)] in stable order
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig
from spec.parameters import (
    BLOCK_PARAMETER_SUFFIXES,
    EMBEDDING_NAME,
    FINAL_NORM_NAME,
    parameter_layout,
)

__all__ = [
    "GGUF_LLAMA",
    "HF_LLAMA",
    "META_LLAMA",
    "ROTATED",
    "Convention",
    "blocks_in_text_order",
    "from_rotate_half",
    "loaded_in_text_order",
    "rotate_half_permutation",
    "to_rotate_half",
]

Array = npt.NDArray[np.float64]
Entry = TypeVar("Entry")
Value = TypeVar("Value")
# The matrices whose output features RoPE rotates: queries and keys, never values.
ROTATED = ("attention.query.weight", "attention.key.weight")


def rotate_half_permutation(width: int, heads: int) -> npt.NDArray[np.intp]:
    """``order[i]``: which interleaved feature becomes rotate-half feature ``i``.

    Within each head of width ``hw``, the interleaved pair ``(2j, 2j+1)`` becomes the
    rotate-half pair ``(j, j + hw/2)``: our feature ``2j`` goes to ``j``, ``2j+1`` to
    ``j + hw/2``.
    """
    if heads < 1 or width % heads or (width // heads) % 2:
        raise ValueError(f"width {width} must split into {heads} heads of even width")
    head_width = width // heads
    half = head_width // 2
    within = [2 * i if i < half else 2 * (i - half) + 1 for i in range(head_width)]
    return np.array([head * head_width + j for head in range(heads) for j in within], dtype=np.intp)


def to_rotate_half(weight: npt.ArrayLike, heads: int) -> Array:
    """A query or key matrix ``[in, out]`` whose output features are reordered from the
    spec's interleaved pairs to rotate-half pairs."""
    matrix = np.asarray(weight, dtype=np.float64)
    return matrix[:, rotate_half_permutation(matrix.shape[1], heads)]


def from_rotate_half(weight: npt.ArrayLike, heads: int) -> Array:
    """The inverse of :func:`to_rotate_half`: rotate-half output features back to pairs."""
    matrix = np.asarray(weight, dtype=np.float64)
    restored = np.empty_like(matrix)
    restored[:, rotate_half_permutation(matrix.shape[1], heads)] = matrix
    return restored


def blocks_in_text_order(entries: Sequence[Entry], layers: int) -> list[Entry]:
    """``entries`` (one per parameter, in the stable order) with the blocks' groups in the
    order of their indices written as text, 0, 1, 10, 11, 2, ...: the order of a map keyed
    by that text, or of a checkpoint's sorted names. The same order below eleven blocks."""
    per_block = len(BLOCK_PARAMETER_SUFFIXES)
    if len(entries) != 2 + per_block * layers:
        raise ValueError(
            f"{len(entries)} entries, not the {2 + per_block * layers} of {layers} blocks"
        )
    groups = [entries[1 + per_block * k : 1 + per_block * (k + 1)] for k in range(layers)]
    moved = [entry for k in sorted(range(layers), key=str) for entry in groups[k]]
    return [entries[0], *moved, entries[-1]]


def loaded_in_text_order(
    parameters: Sequence[tuple[str, Value]], layers: int
) -> list[tuple[str, Value]]:
    """``parameters`` as a loader that fills the blocks in turn from a checkpoint's sorted
    names leaves them: the stable names, each block holding the values of the block that
    the text order puts in its place (block 2 gets block 10's past ten blocks)."""
    moved = blocks_in_text_order(parameters, layers)
    return [(name, value) for (name, _), (_, value) in zip(parameters, moved, strict=True)]


@dataclass(frozen=True)
class Convention:
    """How one family of implementations names and lays out the spec's parameters."""

    name: str
    table: str  # their name for token_embedding.weight (the tied table, [V, d] in both)
    final_gain: str  # their name for final_norm.gain
    block_prefix: str  # their prefix of block parameters, with "{layer}"
    block: Mapping[str, str]  # our suffix (spec.parameters) -> theirs
    out_in: bool  # matrices stored [out, in], as nn.Linear does
    rotate_half: bool  # query and key output features in rotate-half order

    def name_of(self, ours: str) -> str:
        """Their name for one of the spec's names."""
        if ours == EMBEDDING_NAME:
            return self.table
        if ours == FINAL_NORM_NAME:
            return self.final_gain
        _, layer, suffix = ours.split(".", 2)
        return self.block_prefix.format(layer=layer) + self.block[suffix]

    def to_theirs(self, config: DecoderConfig, ours: str, value: npt.ArrayLike) -> Array:
        """One parameter in their layout."""
        array = np.asarray(value, dtype=np.float64)
        if ours == EMBEDDING_NAME or array.ndim != 2:
            return array.copy()
        if self.rotate_half and ours.split(".", 2)[-1] in ROTATED:
            array = to_rotate_half(array, config.heads)
        return np.ascontiguousarray(array.T if self.out_in else array)

    def to_ours(self, config: DecoderConfig, ours: str, value: npt.ArrayLike) -> Array:
        """One of their parameters, named ``ours`` in the spec, in the spec's layout."""
        array = np.asarray(value, dtype=np.float64)
        if ours == EMBEDDING_NAME or array.ndim != 2:
            return array.copy()
        array = array.T if self.out_in else array
        if self.rotate_half and ours.split(".", 2)[-1] in ROTATED:
            array = from_rotate_half(array, config.heads)
        return np.ascontiguousarray(array)

    def export(
        self, config: DecoderConfig, parameters: Sequence[tuple[str, npt.ArrayLike]]
    ) -> dict[str, Array]:
        """The spec's stable-order parameters as their state: their names, their layout."""
        return dict(self.export_each(config, parameters))

    def export_each(
        self, config: DecoderConfig, parameters: Sequence[tuple[str, npt.ArrayLike]]
    ) -> Iterator[tuple[str, Array]]:
        """:meth:`export` one parameter at a time: a consumer that stores each in its own
        format holds one float64 copy at a time (the whole model in float64 is 1.08 GB at
        SmolLM2-135M's shape)."""
        for name, value in parameters:
            yield self.name_of(name), self.to_theirs(config, name, value)

    def load(
        self, config: DecoderConfig, state: Mapping[str, npt.ArrayLike]
    ) -> list[tuple[str, Array]]:
        """Their state as the spec's stable-order parameter list (a ``KeyError`` names what
        is missing)."""
        listed = []
        for name, _ in parameter_layout(config):
            theirs = self.name_of(name)
            if theirs not in state:
                raise KeyError(f"{self.name} state has no {theirs!r} (the spec's {name})")
            listed.append((name, self.to_ours(config, name, state[theirs])))
        return listed


HF_LLAMA = Convention(
    name="hf-llama",
    table="model.embed_tokens.weight",
    final_gain="model.norm.weight",
    block_prefix="model.layers.{layer}.",
    block={
        "attention_norm.gain": "input_layernorm.weight",
        "attention.query.weight": "self_attn.q_proj.weight",
        "attention.key.weight": "self_attn.k_proj.weight",
        "attention.value.weight": "self_attn.v_proj.weight",
        "attention.output.weight": "self_attn.o_proj.weight",
        "ffn_norm.gain": "post_attention_layernorm.weight",
        "ffn.gate.weight": "mlp.gate_proj.weight",
        "ffn.up.weight": "mlp.up_proj.weight",
        "ffn.down.weight": "mlp.down_proj.weight",
    },
    out_in=True,
    rotate_half=True,
)

META_LLAMA = Convention(
    name="meta-llama",
    table="tok_embeddings.weight",
    final_gain="norm.weight",
    block_prefix="layers.{layer}.",
    block={
        "attention_norm.gain": "attention_norm.weight",
        "attention.query.weight": "attention.wq.weight",
        "attention.key.weight": "attention.wk.weight",
        "attention.value.weight": "attention.wv.weight",
        "attention.output.weight": "attention.wo.weight",
        "ffn_norm.gain": "ffn_norm.weight",
        "ffn.gate.weight": "feed_forward.w1.weight",
        "ffn.up.weight": "feed_forward.w3.weight",
        "ffn.down.weight": "feed_forward.w2.weight",
    },
    out_in=True,
    rotate_half=False,
)

# llama.cpp's GGUF names. Matrices are written [out, in] (numpy order; GGUF stores the
# dimensions reversed); its llama graph rotates interleaved pairs, as the spec does. A model
# without ``output.weight`` uses ``token_embd.weight`` as its head: the tie.
GGUF_LLAMA = Convention(
    name="gguf-llama",
    table="token_embd.weight",
    final_gain="output_norm.weight",
    block_prefix="blk.{layer}.",
    block={
        "attention_norm.gain": "attn_norm.weight",
        "attention.query.weight": "attn_q.weight",
        "attention.key.weight": "attn_k.weight",
        "attention.value.weight": "attn_v.weight",
        "attention.output.weight": "attn_output.weight",
        "ffn_norm.gain": "ffn_norm.weight",
        "ffn.gate.weight": "ffn_gate.weight",
        "ffn.up.weight": "ffn_up.weight",
        "ffn.down.weight": "ffn_down.weight",
    },
    out_in=True,
    rotate_half=False,
)
