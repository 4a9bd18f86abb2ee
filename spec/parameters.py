"""Stable parameter names, their shapes, and the parameter-count formula."""

from __future__ import annotations

import re

from spec.config import DecoderConfig

__all__ = [
    "BLOCK_PARAMETER_SUFFIXES",
    "EMBEDDING_NAME",
    "FINAL_NORM_NAME",
    "NAME_PATTERN",
    "is_gain_name",
    "parameter_count",
    "parameter_layout",
    "parameter_names",
    "tensor_count",
]

EMBEDDING_NAME = "token_embedding.weight"
FINAL_NORM_NAME = "final_norm.gain"

# The nine tensors of one block, in the stable order; each gets the prefix ``blocks.{i}.``.
BLOCK_PARAMETER_SUFFIXES: tuple[str, ...] = (
    "attention_norm.gain",
    "attention.query.weight",
    "attention.key.weight",
    "attention.value.weight",
    "attention.output.weight",
    "ffn_norm.gain",
    "ffn.gate.weight",
    "ffn.up.weight",
    "ffn.down.weight",
)

# Lowercase ASCII letters, digits and underscores, in non-empty dot-separated segments.
NAME_PATTERN = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)*")


def is_gain_name(name: str) -> bool:
    """Whether ``name`` is an RMSNorm gain (``final_norm.gain``, ``blocks.{i}.*_norm.gain``)."""
    return name.endswith("_norm.gain")


def tensor_count(layers: int) -> int:
    """Number of parameter tensors of a tied model with ``layers`` blocks: 2 + 9N."""
    return 2 + len(BLOCK_PARAMETER_SUFFIXES) * int(layers)


def _block_shapes(config: DecoderConfig) -> tuple[tuple[int, ...], ...]:
    d, f = config.model_width, config.feed_forward_width
    return ((d,), (d, d), (d, d), (d, d), (d, d), (d,), (d, f), (d, f), (f, d))


def parameter_layout(config: DecoderConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter's stable name and shape, in the stable order."""
    layout: list[tuple[str, tuple[int, ...]]] = [
        (EMBEDDING_NAME, (config.vocabulary_size, config.model_width))
    ]
    block_shapes = _block_shapes(config)
    for layer in range(config.layers):
        for suffix, shape in zip(BLOCK_PARAMETER_SUFFIXES, block_shapes, strict=True):
            layout.append((f"blocks.{layer}.{suffix}", shape))
    layout.append((FINAL_NORM_NAME, (config.model_width,)))
    return layout


def parameter_names(config: DecoderConfig) -> list[str]:
    """The stable name list: 2 + 9N names."""
    return [name for name, _ in parameter_layout(config)]


def parameter_count(config: DecoderConfig, *, tied: bool = True) -> int:
    """Scalars owned by the model: ``Vd + N(4d^2 + 3df + 2d) + d``, plus ``Vd`` if untied."""
    # Python ints: numpy sizes would wrap around silently past 2**63.
    v, d, f, n = (
        int(config.vocabulary_size),
        int(config.model_width),
        int(config.feed_forward_width),
        int(config.layers),
    )
    tied_count = v * d + n * (4 * d * d + 3 * d * f + 2 * d) + d
    return tied_count if tied else tied_count + v * d
