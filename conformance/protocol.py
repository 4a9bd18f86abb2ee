"""The subprocess protocol's message encoding, shared by the client and the example server.

See ``PROTOCOL.md`` beside this file. Arrays travel as dtype, shape and base64 of their
little-endian C-order bytes, so every float64 arrives bit for bit; configuration reals
travel as ``{"float": float.hex(value)}`` for the same reason.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig

__all__ = [
    "LINE_PIECE_BYTES",
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
    "line_pieces",
    "parse_message",
    "printable",
]

PROTOCOL_NAME = "decoder-conformance"
PROTOCOL_VERSION = 1
# Bool, signed, unsigned, floating and complex: what a test may send (complex and bool only
# to be refused, as parameter values) or receive.
_ARRAY_KINDS = "biufc"
# Bounds no legitimate message comes near; past them a message is refused before anything
# is allocated for it.
MAX_RANK = 8
MAX_ELEMENTS = 1 << 36
MAX_NAME_LENGTH = 200
# Control characters (terminal escapes, carriage returns, bidirectional overrides) that a
# backend's text must not smuggle into a terminal or a Markdown table.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069]")
# A line is written in pieces of about this many bytes: a build request at SmolLM2-135M's
# shape is one line of 1.58 GB, and made whole, as text and then as bytes, it was the largest
# allocation of both processes.
LINE_PIECE_BYTES = 1 << 22


class ProtocolError(ValueError):
    """A message that does not follow the protocol."""


def printable(text: str, *, one_line: bool = False) -> str:
    """``text`` with every control character written as an escape (``\\x1b``); newlines and
    tabs stay unless ``one_line``."""
    escaped = _UNPRINTABLE.sub(lambda match: ascii(match.group())[1:-1], text)
    if one_line:
        escaped = escaped.replace("\n", "\\n").replace("\t", "\\t")
    return escaped


def _size(value: object, what: str) -> int:
    """A JSON integer that can be an array size (not a bool, a float or a huge number)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_ELEMENTS:
        raise ProtocolError(f"{what} must be an integer from 0 to 2**36, got {value!r:.60}")
    return value


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
    """The array an :func:`encode_array` message describes; a ``ProtocolError`` names the
    field that is wrong. Every field is checked before anything is allocated."""
    if not isinstance(message, Mapping) or set(message) != {"dtype", "shape", "data"}:
        raise ProtocolError(
            f"{what} must be an object with exactly dtype, shape and data, "
            f"got {printable(repr(message), one_line=True):.200}"
        )
    name, shape_field, data = message["dtype"], message["shape"], message["data"]
    if not isinstance(name, str) or len(name) > 16:
        raise ProtocolError(f"{what}.dtype must be a numpy dtype name, got {name!r:.60}")
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise ProtocolError(f"{what}.dtype {name!r} is not a numpy dtype") from None
    if dtype.kind not in _ARRAY_KINDS:
        raise ProtocolError(f"{what}.dtype {name!r} is not bool, integer, floating or complex")
    if not isinstance(shape_field, list) or len(shape_field) > MAX_RANK:
        raise ProtocolError(
            f"{what}.shape must be a list of at most {MAX_RANK} sizes, got {shape_field!r:.60}"
        )
    shape = tuple(_size(size, f"{what}.shape[{i}]") for i, size in enumerate(shape_field))
    elements = math.prod(shape)
    if elements > MAX_ELEMENTS:
        raise ProtocolError(f"{what}.shape {list(shape)} holds more than 2**36 elements")
    if not isinstance(data, str):
        raise ProtocolError(f"{what}.data must be a base64 string, got {type(data).__name__}")
    expected = elements * dtype.itemsize
    if len(data) != 4 * math.ceil(expected / 3):
        raise ProtocolError(
            f"{what}.data holds {len(data)} base64 characters, but shape {list(shape)} of "
            f"{dtype.name} needs {4 * math.ceil(expected / 3)} ({expected} bytes)"
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ProtocolError(f"{what}.data is not base64: {error}") from None
    if len(raw) != expected:
        raise ProtocolError(f"{what}.data decodes to {len(raw)} bytes, not {expected}")
    little = dtype.newbyteorder("<")
    return np.frombuffer(raw, dtype=little).reshape(shape).astype(little.newbyteorder("="))


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
    message: object, what: str = "parameters", *, consume: bool = False
) -> list[tuple[str, npt.NDArray[Any]]]:
    """The named arrays of an :func:`encode_parameters` message. With ``consume``, each
    entry of the message list is replaced by None once decoded, so its base64 text can go
    while the rest is decoded (a build at a scale shape carries 1.44 GB of it)."""
    if not isinstance(message, list):
        raise ProtocolError(f"{what} must be a list of [name, array] pairs")
    decoded = []
    for index, entry in enumerate(message):
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not isinstance(entry[0], str)
            or len(entry[0]) > MAX_NAME_LENGTH
        ):
            raise ProtocolError(
                f"{what}[{index}] must be [name, array] with a name of at most "
                f"{MAX_NAME_LENGTH} characters, got {printable(repr(entry), one_line=True):.200}"
            )
        decoded.append((entry[0], decode_array(entry[1], f"{what}[{index}]")))
        if consume:
            message[index] = None
    return decoded


