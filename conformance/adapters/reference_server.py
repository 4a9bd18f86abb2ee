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
        try:
            return self.models[int(request["model"])]
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"unknown model handle {request.get('model')!r}") from None

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
        return self._handle(self.backend.build_seeded(config, int(str(request.get("seed")))))

    def initialize(self, request: dict[str, Any]) -> dict[str, Any]:
        config = decode_config(request.get("config"))
        stream = SplitMix64(int(str(request.get("stream_state"))))
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
        shape = request.get("shape")
        output = self.backend.forward(model, tokens, None if shape is None else tuple(shape))
        stages = None if output.stages is None else encode_parameters(output.stages)
        return {"logits": encode_array(output.logits), "stages": stages}

    def loss(self, request: dict[str, Any]) -> dict[str, Any]:
        output = self.backend.loss(
            self._model(request),
            decode_input(request.get("tokens"), "tokens"),
            decode_input(request.get("targets"), "targets"),
            detach_lookup=bool(request.get("detach_lookup", False)),
            detach_head=bool(request.get("detach_head", False)),
        )
        gradients = (
            None if output.gradients is None else encode_parameters(list(output.gradients.items()))
        )
        return {"loss": encode_array(output.loss), "gradients": gradients}

    def shutdown(self, request: dict[str, Any]) -> dict[str, Any]:
        self.running = False
        return {}

    def release(self, request: dict[str, Any]) -> dict[str, Any]:
        self.models.pop(int(request.get("model", -1)), None)
        return {}

    def answer(self, line: str) -> dict[str, Any]:
        """The response to one request line."""
        identifier: Any = None
        try:
            request = parse_message(line)
            identifier = request.get("id")
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
