"""A JAX backend: the spec's decoder written as pure ``jax.numpy`` functions, in float64 or
float32.

A model is its configuration and a dict of arrays under the spec's stable names (``x @ W``
with ``W`` stored ``[in, out]``). The table is one array used for the lookup and,
transposed, for the head; ``jax.value_and_grad`` adds both contributions, and
``jax.lax.stop_gradient`` on one use gives the other role's share. Like most framework code
the model validates nothing: the adapter checks inputs with :mod:`spec.validation` first and
turns a violation into a refusal, and builds parameters with :mod:`spec.recipe`. Models are
immutable, so a refused call changes nothing.

Traps:

- **x64.** JAX computes in float32 unless ``jax_enable_x64`` is on, and then silently
  cuts float64 inputs to float32. Importing this module turns it on; every call checks that
  it is still on, and every array a model holds or a pass returns is checked for the
  declared dtype, so a process that turns x64 off again gets a :class:`DeclaredDtypeError`,
  not float32 numbers labelled float64.
- **Recompilation.** Every new parameter or token shape compiles again (0.1 to 3 s), and the
  suite draws a new configuration for nearly every example. Running eagerly does not avoid
  it: each ``jax.numpy`` operation is compiled per shape too. A first eager pass took
  1.5-2.7 s (its loss 3-4.5 s), a first jitted one 0.35 s (0.9 s), and the suite's ci
  profile 9.5 minutes eager against 2.5 jitted. So the pass and the loss's
  value-and-gradient are jitted whole (:attr:`JaxBackend.compiled`), keyed by the shapes
  and the head count only: the RoPE base, epsilon and the tied-role switches are traced
  arguments, so one compiled loss serves all three roles and every epsilon. They are
  compiled without LLVM's optimizations, which halves compile time, and with XLA:CPU's
  loop emitters in place of its newer fusion emitters, which halves it again (a loss of one
  or two layers 0.8 s, then 0.4 s); neither costs anything measurable at run time on these
  sizes (the 4715-token passes too). Host arrays go over with ``jax.device_put``:
  ``jnp.asarray`` compiles a conversion for every new shape. A ci run made 470
  compilations and spent 210 of its 260 s on them; before these two changes, 384 s.
- **Executables pile up.** Every executable XLA:CPU compiles holds about 70 memory maps and
  10 MB until JAX's caches let it go, and the default profile compiles thousands: past the
  kernel's 65530 maps (``vm.max_map_count``) compilation dies with a segmentation fault.
  The adapter counts compilations (through :mod:`jax.monitoring`) and empties JAX's caches
  every :data:`COMPILATION_BUDGET` of them, before a pass; the suite seldom returns to a
  shape it left.
- **Host checks.** The eps = 0 refusal of a zero mean square needs a value, which a
  compiled function cannot raise on: each RMSNorm reports its first zero row, and the host
  raises after the pass.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib.version
import numpy as np
import numpy.typing as npt

from conformance.adapter import (
    BackendBase,
    Capability,
    FloatArray,
    ForwardOutput,
    LossOutput,
    Parameters,
    Refusal,
    refuse,
    refuse_parameters_past_the_bound,
)
from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.parameters import (
    BLOCK_PARAMETER_SUFFIXES,
    EMBEDDING_NAME,
    FINAL_NORM_NAME,
    parameter_layout,
)
from spec.recipe import SplitMix64, initial_parameters
from spec.tolerances import Precision
from spec.validation import (
    config_violation,
    loss_violation,
    rebuild_violation,
    seed_violation,
    token_violation,
)

# Without it jnp.float64 means float32 (module docstring). jax.config.update is untyped.
jax.config.update("jax_enable_x64", True)  # type: ignore[no-untyped-call]

__all__ = [
    "COMPILATION_BUDGET",
    "DeclaredDtypeError",
    "JaxBackend",
    "JaxDecoder",
    "JaxFloat32Backend",
    "decoder_pass",
    "mean_nll",
    "rotary_tables",
    "stage_names",
]

ParameterArrays = Mapping[str, jax.Array]

# Compilations between two clearings of JAX's caches (module docstring): about 5000 memory
# maps and 700 MB at most, and a shape left behind is seldom needed again.
COMPILATION_BUDGET = 64
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class DeclaredDtypeError(RuntimeError):
    """An array the backend computed does not have its declared dtype: x64 was turned off
    (float64 silently became float32), or an operand promoted float32 to float64."""


_X64_OFF = (
    "jax_enable_x64 was turned off after conformance.adapters.jax_backend was imported; "
    'turn it on again with jax.config.update("jax_enable_x64", True)'
)


def _require_x64() -> None:
    """Without x64 float64 arrays become float32 and the float64 RoPE angles too."""
    if not jax.enable_x64.value:
        raise DeclaredDtypeError(f"the JAX backends compute in float64 in part: {_X64_OFF}")


def _require_dtype(array: jax.Array, dtype: np.dtype[Any], what: str) -> None:
    if array.dtype != dtype:
        cause = "an operand promoted it" if jax.enable_x64.value else _X64_OFF
        raise DeclaredDtypeError(f"{what} is {array.dtype}, not the declared {dtype}: {cause}")


def _detached(array: jax.Array, detach: bool | jax.Array) -> jax.Array:
    """``array``, with no gradient where ``detach`` holds. A select, not an ``if``, so that
    one compiled loss serves every tied role."""
    return jnp.where(detach, jax.lax.stop_gradient(array), array)


def rotary_tables(
    length: int, head_width: int, base: float | jax.Array, dtype: np.dtype[Any]
) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin`` of every angle, ``[T, hw/2]``, stored in ``dtype``.

    The angles are computed in float64 whatever ``dtype`` is: a float32 angle at position
    4095 is already off by ~2e-4 radians.
    """
    exponents = -2.0 * jnp.arange(head_width // 2, dtype=jnp.float64) / head_width
    angles = jnp.arange(length, dtype=jnp.float64)[:, None] * jnp.power(base, exponents)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rotate_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on the interleaved pairs (2j, 2j+1) of ``x [B, H, T, hw]``."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.stack((even * cos - odd * sin, even * sin + odd * cos), axis=-1).reshape(x.shape)


def _first_zero_row(mean_square: jax.Array) -> jax.Array:
    """The flat index of the first row whose mean square is 0, or -1."""
    zero = mean_square.reshape(-1) == 0
    return jnp.where(zero.any(), jnp.argmax(zero), -1)


def _rms_norm(
    x: jax.Array, gain: jax.Array, epsilon: float | jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``x / sqrt(mean(x^2) + eps) * gain`` over the last axis, and the first zero row."""
    mean_square = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(mean_square + epsilon) * gain, _first_zero_row(mean_square)


def _attention(
    parameters: ParameterArrays,
    prefix: str,
    x: jax.Array,
    heads: int,
    rotary: tuple[jax.Array, jax.Array],
) -> jax.Array:
    """Causal multi-head self-attention with RoPE on queries and keys."""
    batch, length, width = x.shape
    head_width = width // heads

    def project(name: str) -> jax.Array:  # (B, T, d) -> (B, H, T, hw)
        projected = x @ parameters[f"{prefix}attention.{name}.weight"]
        return projected.reshape(batch, length, heads, head_width).transpose(0, 2, 1, 3)

    query = _rotate_interleaved(project("query"), *rotary)
    key = _rotate_interleaved(project("key"), *rotary)
    # A Python float is weakly typed: an np.float64 would promote float32 scores.
    scores = query @ key.swapaxes(-1, -2) / math.sqrt(head_width)
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    mixed = (weights @ project("value")).transpose(0, 2, 1, 3).reshape(batch, length, width)
    return mixed @ parameters[f"{prefix}attention.output.weight"]


def _feed_forward(parameters: ParameterArrays, prefix: str, x: jax.Array) -> jax.Array:
    """SwiGLU: ``down(silu(x @ W_gate) * (x @ W_up))``."""
    gate = jax.nn.silu(x @ parameters[f"{prefix}ffn.gate.weight"])
    return (gate * (x @ parameters[f"{prefix}ffn.up.weight"])) @ parameters[
        f"{prefix}ffn.down.weight"
    ]


def stage_names(layers: int) -> list[str]:
    """``embedding``, ``block-0`` .. ``block-{N-1}``, ``final-norm``."""
    return ["embedding", *(f"block-{layer}" for layer in range(layers)), "final-norm"]


def decoder_pass(
    parameters: ParameterArrays,
    ids: jax.Array,
    rope_base: float | jax.Array,
    rms_epsilon: float | jax.Array,
    *,
    heads: int,
    detach_lookup: bool | jax.Array = False,
    detach_head: bool | jax.Array = False,
) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """Stages (as :func:`stage_names`), logits ``[B, T, V]``, and each RMSNorm's first zero
    row in pass order (attention and feed-forward norm per block, then the final norm).

    Only ``heads`` shapes the computation beyond the arrays: the constants and the tied-role
    switches may be traced, so one compiled pass serves every base, epsilon and role.
    """
    table = parameters[EMBEDDING_NAME]
    layers = (len(parameters) - 2) // len(BLOCK_PARAMETER_SUFFIXES)
    head_width = table.shape[1] // heads
    rotary = rotary_tables(ids.shape[-1], head_width, rope_base, table.dtype)
    hidden = _detached(table, detach_lookup)[ids]
    stages, zero_rows = [hidden], []
    for layer in range(layers):
        prefix = f"blocks.{layer}."
        normalized, zero_row = _rms_norm(
            hidden, parameters[f"{prefix}attention_norm.gain"], rms_epsilon
        )
        zero_rows.append(zero_row)
        hidden = hidden + _attention(parameters, prefix, normalized, heads, rotary)
        normalized, zero_row = _rms_norm(hidden, parameters[f"{prefix}ffn_norm.gain"], rms_epsilon)
        zero_rows.append(zero_row)
        hidden = hidden + _feed_forward(parameters, prefix, normalized)
        stages.append(hidden)
    normalized, zero_row = _rms_norm(hidden, parameters[FINAL_NORM_NAME], rms_epsilon)
    zero_rows.append(zero_row)
    stages.append(normalized)
    logits = normalized @ _detached(table, detach_head).T
    return stages, logits, jnp.stack(zero_rows)


def mean_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of ``targets`` (aligned with positions, not shifted)."""
    vocabulary = logits.shape[-1]
    log_probabilities = jax.nn.log_softmax(logits.reshape(-1, vocabulary), axis=-1)
    picked = jnp.take_along_axis(log_probabilities, targets.reshape(-1, 1), axis=-1)
    return -jnp.mean(picked)


def _loss_and_zero_rows(
    parameters: ParameterArrays,
    ids: jax.Array,
    targets: jax.Array,
    rope_base: float | jax.Array,
    rms_epsilon: float | jax.Array,
    *,
    heads: int,
    detach_lookup: bool | jax.Array,
    detach_head: bool | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    _, logits, zero_rows = decoder_pass(
        parameters,
        ids,
        rope_base,
        rms_epsilon,
        heads=heads,
        detach_lookup=detach_lookup,
        detach_head=detach_head,
    )
    return mean_nll(logits, targets), zero_rows


_value_and_gradient = jax.value_and_grad(_loss_and_zero_rows, has_aux=True)
# LLVM's optimizations and the fusion emitters each double XLA's compile time and save
# nothing measurable on the sizes the suite runs; nearly every call brings a new shape.
_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
_compiled_pass = jax.jit(decoder_pass, static_argnames="heads", compiler_options=_COMPILER_OPTIONS)
_compiled_value_and_gradient = jax.jit(
    _value_and_gradient, static_argnames="heads", compiler_options=_COMPILER_OPTIONS
)


@dataclass
class _CompilationCount:
    since_cleared: int = 0


_COMPILATIONS = _CompilationCount()


def _count_compilation(event: str, duration_secs: float, **metadata: str | int) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        _COMPILATIONS.since_cleared += 1


jax.monitoring.register_event_duration_secs_listener(_count_compilation)


def _release_executables_past_the_budget() -> None:
    """Empty JAX's caches once :data:`COMPILATION_BUDGET` compilations have piled up. It is
    process-wide (the eager path's executables live there too); other JAX code in the
    process only compiles again."""
    if _COMPILATIONS.since_cleared >= COMPILATION_BUDGET:
        jax.clear_caches()  # type: ignore[no-untyped-call]  # jax leaves it unannotated
        _COMPILATIONS.since_cleared = 0


@dataclass(frozen=True)
class JaxDecoder:
    """A model: its configuration and its arrays under the stable names, in stable order."""

    config: DecoderConfig
    arrays: dict[str, jax.Array]


def _refuse_zero_mean_square(config: DecoderConfig, zero_rows: jax.Array) -> None:
    """The spec's refusal where eps = 0 met a zero mean square (rsqrt gave inf, then NaN)."""
    if config.rms_epsilon != 0.0:
        return
    rows = np.asarray(zero_rows)
    hit = np.flatnonzero(rows >= 0)
    if not hit.size:
        return
    norm, row = int(hit[0]), int(rows[hit[0]])
    details: dict[str, Any] = {"row": row}
    where = "final RMSNorm"
    if norm < 2 * config.layers:
        component = ("attention RMSNorm", "feed-forward RMSNorm")[norm % 2]
        details.update(layer=norm // 2, component=component)
        where = f"decoder block {norm // 2} {component}"
    raise Refusal(
        ErrorKind.RMS_ZERO_MEAN_SQUARE,
        f"{where}: RMSNorm row {row} has mean square 0 and epsilon is 0",
        details,
    )


@contextlib.contextmanager
def _allocation_refused(ids: jax.Array) -> Iterator[None]:
    """A pass XLA cannot allocate is the spec's resource refusal, not a crash."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        raise Refusal(
            ErrorKind.ACTIVATION_ALLOCATION_FAILED,
            f"a pass over {list(ids.shape)} tokens ran out of memory: {error}",
            {"batch": int(ids.shape[0]), "tokens": int(ids.shape[-1])},
        ) from None


def _on_device(values: npt.ArrayLike, dtype: npt.DTypeLike) -> jax.Array:
    """A private copy of host values on the device, converted to ``dtype`` on the host.
    ``jnp.asarray`` and ``jnp.array(..., dtype=)`` compile a conversion for every new shape
    (20-50 ms each); a transfer compiles nothing."""
    copied: jax.Array = jax.device_put(np.array(values, dtype=dtype, copy=True))
    return copied


def _host_copy(array: jax.Array, dtype: np.dtype[Any], what: str) -> FloatArray:
    """A float64 numpy copy of ``array``, which must have the backend's dtype."""
    _require_dtype(array, dtype, what)
    return np.array(array, dtype=np.float64, copy=True)


class JaxBackend(BackendBase):
    """JAX in float64, every capability."""

    name = "jax"
    precision = Precision.FLOAT64
    capabilities = frozenset(Capability)
    dtype: np.dtype[Any] = np.dtype(np.float64)
    # Jitted whole: eager mode compiles every operation per shape anyway (module docstring).
    compiled = True

    def __init__(self) -> None:
        self.version = f"jax {jax.__version__}, jaxlib {jaxlib.version.__version__}"

    def _constants(self, config: DecoderConfig) -> tuple[jax.Array, jax.Array]:
        """The RoPE base (its angles are float64 work) and epsilon (in the compute dtype, so
        that it promotes nothing) as arrays, which a compiled pass takes as arguments."""
        return (
            _on_device(config.rope_base, np.float64),
            _on_device(config.rms_epsilon, self.dtype),
        )

    def build(self, config: DecoderConfig, parameters: Parameters) -> JaxDecoder:
        _require_x64()
        entries = list(parameters)
        refuse(rebuild_violation(config, entries))
        arrays = {
            name: _on_device(np.asarray(value, dtype=np.float64), self.dtype)
            for name, value in entries
        }
        for name, array in arrays.items():
            _require_dtype(array, self.dtype, f"parameter {name}")
        return JaxDecoder(config, arrays)

    def build_seeded(self, config: DecoderConfig, seed: int) -> JaxDecoder:
        refuse(config_violation(config))
        refuse(seed_violation(seed))
        refuse_parameters_past_the_bound(config)
        return self.build(config, initial_parameters(config, seed))

    def initialize(self, config: DecoderConfig, stream: SplitMix64) -> JaxDecoder:
        refuse(config_violation(config))
        refuse_parameters_past_the_bound(config)
        trial = stream.clone()
        model = self.build(config, initial_parameters(config, trial))
        stream.adopt(trial)
        return model

    def parameters(self, model: JaxDecoder) -> list[tuple[str, FloatArray]]:
        return [
            (name, _host_copy(model.arrays[name], self.dtype, f"parameter {name}"))
            for name, _ in parameter_layout(model.config)
        ]

    def forward(
        self, model: JaxDecoder, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        _require_x64()
        config = model.config
        refuse(token_violation(config, tokens, shape))
        array = np.asarray(tokens, dtype=np.int64)
        ids = _on_device(array.reshape(shape) if shape is not None else array, np.int64)
        _release_executables_past_the_budget()
        with _allocation_refused(ids):
            run_pass = _compiled_pass if self.compiled else decoder_pass
            stages, logits, zero_rows = run_pass(
                model.arrays, ids, *self._constants(config), heads=int(config.heads)
            )
            _refuse_zero_mean_square(config, zero_rows)
            return ForwardOutput(
                logits=_host_copy(logits, self.dtype, "the logits"),
                stages=[
                    (name, _host_copy(stage, self.dtype, f"stage {name}"))
                    for name, stage in zip(stage_names(config.layers), stages, strict=True)
                ],
            )

    def loss(
        self,
        model: JaxDecoder,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        _require_x64()
        config = model.config
        refuse(loss_violation(config, tokens, targets))
        ids = _on_device(tokens, np.int64)
        labels = _on_device(np.asarray(targets, dtype=np.int64).reshape(-1), np.int64)
        value_and_gradient = _compiled_value_and_gradient if self.compiled else _value_and_gradient
        _release_executables_past_the_budget()
        with _allocation_refused(ids):
            (loss, zero_rows), gradients = value_and_gradient(
                model.arrays,
                ids,
                labels,
                *self._constants(config),
                heads=int(config.heads),
                detach_lookup=detach_lookup,
                detach_head=detach_head,
            )
            _refuse_zero_mean_square(config, zero_rows)
            return LossOutput(
                loss=float(_host_copy(loss, self.dtype, "the loss")),
                gradients={
                    name: _host_copy(gradients[name], self.dtype, f"gradient of {name}")
                    for name, _ in parameter_layout(config)
                },
            )


class JaxFloat32Backend(JaxBackend):
    """The same functions in float32."""

    name = "jax-float32"
    precision = Precision.FLOAT32
    dtype = np.dtype(np.float32)
