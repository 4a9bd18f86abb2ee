"""Every error kind: triggered, classified, its values attached, and nothing changed.

Each case names an action on a prepared model; the harness snapshots the random stream,
every parameter value and every accumulated gradient before the action and compares
them bitwise afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from impl.errors import BlockFailure, DecoderModelError, FinalNormFailure
from impl.evidence import collect_evidence
from impl.model import DecoderModel
from impl.resources import MEMORY_LIMIT_VARIABLE
from spec.config import FIXTURE, DecoderConfig
from spec.errors import ErrorCategory, ErrorKind
from spec.evidence import fixture_for
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


@contextlib.contextmanager
def memory_limit(limit: str) -> Iterator[None]:
    """``DECODER_CONFORMANCE_MEMORY_LIMIT=limit`` for the block: refusals that do not depend
    on the machine the tests run on."""
    previous = os.environ.get(MEMORY_LIMIT_VARIABLE)
    os.environ[MEMORY_LIMIT_VARIABLE] = limit
    try:
        yield
    finally:
        if previous is None:
            del os.environ[MEMORY_LIMIT_VARIABLE]
        else:
            os.environ[MEMORY_LIMIT_VARIABLE] = previous


def limited(limit: str, action: Callable[[World], object]) -> Callable[[World], object]:
    """``action`` under a memory limit (the world is prepared without one)."""

    def run(world: World) -> object:
        with memory_limit(limit):
            return action(world)

    return run


def seeded(seed: object, config: DecoderConfig = CONFIG) -> Callable[[World], object]:
    return lambda world: DecoderModel.from_seed(config, seed)  # type: ignore[arg-type]


LONG_CONTEXT = 30_000
# T = 30000 at the fixture's two heads: 2 x 30000^2 float64 attention weights per block,
# 29 GB in all, far above the 1 GiB the long-context cases run under.
LONG_MODEL = DecoderModel.from_seed(with_config(context=LONG_CONTEXT), FIXTURE.seed)


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
    (
        "huge-int-rope-base",
        build(with_config(rope_base=10**400)),
        ErrorKind.CONFIG_FIELD_TYPE,
        {"field": "rope_base", "actual": 10**400},
    ),
    (
        "huge-negative-int-epsilon",
        build(with_config(rms_epsilon=-(10**400))),
        ErrorKind.CONFIG_FIELD_TYPE,
        {"field": "rms_epsilon"},
    ),
    (
        "int-just-past-float64",
        build(with_config(rope_base=2**1024 - 2**970)),
        ErrorKind.CONFIG_FIELD_TYPE,
        {"field": "rope_base"},
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
    ("negative-seed", seeded(-1), ErrorKind.INVALID_SEED, {"field": "seed", "actual": -1}),
    ("seed-2-to-64", seeded(2**64), ErrorKind.INVALID_SEED, {"actual": 2**64}),
    ("string-seed", seeded("7"), ErrorKind.INVALID_SEED, {"actual": "7"}),
    ("float-seed", seeded(7.0), ErrorKind.INVALID_SEED, {"actual": 7.0}),
    ("bool-seed", seeded(True), ErrorKind.INVALID_SEED, {"actual": True}),
    ("none-seed", seeded(None), ErrorKind.INVALID_SEED, {"actual": None}),
    ("huge-seed", seeded(10**400), ErrorKind.INVALID_SEED, {"field": "seed"}),
    (
        "configuration-before-seed",
        seeded(-1, with_config(heads=0)),
        ErrorKind.ZERO_HEAD_COUNT,
        {},
    ),
    (
        "seed-before-resources",
        seeded(-1, with_config(vocabulary_size=2**40)),
        ErrorKind.INVALID_SEED,
        {},
    ),
    (
        "not-a-stream",
        lambda w: DecoderModel.initialize(CONFIG, 7),  # type: ignore[arg-type]
        ErrorKind.INVALID_SEED,
        {"field": "stream", "actual": 7},
    ),
    (
        "too-many-scalars",
        build(with_config(vocabulary_size=2**40)),
        ErrorKind.PARAMETER_ALLOCATION_FAILED,
        {"scalars": 2**42 + 2 * 120 + 4, "reason": "scalar-limit"},
    ),
    (
        "parameters-above-memory-limit",
        limited("1M", build(with_config(vocabulary_size=20_000, model_width=1_000, heads=10))),
        ErrorKind.PARAMETER_ALLOCATION_FAILED,
        {"reason": "memory-limit", "limit_bytes": 2**20, "limit_source": MEMORY_LIMIT_VARIABLE},
    ),
    (
        "rebuild-above-memory-limit",
        limited("1K", rebuild(lambda e: e)),
        ErrorKind.PARAMETER_ALLOCATION_FAILED,
        {"reason": "memory-limit", "limit_bytes": 1024},
    ),
    (
        "rebuild-counts-before-listing-a-huge-depth",
        rebuild(lambda e: e, with_config(layers=2**40)),
        ErrorKind.PARAMETER_COUNT_MISMATCH,
        {"expected": 2 + 9 * 2**40, "actual": 20},
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
        "forward-above-memory-limit",
        limited("1G", lambda w: LONG_MODEL.forward(np.zeros((1, LONG_CONTEXT), dtype=np.int64))),
        ErrorKind.ACTIVATION_ALLOCATION_FAILED,
        {"operation": "a forward pass", "batch": 1, "tokens": LONG_CONTEXT, "limit_bytes": 2**30},
    ),
    (
        "loss-above-memory-limit",
        limited("100K", lambda w: w.model.loss(TOKENS, TARGETS)),
        ErrorKind.ACTIVATION_ALLOCATION_FAILED,
        {"operation": "a loss and its backward pass", "tokens": 3},
    ),
    (
        "token-ids-before-memory",
        limited("1K", lambda w: w.model.forward([[0, 5, 1]])),
        ErrorKind.TOKEN_ID_OUT_OF_BOUNDS,
        {},
    ),
    (
        "targets-before-memory",
        limited("1K", lambda w: w.model.loss(TOKENS, [[1, 2]])),
        ErrorKind.TARGET_COUNT_MISMATCH,
        {},
    ),
    (
        "context-before-memory",
        limited("1K", lambda w: w.model.forward([[0, 1, 2, 3, 4]])),
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        {},
    ),
    (
        "trace-context-probe-above-memory-limit",
        limited(
            "1G",
            lambda w: collect_evidence(
                fixture_for(with_config(context=60_000), FIXTURE.seed, TOKENS, TARGETS)
            ),
        ),
        ErrorKind.ACTIVATION_ALLOCATION_FAILED,
        {"operation": "the trace's context probe (a forward pass)", "tokens": 60_000},
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


def test_messages_of_seeds_huge_reals_and_resources() -> None:
    """Each names the field or the operation, the expectation, and what arrived."""
    world = prepared_world()
    expected = {
        "huge-int-rope-base": (
            "decoder config field rope_base must be a real number representable as a float64,"
            " got int of about 10^400"
        ),
        "negative-seed": "decoder seed must be an integer in [0, 2**64 - 1], got int -1",
        "string-seed": "decoder seed must be an integer in [0, 2**64 - 1], got str '7'",
        "not-a-stream": "decoder stream must be a spec.recipe.SplitMix64, got int 7",
        "too-many-scalars": (
            "decoder parameters: 4398046511348 scalars cannot be allocated; "
            "at most 2147483648 are allowed"
        ),
        "parameters-above-memory-limit": (
            "decoder parameters: 28029000 scalars (within the 2147483648-scalar limit) need "
            "about 584.5 MiB with their gradients; the limit is 1.0 MiB "
            "(DECODER_CONFORMANCE_MEMORY_LIMIT)"
        ),
        "forward-above-memory-limit": (
            "a forward pass over 1 x 30000 tokens needs about 29.4 GiB of working memory; "
            "the limit is 1.0 GiB (DECODER_CONFORMANCE_MEMORY_LIMIT)"
        ),
    }
    actions = {case[0]: case[1] for case in CASES}
    for case, message in expected.items():
        with pytest.raises(DecoderModelError) as caught:
            actions[case](world)
        assert str(caught.value) == message, case


def test_the_attention_weights_alone_exceed_what_a_long_forward_was_refused_for() -> None:
    """The refusal's estimate is no invention: the kept weights alone are 2 x T^2 per block."""
    with memory_limit("1G"), pytest.raises(DecoderModelError) as caught:
        LONG_MODEL.forward(np.zeros((1, LONG_CONTEXT), dtype=np.int64))
    weights = CONFIG.layers * CONFIG.heads * LONG_CONTEXT**2 * 8
    assert weights <= caught.value.needed_bytes <= 2 * weights  # type: ignore[attr-defined]


