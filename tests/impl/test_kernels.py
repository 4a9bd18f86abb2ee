"""The fast path is bound to the plain rules: the same values and gradients, bit for bit.

Every fast rule of ``impl.kernels.fused`` is run beside its plain rule of ``impl.ops`` (with
the hand-over turned off, so the plain code runs at sizes it would otherwise hand over),
on shapes large enough to be split over threads, for 1, 2 and 3 threads. Elementwise and
row-wise work must agree bitwise; a matrix product split by rows may differ in the last bit,
as BLAS results differ between thread counts, and so may causal attention, which takes its
queries in blocks and each block only against the keys it sees (its sums and products run
over fewer, differently grouped terms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from impl import kernels, ops
from impl.kernels import fused, threads
from impl.model import DecoderModel
from impl.tape import Array, Tensor
from spec.config import DecoderConfig
from spec.recipe import initial_parameters


@pytest.fixture
def thread_count() -> Iterator[Callable[[int], None]]:
    """Set the thread count for one test; the previous count is restored after it."""
    previous = threads.thread_count()
    yield threads.set_thread_count
    threads.set_thread_count(previous)


@pytest.fixture
def plain_only(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """``plain_only(True)``: every rule runs its plain code, whatever the size."""

    def switch(plain: bool) -> None:
        if plain:
            monkeypatch.setattr(kernels, "worthwhile", lambda *sizes: False)
        else:
            monkeypatch.undo()

    return switch


def _run(operation: Callable[..., Tensor], shapes: list[tuple[int, ...]], seed: int) -> list[Array]:
    """The value and every input gradient of ``operation`` on seeded inputs."""
    rng = np.random.default_rng(seed)
    leaves = [Tensor(rng.normal(size=shape), requires_grad=True) for shape in shapes]
    output = operation(*leaves)
    output.backward(rng.normal(size=output.shape) if output.shape else None)
    results = [output.value.copy()]
    results.extend(leaf.grad.copy() for leaf in leaves if leaf.grad is not None)
    assert len(results) == len(shapes) + 1, "every input must receive a gradient"
    return results


_ANGLES = np.random.default_rng(7).normal(size=(96, 8))
_TARGETS = np.random.default_rng(8).integers(0, 700, size=288).astype(np.intp)
_IDS = np.random.default_rng(9).integers(0, 600, size=(3, 96)).astype(np.intp)

# (name, rule applied, input shapes): every input large enough for the fast path to split it.
ROW_RULES: list[tuple[str, Callable[..., Tensor], list[tuple[int, ...]]]] = [
    ("rms_norm", lambda x, g: ops.rms_norm(x, g, 1e-6), [(3, 96, 160), (160,)]),
    ("rms_norm-eps0", lambda x, g: ops.rms_norm(x, g, 0.0), [(3, 96, 160), (160,)]),
    ("swiglu", ops.swiglu, [(3, 96, 200), (3, 96, 200)]),
    ("rotary", lambda x: ops.rotary(x, np.cos(_ANGLES), np.sin(_ANGLES)), [(3, 4, 96, 16)]),
    ("indexed_mean_nll", lambda x: ops.indexed_mean_nll(x, _TARGETS), [(3, 96, 700)]),
    ("add", ops.add, [(3, 96, 160), (3, 96, 160)]),
    ("add-broadcast", ops.add, [(3, 96, 160), (160,)]),
    ("reshape-copy", lambda x: ops.reshape(ops.transpose(x, 1, 2), (3, 16, 384)), [(3, 96, 4, 16)]),
    ("gather_rows", lambda t: ops.gather_rows(t, _IDS), [(600, 160)]),
]


@pytest.mark.parametrize(("name", "rule", "shapes"), ROW_RULES, ids=[r[0] for r in ROW_RULES])
def test_fast_rules_equal_their_plain_rules_bitwise(
    name: str,
    rule: Callable[..., Tensor],
    shapes: list[tuple[int, ...]],
    thread_count: Callable[[int], None],
    plain_only: Callable[[bool], None],
) -> None:
    plain_only(True)
    expected = _run(rule, shapes, seed=5)
    plain_only(False)
    for count in (1, 2, 3):
        thread_count(count)
        for position, (want, got) in enumerate(
            zip(expected, _run(rule, shapes, seed=5), strict=True)
        ):
            assert want.tobytes() == got.tobytes(), (
                f"{name} with {count} threads: output {position} differs from the plain rule "
                f"by up to {np.max(np.abs(want - got)):.3e}"
            )


def test_split_matrix_products_agree_with_one_product(
    thread_count: Callable[[int], None], plain_only: Callable[[bool], None]
) -> None:
    """Rows split over threads: the same products to rounding (BLAS may block them apart);
    on one thread, the very same products."""
    shapes = [(4, 128, 96), (96, 80)]
    plain_only(True)
    expected = _run(ops.matmul, shapes, seed=3)
    plain_only(False)
    thread_count(1)
    for want, got in zip(expected, _run(ops.matmul, shapes, seed=3), strict=True):
        assert want.tobytes() == got.tobytes()
    thread_count(2)
    for want, got in zip(expected, _run(ops.matmul, shapes, seed=3), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13 * np.abs(want).max())


@pytest.mark.parametrize("tokens", [64, 96, 300])
def test_blocked_attention_agrees_with_the_plain_rule_to_rounding(
    tokens: int, thread_count: Callable[[int], None], plain_only: Callable[[bool], None]
) -> None:
    """One query block (64 tokens), a short last block (96), several blocks with softmax sums
    over more than numpy's 128-term pairwise block (300): the plain rule's values and
    gradients to rounding (measured: at most 3e-15 of the largest entry), and bitwise the same
    for every thread count, since threads split batch and heads, not the blocks."""
    shapes = [(2, 3, tokens, 16)] * 3
    plain_only(True)
    expected = _run(ops.causal_attention, shapes, seed=6)
    plain_only(False)
    thread_count(1)
    single = _run(fused.causal_attention, shapes, seed=6)
    for want, got in zip(expected, single, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13 * np.abs(want).max())
    for count in (2, 3):
        thread_count(count)
        for want, got in zip(single, _run(fused.causal_attention, shapes, seed=6), strict=True):
            assert want.tobytes() == got.tobytes(), f"{count} threads differ from one"


def test_blocked_attention_never_reads_what_it_did_not_write(
    monkeypatch: pytest.MonkeyPatch, plain_only: Callable[[bool], None]
) -> None:
    """Every buffer the fast path takes starts as NaN: the entries after a block's keys are
    left unwritten, so reading any of them would spread NaN into the results."""
    shapes = [(1, 2, 200, 8)] * 3
    plain_only(True)
    expected = _run(ops.causal_attention, shapes, seed=2)
    plain_only(False)
    monkeypatch.setattr(fused.buffers, "empty", lambda shape: np.full(shape, np.nan))
    for want, got in zip(expected, _run(fused.causal_attention, shapes, seed=2), strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13 * np.abs(want).max())


@pytest.mark.parametrize(
    ("rule", "small", "large"),
    [
        ("rms_norm", [(2, 3, 4), (4,)], [(4, 64, 128), (128,)]),
        ("swiglu", [(2, 3, 4), (2, 3, 4)], [(4, 64, 128), (4, 64, 128)]),
        ("causal_attention", [(1, 2, 3, 4)] * 3, [(2, 4, 64, 16)] * 3),
    ],
)
def test_large_work_goes_to_the_fast_path_and_small_work_stays_plain(
    rule: str,
    small: list[tuple[int, ...]],
    large: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, ...]] = []
    fast = getattr(fused, rule)

    def spy(*arguments: Tensor) -> Tensor:
        calls.append(arguments[0].shape)
        return fast(*arguments)

    monkeypatch.setattr(fused, rule, spy)
    extra = (1e-6,) if rule == "rms_norm" else ()
    for shapes in (small, large):
        tensors = [Tensor(np.ones(shape)) for shape in shapes]
        getattr(ops, rule)(*tensors, *extra)
    assert calls == [large[0]]


def test_a_whole_model_step_is_the_same_on_either_path(
    thread_count: Callable[[int], None], plain_only: Callable[[bool], None]
) -> None:
    """A model large enough that every hot rule hands over: logits, loss and gradients."""
    config = DecoderConfig(700, 64, 4, 96, 2, 96)
    parameters = initial_parameters(config, 11)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 700, size=(3, 96))
    targets = rng.integers(0, 700, size=(3, 96))

    def step() -> list[Array]:
        model = DecoderModel.from_parameters(config, parameters)
        logits = model.forward(tokens).logits.value.copy()
        loss = model.loss(tokens, targets)
        loss.backward(retain_graph=False)
        return [
            logits,
            np.asarray(loss.value),
            *(g for g in model.gradients().values() if g is not None),
        ]

    thread_count(1)
    plain_only(True)
    expected = step()
    plain_only(False)
    for count in (1, 2):
        thread_count(count)
        for want, got in zip(expected, step(), strict=True):
            np.testing.assert_allclose(
                got, want, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(want).max())
            )
