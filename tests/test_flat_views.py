"""Flat views of a result: every wrt entry along one axis, for Newton steps and Laplace
approximations (``res.flat``, ``res.flat_index``, ``res.unflat``)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, rand
from torch import nn
from torch.func import functional_call, hessian, jacrev, vmap

import hoad

DT = torch.float64


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(47)
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)

    def forward(self, X, y):
        return nn.functional.cross_entropy(self.net(X), y)


def _flat_reference(model, args, order):
    """The loss as a function of one flat vector of every parameter, differentiated by torch.func."""
    named = list(model.named_parameters())
    theta = torch.cat([p.detach().reshape(-1) for _, p in named])

    def of_theta(t):
        parts, at = {}, 0
        for name, p in named:
            parts[name] = t[at:at + p.numel()].reshape(p.shape)
            at += p.numel()
        return functional_call(model, parts, args)

    return (jacrev if order == 1 else hessian)(of_theta)(theta)


def test_a_parameter_hessian_flat_is_the_hessian_of_the_flat_parameters():
    model = Classifier()
    X, y = rand(6, 3, seed=1), torch.tensor([0, 1, 1, 0, 1, 0])
    with torch.no_grad():
        res = hoad.compile(model, order=2, wrt=hoad.parameters)(X, y)
    assert list(res.flat_index) == [n for n, _ in model.named_parameters()], "named_parameters() order"
    assert_close(res.flat(order=1), _flat_reference(model, (X, y), 1), "gradient")
    H = res.flat()
    assert_close(H, _flat_reference(model, (X, y), 2), "Hessian")
    assert H.shape == (26, 26) and torch.equal(H, H.T), "exactly symmetric"
    # a Newton step, mapped back to the parameters
    g = res.flat(order=1)
    direction = torch.linalg.solve(H + 1e-3 * torch.eye(26, dtype=DT), g)
    step = res.unflat(direction)
    assert {k: tuple(v.shape) for k, v in step.items()} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert_close(torch.cat([v.reshape(-1) for v in step.values()]), direction, "unflat")


def _mixed(x, w):
    return (torch.tanh(x @ w) ** 2).sum(-1) + x.sin().sum(-1) * w.sum()


def test_per_sample_and_non_scalar_outputs_keep_their_axes_in_front():
    """Per sample (batch_dim=0) over two inputs: (B, P, P) with P = 3 + 6, against torch.func on
    the concatenated inputs; order 3 likewise (B, P, P, P)."""
    X, w = rand(4, 3, seed=2), rand(3, 2, seed=3)

    def of_flat(v):
        return _mixed(v[:3], v[3:].reshape(3, 2))

    flat_in = torch.cat([X, w.reshape(1, -1).expand(4, -1)], dim=1)
    res = hoad.compile(lambda X, w: _mixed(X, w), order=3, wrt=(0, 1))(X[0], w)
    assert_close(res.flat(3), jacrev(jacrev(jacrev(of_flat)))(flat_in[0]), "order 3 at one point")
    want = vmap(hessian(of_flat))(flat_in)
    got = torch.stack([hoad.compile(lambda X, w: _mixed(X, w), order=2, wrt=(0, 1))(x, w).flat() for x in X])
    assert_close(got, want, "stacked points")
    per_sample = hoad.compile(lambda X: _mixed(X, w), order=2, batch_dim=0)(X)
    assert per_sample.flat().shape == (4, 3, 3)
    assert_close(per_sample.flat(), vmap(hessian(lambda x: _mixed(x, w)))(X), "per sample")


def test_diagonal_results_flatten_to_the_pure_derivatives():
    X = rand(5, 3, seed=4)
    f = lambda X: X.sin().sum(-1) * X.cos().sum(-1)  # noqa: E731
    res = hoad.compile(f, order=2, batch_dim=0, diagonal=True)(X)
    full = vmap(hessian(lambda x: x.sin().sum() * x.cos().sum()))(X)
    assert_close(res.flat(2), full.diagonal(dim1=-2, dim2=-1), "pure second derivatives")


@pytest.mark.parametrize("call,fragment", [
    (lambda res: res.flat(order=3), "takes an int in 1..2"),
    (lambda res: res.flat(order=True), "takes an int in 1..2"),
    (lambda res: res.unflat(torch.zeros(4, dtype=DT)), "P = 9 flat entries, got (4,)"),
    (lambda res: res.unflat([0.0] * 9), "got list"),
])
def test_bad_flat_arguments_are_refused(call, fragment):
    res = hoad.compile(_mixed, order=2, wrt=(0, 1))(rand(3, seed=5), rand(3, 2, seed=6))
    with pytest.raises(hoad.InvalidArgumentError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(res)


@pytest.mark.parametrize("order", [2, 3, 4])
def test_packed_holds_each_unique_entry_of_a_symmetric_block_once(order):
    """res.packed(key): the values at every multiset of one input's entries, with their index map,
    equal to the dense block at every permutation of each row; mixed and diagonal blocks refused."""
    import itertools
    import math

    W = rand(3, 2, 4, seed=40)

    def f(x, y):  # a non-scalar output (2,), x (2, 3), y (2,): blocks of x alone and mixed ones
        return torch.einsum("ij,jkl,k->l", x.tanh(), W, y.sin()).reshape(2, 2).sum(0) + (x.prod() * y.sum())

    x, y = rand(2, 3, seed=41), rand(2, seed=42)
    res = hoad.compile(f, order=order, wrt=(0, 1))(x, y)
    values, index = res.packed((0,) * order)
    n = 6
    assert index.shape == (math.comb(n + order - 1, order), order) and values.shape == (2, index.shape[0])
    assert bool((index[:, 1:] >= index[:, :-1]).all()) and len({tuple(r) for r in index.tolist()}) == len(index)
    dense = res[(0,) * order].reshape((2,) + (n,) * order)
    for row, v in zip(index.tolist(), values.T):
        for perm in set(itertools.permutations(row)):
            assert torch.equal(dense[(slice(None),) + perm], v)
    one, i1 = res.packed(1)
    assert torch.equal(one, res[1]) and i1.tolist() == [[0], [1]]
    with pytest.raises(hoad.InvalidArgumentError, match="one wrt input"):
        res.packed((0,) * (order - 1) + (1,))
    diag = hoad.compile(f, order=2, wrt=(0, 1), diagonal=True)(x, y)
    with pytest.raises(hoad.InvalidArgumentError, match="diagonal"):
        diag.packed((0, 0))
