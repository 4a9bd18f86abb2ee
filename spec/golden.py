"""Golden cases: the configurations every backend is compared with, and their file format.

A golden file holds one case's inputs and every expected number: each stage, the logits,
the loss and every parameter gradient. Each array is stored twice: as decimal ``repr``
values, one row per line, for review, and as the base64 of its exact float64 bytes with a
SHA-256, for integrity. A decimal that no longer matches its exact twin names the value that
was edited; a checksum over the whole file catches any other edit.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from spec.config import FIXTURE, DecoderConfig
from spec.variants import VARIANTS, scenario_parameters

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "GOLDEN_CASES",
    "GoldenCase",
    "GoldenError",
    "GoldenRecord",
    "case_by_name",
    "decode_record",
    "encode_record",
]

FORMAT = "decoder-conformance-golden"
FORMAT_VERSION = 1
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class GoldenCase:
    """One golden configuration, and the mistakes it is there to catch."""

    name: str
    config: DecoderConfig
    seed: int
    tokens: tuple[tuple[int, ...], ...]
    targets: tuple[tuple[int, ...], ...]
    catches: str
    variant: str = "recipe"  # the parameters: spec.variants.scenario_parameters

    def parameters(self) -> list[tuple[str, npt.NDArray[np.float64]]]:
        """The case's named parameters: the recipe's for its seed, or a variant of them."""
        return scenario_parameters(self.config, self.seed, self.variant)


def _case(
    name: str,
    config: DecoderConfig,
    seed: int,
    tokens: list[list[int]],
    targets: list[list[int]],
    *,
    catches: str,
    variant: str = "recipe",
) -> GoldenCase:
    return GoldenCase(
        name, config, seed, tuple(map(tuple, tokens)), tuple(map(tuple, targets)), catches, variant
    )


GOLDEN_CASES: tuple[GoldenCase, ...] = (
    _case(
        "seed-fixture",
        FIXTURE.config,
        FIXTURE.seed,
        [[0, 1, 2]],
        [[1, 2, 3]],
        catches="the seed's published two-block fixture",
    ),
    _case(
        "depth0-single-token",
        DecoderConfig(6, 4, 1, 3, 0, 3),
        0,
        [[5]],
        [[2]],
        catches="zero blocks, one token: lookup, final norm and the tied head alone",
    ),
    _case(
        "depth0-batch3-full-context",
        DecoderConfig(7, 8, 2, 12, 0, 4),
        2**64 - 1,
        [[0, 1, 2, 3], [6, 6, 5, 4], [3, 0, 3, 0]],
        [[1, 2, 3, 4], [6, 5, 4, 3], [0, 3, 0, 3]],
        catches="batch rows kept apart at depth 0; seed 2^64 - 1",
    ),
    _case(
        "depth1-four-heads-hw2",
        DecoderConfig(9, 8, 4, 6, 1, 5),
        1,
        [[8, 0, 4, 4, 1], [2, 5, 6, 3, 7]],
        [[0, 4, 4, 1, 7], [5, 6, 3, 7, 8]],
        catches="head split and merge, four heads of width 2; feed-forward narrower than d",
    ),
    _case(
        "depth1-one-head-hw8",
        DecoderConfig(5, 8, 1, 16, 1, 6),
        7,
        [[4, 1, 3]],
        [[1, 3, 0]],
        catches="one head of width 8: four RoPE frequencies; sequence shorter than the context",
    ),
    _case(
        "depth2-three-heads-hw6",
        DecoderConfig(11, 18, 3, 12, 2, 4),
        2**63,
        [[10, 0, 5, 5], [1, 2, 3, 4]],
        [[0, 5, 5, 9], [2, 3, 4, 5]],
        catches="three heads of width 6: odd pair counts per head",
    ),
    _case(
        "depth2-ffn-narrow-full-context",
        DecoderConfig(8, 12, 2, 4, 2, 7),
        12345,
        [[0, 1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7, 7], [3, 1, 4, 1, 5, 2, 6]],
        [[1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 0, 0], [1, 4, 1, 5, 2, 6, 5]],
        catches="seven positions: RoPE angles far from zero; repeated tokens",
    ),
    _case(
        "depth3-hw4-two-tokens",
        DecoderConfig(6, 12, 3, 20, 3, 5),
        2**64 - 1,
        [[5, 0], [2, 2]],
        [[0, 1], [2, 3]],
        catches="three blocks with distinct weights; two positions",
    ),
    _case(
        "depth3-two-heads-hw8-full-context",
        DecoderConfig(10, 16, 2, 24, 3, 6),
        0,
        [[9, 8, 7, 6, 5, 4]],
        [[8, 7, 6, 5, 4, 3]],
        catches="deepest and widest case; seed 0",
    ),
    _case(
        "rope-base-10",
        DecoderConfig(5, 8, 2, 8, 2, 8, rope_base=10.0),
        99,
        [[0, 1, 2, 3, 4, 0, 1, 2], [4, 3, 2, 1, 0, 4, 3, 2]],
        [[1, 2, 3, 4, 0, 1, 2, 3], [3, 2, 1, 0, 4, 3, 2, 1]],
        catches="a small RoPE base: many full turns, so a wrong frequency shows",
    ),
    _case(
        "epsilon-zero",
        DecoderConfig(6, 8, 2, 8, 1, 4, rms_epsilon=0.0),
        5,
        [[1, 2, 3], [4, 5, 0]],
        [[2, 3, 4], [5, 0, 1]],
        catches="RMSNorm epsilon 0",
    ),
    _case(
        "epsilon-large",
        DecoderConfig(7, 4, 2, 4, 2, 5, rms_epsilon=0.25),
        77,
        [[6, 5, 4, 3, 2]],
        [[5, 4, 3, 2, 1]],
        catches="a large epsilon makes its placement inside the root visible",
    ),
    _case(
        "vocabulary-one",
        DecoderConfig(1, 4, 2, 2, 1, 3),
        3,
        [[0, 0, 0], [0, 0, 0]],
        [[0, 0, 0], [0, 0, 0]],
        catches="one-token vocabulary: the loss is exactly zero and so is the output-role gradient",
    ),
    _case(
        "wide-vocabulary",
        DecoderConfig(64, 8, 4, 8, 1, 4),
        2024,
        [[63, 0, 31, 32], [1, 62, 2, 61]],
        [[0, 31, 32, 63], [62, 2, 61, 1]],
        catches="most table rows are never looked up: their gradient is output-role only",
    ),
    _case(
        "varied-gains",
        DecoderConfig(6, 8, 2, 12, 2, 4, rope_base=100.0),
        419,
        [[5, 0, 3, 1], [2, 2, 4, 0]],
        [[0, 3, 1, 2], [2, 4, 0, 5]],
        catches="gains of either sign away from 1 and rescaled matrices: a gain applied twice, "
        "on the wrong side of a residual, or a norm stage reported before its gain",
        variant="varied",
    ),
    _case(
        "large-logits",
        DecoderConfig(9, 8, 2, 8, 1, 4),
        1000,
        [[8, 1, 7, 2], [3, 6, 4, 5]],
        [[1, 7, 2, 0], [6, 4, 5, 3]],
        catches="logits in the thousands (a final gain of 1000): a loss that does not subtract "
        "the row maximum overflows to inf",
        variant="large",
    ),
)


class GoldenError(ValueError):
    """A golden file that is malformed, edited by hand, or not what its case says."""

    def __init__(self, source: str, case: str, what: str) -> None:
        super().__init__(f"{source}: case {case}: {what}")
        self.source, self.case, self.what = source, case, what


@dataclass
class GoldenRecord:
    """One case and every expected number, as the reference produced them."""

    case: GoldenCase
    stages: list[tuple[str, FloatArray]]
    logits: FloatArray
    loss: float
    gradients: list[tuple[str, FloatArray]]
    provenance: dict[str, str] = field(default_factory=dict)


def _exact(values: FloatArray) -> tuple[str, str]:
    raw = np.ascontiguousarray(values, dtype="<f8").tobytes()
    return base64.b64encode(raw).decode("ascii"), hashlib.sha256(raw).hexdigest()


def _array(values: FloatArray) -> dict[str, Any]:
    exact, digest = _exact(values)
    return {
        "shape": list(values.shape),
        "values": np.asarray(values, dtype=np.float64).tolist(),
        "exact": exact,
        "sha256": digest,
    }


def _config(config: DecoderConfig) -> dict[str, Any]:
    return {name: value for name, value in config.as_dict().items()}


def _payload(record: GoldenRecord) -> dict[str, Any]:
    case = record.case
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "provenance": dict(record.provenance),
        "case": {
            "name": case.name,
            "catches": case.catches,
            "config": _config(case.config),
            "seed": str(case.seed),
            "tokens": [list(row) for row in case.tokens],
            "targets": [list(row) for row in case.targets],
            # Only a variant is written, so files of the recipe's parameters keep their bytes.
            **({"variant": case.variant} if case.variant != "recipe" else {}),
        },
        "expected": {
            "stages": [{"name": name, **_array(values)} for name, values in record.stages],
            "logits": _array(record.logits),
            "loss": _array(np.asarray(record.loss, dtype=np.float64)),
            "gradients": [{"name": name, **_array(values)} for name, values in record.gradients],
        },
    }


def _checksum(payload: dict[str, Any]) -> str:
    """SHA-256 of everything but the decimals (those are checked against their exact twins)."""

    def without_decimals(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: without_decimals(value) for key, value in node.items() if key != "values"}
        if isinstance(node, list):
            return [without_decimals(item) for item in node]
        return node

    canonical = json.dumps(without_decimals(payload), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _render(node: Any, indent: int = 0) -> str:
    """JSON with every innermost list of numbers on one line, so a diff shows rows."""
    pad = " " * indent
    if isinstance(node, dict):
        if not node:
            return "{}"
        items = [
            f"{pad}  {json.dumps(key)}: {_render(value, indent + 2)}" for key, value in node.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(node, list) and node and all(isinstance(item, list) for item in node):
        rows = [f"{pad}  {_render(item, indent + 2)}" for item in node]
        return "[\n" + ",\n".join(rows) + f"\n{pad}]"
    if isinstance(node, list) and any(isinstance(item, dict) for item in node):
        rows = [f"{pad}  {_render(item, indent + 2)}" for item in node]
        return "[\n" + ",\n".join(rows) + f"\n{pad}]"
    return json.dumps(node, allow_nan=False)


def encode_record(record: GoldenRecord) -> str:
    """The golden file's text: the payload and its checksum."""
    payload = _payload(record)
    payload["checksum"] = _checksum(payload)
    return _render(payload) + "\n"


