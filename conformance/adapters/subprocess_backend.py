"""The subprocess adapter: a backend in any language, spoken to over JSON lines.

The suite starts ``--backend-command`` once, says hello, and sends one request per line
(``PROTOCOL.md``). A backend that crashes, hangs past ``--backend-timeout``, answers
something that is not the protocol (a malformed field, a dtype its precision does not
allow, an answer larger than twice the largest legitimate one) fails the test that was
asking, with the tail of its stderr; the next request starts a fresh process, so the rest
of the suite goes on. Three timeouts in a row end the wait for good. The process and all
it starts run under :mod:`conformance.supervisor` and end with the run
(:mod:`conformance.backend_process`).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import shlex
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import (
    BackendBase,
    BackendLoadError,
    BackendOptions,
    Capability,
    Departure,
    FloatArray,
    ForwardOutput,
    LossOutput,
    Parameters,
    Refusal,
)
from conformance.backend_process import MIN_RESPONSE_BYTES, BackendFault, BackendProcess
from conformance.protocol import (
    MAX_NAME_LENGTH,
    PROTOCOL_NAME,
    PROTOCOL_VERSION,
    ProtocolError,
    decode_array,
    decode_parameters,
    encode_config,
    encode_input,
    encode_parameters,
    printable,
)
from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.formats import Precision, accepted_dtypes
from spec.recipe import SplitMix64

__all__ = ["BackendFault", "SubprocessBackend"]

# Consecutive timed-out requests after which the backend is given up on for the run: each
# further request fails at once, so a dead backend costs minutes, not hours of timeouts.
MAX_CONSECUTIVE_TIMEOUTS = 3
SHUTDOWN_SECONDS = 2.0
_ENVELOPE = 256  # JSON around one array: its name, dtype, shape and the quotes


def response_limit(scalars: int, arrays: int) -> int:
    """Bytes an answer may take: twice the largest legitimate one (``scalars`` float64
    values as base64 in ``arrays`` array messages), and 1 MiB at least."""
    legitimate = 4 * math.ceil(8 * scalars / 3) + _ENVELOPE * (arrays + 1)
    return max(2 * legitimate, MIN_RESPONSE_BYTES)


@dataclass(frozen=True, eq=False)
class _Model:
    """A model handle: which backend process made it, that process's number for it, and
    the configuration it was built with (which bounds the size of its answers)."""

    generation: int
    number: int
    config: DecoderConfig


class SubprocessBackend(BackendBase):
    """A backend reached through the JSON-lines protocol of ``PROTOCOL.md``."""

    def __init__(self, options: BackendOptions) -> None:
        if not options.backend_command:
            raise BackendLoadError(
                'the subprocess adapter needs --backend-command "COMMAND" '
                "(the program that speaks PROTOCOL.md)"
            )
        try:
            self.command = shlex.split(options.backend_command)
        except ValueError as error:
            raise BackendLoadError(f"--backend-command cannot be split: {error}") from None
        if not self.command:
            raise BackendLoadError("--backend-command is empty")
        self.timeout = options.timeout
        self._process: BackendProcess | None = None
        self._generation = 0
        self._next_id = 0
        self._closing = False
        self._released: list[tuple[int, int]] = []
        self._fault: BackendFault | None = None
        self._timeouts_in_a_row = 0
        self._given_up: str | None = None
        try:
            hello = self._call("hello", protocol=PROTOCOL_NAME, version=PROTOCOL_VERSION)
            self._adopt_hello(hello)
        except (BackendFault, BackendLoadError) as fault:
            self.close()
            if isinstance(fault, BackendLoadError):
                raise
            raise BackendLoadError(f"backend did not complete hello: {fault}") from None
        atexit.register(self.close)

    def _adopt_hello(self, hello: dict[str, Any]) -> None:
        if hello.get("protocol") != PROTOCOL_NAME or hello.get("version") != PROTOCOL_VERSION:
            raise BackendLoadError(
                f"backend speaks {printable(repr(hello.get('protocol')), one_line=True):.80} "
                f"version {printable(repr(hello.get('version')), one_line=True):.40}, "
                f"but the suite speaks {PROTOCOL_NAME!r} version {PROTOCOL_VERSION}"
            )
        try:
            name, version = hello["backend"], hello["backend_version"]
            if not isinstance(name, str) or not isinstance(version, str):
                raise TypeError("backend and backend_version must be strings")
            if not 0 < len(name) <= MAX_NAME_LENGTH or len(version) > MAX_NAME_LENGTH:
                raise ValueError(f"backend name and version hold 1 to {MAX_NAME_LENGTH} characters")
            capabilities = hello["capabilities"]
            if not isinstance(capabilities, list):
                raise TypeError("capabilities must be a list")
            # Shown in a terminal and in Markdown: a name cannot carry escapes or lines.
            self.name = printable(name, one_line=True)
            self.version = printable(version, one_line=True)
            self.precision = Precision(hello["precision"])
            self.capabilities = frozenset(Capability(c) for c in capabilities)
            departures = hello.get("departures", [])
            if not isinstance(departures, list):
                raise TypeError("departures must be a list")
            self.departures = frozenset(Departure(d) for d in departures)
        except (KeyError, ValueError, TypeError) as error:
            raise BackendLoadError(
                f"backend's hello is incomplete or invalid ({error}): "
                f"{printable(repr(hello), one_line=True):.300}"
            ) from None

    # ------------------------------------------------------------------ transport
    def _ensure_process(self) -> BackendProcess:
        if self._process is None or not self._process.alive():
            if self._process is not None:
                self._process.stop()
            self._process = BackendProcess(self.command)
            self._generation += 1
            if self._generation > 1:
                # A restarted backend must introduce itself again before it is used.
                self._request(
                    self._process, "hello", {"protocol": PROTOCOL_NAME, "version": PROTOCOL_VERSION}
                )
        return self._process

    def _request(
        self,
        process: BackendProcess,
        operation: str,
        arguments: dict[str, Any],
        *,
        limit: int = MIN_RESPONSE_BYTES,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        self._next_id += 1
        wait = self.timeout if timeout is None else timeout
        try:
            response = process.exchange(
                {"id": self._next_id, "op": operation, **arguments}, wait, limit
            )
        except BackendFault as fault:
            process.stop()
            self._count_timeout(fault, wait)
            raise
        if operation not in ("hello", "release", "shutdown"):
            # Only an answer to real work shows the backend works: a restarted process
            # always greets.
            self._timeouts_in_a_row = 0
        try:
            return self._outcome(operation, response, process)
        except ProtocolError as error:
            process.stop()  # a backend that breaks the protocol starts afresh for the next test
            raise BackendFault(
                f"backend's answer to '{operation}' breaks the protocol: {error}{process.stderr()}"
            ) from None

    def _count_timeout(self, fault: BackendFault, wait: float) -> None:
        if "did not answer" not in str(fault) and "did not read" not in str(fault):
            self._timeouts_in_a_row = 0
            return
        self._timeouts_in_a_row += 1
        if self._timeouts_in_a_row >= MAX_CONSECUTIVE_TIMEOUTS:
            self._given_up = (
                f"backend stopped answering: {self._timeouts_in_a_row} requests in a row took "
                f"longer than {wait:g} s; the rest of the run does not wait for it "
                "(--backend-timeout sets the wait)"
            )

    @staticmethod
    def _outcome(
        operation: str, response: dict[str, Any], process: BackendProcess
    ) -> dict[str, Any]:
        """The result object of an answer, or the Refusal it carries."""
        if response["ok"]:
            result = response.get("result")
            if not isinstance(result, dict):
                raise ProtocolError("an answer with ok true must carry a result object")
            return result
        error = response.get("error")
        if not isinstance(error, dict):
            raise ProtocolError("an answer with ok false must carry an error object")
        kind, message = error.get("kind"), error.get("message", "")
        details = error.get("details", {})
        if not isinstance(message, str) or not isinstance(details, dict):
            raise ProtocolError("error.message must be a string and error.details an object")
        message = printable(message)
        if kind in {str(k) for k in ErrorKind}:
            raise Refusal(ErrorKind(kind), message, details)
        raise BackendFault(
            f"backend failed '{operation}' "
            f"({printable(repr(kind), one_line=True):.60}): {message:.2000}{process.stderr()}"
        )

    def _call(
        self,
        operation: str,
        *,
        limit: int = MIN_RESPONSE_BYTES,
        timeout: float | None = None,
        **arguments: Any,
    ) -> dict[str, Any]:
        if self._given_up is not None:
            raise BackendFault(self._given_up)
        if self._fault is not None:
            # Within one test a broken backend stays broken: fail at once instead of waiting
            # out another timeout for every example hypothesis tries while it shrinks. The
            # stderr tail was shown with the first failure: it is not repeated.
            first = str(self._fault).split("\nbackend stderr", 1)[0].split("\n(backend", 1)[0]
            raise BackendFault(f"{first} [raised again: the backend failed earlier in this test]")
        try:
            process = self._ensure_process()
            self._release_dropped_models(process)
            return self._request(process, operation, arguments, limit=limit, timeout=timeout)
        except BackendFault as fault:
            self._fault = fault
            raise

    def begin_test(self) -> None:
        """A new test starts: forget an earlier fault (the next request starts a new process)."""
        self._fault = None

    def _handle(self, result: dict[str, Any], config: DecoderConfig) -> _Model:
        number = result.get("model")
        if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number < 2**63:
            raise self._broken(f"result.model must be an integer handle, got {number!r:.60}")
        model = _Model(self._generation, number, config)
        # Released lazily, before the next request: a finalizer must not interleave with one.
        weakref.finalize(model, self._released.append, (model.generation, model.number))
        return model

    def _broken(self, problem: str) -> BackendFault:
        """A fault for an answer whose fields break the protocol; the process starts afresh."""
        process, stderr = self._process, ""
        if process is not None:
            stderr = process.stderr()
            process.stop()
        self._fault = BackendFault(f"backend's answer breaks the protocol: {problem}{stderr}")
        return self._fault

    def _model_arguments(self, model: _Model) -> dict[str, Any]:
        if (
            model.generation != self._generation
            or self._process is None
            or not self._process.alive()
        ):
            raise BackendFault("this model lived in a backend process that has since stopped")
        return {"model": model.number}

    def _release_dropped_models(self, process: BackendProcess) -> None:
        while self._released:
            generation, number = self._released.pop()
            if generation == self._generation:
                self._request(process, "release", {"model": number})

    def close(self) -> None:
        """Ask the backend to shut down (a short wait), then make sure its tree is gone."""
        if self._process is None or self._closing:
            return
        self._closing = True
        process, self._process = self._process, None
        if process.alive():
            with contextlib.suppress(BackendFault, Refusal, ProtocolError):
                self._request(process, "shutdown", {}, timeout=min(self.timeout, SHUTDOWN_SECONDS))
        process.stop()
        self._closing = False

    # --------------------------------------------------------------- decoding
    def _floats(self, message: object, what: str) -> FloatArray:
        """A floating array in the declared precision (float64 always allowed), as float64."""
        try:
            array = decode_array(message, what)
        except ProtocolError as error:
            raise self._broken(str(error)) from None
        allowed = self._wire_dtypes()
        if array.dtype.name not in allowed:
            raise self._broken(
                f"{what} has dtype {array.dtype.name}, but the backend declares "
                f"{self.precision}: send {' or '.join(allowed)}"
            )
        return array.astype(np.float64, copy=False)  # decoded afresh: no copy to share

    def _wire_dtypes(self) -> tuple[str, ...]:
        """The dtypes the protocol carries for the declared precision (bfloat16 has no numpy
        name on the wire: a bfloat16 backend sends float32 or float64)."""
        return tuple(name for name in accepted_dtypes(self.precision) if name != "bfloat16")

    def _named_floats(self, message: object, what: str) -> list[tuple[str, FloatArray]]:
        try:
            # The answer's own list, let go entry by entry (gradients at SmolLM2-135M's
            # shape are 1.44 GB of base64).
            entries = decode_parameters(message, what, consume=True)
        except ProtocolError as error:
            raise self._broken(str(error)) from None
        allowed = self._wire_dtypes()
        for index, (name, value) in enumerate(entries):
            if value.dtype.name not in allowed:
                raise self._broken(
                    f"{what}[{index}] ({printable(name, one_line=True)}) has dtype "
                    f"{value.dtype.name}, but the backend declares {self.precision}"
                )
        return [
            (printable(name, one_line=True), value.astype(np.float64, copy=False))
            for name, value in entries
        ]

    def _stream_state(self, value: object, what: str) -> int:
        if not isinstance(value, str) or not value.isdigit() or len(value) > 20:
            raise self._broken(f"{what} must be a decimal string, got {value!r:.60}")
        state = int(value)
        if state >= 2**64:
            raise self._broken(f"{what} {state} is not an unsigned 64-bit integer")
        return state

    # ------------------------------------------------------------------- protocol
    def build(self, config: DecoderConfig, parameters: Parameters) -> _Model:
        entries = [(name, np.asarray(value)) for name, value in parameters]
        result = self._call(
            "build", config=encode_config(config), parameters=encode_parameters(entries)
        )
        return self._handle(result, config)

    def build_seeded(self, config: DecoderConfig, seed: int) -> _Model:
        result = self._call("build_seeded", config=encode_config(config), seed=str(seed))
        return self._handle(result, config)

    def initialize(self, config: DecoderConfig, stream: SplitMix64) -> _Model:
        try:
            result = self._call(
                "initialize", config=encode_config(config), stream_state=str(stream.state)
            )
        except Refusal as refusal:
            # The backend reports where its copy of the stream stands after refusing.
            if "stream_state" in refusal.details:
                state = self._stream_state(
                    refusal.details.pop("stream_state"), "error.details.stream_state"
                )
                stream.adopt(SplitMix64(state))
            raise
        model = self._handle(result, config)
        stream.adopt(SplitMix64(self._stream_state(result.get("stream_state"), "stream_state")))
        return model

    def parameters(self, model: _Model) -> list[tuple[str, FloatArray]]:
        config = model.config
        result = self._call(
            "parameters",
            limit=response_limit(_parameter_scalars(config), 2 + 9 * _layers(config)),
            **self._model_arguments(model),
        )
        return self._named_floats(result.get("parameters"), "parameters")

    def forward(
        self, model: _Model, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        arguments = self._model_arguments(model)
        positions = _positions(tokens, shape)
        config = model.config
        width, vocabulary = _size(config.model_width), _size(config.vocabulary_size)
        stage_count = _layers(config) + 2
        result = self._call(
            "forward",
            limit=response_limit(positions * (vocabulary + stage_count * width), stage_count + 1),
            **arguments,
            tokens=encode_input(tokens),
            shape=None if shape is None else [_json_size(size) for size in shape],
        )
        stages = result.get("stages")
        return ForwardOutput(
            logits=self._floats(result.get("logits"), "logits"),
            stages=None if stages is None else self._named_floats(stages, "stages"),
        )

    def loss(
        self,
        model: _Model,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        arguments = self._model_arguments(model)
        config = model.config
        result = self._call(
            "loss",
            limit=response_limit(_parameter_scalars(config) + 1, 3 + 9 * _layers(config)),
            **arguments,
            tokens=encode_input(tokens),
            targets=encode_input(targets),
            detach_lookup=detach_lookup,
            detach_head=detach_head,
        )
        gradients = result.get("gradients")
        loss = self._floats(result.get("loss"), "loss")
        if loss.size != 1:
            raise self._broken(f"loss must hold one value, got shape {list(loss.shape)}")
        return LossOutput(
            loss=float(loss.reshape(())),
            gradients=None
            if gradients is None
            else dict(self._named_floats(gradients, "gradients")),
        )


def _size(value: object) -> int:
    """A configuration size as an int (0 for the wrong-typed fields refusal tests send)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _layers(config: DecoderConfig) -> int:
    return _size(config.layers)


def _parameter_scalars(config: DecoderConfig) -> int:
    width, ffn = _size(config.model_width), _size(config.feed_forward_width)
    return (
        _size(config.vocabulary_size) * width
        + _layers(config) * (4 * width * width + 3 * width * ffn + 2 * width)
        + width
    )


def _json_size(size: object) -> object:
    """A declared size as JSON carries it, unchanged: the backend must see a -1, a 2.0 or a
    2.5 to refuse it (numpy's scalars become Python's; anything else travels as its text)."""
    if isinstance(size, bool | np.bool_):
        return bool(size)
    if isinstance(size, int | np.integer):
        return int(size)
    if isinstance(size, float | np.floating):
        return float(size)
    return size if isinstance(size, str) else repr(size)


def _positions(tokens: npt.ArrayLike, shape: tuple[int, int] | None) -> int:
    """How many token positions a forward answers for (0 when the input is malformed: its
    answer is a refusal, which the 1 MiB floor covers)."""
    if shape is not None:
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            return max(int(shape[0]) * int(shape[1]), 0)
        return 0
    try:
        return int(np.asarray(tokens).size)
    except (TypeError, ValueError):
        return 0
