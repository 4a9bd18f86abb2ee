"""Assertion helpers: every failure names its rule, says what it got and what it should be,
and ends with a snippet that reproduces it.

Messages have one shape: ``[RULE-ID] what=got, but should be expected``. A test gets a
:class:`Judge` for its rule from the ``judge`` fixture and binds it to the case it runs
with :meth:`Judge.on`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt
import pytest

from conformance.adapter import Backend, Refusal
from conformance.coverage import RECORDER
from conformance.margins import RECORDER as MARGINS
from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.tolerances import scaled_error

__all__ = [
    "Case",
    "Hint",
    "Judge",
    "describe_positions",
    "off_at_each_position",
    "positions_off",
    "spans",
]


def _literal(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return repr(value.tolist())
    return repr(value)


# What a failure looks like: text, or a function computing it (called on a failure only, as
# it may cost a pass over arrays of the size of a real model).
Hint = str | Callable[[], str]


def _ending(hint: Hint) -> str:
    text = hint() if callable(hint) else hint
    return f"; {text}" if text else ""


def spans(indices: Iterable[int]) -> str:
    """``0-63, 70`` for sorted indices."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(f"{low}" if low == high else f"{low}-{high}" for low, high in runs)


def _counted(indices: npt.NDArray[np.intp], noun: str) -> str:
    return f"{noun if indices.size == 1 else noun + 's'} {spans(int(i) for i in indices)}"


def off_at_each_position(
    got: npt.ArrayLike, exact: npt.ArrayLike, tolerance: float
) -> npt.NDArray[np.bool_] | None:
    """For ``[B, T, ...]`` arrays, whether any element at each position (axis 1) is past
    ``tolerance`` or not finite; None when the shapes differ or there is no position axis."""
    got_array = np.asarray(got, dtype=np.float64)
    exact_array = np.asarray(exact, dtype=np.float64)
    if got_array.shape != exact_array.shape or got_array.ndim < 2 or got_array.size == 0:
        return None
    over = ~(scaled_error(got_array, exact_array) <= tolerance)  # NaN counts as off
    return np.asarray(over.reshape(*over.shape[:2], -1).any(axis=(0, 2)), dtype=np.bool_)


def positions_off(got: npt.ArrayLike, exact: npt.ArrayLike, tolerance: float) -> str:
    """Which positions (axis 1 of ``[B, T, ...]``) of ``got`` are past ``tolerance``, and
    which are within: ``positions 64-79 of 80 off (positions 0-63 within)``; nothing when
    the shapes differ or none is off."""
    return describe_positions(off_at_each_position(got, exact, tolerance))


def describe_positions(flagged: npt.NDArray[np.bool_] | None) -> str:
    """:func:`positions_off`'s text for positions already flagged (``True`` where off)."""
    if flagged is None or not flagged.any():
        return ""
    off, within = np.flatnonzero(flagged), np.flatnonzero(~flagged)
    kept = f" ({_counted(within, 'position')} within)" if within.size else ""
    return f"{_counted(off, 'position')} of {flagged.size} off{kept}"


@dataclass(frozen=True)
class Case:
    """What a check ran: enough to rebuild it outside the suite."""

    config: DecoderConfig
    seed: int | None = None
    tokens: Any = None
    targets: Any = None
    call: str = "backend.forward(model, tokens)"
    notes: dict[str, Any] = field(default_factory=dict)
    variant: str = "recipe"  # the parameters: spec.variants.scenario_parameters

    def snippet(self, adapter: str) -> str:
        """Python that rebuilds the model and repeats the call against the same backend (the
        expected value is computed by the rule's test; ``--repro-dir`` scripts rerun it)."""
        fields = ", ".join(f"{name}={value!r}" for name, value in self.config.as_dict().items())
        lines = [
            "from conformance.adapter import load_backend",
            "from spec.config import DecoderConfig",
            "from spec.recipe import initial_parameters",
            f"backend = load_backend({adapter!r})",
            f"config = DecoderConfig({fields})",
        ]
        if self.seed is not None and self.variant == "recipe":
            lines.append(f"model = backend.build(config, initial_parameters(config, {self.seed}))")
        elif self.seed is not None:
            lines += [
                "from spec.variants import scenario_parameters",
                "parameters = scenario_parameters(config, "
                f"{self.seed}, {self.variant!r})  # gains other than 1",
                "model = backend.build(config, parameters)",
            ]
        if self.tokens is not None:
            lines.append(f"tokens = {_literal(self.tokens)}")
        if self.targets is not None:
            lines.append(f"targets = {_literal(self.targets)}")
        lines.extend(f"{name} = {_literal(value)}" for name, value in self.notes.items())
        lines.extend(self.call.splitlines())
        # The snippet repeats the call; the check (the expected value from the spec) is the
        # rule's test, which the script written by --repro-dir reruns.
        return "the failing call, outside the suite:\n" + "\n".join(f"    {line}" for line in lines)


