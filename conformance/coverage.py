"""What the suite sent: the inputs a run actually exercised, recorded as it runs.

A rule can only catch what its inputs expose: a gain applied twice passes while every gain is
1, a loss without the max-subtraction passes while every logit is small, a missing refusal
passes while its input is never sent. So the run records, at the two places every request
passes through (the guarded backend for calls, the judge for expected refusals):

- the error kinds the suite asked a backend to refuse;
- the token inputs sent (dtype names, ``ragged`` and ``strings`` for what no array holds) and
  the parameter dtypes;
- how many models had RMSNorm gains other than 1, and how many had all gains 1;
- the largest finite ``|logit|`` a backend returned;
- the longest sequence that ran (its last position is the largest RoPE position);
- the range of each configuration size and the RoPE bases and epsilons that ran.

Each process keeps one :data:`RECORDER`; each test's share travels to the controller in the
test report (``user_properties``), so ``-n N`` adds up to the same figures.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from spec.config import DecoderConfig
from spec.errors import ADAPTER_KINDS, ErrorKind
from spec.parameters import is_gain_name

__all__ = ["PROPERTY", "RECORDER", "InputCoverage", "render_coverage"]

PROPERTY = "input_coverage"  # the key of a test report's user property
_SIZES = ("vocabulary_size", "model_width", "heads", "feed_forward_width", "layers", "context")


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe_ids(values: object) -> str:
    """A token or target input's kind: its dtype name, or what no array can hold."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "US":
        return "strings"
    if isinstance(values, np.ndarray):
        return "objects" if values.dtype.kind == "O" else str(values.dtype.name)
    try:
        array = np.asarray(values)
    except (ValueError, TypeError):
        return "ragged"
    if array.dtype.kind in "US":
        return "strings"
    if array.dtype.kind == "O":
        return "ragged"
    return f"list of {array.dtype.name}" if array.size else "empty list"


@dataclass
class InputCoverage:
    """Counts and extremes of what one process (or, merged, one run) sent and got back."""

    calls: Counter[str] = field(default_factory=Counter)
    kinds_requested: Counter[str] = field(default_factory=Counter)
    token_inputs: Counter[str] = field(default_factory=Counter)
    parameter_dtypes: Counter[str] = field(default_factory=Counter)
    models_with_other_gains: int = 0
    models_with_unit_gains: int = 0
    largest_logit: float = 0.0
    longest_sequence: int = 0
    size_ranges: dict[str, list[int]] = field(default_factory=dict)
    rope_bases: set[float] = field(default_factory=set)
    rms_epsilons: set[float] = field(default_factory=set)

    # ------------------------------------------------------------------ recording
    def requested(self, kind: ErrorKind) -> None:
        self.kinds_requested[str(kind)] += 1

    def call(self, method: str, arguments: Sequence[Any]) -> None:
        self.calls[method] += 1
        if method in ("forward", "loss") and len(arguments) > 1:
            self.token_inputs[_describe_ids(arguments[1])] += 1
        if method == "build" and len(arguments) > 1:
            self._parameters(arguments[1])

    def _parameters(self, entries: object) -> None:
        if not isinstance(entries, Iterable):
            return
        unit = True
        for entry in entries:
            if not (isinstance(entry, tuple | list) and len(entry) == 2):
                continue
            name, value = entry
            try:
                array = np.asarray(value)
            except (ValueError, TypeError):
                self.parameter_dtypes["ragged"] += 1
                continue
            self.parameter_dtypes[array.dtype.name] += 1
            if isinstance(name, str) and is_gain_name(name) and array.dtype.kind in "iuf":
                unit = unit and bool(np.all(array == 1))
        if unit:
            self.models_with_unit_gains += 1
        else:
            self.models_with_other_gains += 1

    def built(self, method: str, arguments: Sequence[Any]) -> None:
        """A build that succeeded: its configuration counts as run (seeded builds' gains are
        the recipe's ones)."""
        config = arguments[0] if arguments else None
        if not isinstance(config, DecoderConfig):
            return
        sizes = {name: getattr(config, name) for name in _SIZES}
        width, heads = sizes["model_width"], sizes["heads"]
        if _is_count(width) and _is_count(heads) and heads > 0 and width % heads == 0:
            sizes["head_width"] = width // heads  # only where the config is valid there
        for name, value in sizes.items():
            if _is_count(value):
                low, high = self.size_ranges.get(name, [value, value])
                self.size_ranges[name] = [min(low, value), max(high, value)]
        if isinstance(config.rope_base, float) and math.isfinite(config.rope_base):
            self.rope_bases.add(config.rope_base)
        if isinstance(config.rms_epsilon, float) and math.isfinite(config.rms_epsilon):
            self.rms_epsilons.add(config.rms_epsilon)
        if method in ("build_seeded", "initialize"):
            self.models_with_unit_gains += 1

    def answered(self, method: str, arguments: Sequence[Any], result: Any) -> None:
        if method == "forward":
            logits = np.asarray(getattr(result, "logits", None))
            if logits.dtype.kind == "f" and logits.size:
                finite = np.abs(logits[np.isfinite(logits)])
                if finite.size:
                    self.largest_logit = max(self.largest_logit, float(finite.max()))
        if method in ("forward", "loss") and len(arguments) > 1:
            shape = np.shape(arguments[1]) if isinstance(arguments[1], np.ndarray) else ()
            if len(shape) == 2:
                self.longest_sequence = max(self.longest_sequence, int(shape[1]))

    # ------------------------------------------------------------ moving around
    def take(self) -> dict[str, Any]:
        """This record as plain JSON values, and a fresh start."""
        plain = self.as_dict()
        self.__init__()  # type: ignore[misc]
        return plain

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": dict(sorted(self.calls.items())),
            "kinds_requested": dict(sorted(self.kinds_requested.items())),
            "token_inputs": dict(sorted(self.token_inputs.items())),
            "parameter_dtypes": dict(sorted(self.parameter_dtypes.items())),
            "models_with_other_gains": self.models_with_other_gains,
            "models_with_unit_gains": self.models_with_unit_gains,
            "largest_logit": self.largest_logit,
            "longest_sequence": self.longest_sequence,
            "largest_position": max(self.longest_sequence - 1, 0),
            "size_ranges": dict(sorted(self.size_ranges.items())),
            "rope_bases": sorted(self.rope_bases),
            "rms_epsilons": sorted(self.rms_epsilons),
        }

    def merge(self, other: Mapping[str, Any]) -> None:
        """Add another record (an :meth:`as_dict`), as a worker's share arrives."""
        for name in ("calls", "kinds_requested", "token_inputs", "parameter_dtypes"):
            getattr(self, name).update(other.get(name, {}))
        self.models_with_other_gains += int(other.get("models_with_other_gains", 0))
        self.models_with_unit_gains += int(other.get("models_with_unit_gains", 0))
        self.largest_logit = max(self.largest_logit, float(other.get("largest_logit", 0.0)))
        self.longest_sequence = max(self.longest_sequence, int(other.get("longest_sequence", 0)))
        for name, (low, high) in other.get("size_ranges", {}).items():
            mine = self.size_ranges.get(name, [low, high])
            self.size_ranges[name] = [min(mine[0], low), max(mine[1], high)]
        self.rope_bases.update(other.get("rope_bases", []))
        self.rms_epsilons.update(other.get("rms_epsilons", []))

    def missing_kinds(self) -> list[str]:
        """The adapter-facing error kinds no test asked for."""
        return [str(kind) for kind in ADAPTER_KINDS if str(kind) not in self.kinds_requested]


