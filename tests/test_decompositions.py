"""Ops hoad covers by decomposing them into ops with rules (issue 17, passes/decompositions.py and
passes/indexing.py), checked where the OpInfo sweep cannot: derivatives in every argument, orders
torch cannot differentiate (its backward of cdist, pdist, segment_reduce, embedding_bag has no
derivative), and the edges where a convention decides (zero distance, zeros in a product, ties).

Where torch.func has no derivative of the op itself, or a wrong one, the reference is torch.func
of the same function in plain ops, and the plain function is checked against torch's own first
derivative (the op's convention) where torch has one.

A decomposition also keeps what torch checks or reads: one_hot's class checks, a traced integer
index, embedding's max_norm renormalising the table, gaussian_nll_loss's check of var, padding
modes, and the storage as_strided reads.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_close, check, rand
from torch.func import jacfwd, jacrev

import hoad
from hoad.passes.indexing import _grid_sampler

aten = torch.ops.aten
MODES = ["forward", "reverse"]


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


# ----------------------------------------------------------------------------------- padding
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pad_mode,shape,pad", [
    ("circular", (1, 2, 5), (2, 1)), ("circular", (1, 2, 3, 4), (1, 2, 2, 1)),
    ("reflect", (1, 2, 5), (2, 1)), ("replicate", (1, 2, 3, 4), (1, 2, 2, 1)),
])
def test_padding_modes(pad_mode, shape, pad, mode):
    w = rand(*shape[:-len(pad) // 2], *[n + pad[2 * i] + pad[2 * i + 1] for i, n in
                                        enumerate(reversed(shape[-len(pad) // 2:]))][::-1], seed=5)
    check(lambda x: (F.pad(x, pad, mode=pad_mode).sin() * w).sum(), (rand(*shape),), order=3, mode=mode)


# ----------------------------------------------------------------------------- strided views
def test_as_strided_of_a_view_into_a_larger_storage_is_refused():
    """as_strided reads storage: the program assumes inputs own theirs; a view would be read
    differently by torch, so it is refused, and a copy gives torch's answer."""
    def f(x):
        return torch.as_strided(x, (2, 2), (1, 2)).sin().sum()

    base = torch.randn(12, dtype=torch.float64)
    cf = hoad.compile(f, order=2)
    x = base[:10].clone()
    res = cf(x)
    torch.testing.assert_close(res[0, 0], torch.func.hessian(f)(x))
    with pytest.raises(hoad.InvalidArgumentError, match="larger storage"):
        cf(base[2:12])


def test_as_strided_of_an_intermediate_reads_its_entries():
    """An as_strided of a computed value (group_norm's decomposition emits one) reads entries the
    program owns: inputs that are views are fine. They were refused ("input 'x' is a view into a
    larger storage") for a group_norm with weight and bias on x[:2] or a channels_last x. A view
    with an offset reads relative to that offset's storage (it read from the storage's start)."""
    def f(x):
        y = x.sin().reshape(-1)
        return torch.as_strided(y[2:], (2, 2), (1, 3), 4).exp().sum() + torch.as_strided(y[1:], (3,), (2,)).sum()

    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(hoad.compile(f, order=2, backend="eager")(x)[0, 0], torch.func.hessian(f)(x))
    gn = nn.GroupNorm(2, 4).double()
    nn.init.normal_(gn.weight), nn.init.normal_(gn.bias)

    def g(x):
        return gn(x).sin().sum((1, 2, 3))

    base = torch.randn(3, 4, 3, 3, dtype=torch.float64)
    ref = torch.func.vmap(torch.func.hessian(lambda v: g(v[None])[0]))
    for x in (base[:2], base.to(memory_format=torch.channels_last)):
        torch.testing.assert_close(hoad.compile(g, order=2, batch_dim=0, backend="eager")(x)[0, 0], ref(x))