@dataclass(frozen=True)
class Judge:
    """Checks for one rule against one backend, optionally bound to a case."""

    rule: str
    backend: Backend
    adapter: str
    case: Case | None = None

    def on(self, case: Case) -> Judge:
        """The same judge, reporting ``case`` when a check fails."""
        return Judge(self.rule, self.backend, self.adapter, case)

    def fail(self, what: str, got: object, expected: object) -> NoReturn:
        """Fail in the suite's one message shape, with a reproduction when a case is bound."""
        message = f"[{self.rule}] {what}={got}, but should be {expected}"
        if self.case is not None:
            message += "\n" + self.case.snippet(self.adapter)
        pytest.fail(message, pytrace=False)

    def check(self, condition: bool, what: str, got: object, expected: object) -> None:
        """Fail unless ``condition`` holds."""
        if not condition:
            self.fail(what, got, expected)

    def finite(self, what: str, got: npt.ArrayLike, *, hint: Hint = "") -> None:
        """Fail, naming the first one, unless every value is finite; ``hint`` ends the
        message."""
        got_array = np.asarray(got, dtype=np.float64)
        bad = ~np.isfinite(got_array)
        if not bad.any():
            return
        index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), got_array.shape))
        location = f"{what}{list(index)}" if index else what
        self.fail(
            location,
            f"{float(got_array[index])!r} (not finite; {int(bad.sum())} of {bad.size} elements)",
            "finite" + _ending(hint),
        )

    @staticmethod
    def within(got: npt.ArrayLike, exact: npt.ArrayLike, tolerance: float) -> bool:
        """Whether :meth:`close` would pass."""
        got_array = np.asarray(got, dtype=np.float64)
        exact_array = np.asarray(exact, dtype=np.float64)
        if got_array.shape != exact_array.shape:
            return False
        return bool(np.all(scaled_error(got_array, exact_array) <= tolerance))

    def close(
        self,
        what: str,
        got: npt.ArrayLike,
        exact: npt.ArrayLike,
        tolerance: float,
        *,
        hint: Hint = "",
        scale: float | npt.ArrayLike | None = None,
    ) -> None:
        """Fail unless every value is finite and ``|got - exact| / max(1, |exact|)`` is within
        ``tolerance``; ``hint`` (what the failure looks like, or a function giving it, called
        only on a failure) ends the message.

        With ``scale`` (a number, or one per element), an element's error is
        ``|got - exact| / max(1, |exact|, scale)`` instead: for values that are sums of large
        cancelling terms, where a correct implementation's error follows the size of the
        terms, not of the sum."""
        got_array = np.asarray(got, dtype=np.float64)
        exact_array = np.asarray(exact, dtype=np.float64)
        self.check(
            got_array.shape == exact_array.shape,
            f"{what} shape",
            list(got_array.shape),
            list(exact_array.shape),
        )
        self.finite(what, got_array, hint=hint)
        errors = (
            scaled_error(got_array, exact_array)
            if scale is None
            else np.abs(got_array - exact_array)
            / np.maximum(np.maximum(1.0, np.abs(exact_array)), np.asarray(scale, dtype=np.float64))
        )
        over = ~(errors <= tolerance)
        if not over.any():
            if errors.size:
                worst = float(np.max(errors))
                kind = "scaled error" if scale is None else "error of the terms' scale"
                MARGINS.note(
                    worst / tolerance if tolerance > 0 else 0.0,
                    f"{what}: {kind} {worst:.2e} of {tolerance:.2e}",
                )
            return
        worst = int(np.argmax(np.where(np.isnan(errors), np.inf, errors)))
        index = tuple(int(i) for i in np.unravel_index(worst, errors.shape))
        location = f"{what}{list(index)}" if index else what
        measure = (
            f"scaled error {float(errors[index]):.3e}"
            if scale is None
            else f"error {float(errors[index]):.3e} of the terms' scale"
        )
        self.fail(
            location,
            f"{float(got_array[index])!r} ({measure}; "
            f"{int(over.sum())} of {errors.size} elements over)",
            f"{float(exact_array[index])!r} within {tolerance:.3g}" + _ending(hint),
        )

    def close_each(
        self,
        kind: str,
        got: Mapping[str, npt.ArrayLike] | None,
        exact: Iterable[tuple[str, npt.ArrayLike]],
        tolerance: float,
        *,
        scale: float | Callable[[npt.ArrayLike], float | None] | None = None,
        hint: Callable[[npt.ArrayLike, npt.ArrayLike], str] | None = None,
    ) -> None:
        """:meth:`close` for each ``(name, exact)`` in order, as ``{kind} {name}``: failing at
        the first array missing from ``got`` or off. ``scale`` is a number for every array or
        one per exact array (a function of it); ``hint(got, exact)``, called on a failure
        only, ends a failure's message."""
        returned = got or {}
        for name, expected in exact:
            what = f"{kind} {name}"
            if name not in returned:
                self.fail(what, "missing", f"shape {list(np.shape(expected))}")
            value = returned[name]
            self.close(
                what,
                value,
                expected,
                tolerance,
                scale=scale(expected) if callable(scale) else scale,
                hint="" if hint is None else partial(hint, value, expected),
            )

    def same_bits(self, what: str, got: npt.ArrayLike, expected: npt.ArrayLike) -> None:
        """Fail unless both are finite and bit for bit the same (shape and every value)."""
        got_array, expected_array = np.asarray(got), np.asarray(expected)
        self.finite(what, got_array)
        self.finite(f"{what} (the first time)", expected_array)
        same = (
            got_array.shape == expected_array.shape
            and got_array.dtype == expected_array.dtype
            and got_array.tobytes() == expected_array.tobytes()
        )
        if not same:
            self.fail(what, _how_different(got_array, expected_array), "bitwise the same")

    def refused(
        self,
        action: Callable[[], object],
        expected: ErrorKind,
        *,
        what: str = "refusal kind",
        reason: str = "",
        **details: Any,
    ) -> Refusal:
        """``action`` must raise a :class:`Refusal` of kind ``expected`` carrying ``details``;
        ``reason`` (why that kind) follows the expected kind in a failure message."""
        RECORDER.requested(expected)
        expected_text = f"{expected} ({reason})" if reason else str(expected)
        # Judged outside the except clauses, so a failure is not chained to the refusal and
        # its first line is the rule's own message.
        caught: Refusal | None = None
        crash: Exception | None = None
        try:
            action()
        except Refusal as refusal:
            caught = refusal
        except Exception as error:  # a crash is a wrong answer, and is reported as one
            crash = error
        if crash is not None:
            self.fail(
                "refusal", f"{type(crash).__name__}: {crash}", f"a Refusal of kind {expected_text}"
            )
        if caught is None:
            self.fail("refusal", "none (the call succeeded)", f"a Refusal of kind {expected_text}")
        self.check(
            caught.kind is expected, what, f"{caught.kind} ({caught.message})", expected_text
        )
        for name, value in details.items():
            got = caught.details.get(name, "missing")
            self.check(got == value, f"refusal detail {name}", got, value)
        return caught


def _how_different(got: npt.NDArray[Any], expected: npt.NDArray[Any]) -> str:
    """What differs between two finite arrays that are not bit for bit the same."""
    if got.shape != expected.shape:
        return f"different (shape {list(got.shape)} against {list(expected.shape)})"
    gap = float(np.max(np.abs(got.astype(np.float64) - expected), initial=0.0))
    if gap > 0:
        return f"different (by up to {gap:.3e})"
    if got.dtype != expected.dtype:
        return f"different (dtype {got.dtype} against {expected.dtype}, the same values)"
    zeros = int(np.count_nonzero(np.signbit(got) != np.signbit(expected)))
    return f"different (the same values, {zeros} zero{'s' if zeros != 1 else ''} of the other sign)"
