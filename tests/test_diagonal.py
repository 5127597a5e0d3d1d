"""diagonal=True: pure derivatives only, checked against the diagonals of full torch.func blocks."""

import pytest
import torch
from helpers import assert_close, rand
from torch.func import hessian, jacfwd, jacrev, vmap

import hoad

W = rand(4, 6, seed=41) / 2
V = rand(6, 3, seed=42) / 2


def f(x):
    return torch.tanh(torch.tanh(x @ W) @ V)  # R^4 -> R^3


def pure(t, r, m, n):
    """The pure-derivative diagonal of a full block: out axes r, then m slots of one n-vector."""
    idx = torch.arange(n)
    return t[(slice(None),) * r + (idx,) * m]


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("order", [2, 3, 4])
def test_pure_derivatives_equal_diagonals_of_full_blocks(mode, order):
    x = rand(4, seed=1)
    res = hoad.compile(f, order=order, diagonal=True, mode=mode)(x)
    g = jacrev(f)
    for _ in range(2, order + 1):
        g = jacfwd(g)
    full = g(x)
    got = res[(0,) * order]
    assert got.shape == (3, 4)
    assert_close(got, pure(full, 1, order, 4), f"order {order}")
    assert_close(res[0], jacrev(f)(x), "order 1 is the full Jacobian")


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_mixed_keys_tie_only_equal_inputs(mode):
    def g(x, y):
        return (torch.tanh(x @ W) * y.sin().sum()).sum()

    x, y = rand(4, seed=2), rand(5, seed=3)
    res = hoad.compile(g, order=3, wrt=(0, 1), diagonal=True, mode=mode)(x, y)
    full = jacfwd(jacfwd(jacrev(g, argnums=0), argnums=0), argnums=1)(x, y)  # (4, 4, 5)
    assert res[0, 0, 1].shape == (4, 5)
    assert_close(res[0, 0, 1], full[torch.arange(4), torch.arange(4)], "(x, x, y)")
    assert_close(res[1, 0, 0], full[torch.arange(4), torch.arange(4)].t(), "permuted key")
    assert_close(res[0, 1], jacfwd(jacrev(g, argnums=0), argnums=1)(x, y), "distinct inputs stay full")


def test_per_sample_laplacian():
    def batched(X):
        return torch.tanh(torch.tanh(X @ W) @ V).sum(1)

    def point(x):
        return batched(x[None])[0]

    X = rand(7, 4, seed=4)
    res = hoad.compile(batched, order=2, batch_dim=0, diagonal=True)(X)
    assert res[0, 0].shape == (7, 4)
    laplacian = vmap(lambda x: torch.trace(hessian(point)(x)))(X)
    assert_close(res[0, 0].sum(-1), laplacian, "Laplacian")


def test_structural_zeros_have_diagonal_shapes():
    res = hoad.compile(lambda x: (x**2).sum(), order=3, diagonal=True)(rand(5))
    assert res.is_structural_zero((0, 0, 0))
    assert res[0, 0, 0].shape == (5,) and not res[0, 0, 0].any()
    assert_close(res[0, 0], torch.full((5,), 2.0, dtype=torch.float64), "d2 x^2")


def test_diagonal_argument_check():
    with pytest.raises(hoad.InvalidArgumentError, match="diagonal"):
        hoad.compile(f, order=2, diagonal="yes")
