"""The torch adapter's 16-bit matrix products: float32 sums rounded once, as torch's own kernel
computes them, through float32 products (50 times faster on a CPU without 16-bit matrix
instructions); they differ from torch's only in the order of the float32 sums."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conformance.adapters.torch_backend import product  # noqa: E402

SIXTEEN_BIT = [torch.float16, torch.bfloat16]


def _with_gradients(multiply, a, b, upstream):  # type: ignore[no-untyped-def]
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    result = multiply(a, b)
    result.backward(upstream)
    return [result.detach(), a.grad, b.grad]


def _magnitudes(a, b, upstream):  # type: ignore[no-untyped-def]
    """For the value and both gradients: the products of magnitudes |x| |y| that bound a
    float32 sum's rounding error, and the number of terms each entry sums."""
    a, b, upstream = a.abs().double(), b.abs().double(), upstream.abs().double()
    if b.dim() == 2:
        rows, terms = a.reshape(-1, a.shape[-1]), upstream.reshape(-1, upstream.shape[-1])
        for_b, count_b = rows.T @ terms, rows.shape[0]
    else:
        for_b, count_b = a.transpose(-1, -2) @ upstream, a.shape[-2]
    return [
        (a @ b, a.shape[-1]),
        (upstream @ b.transpose(-1, -2), b.shape[-1]),
        (for_b, count_b),
    ]


def _agree(got, want, magnitude, terms: int) -> None:  # type: ignore[no-untyped-def]
    """The two differ only in the order of their float32 sums: each is within ``terms`` float32
    units of ``magnitude`` of the exact sum (the standard bound), then rounded once to 16 bits,
    so they differ by at most twice the one plus a unit of the format."""
    assert got.dtype == want.dtype and got.shape == want.shape
    eps16, eps32 = torch.finfo(want.dtype).eps, torch.finfo(torch.float32).eps
    bound = eps16 * torch.maximum(got.abs(), want.abs()).double() + 2 * terms * eps32 * magnitude
    excess = (got.double() - want.double()).abs() - bound
    assert bool((excess <= 0).all()), f"{int((excess > 0).sum())} entries past the bound"


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
@pytest.mark.parametrize(
    ("left", "right"),
    [((2, 3, 64, 40), (40, 50)), ((2, 3, 64, 40), (2, 3, 40, 64)), ((96, 576), (576, 300))],
    ids=["weight", "batched", "2-d"],
)
def test_16_bit_products_match_torchs_own_to_float32_rounding(
    dtype: object, left: tuple[int, ...], right: tuple[int, ...]
) -> None:
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(left, generator=generator).to(dtype)
    b = torch.randn(right, generator=generator).to(dtype)
    upstream = torch.randn((*left[:-1], right[-1]), generator=generator)
    upstream = upstream.to(dtype)
    native = _with_gradients(torch.matmul, a, b, upstream)
    widened = _with_gradients(product, a, b, upstream)
    for got, want, (magnitude, terms) in zip(
        widened, native, _magnitudes(a, b, upstream), strict=True
    ):
        _agree(got, want, magnitude, terms)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_16_bit_products_round_once_from_float32(dtype: object) -> None:
    """A sum whose float32 value needs more than 16 bits: rounded once, not term by term."""
    a = torch.full((1, 1024), 1.0).to(dtype)
    b = torch.full((1024, 1), 1.0 / 1024 + 2.0**-20).to(dtype)
    exact = (a.double() @ b.double()).to(dtype)
    assert torch.equal(product(a, b), exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_wider_products_are_torchs_own(dtype: object) -> None:
    generator = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, 8, 16, generator=generator), torch.randn(16, 5, generator=generator)
    a, b = a.to(dtype), b.to(dtype)
    assert torch.equal(product(a, b), a @ b)
