"""ONNX Runtime: :class:`TorchDecoder` exported to ONNX and run by ``onnxruntime`` on the CPU.

The adapter is :class:`~conformance.adapters.torch_backend.TorchBackend` with another engine:
torch holds the parameters and checks every input with :mod:`spec.validation` (the same
refusals, seeded builds and stream draws), and ONNX Runtime computes everything else. The
graph is the unchanged torch module traced by the TorchScript exporter
(``torch.onnx.export(dynamo=False)``), with the parameters, the RoPE base and the RMSNorm
epsilon as graph inputs and the batch, length, vocabulary and feed-forward width as dynamic
axes. One graph, exported once and kept with its session, serves every model of the same
width, heads and depth, whatever its weights. It outputs the logits, the mean NLL of the
targets (aligned with positions, not shifted), every stage, and which rows each RMSNorm
sees with mean square 0. ONNX Runtime has no autodiff, so there are no gradients.

Precision: ``onnxruntime`` runs in float64 and ``onnxruntime-float32`` in float32, every
operation in that format. The traps of the export, each checked by the tests:

- The TorchScript exporter traces shape arithmetic, and its ``reciprocal`` symbolic casts
  integers to float32 whatever the dtype: RoPE's ``-2 / head_width`` (1/6 at head width 6)
  reached the frequencies rounded to float32, 2e-8 off in float64 logits. In a float64
  graph every cast to float32 is made a cast to float64.
- The tracer's scalar constants take torch's default dtype (that ``-2`` was a float32
  constant), so the export runs with the model's dtype as the default.
- A graph cannot raise, and RMSNorm's refusal of a zero mean square at epsilon 0 is a
  data-dependent branch a tracer would freeze. The module is traced at a placeholder
  epsilon (never 0, so the branch is not taken), the graph reports each norm's zero rows,
  computed by ONNX Runtime, and the adapter refuses from them (the graph alone gives NaN).

The dynamo exporter (``dynamo=True``, torch's default since 2.9) took 0.8 to 3.2 s a
structure (depth 0 to 2) where this one takes 0.02 to 0.15 s, and left float64 logits 1e-8
off: it stores Python float constants (the epsilon) in float32 whatever the default dtype.
The TorchScript exporter is deprecated; its warnings are silenced here.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort  # type: ignore[import-untyped]  # ships no type information
import torch
from torch import nn

from conformance.adapter import (
    Capability,
    ForwardOutput,
    LossOutput,
    Parameters,
    Refusal,
    refuse,
)
from conformance.adapters.torch_backend import RMSNorm, TorchBackend, TorchDecoder
from conformance.adapters.torch_backend import _allocation_refused as torch_allocation_refused
from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.parameters import parameter_layout
from spec.tolerances import Precision
from spec.validation import loss_violation

__all__ = [
    "LEADING_OUTPUTS",
    "OnnxRuntimeBackend",
    "OnnxRuntimeFloat32Backend",
    "export_graph",
    "stage_names",
]

Model = tuple[DecoderConfig, TorchDecoder]

# The graph's outputs before the stages, in order.
LEADING_OUTPUTS = ("logits", "loss", "zero_rows")
# The tracer's sample: two sequences of two tokens, so no dynamic axis is traced at size 1.
_SAMPLE_SHAPE = (2, 2)
# What the traced module holds in place of the RoPE base and the epsilon; the export then
# makes each constant of that value a graph input. Exact in float32 and float64, equal to no
# other constant of the graph, and an epsilon other than 0.
_BASE_PLACEHOLDER = 4321.0625
_EPSILON_PLACEHOLDER = 3 * 2.0**-11
# Sessions hold no weights and, without the arena, no buffers: about 2 MiB at depth 3.
_SESSIONS_KEPT = 128


class _GraphDecoder(nn.Module):
    """The decoder and its loss: (ids, targets) to logits, loss, zero rows, stages."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.decoder = TorchDecoder(config).to(dtype).requires_grad_(False)
        self.zero_rows: list[torch.Tensor] = []
        for module in self.decoder.modules():  # in execution order
            if isinstance(module, RMSNorm):
                module.register_forward_pre_hook(self._record_zero_rows)

    def _record_zero_rows(self, _norm: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        (x,) = inputs
        self.zero_rows.append(((x * x).mean(dim=-1) == 0).reshape(-1))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.zero_rows.clear()
        stages, logits = self.decoder(ids)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return (logits, loss, torch.stack(self.zero_rows), *(value for _, value in stages))


def stage_names(layers: int) -> list[str]:
    """The stages a graph of ``layers`` blocks outputs after :data:`LEADING_OUTPUTS`."""
    return ["embedding", *(f"block-{layer}" for layer in range(layers)), "final-norm"]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _scalar_constant(node: onnx.NodeProto) -> float | None:
    if node.op_type != "Constant" or len(node.attribute) != 1 or node.attribute[0].name != "value":
        return None
    value = onnx.numpy_helper.to_array(node.attribute[0].t)
    return float(value.reshape(())) if value.size == 1 and value.dtype.kind == "f" else None


def _constants_as_input(
    graph: onnx.GraphProto, value: float, name: str, element_type: int, expected: int
) -> None:
    """Each scalar constant equal to ``value`` replaced by the graph input ``name``."""
    constants = {node.output[0] for node in graph.node if _scalar_constant(node) == value}
    if len(constants) != expected:
        raise RuntimeError(f"the exported graph holds {len(constants)} {name}s, not {expected}")
    kept = [node for node in graph.node if not set(node.output) & constants]
    for node in kept:
        node.input[:] = [name if source in constants else source for source in node.input]
    del graph.node[:]
    graph.node.extend(kept)
    graph.input.append(onnx.helper.make_tensor_value_info(name, element_type, []))


def _casts_to_float64(graph: onnx.GraphProto) -> None:
    casts = (node for node in graph.node if node.op_type == "Cast")
    for target in (attribute for node in casts for attribute in node.attribute):
        if target.name == "to" and target.i == onnx.TensorProto.FLOAT:
            target.i = onnx.TensorProto.DOUBLE
    del graph.value_info[:]  # the exporter's inferred types; ONNX Runtime infers them again


def export_graph(config: DecoderConfig, dtype: torch.dtype) -> onnx.ModelProto:
    """The ONNX graph of every model with ``config``'s width, heads and depth, in ``dtype``.

    Inputs: ``tokens`` and ``targets`` ``[B, T]`` (int64), every parameter by its spec name,
    ``rope_base`` and ``rms_epsilon`` (scalars of ``dtype``). Outputs: ``logits``, ``loss``,
    ``zero_rows`` (``[norms, B*T]``, each norm in execution order), then the stages.
    """
    width, layers = config.model_width, config.layers
    # Vocabulary and hidden width unlike the width and each other: their axes are found by size.
    sample = DecoderConfig(
        width + 1, width, config.heads, width + 2, layers, _SAMPLE_SHAPE[1],
        rope_base=_BASE_PLACEHOLDER, rms_epsilon=_EPSILON_PLACEHOLDER,
    )  # fmt: skip
    sizes = {sample.vocabulary_size: "vocabulary", sample.feed_forward_width: "hidden"}
    layout = parameter_layout(sample)
    positions = {0: "batch", 1: "length"}
    axes = {name: positions for name in ("tokens", "targets", *stage_names(layers))}
    axes |= {"logits": {**positions, 2: "vocabulary"}, "zero_rows": {1: "rows"}}
    axes |= {
        name: {axis: sizes[size] for axis, size in enumerate(shape) if size in sizes}
        for name, shape in layout
    }
    ids = torch.zeros(_SAMPLE_SHAPE, dtype=torch.int64)
    buffer = io.BytesIO()
    with _default_dtype(dtype), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer warnings
        torch.onnx.export(
            _GraphDecoder(sample, dtype),
            (ids, ids),
            buffer,  # type: ignore[arg-type]  # typed for dynamo; TorchScript takes a file object
            dynamo=False,
            # Parameters as inputs, not initializers (without keep_initializers_as_inputs
            # the exporter drops all but the first three).
            export_params=False,
            keep_initializers_as_inputs=True,
            do_constant_folding=False,
            input_names=["tokens", "targets", *(name for name, _ in layout)],
            output_names=[*LEADING_OUTPUTS, *stage_names(layers)],
            dynamic_axes=axes,
        )
    model = onnx.load_from_string(buffer.getvalue())
    element_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(_numpy_dtype(dtype)))
    _constants_as_input(model.graph, _BASE_PLACEHOLDER, "rope_base", element_type, layers)
    norms = 2 * layers + 1
    _constants_as_input(model.graph, _EPSILON_PLACEHOLDER, "rms_epsilon", element_type, norms)
    if dtype == torch.float64:
        _casts_to_float64(model.graph)
    return model


