"""The adapter protocol: the few things a backend provides so the suite can judge it.

A backend is any object with the attributes and methods of :class:`Backend`. Subclass
:class:`BackendBase` to get defaults for the optional parts. Arrays cross the boundary as
numpy arrays; a refusal crosses it as :class:`Refusal`, which names a spec error kind.

Capabilities say which optional parts exist. A rule that needs a missing capability is
skipped, with the capability named; it is never silently passed.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from spec.config import DecoderConfig
from spec.errors import ErrorKind
from spec.parameters import parameter_count
from spec.recipe import SplitMix64
from spec.rules import Capability
from spec.tolerances import Precision
from spec.validation import Violation

__all__ = [
    "ENTRY_POINT_GROUP",
    "MAX_PARAMETER_SCALARS",
    "Backend",
    "BackendBase",
    "BackendLoadError",
    "BackendOptions",
    "Capability",
    "Departure",
    "ForwardOutput",
    "LossOutput",
    "Refusal",
    "call_build_seeded",
    "call_initialize",
    "declared_departures",
    "describe",
    "load_backend",
    "refuse",
    "refuse_parameters_past_the_bound",
    "where",
]

ENTRY_POINT_GROUP = "decoder_conformance.adapters"

FloatArray = npt.NDArray[np.float64]
Parameters = Sequence[tuple[str, FloatArray]]


class Departure(StrEnum):
    """A known way an engine differs from the seed that its adapter cannot work around.

    A backend declares it in ``departures`` (optional; none by default). The rules whose
    subject it is still run it, and fail with the engine's own message; every other rule
    draws its cases from what the engine can do, so one departure does not mask the rest.
    """

    NO_DEPTH_ZERO = "no-depth-zero"  # a model with no blocks cannot be built (llama.cpp aborts)


def declared_departures(backend: object) -> frozenset[Departure]:
    """The departures a backend declares (an adapter without the attribute declares none)."""
    return frozenset(Departure(d) for d in getattr(backend, "departures", ()))


class Refusal(Exception):
    """A backend's refusal of an input, classified by spec error kind.

    ``details`` carries the offending values a rule may check, by the attribute names of
    :mod:`impl.errors` (for example ``position`` for an out-of-range ID).
    """

    def __init__(
        self, kind: ErrorKind | str, message: str, details: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})

    def __str__(self) -> str:
        return f"{self.message} [{self.kind}]"


def refuse(violation: Violation | None) -> None:
    """Raise the :class:`Refusal` of a :mod:`spec.validation` violation, if there is one:
    for adapters whose framework validates nothing itself."""
    if violation is not None:
        raise Refusal(violation.kind, f"refused: {violation.kind}", dict(violation.details))


# The reference's bound on parameter scalars (impl.model.MAX_PARAMETER_SCALARS; adapters do
# not import impl).
MAX_PARAMETER_SCALARS = 2**31


def refuse_parameters_past_the_bound(config: DecoderConfig) -> None:
    """The reference's resource refusal of a model too large to allocate, for adapters that
    draw the recipe's parameters themselves."""
    scalars = parameter_count(config)
    if scalars > MAX_PARAMETER_SCALARS:
        raise Refusal(
            ErrorKind.PARAMETER_ALLOCATION_FAILED,
            f"{scalars} parameter scalars cannot be allocated; at most {MAX_PARAMETER_SCALARS}",
            {"scalars": scalars},
        )


@dataclass
class ForwardOutput:
    """What a forward pass returns: logits ``[B, T, V]`` and, with STAGES, every stage."""

    logits: FloatArray
    stages: list[tuple[str, FloatArray]] | None = None


@dataclass
class LossOutput:
    """The mean loss and, with GRADIENTS, the gradient of every named parameter."""

    loss: float
    gradients: dict[str, FloatArray] | None = None


@dataclass
class BackendOptions:
    """Settings the command line or pytest options pass to a backend factory."""

    backend_command: str | None = None
    timeout: float = 60.0
    extra: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """What the suite needs from an implementation.

    Two optional methods complete it: ``build_seeded(config, seed)`` for SEEDED_INIT (a
    model whose parameters follow the recipe for ``(config, seed)``), and
    ``initialize(config, stream)`` for STREAM_INIT (draws from a caller's
    :class:`spec.recipe.SplitMix64`, advancing it only on success).
    """

    name: str
    version: str
    precision: Precision
    capabilities: frozenset[Capability]

    def build(self, config: DecoderConfig, parameters: Parameters) -> Any:
        """A model from a configuration and a stable-order named parameter list."""

    def parameters(self, model: Any) -> list[tuple[str, FloatArray]]:
        """The model's named parameters, in its own order, as float64 arrays."""

    def forward(
        self, model: Any, tokens: npt.ArrayLike, shape: tuple[int, int] | None = None
    ) -> ForwardOutput:
        """Logits (and stages) for ``[B, T]`` tokens, or flat IDs with an explicit shape."""

    def loss(
        self,
        model: Any,
        tokens: npt.ArrayLike,
        targets: npt.ArrayLike,
        *,
        detach_lookup: bool = False,
        detach_head: bool = False,
    ) -> LossOutput:
        """Mean NLL and fresh gradients (not accumulated across calls)."""


