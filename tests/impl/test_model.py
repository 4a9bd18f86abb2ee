"""The reference model's structure: names, counts, tying, recipe, determinism, causality."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from impl.layers import NamedParameter
from impl.model import DecoderModel
from spec import strategies
from spec.config import FIXTURE, DecoderConfig
from spec.parameters import parameter_count, parameter_layout, parameter_names
from spec.recipe import GOLDEN_GAMMA, SplitMix64
from tests.helpers import central_difference, max_symmetric_error

CONFIG = FIXTURE.config


def test_fixture_structure() -> None:
    model = DecoderModel.from_seed(CONFIG, FIXTURE.seed)
    names = model.parameter_names()
    assert names == parameter_names(CONFIG)
    assert (len(names), names[0], names[9], names[-1]) == (
        20,
        "token_embedding.weight",
        "blocks.0.ffn.down.weight",
        "final_norm.gain",
    )
    assert model.parameter_count() == 264 == parameter_count(CONFIG)
    assert parameter_count(CONFIG, tied=False) == 284
    assert not any("bias" in name or "lm_head" in name for name in names)
    assert [p.shape for p in model.parameters()] == [shape for _, shape in parameter_layout(CONFIG)]
    forward = model.forward(FIXTURE.tokens)
    assert [stage.shape for _, stage in forward.stages()] == [(1, 3, 4)] * 4
    assert forward.logits.shape == (1, 3, 5)


def test_one_leaf_serves_lookup_and_head() -> None:
    model = DecoderModel.from_seed(CONFIG, FIXTURE.seed)
    forward = model.forward(FIXTURE.tokens)
    table = model.parameters()[0].tensor
    assert forward.lookup_table.is_same_node(table)
    assert forward.head_table.is_same_node(table)
    assert model.tied_embedding.name == "token_embedding.weight"


@given(config=strategies.configs(), data=st.data())
def test_tied_gradient_is_lookup_plus_output_role(
    config: DecoderConfig, data: st.DataObject
) -> None:
    tokens = data.draw(strategies.token_batches(config))
    targets = data.draw(st.integers(0, 2**32 - 1)) % config.vocabulary_size * np.ones_like(tokens)
    gradients = []
    for detach_lookup, detach_head in ((False, False), (False, True), (True, False)):
        model = DecoderModel.from_seed(config, 5)
        model.loss(tokens, targets, detach_lookup=detach_lookup, detach_head=detach_head).backward()
        gradient = model.tied_embedding.tensor.grad
        gradients.append(
            np.zeros((config.vocabulary_size, config.model_width)) if gradient is None else gradient
        )
    full, lookup_role, output_role = gradients
    assert max_symmetric_error(full, lookup_role + output_role) <= 1e-14
    # Rows never looked up get gradient only from the output role.
    unused = np.setdiff1d(np.arange(config.vocabulary_size), tokens)
    assert np.all(lookup_role[unused] == 0.0)


def test_the_tie_is_one_node_and_a_rebuild_makes_new_ones() -> None:
    """Both uses of the table are the model's one leaf; a rebuilt model owns new leaves with
    equal values, so its gradients never reach the original's."""
    model = DecoderModel.from_seed(CONFIG, FIXTURE.seed)
    table = model.tied_embedding.tensor
    forward = model.forward(FIXTURE.tokens)
    assert forward.lookup_table.is_same_node(table) and forward.head_table.is_same_node(table)
    rebuilt = DecoderModel.from_parameters(CONFIG, model.state())
    assert not rebuilt.tied_embedding.tensor.is_same_node(table)
    np.testing.assert_array_equal(rebuilt.tied_embedding.tensor.value, table.value)
    rebuilt.loss(FIXTURE.tokens, FIXTURE.targets).backward()
    assert rebuilt.tied_embedding.tensor.grad is not None
    assert all(grad is None for grad in model.gradients().values())


def test_stream_advances_by_exactly_the_matrix_scalars() -> None:
    stream = SplitMix64(FIXTURE.seed)
    DecoderModel.initialize(CONFIG, stream)
    matrices = sum(int(np.prod(shape)) for _, shape in parameter_layout(CONFIG) if len(shape) == 2)
    assert matrices == 264 - 4 * 5
    assert stream.state == (FIXTURE.seed + matrices * GOLDEN_GAMMA) % 2**64


def test_initialization_follows_the_recipe_scalar_by_scalar() -> None:
    """A plain per-scalar SplitMix64/Xavier loop, written here, gives the same parameters."""
    mask = 2**64 - 1
    state = FIXTURE.seed

    def next_unit() -> float:
        nonlocal state
        state = (state + GOLDEN_GAMMA) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return ((z ^ (z >> 31)) >> 11) * 2.0**-53

    model = DecoderModel.from_seed(CONFIG, FIXTURE.seed)
    for parameter in model.parameters():
        value = parameter.tensor.value
        if value.ndim == 1:
            assert np.all(value == 1.0), parameter.name
            continue
        fan_in, fan_out = value.shape
        limit = (6.0 / (fan_in + fan_out)) ** 0.5
        expected = [limit * (2.0 * next_unit() - 1.0) for _ in range(value.size)]
        assert value.ravel().tolist() == expected, parameter.name


def test_published_embedding_row() -> None:
    """The trace's first lookup row, to its six printed decimals."""
    model = DecoderModel.from_seed(CONFIG, FIXTURE.seed)
    row = model.forward(FIXTURE.tokens).embedding.value[0, 0]
    assert [f"{v:.6f}" for v in row] == ["0.682029", "0.153556", "-0.351563", "0.356056"]