def _finite_number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError(f"the number {text:.40} is outside the float64 range")
    return value


def _no_constant(text: str) -> float:
    raise ProtocolError(f"{text} is not JSON (the protocol sends non-finite floats as hex)")


def line_pieces(message: dict[str, Any]) -> Iterator[bytes]:
    """``message`` as one protocol line (JSON in ASCII, then a newline), in pieces of about
    :data:`LINE_PIECE_BYTES`: no copy of the whole line is made. Checked before any piece
    exists: a value JSON cannot hold (a non-finite float, an object) raises ``ValueError`` or
    ``TypeError`` from this call, so a caller that has not begun writing has written nothing."""
    try:
        json.dumps(_outline(message), allow_nan=False)
    except RecursionError:  # what json.dumps itself says of a circular message
        raise ValueError("the message is circular or nested too deeply for JSON") from None
    return _pieces(message)


def _outline(value: object) -> object:
    """``value`` with every string emptied: whatever JSON could refuse in it, in a few bytes
    (strings it cannot refuse: ``ensure_ascii`` escapes any character)."""
    if isinstance(value, str):
        return ""
    if isinstance(value, dict):  # another mapping stays, for json.dumps to refuse as it would
        return {key: _outline(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_outline(item) for item in value]
    return value


def _pieces(message: dict[str, Any]) -> Iterator[bytes]:
    waiting: list[str] = []
    waiting_size = 0
    for text in json.JSONEncoder(allow_nan=False).iterencode(message):
        if len(text) >= LINE_PIECE_BYTES:  # an array's base64: sent in slices, not copied whole
            if waiting:
                yield "".join(waiting).encode("ascii")
                waiting, waiting_size = [], 0
            for start in range(0, len(text), LINE_PIECE_BYTES):
                yield text[start : start + LINE_PIECE_BYTES].encode("ascii")
            continue
        waiting.append(text)
        waiting_size += len(text)
        if waiting_size >= LINE_PIECE_BYTES:
            yield "".join(waiting).encode("ascii")
            waiting, waiting_size = [], 0
    waiting.append("\n")
    yield "".join(waiting).encode("ascii")


def parse_message(line: str) -> dict[str, Any]:
    """One line of the protocol: a JSON object, or a ``ProtocolError`` quoting what arrived
    (malformed JSON, nesting too deep to parse, numbers too long or outside float64)."""
    # Quoted from its start only: a message can be gigabytes (a build at a scale shape).
    quoted = f"{printable(line[:400].strip(), one_line=True)!r:.200}"
    try:
        message = json.loads(line, parse_float=_finite_number, parse_constant=_no_constant)
    except ProtocolError as error:
        raise ProtocolError(f"not valid JSON: {error}: {quoted}") from None
    except json.JSONDecodeError as error:
        raise ProtocolError(f"not JSON ({error.msg} at column {error.colno}): {quoted}") from None
    except RecursionError:
        raise ProtocolError(f"not JSON a decoder can read (nested too deeply): {quoted}") from None
    except ValueError as error:  # an integer of thousands of digits
        raise ProtocolError(f"not valid JSON ({error}): {quoted}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a JSON object, got {quoted}")
    return message
