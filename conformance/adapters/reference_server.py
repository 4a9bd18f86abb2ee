"""An example subprocess backend: the reference implementation behind the JSON-lines protocol.

Run it as ``python -m conformance.adapters.reference_server``; check it with
``decoder-conformance run --adapter subprocess --backend-command
"python -m conformance.adapters.reference_server"``. A port to another language follows
the same loop: read a line, act, write one line back, flush; exit at ``shutdown`` or at the
end of input.

It never crashes on what it reads: a malformed request (not JSON, nested too deeply, a
number too long, a wrong field, an array whose data does not fit its shape, a line longer
than :data:`MAX_REQUEST_BYTES`) gets a ``protocol`` error naming the field, a refused input
its spec kind, and anything else the reference raises an ``internal`` error.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from conformance.adapter import Backend, Refusal
from conformance.adapters.reference import ReferenceBackend
from conformance.heap import return_freed_memory
from conformance.protocol import (
    PROTOCOL_NAME,
    PROTOCOL_VERSION,
    ProtocolError,
    decode_config,
    decode_input,
    decode_parameters,
    encode_array,
    encode_parameters,
    line_pieces,
    parse_message,
)
from spec.recipe import SplitMix64

__all__ = ["MAX_REQUEST_BYTES", "Server", "main"]

# The largest request the suite sends is a build at the largest scale shape, every float64
# parameter as base64: 1.58 GB at smollm2-135m (tests/conformance/test_hostile_backends.py
# computes it and holds this to twice it). Past this a line is read through and refused,
# never held.
MAX_REQUEST_BYTES = 4 << 30
# After a request or answer longer than this (a build, a forward with its stages, gradients
# at a scale shape), the heap's freed pages go back to the system before the next request.
_LARGE_LINE_BYTES = 16 << 20


class Server:
    """Answers protocol requests with a backend (the reference unless given), one model
    handle per build. ``hello`` names it ``backend.name + name_suffix``."""

    def __init__(
        self, backend: Backend | None = None, *, name_suffix: str = "-over-subprocess"
    ) -> None:
        self.backend: Any = ReferenceBackend() if backend is None else backend
        self.name_suffix = name_suffix
        self.models: dict[int, Any] = {}
        self.operations: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "hello": self.hello,
            "build": self.build,
            "build_seeded": self.build_seeded,
            "initialize": self.initialize,
            "parameters": self.parameters,
            "forward": self.forward,
            "loss": self.loss,
            "release": self.release,
            "shutdown": self.shutdown,
        }
        self.running = True

    def _handle(self, model: Any) -> dict[str, Any]:
        handle = len(self.models) + 1
        while handle in self.models:
            handle += 1
        self.models[handle] = model
        return {"model": handle}

    def _model(self, request: dict[str, Any]) -> Any:
        handle = request.get("model")
        if not isinstance(handle, int) or isinstance(handle, bool) or handle not in self.models:
            raise ProtocolError(
                f"request field 'model' must be a live model handle, got {handle!r}"
            )
        return self.models[handle]

    @staticmethod
    def _unsigned(request: dict[str, Any], field: str) -> int:
        text = request.get(field)
        if not isinstance(text, str) or not text.isdigit() or int(text) >= 2**64:
            raise ProtocolError(
                f"request field {field!r} must be a decimal string of an unsigned 64-bit "
                f"integer, got {text!r}"
            )
        return int(text)

    @staticmethod
    def _seed(request: dict[str, Any]) -> int:
        """A seed: the decimal string of any integer; one outside [0, 2**64 - 1] is the
        backend's to refuse (invalid-seed), not a malformed request."""
        text = request.get("seed")
        if not isinstance(text, str) or not text.removeprefix("-").isdigit() or len(text) > 40:
            raise ProtocolError(
                f"request field 'seed' must be the decimal string of an integer, got {text!r:.60}"
            )
        return int(text)

    @staticmethod
    def _flag(request: dict[str, Any], field: str) -> bool:
        value = request.get(field, False)
        if not isinstance(value, bool):
            raise ProtocolError(f"request field {field!r} must be true or false, got {value!r}")
        return value

    @staticmethod
    def _shape(request: dict[str, Any]) -> tuple[Any, ...] | None:
        """The declared shape as the caller gave it: a size that is no non-negative integer
        (-1, 2.0, 2.5, true) is the backend's token-dtype refusal, not a malformed request."""
        shape = request.get("shape")
        if shape is None:
            return None
        if not isinstance(shape, list) or not all(isinstance(s, int | float | str) for s in shape):
            raise ProtocolError(
                f"request field 'shape' must be null or a list of numbers, got {shape!r:.60}"
            )
        return tuple(shape)

    def hello(self, request: dict[str, Any]) -> dict[str, Any]:
        if request.get("protocol") != PROTOCOL_NAME or request.get("version") != PROTOCOL_VERSION:
            raise ProtocolError(
                f"this server speaks {PROTOCOL_NAME} version {PROTOCOL_VERSION}, "
                f"not {request.get('protocol')!r} version {request.get('version')!r}"
            )
        backend = self.backend
        return {
            "protocol": PROTOCOL_NAME,
            "version": PROTOCOL_VERSION,
            "backend": f"{backend.name}{self.name_suffix}",
            "backend_version": backend.version,
            "precision": str(backend.precision),
            "capabilities": sorted(str(c) for c in backend.capabilities),
            "departures": sorted(str(d) for d in getattr(backend, "departures", ())),
        }

    def build(self, request: dict[str, Any]) -> dict[str, Any]:
        config = decode_config(request.get("config"))
        # Taken out of the request and decoded entry by entry, each entry's text let go once
        # decoded: at a scale shape the text is 1.44 GB and the arrays 1.08 GB.
        parameters = decode_parameters(request.pop("parameters", None), consume=True)
        return self._handle(self.backend.build(config, parameters))

    def build_seeded(self, request: dict[str, Any]) -> dict[str, Any]:
        config = decode_config(request.get("config"))
        return self._handle(self.backend.build_seeded(config, self._seed(request)))

    def initialize(self, request: dict[str, Any]) -> dict[str, Any]:
        config = decode_config(request.get("config"))
        stream = SplitMix64(self._unsigned(request, "stream_state"))
        try:
            result = self._handle(self.backend.initialize(config, stream))
        except Refusal as refusal:
            refusal.details["stream_state"] = str(stream.state)
            raise
        return result | {"stream_state": str(stream.state)}

    def parameters(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"parameters": encode_parameters(self.backend.parameters(self._model(request)))}

    def forward(self, request: dict[str, Any]) -> dict[str, Any]:
        model = self._model(request)
        tokens = decode_input(request.get("tokens"), "tokens")
        shape = self._shape(request)
        if shape is not None and len(shape) != 2:
            raise ProtocolError(
                f"request field 'shape' must hold two sizes [B, T], got {list(shape)}"
            )
        output = self.backend.forward(
            model, tokens, None if shape is None else (shape[0], shape[1])
        )
        stages = None if output.stages is None else encode_parameters(output.stages)
        return {"logits": encode_array(output.logits), "stages": stages}

    def loss(self, request: dict[str, Any]) -> dict[str, Any]:
        output = self.backend.loss(
            self._model(request),
            decode_input(request.get("tokens"), "tokens"),
            decode_input(request.get("targets"), "targets"),
            detach_lookup=self._flag(request, "detach_lookup"),
            detach_head=self._flag(request, "detach_head"),
        )
        gradients = (
            None if output.gradients is None else encode_parameters(list(output.gradients.items()))
        )
        return {"loss": encode_array(output.loss), "gradients": gradients}

    def shutdown(self, request: dict[str, Any]) -> dict[str, Any]:
        self.running = False
        return {}

    def release(self, request: dict[str, Any]) -> dict[str, Any]:
        self._model(request)
        self.models.pop(request["model"])
        return {}

    def answer(self, line: str) -> dict[str, Any]:
        """The response to one request line."""
        request, refusal = _parsed(line)
        return refusal if request is None else self.answer_request(request)

    def answer_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """The response to one parsed request (a build's parameters are taken out of it)."""
        identifier: Any = request.get("id")
        try:
            if not isinstance(identifier, int) or isinstance(identifier, bool):
                identifier = None
                raise ProtocolError(
                    f"request field 'id' must be an integer, got {request.get('id')!r:.60}"
                )
            op = request.get("op")
            operation = self.operations.get(op) if isinstance(op, str) else None
            if operation is None:
                raise ProtocolError(f"unknown op {op!r:.60}; known: {', '.join(self.operations)}")
            return {"id": identifier, "ok": True, "result": operation(request)}
        except Refusal as refusal:
            error = {
                "kind": str(refusal.kind),
                "message": refusal.message,
                "details": _jsonable(refusal.details),
            }
            return {"id": identifier, "ok": False, "error": error}
        except ProtocolError as problem:
            return _error(identifier, "protocol", str(problem))
        except (TypeError, ValueError, OverflowError, RecursionError) as problem:
            # A field of the right JSON type but an impossible value (a config size of
            # 10**30, say) that the reference's own checks did not classify.
            return _error(identifier, "protocol", f"{type(problem).__name__}: {problem}")
        except Exception as problem:  # the server answers; it does not die
            return _error(identifier, "internal", f"{type(problem).__name__}: {problem}")

    def serve(self, source: BinaryIO, sink: BinaryIO) -> None:
        """Answer every line until ``shutdown`` or the end of input."""
        while True:
            line = _request_line(source)
            if line == "":
                return  # the end of input
            received = MAX_REQUEST_BYTES + 1 if line is None else len(line)
            if line is None:
                answer = _error(
                    None, "protocol", f"request line longer than {MAX_REQUEST_BYTES} bytes"
                )
            elif line.isspace():  # (not strip(): that would copy a line of gigabytes)
                continue
            else:
                request, answer = _parsed(line)
                # Parsed, its text can go before the work starts (1.58 GB for a build at
                # SmolLM2-135M's shape).
                line = None
                if request is not None:
                    answer = self.answer_request(request)
                    del request
            sent = 0
            for piece in _answer_pieces(answer):
                sink.write(piece)
                sent += len(piece)
            sink.flush()
            del answer
            if max(received, sent) > _LARGE_LINE_BYTES:
                return_freed_memory()
            if not self.running:
                return