def _numpy_dtype(dtype: torch.dtype) -> type[np.floating[Any]]:
    return np.float64 if dtype == torch.float64 else np.float32


@functools.lru_cache(maxsize=_SESSIONS_KEPT)
def _session(width: int, heads: int, layers: int, dtype: torch.dtype) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # small graphs: threads cost more than they give
    options.inter_op_num_threads = 1
    options.log_severity_level = 4  # a failed run raises; its log line would only repeat it
    options.enable_cpu_mem_arena = False  # each run's buffers are freed after it
    config = DecoderConfig(1, width, heads, 1, layers, 1)
    graph = export_graph(config, dtype).SerializeToString()
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


_ENGINE_ERRORS = (
    ort.capi.onnxruntime_pybind11_state.Fail,
    ort.capi.onnxruntime_pybind11_state.RuntimeException,
)


@contextlib.contextmanager
def _allocation_refused(ids: torch.Tensor) -> Iterator[None]:
    """A pass ONNX Runtime cannot allocate is the spec's resource refusal, as in torch."""
    with torch_allocation_refused(ids):
        try:
            yield
        except _ENGINE_ERRORS as error:
            # Without the arena a failed allocation reads "std::bad_alloc".
            if not any(sign in str(error) for sign in ("allocate", "bad_alloc")):
                raise
            raise RuntimeError(f"ONNX Runtime cannot allocate: {error}") from None


