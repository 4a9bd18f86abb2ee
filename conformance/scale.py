"""What the ``scale`` profile's rules share: one shape's runs, computed once, held one at a time.

At a scale shape each run is seconds to a minute, so the rules of a shape share them: the
float64 reference's stages, logits, loss and gradients (the oracle), the backend's model, its
forward pass and its loss. The plugin orders the tests shape by shape, and moving to another
shape drops everything held for the previous one. The reference's own activations are freed
before the backend runs: the suite holds at most one full set of activations at a time, and
what it keeps are the outputs (the stages, the logits, the gradients).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from conformance.adapter import Backend, Capability, FloatArray, ForwardOutput, LossOutput
from conformance.checks import Case, Judge, describe_positions, off_at_each_position
from conformance.guard import AdapterFault
from conformance.heap import return_freed_memory
from spec.scale import ScaleShape, scale_shape
from spec.tolerances import MissingScaleBound, Tolerance, scale_tolerance
from spec.variants import scenario_parameters

__all__ = [
    "POSITION_TILE",
    "ReferenceRun",
    "ShapeRuns",
    "check_against_the_reference",
    "check_loss_and_gradients",
    "pattern_advice",
    "runs_at",
    "shape_bound",
]

POSITION_TILE = 64  # the position tile engines' attention kernels commonly use

# What the pattern of positions off says, for a shape's rule: ``True`` where off.
PositionAdvice = Callable[[npt.NDArray[np.bool_]], str]


@dataclass
class ReferenceRun:
    """The float64 reference's answers at one shape: the oracle of its rules."""

    stages: list[tuple[str, FloatArray]]
    logits: FloatArray
    loss: float
    gradients: dict[str, FloatArray]


@dataclass
class ShapeRuns:
    """One shape's inputs and, computed on first use, its runs."""

    shape: ScaleShape
    backend: Backend
    tokens: Any
    targets: Any
    _reference: ReferenceRun | None = None
    _model: Any = None
    _forward: ForwardOutput | None = None
    _loss: LossOutput | None = None
    _loss_error: BaseException | None = None
    _parameters: list[tuple[str, FloatArray]] = field(default_factory=list)

    @property
    def parameters(self) -> list[tuple[str, FloatArray]]:
        """The shape's parameters (``spec.variants``), drawn once."""
        if not self._parameters:
            shape = self.shape
            self._parameters = scenario_parameters(shape.config, shape.seed, shape.variant)
        return self._parameters

    def reference(self) -> ReferenceRun:
        """The float64 reference's answers (its model is dropped once they are taken)."""
        if self._reference is None:
            # Through its adapter: the suite itself imports no implementation.
            from conformance.adapters.reference import ReferenceBackend, release_buffers

            oracle = ReferenceBackend()
            model = oracle.build(self.shape.config, self.parameters)
            self._parameters = []  # the model holds its own copy; drawn again when needed
            forward = oracle.forward(model, self.tokens)  # its tape is gone once it returns
            loss = oracle.loss(model, self.tokens, self.targets)
            self._reference = ReferenceRun(
                forward.stages or [], forward.logits, loss.loss, loss.gradients or {}
            )
            del model, forward, loss
            gc.collect()
            release_buffers()  # the reference's reusable buffers go back before the backend runs
            return_freed_memory()
        return self._reference

    def model(self) -> Any:
        """The backend's model of the shape's parameters."""
        if self._model is None:
            self._model = self.backend.build(self.shape.config, self.parameters)
            self._parameters = []  # 1 GB at SmolLM2-135M's shape: drawn again if needed
            return_freed_memory()  # the conversions a build makes are gigabytes at this size
        return self._model

    def drop_model(self) -> None:
        """Let the backend's model go, to be built again if a later rule asks for it: a rule
        that builds a second model at this shape holds one model, not two (over llama.cpp's
        protocol server at SmolLM2-135M's shape, 1.2 GB of the server's peak)."""
        self._model = None
        gc.collect()
        return_freed_memory()

    def forward(self) -> ForwardOutput:
        """The backend's forward pass over the shape's tokens."""
        if self._forward is None:
            # A backend's loss pass is its largest: run it first, while the least is held
            # (hf-llama's reaches 7.5 GB over its model at SmolLM2-135M's shape).
            with contextlib.suppress(Exception, AdapterFault):  # the loss's rules report it
                self.loss()
            self._forward = self.backend.forward(self.model(), self.tokens)
            return_freed_memory()
        return self._forward

    def loss(self) -> LossOutput:
        """The backend's loss (and, with GRADIENTS, gradients) over the shape's tokens."""
        if self._loss is None:
            if self._loss_error is not None:
                raise self._loss_error
            try:
                self._loss = self.backend.loss(self.model(), self.tokens, self.targets)
            except (Exception, AdapterFault) as error:
                # Kept without its frames, which hold the adapter's activations.
                self._loss_error = error.with_traceback(None)
                raise
            finally:
                return_freed_memory()
        return self._loss

    def case(self, call: str = "backend.forward(model, tokens)", **notes: Any) -> Case:
        """The reproduction of a check: the shape's parameters and tokens come from
        ``spec.scale`` by name, not as literals (they are megabytes)."""
        fetch = (
            "import numpy as np\n"
            "from spec.scale import scale_shape\n"
            f"tokens, targets = scale_shape({self.shape.name!r}).tokens_and_targets()"
        )
        return Case(
            self.shape.config,
            self.shape.seed,
            call=f"{fetch}\n{call}",
            notes={"shape": self.shape.name, **notes},
            variant=self.shape.variant,
        )


