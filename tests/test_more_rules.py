"""Ops hoad covers by decomposing them into ops with rules (issue 17, passes/decompositions.py and passes/indexing.py),
checked where the OpInfo sweep cannot: derivatives in every argument, orders torch cannot
differentiate (its backward of cdist, pdist, segment_reduce, embedding_bag has no derivative),
and the edges where a convention decides (zero distance, zeros in a product, ties).

Where torch.func has no derivative of the op itself, or a wrong one, the reference is torch.func
of the same function in plain ops, and the plain function is checked against torch's own first
derivative (the op's convention) where torch has one.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check, rand

import hoad
from hoad.passes.indexing import _grid_sampler

aten = torch.ops.aten


def _idx(*v):
    return torch.tensor(v)


def _grad(f, *args):
    """torch's own first derivative of the scalar f, per argument."""
    args = [a.detach().requires_grad_() for a in args]
    return torch.autograd.grad(f(*args), args)


# ------------------------------------------------------------------------------- grid_sample
# Bilinear in the image; in the grid a polynomial between the integer crossings, so every order
# in the grid is the polynomial's (torch's kernel has no second derivative in the grid).
def _plain_grid_sampler_2d(a, grid, mode, padding, align):
    from torch._decomp.decompositions import _grid_sampler_2d

    return _grid_sampler_2d(a, grid, mode, padding, align)


_MODES = {"bilinear": 0, "nearest": 1, "bicubic": 2}
_PADDINGS = {"zeros": 0, "border": 1, "reflection": 2}


@pytest.mark.parametrize("mode,padding,align,order", [
    ("bilinear", "zeros", False, 2),
    pytest.param("bilinear", "zeros", False, 3, marks=pytest.mark.slow),
    pytest.param("bicubic", "border", True, 2, marks=pytest.mark.slow),
    pytest.param("bilinear", "reflection", False, 2, marks=pytest.mark.slow),
])
def test_grid_sample_2d_in_image_and_grid(mode, padding, align, order):
    a, grid = rand(1, 1, 3, 4, seed=40), rand(1, 1, 3, 2, seed=41) * 1.3

    def f(a, g):
        return F.grid_sample(a.sin(), g.tanh() * 1.2, mode=mode, padding_mode=padding,
                             align_corners=align).sin().sum((0, 1))

    def plain(a, g):
        return _plain_grid_sampler_2d(a.sin(), g.tanh() * 1.2, _MODES[mode], _PADDINGS[padding],
                                      align).sin().sum((0, 1))

    for want, got in zip(_grad(lambda a, g: f(a, g).sum(), a, grid), _grad(lambda a, g: plain(a, g).sum(), a, grid)):
        assert_close(got, want, "the plain form's first derivative is torch's")
    # the image derivative is linear (the sweep checks it): the default run takes the grid's alone
    check(f, (a, grid), wrt=(1,) if order == 2 and mode == "bilinear" else (0, 1), order=order, reference_fn=plain,
          mode="forward")


@pytest.mark.parametrize("order,mode", [(1, "reverse"), pytest.param(2, "forward", marks=pytest.mark.slow),
                                        pytest.param(2, "reverse", marks=pytest.mark.slow)])
def test_grid_sample_3d_in_image_and_grid(order, mode):
    a, grid = rand(1, 1, 2, 2, 2, seed=42), rand(1, 1, 1, 2, 3, seed=43) * 1.3

    def f(a, g):
        return F.grid_sample(a.sin(), g.tanh() * 1.2, padding_mode="reflection", align_corners=False).sin().sum()

    def plain(a, g):
        return _grid_sampler(a.sin(), g.tanh() * 1.2, 0, 2, False).sin().sum()

    assert_close(plain(a, grid), f(a, grid), "value")
    for want, got in zip(_grad(f, a, grid), _grad(plain, a, grid)):
        assert_close(got, want, "the plain form's first derivative is torch's")
    check(f, (a, grid), wrt=(0, 1), order=order, reference_fn=plain, mode=mode)


