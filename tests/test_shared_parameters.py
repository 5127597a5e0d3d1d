"""Per-sample derivatives with respect to parameters every sample shares (``batch_dim=0`` with a
module's parameters in ``wrt``): blocks ``(B, *p, *p)`` equal to ``vmap`` over torch.func with
the parameters unmapped, on an MLP classifier, a CNN and attention, mixed with the samples' own
inputs, flat, chunked and at every number of samples."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, compiled, inductor_layout, rand, shared_parameter_reference
from torch import nn
from torch.func import functional_call, hessian, jacfwd, jacrev, vmap

import hoad

DT = torch.float64


class PerSampleLoss(nn.Module):
    """Each sample's cross-entropy: the output holds one loss per sample."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net.to(DT)

    def forward(self, X, y):
        return F.cross_entropy(self.net(X), y, reduction="none")


def _mlp():
    torch.manual_seed(470)
    return PerSampleLoss(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)))


def _cnn():
    torch.manual_seed(471)
    return PerSampleLoss(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)))


class Attention(nn.Module):
    """Self-attention within each sample's sequence, then a squared readout per sample."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(472)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True, dtype=DT)

    def forward(self, X):
        return self.attn(X, X, X, need_weights=False)[0].pow(2).sum((1, 2))


def _check(res, keys: list, ref: dict):
    for K, expected in ref.items():
        key = tuple(keys[p] for p in K)
        assert_close(res[key], expected, f"block {key}")


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("layout", ["eager", "fused"])
def test_an_mlp_classifiers_per_sample_blocks_equal_vmap_up_to_order_three(mode, layout):
    model = _mlp()
    X, y = rand(5, 3, seed=1), torch.tensor([0, 2, 1, 1, 0])
    names = ["net.0.weight", "net.2.bias"]
    target = inductor_layout() if layout == "fused" else None
    with torch.no_grad():
        res = compiled(model, 3, names, target=target, batch_dim=0, mode=mode, backend="eager")(X, y)
    assert res["net.0.weight", "net.2.bias"].shape == (5, 4, 3, 3)
    assert res["net.0.weight", "net.0.weight", "net.2.bias"].shape == (5, 4, 3, 4, 3, 3)
    _check(res, names, shared_parameter_reference(model, names, (X, y), 3))
    mixed = shared_parameter_reference(model, names, (X, y), 2)[(0, 1)]
    assert_close(res["net.2.bias", "net.0.weight"], mixed.permute(0, 3, 1, 2), "a permuted key")


def test_every_parameter_of_a_cnn_at_order_two():
    model = _cnn()
    X, y = rand(4, 1, 5, 5, seed=2), torch.tensor([2, 0, 1, 2])
    names = [k for k, _ in model.named_parameters()]
    with torch.no_grad():
        res = hoad.compile(model, order=2, wrt=hoad.parameters, batch_dim=0, backend="eager")(X, y)
    assert res.wrt == names
    _check(res, names, shared_parameter_reference(model, names, (X, y), 2))


def test_attention_within_each_sample_with_its_input_and_its_projection():
    """Mixed blocks of the samples' own input and a shared parameter: (B, *x, *p)."""
    model = Attention()
    X = rand(3, 3, 4, seed=3)
    names = ["attn.in_proj_weight", "attn.out_proj.bias"]
    with torch.no_grad():
        res = hoad.compile(model, order=2, wrt=["X"] + names, batch_dim=0, backend="eager")(X)
    assert res["X", "attn.in_proj_weight"].shape == (3, 3, 4, 12, 4)
    _check(res, ["X"] + names, shared_parameter_reference(model, names, (X,), 2, sample_wrt=(0,)))