@given(config=strategies.configs(), seed=st.integers(0, 2**64 - 1), data=st.data())
def test_same_config_and_seed_replay_bitwise(
    config: DecoderConfig, seed: int, data: st.DataObject
) -> None:
    tokens = data.draw(strategies.token_batches(config))
    first, second = DecoderModel.from_seed(config, seed), DecoderModel.from_seed(config, seed)
    for a, b in zip(first.state(), second.state(), strict=True):
        assert a[0] == b[0] and a[1].tobytes() == b[1].tobytes()
    assert (
        first.forward(tokens).logits.value.tobytes()
        == second.forward(tokens).logits.value.tobytes()
    )


@given(config=strategies.configs(), data=st.data())
def test_changing_token_t_leaves_earlier_rows_bitwise_unchanged(
    config: DecoderConfig, data: st.DataObject
) -> None:
    tokens = data.draw(strategies.token_batches(config))
    position = data.draw(st.integers(0, tokens.shape[1] - 1))
    changed = tokens.copy()
    changed[:, position] = (changed[:, position] + 1) % config.vocabulary_size
    model = DecoderModel.from_seed(config, 11)
    before, after = model.forward(tokens).logits.value, model.forward(changed).logits.value
    assert before[:, :position].tobytes() == after[:, :position].tobytes()


@given(config=strategies.configs(), data=st.data())
def test_batch_rows_are_independent(config: DecoderConfig, data: st.DataObject) -> None:
    tokens = data.draw(strategies.token_batches(config))
    model = DecoderModel.from_seed(config, 3)
    together = model.forward(tokens).logits.value
    for row in range(tokens.shape[0]):
        alone = model.forward(tokens[row : row + 1]).logits.value
        assert max_symmetric_error(alone[0], together[row]) <= 1e-13


@given(config=strategies.configs(max_layers=0), data=st.data())
def test_depth_zero_is_normalized_lookup_times_table_transpose(
    config: DecoderConfig, data: st.DataObject
) -> None:
    tokens = data.draw(strategies.token_batches(config))
    model = DecoderModel.from_seed(config, 1)
    table = model.tied_embedding.tensor.value
    rows = table[tokens]
    normalized = rows / np.sqrt((rows * rows).mean(axis=-1, keepdims=True) + config.rms_epsilon)
    assert max_symmetric_error(model.forward(tokens).logits.value, normalized @ table.T) <= 1e-13


def test_rebuild_round_trips_and_copies() -> None:
    model = DecoderModel.from_seed(CONFIG, FIXTURE.seed)
    state = model.state()
    rebuilt = DecoderModel.from_parameters(CONFIG, state)
    expected = model.forward(FIXTURE.tokens).logits.value
    assert rebuilt.forward(FIXTURE.tokens).logits.value.tobytes() == expected.tobytes()
    state[0][1][:] = 0.0  # the caller's array is not the model's
    assert rebuilt.forward(FIXTURE.tokens).logits.value.tobytes() == expected.tobytes()
    from_mapping = DecoderModel.from_parameters(CONFIG, dict(model.state()))
    from_named = DecoderModel.from_parameters(CONFIG, model.parameters())
    for other in (from_mapping, from_named):
        assert other.forward(FIXTURE.tokens).logits.value.tobytes() == expected.tobytes()
    assert not from_named.parameters()[0].tensor.is_same_node(model.parameters()[0].tensor)
    assert isinstance(from_named.parameters()[0], NamedParameter)


def test_flat_ids_with_shape_equal_the_2d_form() -> None:
    model = DecoderModel.from_seed(CONFIG, FIXTURE.seed)
    flat = model.forward([0, 1, 2, 2, 1, 0], shape=(2, 3)).logits.value
    square = model.forward([[0, 1, 2], [2, 1, 0]]).logits.value
    assert flat.tobytes() == square.tobytes()


@given(config=strategies.configs(max_layers=2), data=st.data())
def test_whole_model_gradients_match_central_differences(
    config: DecoderConfig, data: st.DataObject
) -> None:
    tokens = data.draw(strategies.token_batches(config))
    targets = (tokens + 1) % config.vocabulary_size
    model = DecoderModel.from_seed(config, 17)
    model.loss(tokens, targets).backward()
    state = model.state()
    index = data.draw(st.integers(0, len(state) - 1))
    name, value = state[index]

    def loss_of(candidate: np.ndarray) -> float:  # type: ignore[type-arg]
        entries = list(state)
        entries[index] = (name, candidate)
        return float(DecoderModel.from_parameters(config, entries).loss(tokens, targets).value)

    gradient = model.gradients()[name]
    assert gradient is not None
    error = max_symmetric_error(gradient, central_difference(loss_of, value))
    assert error <= 1e-6, f"{name}: scaled error {error:.2e}, but should be <= 1e-6"


def test_depth_changes_only_the_block_list() -> None:
    for layers in (0, 1, 3):
        config = dataclasses.replace(CONFIG, layers=layers)
        model = DecoderModel.from_seed(config, 0)
        assert len(model.blocks) == layers
        assert model.parameter_count() == parameter_count(config)
        assert len(model.forward(FIXTURE.tokens).blocks) == layers


@pytest.mark.parametrize("seed", [0, 2**64 - 1])
def test_extreme_seeds(seed: int) -> None:
    model = DecoderModel.from_seed(CONFIG, seed)
    assert np.all(np.isfinite(model.forward(FIXTURE.tokens).logits.value))