class BackendBase:
    """Defaults for the optional parts; subclasses set the attributes and the core methods."""

    name = "unnamed"
    version = "0"
    precision = Precision.FLOAT64
    capabilities: frozenset[Capability] = frozenset()
    departures: frozenset[Departure] = frozenset()

    def build_seeded(self, config: DecoderConfig, seed: int) -> Any:
        """Not supported unless the backend declares SEEDED_INIT."""
        raise NotImplementedError(f"backend {self.name} does not declare {Capability.SEEDED_INIT}")

    def initialize(self, config: DecoderConfig, stream: SplitMix64) -> Any:
        """Not supported unless the backend declares STREAM_INIT."""
        raise NotImplementedError(f"backend {self.name} does not declare {Capability.STREAM_INIT}")


def call_build_seeded(backend: Backend, config: DecoderConfig, seed: int) -> Any:
    """``backend.build_seeded(config, seed)``, the optional method of SEEDED_INIT."""
    method = getattr(backend, "build_seeded", None)
    if method is None:
        raise NotImplementedError(f"backend {backend.name} has no build_seeded method")
    return method(config, seed)


def call_initialize(backend: Backend, config: DecoderConfig, stream: SplitMix64) -> Any:
    """``backend.initialize(config, stream)``, the optional method of STREAM_INIT."""
    method = getattr(backend, "initialize", None)
    if method is None:
        raise NotImplementedError(f"backend {backend.name} has no initialize method")
    return method(config, stream)


class BackendLoadError(Exception):
    """The named adapter cannot be found, imported or created."""


def _registered() -> dict[str, str]:
    return {point.name: point.value for point in entry_points(group=ENTRY_POINT_GROUP)}


def where(error: BaseException) -> str:
    """``file:line`` of the innermost frame an exception passed through (the file's name only)."""
    frames = traceback.extract_tb(error.__traceback__)
    if isinstance(error, SyntaxError) and error.filename:
        return f"{Path(error.filename).name}:{error.lineno}"
    if not frames:
        return "?"
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}"


def describe(error: BaseException) -> str:
    """``Type: message (file:line)``, on one line."""
    text = " ".join(str(error).split()) or "(no message)"
    return f"{type(error).__name__}: {text} ({where(error)})"


def _import_module(module_name: str, target: str) -> ModuleType:
    """The module of ``module:attr``: a dotted name (found from the working directory too) or
    a path to a ``.py`` file (imported under its file name, its folder on the import path)."""
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise BackendLoadError(f"adapter {target!r}: no file {path}")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise BackendLoadError(f"adapter {target!r}: {path} is not a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        loader: Any = spec.loader
        try:
            loader.exec_module(module)
        except Exception as error:
            del sys.modules[path.stem]
            raise BackendLoadError(
                f"adapter {target!r}: importing {path} failed: {describe(error)}"
            ) from error
        return module
    working = os.getcwd()
    if "" not in sys.path and working not in sys.path:
        sys.path.insert(0, working)  # as "python -m" would: the user's own module comes first
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        wanted = module_name.split(".")
        if error.name is not None and error.name.split(".") == wanted[: len(error.name.split("."))]:
            raise BackendLoadError(
                f"adapter {target!r}: no module {module_name} in {working} or the installed "
                f"packages ({error})"
            ) from error
        raise BackendLoadError(  # the adapter's module was found; one of its imports was not
            f"adapter {target!r}: importing {module_name} failed: {describe(error)}"
        ) from error
    except Exception as error:
        raise BackendLoadError(
            f"adapter {target!r}: importing {module_name} failed: {describe(error)}"
        ) from error


def _import_target(target: str) -> object:
    module_name, _, attribute = target.rpartition(":")
    if not module_name or not attribute:
        raise BackendLoadError(
            f"adapter {target!r} must be a registered name, 'package.module:attribute' "
            "or 'path/to/file.py:attribute'"
        )
    module = _import_module(module_name, target)
    try:
        found: object = module
        for part in attribute.split("."):
            found = getattr(found, part)
    except AttributeError:
        raise BackendLoadError(
            f"adapter {target!r}: {module_name} has no attribute {attribute!r}"
        ) from None
    return found


def load_backend(name: str, options: BackendOptions | None = None) -> Backend:
    """A backend by registered name (entry-point group) or ``package.module:attribute``.

    The attribute may be a backend object, or a class or factory called with no argument,
    or with a :class:`BackendOptions` when it takes one.
    """
    registered = _registered()
    if ":" not in name and name not in registered:
        known = ", ".join(sorted(registered)) or "none"
        hint = " (name the class too: FILE.py:CLASS)" if name.endswith(".py") else ""
        raise BackendLoadError(
            f"no adapter named {name!r}{hint}; registered adapters: {known}, "
            "or give package.module:attribute or path/to/file.py:attribute"
        )
    target = _import_target(registered.get(name, name))
    if isinstance(target, Backend) and not inspect.isclass(target):
        return target
    if not callable(target):
        raise BackendLoadError(f"adapter {name!r} is neither a backend nor a factory")
    takes_options = bool(inspect.signature(target).parameters)
    try:
        made = target(options or BackendOptions()) if takes_options else target()
    except BackendLoadError:
        raise
    except Exception as error:
        raise BackendLoadError(
            f"adapter {name!r} could not be created: {describe(error)}"
        ) from error
    if not isinstance(made, Backend):
        raise BackendLoadError(
            f"adapter {name!r} made {type(made).__name__}, which lacks the Backend protocol "
            "(name, version, precision, capabilities, build, parameters, forward, loss)"
        )
    return made