class OnnxRuntimeBackend(TorchBackend):
    """ONNX Runtime in float64: stages, refusals, seeded and stream builds; no gradients."""

    name = "onnxruntime"
    precision = Precision.FLOAT64
    capabilities = frozenset(Capability) - {Capability.GRADIENTS, Capability.TIED_ROLES}
    dtype = torch.float64

    def __init__(self) -> None:
        super().__init__()
        self.version = (
            f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, torch {torch.__version__}"
        )

    def _session(self, config: DecoderConfig) -> ort.InferenceSession:
        return _session(int(config.model_width), int(config.heads), int(config.layers), self.dtype)

    def build(self, config: DecoderConfig, parameters: Parameters) -> Model:
        model = super().build(config, parameters)
        self._session(config)  # exported at the first build of its structure
        return model

    def _run(
        self, model: Model, ids: npt.NDArray[np.int64], targets: npt.NDArray[np.int64]
    ) -> list[npt.NDArray[Any]]:
        config, module = model
        real = _numpy_dtype(self.dtype)
        feeds: dict[str, npt.NDArray[Any]] = {
            "tokens": ids,
            "targets": targets,
            "rope_base": np.array(config.rope_base, dtype=real),
            "rms_epsilon": np.array(config.rms_epsilon, dtype=real),
        }
        feeds |= {name: p.detach().numpy() for name, p in module.named_parameters()}
        with _allocation_refused(torch.from_numpy(ids)):
            outputs: list[npt.NDArray[Any]] = self._session(config).run(None, feeds)
        zero_rows = outputs[LEADING_OUTPUTS.index("zero_rows")]
        if config.rms_epsilon == 0.0 and zero_rows.any():
            norm, row = (int(index) for index in np.argwhere(zero_rows)[0])
            raise Refusal(
                ErrorKind.RMS_ZERO_MEAN_SQUARE,
                f"RMSNorm {norm} (in execution order), row {row}: mean square 0, epsilon 0",
                {"row": row},
            )
        return outputs

    def forward(
        self, model: Model, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        ids = self._ids(model, tokens, shape).numpy()
        # The graph computes a loss too; zeros are targets of any vocabulary.
        outputs = self._run(model, ids, np.zeros_like(ids))
        stages = outputs[len(LEADING_OUTPUTS) :]
        return ForwardOutput(
            logits=outputs[LEADING_OUTPUTS.index("logits")].astype(np.float64),
            stages=[
                (name, value.astype(np.float64))
                for name, value in zip(stage_names(model[0].layers), stages, strict=True)
            ],
        )

    def loss(
        self,
        model: Model,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        if detach_lookup or detach_head:
            raise NotImplementedError("ONNX Runtime computes no gradients, so detaches nothing")
        config = model[0]
        refuse(loss_violation(config, tokens, targets))
        ids = np.asarray(tokens, dtype=np.int64)
        labels = np.asarray(targets, dtype=np.int64).reshape(ids.shape)
        loss = self._run(model, ids, labels)[LEADING_OUTPUTS.index("loss")]
        return LossOutput(loss=float(loss), gradients=None)


class OnnxRuntimeFloat32Backend(OnnxRuntimeBackend):
    """The same graph in float32."""

    name = "onnxruntime-float32"
    precision = Precision.FLOAT32
    dtype = torch.float32
