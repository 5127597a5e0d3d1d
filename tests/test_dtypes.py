"""Inputs of other dtypes than float64: float32 and float16 derivatives whose scalar factors leave
the dtype's range (the powers of 1/u go onto the first-order factors of each term,
hoad.rules.combinators.Scaled), and arguments of two dtypes, promoted as torch promotes them."""

import pytest
import torch
from helpers import check, rand
from torch.func import jacfwd, jacrev

import hoad

MODES = ["forward", "reverse"]


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_float32_input_times_a_float64_constant(mode):
    """torch promotes the product to float64; hoad's contraction of the input's float32 blocks
    with the constant's float64 factor was refused from order 2 ("torch refuses mixed dtypes
    there (the function itself fails when run)": it does not)."""
    c = torch.arange(1, 7, dtype=torch.float64)
    x = torch.randn(6, dtype=torch.float32)
    for f in (lambda x: (torch.softmax(x, 0) * c).sum(), lambda x: (x / x.sum() * c).sin().sum(),
              lambda x: ((x - x.sum()).exp() * c).sum()):
        res = hoad.compile(f, order=3, mode=mode, backend="eager")(x)
        ref = torch.func.jacfwd(torch.func.jacfwd(torch.func.jacfwd(f)))(x)  # (jacrev's would be float32)
        assert res[0, 0, 0].dtype == ref.dtype == torch.float64
        torch.testing.assert_close(res[0, 0, 0], ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("mode", MODES)
def test_xlogy_of_counts_and_rates_of_two_dtypes(mode):
    """A Poisson log-likelihood xlogy(k int64, λ) - λ, and xlogy of float32 and float64 tensors,
    were refused ("no derivative rule for aten.xlogy.Tensor"): torch promotes, so does hoad."""
    k = torch.tensor([0, 1, 3, 7])
    w = torch.tensor([0.0, 0.5, 2.0, 1.5], dtype=torch.float32)
    check(lambda lam: (torch.xlogy(k, lam) - lam).sum() + torch.special.xlog1py(k, lam).sum()
          + torch.xlogy(w, lam).sum(), (rand(4, seed=12).abs() + 0.5,), order=3, mode=mode)


_EPS = 1e-12


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,fn,order", [
    ("sqrt", lambda x: torch.sqrt(x * x + _EPS), 4), ("log", lambda x: torch.log(x * x + _EPS), 4),
    ("rsqrt", lambda x: torch.rsqrt(x * x + _EPS), 3), ("pow", lambda x: (x * x + _EPS) ** -0.5, 3),
    ("norm", lambda x: x.norm() * 1.0, 4), ("reciprocal", lambda x: 1 / (x * x + _EPS), 3),
])
def test_float32_derivatives_whose_scalar_factor_overflows(name, fn, order, mode):
    """φ^(4) of √u at u = 1e-12 is ∝ u^-3.5 = 1e42, past float32's range, while the derivative of
    √(x² + ε) is -3e18: NaN or -inf, where torch.func is finite. The powers of 1/u now go onto the
    first-order factors of each term (hoad.rules.combinators.Scaled)."""
    x = torch.tensor([0.0, 1e-7, -1e-6], dtype=torch.float64) if name != "norm" else \
        torch.tensor([1e-6, -2e-6, 0.5e-6], dtype=torch.float64)
    f = (lambda x: fn(x).sum()) if name != "norm" else fn
    res = hoad.compile(f, order=order, mode=mode, backend="eager")(x.float())[(0,) * order]
    g = jacrev(f)
    for _ in range(order - 1):
        g = jacfwd(g)
    want = g(x)
    assert torch.isfinite(res).all(), res
    torch.testing.assert_close(res.double(), want, rtol=1e-3, atol=1e-5 * float(want.abs().max()))


def test_float16_derivatives_of_a_reciprocal_keep_their_sign():
    """1/(1 + x²) at x = 5 in float16: φ^(4) = 24 y^5 = 8e-8 underflowed, and the fourth derivative
    came out -2.1e-4 where it is 5.8e-3."""
    x = torch.tensor([5.0, 6.0, -3.0], dtype=torch.float64)
    f = lambda x: (1 / (1 + x * x)).sum()  # noqa: E731
    res = hoad.compile(f, order=4, backend="eager")(x.half())[0, 0, 0, 0]
    want = jacfwd(jacfwd(jacfwd(jacrev(f))))(x)
    torch.testing.assert_close(res.double(), want, rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,fn,xs", [
    ("atan", torch.atan, [12.0, 15.0, -40.0, 0.5]),
    ("atan2", lambda x: torch.atan2(x, torch.ones_like(x)), [12.0, 15.0, -40.0, 0.5]),
    ("erf", torch.erf, [25.0, -30.0, 3.0, 0.5]),
])
def test_float16_derivatives_out_of_range_factors(name, fn, xs, mode):
    """float16 at orders 3-4: atan's P_k(x) (1 + x²)^-k underflowed to 0 (-9e-5 at x = 12) or gave
    0 · inf = NaN (x = 15), and erf's Hermite polynomial times exp(-x²) was NaN from |x| = 25, where
    the derivative is 0."""
    x = torch.tensor(xs, dtype=torch.float64)
    f = lambda x: fn(x).sum()  # noqa: E731
    for order in (3, 4):
        res = hoad.compile(f, order=order, mode=mode, backend="eager")(x.half())[(0,) * order]
        g = jacrev(f)
        for _ in range(order - 1):
            g = jacfwd(g)
        want = torch.einsum("i" * order + "->i", g(x))
        got = torch.einsum("i" * order + "->i", res.double())
        assert torch.isfinite(got).all(), got
        torch.testing.assert_close(got, want, rtol=3e-2, atol=2e-7)
