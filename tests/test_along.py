"""Derivatives.along(v): dᵏ/dtᵏ f(x + t v) at t = 0 from a result's blocks, against nested
torch.func along the line (jacfwd of t ↦ f(x + t v), k times), dense and packed."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.func import jacfwd

import hoad
import hoad.packed as hp
from tests.helpers import DT, assert_close, rand

W = rand(5, 7, seed=80) / 2


def f(x, y):
    """Two inputs, mixed blocks at every order, a non-scalar output."""
    return torch.tanh(x @ W[:3] + y @ W[3:]) ** 2 * torch.sin(y).sum(-1, keepdim=True)


def line(fn, points, directions, order):
    """[dᵏ/dtᵏ fn(p + t v) at t = 0 for k = 1..order] by nested jacfwd over t."""
    g = lambda t: fn(*(p + t * v for p, v in zip(points, directions)))  # noqa: E731
    out = []
    for _ in range(order):
        g = jacfwd(g)
        out.append(g(torch.zeros((), dtype=DT)))
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_along_two_inputs_matches_the_line(packed):
    """Orders 1..5 (1..4 dense: a cheaper build) of two inputs moved together, mixed blocks with
    their multiplicity; a tuple in wrt order and a dict by key give the same; packed results form
    no dense block."""
    order = 5 if packed else 4
    x, y, vx, vy = rand(3, seed=81), rand(2, seed=82), rand(3, seed=83), rand(2, seed=84)
    res = hoad.compile(f, order=order, wrt=(0, "y"), packed=packed, backend="eager")(x, y)
    got, want = res.along((vx, vy)), line(f, (x, y), (vx, vy), order)
    assert len(got) == order and all(g.shape == res.value.shape for g in got)
    for k, (g, w) in enumerate(zip(got, want), 1):
        assert_close(g, w, f"order {k}")
    assert_close(res.along({"y": vy, 0: vx})[-1], want[-1])
    if packed:
        assert isinstance(res._blocks, hp.PackedBlocks) and not res._blocks._dense


def test_along_one_input_a_scalar_input_and_a_structural_zero():
    """One input's v alone; a 0-d input; a sum f(x) + g(y), whose mixed blocks are structural zeros."""
    x, v = rand(4, seed=85), rand(4, seed=86)
    u = lambda x: torch.cosh(x).prod() * x.sum()  # noqa: E731
    res = hoad.compile(u, order=4, backend="eager")(x)
    for k, (g, w) in enumerate(zip(res.along(v), line(u, (x,), (v,), 4)), 1):
        assert_close(g, w, f"order {k}")
    s, ds = torch.tensor(0.3, dtype=DT), torch.tensor(-1.5, dtype=DT)
    h = lambda x, s: torch.exp(s * x).sum()  # noqa: E731
    res = hoad.compile(h, order=3, wrt=(0, 1), backend="eager")(x, s)
    for g, w in zip(res.along((v, ds)), line(h, (x, s), (v, ds), 3)):
        assert_close(g, w)
    split = lambda x, y: x.sin().sum() + y.exp().sum()  # noqa: E731
    res = hoad.compile(split, order=3, wrt=(0, 1), backend="eager")(x, rand(2, seed=87))
    assert res.is_structural_zero((0, 1))
    for g, w in zip(res.along((v, rand(2, seed=88))), line(split, (x, rand(2, seed=87)), (v, rand(2, seed=88)), 3)):
        assert_close(g, w)


@pytest.mark.parametrize("packed", [False, True])
def test_along_per_sample_with_shared_and_per_sample_directions(packed):
    """Under batch_dim a v of one point's shape is shared by the samples; one with the sample
    axis goes sample by sample."""
    X, Y, VX, vy = rand(4, 3, seed=89), rand(4, 2, seed=90), rand(4, 3, seed=91), rand(2, seed=92)
    res = hoad.compile(f, order=3, wrt=(0, 1), batch_dim=0, packed=packed, backend="eager")(X, Y)
    got = res.along((VX, vy))
    one = lambda x, y: f(x[None], y[None])[0]  # noqa: E731
    want = [torch.stack([line(one, (X[i], Y[i]), (VX[i], vy), 3)[k] for i in range(4)]) for k in range(3)]
    for k, (g, w) in enumerate(zip(got, want), 1):
        assert g.shape == res.value.shape
        assert_close(g, w, f"order {k}")
    # one direction per sample and output entry for x, per sample for y (leading axes of the value's)
    VXO, VY = rand(4, 7, 3, seed=98), rand(4, 2, seed=99)
    got = res.along((VXO, VY))
    for i, j in ((0, 0), (1, 3), (3, 6)):
        ref = line(lambda x, y: one(x, y)[j], (X[i], Y[i]), (VXO[i, j], VY[i]), 3)  # noqa: B023
        for k in range(3):
            assert_close(got[k][i, j], ref[k], f"sample {i}, entry {j}, order {k + 1}")


def test_along_a_modules_parameters_by_name():
    """wrt=hoad.parameters: directions by parameter name (a step in parameter space)."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = rand(3, seed=93)
    res = hoad.compile(net, order=3, wrt=hoad.parameters, backend="eager")(x)
    steps = {name: rand(*p.shape, seed=94 + i) for i, (name, p) in enumerate(net.named_parameters())}
    params = dict(net.named_parameters())
    names = list(params)
    call = lambda *ps: torch.func.functional_call(net, dict(zip(names, ps)), (x,))  # noqa: E731
    want = line(call, [params[n].detach() for n in names], [steps[n] for n in names], 3)
    for g, w in zip(res.along(steps), want):
        assert_close(g, w)


@pytest.mark.parametrize("direction, options, fragment", [
    ("one", {}, "one direction per wrt input (2"),
    ("missing", {}, "missing ['y']"),
    ("shape", {}, "one point's shape (2,)"),
    ("type", {}, "must be a tensor"),
    ("pair", {"diagonal": True}, "diagonal=True"),
])
def test_along_refusals_name_the_fix(direction, options, fragment):
    x, y = rand(3, seed=95), rand(2, seed=96)
    res = hoad.compile(f, order=2, wrt=(0, "y"), backend="eager", **options)(x, y)
    given = {"one": x, "missing": {0: x}, "shape": (x, rand(3, seed=97)), "type": (x, [1.0, 2.0]),
             "pair": (x, y)}[direction]
    with pytest.raises(hoad.InvalidArgumentError, match=re.escape(fragment)):
        res.along(given)