# Refusals of sizes far beyond the bound: each must come at once and allocate next to nothing.
QUICK_REFUSALS = [
    "huge-int-rope-base",
    "negative-seed",
    "seed-before-resources",
    "too-many-scalars",
    "parameters-above-memory-limit",
    "forward-above-memory-limit",
    "trace-context-probe-above-memory-limit",
]


@pytest.mark.parametrize("case", QUICK_REFUSALS)
def test_refusals_are_quick_and_allocate_nothing(case: str) -> None:
    action = {entry[0]: entry[1] for entry in CASES}[case]
    world = prepared_world()
    best = math.inf
    for _ in range(3):  # the best of three: the machine may be busy
        tracemalloc.start()
        started = time.perf_counter()
        with pytest.raises(DecoderModelError) as caught:
            action(world)
        best = min(best, time.perf_counter() - started)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    refused = getattr(caught.value, "needed_bytes", 0) or 2**30
    assert best < 0.1, f"{case}: refused after {best:.3f} s"
    assert peak < min(refused // 100, 4 * 2**20), f"{case}: allocated {peak} bytes to refuse"


def test_running_out_anyway_is_reported_with_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MemoryError past the estimate (a busy machine) is the resource kind, saying the
    machine ran out, and still changes nothing."""

    def exhausted(*arguments: object, **keywords: object) -> object:
        raise MemoryError

    world = prepared_world()
    before = world.snapshot()
    monkeypatch.setattr("impl.model.initial_parameters", exhausted)
    with pytest.raises(DecoderModelError) as building:
        DecoderModel.initialize(CONFIG, world.stream)
    assert building.value.kind is ErrorKind.PARAMETER_ALLOCATION_FAILED
    assert str(building.value).startswith(
        "the machine ran out of memory while allocating the decoder's 264 parameter scalars"
    )
    monkeypatch.setattr(DecoderModel, "_forward", exhausted)
    for run in (lambda: world.model.forward(TOKENS), lambda: world.model.loss(TOKENS, TARGETS)):
        with pytest.raises(DecoderModelError) as running:
            run()
        assert running.value.kind is ErrorKind.ACTIVATION_ALLOCATION_FAILED
        assert str(running.value).startswith("the machine ran out of memory during a ")
        assert running.value.reason == "out-of-memory"  # type: ignore[attr-defined]
    assert world.snapshot() == before


def test_trace_of_a_huge_context_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``decoder-conformance trace --context 60000``: refused before any probe is built."""
    from conformance.cli import main

    with memory_limit("1G"):
        tracemalloc.start()
        status = main(["trace", "--context", "60000"])
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "context probe (a forward pass) over 1 x 60000 tokens needs about" in captured.err
    assert captured.err.rstrip().endswith("[activation-allocation-failed]")
    assert peak < 16 * 2**20


def test_an_adapter_trace_shows_a_context_it_cannot_hold_as_unavailable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Through the adapter the trace goes on: a resource refusal of the full-context probe
    is no broken context rule, so that one flag reads ``unavailable``, not ``false``."""
    from conformance.cli import main

    with memory_limit("1G"):
        status = main(["trace", "--adapter", "reference", "--context", "60000"])
    depths = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("depths ")
    )
    assert status == 0
    assert "context_limit=unavailable" in depths
    assert "configuration_errors=true" in depths