class _DecimalText(str):
    """A JSON number kept exactly as written, so an edit that rounds to the same float shows."""


def _as_numbers(node: Any) -> Any:
    """The parsed payload with every kept decimal turned back into a float."""
    if isinstance(node, _DecimalText):
        return float(node)
    if isinstance(node, dict):
        return {key: _as_numbers(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_as_numbers(item) for item in node]
    return node


def _flat_texts(node: Any) -> list[str]:
    if isinstance(node, list):
        return [text for item in node for text in _flat_texts(item)]
    return [str(node)]


def _decode_array(entry: Any, source: str, case: str, what: str) -> FloatArray:
    try:
        shape = tuple(int(size) for size in entry["shape"])
        raw = base64.b64decode(entry["exact"], validate=True)
        exact = np.frombuffer(raw, dtype="<f8").astype(np.float64)
        texts = _flat_texts(entry["values"])
        digest = str(entry["sha256"])
    except (KeyError, TypeError, ValueError) as error:
        raise GoldenError(source, case, f"{what} is malformed ({error})") from None
    if exact.size != int(np.prod(shape)) or len(texts) != exact.size:
        detail = f"{what} holds {len(texts)} values for shape {list(shape)}"
        raise GoldenError(source, case, detail)
    if hashlib.sha256(raw).hexdigest() != digest:
        detail = f"{what}: its exact bytes do not match their SHA-256 (edited by hand?)"
        raise GoldenError(source, case, detail)
    for position, (text, value) in enumerate(zip(texts, exact.tolist(), strict=True)):
        if text != repr(value):
            index = [int(i) for i in np.unravel_index(position, shape)] if shape else []
            detail = (
                f"{what}{index} reads {text}, but its exact value is {value!r} (edited by hand?)"
            )
            raise GoldenError(source, case, detail)
    return exact.reshape(shape)


def _object(node: Any, source: str, case: str, what: str) -> dict[str, Any]:
    if not isinstance(node, dict):
        raise GoldenError(
            source, case, f"{what} is malformed (a {type(node).__name__}, not an object)"
        )
    return node


def _entries(node: Any, source: str, case: str, what: str) -> list[dict[str, Any]]:
    if not isinstance(node, list) or not all(isinstance(item, dict) for item in node):
        raise GoldenError(source, case, f"{what} is malformed (not a list of objects)")
    return node


# What hostile text can raise while it is parsed and verified, besides GoldenError: nesting
# deeper than the interpreter's stack (RecursionError, in json or in the walks below), an
# integer of more digits than int() converts (ValueError), a value of the wrong type where a
# number, list or object belongs.
_PARSE_FAILURES = (RecursionError, ValueError, TypeError, KeyError, IndexError, OverflowError)


def decode_record(text: str, source: str = "<golden>") -> GoldenRecord:
    """Parse and verify a golden file; a :class:`GoldenError` names the file, case and value.

    Whatever the text, the only exception is a GoldenError, so a check reports any file it
    cannot read as hand-edited instead of crashing on it.
    """
    try:
        return _decode_record(text, source)
    except GoldenError:
        raise
    except RecursionError:
        raise GoldenError(source, "?", "not a golden file (nested too deeply)") from None
    except _PARSE_FAILURES as error:
        detail = f"not a golden file ({type(error).__name__}: {error})"
        raise GoldenError(source, "?", detail) from None


def _decode_record(text: str, source: str) -> GoldenRecord:
    try:
        payload = json.loads(text, parse_float=_DecimalText)
    except json.JSONDecodeError as error:
        raise GoldenError(source, "?", f"not JSON ({error.msg} at line {error.lineno})") from None
    except RecursionError:
        raise GoldenError(source, "?", "not JSON this suite reads (nested too deeply)") from None
    except ValueError as error:  # an integer of more digits than Python converts
        raise GoldenError(source, "?", f"not JSON this suite reads ({error})") from None
    if not isinstance(payload, dict):
        raise GoldenError(source, "?", f"not a JSON object (a {type(payload).__name__})")
    case_entry = _object(payload.get("case", {}), source, "?", "case")
    name = str(case_entry.get("name", "?"))
    if payload.get("format") != FORMAT or payload.get("format_version") != FORMAT_VERSION:
        found = f"format {payload.get('format')!r} version {payload.get('format_version')!r}"
        wanted = f"this suite reads {FORMAT!r} version {FORMAT_VERSION}"
        raise GoldenError(source, name, f"{found}, but {wanted}")
    expected = _object(payload.get("expected", {}), source, name, "expected")
    stages = [
        (str(s.get("name")), _decode_array(s, source, name, f"stage {s.get('name')}"))
        for s in _entries(expected.get("stages", []), source, name, "stages")
    ]
    logits = _decode_array(expected.get("logits"), source, name, "logits")
    loss = _decode_array(expected.get("loss"), source, name, "loss")
    gradients = [
        (str(g.get("name")), _decode_array(g, source, name, f"gradient of {g.get('name')}"))
        for g in _entries(expected.get("gradients", []), source, name, "gradients")
    ]
    checksum = payload.pop("checksum", None)
    if checksum != _checksum(_as_numbers(payload)):
        raise GoldenError(
            source,
            name,
            "the file's checksum does not match its content (case, provenance or layout edited)",
        )
    try:
        case = GoldenCase(
            name=name,
            config=DecoderConfig(**_as_numbers(case_entry["config"])),
            seed=int(case_entry["seed"]),
            tokens=tuple(tuple(int(t) for t in row) for row in case_entry["tokens"]),
            targets=tuple(tuple(int(t) for t in row) for row in case_entry["targets"]),
            catches=str(case_entry.get("catches", "")),
            variant=str(case_entry.get("variant", "recipe")),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise GoldenError(source, name, f"case inputs are malformed ({error})") from None
    if case.variant not in VARIANTS:
        raise GoldenError(
            source, name, f"case variant {case.variant!r:.40} is not one of {VARIANTS}"
        )
    provenance_entry = _object(payload.get("provenance", {}), source, name, "provenance")
    provenance = {str(k): str(v) for k, v in provenance_entry.items()}
    return GoldenRecord(case, stages, logits, float(loss), gradients, provenance)


def case_by_name(name: str, cases: Sequence[GoldenCase] = GOLDEN_CASES) -> GoldenCase:
    """The golden case of that name."""
    for case in cases:
        if case.name == name:
            return case
    raise KeyError(f"no golden case {name!r}; known: {', '.join(c.name for c in cases)}")
