"""Containers: functions that return several tensors (a tuple, list or dict of them, nested),
one program for all of them and one result per tensor in the function's own structure (a
Navier-Stokes PINN returns (u, v, p)); and wrt entries that name a container argument, each of
its tensors then a wrt entry named by its path."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import assert_close, rand
from torch import nn
from torch.func import hessian, jacfwd, jacrev, vmap

import hoad

DT = torch.float64


def _net():
    torch.manual_seed(44)
    return nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 3)).to(DT)


NET = _net()


def uvp(P):
    out = NET(P)
    return out[..., 0], out[..., 1], out[..., 2]


def one(i):
    return lambda p: NET(p)[..., i]


def _laplacian(f):
    return lambda p: hessian(f)(p).diagonal().sum()


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=[pytest.mark.inductor, pytest.mark.slow])])
def test_per_sample_tuple_outputs_against_each_output_alone(backend):
    cf = hoad.compile(uvp, order=2, batch_dim=0, backend=backend)
    for count in (6, 9, 4):  # (then one program for every count: each output's shape follows the call)
        P = rand(count, 2, seed=count)
        res = cf(P)
        assert isinstance(res, tuple) and len(res) == 3
        for i, r in enumerate(res):
            assert isinstance(r, hoad.Derivatives)
            assert_close(r.value, NET(P)[:, i], f"value {i} at {count} samples")
            assert_close(r[0], vmap(jacrev(one(i)))(P), f"gradient {i}")
            assert_close(r[0, 0], vmap(hessian(one(i)))(P), f"Hessian {i}")
    assert any(e.build.stats.get("any_samples") for e in cf._cache.values())


def test_nested_dict_outputs_with_two_inputs_at_order_3():
    """A dict holding a tuple, outputs of different shapes, mixed blocks of two inputs."""
    x, w = rand(3, seed=2), rand(3, 2, seed=3)

    def f(x, w):
        h = torch.tanh(x @ w)
        return {"energy": h.pow(2).sum(), "parts": (h * 2, x.sin() * w.sum())}

    res = hoad.compile(f, order=3, wrt=(0, 1))(x, w)
    assert set(res) == {"energy", "parts"} and isinstance(res["parts"], tuple)
    leaves = {"energy": lambda x, w: f(x, w)["energy"], "parts0": lambda x, w: f(x, w)["parts"][0],
              "parts1": lambda x, w: f(x, w)["parts"][1]}
    got = {"energy": res["energy"], "parts0": res["parts"][0], "parts1": res["parts"][1]}
    for name, g in leaves.items():
        assert_close(got[name].value, g(x, w), f"{name} value")
        assert_close(got[name][0, 1], jacfwd(jacrev(g, argnums=0), argnums=1)(x, w), f"{name} ∂²/∂x∂w")
        assert_close(got[name][1, 0, 0], jacfwd(jacfwd(jacrev(g, argnums=1), argnums=0), argnums=0)(x, w),
                     f"{name} order 3")


def test_a_list_output_keeps_its_type_and_the_program_is_one():
    x = rand(4, seed=4)
    cf = hoad.compile(lambda x: [x.sin().sum(), x.exp()], order=2)
    res = cf(x)
    assert isinstance(res, list) and res[1].value.shape == (4,)
    assert_close(res[1][0, 0], jacfwd(jacrev(torch.exp))(x), "exp's second derivatives")
    assert len({id(e) for e in cf._cache.values()}) == 1


@pytest.mark.parametrize("estimator", [None, "pairs", "gaussian"])
def test_operators_give_one_result_per_output(estimator):
    P = rand(4, 2, seed=5)
    if estimator is None:
        lap = hoad.laplacian(uvp, batch_dim=0)(P)
        bih = hoad.biharmonic(uvp, batch_dim=0)(P)
        for i in range(3):
            assert_close(lap[i].laplacian, vmap(_laplacian(one(i)))(P), f"Δu of output {i}")
            assert_close(lap[i].gradient, vmap(jacrev(one(i)))(P), f"∇u of output {i}")
            assert_close(bih[i].biharmonic, vmap(_laplacian(_laplacian(one(i))))(P), f"Δ²u of output {i}")
        return
    V = rand(3, 2, seed=6)
    bih = hoad.biharmonic(uvp, batch_dim=0, directions=V, estimator=estimator)(P)
    for i in (0, 2):
        alone = hoad.biharmonic(one(i), batch_dim=0, directions=V, estimator=estimator)(P)
        assert_close(bih[i].biharmonic, alone.biharmonic, f"{estimator} estimate of output {i}")
        assert_close(bih[i].laplacian, alone.laplacian, f"{estimator} Laplacian of output {i}")


def test_taylor_per_output():
    P, V = rand(4, 2, seed=7), rand(3, 2, seed=8)
    jets = hoad.taylor(uvp, order=3, directions=V, batch_dim=0)(P)
    for i in range(3):
        alone = hoad.taylor(one(i), order=3, directions=V, batch_dim=0)(P)
        assert_close(jets[i].derivatives, alone.derivatives, f"output {i}")


def test_training_through_several_outputs():
    """A residual over (u, v, p) trains every parameter: gradients as with each output's own
    operator (one program against three)."""
    P = rand(8, 2, seed=9)
    lap = hoad.laplacian(uvp, batch_dim=0)
    loss = sum((r.laplacian + r.value).pow(2).mean() for r in lap(P))
    got = torch.autograd.grad(loss, list(NET.parameters()))
    want_loss = sum((hoad.laplacian(one(i), batch_dim=0)(P).laplacian + NET(P)[:, i]).pow(2).mean() for i in range(3))
    want = torch.autograd.grad(want_loss, list(NET.parameters()))
    for g, h in zip(got, want):
        assert_close(g, h, "parameter gradient")


def test_chunks_join_each_output():
    P = rand(10, 2, seed=10)
    whole = hoad.compile(uvp, order=2, batch_dim=0)(P)
    chunked = hoad.compile(uvp, order=2, batch_dim=0, chunk_size=4)(P)
    for a, b in zip(whole, chunked):
        assert_close(b[0, 0], a[0, 0], "chunked Hessians")


@pytest.mark.parametrize("f,options,fragment", [
    (lambda x: (x.sin().sum(), x.float().cos().sum()), {}, "different dtypes (output[0] float64, output[1] float32)"),
    (lambda x: {"u": x.sin(), "mask": x > 0}, {}, "output['mask'] bool); hoad differentiates them in one program"),
    (lambda X: (X.sin().sum(), X.cos()), {"batch_dim": 0}, "holds its samples along dim 0"),
    (lambda x: (x.sin().sum(), "label"), {}, "output[1] is 'label', not a tensor"),
    (lambda x: {"u": [x.sin(), None]}, {}, "output['u'][1] is None, not a tensor"),
    (lambda x: {}, {}, "returns an empty dict: there is no tensor to differentiate"),
])
def test_outputs_that_cannot_be_joined_are_refused(f, options, fragment):
    """Each refusal names the output that cannot be joined (a message naming only the container
    said "must return a single tensor, got a dict" of a dict holding a None)."""
    with pytest.raises(hoad.OutputError, match=re.escape(fragment)):
        hoad.compile(f, order=1, **options)(rand(4, 2, seed=11) if options else rand(3, seed=11))


# ------------------------------------------------------------------------- container inputs
def _with_batch(x, batch):
    return (batch["u"] * x.sin()).sum() + (batch["v"] ** 2).sum() * x.cos().sum() + batch["w"]["deep"].exp().sum()


@pytest.mark.parametrize("wrt", [(0, "batch"), (0, 1)])
def test_a_dict_argument_in_wrt_is_each_of_its_tensors(wrt):
    """wrt naming a dict raised "wrt input 1 is a dict"; each tensor in it is now an entry named
    by its path, against torch.func's dict-shaped derivatives."""
    x = rand(3, seed=20)
    batch = {"u": rand(3, seed=21), "v": rand(2, seed=22), "w": {"deep": rand(2, seed=23)}}
    res = hoad.compile(_with_batch, order=3, wrt=wrt)(x, batch)
    assert list(res.wrt) == [0, "batch['u']", "batch['v']", "batch['w']['deep']"]
    h = jacfwd(jacrev(_with_batch, argnums=1), argnums=1)(x, batch)
    assert_close(res["batch['u']", "batch['v']"], h["u"]["v"], "∂²/∂u∂v")
    assert_close(res["batch['w']['deep']", "batch['w']['deep']"], h["w"]["deep"]["w"]["deep"], "the nested tensor")
    mixed = jacfwd(jacrev(_with_batch, argnums=0), argnums=1)(x, batch)
    assert_close(res["x", "batch['v']"], mixed["v"], "with the plain input")
    third = jacfwd(jacfwd(jacrev(_with_batch, argnums=1), argnums=1), argnums=0)(x, batch)
    assert_close(res["batch['u']", "batch['u']", 0], third["u"]["u"], "order 3")
    assert res.flat().shape == (10, 10), "every entry along one flat axis"


