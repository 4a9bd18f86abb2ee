"""Every error kind: triggered, classified, its values attached, and nothing changed.

Each case names an action on a prepared model; the harness snapshots the random stream,
every parameter value and every accumulated gradient before the action and compares
them bitwise afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from impl.errors import BlockFailure, DecoderModelError, FinalNormFailure
from impl.model import DecoderModel
from spec.config import FIXTURE, DecoderConfig
from spec.errors import ErrorCategory, ErrorKind
from spec.parameters import parameter_layout
from spec.recipe import SplitMix64

CONFIG = FIXTURE.config
TOKENS = FIXTURE.tokens
TARGETS = FIXTURE.targets


@dataclass
class World:
    """The state a rejected call must leave untouched."""

    stream: SplitMix64
    model: DecoderModel
    state: list[tuple[str, np.ndarray[Any, Any]]] = field(default_factory=list)

    def snapshot(self) -> tuple[int, list[bytes], list[bytes | None]]:
        values = [p.tensor.value.tobytes() for p in self.model.parameters()]
        grads = [
            None if p.tensor.grad is None else p.tensor.grad.tobytes()
            for p in self.model.parameters()
        ]
        return self.stream.state, values, grads


def prepared_world() -> World:
    stream = SplitMix64(FIXTURE.seed)
    model = DecoderModel.initialize(CONFIG, stream)
    model.loss(TOKENS, TARGETS).backward()  # gradients exist, so "unchanged" means something
    return World(stream=stream, model=model, state=model.state())


def build(config: DecoderConfig) -> Callable[[World], object]:
    return lambda world: DecoderModel.initialize(config, world.stream)


def rebuild(
    edit: Callable[[list[Any]], list[Any]], config: DecoderConfig = CONFIG
) -> Callable[[World], object]:
    return lambda world: DecoderModel.from_parameters(config, edit(list(world.state)))


def replace_entry(index: int, value: object) -> Callable[[list[Any]], list[Any]]:
    def edit(entries: list[Any]) -> list[Any]:
        entries[index] = value
        return entries

    return edit


def replace_value(index: int, value: object) -> Callable[[list[Any]], list[Any]]:
    def edit(entries: list[Any]) -> list[Any]:
        entries[index] = (entries[index][0], value)
        return entries

    return edit


def with_config(**changes: Any) -> DecoderConfig:
    return dataclasses.replace(CONFIG, **changes)


ZERO_ROW_TABLE = np.array(dict(prepared_world().state)["token_embedding.weight"])
ZERO_ROW_TABLE[0] = 0.0


def zero_row_model(layers: int) -> Callable[[World], object]:
    """Epsilon 0 and an all-zero table row: the first RMSNorm on that row must refuse."""
    config = with_config(rms_epsilon=0.0, layers=layers)

    def action(world: World) -> object:
        entries = [(name, np.ones(shape)) for name, shape in parameter_layout(config)]
        entries[0] = ("token_embedding.weight", ZERO_ROW_TABLE)
        return DecoderModel.from_parameters(config, entries).forward(TOKENS)

    return action


def _released_loss(world: World) -> Any:
    loss = world.model.loss(TOKENS, TARGETS)
    loss.backward(retain_graph=False)
    world.model.zero_grad()
    world.model.loss(TOKENS, TARGETS).backward()  # gradients exist again, to prove untouched
    return loss


# (case id, action, kind, expected attributes)
CASES: list[tuple[str, Callable[[World], object], ErrorKind, dict[str, Any]]] = [
    ("float-field", build(with_config(heads=2.0)), ErrorKind.CONFIG_FIELD_TYPE, {"field": "heads"}),
    (
        "bool-field",
        build(with_config(layers=True)),
        ErrorKind.CONFIG_FIELD_TYPE,
        {"field": "layers"},
    ),
    (
        "negative-field",
        build(with_config(context=-1)),
        ErrorKind.CONFIG_FIELD_TYPE,
        {"field": "context", "actual": -1},
    ),
    (
        "string-epsilon",
        build(with_config(rms_epsilon="0")),
        ErrorKind.CONFIG_FIELD_TYPE,
        {"field": "rms_epsilon"},
    ),
    ("zero-vocabulary", build(with_config(vocabulary_size=0)), ErrorKind.EMPTY_VOCABULARY, {}),
    ("zero-width", build(with_config(model_width=0)), ErrorKind.ZERO_MODEL_WIDTH, {}),
    ("zero-heads", build(with_config(heads=0)), ErrorKind.ZERO_HEAD_COUNT, {}),
    (
        "indivisible",
        build(with_config(heads=3)),
        ErrorKind.MODEL_WIDTH_NOT_DIVISIBLE,
        {"model_width": 4, "heads": 3},
    ),
    (
        "odd-head-width",
        build(with_config(model_width=6, heads=2)),
        ErrorKind.ODD_HEAD_WIDTH,
        {"head_width": 3},
    ),
    ("zero-ffn", build(with_config(feed_forward_width=0)), ErrorKind.ZERO_FEED_FORWARD_WIDTH, {}),
    ("zero-context", build(with_config(context=0)), ErrorKind.ZERO_CONTEXT_CAPACITY, {}),
    (
        "infinite-rope",
        build(with_config(rope_base=float("inf"))),
        ErrorKind.INVALID_ROPE_BASE,
        {"value": float("inf")},
    ),
    (
        "negative-rope",
        build(with_config(rope_base=-1.0)),
        ErrorKind.INVALID_ROPE_BASE,
        {"value": -1.0},
    ),
    (
        "negative-epsilon",
        build(with_config(rms_epsilon=-1e-9)),
        ErrorKind.INVALID_RMS_EPSILON,
        {"value": -1e-9},
    ),
    (
        "depth0-still-validated",
        build(with_config(layers=0, heads=0)),
        ErrorKind.ZERO_HEAD_COUNT,
        {},
    ),
    (
        "precedence-first-rule-wins",
        build(with_config(model_width=0, context=0)),
        ErrorKind.ZERO_MODEL_WIDTH,
        {},
    ),
    (
        "too-many-scalars",
        build(with_config(vocabulary_size=2**40)),
        ErrorKind.PARAMETER_ALLOCATION_FAILED,
        {"scalars": 2**42 + 2 * 120 + 4},
    ),
    (
        "rebuild-bad-config",
        rebuild(lambda e: e, with_config(heads=0)),
        ErrorKind.ZERO_HEAD_COUNT,
        {},
    ),
    (
        "missing-tensor",
        rebuild(lambda e: e[:-1]),
        ErrorKind.PARAMETER_COUNT_MISMATCH,
        {"expected": 20, "actual": 19},
    ),
    (
        "extra-tensor",
        rebuild(lambda e: [*e, ("extra.weight", np.ones(1))]),
        ErrorKind.PARAMETER_COUNT_MISMATCH,
        {"expected": 20, "actual": 21},
    ),
    (
        "renamed",
        rebuild(replace_entry(9, ("blocks.0.ffn.down.bias", np.ones((4, 4))))),
        ErrorKind.PARAMETER_NAME_MISMATCH,
        {"index": 9, "expected": "blocks.0.ffn.down.weight", "actual": "blocks.0.ffn.down.bias"},
    ),
    (
        "swapped-order",
        rebuild(lambda e: [e[0], e[2], e[1], *e[3:]]),
        ErrorKind.PARAMETER_NAME_MISMATCH,
        {"index": 1, "expected": "blocks.0.attention_norm.gain"},
    ),
    (
        "names-before-shapes",
        rebuild(lambda e: [(e[0][0], np.ones(3)), *e[1:-1], ("lm_head.weight", e[-1][1])]),
        ErrorKind.PARAMETER_NAME_MISMATCH,
        {"index": 19},
    ),
    (
        "misshaped",
        rebuild(replace_value(7, np.ones((4, 5)))),
        ErrorKind.PARAMETER_SHAPE_MISMATCH,
        {"index": 7, "expected": (4, 4), "actual": (4, 5)},
    ),
    (
        "string-values",
        rebuild(replace_value(19, np.array(["a"] * 4))),
        ErrorKind.PARAMETER_DTYPE,
        {"index": 19, "name": "final_norm.gain"},
    ),
    (
        "ragged-values",
        rebuild(replace_value(19, [[1.0], [1.0, 2.0]])),
        ErrorKind.PARAMETER_DTYPE,
        {"index": 19},
    ),
    (
        "nan-value",
        rebuild(replace_value(1, np.array([1.0, np.nan, 1.0, 1.0]))),
        ErrorKind.PARAMETER_NOT_FINITE,
        {"index": 1, "position": 1},
    ),
    (
        "float-tokens",
        lambda w: w.model.forward([[0.0, 1.0]]),
        ErrorKind.TOKEN_DTYPE,
        {"what": "token IDs"},
    ),
    ("ragged-tokens", lambda w: w.model.forward([[0, 1], [2]]), ErrorKind.TOKEN_DTYPE, {}),
    (
        "negative-shape",
        lambda w: w.model.forward([0, 1], shape=(-1, 2)),
        ErrorKind.TOKEN_DTYPE,
        {"what": "token shape"},
    ),
    ("rank-one", lambda w: w.model.forward([0, 1, 2]), ErrorKind.TOKEN_RANK, {"rank": 1}),
    ("rank-three", lambda w: w.model.forward([[[0, 1, 2]]]), ErrorKind.TOKEN_RANK, {"rank": 3}),
    (
        "empty-batch",
        lambda w: w.model.forward(np.zeros((0, 3), dtype=int)),
        ErrorKind.EMPTY_BATCH,
        {},
    ),
    ("empty-tokens", lambda w: w.model.forward([[]]), ErrorKind.EMPTY_TOKENS, {}),
    (
        "too-long",
        lambda w: w.model.forward([[0, 1, 2, 3, 4]]),
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        {"tokens": 5, "context": 4},
    ),
    (
        "context-before-ids",
        lambda w: w.model.forward([[9, 9, 9, 9, 9]]),
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        {},
    ),
    (
        "count-overflow",
        lambda w: DecoderModel.from_seed(with_config(context=2**62), 0).forward(
            [0], shape=(2**62, 2**62)
        ),
        ErrorKind.TOKEN_COUNT_OVERFLOW,
        {"batch": 2**62, "tokens": 2**62},
    ),
    (
        "count-mismatch",
        lambda w: w.model.forward([0, 1, 2], shape=(2, 2)),
        ErrorKind.TOKEN_COUNT_MISMATCH,
        {"expected": 4, "actual": 3},
    ),
    (
        "token-id-equals-vocabulary",
        lambda w: w.model.forward([[0, 5, 1]]),
        ErrorKind.TOKEN_ID_OUT_OF_BOUNDS,
        {"position": 1, "id": 5, "vocabulary_size": 5},
    ),
    (
        "negative-token-id",
        lambda w: w.model.forward([[0, 1], [-2, 9]]),
        ErrorKind.TOKEN_ID_OUT_OF_BOUNDS,
        {"position": 2, "id": -2},
    ),
    (
        "target-count-before-token-id",
        lambda w: w.model.loss([[0, 5, 1]], [[1]]),
        ErrorKind.TARGET_COUNT_MISMATCH,
        {"expected": 3, "actual": 1},
    ),
    (
        "target-id-before-token-id",
        lambda w: w.model.loss([[0, 5, 1]], [[1, 7, 2]]),
        ErrorKind.TARGET_ID_OUT_OF_BOUNDS,
        {"position": 1, "id": 7},
    ),
    (
        "target-dtype-before-token-id",
        lambda w: w.model.loss([[0, 5, 1]], [[1.0, 2.0, 3.0]]),
        ErrorKind.TARGET_DTYPE,
        {},
    ),
    (
        "token-id-after-valid-targets",
        lambda w: w.model.loss([[0, 5, 1]], TARGETS),
        ErrorKind.TOKEN_ID_OUT_OF_BOUNDS,
        {"position": 1, "id": 5},
    ),
    (
        "token-shape-before-targets",
        lambda w: w.model.loss([[0, 1, 2, 3, 4]], [[9]]),
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        {},
    ),
    (
        "float-targets",
        lambda w: w.model.loss(TOKENS, [[1.0, 2.0, 3.0]]),
        ErrorKind.TARGET_DTYPE,
        {},
    ),
    (
        "missing-target",
        lambda w: w.model.loss(TOKENS, [[1, 2]]),
        ErrorKind.TARGET_COUNT_MISMATCH,
        {"expected": 3, "actual": 2},
    ),
    (
        "extra-targets-in-any-shape",
        lambda w: w.model.loss([[0, 1], [2, 3]], [[1, 2, 3], [4, 0, 1]]),
        ErrorKind.TARGET_COUNT_MISMATCH,
        {"expected": 4, "actual": 6, "shape": (2, 3)},
    ),
    (
        "target-id-equals-vocabulary",
        lambda w: w.model.loss(TOKENS, [1, 5, 9]),
        ErrorKind.TARGET_ID_OUT_OF_BOUNDS,
        {"position": 1, "id": 5, "vocabulary_size": 5},
    ),
    (
        "zero-row-block",
        zero_row_model(layers=1),
        ErrorKind.RMS_ZERO_MEAN_SQUARE,
        {"layer": 0, "component": "attention RMSNorm"},
    ),
    ("zero-row-final", zero_row_model(layers=0), ErrorKind.RMS_ZERO_MEAN_SQUARE, {}),
    (
        "backward-after-release",
        lambda w: _released_loss(w).backward(),
        ErrorKind.GRAPH_RELEASED,
        {"operation": "indexed_mean_nll"},
    ),
    (
        "backward-non-scalar",
        lambda w: w.model.forward(TOKENS).logits.backward(),
        ErrorKind.BACKWARD_SEED_SHAPE,
        {"expected": (1, 3, 5), "actual": None},
    ),
]


@pytest.mark.parametrize(
    ("action", "kind", "attributes"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_refusal_has_kind_attributes_and_changes_nothing(
    action: Callable[[World], object], kind: ErrorKind, attributes: dict[str, Any]
) -> None:
    world = prepared_world()
    before = world.snapshot()
    with pytest.raises(DecoderModelError) as caught:
        action(world)
    error = caught.value
    assert error.kind is kind, f"kind={error.kind}, but should be {kind} [{error}]"
    assert isinstance(error, ValueError)
    for name, expected in attributes.items():
        assert getattr(error, name) == expected, (
            f"{name}={getattr(error, name)!r}, but should be {expected!r}"
        )
    assert str(error), "the message must say what was wrong"
    assert world.snapshot() == before, (
        "a refused call changed the stream, a parameter or a gradient"
    )


def test_every_error_kind_has_a_case() -> None:
    covered = {case[2] for case in CASES}
    assert covered == set(ErrorKind), f"kinds without a case: {sorted(set(ErrorKind) - covered)}"


def test_wrapped_norm_failures_keep_their_source() -> None:
    world = prepared_world()
    with pytest.raises(BlockFailure) as block:
        zero_row_model(layers=2)(world)
    assert block.value.source.kind is ErrorKind.RMS_ZERO_MEAN_SQUARE
    assert block.value.__cause__ is block.value.source
    assert str(block.value).startswith("decoder block 0 attention RMSNorm: RMSNorm row 0")
    with pytest.raises(FinalNormFailure) as final:
        zero_row_model(layers=0)(world)
    assert str(final.value).startswith("final RMSNorm: RMSNorm row 0")


@pytest.mark.parametrize(
    ("example", "category"),
    [
        (
            lambda w: DecoderModel.initialize(with_config(heads=0), w.stream),
            ErrorCategory.CONFIGURATION,
        ),
        (lambda w: w.model.forward([[0, 1, 2, 3, 4]]), ErrorCategory.CONTEXT),
        (lambda w: w.model.forward([[0, 1, 5]]), ErrorCategory.VOCABULARY_INPUT),
        (lambda w: w.model.loss(TOKENS, [[1, 2]]), ErrorCategory.TARGET_SHAPE),
    ],
    ids=["zero-heads", "token-length-above-capacity", "token-id-V", "one-missing-target"],
)
def test_seed_worked_classification(
    example: Callable[[World], object], category: ErrorCategory
) -> None:
    """The seed's four examples: configuration, context, vocabulary-input, target-shape."""
    with pytest.raises(DecoderModelError) as caught:
        example(prepared_world())
    assert caught.value.category is category


