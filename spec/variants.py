"""Parameter lists beyond initialization: what a trained model looks like to a rule.

The recipe sets every RMSNorm gain to 1 and draws every matrix at one Xavier scale, so a
model straight from initialization hides every mistake that a gain of 1 or a uniform scale
cancels: a final-norm stage reported before its gain, a gain applied twice or on the wrong
side of a residual, a gain shared between the two norms of a block. The suite's rules run on
these variants as well as on the recipe's parameters:

- ``recipe``: :func:`spec.recipe.initial_parameters` as it is;
- ``varied``: the same draws with every gain replaced by values of either sign with
  magnitudes in [0.25, 2], and every matrix rescaled by its own factor in [0.5, 2];
- ``large``: ``varied``, then the final gain multiplied by ``LARGE_GAIN``, so that the
  logits reach the thousands (a loss computed without subtracting the row maximum
  overflows there; the correct one stays finite);
- ``sharp``: ``varied``, then every query and key matrix multiplied by ``SHARP_SCALE``, so
  that attention scores reach the thousands (a softmax computed without subtracting the row
  maximum overflows there, or underflows to 0 / 0 where every score of a row is far below
  zero; the correct one stays finite and saturates towards one key);
- ``hot``: ``varied``, then every feed-forward gate matrix multiplied by ``HOT_SCALE`` and
  every down matrix divided by it, so that the gate pre-activations reach the hundreds while
  the blocks' outputs keep their size (a sigmoid written ``exp(u) / (1 + exp(u))``, or a
  SiLU slope written with ``exp(-u)``, overflows there: past u = 88.7 in float32 and 11.1
  in float16; the correct one saturates to 0 or 1);
- ``tiny``: ``varied``, then the embedding table multiplied by ``TINY_SCALE`` and the final
  gain divided by it: the first norms see mean squares near 1e-30 (normal even in float32),
  where an epsilon of 0 must stay 0 (a hard-coded 1e-6 would swamp them), and the tied head
  brings the logits back to ordinary sizes, so the scaled error can see the difference;
- ``loud``: ``varied``, then the embedding table multiplied by ``LOUD_SCALE`` and the final
  gain divided by it: the residual stream's rows have RMS in the hundreds and more, as a
  trained model's do, so a square alone passes float16's largest number (65,504 at
  |x| > 256): an RMSNorm that squares or averages in float16 overflows, while one that works
  in float32 (transformers' LlamaRMSNorm) is exact; the tied head brings the logits back to
  ordinary sizes;
- ``spread``: ``recipe`` (gains 1), but the embedding table divided by its Xavier bound
  ``sqrt(6 / (V + d))``, so that its entries fill [-1, 1] whatever the vocabulary: at 70,001
  entries the recipe's are under 0.01, and two rows' logits differ by less than a 16-bit
  format resolves (``VALUE-LARGE-IDS`` must see which row an ID selected). Not on top of
  ``varied``: its gains made the emulated bfloat16 logits' bound there 2.5 (scaled), past
  the difference a wrong row makes.

Everything is a function of ``(config, seed, variant)``, so a failure's reproduction
rebuilds the same list.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig
from spec.parameters import EMBEDDING_NAME, FINAL_NORM_NAME, is_gain_name
from spec.recipe import initial_parameters

__all__ = [
    "HOT_SCALE",
    "LARGE_GAIN",
    "LOUD_SCALE",
    "SHARP_SCALE",
    "TABLE_SCALES",
    "TINY_SCALE",
    "VARIANTS",
    "scenario_parameters",
]

VARIANTS = ("recipe", "varied", "large", "tiny", "sharp", "hot", "spread", "loud")
LARGE_GAIN = 1000.0
SHARP_SCALE = 16.0
# Scores are q k^T / sqrt(hw): both factors scaled, the scores grow by SHARP_SCALE^2.
SHARPENED_SUFFIXES = ("attention.query.weight", "attention.key.weight")
TINY_SCALE = 1e-15
# Large enough that the rows of a small vocabulary's table (Xavier bound 0.5 or more) have RMS
# in the hundreds, past float16's square root of 65,504 (256); small enough that the final
# gain, divided by it, stays a normal float16 number (at least 0.25 / 2048).
LOUD_SCALE = 2048.0
# Variants that scale the tied table and undo it with the final gain, so the logits stay
# ordinary while the residual stream is tiny or loud.
TABLE_SCALES = {"tiny": TINY_SCALE, "loud": LOUD_SCALE}
# The gate's input is normalized, so its pre-activations grow with the gate matrix alone; the
# down matrix undoes the growth of silu(gate) * up (silu(u) ~ u for large positive u).
HOT_SCALE = 64.0

ParameterList = list[tuple[str, npt.NDArray[np.float64]]]


def scenario_parameters(config: DecoderConfig, seed: int, variant: str = "recipe") -> ParameterList:
    """The named parameters of ``variant`` (one of :data:`VARIANTS`) for ``(config, seed)``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown parameter variant {variant!r}; known: {', '.join(VARIANTS)}")
    entries = initial_parameters(config, seed)
    if variant == "recipe":
        return entries
    if variant == "spread":
        return [
            (name, value / np.sqrt(6.0 / sum(value.shape)) if name == EMBEDDING_NAME else value)
            for name, value in entries
        ]
    # Its own stream, so the recipe's draws stay the recipe's.
    rng = np.random.Generator(np.random.PCG64(seed))
    varied: ParameterList = []
    table_scale = TABLE_SCALES.get(variant)
    for name, value in entries:
        if is_gain_name(name):
            signs = rng.choice(np.array([-1.0, 1.0]), size=value.shape)
            new = signs * rng.uniform(0.25, 2.0, size=value.shape)
        else:
            new = value * rng.uniform(0.5, 2.0)
        if variant == "large" and name == FINAL_NORM_NAME:
            new = new * LARGE_GAIN
        if variant == "sharp" and name.endswith(SHARPENED_SUFFIXES):
            new = new * SHARP_SCALE
        if variant == "hot" and name.endswith("ffn.gate.weight"):
            new = new * HOT_SCALE
        if variant == "hot" and name.endswith("ffn.down.weight"):
            new = new / HOT_SCALE
        if table_scale is not None and name == EMBEDDING_NAME:
            new = new * table_scale
        if table_scale is not None and name == FINAL_NORM_NAME:
            new = new / table_scale
        varied.append((name, np.ascontiguousarray(new, dtype=np.float64)))
    return varied