@pytest.mark.parametrize("kind", ["cnn", "attention"])
def test_order_three_of_a_cnn_and_of_attention(kind):
    if kind == "cnn":
        model, args, names = _cnn(), (rand(3, 1, 5, 5, seed=10), torch.tensor([2, 0, 1])), ["net.0.weight"]
    else:
        model, args, names = Attention(), (rand(3, 3, 4, seed=11),), ["attn.in_proj_bias"]
    with torch.no_grad():
        res = hoad.compile(model, order=3, wrt=names, batch_dim=0, backend="eager")(*args)
    _check(res, names, shared_parameter_reference(model, names, args, 3))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_mixed_input_parameter_blocks_at_order_three(mode):
    model = _mlp()
    X, y = rand(4, 3, seed=4), torch.tensor([1, 0, 2, 2])
    with torch.no_grad():
        res = hoad.compile(model, order=3, wrt=["X", "net.2.weight"], batch_dim=0, mode=mode, backend="eager")(X, y)
    _check(res, ["X", "net.2.weight"], shared_parameter_reference(model, ["net.2.weight"], (X, y), 3, sample_wrt=(0,)))


def test_the_pure_derivatives_under_diagonal():
    model = _mlp()
    X, y = rand(4, 3, seed=5), torch.tensor([1, 0, 2, 2])
    with torch.no_grad():
        res = hoad.compile(model, order=2, wrt=["net.0.weight"], batch_dim=0, diagonal=True, backend="eager")(X, y)
    full = shared_parameter_reference(model, ["net.0.weight"], (X, y), 2)[(0, 0)].reshape(4, 12, 12)
    assert_close(res["net.0.weight", "net.0.weight"], full.diagonal(dim1=1, dim2=2).reshape(4, 4, 3), "pure")


def test_flat_gives_one_hessian_per_sample_for_a_newton_or_laplace_step():
    model = _mlp()
    X, y = rand(5, 3, seed=6), torch.tensor([0, 2, 1, 1, 0])
    with torch.no_grad():
        res = hoad.compile(model, order=2, wrt=hoad.parameters, batch_dim=0, backend="eager")(X, y)
    named = list(model.named_parameters())
    theta = torch.cat([p.detach().reshape(-1) for _, p in named])

    def of_theta(t, x, label):
        parts, at = {}, 0
        for name, p in named:
            parts[name] = t[at:at + p.numel()].reshape(p.shape)
            at += p.numel()
        return functional_call(model, parts, (x[None], label[None]))[0]

    H = res.flat()
    assert H.shape == (5, 31, 31) and torch.equal(H, H.transpose(1, 2)), "one exactly symmetric (P, P) per sample"
    assert_close(H, vmap(hessian(of_theta), in_dims=(None, 0, 0))(theta, X, y), "per-sample Hessians")
    assert_close(res.flat(order=1), vmap(jacrev(of_theta), in_dims=(None, 0, 0))(theta, X, y), "per-sample gradients")


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_one_program_serves_every_number_of_samples(backend):
    """Counts 5, 4, 6, 9, 4: the second builds the program for every count, labels and all. At 6
    samples Linear(3, 6)'s weight has as many rows as there are samples, and stays a shared
    (6, 3) parameter."""
    torch.manual_seed(473)
    model = PerSampleLoss(nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 3)))
    names = ["net.0.weight"]
    cf = hoad.compile(model, order=2, wrt=names, batch_dim=0, backend=backend)
    for count in (5, 4, 6, 9, 4):
        X, y = rand(count, 3, seed=480 + count), torch.arange(count) % 3
        with torch.no_grad():
            res = cf(X, y)
        assert res["net.0.weight", "net.0.weight"].shape == (count, 6, 3, 6, 3)
        _check(res, names, shared_parameter_reference(model, names, (X, y), 2))
    assert len({id(e) for e in cf._cache.values()}) == 2, "one program for 5 samples, one for every number"