@pytest.mark.parametrize(("scale", "refused"), [(0.0, True), (1e-170, True), (1e-150, False)])
def test_zero_mean_square_is_the_float64_mean_of_squares(scale: float, refused: bool) -> None:
    """With epsilon 0 the recipe refuses a row whose mean square is exactly 0: all zeros, or
    values whose squares underflow (1e-170 squared is 1e-340, below the smallest float64)."""
    config = with_config(rms_epsilon=0.0, layers=0)
    entries = [(name, np.ones(shape)) for name, shape in parameter_layout(config)]
    entries[0] = ("token_embedding.weight", np.full((5, 4), scale))
    model = DecoderModel.from_parameters(config, entries)
    if refused:
        with pytest.raises(FinalNormFailure) as caught:
            model.forward(TOKENS)
        assert caught.value.source.kind is ErrorKind.RMS_ZERO_MEAN_SQUARE
    else:
        assert np.all(np.isfinite(model.forward(TOKENS).logits.value))


def test_token_count_overflows_past_the_seeds_unsigned_64_bit_size() -> None:
    """The seed counts B*T in a usize: 3 * 2**62 still fits (a count mismatch), 2**64 not."""
    model = DecoderModel.from_seed(with_config(context=2**62, layers=0), 0)
    with pytest.raises(DecoderModelError) as fits:
        model.forward([0], shape=(3, 2**62))
    assert fits.value.kind is ErrorKind.TOKEN_COUNT_MISMATCH
    with pytest.raises(DecoderModelError) as overflows:
        model.forward([0], shape=(4, 2**62))
    assert overflows.value.kind is ErrorKind.TOKEN_COUNT_OVERFLOW


def test_targets_are_counted_not_shaped() -> None:
    """The seed takes its targets as one flat list: B*T IDs in any shape are one per token."""
    model = prepared_world().model
    tokens = [[0, 1], [2, 3]]
    expected = float(model.loss(tokens, [[1, 2], [3, 4]]).value)
    for targets in ([1, 2, 3, 4], [[1, 2, 3, 4]], [[1], [2], [3], [4]], [[[1, 2]], [[3, 4]]]):
        assert float(model.loss(tokens, targets).value) == expected, targets


def test_messages_name_field_expectation_and_value() -> None:
    world = prepared_world()
    with pytest.raises(DecoderModelError) as caught:
        DecoderModel.from_parameters(
            CONFIG,
            [*world.state[:7], ("blocks.0.ffn.gate.weight", np.ones((4, 5))), *world.state[8:]],
        )
    assert (
        str(caught.value)
        == "decoder parameter 7 (blocks.0.ffn.gate.weight) must have shape [4, 4], got [4, 5]"
    )
    with pytest.raises(DecoderModelError) as caught:
        DecoderModel.initialize(with_config(heads=2.5), world.stream)
    assert (
        str(caught.value)
        == "decoder config field heads must be a non-negative integer, got float 2.5"
    )