# ---------------------------------------------------------------- what torch checks or reads
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_indexing_by_a_traced_integer_tensor(mode):
    """x[x.argmax()] or x[i] for a 0-d index argument: Python indexing read the tensor's value (a
    DataDependentControlFlowError advising torch.where); it is a one-entry gather."""
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    i, j = torch.tensor(2), torch.tensor(-1)
    for f in (lambda x, i, j: (x[x.sum(1).argmax()] ** 2).sum() + x.sum(),
              lambda x, i, j: (x[i] * x[:, j]).sum() + x[i, j] ** 3,
              lambda x, i, j: (x[i, 1:] ** 2).sum() * x[None, j].sin().sum()):
        res = hoad.compile(f, order=2, mode=mode, backend="eager")(x, i, j)
        torch.testing.assert_close(res[0, 0], torch.func.hessian(f)(x, i, j))


W_ONE_HOT = rand(3, 4, seed=71)


def _one_hot_loss(x, i):
    return (F.one_hot(i, 4).to(x.dtype) * torch.tanh(x @ W_ONE_HOT)).sum()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_one_hot_checks_its_classes(backend):
    """F.one_hot's class checks were dropped by the trace (a class out of range gave a row of
    zeros); it is a checked scatter now."""
    x, labels = rand(3, 3, seed=72), torch.tensor([0, 3, 1])
    cf = hoad.compile(_one_hot_loss, order=2, backend=backend)
    assert_close(cf(x, labels)[0, 0], jacfwd(jacrev(_one_hot_loss))(x, labels), "index passed")
    for bad in ([0, 4, 1], [0, -1, 1]):
        with pytest.raises(hoad.ExecutionError, match="out of bounds"):
            cf(x, torch.tensor(bad))
    with pytest.raises(hoad.DataDependentControlFlowError, match="pass num_classes"):
        hoad.compile(lambda x, i: (F.one_hot(i).to(x.dtype) * x).sum(), order=1, backend=backend)(x, labels)


# (inductor under -m slow: two more cold compiles, 9 s of the default suite)
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_one_hot_follows_a_closed_over_index(backend):
    """A closed-over index was refused as control flow."""
    x, labels = rand(3, 3, seed=72), torch.tensor([0, 3, 1])

    def g(x):
        return _one_hot_loss(x, labels)

    cg = hoad.compile(g, order=2, backend=backend)
    assert_close(cg(x)[0, 0], jacfwd(jacrev(g))(x), "index closed over")
    labels[1] = 2
    assert_close(cg(x)[0, 0], jacfwd(jacrev(g))(x), "after labels[1] = 2")


@pytest.mark.parametrize("mode", MODES)
def test_embedding_with_max_norm_differentiates_the_table_as_torch_does(mode):
    """max_norm renormalises the table's rows in place under no_grad: autograd sees the table
    itself, with the new values (every derivative was 0: the trace read a detached copy)."""
    idx = torch.tensor([0, 2, 2, 4])

    def f(W):
        return (F.embedding(idx, W, max_norm=1.0) ** 3).sum() + (W * W).sum()

    W = rand(5, 3, seed=74) * 2
    res = hoad.compile(f, order=2, mode=mode, backend="eager")(W.clone())
    renormed = W.clone()
    f(renormed)  # torch's own call renormalises in place; its derivatives are those at the new table
    g = lambda W: (W[idx] ** 3).sum() + (W * W).sum()  # noqa: E731
    assert_close(res[0], jacrev(g)(renormed), "gradient")
    assert_close(res[0, 0], jacfwd(jacrev(g))(renormed), "Hessian")
    W2 = W.clone()
    hoad.compile(f, order=1, mode=mode, backend="eager")(W2)
    assert_close(W2, renormed, "the table renormalised in place, as torch does")


@pytest.mark.parametrize("var_shape", ["per entry", "one per row"])
def test_gaussian_nll_loss_is_traced(var_shape):
    """torch checks var >= 0 with a Python `if` on its values: refused as control flow before;
    now the same loss, var clamped at eps with derivative 1 as torch's in-place clamp has it."""
    x, t = rand(4, 3, seed=79), rand(4, 3, seed=80)
    var = rand(4, 3, seed=81, positive=True) if var_shape == "per entry" else rand(4, seed=81, positive=True)
    check(lambda x, v: F.gaussian_nll_loss(x, t, v, full=True), (x, var), wrt=(0, 1), order=3)
