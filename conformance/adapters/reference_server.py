"""An example subprocess backend: the reference implementation behind the JSON-lines protocol.

Run it as ``python -m conformance.adapters.reference_server``; check it with
``decoder-conformance run --adapter subprocess --backend-command
"python -m conformance.adapters.reference_server"``. A port to another language follows
the same loop: read a line, act, write one line back, flush.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from conformance.adapter import Refusal
from conformance.adapters.reference import ReferenceBackend
from conformance.protocol import (
    PROTOCOL_NAME,
    PROTOCOL_VERSION,
    ProtocolError,
    decode_config,
    decode_input,
    decode_parameters,
    encode_array,
    encode_parameters,
    parse_message,
)
from spec.recipe import SplitMix64

__all__ = ["Server", "main"]


class Server:
    """Answers protocol requests with the reference backend, one model handle per build."""

    def __init__(self) -> None:
        self.backend = ReferenceBackend()
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
    def _flag(request: dict[str, Any], field: str) -> bool:
        value = request.get(field, False)
        if not isinstance(value, bool):
            raise ProtocolError(f"request field {field!r} must be true or false, got {value!r}")
        return value

    @staticmethod
    def _shape(request: dict[str, Any]) -> tuple[int, ...] | None:
        shape = request.get("shape")
        if shape is None:
            return None
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in shape
        ):
            raise ProtocolError(
                f"request field 'shape' must be null or a list of integers, got {shape!r}"
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
            "backend": f"{backend.name}-over-subprocess",
            "backend_version": backend.version,
            "precision": str(backend.precision),
            "capabilities": sorted(str(c) for c in backend.capabilities),
        }

    def build(self, request: dict[str, Any]) -> dict[str, Any]:
        config = decode_config(request.get("config"))
        return self._handle(
            self.backend.build(config, decode_parameters(request.get("parameters")))
        )

    def build_seeded(self, request: dict[str, Any]) -> dict[str, Any]:
        config = decode_config(request.get("config"))
        return self._handle(self.backend.build_seeded(config, self._unsigned(request, "seed")))

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
        identifier: Any = None
        try:
            request = parse_message(line)
            identifier = request.get("id")
            if not isinstance(identifier, int) or isinstance(identifier, bool):
                raise ProtocolError(f"request field 'id' must be an integer, got {identifier!r}")
            operation = self.operations.get(str(request.get("op")))
            if operation is None:
                raise ProtocolError(
                    f"unknown op {request.get('op')!r}; known: {', '.join(self.operations)}"
                )
            return {"id": identifier, "ok": True, "result": operation(request)}
        except Refusal as refusal:
            error = {
                "kind": str(refusal.kind),
                "message": refusal.message,
                "details": _jsonable(refusal.details),
            }
            return {"id": identifier, "ok": False, "error": error}
        except ProtocolError as problem:
            return {
                "id": identifier,
                "ok": False,
                "error": {"kind": "protocol", "message": str(problem), "details": {}},
            }

    def serve(self, source: TextIO, sink: TextIO) -> None:
        """Answer every line until ``shutdown`` or the end of input."""
        for line in source:
            if not line.strip():
                continue
            sink.write(json.dumps(self.answer(line), allow_nan=False) + "\n")
            sink.flush()
            if not self.running:
                return


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
    Server().serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
