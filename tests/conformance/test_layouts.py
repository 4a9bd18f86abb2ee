"""Layout converters: the permutation, the two conventions, a converted model the same."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.layouts import (
    HF_LLAMA,
    META_LLAMA,
    Convention,
    blocks_in_text_order,
    from_rotate_half,
    loaded_in_text_order,
    rotate_half_permutation,
    to_rotate_half,
)
from spec import strategies
from spec.config import DecoderConfig
from spec.parameters import BLOCK_PARAMETER_SUFFIXES, parameter_names
from spec.recipe import initial_parameters


def test_the_permutation_sends_pair_2j_2j_plus_1_to_j_j_plus_half() -> None:
    # Two heads of width 4: our (0, 1) and (2, 3) become rotate-half (0, 2) and (1, 3).
    assert rotate_half_permutation(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError, match="even width"):
        rotate_half_permutation(6, 2)


def _rotate_interleaved(x: np.ndarray, angles: np.ndarray) -> np.ndarray:  # type: ignore[type-arg]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(angles) - b * np.sin(angles)
    out[..., 1::2] = a * np.sin(angles) + b * np.cos(angles)
    return out


def _rotate_half(x: np.ndarray, angles: np.ndarray) -> np.ndarray:  # type: ignore[type-arg]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate(
        [a * np.cos(angles) - b * np.sin(angles), a * np.sin(angles) + b * np.cos(angles)], -1
    )


@given(heads=st.integers(1, 3), pairs=st.integers(1, 4), length=st.integers(1, 5))
def test_permuted_query_and_key_give_the_same_scores(heads: int, pairs: int, length: int) -> None:
    """RoPE on interleaved pairs with our weights equals rotate-half RoPE with permuted ones."""
    rng = np.random.default_rng(heads * 100 + pairs * 10 + length)
    head_width, width = 2 * pairs, heads * 2 * pairs
    x = rng.normal(size=(length, width))
    query, key = rng.normal(size=(width, width)), rng.normal(size=(width, width))
    angles = np.arange(length)[:, None] * 10000.0 ** (-2.0 * np.arange(pairs) / head_width)

    def scores(q: np.ndarray, k: np.ndarray, rotate: object) -> np.ndarray:  # type: ignore[type-arg]
        split = [(x @ m).reshape(length, heads, head_width).transpose(1, 0, 2) for m in (q, k)]
        rotated = [rotate(part, angles) for part in split]  # type: ignore[operator]
        return rotated[0] @ np.swapaxes(rotated[1], -1, -2)

    ours = scores(query, key, _rotate_interleaved)
    theirs = scores(to_rotate_half(query, heads), to_rotate_half(key, heads), _rotate_half)
    np.testing.assert_allclose(theirs, ours, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(from_rotate_half(to_rotate_half(query, heads), heads), query)


@pytest.mark.parametrize("convention", [HF_LLAMA, META_LLAMA], ids=lambda c: c.name)
@given(config=strategies.configs(max_layers=2), seed=st.integers(0, 2**32))
def test_export_and_load_round_trip_every_parameter(
    convention: Convention, config: object, seed: int
) -> None:
    parameters = initial_parameters(config, seed)  # type: ignore[arg-type]
    state = convention.export(config, parameters)  # type: ignore[arg-type]
    assert len(state) == len(parameters)
    assert set(convention.block) == set(BLOCK_PARAMETER_SUFFIXES)
    back = convention.load(config, state)  # type: ignore[arg-type]
    assert [name for name, _ in back] == parameter_names(config)  # type: ignore[arg-type]
    for (name, got), (_, expected) in zip(back, parameters, strict=True):
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_names_and_layouts_of_the_two_conventions() -> None:
    config = DecoderConfig(5, 4, 2, 3, 1, 4)
    assert (
        HF_LLAMA.name_of("blocks.3.attention.query.weight")
        == "model.layers.3.self_attn.q_proj.weight"
    )
    assert META_LLAMA.name_of("blocks.0.ffn.up.weight") == "layers.0.feed_forward.w3.weight"
    assert META_LLAMA.name_of("token_embedding.weight") == "tok_embeddings.weight"
    gate = np.arange(12.0).reshape(4, 3)  # [in, out]
    np.testing.assert_array_equal(
        META_LLAMA.to_theirs(config, "blocks.0.ffn.gate.weight", gate), gate.T
    )
    key = np.arange(16.0).reshape(4, 4)
    np.testing.assert_array_equal(
        META_LLAMA.to_theirs(config, "blocks.0.attention.key.weight", key), key.T
    )  # Meta's reference rotates interleaved pairs, as the spec does
    swapped = dataclasses.replace(META_LLAMA, rotate_half=True)
    np.testing.assert_array_equal(
        swapped.to_theirs(config, "blocks.0.attention.key.weight", key), to_rotate_half(key, 2).T
    )
    with pytest.raises(KeyError, match=r"has no 'norm\.weight'"):
        META_LLAMA.load(
            DecoderConfig(5, 4, 2, 3, 0, 4), {"tok_embeddings.weight": np.zeros((5, 4))}
        )


def test_blocks_in_text_order_moves_whole_blocks_only_past_ten() -> None:
    def names(layers: int) -> list[str]:
        return parameter_names(DecoderConfig(4, 2, 1, 2, layers, 2))

    assert blocks_in_text_order(names(10), 10) == names(10)
    moved = blocks_in_text_order(names(12), 12)
    assert sorted(moved) == sorted(names(12))
    blocks = [name.split(".")[1] for name in moved[1 : -1 : len(BLOCK_PARAMETER_SUFFIXES)]]
    assert blocks == ["0", "1", "10", "11", "2", "3", "4", "5", "6", "7", "8", "9"]
    assert moved[0] == names(12)[0] and moved[-1] == names(12)[-1]
    assert moved[19:28] == names(12)[91:100]  # block 10's nine, third, in their own order
    with pytest.raises(ValueError, match="20 entries, not the 110 of 12 blocks"):
        blocks_in_text_order(names(2), 12)
    # Loaded in that order: the stable names, block 2 holding block 10's values.
    loaded = loaded_in_text_order([(name, name) for name in names(12)], 12)
    assert [name for name, _ in loaded] == names(12)
    assert [value for _, value in loaded[19:28]] == names(12)[91:100]
