"""Precision bugs: correct formulas computed, somewhere, in a narrower format than declared.

Each is :class:`conformance.adapters.emulated.EmulatedBackend` (every operation rounded to
the declared format) wrong in one place, at the precision where the mistake is a bug: a
float32 backend that rounds one step to a 16-bit format, a bfloat16 backend that computes
RoPE's positions in bfloat16, or a float64 backend that accumulates in float32. The
derived tolerances of the declared precision reject each at ``ci``; the emulation is
otherwise the instrument those tolerances were derived with, so only the mistake can move
it past them. The last two write SiLU with an exponential that overflows in float32 past
88.7 (float16: 11.1), where the correct form saturates.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from conformance.adapters.emulated import EmulatedBackend
from conformance.tools.mutants.base import mutant
from impl.emulation import Arithmetic, EmulatedModel
from impl.tape import Array
from spec.formats import Precision, round_to


@mutant("VALUE-STAGES")
class Float16WorkDeclaredFloat32(EmulatedBackend):
    """Every operation in float16, declared float32, its arrays widened to float64."""

    precision = Precision.FLOAT32
    arithmetic = Precision.FLOAT16


class _TablesInBfloat16(EmulatedModel):
    def _tables(self, length: int) -> tuple[Array, Array]:
        head_width = self.config.head_width
        exponents = np.arange(head_width // 2, dtype=np.float64) * (-2.0 / head_width)
        frequencies = round_to(float(self.config.rope_base) ** exponents, Precision.BFLOAT16)
        positions = round_to(np.arange(length, dtype=np.float64), Precision.BFLOAT16)
        angles = round_to(positions[:, None] * frequencies, Precision.BFLOAT16)
        return (
            round_to(np.cos(angles), Precision.BFLOAT16),
            round_to(np.sin(angles), Precision.BFLOAT16),
        )


@mutant("VALUE-STAGES")
class RopeTablesInBfloat16(EmulatedBackend):
    """RoPE's positions, angles and cos/sin tables computed in bfloat16 in a float32 backend.

    EleutherAI/gpt-neox#1003: positions above 256 are not integers in bfloat16, and the
    tables were off by up to 0.78 at position 1857.
    """

    precision = Precision.FLOAT32
    emulation_class = _TablesInBfloat16


@mutant("VALUE-LONG-CONTEXT")
class RopeAnglesInBfloat16(EmulatedBackend):
    """RoPE's positions and angles computed in bfloat16 in a bfloat16 backend.

    The tables are stored in bfloat16 either way; computed there, positions above 256 are
    no longer integers, which only a long sequence shows (gpt-neox#1003's case).
    """

    precision = Precision.BFLOAT16
    emulation_class = _TablesInBfloat16


class _SoftmaxInFloat16(EmulatedModel):
    def _round_scores(self, values: npt.ArrayLike) -> Array:
        return round_to(values, Precision.FLOAT16)


@mutant("VALUE-STAGES")
class SoftmaxAccumulatedInFloat16(EmulatedBackend):
    """Attention scores and softmax computed in float16 in a float32 backend (llama.cpp#10015)."""

    precision = Precision.FLOAT32
    emulation_class = _SoftmaxInFloat16


class _NormalizedInBfloat16(EmulatedModel):
    def _round_normalized(self, values: Array) -> Array:
        return round_to(values, Precision.BFLOAT16)


@mutant("VALUE-STAGES")
class RmsNormCastBeforeTheGain(EmulatedBackend):
    """RMSNorm rounds its normalized rows to bfloat16 before the gain, in a float32 backend.

    The cast belongs after the multiply (vllm-project/vllm#42379: about 3e-2 per layer).
    """

    precision = Precision.FLOAT32
    emulation_class = _NormalizedInBfloat16


class _SquaresInFloat16(EmulatedModel):
    def _mean_square(self, values: Array) -> Array:
        squares = round_to(values * values, Precision.FLOAT16)
        return round_to(squares.astype(np.float32).mean(axis=-1, keepdims=True), Precision.FLOAT16)


@mutant("VALUE-LOGITS")
class RmsNormSquaresInFloat16(EmulatedBackend):
    """RMSNorm squares and averages its rows in float16 in a float16 backend, without the
    upcast to float32 that transformers' LlamaRMSNorm makes.

    A residual row with entries past 256 squares to infinity; its inverse root is 0 and the
    norm's output vanishes (pytorch/pytorch#133085: torch's fused RMSNorm in float16, put in
    place of LlamaRMSNorm, gave wrong answers from its overflowing squares).
    """

    precision = Precision.FLOAT16
    emulation_class = _SquaresInFloat16


class _Float32Accumulation(Arithmetic):
    def product(self, a: Array, b: Array) -> Array:
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float64)


class _Float32Products(EmulatedModel):
    arithmetic_class = _Float32Accumulation


@mutant("VALUE-STAGES")
class Float32AccumulationInFloat64(EmulatedBackend):
    """Matrix products accumulated in float32 in a backend that declares float64."""

    precision = Precision.FLOAT64
    emulation_class = _Float32Products


class _SigmoidAsExpRatio(EmulatedModel):
    def _sigmoid(self, u: Array) -> Array:
        q = self.arithmetic.q
        grown = q(np.exp(u))  # inf past u = 88.7 in float32
        return q(grown / q(1 + grown))


@mutant("VALUE-LARGE-GATES")
class SigmoidAsExpRatioInFloat32(EmulatedBackend):
    """SwiGLU's sigmoid written exp(u) / (1 + exp(u)) in a float32 backend: inf / inf past 88.7."""

    precision = Precision.FLOAT32
    emulation_class = _SigmoidAsExpRatio


class _SlopeFromExponential(EmulatedModel):
    def _silu_slope(self, u: Array, sigmoids: Array) -> Array:
        q = self.arithmetic.q
        decayed = q(np.exp(-u))  # inf below u = -88.7 in float32
        # s + u e / (1 + e)^2: the same derivative, as a fused backward kernel may write it.
        return q(sigmoids + q(q(u * decayed) / q(q(1 + decayed) * q(1 + decayed))))


@mutant("VALUE-LARGE-GATES")
class SiluSlopeFromExponentialInFloat32(EmulatedBackend):
    """SiLU's slope written s + u exp(-u) / (1 + exp(-u))^2 in a float32 backend; forward exact.

    Below u = -88.7 the exponential overflows and the slope is inf / inf.
    """

    precision = Precision.FLOAT32
    emulation_class = _SlopeFromExponential