def shape_bound(backend: Backend, name: str) -> Tolerance:
    """The bound of ``backend``'s precision at shape ``name``; the test is skipped (no
    verdict either way) where none was measured."""
    try:
        return scale_tolerance(backend.precision, name)
    except MissingScaleBound as missing:
        pytest.skip(str(missing))


_HELD: list[ShapeRuns] = []  # the current shape's runs only


def runs_at(name: str, backend: Backend) -> ShapeRuns:
    """The runs of shape ``name`` against ``backend``; another shape's are dropped first."""
    if _HELD and _HELD[0].shape.name == name and _HELD[0].backend is backend:
        return _HELD[0]
    _HELD.clear()
    gc.collect()
    return_freed_memory()
    shape = scale_shape(name)
    tokens, targets = shape.tokens_and_targets()
    runs = ShapeRuns(shape, backend, tokens, targets)
    _HELD.append(runs)
    return runs


def check_against_the_reference(
    backend: Backend, judge: Judge, name: str, advice: PositionAdvice
) -> None:
    """Shape ``name``'s stages, logits, loss and gradients (those the backend has) against the
    float64 reference at the shape's bound for the backend's precision. A failing stage or
    logits says which positions are off, and ``advice`` what their pattern points at."""
    bound = shape_bound(backend, name)
    runs = runs_at(name, backend)  # the reference runs first: its activations go first

    def hint(tolerance: float) -> Callable[[npt.ArrayLike, npt.ArrayLike], str]:
        def told(got: npt.ArrayLike, exact: npt.ArrayLike) -> str:
            flagged = off_at_each_position(got, exact, tolerance)
            if flagged is None or not flagged.any():
                return ""
            return f"{describe_positions(flagged)}; {advice(flagged)}"

        return told

    reference = runs.reference()
    output = runs.forward()
    check = judge.on(runs.case())
    if output.stages is not None:
        check.close_each(
            "stage", dict(output.stages), reference.stages, bound.stages, hint=hint(bound.stages)
        )
    check.close(
        "logits",
        output.logits,
        reference.logits,
        bound.logits,
        hint=lambda: hint(bound.logits)(output.logits, reference.logits),
    )
    check_loss_and_gradients(backend, judge, name)


def check_loss_and_gradients(
    backend: Backend,
    judge: Judge,
    name: str,
    advice: Callable[[set[str]], str] | None = None,
) -> None:
    """Shape ``name``'s loss and gradients (where the backend has them) against the float64
    reference at the shape's bounds; a failing gradient ends with ``advice`` on the set of
    gradients off."""
    bound = shape_bound(backend, name)
    runs = runs_at(name, backend)
    reference = runs.reference()
    result = runs.loss()
    check = judge.on(runs.case("backend.loss(model, tokens, targets)"))
    check.close("loss", result.loss, reference.loss, bound.loss)
    if Capability.GRADIENTS not in backend.capabilities:
        return
    gradients = result.gradients or {}

    def told(got: npt.ArrayLike, exact: npt.ArrayLike) -> str:
        assert advice is not None  # told is the hint only when there is advice
        off = {
            parameter
            for parameter, expected in reference.gradients.items()
            if parameter in gradients
            and not Judge.within(gradients[parameter], expected, bound.gradients)
        }
        return advice(off)

    check.close_each(
        "gradient of",
        gradients,
        reference.gradients.items(),
        bound.gradients,
        hint=None if advice is None else told,
    )


def pattern_advice(flagged: npt.NDArray[np.bool_], *, rope: str, otherwise: str) -> str:
    """What a pattern of positions off (``True`` where off) points at: RoPE when only position
    0 (angle 0, attending to itself alone) is right, a tile when only positions past the
    first tile are off, else ``otherwise``; ``rope`` says what to look for in RoPE."""
    if not flagged[0] and flagged[1:].all():
        return (
            "position 0 is right and every later one off: position 0 attends to itself alone, "
            f"at RoPE angle 0, so look at RoPE {rope}"
        )
    if flagged.size > POSITION_TILE and not flagged[:POSITION_TILE].any():
        return (
            f"only positions from {POSITION_TILE} on are off: look for a tile of "
            f"{POSITION_TILE} positions (its last, partial block)"
        )
    return otherwise
