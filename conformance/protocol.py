"""The subprocess protocol's message encoding, shared by the client and the example server.

See ``PROTOCOL.md`` beside this file. Arrays travel as dtype, shape and base64 of their
little-endian C-order bytes, so every float64 arrives bit for bit; configuration reals
travel as ``{"float": float.hex(value)}`` for the same reason.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig

__all__ = [
    "PROTOCOL_NAME",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "decode_array",
    "decode_config",
    "decode_input",
    "decode_parameters",
    "encode_array",
    "encode_config",
    "encode_input",
    "encode_parameters",
    "parse_message",
]

PROTOCOL_NAME = "decoder-conformance"
PROTOCOL_VERSION = 1
_ARRAY_KINDS = "biuf"  # bool, signed, unsigned, floating: what a test may send or receive


class ProtocolError(ValueError):
    """A message that does not follow the protocol."""


def encode_array(values: npt.ArrayLike) -> dict[str, Any]:
    """``{"dtype", "shape", "data"}``: the array's exact bytes, little-endian, C order."""
    array = np.asarray(values)
    if array.dtype.kind not in _ARRAY_KINDS:
        raise ProtocolError(f"cannot send an array of dtype {array.dtype}")
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {
        "dtype": array.dtype.name,
        "shape": list(array.shape),
        "data": base64.b64encode(np.ascontiguousarray(little).tobytes()).decode("ascii"),
    }


def decode_array(message: object, what: str = "array") -> npt.NDArray[Any]:
    """The array an :func:`encode_array` message describes; a ``ProtocolError`` says why not."""
    if not isinstance(message, Mapping) or set(message) != {"dtype", "shape", "data"}:
        raise ProtocolError(
            f"{what} must be an object with dtype, shape and data, got {message!r:.200}"
        )
    try:
        dtype = np.dtype(message["dtype"]).newbyteorder("<")
        shape = tuple(int(size) for size in message["shape"])
        raw = base64.b64decode(message["data"], validate=True)
        if dtype.kind not in _ARRAY_KINDS:
            raise ProtocolError(f"{what} has unsupported dtype {message['dtype']!r}")
        return np.frombuffer(raw, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    except ProtocolError:
        raise
    except (TypeError, ValueError) as error:
        raise ProtocolError(f"{what} is not a valid array message: {error}") from None


def encode_input(values: object) -> dict[str, Any]:
    """Token or target IDs: an array message, or ``{"values": ...}`` for what no array holds.

    Malformed inputs (ragged rows, strings) must reach the backend too, so that the backend,
    not the transport, is the one that refuses them.
    """
    try:
        array = np.asarray(values)
    except ValueError:
        array = None
    if array is not None and array.dtype.kind in _ARRAY_KINDS:
        return encode_array(array)
    plain = array.tolist() if array is not None else _plain(values)
    return {"values": plain}


def _plain(values: object) -> object:
    if isinstance(values, np.ndarray):
        return values.tolist()
    if isinstance(values, list | tuple):
        return [_plain(item) for item in values]
    if isinstance(values, np.generic):
        return values.item()
    return values


def decode_input(message: object, what: str) -> Any:
    """The IDs an :func:`encode_input` message carries (an array, or plain JSON values)."""
    if isinstance(message, Mapping) and set(message) == {"values"}:
        return message["values"]
    return decode_array(message, what)


def encode_config(config: DecoderConfig) -> dict[str, Any]:
    """Every field by name; floats as hex strings, anything else as plain JSON."""
    encoded: dict[str, Any] = {}
    for field in fields(DecoderConfig):
        value = getattr(config, field.name)
        if isinstance(value, float | np.floating):
            encoded[field.name] = {"float": float(value).hex()}
        elif isinstance(value, np.integer):
            encoded[field.name] = int(value)
        else:
            encoded[field.name] = value
    return encoded


def decode_config(message: object) -> DecoderConfig:
    """The configuration an :func:`encode_config` message describes."""
    names = [field.name for field in fields(DecoderConfig)]
    if not isinstance(message, Mapping) or set(message) != set(names):
        raise ProtocolError(
            f"config must be an object with exactly the fields {names}, got {message!r:.200}"
        )
    values: dict[str, Any] = {}
    for name in names:
        value = message[name]
        if isinstance(value, Mapping) and set(value) == {"float"}:
            try:
                value = float.fromhex(str(value["float"]))
            except ValueError:
                raise ProtocolError(
                    f"config field {name}: {value['float']!r} is not a hex float"
                ) from None
        values[name] = value
    return DecoderConfig(**values)


def encode_parameters(parameters: Sequence[tuple[str, npt.ArrayLike]]) -> list[list[Any]]:
    """``[[name, array message], ...]`` in the given order."""
    return [[name, encode_array(value)] for name, value in parameters]


def decode_parameters(
    message: object, what: str = "parameters"
) -> list[tuple[str, npt.NDArray[Any]]]:
    """The named arrays of an :func:`encode_parameters` message."""
    if not isinstance(message, list):
        raise ProtocolError(f"{what} must be a list of [name, array] pairs")
    decoded = []
    for index, entry in enumerate(message):
        if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str):
            raise ProtocolError(f"{what}[{index}] must be [name, array], got {entry!r:.200}")
        decoded.append((entry[0], decode_array(entry[1], f"{what}[{index}]")))
    return decoded


def parse_message(line: str) -> dict[str, Any]:
    """One line of the protocol: a JSON object, or a ``ProtocolError`` quoting what arrived."""
    try:
        message = json.loads(line)
    except json.JSONDecodeError as error:
        raise ProtocolError(
            f"not JSON ({error.msg} at column {error.colno}): {line.strip()!r:.200}"
        ) from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a JSON object, got {line.strip()!r:.200}")
    return message
