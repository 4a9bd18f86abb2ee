"""The buffer cache: a buffer anything still refers to is never handed out again."""

from __future__ import annotations

import numpy as np

from impl.kernels import buffers as workspace
from impl.model import DecoderModel
from spec.config import DecoderConfig
from spec.recipe import initial_parameters

# Large enough to be cached: 32768 float64 elements are 256 KiB.
SHAPE = (64, 512)


def test_a_held_buffer_is_not_handed_out_again() -> None:
    first = workspace.empty(SHAPE)
    second = workspace.empty(SHAPE)
    assert not np.shares_memory(first, second)


def test_a_dropped_buffer_is_reused_in_any_shape_of_the_same_size() -> None:
    first = workspace.empty(SHAPE)
    address = first.__array_interface__["data"][0]
    del first
    again = workspace.empty((512, 64))
    assert again.__array_interface__["data"][0] == address
    assert again.shape == (512, 64)


def test_a_view_keeps_its_buffer_from_reuse() -> None:
    first = workspace.empty(SHAPE)
    first.fill(7.0)
    corner = first[:2, :3]
    del first
    other = workspace.empty(SHAPE)
    other.fill(-1.0)
    assert np.all(corner == 7.0)


def test_small_arrays_are_not_cached() -> None:
    before = workspace.cached_bytes()
    small = workspace.empty((10, 10))
    assert small.shape == (10, 10)
    assert workspace.cached_bytes() == before


def test_zeros_are_zero_even_in_a_reused_buffer() -> None:
    dirty = workspace.empty(SHAPE)
    dirty.fill(3.0)
    del dirty
    assert np.all(workspace.zeros(SHAPE) == 0.0)


def test_the_limit_evicts_free_buffers_and_then_falls_back_to_numpy() -> None:
    cache = workspace._Workspace(limit=3 * 256 * 1024)
    held = [cache.empty(SHAPE) for _ in range(3)]
    assert cache.cached == 3 * 256 * 1024
    beyond = cache.empty(SHAPE)  # every cached buffer is in use: numpy's, not cached
    assert cache.cached == 3 * 256 * 1024 and beyond.base is None
    del held[0]
    other_size = cache.empty((64, 511))  # evicts the free one to make room
    assert other_size.base is not None
    assert cache.cached == 2 * 256 * 1024 + other_size.nbytes
    cache.release()  # every remaining buffer is in use
    assert cache.cached == 2 * 256 * 1024 + other_size.nbytes
    del held
    cache.release()
    assert cache.cached == other_size.nbytes


def test_arrays_a_caller_holds_survive_later_steps() -> None:
    """Stage values and gradients a caller keeps (the tape's own arrays, not copies) are not
    overwritten by the buffers later steps reuse; a repeated step reproduces them bitwise."""
    config = DecoderConfig(512, 64, 4, 96, 2, 128)
    model = DecoderModel.from_parameters(config, initial_parameters(config, 4))
    rng = np.random.default_rng(0)
    tokens, targets = rng.integers(0, 512, size=(2, 2, 128))
    forward = model.forward(tokens)
    held = [stage.value for _, stage in forward.stages()] + [forward.logits.value]
    loss = model.loss(tokens, targets)
    loss.backward(retain_graph=False)
    held += [p.tensor.grad for p in model.parameters() if p.tensor.grad is not None]
    assert workspace.cached_bytes() > 0, "the step must have used cached buffers"
    copies = [array.copy() for array in held]
    for _ in range(2):
        model.zero_grad()
        other_tokens, other_targets = rng.integers(0, 512, size=(2, 2, 128))
        model.forward(other_tokens)
        model.loss(other_tokens, other_targets).backward(retain_graph=False)
    for index, (array, copy) in enumerate(zip(held, copies, strict=True)):
        np.testing.assert_array_equal(array, copy, err_msg=f"held array {index} was overwritten")
    model.zero_grad()
    again = model.forward(tokens)
    model.loss(tokens, targets).backward(retain_graph=False)
    repeated = [stage.value for _, stage in again.stages()] + [again.logits.value]
    repeated += [p.tensor.grad for p in model.parameters() if p.tensor.grad is not None]
    for index, (array, copy) in enumerate(zip(repeated, copies, strict=True)):
        np.testing.assert_array_equal(array, copy, err_msg=f"array {index}: not repeatable")
