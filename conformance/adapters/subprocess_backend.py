"""The subprocess adapter: a backend in any language, spoken to over JSON lines.

The suite starts ``--backend-command`` once, says hello, and sends one request per line
(``PROTOCOL.md``). A backend that crashes, hangs past ``--backend-timeout`` or answers
something that is not the protocol fails the test that was asking, with the tail of its
stderr; the next request starts a fresh process, so the rest of the suite goes on. Every
process is started in its own session and killed with its whole process group.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import queue
import shlex
import signal
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from conformance.adapter import (
    BackendBase,
    BackendLoadError,
    BackendOptions,
    Capability,
    FloatArray,
    ForwardOutput,
    LossOutput,
    Parameters,
    Refusal,
)
from conformance.protocol import (
    PROTOCOL_NAME,
    PROTOCOL_VERSION,
    ProtocolError,
    decode_array,
    decode_parameters,
    encode_config,
    encode_input,
    encode_parameters,
    parse_message,
)
from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.recipe import SplitMix64
from spec.tolerances import Precision

__all__ = ["BackendFault", "SubprocessBackend"]

_STDERR_LINES = 40
_POLL_SECONDS = 0.05


class BackendFault(RuntimeError):
    """The backend process crashed, hung, or broke the protocol."""


class _Process:
    """One running backend: a writer, a reader thread per output stream, a deadline per answer."""

    def __init__(self, command: list[str]) -> None:
        try:
            self.popen = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                encoding="utf-8",
                errors="replace",
                bufsize=1,
                start_new_session=True,
            )
        except OSError as error:
            raise BackendLoadError(
                f"cannot start backend command {shlex.join(command)}: {error}"
            ) from error
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self._pump(self.popen.stdout, self.lines.put, end=lambda: self.lines.put(None))
        self._pump(self.popen.stderr, self.stderr_tail.append, end=lambda: None)

    @staticmethod
    def _pump(stream: IO[str] | None, sink: Any, end: Any) -> None:
        def run() -> None:
            assert stream is not None
            for line in stream:
                sink(line)
            end()

        threading.Thread(target=run, daemon=True).start()

    def stderr(self) -> str:
        """The last lines the backend wrote to stderr, or a note that it wrote none."""
        text = "".join(self.stderr_tail).rstrip()
        return (
            f"\nbackend stderr (last {_STDERR_LINES} lines):\n{text}"
            if text
            else "\n(backend wrote nothing to stderr)"
        )

    def exchange(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request line and wait for its one response line."""
        operation = message.get("op")
        try:
            assert self.popen.stdin is not None
            self.popen.stdin.write(json.dumps(message, allow_nan=False) + "\n")
            self.popen.stdin.flush()
        except (BrokenPipeError, OSError):
            self._wait_briefly()
            raise BackendFault(
                f"backend process exited with status {self.popen.returncode} "
                f"before '{operation}'{self.stderr()}"
            ) from None
        try:
            line = self._next_line(timeout)
        except TimeoutError:
            self.stop()
            raise BackendFault(
                f"backend did not answer '{operation}' within {timeout:g} s (killed){self.stderr()}"
            ) from None
        if line is None:
            self.stop()
            raise BackendFault(
                f"backend process exited with status {self.popen.returncode} "
                f"while answering '{operation}'{self.stderr()}"
            )
        try:
            response = parse_message(line)
        except ProtocolError as error:
            self.stop()
            raise BackendFault(
                f"backend answered '{operation}' with {error}{self.stderr()}"
            ) from None
        if response.get("id") != message["id"] or not isinstance(response.get("ok"), bool):
            self.stop()
            raise BackendFault(
                f"backend answered '{operation}' with a malformed response "
                f"{line.strip()!r:.300}{self.stderr()}"
            )
        return response

    def _next_line(self, timeout: float) -> str | None:
        """The next output line, or None once the process has exited; TimeoutError at the deadline.

        A child of the backend may keep its stdout open after the backend itself died, so
        the end of output alone cannot tell that the backend is gone: poll it as well.
        """
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            try:
                return self.lines.get(timeout=min(remaining, _POLL_SECONDS))
            except queue.Empty:
                if self.popen.poll() is not None:
                    try:  # a last answer may still be on its way through the pipe
                        return self.lines.get(timeout=_POLL_SECONDS)
                    except queue.Empty:
                        return None

    def _wait_briefly(self) -> None:
        try:
            self.popen.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.stop()

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.popen.poll() is None

    def stop(self) -> None:
        """Kill the process and everything it started (its process group, which can outlive it)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


@dataclass(frozen=True, eq=False)
class _Model:
    """A model handle: which backend process made it, and that process's number for it."""

    generation: int
    number: int


