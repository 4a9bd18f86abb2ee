"""The backend as the rule tests see it: an adapter's own exceptions are adapter errors.

A backend refuses bad input by raising :class:`~conformance.adapter.Refusal`; any other
exception is a bug of the adapter (or of the implementation behind it), not a verdict on a
rule. The guard reports it in one line, first in the rule's detail::

    adapter error in forward: IndexError: index 5 is out of bounds (my_backend.py:42);
    call: forward(model of DecoderConfig(...), tokens [1, 3] [[0, 5, 2]])

The IDs follow their shape when there are at most 24.

It is raised as :class:`AdapterFault`, a ``BaseException``: hypothesis lets it through at
once instead of shrinking for minutes an input that was never the cause, and the plugin
reports its message, without a traceback, as the test's failure.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from conformance.adapter import Backend, Refusal
from conformance.coverage import RECORDER
from spec.errors import ErrorKind

__all__ = [
    "METHODS",
    "AdapterFault",
    "GuardedBackend",
    "adapter_location",
    "allocation_hint",
    "unexpected_refusal",
]

# The calls a rule test makes of a backend.
METHODS = ("build", "build_seeded", "initialize", "parameters", "forward", "loss")
# Those that make a model, and so can fail to allocate its parameters.
CONSTRUCTORS = ("build", "build_seeded", "initialize")

# How frameworks say an allocation failed, besides MemoryError: numpy's "array is too big",
# torch's DefaultCPUAllocator and CUDA "out of memory", XLA's RESOURCE_EXHAUSTED, and C++'s
# std::bad_alloc in a subprocess backend's error message.
_ALLOCATION_WORDS = (
    "allocate", "array is too big", "out of memory", "resource_exhausted", "bad_alloc",
)  # fmt: skip


def allocation_hint(method: str, error: BaseException) -> str:
    """What an allocation failure escaping ``method`` should have been, or "" for another
    error: the spec classifies sizes the machine cannot hold as refusals, and a port that
    lets its framework's out-of-memory error through is the commonest way to fail them."""
    text = str(error).lower()
    if not (isinstance(error, MemoryError) or any(word in text for word in _ALLOCATION_WORDS)):
        return ""
    if method in CONSTRUCTORS:
        kind, what = ErrorKind.PARAMETER_ALLOCATION_FAILED, "parameters"
    elif method in ("forward", "loss"):
        kind, what = ErrorKind.ACTIVATION_ALLOCATION_FAILED, "a pass's working memory"
    else:
        return ""
    return (
        f"An allocation that fails for {what} is the spec's refusal {kind}, not an error: "
        f"catch it in the adapter and raise Refusal(ErrorKind.{kind.name}, message) "
        "(ERR-RESOURCES; README, 'Check your own implementation')."
    )


def adapter_location(error: BaseException, adapter_file: str | None) -> str:
    """``file:line`` where the error left the adapter's own code (its innermost frame in the
    adapter's file), else its innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)
    if isinstance(error, SyntaxError) and error.filename:
        return f"{Path(error.filename).name}:{error.lineno}"
    if not frames:
        return "?"
    chosen = frames[-1]
    if adapter_file is not None:
        own = [frame for frame in frames if Path(frame.filename) == Path(adapter_file)]
        chosen = own[-1] if own else chosen
    return f"{Path(chosen.filename).name}:{chosen.lineno}"


def unexpected_refusal(refusal: Refusal) -> str:
    """The report of a refusal no check asked for: the backend refused a call the spec
    answers (where a refusal is expected, the check catches it and judges its kind)."""
    calls = [note for note in getattr(refusal, "__notes__", ()) if note.startswith("call: ")]
    where = f"; {calls[-1]}" if calls else ""
    return (
        f"the backend refused a call the spec answers: Refusal({refusal.kind}): "
        f"{' '.join(refusal.message.split())}{where}\n"
        "nothing in this call breaks a rule of the spec (`decoder-conformance rules` lists "
        "them), so the rule needs its answer: check the refusal's condition in the adapter "
        "or backend against the spec's (ERR-* rules)"
    )


class AdapterFault(BaseException):
    """An adapter raised something other than a Refusal; the message says what and where."""


_SHOWN_VALUES = 24  # a call's IDs are written out up to this many: enough for drawn cases


def _shape_and_ids(value: Any) -> str:
    """``[2, 5]``, followed by the values themselves when there are few (the IDs a backend
    refused or failed on are what its author needs to look at)."""
    try:
        shape = list(np.shape(value))
    except (ValueError, TypeError):
        return type(value).__name__
    if int(np.prod(shape)) > _SHOWN_VALUES:
        return str(shape)
    try:
        return f"{shape} {np.asarray(value).tolist()}"
    except (ValueError, TypeError):
        return str(shape)


class GuardedBackend:
    """Forwards everything to ``backend``; its calls report adapter errors as such."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._configs: dict[int, str] = {}  # id(model) -> the configuration it was built for
        try:
            self._adapter_file: str | None = inspect.getfile(type(backend))
        except (TypeError, OSError):
            self._adapter_file = None

    @property
    def wrapped(self) -> Backend:
        """The backend itself."""
        return self._backend

    def begin_test(self) -> None:
        """A new test starts (a subprocess backend forgets an earlier process fault)."""
        begin = getattr(self._backend, "begin_test", None)
        if callable(begin):
            begin()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._backend, name)
        if name in METHODS and callable(value):
            return self._guarded(name, value)
        return value

    def _describe_call(self, method: str, arguments: tuple[Any, ...]) -> str:
        if method in CONSTRUCTORS and arguments:
            return f"{method}({arguments[0]!r}, ...)"
        if not arguments:
            return f"{method}()"
        model = self._configs.get(id(arguments[0]), "a model")
        described = [f"tokens {_shape_and_ids(arguments[1])}"] if len(arguments) > 1 else []
        if len(arguments) > 2:
            # forward's third argument is the declared shape of flat IDs; loss's the targets.
            third = arguments[2]
            described.append(
                f"shape={third!r}" if method == "forward" else f"targets {_shape_and_ids(third)}"
            )
        return f"{method}({', '.join([model, *described])})"

    def _message(self, method: str, arguments: tuple[Any, ...], error: Exception) -> str:
        lines = str(error).strip().splitlines() or ["(no message)"]
        location = adapter_location(error, self._adapter_file)
        first = (
            f"adapter error in {method}: {type(error).__name__}: {' '.join(lines[0].split())} "
            f"({location}); call: {self._describe_call(method, arguments)}"
        )
        hint = allocation_hint(method, error)
        return "\n".join([first, *([hint] if hint else []), *lines[1:]])

    def _guarded(self, method: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*arguments: Any, **keywords: Any) -> Any:
            caught: Exception | None = None
            RECORDER.call(method, arguments)
            try:
                result = call(*arguments, **keywords)
            except Refusal as refusal:
                # Read only if no check expected it (a refusal of a valid call, below).
                refusal.add_note(f"call: {self._describe_call(method, arguments)}")
                raise
            except Exception as error:
                caught = error
            if caught is not None:
                raise AdapterFault(self._message(method, arguments, caught))
            if method in CONSTRUCTORS and arguments:
                self._configs[id(result)] = f"model of {arguments[0]!r}"
                RECORDER.built(method, arguments)
            RECORDER.answered(method, arguments, result)
            return result

        return guarded