RECORDER = InputCoverage()


def _counts(counter: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in counter.items()) or "none"


def render_coverage(coverage: Mapping[str, Any], *, refusals_asked: bool = True) -> str:
    """The coverage section of the terminal report: a few lines, from an :meth:`as_dict`.
    ``refusals_asked=False`` (the scale profile, whose rules ask for none) does not list
    the kinds never requested."""
    calls = coverage["calls"]
    requested = coverage["kinds_requested"]
    missing = [str(kind) for kind in ADAPTER_KINDS if str(kind) not in requested]
    kinds = f"{len(ADAPTER_KINDS) - len(missing)} of {len(ADAPTER_KINDS)}"
    if not refusals_asked:
        kinds += " (this profile's rules ask for none)"
    elif missing:
        kinds += f"; never: {', '.join(missing)}"
    else:
        kinds += " (every kind an adapter refuses)"
    ranges = ", ".join(
        f"{name} {low}" + (f"-{high}" if high != low else "")
        for name, (low, high) in coverage["size_ranges"].items()
    )
    bases = ", ".join(f"{base:g}" for base in coverage["rope_bases"]) or "none"
    epsilons = ", ".join(f"{eps:g}" for eps in coverage["rms_epsilons"]) or "none"
    lines = [
        f"calls: {sum(calls.values())} ({_counts(calls)})",
        f"error kinds requested: {kinds}",
        f"token inputs: {_counts(coverage['token_inputs'])}",
        f"parameter dtypes: {_counts(coverage['parameter_dtypes'])}",
        f"models: {coverage['models_with_other_gains']} with RMSNorm gains other than 1, "
        f"{coverage['models_with_unit_gains']} with every gain 1",
        f"largest |logit| returned: {coverage['largest_logit']:.4g}",
        f"longest sequence: {coverage['longest_sequence']} tokens "
        f"(largest position {coverage['largest_position']})",
        f"configurations run: {ranges or 'none'}; RoPE bases {bases}; epsilons {epsilons}",
    ]
    return "\n".join(lines) + "\n"
