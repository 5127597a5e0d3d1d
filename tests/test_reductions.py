"""Reductions that are not linear sums: products (hoad/rules/reduction.py; at exact zeros, where
torch.func itself is wrong from order 3, the reference is the closed form), softmax, log_softmax
and logsumexp, and ops with a dim on 0-d inputs; against nested torch.func in float64."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check, rand

import hoad

MODES = ["forward", "reverse"]
W23 = rand(2, 3, seed=101)


# -------------------------------------------------------------------------------- softmax family
@pytest.mark.parametrize("order", [3, 4])
def test_softmax_weighted(order):
    check(lambda x: (torch.softmax(x, -1) * W23).sum(), (rand(2, 3),), order=order)


def test_softmax_matrix_output():
    check(lambda x: torch.softmax(x, 0), (rand(2, 3),), order=3)


def test_softmax_sum_is_constant():
    res = hoad.compile(lambda x: torch.softmax(x, -1).sum(), order=3)(rand(2, 3))
    for k in (1, 2, 3):
        assert torch.allclose(res[(0,) * k], torch.zeros(()).double(), atol=1e-12)


def test_log_softmax_order_4():
    check(lambda x: (F.log_softmax(x, -1) * W23).sum(), (rand(2, 3),), order=4)


def test_log_softmax_matrix_output():
    check(lambda x: F.log_softmax(x, 1), (rand(2, 3),), order=3)


def test_logsumexp():
    check(lambda x: torch.logsumexp(x, 1), (rand(2, 3),), order=4)


def test_logsumexp_all_dims():
    check(lambda x: torch.logsumexp(x, (0, 1)), (rand(2, 3),), order=4)


# ------------------------------------------------------------------------------------ prod
def test_prod_all_dims():
    check(lambda x: x.prod(), (rand(2, 3),), order=4)


def _prod_reference(x, k):
    """∂^k prod(x): at distinct flat indices the product of the other entries, else 0."""
    flat = x.reshape(-1)
    n = flat.numel()
    out = torch.zeros((n,) * k, dtype=x.dtype)
    for idx in itertools.permutations(range(n), k):
        out[idx] = math.prod(float(flat[j]) for j in range(n) if j not in idx)
    return out.reshape(tuple(x.shape) * k)


@pytest.mark.parametrize("zeros", [1, 2], ids=["one_zero", "two_zeros"])
def test_prod_all_dims_with_exact_zero(zeros):
    # torch.func is itself wrong here from order 3 on (prod_backward's zero handling is not
    # differentiated correctly), so the reference is the closed form
    x = rand(2, 3)
    x[0, 1] = 0.0
    if zeros == 2:
        x[1, 2] = 0.0
    res = hoad.compile(lambda t: t.prod(), order=4)(x)
    assert float(res.value) == 0.0
    for k in range(1, 5):
        assert_close(res[(0,) * k], _prod_reference(x, k), f"order {k}")


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_prod_along_a_dim_with_exact_zeros(mode):
    """Lines with one and two exact zeros, keepdim: the derivative tensors of the product are
    formed without division (torch.func is wrong at a zero from order 3, so the reference is the
    closed form, line by line)."""
    x = rand(3, 4, seed=50)
    x[1, 2] = 0.0
    x[2, 0] = x[2, 3] = 0.0
    res = hoad.compile(lambda t: t.prod(1, keepdim=True), order=4, mode=mode)(x)
    for k in range(1, 5):
        expected = torch.zeros((3, 1) + (3, 4) * k, dtype=x.dtype)
        for row in range(3):
            block = _prod_reference(x[row], k)  # (4,) * k
            index = (row, 0) + (row, slice(None)) * k
            expected[index] = block
        assert_close(res[(0,) * k], expected, f"order {k}")


def test_prod_over_a_wide_line_of_few_inputs():
    """A product over 40 entries that depend on 2 inputs: built as a tree of pairwise products
    (the derivative tensors would be 40^k per entry against 2^k slots)."""
    W = rand(2, 40, seed=51)
    check(lambda x: (1.0 + 0.1 * torch.tanh(x @ W)).prod(-1), (rand(3, 2, seed=52),), order=3)


def test_prod_order_3_needs_memory_near_its_result():
    """Order 3 of a product of 100 entries per sample: its results take 15 MB. A tree of pairwise
    products made [50, 100, 100, 100] blocks (an estimated 6.7 GB); the derivative tensors fit in
    200 MB."""
    X = rand(2, 100, seed=55)
    cf = hoad.compile(lambda X: X.sin().prod(-1), order=3, batch_dim=0, backend="eager", memory_budget=200e6)
    res = cf(X)
    one = torch.func.jacfwd(torch.func.jacfwd(torch.func.jacrev(lambda x: x.sin().prod())))(X[1])
    assert_close(res[0, 0, 0][1], one, "order 3, sample 1")


def test_prod_per_sample_and_in_a_laplacian():
    """A PINN's hard boundary factor Π x_i (1 - x_i) times a network, per sample."""
    W = rand(3, 5, seed=53)

    def u(X):
        return (X * (1 - X)).prod(-1) * torch.tanh(X @ W).sum(-1)

    X = rand(4, 3, seed=54)
    check(u, (X,), order=4, batch_dim=0)
    lap = hoad.laplacian(u, batch_dim=0)(X).laplacian
    hess = torch.func.vmap(torch.func.hessian(lambda x: u(x[None])[0]))(X)
    assert_close(lap, hess.diagonal(dim1=1, dim2=2).sum(-1), "laplacian")


def test_prod_all_dims_of_nonlinear():
    check(lambda t: (t.sin() + 1.5).prod(), (rand(2, 3),), order=3)


# -------------------------------------------------------------------------------- 0-d inputs
ZERO_D = {
    "cumsum": lambda s: s.cumsum(0).sin(),
    "mean": lambda s: s.mean(0).sin() * s.mean(),
    "sort": lambda s: s.sort(0).values.sin(),
    "topk": lambda s: s.topk(1).values.sin().sum(),
    "prod": lambda s: s.prod(0).sin() * s.exp().prod(),
    "prod-keepdim": lambda s: s.exp().prod(0, keepdim=True).sin(),
    "index_select": lambda s: s.index_select(0, torch.tensor([0])).sin().sum(),
    "gather": lambda s: s.gather(0, torch.tensor(0)).sin(),
    "amax": lambda s: s.exp().amax(0).sin(),
    "max.dim": lambda s: s.exp().max(0).values.sin(),
    "max.dim-keepdim": lambda s: s.exp().max(0, keepdim=True).values.sin(),
    "logsumexp": lambda s: s.sin().logsumexp(0).exp(),
    "softmax": lambda s: (s * s).softmax(0).sin(),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ZERO_D))
def test_zero_dimensional_inputs_of_ops_with_a_dim(name, mode):
    check(ZERO_D[name], (torch.tensor(0.7, dtype=torch.float64),), order=3, mode=mode)