class SubprocessBackend(BackendBase):
    """A backend reached through the JSON-lines protocol of ``PROTOCOL.md``."""

    def __init__(self, options: BackendOptions) -> None:
        if not options.backend_command:
            raise BackendLoadError(
                'the subprocess adapter needs --backend-command "COMMAND" '
                "(the program that speaks PROTOCOL.md)"
            )
        self.command = shlex.split(options.backend_command)
        self.timeout = options.timeout
        self._process: _Process | None = None
        self._generation = 0
        self._next_id = 0
        self._closing = False
        self._released: list[tuple[int, int]] = []
        self._fault: BackendFault | None = None
        try:
            hello = self._call("hello", protocol=PROTOCOL_NAME, version=PROTOCOL_VERSION)
        except BackendFault as fault:
            self.close()
            raise BackendLoadError(f"backend did not complete hello: {fault}") from None
        self._adopt_hello(hello)
        atexit.register(self.close)

    def _adopt_hello(self, hello: dict[str, Any]) -> None:
        if hello.get("protocol") != PROTOCOL_NAME or hello.get("version") != PROTOCOL_VERSION:
            raise BackendLoadError(
                f"backend speaks {hello.get('protocol')!r} version {hello.get('version')!r}, "
                f"but the suite speaks {PROTOCOL_NAME!r} version {PROTOCOL_VERSION}"
            )
        try:
            self.name = str(hello["backend"])
            self.version = str(hello["backend_version"])
            self.precision = Precision(hello["precision"])
            self.capabilities = frozenset(Capability(c) for c in hello["capabilities"])
        except (KeyError, ValueError, TypeError) as error:
            raise BackendLoadError(
                f"backend's hello is incomplete or invalid ({error}): {hello!r:.300}"
            ) from None

    # ------------------------------------------------------------------ transport
    def _ensure_process(self) -> _Process:
        if self._process is None or not self._process.alive():
            if self._process is not None:
                self._process.stop()
            self._process = _Process(self.command)
            self._generation += 1
            if self._generation > 1:
                # A restarted backend must introduce itself again before it is used.
                self._request(
                    self._process, "hello", {"protocol": PROTOCOL_NAME, "version": PROTOCOL_VERSION}
                )
        return self._process

    def _request(
        self, process: _Process, operation: str, arguments: dict[str, Any]
    ) -> dict[str, Any]:
        self._next_id += 1
        try:
            response = process.exchange(
                {"id": self._next_id, "op": operation, **arguments}, self.timeout
            )
        except BackendFault:
            process.stop()
            raise
        if response["ok"]:
            result = response.get("result")
            if not isinstance(result, dict):
                raise BackendFault(f"backend's answer to '{operation}' has no result object")
            return result
        error = response.get("error")
        if not isinstance(error, dict):
            raise BackendFault(f"backend's refusal of '{operation}' has no error object")
        kind, message = error.get("kind"), str(error.get("message", ""))
        details = error.get("details") if isinstance(error.get("details"), dict) else {}
        if kind in {str(k) for k in ErrorKind}:
            raise Refusal(ErrorKind(kind), message, details)
        raise BackendFault(f"backend failed '{operation}' ({kind}): {message}{process.stderr()}")

    def _call(self, operation: str, **arguments: Any) -> dict[str, Any]:
        if self._fault is not None:
            # Within one test a broken backend stays broken: fail at once instead of waiting
            # out another timeout for every example hypothesis tries while it shrinks.
            raise BackendFault(
                f"{self._fault} [raised again: the backend failed earlier in this test]"
            )
        try:
            process = self._ensure_process()
            self._release_dropped_models(process)
            return self._request(process, operation, arguments)
        except BackendFault as fault:
            self._fault = fault
            raise

    def begin_test(self) -> None:
        """A new test starts: forget an earlier fault (the next request starts a new process)."""
        self._fault = None

    def _handle(self, result: dict[str, Any]) -> _Model:
        model = _Model(self._generation, int(result["model"]))
        # Released lazily, before the next request: a finalizer must not interleave with one.
        weakref.finalize(model, self._released.append, (model.generation, model.number))
        return model

    def _model_arguments(self, model: _Model) -> dict[str, Any]:
        if (
            model.generation != self._generation
            or self._process is None
            or not self._process.alive()
        ):
            raise BackendFault("this model lived in a backend process that has since stopped")
        return {"model": model.number}

    def _release_dropped_models(self, process: _Process) -> None:
        while self._released:
            generation, number = self._released.pop()
            if generation == self._generation:
                self._request(process, "release", {"model": number})

    def close(self) -> None:
        """Ask the backend to shut down, then make sure its process group is gone."""
        if self._process is None or self._closing:
            return
        self._closing = True
        process, self._process = self._process, None
        if process.alive():
            with contextlib.suppress(BackendFault, Refusal):
                self._request(process, "shutdown", {})
        process.stop()
        self._closing = False

    # ------------------------------------------------------------------- protocol
    def build(self, config: DecoderConfig, parameters: Parameters) -> _Model:
        entries = [(name, np.asarray(value)) for name, value in parameters]
        return self._handle(
            self._call("build", config=encode_config(config), parameters=encode_parameters(entries))
        )

    def build_seeded(self, config: DecoderConfig, seed: int) -> _Model:
        return self._handle(
            self._call("build_seeded", config=encode_config(config), seed=str(seed))
        )

    def initialize(self, config: DecoderConfig, stream: SplitMix64) -> _Model:
        try:
            result = self._call(
                "initialize", config=encode_config(config), stream_state=str(stream.state)
            )
        except Refusal as refusal:
            # The backend reports where its copy of the stream stands after refusing.
            if "stream_state" in refusal.details:
                stream.adopt(SplitMix64(int(refusal.details.pop("stream_state"))))
            raise
        stream.adopt(SplitMix64(int(result["stream_state"])))
        return self._handle(result)

    def parameters(self, model: _Model) -> list[tuple[str, FloatArray]]:
        result = self._call("parameters", **self._model_arguments(model))
        return [
            (name, value.astype(np.float64))
            for name, value in decode_parameters(result.get("parameters"))
        ]

    def forward(
        self, model: _Model, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        arguments = self._model_arguments(model)
        result = self._call(
            "forward",
            **arguments,
            tokens=encode_input(tokens),
            shape=None if shape is None else [int(s) for s in shape],
        )
        stages = result.get("stages")
        return ForwardOutput(
            logits=decode_array(result.get("logits"), "logits").astype(np.float64),
            stages=None
            if stages is None
            else [(n, v.astype(np.float64)) for n, v in decode_parameters(stages, "stages")],
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
        result = self._call(
            "loss",
            **arguments,
            tokens=encode_input(tokens),
            targets=encode_input(targets),
            detach_lookup=detach_lookup,
            detach_head=detach_head,
        )
        gradients = result.get("gradients")
        return LossOutput(
            loss=float(decode_array(result.get("loss"), "loss")),
            gradients=None
            if gradients is None
            else {n: v.astype(np.float64) for n, v in decode_parameters(gradients, "gradients")},
        )
