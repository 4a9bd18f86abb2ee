"""llama.cpp behind the subprocess protocol: a GGUF file per model, run by ``llama_decode``.

``python -m conformance.adapters.llama_cpp_server [--kv-cache f32|f16]`` serves
``PROTOCOL.md`` (the adapters ``llama-cpp`` and ``llama-cpp-f16-cache`` start it). It runs in
a process of its own because llama.cpp aborts the process on what it cannot handle (a model
with no blocks: ``GGML_ASSERT(hparams.n_layer_all > 0)``); the suite then fails the one test
that asked, shows the assertion from stderr, and starts a fresh server for the next.

How a model is made, as a user's converter would make it: the parameters go into a GGUF
file (architecture ``llama``, F32 tensors, the matrices ``[out, in]``, no ``output.weight``,
so llama.cpp uses ``token_embd.weight`` as the head), which llama.cpp loads; the file is
gone once loaded, and on Linux it never has a name, so an abort leaves nothing behind. A
forward pass is one ``llama_decode`` of a batch holding every sequence (sequence ``b`` is
``seq_id`` b at positions 0..T-1) with logits for every token.
The stages come from the context's eval callback: the tensors ``embd``, ``l_out-i`` and
``result_norm`` of llama.cpp's graph.

What the adapter leaves to llama.cpp, so that the suite sees what the engine does: the
context length (llama.cpp accepts tokens past ``llama.context_length`` with a log line) and
the token IDs (``llama_decode`` returns -1 after logging ``invalid token[i]``, which becomes
the spec's refusal at flat position ``i``). The adapter checks only what marshalling a
``[B, T]`` integer array needs (dtype, rank, empty batch or sequence, count). llama.cpp has
no loss: the adapter computes the mean NLL of llama.cpp's logits in float64, after checking
the targets. No gradients, no configuration or parameter-list validation (llama.cpp loads
files, it does not build models from lists), no initialization.

Precision: F32 weights and arithmetic. ``--kv-cache f32`` (``type_k = type_v =
GGML_TYPE_F32``, flash attention off) keeps the attention in float32. ``--kv-cache f16`` is
how llama.cpp runs by default: keys and values stored in float16, flash attention as
llama.cpp chooses; it still declares float32, what a user of an F32 model believes they run,
so the suite shows rule by rule what the float16 cache costs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import numpy as np
import numpy.typing as npt

from conformance.adapter import (
    BackendBase,
    Capability,
    Departure,
    FloatArray,
    ForwardOutput,
    LossOutput,
    Parameters,
    Refusal,
    refuse,
)
from conformance.adapters.reference_server import Server
from conformance.layouts import GGUF_LLAMA
from conformance.protocol import encode_parameters
from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.formats import Precision
from spec.validation import loss_violation, token_violation

__all__ = ["KV_CACHE_TYPES", "LlamaCppEngine", "LlamaCppModel", "main"]

# ggml_type values of the key/value cache (ggml.h: GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1).
KV_CACHE_TYPES = {"f32": 0, "f16": 1}
_FLASH_ATTENTION_AUTO, _FLASH_ATTENTION_OFF = -1, 0
_LOG_ERROR = 4  # ggml_log_level GGML_LOG_LEVEL_ERROR
_INVALID_TOKEN = re.compile(r"invalid token\[(\d+)\] = (-?\d+)")
_INT32 = np.iinfo(np.int32)
# The context's eval callback sees these tensors of llama.cpp's llama graph.
_EMBEDDING, _FINAL_NORM, _BLOCK_PREFIX = "embd", "result_norm", "l_out-"


def _ggml_base() -> ctypes.CDLL:
    """The few ggml functions the eval callback needs, from the library llama_cpp loaded."""
    library = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    library.ggml_get_name.argtypes = [ctypes.c_void_p]
    library.ggml_get_name.restype = ctypes.c_char_p
    library.ggml_nelements.argtypes = [ctypes.c_void_p]
    library.ggml_nelements.restype = ctypes.c_int64
    library.ggml_nbytes.argtypes = [ctypes.c_void_p]
    library.ggml_nbytes.restype = ctypes.c_size_t
    library.ggml_backend_tensor_get.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
    ]
    library.ggml_backend_tensor_get.restype = None
    return library


class _Log:
    """llama.cpp's log: errors go on to stderr, and a block can record what it logged.

    The ctypes callback must stay referenced for as long as llama.cpp may call it (a
    collected one segfaults the process), so it lives on this object, which lives as long as
    the engine.
    """

    def __init__(self) -> None:
        self._recording: list[str] | None = None
        self.callback = llama_cpp.llama_log_callback(self._record)
        llama_cpp.llama_log_set(self.callback, ctypes.c_void_p(0))

    def _record(self, level: int, text: bytes | None, _user: Any) -> None:
        line = (text or b"").decode("utf-8", errors="replace")
        if self._recording is not None:
            self._recording.append(line)  # the caller reports it, or turns it into a refusal
        elif level == _LOG_ERROR:
            sys.stderr.write(line)

    @contextlib.contextmanager
    def since(self) -> Iterator[list[str]]:
        """The lines logged inside the block."""
        recorded: list[str] = []
        self._recording = recorded
        try:
            yield recorded
        finally:
            self._recording = None


@dataclasses.dataclass
class LlamaCppModel:
    """A loaded llama.cpp model, and the F32 parameters its GGUF file held."""

    config: DecoderConfig
    handle: Any
    parameters: list[tuple[str, npt.NDArray[np.float32]]]

    def close(self) -> None:
        if self.handle is not None:
            llama_cpp.llama_model_free(self.handle)
            self.handle = None


@contextlib.contextmanager
def _scratch_file() -> Iterator[Path]:
    """A path to write a model's GGUF file to and load it from, gone on the way out.

    Where the process can name its own open files (``/proc/self/fd``, Linux), the file never
    has a name in any folder: llama.cpp aborts the process on a model it cannot load, and a
    timeout kills it, and neither leaves a file behind (at SmolLM2-135M's shape that file is
    540 MB). Elsewhere it lives in a private temporary folder, removed on a normal exit.
    """
    with tempfile.TemporaryFile(prefix="decoder-conformance-gguf-") as unnamed:
        path = Path(f"/proc/self/fd/{unnamed.fileno()}")
        if path.exists():
            yield path
            return
    with tempfile.TemporaryDirectory(prefix="decoder-conformance-gguf-") as folder:
        yield Path(folder) / "model.gguf"


def write_gguf(config: DecoderConfig, parameters: Parameters, path: Path) -> None:
    """The model as a user's converter writes it: architecture ``llama``, F32, tied."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config.context)
    writer.add_embedding_length(config.model_width)
    writer.add_block_count(config.layers)
    writer.add_feed_forward_length(config.feed_forward_width)
    writer.add_head_count(config.heads)
    writer.add_head_count_kv(config.heads)
    writer.add_rope_freq_base(config.rope_base)
    writer.add_layer_norm_rms_eps(config.rms_epsilon)
    writer.add_vocab_size(config.vocabulary_size)
    writer.add_file_type(0)  # all F32
    writer.add_tokenizer_model("none")
    for name, value in GGUF_LLAMA.export_each(config, parameters):
        writer.add_tensor(name, value.astype(np.float32))
        del value  # (one float64 copy at a time)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class LlamaCppEngine(BackendBase):
    """llama.cpp in this process (the server's backend; the suite reaches it through the
    subprocess adapter, so an abort costs one test)."""

    precision = Precision.FLOAT32
    capabilities = frozenset({Capability.STAGES, Capability.INPUT_ERRORS})
    departures = frozenset({Departure.NO_DEPTH_ZERO})

    def __init__(self, kv_cache: str = "f32") -> None:
        if kv_cache not in KV_CACHE_TYPES:
            raise ValueError(f"kv cache {kv_cache!r}: choose one of {', '.join(KV_CACHE_TYPES)}")
        self.kv_cache = kv_cache
        self.name = "llama-cpp" if kv_cache == "f32" else f"llama-cpp-{kv_cache}-cache"
        self.version = f"llama-cpp-python {llama_cpp.__version__}, gguf {version('gguf')}"
        self._log = _Log()
        llama_cpp.llama_backend_init()
        self._ggml = _ggml_base()
        # Stages of the pass under way, filled by the eval callback (kept referenced).
        self._captured: dict[str, npt.NDArray[np.float32]] = {}
        self._eval_callback = llama_cpp.ggml_backend_sched_eval_callback(self._observe)

    # ------------------------------------------------------------------ models
    def build(self, config: DecoderConfig, parameters: Parameters) -> LlamaCppModel:
        entries = [(name, np.asarray(value, dtype=np.float64)) for name, value in parameters]
        stored = [(name, value.astype(np.float32)) for name, value in entries]
        with _scratch_file() as path:
            write_gguf(config, entries, path)
            model_parameters = llama_cpp.llama_model_default_params()
            model_parameters.use_mmap = False  # the file is gone once the model is loaded
            with self._log.since() as logged:
                handle = llama_cpp.llama_model_load_from_file(str(path).encode(), model_parameters)
        if not handle:
            raise RuntimeError(f"llama.cpp could not load the model: {_errors(logged)}")
        return LlamaCppModel(config, handle, stored)

    def parameters(self, model: LlamaCppModel) -> list[tuple[str, FloatArray]]:
        return [(name, value.astype(np.float64)) for name, value in model.parameters]

    # ------------------------------------------------------------------ passes
    def _observe(self, tensor: Any, ask: bool, _user: Any) -> bool:
        name = (self._ggml.ggml_get_name(tensor) or b"").decode()
        wanted = name in (_EMBEDDING, _FINAL_NORM) or name.startswith(_BLOCK_PREFIX)
        if ask or not wanted:
            return wanted if ask else True
        count = int(self._ggml.ggml_nelements(tensor))
        if int(self._ggml.ggml_nbytes(tensor)) != 4 * count:
            raise RuntimeError(f"llama.cpp tensor {name} is not F32")  # pragma: no cover
        values = np.empty(count, dtype=np.float32)
        self._ggml.ggml_backend_tensor_get(tensor, values.ctypes.data, 0, 4 * count)
        self._captured[name] = values
        return True

    def _context(self, sequences: int, tokens: int) -> Any:
        settings = llama_cpp.llama_context_default_params()
        settings.n_ctx = sequences * tokens  # llama.cpp pads it to a multiple of 256
        settings.n_batch = settings.n_ubatch = sequences * tokens
        settings.n_seq_max = sequences
        settings.kv_unified = True
        settings.n_threads = settings.n_threads_batch = 1
        settings.no_perf = True
        settings.cb_eval = self._eval_callback
        if self.kv_cache == "f32":
            settings.type_k = settings.type_v = KV_CACHE_TYPES["f32"]
            settings.flash_attn_type = _FLASH_ATTENTION_OFF
        else:
            settings.type_k = settings.type_v = KV_CACHE_TYPES[self.kv_cache]
            settings.flash_attn_type = _FLASH_ATTENTION_AUTO
        return settings

    def _ids(
        self, config: DecoderConfig, tokens: npt.ArrayLike, shape: tuple[int, int] | None
    ) -> npt.NDArray[np.int64]:
        """A ``[B, T]`` int64 array: the checks marshalling needs, none of llama.cpp's own."""
        unlimited = dataclasses.replace(config, context=sys.maxsize)  # llama.cpp's to check
        violation = token_violation(unlimited, tokens, shape)
        if violation is not None and violation.kind is not ErrorKind.TOKEN_ID_OUT_OF_BOUNDS:
            refuse(violation)
        array = np.asarray(tokens)
        return np.asarray(array.reshape(shape) if shape is not None else array, dtype=np.int64)

    def _decode(
        self, model: LlamaCppModel, ids: npt.NDArray[np.int64]
    ) -> tuple[list[tuple[str, FloatArray]], FloatArray]:
        if model.handle is None:
            raise RuntimeError("the model was released")
        sequences, length = ids.shape
        count = sequences * length
        # An ID no int32 holds is as invalid to llama.cpp as the int32 nearest it (casting
        # would wrap it into the vocabulary); the refusal names the ID that was given.
        given = ids.reshape(-1)
        flat = np.clip(given, _INT32.min, _INT32.max).astype(np.int32)
        with self._log.since() as logged:
            context = llama_cpp.llama_init_from_model(
                model.handle, self._context(sequences, length)
            )
        if not context:
            if any("failed to allocate" in line for line in logged):
                # llama.cpp's own allocation failure, in the spec's words.
                raise Refusal(
                    ErrorKind.ACTIVATION_ALLOCATION_FAILED,
                    f"llama.cpp could not allocate a context for {count} tokens: {_errors(logged)}",
                    {"batch": sequences, "tokens": length},
                )
            raise RuntimeError(
                f"llama.cpp could not create a context for {count} tokens: {_errors(logged)}"
            )
        batch = llama_cpp.llama_batch_init(count, 0, 1)
        try:
            for index in range(count):
                batch.token[index] = int(flat[index])
                batch.pos[index] = index % length
                batch.n_seq_id[index] = 1
                batch.seq_id[index][0] = index // length
                batch.logits[index] = True
            batch.n_tokens = count
            self._captured.clear()
            with self._log.since() as logged:
                status = llama_cpp.llama_decode(context, batch)
            if status != 0:
                self._refuse_decode(status, logged, given)
            vocabulary = model.config.vocabulary_size
            raw = llama_cpp.llama_get_logits(context)
            logits = np.ctypeslib.as_array(raw, shape=(count * vocabulary,))
            logits64 = logits.astype(np.float64).reshape(sequences, length, vocabulary)
            stages = self._stages(model.config, sequences, length)
        finally:
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(context)
        return stages, logits64

    @staticmethod
    def _refuse_decode(status: int, logged: list[str], given: npt.NDArray[np.int64]) -> None:
        for line in logged:
            found = _INVALID_TOKEN.search(line)
            if found:
                position = int(found.group(1))
                raise Refusal(
                    ErrorKind.TOKEN_ID_OUT_OF_BOUNDS,
                    f"llama_decode returned {status}: {line.strip()}",
                    {"position": position, "id": int(given[position])},
                )
        raise RuntimeError(f"llama_decode returned {status}: {_errors(logged)}")

    def _stages(
        self, config: DecoderConfig, sequences: int, length: int
    ) -> list[tuple[str, FloatArray]]:
        names = [("embedding", _EMBEDDING)]
        names += [(f"block-{layer}", f"{_BLOCK_PREFIX}{layer}") for layer in range(config.layers)]
        names.append(("final-norm", _FINAL_NORM))
        shape = (sequences, length, config.model_width)
        stages = []
        for ours, theirs in names:
            values = self._captured.get(theirs)
            if values is None or values.size != np.prod(shape):
                seen = ", ".join(sorted(self._captured)) or "none"
                raise RuntimeError(f"llama.cpp's graph had no tensor {theirs} (saw {seen})")
            stages.append((ours, values.astype(np.float64).reshape(shape)))
        return stages

    def forward(
        self, model: LlamaCppModel, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        stages, logits = self._decode(model, self._ids(model.config, tokens, shape))
        return ForwardOutput(logits=logits, stages=stages)

    def loss(
        self,
        model: LlamaCppModel,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        if detach_lookup or detach_head:
            raise NotImplementedError("llama.cpp has no gradients, so no tied roles")
        config = model.config
        ids = self._ids(config, tokens, None)
        # The targets are the adapter's to check (llama.cpp has no loss); the token IDs are
        # llama.cpp's, checked after them, as the seed's loss does.
        violation = loss_violation(dataclasses.replace(config, context=sys.maxsize), ids, targets)
        if violation is not None and violation.kind is not ErrorKind.TOKEN_ID_OUT_OF_BOUNDS:
            refuse(violation)
        _, logits = self._decode(model, ids)
        rows = logits.reshape(-1, config.vocabulary_size)
        shifted = rows - rows.max(axis=1, keepdims=True)
        log_norm = np.log(np.exp(shifted).sum(axis=1))
        chosen = shifted[np.arange(rows.shape[0]), np.asarray(targets, dtype=np.int64).reshape(-1)]
        return LossOutput(loss=float(np.mean(log_norm - chosen)), gradients=None)


def _errors(logged: list[str]) -> str:
    text = " ".join(line.strip() for line in logged if line.strip())
    return text[-1000:] or "(llama.cpp logged nothing)"


class _LlamaServer(Server):
    """The protocol server, freeing a llama.cpp model when the suite releases it."""

    def parameters(self, request: dict[str, Any]) -> dict[str, Any]:
        """The F32 values as float32, which a float32 backend may send: half the bytes of
        float64 (0.8 GB less at SmolLM2-135M's shape)."""
        model: LlamaCppModel = self._model(request)  # every model here is the engine's
        return {"parameters": encode_parameters(model.parameters)}

    def release(self, request: dict[str, Any]) -> dict[str, Any]:
        model = self._model(request)
        answer = super().release(request)
        if isinstance(model, LlamaCppModel):
            model.close()
        return answer


def main(arguments: list[str] | None = None) -> None:
    """Serve the protocol on standard input and output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--kv-cache", choices=sorted(KV_CACHE_TYPES), default="f32")
    options = parser.parse_args(arguments)
    # ggml's abort would run gdb for a backtrace: slow, and it pushes the assertion that
    # says why out of the stderr tail the suite shows.
    os.environ["GGML_NO_BACKTRACE"] = "1"
    # The protocol owns the real standard output; anything llama.cpp's C code prints to
    # file descriptor 1 goes to stderr instead of into an answer.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    engine = LlamaCppEngine(options.kv_cache)
    _LlamaServer(engine, name_suffix="").serve(sys.stdin.buffer, protocol)


if __name__ == "__main__":
    main()
