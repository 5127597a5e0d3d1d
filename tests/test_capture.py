"""Capture (passes/capture.py) traces what autograd sees: what the function computes under no_grad or
reads through .data is a constant, a write autograd does not see keeps its target's derivatives,
and in-place ops are functionalized (a zoo of models captured with none left, a write into a
fresh buffer); against nested torch.func or torch.autograd in float64."""

import pytest
import torch
import torch.nn as nn
from helpers import ZOO, assert_close, check, rand
from torch.func import jacrev

import hoad
from hoad.binding import bind_layout
from hoad.passes.capture import _mutates, capture

MODES = ["forward", "reverse"]


def _in_place_ops(fn, x) -> set[str]:
    layout, tensors = bind_layout(fn, (x,), {})
    return {str(n.target) for n in capture(fn, layout, tensors, [0]).gm.graph.nodes if _mutates(n)}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_model_zoo_has_no_in_place_ops_and_matches_torch_func(name):
    torch.manual_seed(0)
    fn = ZOO[name]()
    x = rand(2, 3)
    assert not _in_place_ops(fn, x)
    check(fn, (x,), order=2)


def test_transformer_encoder_layer_has_no_in_place_ops():
    """torch.func cannot take its second derivatives (CPU flash attention has no forward AD), so
    the gradient is checked against torch.autograd and the Hessian for symmetry."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True).double().eval()

    def f(x):
        return layer(x).sin().sum()

    x = rand(1, 3, 4)
    assert not _in_place_ops(f, x)
    res = hoad.compile(f, order=2)(x)
    assert_close(res[0], jacrev(f)(x), "gradient")
    h = res[0, 0].reshape(12, 12)
    assert_close(h, h.T, "Hessian symmetry")


# ---------------------------------------------------------------- what autograd does not see
@pytest.mark.parametrize("mode", MODES)
def test_no_grad_and_data_inside_the_function_are_constants_as_in_autograd(mode):
    """What the function computes under no_grad / set_grad_enabled(False), or reads through
    .data, has no derivative in autograd; hoad differentiated through it. A call made under
    no_grad from outside still gets every derivative (only the function's own blocks count)."""
    x = torch.tensor([0.3, -1.2, 0.7], dtype=torch.float64)

    def under_no_grad(x):
        with torch.no_grad():
            shift = (x ** 2).sum()
        return shift * x.sin().sum()

    def switched_off(x):
        torch.set_grad_enabled(False)
        shift = (x ** 2).sum()
        torch.set_grad_enabled(True)
        return shift * x.sin().sum()

    def through_data(x):
        return (x.data ** 2).sum() * x.sin().sum()

    def detached(x):  # the reference: the same function with detach
        return (x.detach() ** 2).sum() * x.sin().sum()

    want = hoad.compile(detached, order=2, backend="eager", mode=mode)(x)
    assert_close(want[0], jacrev(detached)(x), "reference")
    for f in (under_no_grad, switched_off, through_data):
        got = hoad.compile(f, order=2, backend="eager", mode=mode)(x)
        assert_close(got[0], want[0], f.__name__)
        assert_close(got[0, 0], want[0, 0], f.__name__)
    with torch.no_grad():
        outside = hoad.compile(lambda x: (x ** 2).sum() * x.sin().sum(), order=1, backend="eager", mode=mode)(x)
    assert_close(outside[0], jacrev(lambda x: (x ** 2).sum() * x.sin().sum())(x), "called under no_grad")


def _autograd_derivatives(f, x, order):
    """∂^k f / ∂x^k for k = 1..order by nested torch.autograd.grad (autograd's own semantics for
    writes it does not see; torch.func's transforms differ there)."""
    x = x.clone().requires_grad_()
    out, d = [], f(x)
    for k in range(order):
        if k == 0:
            d = torch.autograd.grad(d, x, create_graph=True)[0]
        else:
            d = torch.stack([torch.autograd.grad(e, x, create_graph=True, allow_unused=True)[0]
                             for e in d.reshape(-1)]).reshape(*d.shape, *x.shape)
        out.append(d.detach())
    return out


@pytest.mark.parametrize("mode", MODES)
def test_writes_autograd_does_not_see_keep_their_targets_derivatives(mode):
    """y = 2x, then y.mul_(3) under no_grad: autograd keeps dy/dx = 2 and reads the new values
    (2 cos 6x); hoad differentiated through the write (6 cos 6x). Through .data every derivative
    was 0, and y[0] = 5 under no_grad gave 0 at entry 0 where autograd gives 2 cos 5."""
    x = torch.tensor([0.3, -1.2, 0.7], dtype=torch.float64)

    def scaled_under_no_grad(x):
        y = x * 2
        with torch.no_grad():
            y.mul_(3)
        return (y.sin() * x).sum()

    def scaled_through_data(x):
        y = x * 2
        y.data.mul_(3)
        return (y.sin() * x).sum()

    def scaled_through_detach(x):
        y = x * 2
        y.detach().add_(1.5)
        return (y.sin() * x).sum()

    def entry_set_under_no_grad(x):
        y = x * 2
        with torch.no_grad():
            y[0] = 5.0
            y[1] = float("inf")  # (a target's inf stays the written value's business)
        return (y[[0, 2]].sin() * x[[0, 2]]).sum()

    for f in (scaled_under_no_grad, scaled_through_data, scaled_through_detach, entry_set_under_no_grad):
        got = hoad.compile(f, order=3, backend="eager", mode=mode)(x)
        for k, want in enumerate(_autograd_derivatives(f, x, 3), 1):
            assert_close(got[(0,) * k], want, f"{f.__name__} order {k}")

    def transposed_under_no_grad(x):  # (a write of its shape, not its values: the kept clone failed to broadcast)
        y = (x * 2)[None].expand(2, 3).clone()
        with torch.no_grad():
            y.t_()
        return (y.sin() * x[:, None]).sum()

    plain = lambda x: ((x * 2)[None].expand(2, 3).t().sin() * x[:, None]).sum()  # noqa: E731
    assert_close(hoad.compile(transposed_under_no_grad, order=1, backend="eager", mode=mode)(x)[0], jacrev(plain)(x),
                 "transposed under no_grad")


# ------------------------------------------------------------------------------------ writes
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_write_into_a_fresh_buffer(mode):
    """Functionalization turns ``z[0] = v`` into a functional copy and scatters, and capture
    decomposes the copy into a broadcast clone (torch's autograd has no formula for ``copy``)."""
    def f(x):
        z = torch.zeros(2, 3, dtype=x.dtype)
        z[0] = x[1].sin()
        z[:, 1:] = x[:, :1].cos()
        return (z * x).exp().sum()

    check(f, (rand(2, 3, seed=54),), order=3, mode=mode)