def test_chunks_split_the_samples_and_keep_the_parameters_whole():
    model, X = Attention(), rand(7, 3, 4, seed=7)
    wrt = ["X", "attn.out_proj.weight"]
    with torch.no_grad():
        whole = hoad.compile(model, order=2, wrt=wrt, batch_dim=0, backend="eager")(X)
        chunked = hoad.compile(model, order=2, wrt=wrt, batch_dim=0, backend="eager", chunk_size=3)(X)
    for key in whole:
        assert_close(chunked[key], whole[key], f"block {key}")
    with pytest.raises(hoad.InvalidArgumentError, match=r"names none of this call's arguments.*Add the input"):
        hoad.compile(model, order=2, wrt=["attn.out_proj.weight"], batch_dim=0, chunk_size=3)(X)


def test_a_function_that_mixes_samples_is_still_differentiated_exactly_wrt_its_parameters():
    """Centering over the batch mixes samples: each output's derivative with respect to a shared
    parameter is still exact (the Jacobian of the whole batch's outputs); wrt the samples' own
    input, the mixing is named."""
    torch.manual_seed(474)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(DT)

    class Centered(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, X):
            return self.net(X - X.mean(0)).squeeze(-1)

    model, X = Centered(), rand(5, 3, seed=8)
    w = net[0].weight.detach()
    whole = lambda v: functional_call(model, {"net.0.weight": v}, (X,))  # noqa: E731
    with torch.no_grad():
        res = hoad.compile(model, order=2, wrt=["net.0.weight"], batch_dim=0, backend="eager")(X)
    assert_close(res["net.0.weight"], jacrev(whole)(w), "gradient")
    assert_close(res["net.0.weight", "net.0.weight"], jacfwd(jacrev(whole))(w), "Hessian")
    with pytest.raises(hoad.BatchCouplingError, match="mixes entries along the batch axis"):
        hoad.compile(model, order=2, wrt=["X", "net.0.weight"], batch_dim=0, backend="eager")(X)


def test_a_plain_tensor_without_the_samples_names_the_module_way():
    with pytest.raises(hoad.InvalidArgumentError, match=r"every sample shares is a module's parameter"):
        hoad.compile(lambda X, w: (X @ w).sum(1), order=2, wrt=(0, 1), batch_dim=0)(rand(3, 4), rand(4, 2))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_the_program_keeps_every_tensor_linear_in_the_samples(mode):
    """No (B, B, …) tensor: the parameters' blocks carry one sample axis, never a pair."""
    sizes = {}
    for B in (5, 19):
        torch.manual_seed(475)
        model = PerSampleLoss(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)))
        cf = hoad.compile(model, order=2, wrt=["net.0.weight", "X"], batch_dim=0, mode=mode, backend="eager")
        with torch.no_grad():
            cf(rand(B, 3, seed=B), torch.arange(B) % 3)
        values = [n.meta["val"] for n in cf.graph.module.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        assert not any(list(v.shape).count(B) >= 2 for v in values), "a tensor with two sample axes"
        sizes[B] = max(v.numel() for v in values)
    assert sizes[19] <= 19 / 5 * sizes[5] * 1.01


def test_a_penalty_on_per_sample_gradients_trains_through_the_program():
    """A loss made of the per-sample gradients (a gradient-norm penalty): its backward reaches the
    parameters as torch.func's grad of vmap(grad) does."""
    model = _mlp()
    X, y = rand(5, 3, seed=9), torch.tensor([0, 2, 1, 1, 0])
    res = hoad.compile(model, order=1, wrt=hoad.parameters, batch_dim=0, backend="eager")(X, y)
    penalty = res.flat(order=1).pow(2).sum(1).mean()
    got = torch.autograd.grad(penalty, list(model.parameters()))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def of_params(p):
        one = lambda q, x, label: functional_call(model, q, (x[None], label[None]))[0]  # noqa: E731
        g = vmap(jacrev(one), in_dims=(None, 0, 0))(p, X, y)
        return sum(v.reshape(5, -1).pow(2).sum(1) for v in g.values()).mean()

    ref = jacrev(of_params)(params)
    for (name, _), g in zip(model.named_parameters(), got):
        assert_close(g, ref[name], name)