def test_a_tuple_argument_per_sample():
    X, Y = rand(5, 2, seed=24), rand(5, 2, seed=25)
    f = lambda pair: (pair[0].sin() * pair[1]).sum(-1) + pair[1].pow(3).sum(-1)  # noqa: E731
    res = hoad.compile(f, order=2, wrt="pair", batch_dim=0)((X, Y))
    assert list(res.wrt) == ["pair[0]", "pair[1]"]
    g = lambda x, y: (x.sin() * y).sum() + y.pow(3).sum()  # noqa: E731
    assert_close(res["pair[0]", "pair[1]"], vmap(jacfwd(jacrev(g, argnums=0), argnums=1))(X, Y), "per sample")


def test_a_container_without_tensors_is_refused():
    with pytest.raises(hoad.InvalidArgumentError, match="holding no tensor"):
        hoad.compile(lambda x, opts: x.sin().sum() * opts["k"], order=1, wrt="opts")(rand(3, seed=26), {"k": 2.0})


# ------------------------------------------------------------- a leaf or a subtree of a container
def test_wrt_addresses_a_leaf_or_a_subtree_inside_a_container():
    """A wrt entry may name a path inside a container argument: a leaf ("batch['v']"), a subtree
    ("batch['w']", each tensor under it), beside other entries. It was refused ("not an argument
    of the function")."""
    x = rand(3, seed=27)
    batch = {"u": rand(3, seed=28), "v": rand(2, seed=29), "w": {"deep": rand(2, seed=30), "flat": rand(1, seed=31)}}

    def f(x, batch):
        return _with_batch(x, batch) * batch["w"]["flat"].sum().cos()

    res = hoad.compile(f, order=2, wrt=("batch['w']", 0, "batch['v']"))(x, batch)
    assert list(res.wrt) == ["batch['w']['deep']", "batch['w']['flat']", 0, "batch['v']"]
    h = jacfwd(jacrev(f, argnums=(0, 1)), argnums=(0, 1))(x, batch)
    assert_close(res["batch['w']['deep']", "batch['w']['flat']"], h[1]["w"]["deep"][1]["w"]["flat"], "in the subtree")
    assert_close(res["batch['v']", "batch['w']['flat']"], h[1]["v"][1]["w"]["flat"], "leaf and subtree")
    assert_close(res["x", "batch['v']"], h[0][1]["v"], "with the plain input")
    assert res.flat().shape == (8, 8), "2 + 1 + 3 + 2 entries"
    with pytest.raises(hoad.InvalidArgumentError, match="holds no tensor of argument 'batch'; the tensors in it are"):
        hoad.compile(f, order=2, wrt="batch['z']")(x, batch)
    with pytest.raises(hoad.InvalidArgumentError, match="not an argument of the function"):
        hoad.compile(f, order=2, wrt="bacth['u']")


