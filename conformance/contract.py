"""The adapter contract, checked in seconds before the suite starts.

On the seed's fixture and one wider configuration, every method the backend declares is
called once, and what comes back is checked against the protocol: numpy arrays (not a
framework's tensors), the shapes and dtypes of the declared precision, the stage names, a
dict of gradients keyed by every parameter name, parameters that round-trip, and each
declared capability really there. Each violation is one line naming the method and what to
return instead. ``decoder-conformance check-adapter`` prints them; ``run`` does not start
the suite on a broken contract unless told to (``--no-contract-check``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.adapter import Backend, Refusal, call_build_seeded, call_initialize
from conformance.guard import adapter_location
from spec.config import FIXTURE, DecoderConfig
from spec.errors import ErrorKind
from spec.formats import Precision, accepted_dtypes, held_in_format, number_format, round_to
from spec.parameters import parameter_layout, parameter_names
from spec.recipe import GOLDEN_GAMMA, SplitMix64, initial_parameters
from spec.rules import Capability
from spec.shapes import stage_names

__all__ = ["WIDER", "ContractViolation", "check_contract"]

# One configuration beyond the fixture: odd head count, head width 4, a narrow feed-forward.
WIDER = DecoderConfig(7, 12, 3, 5, 2, 6, rope_base=500.0, rms_epsilon=1e-5)


@dataclass(frozen=True)
class ContractViolation:
    """One thing an adapter returns or does against the protocol, and what it should do;
    ``rule``, where the violation is also the breach of a rule, names that rule."""

    method: str
    problem: str
    rule: str | None = None

    def __str__(self) -> str:
        if self.problem.startswith("adapter error in "):
            return self.problem  # names the method already
        return f"{self.method}: {self.problem}"


class _Stop(Exception):
    """A call failed; later checks of this configuration would only repeat the failure."""


def _kind_of(value: Any) -> str:
    module = type(value).__module__.split(".")[0]
    return (
        f"{module}.{type(value).__name__}"
        if module not in ("builtins", "numpy")
        else type(value).__name__
    )


class _Checker:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.found: list[ContractViolation] = []
        self.adapter_file: str | None
        try:
            import inspect

            self.adapter_file = inspect.getfile(type(backend))
        except (TypeError, OSError):
            self.adapter_file = None

    def flag(self, method: str, problem: str, rule: str | None = None) -> None:
        # The same fault met on both configurations is one line (under the first rule).
        if all((found.method, found.problem) != (method, problem) for found in self.found):
            self.found.append(ContractViolation(method, problem, rule))

    def call(
        self, method: str, action: Callable[[], Any], what: str, rule: str | None = None
    ) -> Any:
        begin_test = getattr(self.backend, "begin_test", None)
        if callable(begin_test):
            begin_test()  # each call on its own: a fault of one does not spill into the next
        try:
            return action()
        except Refusal as refusal:
            self.flag(method, f"refused {what} ({refusal}); it must accept it", rule)
        except Exception as error:
            text = " ".join(str(error).split()) or "(no message)"
            location = adapter_location(error, self.adapter_file)
            self.flag(
                method,
                f"adapter error in {method}: {type(error).__name__}: {text} ({location}); "
                f"call: {method} on {what}",
                rule,
            )
        raise _Stop

    def array(
        self,
        method: str,
        what: str,
        value: Any,
        shape: tuple[int, ...],
        shape_rule: str | None = None,
    ) -> Any:
        """``value`` as checked: a numpy float array of ``shape`` in the declared precision."""
        if not isinstance(value, np.ndarray):
            hint = ", e.g. tensor.detach().cpu().numpy()" if hasattr(value, "detach") else ""
            self.flag(method, f"{what} is a {_kind_of(value)}; return a numpy array{hint}")
            return None
        if value.dtype.kind != "f":
            self.flag(method, f"{what} has dtype {value.dtype}; return floating-point values")
            return None
        declared = str(self.backend.precision)
        accepted = accepted_dtypes(declared)
        if value.dtype.name not in accepted:
            self.flag(
                method,
                f"{what} has dtype {value.dtype}, but the backend declares {declared}; return "
                f"{' or '.join(accepted)} arrays",
            )
        if tuple(value.shape) != shape:
            self.flag(
                method,
                f"{what} has shape {list(value.shape)}; return shape {list(shape)}",
                shape_rule,
            )
            return None
        if not np.all(np.isfinite(value)):
            self.flag(method, f"{what} holds values that are not finite")
        return value


def _stored(values: np.ndarray[Any, Any], precision: Precision) -> np.ndarray[Any, Any]:
    """How a backend of ``precision`` holds float64 parameters (rounded to its format)."""
    return round_to(values, precision)


def _held(held: np.ndarray[Any, Any], original: np.ndarray[Any, Any], precision: Precision) -> bool:
    """``held`` is ``original`` exactly, or stored in ``precision`` (either rounding)."""
    return bool(
        held.shape == original.shape
        and (np.array_equal(held, original) or np.all(held_in_format(held, original, precision)))
    )


_COPY_ADVICE = {
    "build": "copy them before converting them (np.array(value), torch.tensor(value); "
    "torch.from_numpy shares the caller's memory)",
    "forward": "work on a copy (torch.from_numpy and np.asarray share the caller's memory)",
    "loss": "work on a copy (torch.from_numpy and np.asarray share the caller's memory)",
}


def _left_unchanged(
    checker: _Checker, method: str, given: list[tuple[str, Any]], before: list[tuple[str, Any]]
) -> None:
    """Flag ``method`` if it wrote into the arrays it was given (``before`` holds copies):
    the suite reuses them, so every later check would judge inputs the backend changed."""
    changed = [
        name
        for (name, value), (_, original) in zip(given, before, strict=True)
        if not np.array_equal(value, original, equal_nan=True)
    ]
    if not changed:
        return
    listed = ", ".join(changed[:3]) + (" and others" if len(changed) > 3 else "")
    what = (
        f"parameter arrays it was given ({listed})"
        if method == "build"
        else f"{' and '.join(changed)} it was given"
    )
    checker.flag(method, f"wrote into the {what}: {_COPY_ADVICE[method]}")


def _stages_differ(checker: _Checker, stages: list[tuple[str, Any]]) -> None:
    """Consecutive stages of a random model never agree bit for bit; when they do, the list
    holds one buffer that each block updated in place (``hidden += ...``)."""
    for (earlier, before), (later, after) in itertools.pairwise(stages):
        if np.array_equal(before, after):
            checker.flag(
                "forward",
                f"stages {earlier} and {later} hold the same values: a stage list that keeps one "
                "buffer each block updates in place; return a copy of each stage",
                "VALUE-STAGES",
            )
            return


def _check_model(checker: _Checker, config: DecoderConfig, seed: int) -> None:
    backend = checker.backend
    capabilities = set(backend.capabilities)
    parameters = initial_parameters(config, seed)
    given = [(name, value.copy()) for name, value in parameters]
    model = checker.call(
        "build",
        lambda: backend.build(config, given),
        "a valid configuration",
        "CONFIG-VALID-BUILDS",
    )
    _left_unchanged(checker, "build", given, parameters)
    listed = checker.call("parameters", lambda: backend.parameters(model), "a built model")
    _check_parameters(checker, config, listed, parameters)
    rng = np.random.default_rng(seed)
    batch, length = 2, config.context
    tokens = rng.integers(0, config.vocabulary_size, size=(batch, length))
    targets = rng.integers(0, config.vocabulary_size, size=(batch, length))
    # Each call gets its own copies, checked afterwards: a backend that writes into its
    # inputs is told so, instead of the next call meeting other IDs.
    sent = tokens.copy()
    output = checker.call("forward", lambda: backend.forward(model, sent), "[2, T] tokens")
    _left_unchanged(checker, "forward", [("token IDs", sent)], [("token IDs", tokens)])
    logits = checker.array(
        "forward",
        "logits",
        getattr(output, "logits", output),
        (batch, length, config.vocabulary_size),
        "SHAPE-LOGITS",
    )
    if not hasattr(output, "logits"):
        checker.flag(
            "forward", f"returned {_kind_of(output)}; return ForwardOutput(logits, stages)"
        )
    hidden = (batch, length, config.model_width)
    stages = getattr(output, "stages", None)
    if Capability.STAGES in capabilities:
        if not isinstance(stages, list | tuple):
            checker.flag(
                "forward",
                f"stages is {_kind_of(stages)}; with 'stages' declared return a list of "
                "(name, array) pairs: embedding, block-0, ..., final-norm",
            )
        else:
            names = [
                entry[0] if isinstance(entry, tuple | list) and len(entry) == 2 else "?"
                for entry in stages
            ]
            if names != stage_names(config.layers):
                checker.flag(
                    "forward",
                    f"stage names are {names}; return {stage_names(config.layers)}",
                    "SHAPE-BLOCKS",
                )
            checked = []
            for entry in stages:
                if isinstance(entry, tuple | list) and len(entry) == 2:
                    rule = {"embedding": "SHAPE-EMBEDDING", "final-norm": "SHAPE-FINAL-NORM"}
                    value = checker.array(
                        "forward",
                        f"stage {entry[0]}",
                        entry[1],
                        hidden,
                        rule.get(str(entry[0]), "SHAPE-BLOCKS"),
                    )
                    if value is not None:
                        checked.append((str(entry[0]), value))
            _stages_differ(checker, checked)
    sent = tokens.reshape(-1).copy()
    flat = checker.call(
        "forward",
        lambda: backend.forward(model, sent, (batch, length)),
        "flat token IDs with shape=(B, T)",
    )
    _left_unchanged(checker, "forward", [("token IDs", sent)], [("token IDs", tokens.reshape(-1))])
    flat_logits = getattr(flat, "logits", None)
    if (
        logits is not None
        and isinstance(flat_logits, np.ndarray)
        and flat_logits.shape == logits.shape
        and not np.allclose(flat_logits, logits, rtol=1e-6, atol=1e-6, equal_nan=True)
    ):
        checker.flag("forward", "flat IDs with shape=(B, T) give other logits than [B, T] IDs")
    _check_loss(checker, config, _loss(checker, model, tokens, targets, {}), capabilities)
    if Capability.TIED_ROLES in capabilities:
        for options in ({"detach_lookup": True}, {"detach_head": True}):
            _check_loss(
                checker, config, _loss(checker, model, tokens, targets, options), capabilities
            )


def _loss(
    checker: _Checker, model: Any, tokens: Any, targets: Any, options: dict[str, bool]
) -> Any:
    """The loss on copies of ``tokens`` and ``targets``, which must come back unchanged."""
    what = ", ".join(f"{name}=True" for name in options) or "[2, T] targets"
    sent, sent_targets = tokens.copy(), targets.copy()
    result = checker.call(
        "loss", lambda: checker.backend.loss(model, sent, sent_targets, **options), what
    )
    _left_unchanged(
        checker,
        "loss",
        [("token IDs", sent), ("target IDs", sent_targets)],
        [("token IDs", tokens), ("target IDs", targets)],
    )
    return result


def _check_parameters(
    checker: _Checker, config: DecoderConfig, listed: Any, given: list[tuple[str, Any]]
) -> None:
    if isinstance(listed, Mapping) or not isinstance(listed, list | tuple):
        checker.flag(
            "parameters", f"returned {_kind_of(listed)}; return a list of (name, array) pairs"
        )
        return
    names = [
        entry[0] if isinstance(entry, tuple | list) and len(entry) == 2 else None
        for entry in listed
    ]
    if names != parameter_names(config):
        checker.flag(
            "parameters",
            f"names are {names[:3]}...; return the {len(given)} stable names in order "
            f"({', '.join(parameter_names(config)[:2])}, ...)",
            "PARAM-NAMES",
        )
        return
    drifted = []
    formats_held = set(Precision)
    for (name, value), (_, shape), (_, original) in zip(
        listed, parameter_layout(config), given, strict=True
    ):
        checked = checker.array("parameters", name, value, shape, "SHAPE-PARAMETERS")
        if checked is None:
            continue
        held = checked.astype(np.float64)
        if not _held(held, original, Precision(checker.backend.precision)):
            drifted.append(name)
        formats_held &= {p for p in Precision if _held(held, original, p)}
    if drifted:
        named = ", ".join(drifted[:3]) + (" and others" if len(drifted) > 3 else "")
        # Values rounded to another format than the declared one are a false declaration.
        held_in = sorted(formats_held, key=lambda p: -number_format(p).unit_roundoff)
        telling = (
            f" (they are the values rounded to {held_in[0]}: declare {held_in[0]}, or hold "
            f"{checker.backend.precision})"
            if held_in
            else ""
        )
        checker.flag(
            "parameters",
            f"{named} do not round-trip{telling}: "
            "return the values build received (or them rounded to the declared precision), "
            "in the spec's [in, out] layout",
            "REBUILD-ROUNDTRIP",
        )


def _check_loss(
    checker: _Checker, config: DecoderConfig, result: Any, capabilities: set[Any]
) -> None:
    loss = getattr(result, "loss", result)
    if not hasattr(result, "loss"):
        checker.flag("loss", f"returned {_kind_of(result)}; return LossOutput(loss, gradients)")
    if hasattr(loss, "detach") or not isinstance(loss, float | int | np.floating | np.ndarray):
        checker.flag("loss", f"loss is a {_kind_of(loss)}; return a Python float (tensor.item())")
    elif not np.isfinite(float(np.asarray(loss))):
        checker.flag("loss", "loss is not finite")
    gradients = getattr(result, "gradients", None)
    if Capability.GRADIENTS not in capabilities:
        return
    if not isinstance(gradients, Mapping):
        checker.flag(
            "loss",
            f"gradients is {_kind_of(gradients)}; with 'gradients' declared return a dict "
            "{name: array} with every parameter",
        )
        return
    missing = [name for name in parameter_names(config) if name not in gradients]
    if missing:
        checker.flag(
            "loss",
            f"gradients lack {missing[:3]}{'...' if len(missing) > 3 else ''}",
            "GRAD-FINITE",
        )
    for name, shape in parameter_layout(config):
        if name in gradients:
            checker.array("loss", f"gradient of {name}", gradients[name], shape, "GRAD-FINITE")


def _check_refusals(checker: _Checker) -> None:
    backend = checker.backend
    capabilities = set(backend.capabilities)
    config = FIXTURE.config
    probes: list[tuple[Capability, str, str, Callable[[], Any], ErrorKind, str]] = []
    if Capability.CONFIG_ERRORS in capabilities:
        zero_heads = dataclasses.replace(config, heads=0)
        probes.append(
            (
                Capability.CONFIG_ERRORS,
                "build",
                "a configuration with zero heads",
                lambda: backend.build(zero_heads, []),
                ErrorKind.ZERO_HEAD_COUNT,
                "ERR-CONFIG-KIND",
            )
        )
        # The construction methods that take no parameter list validate the configuration
        # too; an adapter that checks only in build is the common slip.
        if Capability.SEEDED_INIT in capabilities:
            probes.append(
                (
                    Capability.CONFIG_ERRORS,
                    "build_seeded",
                    "a configuration with zero heads",
                    lambda: call_build_seeded(backend, zero_heads, 0),
                    ErrorKind.ZERO_HEAD_COUNT,
                    "ERR-CONFIG-KIND",
                )
            )
        if Capability.STREAM_INIT in capabilities:
            probes.append(
                (
                    Capability.CONFIG_ERRORS,
                    "initialize",
                    "a configuration with zero heads",
                    lambda: call_initialize(backend, zero_heads, SplitMix64(1)),
                    ErrorKind.ZERO_HEAD_COUNT,
                    "ERR-CONFIG-KIND",
                )
            )
    if Capability.REBUILD_ERRORS in capabilities:
        short = initial_parameters(config, 0)[:-1]
        probes.append(
            (
                Capability.REBUILD_ERRORS,
                "build",
                "a parameter list one tensor short",
                lambda: backend.build(config, short),
                ErrorKind.PARAMETER_COUNT_MISMATCH,
                "ERR-REBUILD-COUNT",
            )
        )
    if Capability.INPUT_ERRORS in capabilities:
        model = checker.call(
            "build",
            lambda: backend.build(config, initial_parameters(config, 0)),
            "a valid configuration",
        )
        probes.append(
            (
                Capability.INPUT_ERRORS,
                "forward",
                "token ID V",
                lambda: backend.forward(model, [[0, 1, config.vocabulary_size]]),
                ErrorKind.TOKEN_ID_OUT_OF_BOUNDS,
                "ERR-TOKEN-ID",
            )
        )
    for capability, method, what, action, kind, rule in probes:
        try:
            action()
        except Refusal as refusal:
            if refusal.kind is not kind:
                checker.flag(
                    method, f"{what} was refused as {refusal.kind}; refuse it as {kind}", rule
                )
        except Exception as error:
            location = adapter_location(error, checker.adapter_file)
            checker.flag(
                method,
                f"{what} raised {type(error).__name__} ({location}); with '{capability}' "
                f"declared raise Refusal(ErrorKind.{kind.name}, message)",
                rule,
            )
        else:
            checker.flag(
                method, f"{what} was accepted; with '{capability}' declared refuse it", rule
            )


def _check_initialization(checker: _Checker) -> None:
    backend = checker.backend
    capabilities = set(backend.capabilities)
    config, seed = FIXTURE.config, FIXTURE.seed
    precision = Precision(backend.precision)
    exact = initial_parameters(config, seed)
    if Capability.SEEDED_INIT in capabilities:
        model = checker.call(
            "build_seeded", lambda: call_build_seeded(backend, config, seed), "the seed's fixture"
        )
        listed = checker.call("parameters", lambda: backend.parameters(model), "a seeded model")
        held = [(n, np.asarray(v, dtype=np.float64)) for n, v in listed]
        if [n for n, _ in held] != [n for n, _ in exact] or not all(
            _held(got, value, precision) for (_, got), (_, value) in zip(held, exact, strict=True)
        ):
            checker.flag(
                "build_seeded",
                "parameters differ from spec.recipe.initial_parameters(config, seed)",
                "INIT-RECIPE",
            )
    if Capability.STREAM_INIT in capabilities:
        stream = SplitMix64(seed)
        checker.call("initialize", lambda: call_initialize(backend, config, stream), "the fixture")
        draws = sum(int(np.prod(shape)) for _, shape in parameter_layout(config) if len(shape) == 2)
        if stream.state != (seed + draws * GOLDEN_GAMMA) % 2**64:
            checker.flag(
                "initialize",
                f"the stream must advance by exactly {draws} draws",
                "INIT-STREAM-ADVANCE",
            )


def check_contract(backend: Backend) -> list[ContractViolation]:
    """Every way ``backend`` breaks the adapter contract (empty when it keeps it)."""
    checker = _Checker(backend)
    for attribute, kind in (("name", str), ("version", str)):
        value = getattr(backend, attribute, None)
        if not isinstance(value, kind) or not value:
            checker.flag(attribute, f"is {value!r}; set a non-empty string")
    precision = getattr(backend, "precision", None)
    if str(precision) not in {str(p) for p in Precision}:
        checker.flag("precision", f"is {precision!r}; choose from {', '.join(map(str, Precision))}")
        return checker.found
    capabilities = getattr(backend, "capabilities", ())
    known = {str(c) for c in Capability}
    unknown = [c for c in capabilities if str(c) not in known]
    if unknown:
        checker.flag("capabilities", f"{unknown} are no capabilities; choose from {sorted(known)}")
    for config, seed in ((FIXTURE.config, FIXTURE.seed), (WIDER, 7)):
        try:
            _check_model(checker, config, seed)
        except _Stop:
            continue
    for step in (_check_refusals, _check_initialization):
        try:
            step(checker)
        except _Stop:
            continue
    return checker.found
