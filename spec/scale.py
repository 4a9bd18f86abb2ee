"""The ``scale`` profile's named shapes: configurations the size of real models of this family.

The suite's generated configurations are tiny because the mpmath oracle judges them. At a
scale shape the float64 reference is the judge instead: its own error against mpmath is
certified over the sizes mpmath reaches (``decoder-conformance tolerances derive --growth``)
and extrapolated to each shape, where it stays orders of magnitude below the error a float32,
bfloat16 or float16 backend is allowed (the bounds of ``tolerances derive --scale``, measured
at each shape itself).

Every shape is a function of its fields alone: the parameters are the recipe's for
``(config, seed)`` (Xavier-uniform matrices, gains 1), and the tokens and targets are drawn
from ``PCG64(seed)`` (but ``large-ids``, which VALUE-LARGE-IDS judges at every profile but
``scale``: one block, the ``spread`` variant's table, chosen IDs). VALUE-WIDE-HEADS judges
``wide-heads`` at those profiles too (no generated head is wider than 8), VALUE-ODD-WIDTHS
``odd-widths`` (no generated width is past 32), and GRAD-LONG-CONTEXT ``long-gradients`` (no
other gradient is taken over more than 80 positions). Not the
``varied`` variant the generated cases also use: its rescaled matrices and gains compound over
30 blocks, and measured at SmolLM2-135M's shape they made the emulation's worst float32 stage
error 115 times and its bfloat16 one 44 times the recipe's, so that a 16-bit backend's values
could hardly fail there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig

__all__ = ["DEFAULT_SCALE_SHAPES", "LARGE_IDS", "SCALE_SHAPES", "ScaleShape", "scale_shape"]

IdArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ScaleShape:
    """One named shape: a configuration, a batch of ``batch`` sequences of ``positions``
    tokens, the parameter seed, and what the shape stands for."""

    name: str
    config: DecoderConfig
    batch: int
    positions: int
    seed: int
    about: str
    variant: str = "recipe"
    # Chosen IDs, ``batch`` rows of ``positions``; drawn from the seed when empty.
    tokens: tuple[tuple[int, ...], ...] = ()
    targets: tuple[tuple[int, ...], ...] = ()

    def tokens_and_targets(self) -> tuple[IdArray, IdArray]:
        """The shape's ``[batch, positions]`` token IDs and targets."""
        if self.tokens and self.targets:
            return np.array(self.tokens, dtype=np.int64), np.array(self.targets, dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64(self.seed))
        size = (self.batch, self.positions)
        tokens = rng.integers(0, self.config.vocabulary_size, size=size, dtype=np.int64)
        targets = rng.integers(0, self.config.vocabulary_size, size=size, dtype=np.int64)
        return tokens, targets


# IDs past what a narrower copy keeps: 256+ (8 bits), 257 and 385 (bfloat16's 8 significant
# bits), 2049 and 4097 (float16's 11), 32768+ (a signed 16-bit integer), 65536+ (16 bits;
# 65535 and past is infinity in float16), and 70000, the last row. Rows 0-1: tokens; 2-3:
# targets, so that a loss reading the wrong column shows in the loss alone.
LARGE_IDS: tuple[tuple[int, ...], ...] = (
    (65537, 256, 2049, 32768, 65535, 1, 4097, 257, 70000, 65536, 255, 16385),
    (2047, 69999, 385, 2051, 8193, 32767, 0, 65538, 513, 40961, 2048, 4095),
    (257, 65536, 4097, 70000, 2049, 32769, 65537, 129, 256, 2, 65539, 8191),
    (1, 2050, 65535, 69999, 385, 0, 2047, 32768, 16384, 4099, 65538, 258),
)

# fmt: off
SCALE_SHAPES: dict[str, ScaleShape] = {shape.name: shape for shape in (
    ScaleShape(
        "smollm2-135m",
        DecoderConfig(49152, 576, 9, 1536, 30, 2048, rope_base=100000.0, rms_epsilon=1e-5),
        batch=2, positions=512, seed=135,
        about="SmolLM2-135M: vocabulary 49,152, width 576, 9 heads of width 64, SwiGLU 1,536, "
        "30 blocks, RoPE base 100,000 (with as many key/value heads as heads)",
    ),
    ScaleShape(
        "long-context",
        DecoderConfig(2048, 128, 2, 344, 2, 8192),
        batch=1, positions=8192, seed=8192,
        about="a shallow model over 8,192 positions: RoPE angles, masks and softmax rows "
        "at lengths where caches sized for 2,048 or 4,096 end",
    ),
    ScaleShape(
        "wide-vocabulary",
        DecoderConfig(128256, 256, 4, 688, 2, 512, rope_base=500000.0),
        batch=2, positions=128, seed=128256,
        about="Llama 3.2's 128,256-entry vocabulary (tied in its 1B model): softmax and "
        "the tied head over rows of 128,256 logits",
    ),
    ScaleShape(
        "large-ids",
        DecoderConfig(70001, 16, 2, 32, 1, 16),
        batch=2, positions=12, seed=70001, variant="spread",
        tokens=LARGE_IDS[:2], targets=LARGE_IDS[2:],
        about="a vocabulary of 70,001 entries, small otherwise, with token and target IDs "
        "where 8-bit, 16-bit, bfloat16 and float16 copies of an ID go wrong (VALUE-LARGE-IDS)",
    ),
    ScaleShape(
        "wide-heads",
        DecoderConfig(97, 256, 2, 344, 1, 80),
        batch=2, positions=80, seed=128,
        about="two heads of width 128 over 80 positions: the head width of most real models, "
        "where engines switch to kernels specialized for it, past a 64-position tile",
    ),
    ScaleShape(
        "odd-widths",
        DecoderConfig(131, 210, 3, 333, 1, 67),
        batch=2, positions=67, seed=210,
        about="every size past a tile of 64 and none a multiple of 4: heads of 70 (35 RoPE "
        "pairs), width 210, SwiGLU 333, vocabulary 131, 67 positions, where a vectorized "
        "loop or a tile over any of them ends in a partial group (VALUE-ODD-WIDTHS)",
    ),
    ScaleShape(
        "long-gradients",
        DecoderConfig(37, 16, 1, 24, 1, 4715),
        batch=1, positions=4715, seed=4715,
        about="one block over 4,715 positions, for the backward pass: every gradient a sum "
        "over thousands of positions, and 4,715 odd, so every tile or chunk of a power of two "
        "ends in a partial one (GRAD-LONG-CONTEXT)",
    ),
    ScaleShape(
        "smoke",
        DecoderConfig(512, 64, 4, 172, 2, 256),
        batch=2, positions=64, seed=64,
        about="a small shape for trying an adapter with the scale rules in seconds",
    ),
)}
# fmt: on

# What ``--profile scale`` runs when no shape is named: the three of the size of real models,
# and the head width of most of them (seconds).
DEFAULT_SCALE_SHAPES: tuple[str, ...] = (
    "smollm2-135m",
    "long-context",
    "wide-vocabulary",
    "wide-heads",
)


def scale_shape(name: str) -> ScaleShape:
    """The named shape; a ``KeyError`` lists the known names."""
    try:
        return SCALE_SHAPES[name]
    except KeyError:
        known = ", ".join(SCALE_SHAPES)
        raise KeyError(f"no scale shape {name!r}; known: {known}") from None