def test_operators_differentiate_a_tensor_inside_a_container():
    """A space-time PINN's u({"x": X, "t": T}): the Laplacian, randomized Laplacian and jets
    along curves in x alone, per sample, against torch.func; chunk_size, which splits tensor
    arguments, is refused naming the way out."""
    W = rand(2, 4, seed=32)

    def u(inputs):
        return torch.tanh(inputs["x"] @ W + inputs["t"][..., None]).sum(-1) * (1 + inputs["t"] ** 2)

    X, T = rand(5, 2, seed=33), rand(5, seed=34)
    H = vmap(lambda x, t: hessian(lambda y: u({"x": y, "t": t}))(x))(X, T)
    G = vmap(lambda x, t: torch.func.grad(lambda y: u({"x": y, "t": t}))(x))(X, T)
    lap = hoad.laplacian(u, "inputs['x']", batch_dim=0)({"x": X, "t": T})
    assert_close(lap.laplacian, H.diagonal(dim1=-2, dim2=-1).sum(-1), "Laplacian in x")
    drawn = hoad.laplacian(u, "inputs['x']", batch_dim=0, randomization=("normal", 3))
    got = drawn({"x": X, "t": T}).laplacian
    assert_close(got, torch.einsum("sd,bde,se->b", drawn.directions, H, drawn.directions) / 3, "drawn directions")
    V, V2 = rand(2, 2, seed=35), rand(2, 2, seed=36)
    curves = hoad.taylor(u, order=2, wrt="inputs['x']", batch_dim=0, directions=V, higher=(V2,))({"x": X, "t": T})
    assert_close(curves[2], torch.einsum("sd,bde,se->bs", V, H, V) + G @ V2.T, "along curves in x")
    with pytest.raises(hoad.InvalidArgumentError, match="inside a container argument: pass the points"):
        hoad.taylor(u, order=2, wrt="inputs['x']", batch_dim=0, directions=V, higher=(V2,), chunk_size=2)(
            {"x": X, "t": T})
    with pytest.raises(hoad.InvalidArgumentError, match="inside a container"):
        hoad.compile(u, order=2, wrt="inputs['x']", batch_dim=0, chunk_size=2)({"x": X, "t": T})


