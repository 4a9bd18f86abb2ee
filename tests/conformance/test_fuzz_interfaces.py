"""Fuzzing the command line and the protocol server: one clear error, never a crash.

The command line answers every bad option with one line on stderr and status 2; the
reference server answers every malformed request with a protocol error or the spec kind of
a refused input. Run them harder with ``HYPOTHESIS_PROFILE=thorough``.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st

from conformance.adapters.reference_server import Server
from conformance.cli import main
from conformance.protocol import encode_array, encode_config, encode_parameters
from spec.config import FIXTURE
from spec.errors import ErrorKind
from spec.recipe import initial_parameters

CONFIG = FIXTURE.config


option_values = st.sampled_from(
    ["0", "1", "3", "-1", "x", "", "1e3", "nan", "inf", "99999999999", "4.5"]
)


@given(
    arguments=st.lists(
        st.one_of(
            st.tuples(
                st.sampled_from(
                    ["--vocab", "--width", "--heads", "--ffn", "--layers", "--context", "--seed"]
                ),
                option_values,
            ),
            st.tuples(st.sampled_from(["--rope-base", "--epsilon"]), option_values),
            st.tuples(
                st.sampled_from(["--tokens", "--targets"]),
                st.sampled_from(["0,1,2", "0,1;2", "", "a", "1,2,3;3,2,1", "9,9,9"]),
            ),
            st.tuples(st.sampled_from(["--format"]), st.sampled_from(["json", "text", "xml"])),
            st.tuples(st.sampled_from(["--bogus"]), option_values),
        ),
        max_size=4,
    )
)
def test_command_line_trace(arguments: list[tuple[str, str]]) -> None:
    argv = ["trace"] + [part for pair in arguments for part in pair]
    sizes = {
        flag: value
        for flag, value in arguments
        if flag in ("--vocab", "--width", "--ffn", "--layers", "--context")
    }
    assume(all(not value.isdigit() or int(value) <= 1000 for value in sizes.values()))
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        status = main(argv)
    assert status in (0, 2), f"exit status {status} for {argv}"
    if status == 2:
        assert stderr.getvalue().count("\n") == 1 and stderr.getvalue().startswith(
            "decoder-conformance"
        )
        assert stdout.getvalue() == ""
    else:
        assert stdout.getvalue() and stderr.getvalue() == ""


def _valid_requests() -> list[dict[str, Any]]:
    return [
        {"id": 1, "op": "hello", "protocol": "decoder-conformance", "version": 1},
        {
            "id": 2,
            "op": "build",
            "config": encode_config(CONFIG),
            "parameters": encode_parameters(initial_parameters(CONFIG, 1)),
        },
        {
            "id": 3,
            "op": "forward",
            "model": 1,
            "tokens": encode_array(np.asarray(FIXTURE.tokens)),
            "shape": None,
        },
        {
            "id": 4,
            "op": "loss",
            "model": 1,
            "tokens": encode_array(np.asarray(FIXTURE.tokens)),
            "targets": encode_array(np.asarray(FIXTURE.targets)),
            "detach_lookup": False,
            "detach_head": False,
        },
        {"id": 5, "op": "build_seeded", "config": encode_config(CONFIG), "seed": "7"},
        {"id": 6, "op": "initialize", "config": encode_config(CONFIG), "stream_state": "7"},
    ]


def _mangle(request: dict[str, Any], data: st.DataObject) -> str:
    line = json.dumps(request)
    choice = data.draw(
        st.sampled_from(
            [
                "truncate",
                "field-type",
                "drop-field",
                "unknown-op",
                "version",
                "not-object",
                "bad-array",
            ]
        )
    )
    if choice == "truncate":
        return line[: data.draw(st.integers(0, len(line) - 1))]
    mangled = dict(request)
    if choice == "field-type":
        field = data.draw(st.sampled_from(sorted(mangled)))
        mangled[field] = data.draw(st.sampled_from([None, "x", 1.5, [], {}, True, -1]))
    elif choice == "drop-field":
        mangled.pop(data.draw(st.sampled_from(sorted(mangled))))
    elif choice == "unknown-op":
        mangled["op"] = data.draw(st.sampled_from(["fly", "", "FORWARD"]))
    elif choice == "version":
        mangled.update({"op": "hello", "version": data.draw(st.sampled_from([0, 2, "1"]))})
    elif choice == "not-object":
        return json.dumps(data.draw(st.sampled_from([[1, 2], "hello", 3, None])))
    else:
        for field in ("tokens", "targets", "parameters", "config"):
            if field in mangled:
                mangled[field] = data.draw(
                    st.sampled_from(
                        [
                            {"dtype": "float64", "shape": [2], "data": "!!"},
                            {"dtype": "complex128", "shape": [], "data": ""},
                            {"values": [[0, 1], [2]]},
                            {"shape": [1]},
                        ]
                    )
                )
    return json.dumps(mangled)


@given(data=st.data())
def test_protocol_messages(data: st.DataObject) -> None:
    server = Server()
    for request in _valid_requests()[:2]:
        assert server.answer(json.dumps(request))["ok"], request["op"]
    request = data.draw(st.sampled_from(_valid_requests()))
    line = _mangle(request, data)
    response = server.answer(line)  # must not raise
    json.dumps(response, allow_nan=False)  # must be sendable
    if not response["ok"]:
        error = response["error"]
        assert error["kind"] == "protocol" or error["kind"] in {str(k) for k in ErrorKind}
        assert error["message"]
    else:
        # Only a mangling that left a valid request may succeed.
        parsed = json.loads(line)
        assert isinstance(parsed, dict) and parsed.get("op") in {
            "hello",
            "build",
            "forward",
            "loss",
            "build_seeded",
            "initialize",
        }


def test_fields_named_in_protocol_errors() -> None:
    server = Server()
    response = server.answer(
        json.dumps({"id": 1, "op": "build_seeded", "config": encode_config(CONFIG), "seed": -4})
    )
    assert response["error"]["kind"] == "protocol"
    assert (
        "request field 'seed' must be the decimal string" in response["error"]["message"]
        and "-4" in response["error"]["message"]
    )
    response = server.answer('{"id": 1, "op": "forw')
    assert response["error"]["kind"] == "protocol" and "not JSON" in response["error"]["message"]
    response = server.answer(
        json.dumps({"id": 2, "op": "hello", "protocol": "decoder-conformance", "version": 2})
    )
    assert (
        "speaks decoder-conformance version 1, not 'decoder-conformance' version 2"
        in response["error"]["message"]
    )