@pytest.mark.parametrize("mode,padding", [("bilinear", "zeros"), ("nearest", "reflection"), ("bilinear", "border")])
def test_grid_sample_2d_per_sample(mode, padding):
    """Each sample reads its own image at its own grid: torch's 2-D decomposition indexed the
    image by arange(N), a false BatchCouplingError under batch_dim=0."""
    a, grid = rand(2, 2, 3, 4, seed=46), rand(2, 2, 3, 2, seed=47) * 1.3

    def f(a, g):
        return F.grid_sample(a.sin(), g.tanh() * 1.2, mode=mode, padding_mode=padding,
                             align_corners=False).sin().sum((1, 2, 3))

    def plain(a, g):
        out = _plain_grid_sampler_2d(a.sin(), g.tanh() * 1.2, _MODES[mode], _PADDINGS[padding], False)
        return out.sin().sum((1, 2, 3))

    check(f, (a, grid), wrt=(0, 1), order=2, reference_fn=plain, batch_dim=0)


@pytest.mark.slow
def test_grid_sample_3d_nearest_border():
    a, grid = rand(1, 2, 3, 2, 2, seed=44), rand(1, 2, 1, 2, 3, seed=45) * 1.5
    check(lambda a: F.grid_sample(a.sin(), grid, mode="nearest", padding_mode="border",
                                  align_corners=False).tanh().sum(),
          (a,), order=2, reference_fn=lambda a: _grid_sampler(a.sin(), grid, 1, 1, False).tanh().sum())


# ------------------------------------------------------------------------------------ distances
def _plain_norm(d, p):
    """The norm written out, 0 where d is all zero (torch's derivative there is 0)."""
    zero = (d == 0).all(-1, keepdim=True)
    safe = torch.where(zero, torch.ones_like(d), d)
    n = (safe.abs() ** p).sum(-1) ** (1 / p) if p != 2 else (safe * safe).sum(-1).sqrt()
    return torch.where(zero.squeeze(-1), torch.zeros_like(n), n)


@pytest.mark.parametrize("p", [2.0, pytest.param(1.5, marks=pytest.mark.slow)])
def test_cdist_with_a_coincident_row(p):
    x1, x2 = rand(3, 2, seed=46), rand(2, 2, seed=47)
    x2[1] = x1[0].sin()  # distance 0 between sin(x1[0]) and x2[1]: torch's first derivative there is 0
    f = lambda x, y: torch.cdist(x.sin(), y, p=p).sin()  # noqa: E731
    plain = lambda x, y: _plain_norm(x.sin()[:, None] - y[None], p).sin()  # noqa: E731
    want = _grad(lambda x, y: f(x, y).sum(), x1, x2)
    got = _grad(lambda x, y: plain(x, y).sum(), x1, x2)
    for w, g in zip(want, got):
        assert_close(g, w, "the plain form's first derivative is torch's")
    check(f, (x1, x2), wrt=(0, 1), order=2, reference_fn=plain, mode="forward")


def test_pdist_and_dist():
    x = rand(4, 3, seed=48)
    i, j = torch.triu_indices(4, 4, 1)
    check(lambda x: F.pdist(x.sin(), p=3).tanh(), (x,), order=2,
          reference_fn=lambda x: _plain_norm(x.sin()[i] - x.sin()[j], 3).tanh(), mode="reverse")
    y = x.clone()
    assert_close(hoad.compile(lambda x: torch.dist(x, y), order=1)(x)[0], torch.zeros_like(x), "dist at 0")


# ------------------------------------------------------------------------------ segments, bags
def test_segment_reduce_orders_torch_cannot_reach():
    data, lengths = rand(6, 2, seed=49), _idx(2, 0, 3, 1)
    ids = _idx(0, 0, 2, 2, 2, 3)

    def plain(x, reduce, initial):
        segs = [x[ids == s] for s in range(4)]
        if reduce == "mean":
            return torch.stack([(s.sum(0) + initial) / max(len(s), 1) for s in segs])
        return torch.stack([torch.cat([s, torch.full((1, 2), initial, dtype=x.dtype)]).amax(0) for s in segs])

    for reduce in ("mean", "max"):
        f = lambda x, reduce=reduce: torch.segment_reduce(x.sin(), reduce, lengths=lengths, initial=-0.5).tanh()  # noqa: E731
        assert_close(f(data), plain(data.sin(), reduce, -0.5).tanh(), "value")
        check(f, (data,), order=2, reference_fn=lambda x, reduce=reduce: plain(x.sin(), reduce, -0.5).tanh())