def test_a_path_to_a_number_or_to_nothing_says_what_is_there():
    """A wrt path at a Python float inside a container was refused as holding "no tensor" (by
    hoad.compile) or as "a NoneType" (by the operators); a path to nothing, too, was "a NoneType"."""
    x = rand(3, seed=37)

    def u(x, b):
        return b["s"] * (b["t"] * x.sin()).sum()

    b = {"s": 2.0, "t": rand(3, seed=38)}
    with pytest.raises(hoad.InvalidArgumentError, match=re.escape("holds 2.0 (float), not a tensor: pass it as")):
        hoad.compile(u, order=2, wrt="b['s']")(x, b)
    with pytest.raises(hoad.InvalidArgumentError, match=re.escape("must be a floating-point tensor, got 2.0 (float)")):
        hoad.laplacian(u, "b['s']")(x, b)
    with pytest.raises(hoad.InvalidArgumentError, match=re.escape("is not in the call's argument 'b'; the tensors "
                                                                  "in it are [\"b['t']\"]")):
        hoad.laplacian(u, "b['z']")(x, b)


def test_chunk_size_refuses_samples_it_cannot_split_inside_a_container():
    """chunk_size splits the wrt inputs; another tensor with a row per sample, kept whole, would
    be silently wrong (a mean over it) or fail to broadcast, so it is refused. One inside a
    container argument went unseen."""
    X, C = rand(6, 3, seed=37), rand(6, 3, seed=38)
    f = lambda x, extra: (x.sin() * extra["c"].mean(0)).sum(-1)  # noqa: E731
    with pytest.raises(hoad.InvalidArgumentError, match=r"the tensor argument 1\['c'\] \(shape \(6, 3\)\) also has 6"):
        hoad.compile(f, order=2, batch_dim=0, chunk_size=4)(X, {"c": C})


def test_chunk_size_takes_parameter_names_for_parameters():
    """A parameter's name ("net.0.weight") is no path inside an argument named like its submodule
    (``net``): chunk_size, which refuses a wrt inside a container argument, took it for one."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double()

        def forward(self, net):  # (the points, named like the submodule)
            return self.net(net).squeeze(-1)

    m, X = Model(), rand(5, 2, seed=39)
    whole = hoad.compile(m, order=2, wrt=(0, hoad.parameters), batch_dim=0)(X)
    chunked = hoad.compile(m, order=2, wrt=(0, hoad.parameters), batch_dim=0, chunk_size=2)(X)
    for key in ((0,), ("net.0.weight",), (0, "net.0.weight")):
        assert_close(chunked[key], whole[key], f"{key}, in chunks of 2")
