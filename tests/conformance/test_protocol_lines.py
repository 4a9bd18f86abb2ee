"""Protocol lines of real-model size: written in pieces, checked before the first byte.

A build at SmolLM2-135M's shape is one request line of 1.58 GB. Made whole, as text and then
as bytes, it was the largest allocation of the suite and of the server; both now write a line
piece by piece, and the server lets a request's text go once it is parsed.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
import tracemalloc
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

from conformance import protocol
from conformance.adapters import reference_server
from conformance.backend_process import BackendProcess, Tail
from conformance.protocol import (
    decode_parameters,
    encode_config,
    encode_parameters,
    line_pieces,
)
from spec.config import FIXTURE
from spec.parameters import parameter_layout
from spec.recipe import initial_parameters

HELLO = {"op": "hello", "protocol": "decoder-conformance", "version": 1}
SERVER = [sys.executable, "-m", "conformance.adapters.reference_server"]


@contextlib.contextmanager
def _peak_growth() -> Iterator[list[int]]:
    """The peak of traced memory inside the block over what was traced at its start, in the
    yielded list once the block ends (tracing already on, under PYTHONTRACEMALLOC, is kept)."""
    growth: list[int] = []
    tracing_already = tracemalloc.is_tracing()
    if not tracing_already:
        tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        yield growth
        _, peak = tracemalloc.get_traced_memory()
        growth.append(peak - before)
    finally:
        if not tracing_already:
            tracemalloc.stop()


@pytest.fixture
def backend() -> Iterator[BackendProcess]:
    process = BackendProcess(SERVER)
    try:
        yield process
    finally:
        process.stop()


def test_the_pieces_make_the_json_line_and_each_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "LINE_PIECE_BYTES", 64)
    message = {
        "id": 7,
        "op": "build",
        "text": 'é\u2028\x1b"\\' * 30,  # escaped by ensure_ascii, several times 64 bytes
        "reals": [0.1, -2.5e-300, 1e300],
        "nested": {"empty": [], "long": "x" * 1000, "short": "y", "flag": None},
        "many": [str(index) for index in range(200)],
    }
    pieces = list(line_pieces(message))
    assert b"".join(pieces) == (json.dumps(message) + "\n").encode("ascii")
    assert len(pieces) > 10 and max(len(piece) for piece in pieces) <= 2 * 64


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (math.nan, ValueError),
        (math.inf, ValueError),
        (object(), TypeError),
        (MappingProxyType({"a": 1}), TypeError),  # a mapping that is no dict: json refuses it
    ],
)
def test_a_message_json_cannot_hold_raises_before_any_piece_is_made(
    value: object, error: type[Exception]
) -> None:
    message = {"id": 1, "op": "build", "data": "x" * 100, "deep": [{"value": value}]}
    with pytest.raises(error):
        line_pieces(message)  # the call itself, not the first piece


def test_a_circular_message_is_a_value_error_before_any_piece() -> None:
    circular: dict[str, Any] = {"id": 1, "op": "build"}
    circular["self"] = [circular]
    with pytest.raises(ValueError, match="circular"):
        line_pieces(circular)


def test_a_request_json_cannot_hold_sends_nothing_and_the_backend_goes_on(
    backend: BackendProcess,
) -> None:
    with pytest.raises(ValueError):
        backend.exchange({"id": 1, **HELLO, "padding": "x" * 100_000, "x": math.nan}, 60)
    assert backend.alive()
    answer = backend.exchange({"id": 2, **HELLO}, 60)
    assert answer["id"] == 2 and answer["ok"], answer


def test_a_request_is_sent_without_a_copy_of_its_whole_line(
    backend: BackendProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """32 MB of request text in 1 MB pieces: the old client made it whole twice (text, then
    bytes); now what it holds at once is a few pieces (an escaped string and a piece of it)."""
    monkeypatch.setattr(protocol, "LINE_PIECE_BYTES", 1 << 20)
    padding = ["p" * (1 << 21) for _ in range(16)]
    line_bytes = len(json.dumps({"id": 1, **HELLO, "padding": padding})) + 1
    with _peak_growth() as growth:
        answer = backend.exchange({"id": 1, **HELLO, "padding": padding}, 60)
    assert answer["ok"], answer
    assert growth[0] < line_bytes // 4, (growth[0], line_bytes)


def test_an_answer_json_cannot_hold_is_an_internal_error_and_the_server_goes_on() -> None:
    server = reference_server.Server()
    server.operations["broken"] = lambda request: {"value": math.nan}
    requests = [json.dumps({"id": 1, "op": "broken"}), json.dumps({"id": 2, **HELLO})]
    sink = io.BytesIO()
    server.serve(io.BytesIO("\n".join(requests).encode() + b"\n"), sink)
    first, second = (json.loads(line) for line in sink.getvalue().splitlines())
    assert first["id"] == 1 and not first["ok"], first
    assert first["error"]["kind"] == "internal"
    assert "not JSON" in first["error"]["message"] and "Out of range float" in str(first)
    assert second["id"] == 2 and second["ok"], second


def test_a_line_the_server_cannot_read_is_an_internal_error_and_it_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def out_of_memory(line: str) -> dict[str, Any]:
        if "padding" in line:
            raise MemoryError("a line of gigabytes")
        return json.loads(line)  # type: ignore[no-any-return]

    monkeypatch.setattr(reference_server, "parse_message", out_of_memory)
    requests = [json.dumps({"id": 1, **HELLO, "padding": 1}), json.dumps({"id": 2, **HELLO})]
    sink = io.BytesIO()
    reference_server.Server().serve(io.BytesIO("\n".join(requests).encode() + b"\n"), sink)
    first, second = (json.loads(line) for line in sink.getvalue().splitlines())
    assert first["id"] is None and first["error"]["kind"] == "internal", first
    assert "MemoryError: a line of gigabytes" in first["error"]["message"]
    assert second["id"] == 2 and second["ok"], second


def _build_request() -> dict[str, Any]:
    parameters = initial_parameters(FIXTURE.config, 0)
    return {
        "id": 3,
        "op": "build",
        "config": encode_config(FIXTURE.config),
        "parameters": encode_parameters(parameters),
    }


def test_decoding_can_let_each_entry_go_once_decoded() -> None:
    message = _build_request()["parameters"]
    kept = decode_parameters(message)
    assert all(entry is not None for entry in message)
    consumed = decode_parameters(message, consume=True)
    assert message == [None] * len(kept)
    for (name, value), (same_name, same_value) in zip(kept, consumed, strict=True):
        assert name == same_name and np.array_equal(value, same_value)


def test_a_build_takes_its_parameters_out_of_the_request() -> None:
    server = reference_server.Server()
    request = _build_request()
    answer = server.answer_request(request)
    assert answer["ok"], answer
    assert "parameters" not in request
    handle = answer["result"]["model"]
    returned = server.answer_request({"id": 4, "op": "parameters", "model": handle})["result"]
    names = [name for name, _ in returned["parameters"]]
    assert names == [name for name, _ in parameter_layout(FIXTURE.config)]


def test_the_server_returns_freed_memory_after_large_lines_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trims: list[int] = []
    monkeypatch.setattr(reference_server, "return_freed_memory", lambda: trims.append(1))
    monkeypatch.setattr(reference_server, "_LARGE_LINE_BYTES", 1000)
    small = json.dumps({"id": 1, **HELLO})
    large_request = json.dumps({"id": 2, **HELLO, "padding": "x" * 2000})
    requests = "\n".join([small, large_request, small.replace("1", "3", 1)]) + "\n"
    sink = io.BytesIO()
    reference_server.Server().serve(io.BytesIO(requests.encode()), sink)
    assert len(sink.getvalue().splitlines()) == 3 and len(trims) == 1


BIG_ANSWER = (
    "import sys; sys.stdin.buffer.readline(); "
    'sys.stdout.write(\'  {"id": 1, "ok": true, "result": {"x": "\' + \'a\' * (32 << 20) '
    "+ '\"}}\\n'); sys.stdout.flush(); sys.stdin.buffer.readline()"
)


def test_an_answer_is_parsed_without_copies_of_its_whole_line() -> None:
    """A 32 MB answer: the old client copied the line to bytes, stripped a copy of it to see
    its first byte, and held the bytes while parsing the text (2.9 times the line at once);
    now the line arrives in one buffer, goes once the text is decoded, and the parsed answer
    shares nothing with it (2.1 times)."""
    process = BackendProcess([sys.executable, "-c", BIG_ANSWER])
    try:
        line_bytes = (32 << 20) + 46
        with _peak_growth() as growth:
            answer = process.exchange({"id": 1, **HELLO}, 60, limit=64 << 20)
    finally:
        process.stop()
    assert answer["ok"] and len(answer["result"]["x"]) == 32 << 20
    assert growth[0] < 2.5 * line_bytes, growth[0] / line_bytes


@pytest.mark.parametrize("size", [1, 150, 199, 200, 201, 399, 400, 401, 5000])
def test_a_line_kept_by_its_start_reads_as_the_whole_line_would(size: int) -> None:
    line = b"x" * (size - 1) + b"\n"
    whole, started = Tail(3, 200), Tail(3, 200)
    whole.feed(b"before\n" + line)
    started.feed(b"before\n")
    started.feed_line(line[:400], len(line))
    assert started.text() == whole.text()