@pytest.mark.parametrize("mode", ["sum", pytest.param("mean", marks=pytest.mark.slow), "max"])
def test_embedding_bag(mode):
    w, psw = rand(5, 3, seed=50), rand(6, seed=51)
    idx, offsets = _idx(0, 2, 1, 2, 4, 1), _idx(0, 2, 2, 5)

    def f(w, s):
        return F.embedding_bag(idx, w.sin(), offsets, mode=mode, padding_idx=1,
                               per_sample_weights=s.exp() if mode == "sum" else None).tanh()

    def plain(w, s):
        rows = w.sin()[idx] * (s.exp()[:, None] if mode == "sum" else 1)
        bags = []
        for lo, hi in ((0, 2), (2, 2), (2, 5), (5, 6)):
            keep = [k for k in range(lo, hi) if idx[k] != 1]
            r = rows[keep]
            if not keep:
                bags.append(torch.zeros(3, dtype=w.dtype))
            else:
                bags.append({"sum": r.sum(0), "mean": r.mean(0), "max": r.amax(0)}[mode])
        return torch.stack(bags).tanh()

    wrt = (0, 1) if mode == "sum" else (0,)
    check(f, (w, psw), wrt=wrt, order=2, reference_fn=plain)


# ------------------------------------------------------------------------------ indexed writes
def _products(x, index, src, include_self):
    """scatter_reduce(x, 0, index, src, "prod") one product at a time."""
    rows = []
    for j in range(x.shape[0]):
        cols = []
        for c in range(x.shape[1]):
            factors = [src[k, c] for k in range(index.shape[0]) if index[k, c] == j]
            p = x[j, c] if include_self or not factors else None
            for s in factors:
                p = s if p is None else p * s
            cols.append(p)
        rows.append(torch.stack(cols))
    return torch.stack(rows)


@pytest.mark.parametrize("include_self", [pytest.param(True, marks=pytest.mark.slow), False])
def test_scatter_reduce_prod_exact_at_zeros(include_self):
    """torch.func's second derivative of scatter_reduce(prod) is wrong (its backward divides)."""
    x, src = rand(3, 2, seed=52), rand(4, 2, seed=53)
    index = _idx(0, 2, 0, 0, 2, 1, 0, 2).view(4, 2)
    at_zero = src.detach().clone()
    at_zero[2, 0] = 0.0  # an exact zero among three factors of one product

    def f(x, s):
        return x.sin().scatter_reduce(0, index, s - at_zero, "prod", include_self=include_self).sin()

    def plain(x, s):
        return _products(x.sin(), index, s - at_zero, include_self).sin()

    check(f, (x, src), wrt=(0, 1), order=3, reference_fn=plain, mode="reverse" if include_self else "forward")


def test_as_strided_scatter():
    """torch's backward of as_strided_scatter with non-contiguous strides is wrong (it gives the
    self gradient inside the overwritten view): the reference writes src into place by index."""
    x, src = rand(3, 3, seed=54), rand(2, 2, seed=55)
    flat = _idx(0, 2, 1, 3)

    def f(x, s):
        return torch.as_strided_scatter(x.sin(), s.exp(), (2, 2), (1, 2), 1).sin()

    def plain(x, s):
        return x.sin().reshape(-1).index_put((flat + 1,), s.exp().reshape(-1)).view(3, 3).sin()

    assert_close(f(x, src), plain(x, src), "value")
    check(f, (x, src), wrt=(0, 1), order=2, reference_fn=plain)


def test_index_put_with_a_mask():
    x, v = rand(4, 3, seed=56), rand(2, 3, seed=57)
    mask = _idx(False, True, False, True)
    rows = _idx(1, 3)

    check(lambda x, v: torch.index_put(x.sin(), (mask,), v.exp()).tanh(), (x, v), wrt=(0, 1), order=2,
          reference_fn=lambda x, v: torch.index_put(x.sin(), (rows,), v.exp()).tanh())
    check(lambda x, v: torch.index_put(x.sin(), (mask,), v[0].exp(), accumulate=True).tanh(), (x, v),
          wrt=(0, 1), order=2,
          reference_fn=lambda x, v: torch.index_put(x.sin(), (rows,), v[0].exp(), accumulate=True).tanh())


def test_rrelu_evaluates_as_leaky_relu_and_training_is_refused():
    x = rand(2, 3, seed=58)
    check(lambda x: F.rrelu(x.sin(), 0.1, 0.3).exp(), (x,), order=2,
          reference_fn=lambda x: F.leaky_relu(x.sin(), 0.2).exp())
    with pytest.raises(hoad.RandomnessError):
        hoad.compile(lambda x: F.rrelu(x, training=True).sum(), order=1)(x)


def test_frexp_mantissa():
    x = rand(2, 3, seed=59) * 10
    check(lambda x: torch.frexp(x.sin() * 3)[0].exp(), (x,), order=2)


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
