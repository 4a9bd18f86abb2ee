"""Expected shapes of every stage of a forward pass."""

from __future__ import annotations

from spec.config import DecoderConfig

__all__ = ["logits_shape", "stage_names", "stage_shapes"]


def stage_names(layers: int) -> list[str]:
    """Stage names in order: ``embedding``, ``block-0`` .. ``block-{N-1}``, ``final-norm``."""
    return ["embedding", *(f"block-{layer}" for layer in range(layers)), "final-norm"]


def stage_shapes(
    config: DecoderConfig, batch: int, length: int
) -> list[tuple[str, tuple[int, ...]]]:
    """Every residual-stream stage keeps ``[B, T, d]``."""
    hidden = (batch, length, config.model_width)
    return [(name, hidden) for name in stage_names(config.layers)]


def logits_shape(config: DecoderConfig, batch: int, length: int) -> tuple[int, int, int]:
    """The tied projection changes only the last axis: ``[B, T, V]``."""
    return (batch, length, config.vocabulary_size)