def _parsed(line: str) -> tuple[dict[str, Any], dict[str, Any]] | tuple[None, dict[str, Any]]:
    """The request a line holds, and the answer for a line that holds none: a ``protocol``
    error for what is not a request, ``internal`` for what failed reading it (memory for a
    line of gigabytes)."""
    try:
        return parse_message(line), {}
    except ProtocolError as problem:
        return None, _error(None, "protocol", str(problem))
    except Exception as problem:  # the server answers; it does not die
        return None, _error(None, "internal", f"{type(problem).__name__}: {problem}")


def _answer_pieces(answer: dict[str, Any]) -> Iterator[bytes]:
    """The answer's line in pieces; an answer JSON cannot hold (a backend's result with a
    non-finite float or an object in it) becomes an internal error, not a dead server."""
    try:
        return line_pieces(answer)
    except (TypeError, ValueError) as problem:
        identifier = answer.get("id")
        message = f"the answer is not JSON: {type(problem).__name__}: {problem}"
        return line_pieces(_error(identifier, "internal", message))


def _error(identifier: int | None, kind: str, message: str) -> dict[str, Any]:
    return {
        "id": identifier,
        "ok": False,
        "error": {"kind": kind, "message": message[:2000], "details": {}},
    }


def _request_line(source: BinaryIO) -> str | None:
    """The next line of ``source`` as text (empty at the end of input), or None for a line
    over the limit (read past, not kept). Only the text outlives the call: a request can be
    gigabytes."""
    line = source.readline(MAX_REQUEST_BYTES + 1)
    if len(line) > MAX_REQUEST_BYTES and not line.endswith(b"\n"):
        del line
        while True:
            rest = source.readline(1 << 20)
            if not rest or rest.endswith(b"\n"):
                break
        return None
    return line.decode("utf-8", errors="replace")


def _jsonable(details: dict[str, Any]) -> dict[str, Any]:
    """Details with tuples as lists and anything JSON cannot hold as its text."""
    converted: dict[str, Any] = {}
    for name, value in details.items():
        plain = list(value) if isinstance(value, tuple) else value
        try:
            json.dumps(plain, allow_nan=False)
        except (TypeError, ValueError):
            plain = repr(plain)
        converted[name] = plain
    return converted


def main() -> None:
    """Serve standard input to standard output."""
    Server().serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()
