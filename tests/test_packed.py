"""hoad.compile(..., packed=True): the unique entries of each block of one input, computed from
Taylor jets along lattice directions (hoad.packed), against nested torch.func and hoad's dense
program."""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import jacfwd, jacrev, vmap

import hoad
import hoad.packed as hp
from hoad.derivatives import index_map
from tests.helpers import assert_close, rand, reference


def _in_threads(work, threads: int = 8) -> None:
    """``work(t)`` on each of ``threads`` threads at once; the first failure of any is raised here."""
    errors = []

    def run(t):
        try:
            work(t)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert not errors, errors[0]


def _check_packed(f, args, wrt=0, order=3, **options):
    """Every block of orders 1..order, dense and packed, against torch.func (permuted keys included)."""
    res = hoad.compile(f, order=order, wrt=wrt, packed=True, **options)(*args)
    argnum = wrt if isinstance(wrt, int) else 0
    ref = reference(f, args, (argnum,), order)
    assert_close(res.value, f(*args), "value")
    n = args[argnum].numel()
    for k in range(1, order + 1):
        key = (wrt,) * k
        assert_close(res[key], ref[(0,) * k], f"block {k}")
        values, index = res.packed(key)
        dense = ref[(0,) * k].reshape(res.value.shape + (n,) * k)
        want = dense[(Ellipsis,) + tuple(index.T)]
        assert values.shape == res.value.shape + (math.comb(n + k - 1, k),)
        assert_close(values, want, f"packed {k}")
    return res


# ------------------------------------------------------------------------------ the map
@pytest.mark.parametrize("n, d", [(1, 3), (3, 1), (4, 3), (5, 4), (3, 6)])
def test_ranks_and_lattice_follow_the_index_map_order(n, d):
    index = index_map(n, d)
    assert index.tolist() == [list(c) for c in itertools.combinations_with_replacement(range(n), d)]
    assert hp._rank(index.numpy(), n).tolist() == list(range(len(index)))
    counts = hp.lattice(n, d)
    assert counts.shape == (math.comb(n + d - 1, d), n) and bool((counts.sum(1) == d).all())
    assert all(sorted(sum(([v] * int(c) for v, c in enumerate(row)), [])) == list(r)
               for row, r in zip(counts.tolist(), index.tolist()))


@pytest.mark.parametrize("n, d", [(2, 3), (3, 4), (4, 2), (3, 5)])
def test_the_map_recovers_every_coefficient_of_a_polynomial(n, d):
    """u a random polynomial of degree d in n variables: the map takes its exact directional
    derivatives along the lattice to its exact coefficients, at every order k <= d."""
    g = torch.Generator().manual_seed(n * 10 + d)
    J = hp.lattice(n, d)
    for k in range(1, d + 1):
        I = torch.from_numpy(hp._counts(n, k)).to(torch.float64)  # (M, n) target multi-indices
        c = torch.randn(len(I), dtype=torch.float64, generator=g)  # ∂ⁱu for |i| = k
        fact = torch.tensor([math.prod(math.factorial(int(a)) for a in i) for i in I], dtype=torch.float64)
        # d^k/dt^k of Σ_i c_i/i! (t j)^i = k! Σ_i c_i/i! j^i
        along = math.factorial(k) * ((J[:, None, :] ** I[None]).prod(-1) * (c / fact)).sum(-1)
        got = hp.interpolation(n, d, k) @ along
        torch.testing.assert_close(got, c, rtol=1e-12, atol=1e-12)


def test_the_map_is_sparse():
    gamma = hp.interpolation(8, 6, 6)
    assert gamma.shape == (1716, 1716) and gamma.values().numel() < 0.06 * 1716 ** 2


# ------------------------------------------------------------------------------ programs
@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
def test_packed_blocks_of_an_mlp_match_torch_func(order):
    W1, b1, W2 = rand(8, 4, seed=1) / 2, rand(8, seed=2) / 10, rand(3, 8, seed=3) / 3
    _check_packed(lambda x: W2 @ torch.tanh(W1 @ x + b1), (rand(4, seed=4),), order=order)


@pytest.mark.parametrize("fn", [
    lambda x: torch.exp(x).prod(),
    lambda x: (torch.sin(x) * torch.cos(x.flip(0))).sum() + torch.log1p(x.square()).sum() ** 2,
    lambda x: torch.softmax(x, 0) @ torch.arange(1.0, 5.0, dtype=torch.float64),
    lambda x: torch.stack([x.norm(), (x[:2] * x[2:]).sum(), torch.sigmoid(x).prod()]),
], ids=["prod-exp", "dag", "softmax", "stacked"])
def test_packed_elementwise_reductions_and_dags(fn):
    _check_packed(fn, (rand(4, seed=7) / 2 + 0.3,), order=3)


def test_a_matrix_input_a_second_argument_and_a_name():
    """x (2, 3) flattened to 6 entries; w another argument, not differentiated; wrt by name."""
    w = rand(3, seed=8)

    def f(w, x):
        return (torch.tanh(x @ w) ** 2).sum() + x.prod()

    res = _check_packed(f, (w, rand(2, 3, seed=9)), wrt=1, order=3)
    named = hoad.compile(f, order=3, wrt="x", packed=True)(w, rand(2, 3, seed=9))
    torch.testing.assert_close(named["x", "x", "x"], res[1, 1, 1], rtol=0, atol=0)
    assert named.wrt == ["x"]


def test_orders_above_the_polynomial_degree_are_zero_and_structural_zeros_come_packed():
    x = rand(3, seed=10)
    res = _check_packed(lambda x: (x ** 2).sum() * x[0], (x,), order=5)  # cubic: orders 4, 5 vanish
    assert float(res[0, 0, 0, 0].abs().max()) < 1e-10
    linear = hoad.compile(lambda x: 2 * x.sum(), order=3, packed=True)(x)
    assert linear.is_structural_zero((0, 0)) and linear.packed((0, 0, 0))[0].shape == (10,)
    assert torch.equal(linear[0, 0], torch.zeros(3, 3, dtype=torch.float64))


def test_an_input_the_output_does_not_reach_gives_structural_zeros():
    x, y = rand(3, seed=40), rand(2, seed=41)
    res = hoad.compile(lambda x, y: y.sin().sum(), order=2, packed=True)(x, y)
    assert res.is_structural_zero((0,)) and res.is_structural_zero((0, 0))
    assert torch.equal(res[0, 0], torch.zeros(3, 3, dtype=torch.float64))
    assert torch.equal(res.packed((0, 0))[0], torch.zeros(6, dtype=torch.float64))


def test_packed_equals_the_unique_entries_of_the_dense_program():
    W = rand(5, 5, seed=11) / 3

    def f(x):
        return torch.tanh(W @ torch.tanh(W @ x)).sum()

    x = rand(5, seed=12)
    dense = hoad.compile(f, order=4)(x)
    packed = hoad.compile(f, order=4, packed=True)(x)
    for k in range(1, 5):
        a, ia = dense.packed((0,) * k)
        b, ib = packed.packed((0,) * k)
        assert torch.equal(ia, ib)
        assert_close(b, a, f"order {k}")


def test_per_sample_packed_blocks_under_batch_dim():
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    X = rand(5, 2, 3, seed=13)
    res = hoad.compile(lambda X: net(X.flatten(1)), order=3, batch_dim=0, packed=True)(X)
    single = lambda x: net(x.reshape(-1))  # noqa: E731
    assert_close(res[0], vmap(jacrev(single))(X))
    assert_close(res[0, 0, 0], vmap(jacfwd(jacfwd(jacrev(single))))(X))
    values, index = res.packed((0, 0))
    assert values.shape == (5, 2, 21) and index.shape == (21, 2)


def test_training_through_packed_blocks():
    """Gradients w.r.t. the parameters flow through the jets and the map."""
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    x = rand(3, seed=14)
    params = [p for name, p in net.named_parameters() if name != "2.bias"]
    res = hoad.compile(lambda x: net(x).squeeze(-1), order=3, packed=True)(x)
    values, _ = res.packed((0, 0, 0))
    got = torch.autograd.grad(values.square().sum() + res[0, 0].sum(), params)

    def loss():
        u = lambda x: net(x).squeeze(-1)  # noqa: E731
        third = jacfwd(jacfwd(jacrev(u)))(x)
        return third[tuple(index_map(3, 3).T)].square().sum() + jacfwd(jacrev(u))(x).sum()

    want = torch.autograd.grad(loss(), params)
    for g, w in zip(got, want):
        assert_close(g, w)


def test_a_decorated_method():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1).double()

        @hoad.compile(order=4, wrt="x", packed=True)
        def energy(self, x):
            return torch.cosh(self.lin(x)).sum()

    m = Model()
    assert repr(Model.energy) == "<hoad.compile(Model.energy, order=4, wrt='x', packed=True)>"
    x = rand(3, seed=15)
    res = m.energy(x)
    u = lambda x: torch.cosh(m.lin(x)).sum()  # noqa: E731
    assert_close(res["x", "x", "x", "x"], jacfwd(jacfwd(jacfwd(jacrev(u))))(x))


def test_threads_calling_one_packed_program_at_mixed_shapes():
    """8 threads x 6 calls, each at one of three input sizes: every result right (the lattice, the
    maps and the dense expansions are shared between them)."""
    cf = hoad.compile(lambda x: torch.tanh(x).prod() + x.square().sum() ** 2, order=3, packed=True)
    points = {n: rand(n, seed=20 + n) / 2 for n in (2, 3, 4)}
    refs = {n: reference(lambda x: torch.tanh(x).prod() + x.square().sum() ** 2, (x,), (0,), 3)
            for n, x in points.items()}

    def work(t):
        for i in range(6):
            n = (2, 3, 4)[(t + i) % 3]
            res = cf(points[n])
            for k in (1, 2, 3):
                assert_close(res[(0,) * k], refs[n][(0,) * k], f"thread {t} n={n} order {k}")

    _in_threads(work)


def test_explain_shows_each_orders_dense_and_computed_entries():
    """Dense and computed entries per block (mixed ones with several inputs), then the jet program."""
    two = hoad.compile(lambda x, y: (x.sin() * y).sum(), order=2, wrt=(0, 1), packed=True)
    text = str(two.explain(rand(3, seed=36), rand(3, seed=37)))
    assert "every block of x, y (3 + 3 = 6 entries, joined)" in text and "21 lattice directions" in text, text
    assert "(x, y)" in text
    cf = hoad.compile(lambda x: torch.tanh(x).prod(), order=3, packed=True)
    text = str(cf.explain(rand(4, seed=30)))
    assert "every block of x (4 entries) as its unique entries" in text and "20 lattice directions" in text, text
    head = text.split("hoad program:")[0]
    rows = {line.split()[0]: line.split()[-2:] for line in head.splitlines() if "(x" in line}
    assert rows == {"1": ["4", "4"], "2": ["16", "10"], "3": ["64", "20"]}, rows
    assert "hoad program: order 3" in text  # the jet program's own explanation follows


@pytest.mark.parametrize("order", [2, 3])
def test_mixed_blocks_of_several_inputs_from_their_joined_entries(order):
    """wrt=(0, "y"): the symmetric tensor over x's 3 and y's 2 entries joined; every canonical block,
    mixed ones included, against torch.func; packed() of one input's block against the dense
    program's; keys by argnum and name alike."""
    W = rand(4, 3, seed=31) / 2

    def f(x, s, y):  # x (3,), s a scalar argument not differentiated, y (1, 2)
        return torch.tanh(W @ x + s) @ torch.cat([y.sin().reshape(-1), y.reshape(-1) ** 2]) + x.prod() * y.sum()

    args = (rand(3, seed=32), 0.3, rand(1, 2, seed=33))
    res = hoad.compile(f, order=order, wrt=(0, "y"), packed=True)(*args)
    ref = reference(lambda x, y: f(x, 0.3, y), (args[0], args[2]), (0, 1), order)
    for K, want in ref.items():
        key = tuple((0, "y")[p] for p in K)
        assert_close(res[key], want, f"block {key}")
    assert_close(res["x", "y"], ref[0, 1], "by name")
    assert_close(res[2, 0], ref[0, 1].permute(1, 2, 0), "a permuted key")
    dense = hoad.compile(f, order=order, wrt=(0, 2))(*args)
    for p in (0, 2):
        values, index = res.packed((p,) * order)
        want, want_index = dense.packed((p,) * order)
        assert torch.equal(index, want_index)
        assert_close(values, want, f"packed {p}")
    with pytest.raises(hoad.InvalidArgumentError, match="one wrt input"):
        res.packed((0,) * (order - 1) + ("y",))


def test_mixed_blocks_per_sample():
    """batch_dim=0 with two per-sample inputs joined sample by sample."""
    net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1)).double()

    def f(X, T):
        return net(torch.cat([X, T], -1)).squeeze(-1)

    X, T = rand(4, 3, seed=34), rand(4, 2, seed=35)
    res = hoad.compile(f, order=3, wrt=(0, 1), batch_dim=0, packed=True)(X, T)
    one = lambda x, t: f(x[None], t[None])[0]  # noqa: E731
    assert_close(res[0, 1], vmap(jacfwd(jacrev(one, 0), 1))(X, T))
    assert_close(res[0, 1, 1], vmap(jacfwd(jacfwd(jacrev(one, 0), 1), 1))(X, T))
    assert_close(res[1, 1, 1], vmap(jacfwd(jacfwd(jacrev(one, 1), 1), 1))(X, T))
    with pytest.raises(hoad.InvalidArgumentError, match="samples along dim 0"):
        hoad.compile(f, order=2, wrt=(0, 1), batch_dim=0, packed=True)(X, T[:3])


@pytest.mark.parametrize("options, fragment", [
    (dict(wrt=(0, 0)), "distinct"),
    (dict(wrt=hoad.parameters), "leave packed off"),
    (dict(diagonal=True), "diagonal="),
    (dict(packed="yes"), 'True, False or "auto"'),
    (dict(order=0), "order must be"),
])
def test_packed_refusals_name_the_way_out(options, fragment):
    def f(x, y):
        return (x * y).sum()

    kwargs = {"order": 2, "packed": True, **options}
    with pytest.raises(hoad.InvalidArgumentError, match=fragment):
        hoad.compile(f, **kwargs)(rand(2), rand(2))


@pytest.mark.slow  # (a cold Inductor compile: 20 s; the jet program's Inductor path is test_operators')
@pytest.mark.inductor
def test_packed_under_inductor():
    W = rand(6, 3, seed=16) / 2

    def f(x):
        return torch.tanh(W @ x).sum()

    _check_packed(f, (rand(3, seed=17),), order=4, backend="inductor")


def test_the_rank_table_counts_every_multiset():
    for n, d in ((4, 3), (6, 2)):
        table = hp._rank_table(n, d)
        assert int(table[0, n]) == math.comb(n + d - 1, d)
        assert np.all(np.diff(table, axis=1) > 0)


def test_explain_points_a_dense_program_to_packed_where_it_pays():
    """explain() of a dense program (packed=False) names packed=True where the top order's dense
    entries are 50x its unique ones or more (order 6 over 5 entries: 74x), and not below (order 4:
    at most 24x)."""
    f = lambda x: torch.exp(x).sum()  # noqa: E731 - (its blocks are diagonal: a cheap dense build)
    high = str(hoad.compile(f, order=6, packed=False).explain(rand(5, seed=38)))
    assert "order 6 over 5 entries: 15625 dense, 210 unique" in high and "packed=True" in high, high
    low = str(hoad.compile(f, order=4).explain(rand(8, seed=39)))
    assert "packed=True" not in low, low


def test_a_slow_dense_build_names_packed_where_it_pays(monkeypatch, caplog):
    """The line that ends a reported build (one past HOAD_PROGRESS seconds) names packed=True where
    explain() would, and says nothing of it for order 4 or an operator's program."""
    import logging

    monkeypatch.setenv("HOAD_PROGRESS", "0.01")  # (report every build)
    caplog.set_level(logging.WARNING, logger="hoad")
    f = lambda x: torch.exp(x).sum()  # noqa: E731
    hoad.compile(f, order=6, backend="eager", packed=False)(rand(5, seed=40))
    built = [r.getMessage() for r in caplog.records if "built" in r.getMessage()]
    assert built and "15625 dense, 210 unique" in built[-1] and "packed=True" in built[-1], built
    caplog.clear()
    hoad.compile(f, order=4, backend="eager")(rand(8, seed=41))
    hoad.taylor(f, order=6, directions=rand(3, 5, seed=42), backend="eager")(rand(5, seed=43))
    built = [r.getMessage() for r in caplog.records if "built" in r.getMessage()]
    assert len(built) == 2 and not any("packed=True" in line for line in built), built


def test_a_product_along_the_directions_is_built_as_a_tree():
    """In diagonal mode a product's slots share one label: the tree of pairwise products costs
    about n·2^k, its derivative tensors n^k. From the tensors, order 5 over 8 entries built a
    535-call program in 2.9 s (order 6: 20 s); as a tree 321 calls in 1.1 s. Checked against the
    closed form ∂^α Π_j tanh(x_j) = Π_j tanh^(α_j)(x_j)."""
    cf = hoad.compile(lambda x: torch.tanh(x).prod(), order=5, packed=True)
    x = rand(8, seed=42) / 2
    values, index = cf(x).packed((0,) * 5)
    calls = sum(1 for node in cf.graph.module.graph.nodes if node.op == "call_function")
    assert calls < 450, calls
    d = [torch.tanh]
    for _ in range(5):
        d.append(torch.func.grad(d[-1]))
    tanh_k = torch.stack([torch.stack([dk(v) for dk in d]) for v in x])  # (8, 6): tanh^(m)(x_j)
    counts = torch.zeros(len(index), 8, dtype=torch.long).scatter_add_(1, index, torch.ones_like(index))
    want = tanh_k[torch.arange(8), counts].prod(1)  # Π_j tanh^(α_j)(x_j) per multiset α
    torch.testing.assert_close(values, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ packed="auto"
def _mlp(n: int, seed: int, dtype=torch.float64):
    """A tanh MLP n-6-1 at a point, and the point."""
    W, v = rand(n, 6, seed=seed).to(dtype) / 2, rand(6, seed=seed + 1).to(dtype)
    return (lambda x: torch.tanh(x @ W) @ v), rand(n, seed=seed + 2).to(dtype)


def test_the_default_computes_packed_where_it_pays_and_dense_below():
    """hoad.compile's default (packed="auto"): order 6 over 5 entries (74x more dense entries than
    unique ones) runs the packed program, order 6 over 4 (49x) and order 4 the dense one; every
    block equals the dense program's, and order 5 equals nested torch.func."""
    f, x = _mlp(5, seed=60)
    cf = hoad.compile(f, order=6, backend="eager")
    assert isinstance(cf, hp.AutoPacked)
    res, dense = cf(x), hoad.compile(f, order=6, backend="eager", packed=False)(x)
    assert cf._ran_packed and isinstance(res._blocks, hp.PackedBlocks)
    for k in range(1, 7):
        assert_close(res[(0,) * k], dense[(0,) * k], f"order {k}")
    assert_close(res[(0,) * 5], reference(f, (x,), (0,), 5)[(0,) * 5], "order 5 against torch.func")
    assert "every block of x (5 entries) as its unique entries" in str(cf.explain())
    assert "lattice" in str(cf.explain(x)) and cf.graph is not None
    res.packed((0,) * 6)  # (the unique entries, as computed)
    g, y = _mlp(4, seed=61)
    small = hoad.compile(g, order=6, backend="eager")
    assert_close(small(y)[(0,) * 6], hoad.compile(g, order=6, backend="eager", packed=False)(y)[(0,) * 6])
    assert not small._ran_packed and "hoad program: order 6" in str(small.explain())
    four = hoad.compile(f, order=4, backend="eager")
    four(x)
    assert not four._ran_packed


def test_where_packed_pays():
    """The rule the default follows, on the measured rows (tanh MLP at a point, dense against
    packed): packed from 50x more dense than unique entries, or 35x with 400 lattice directions."""
    from hoad.explanation import packed_pays

    faster_packed = [(8, 6), (5, 6), (16, 5), (8, 5), (7, 5)]  # 153x, 74x, 68x, 41x (792), 36x (462)
    faster_dense = [(4, 6), (6, 5), (8, 4), (16, 4), (64, 3)]  # 49x (84 directions), 31x (252), order 4, 3
    assert all(packed_pays(n, k) for n, k in faster_packed)
    assert not any(packed_pays(n, k) for n, k in faster_dense)


@pytest.mark.parametrize("case", ["float32", "packed=False", "diagonal", "parameters", "method", "nested", "fsdp"])
def test_the_default_stays_dense_where_packed_does_not_serve(case, monkeypatch):
    """float32 inputs (the map costs digits there), packed=False, diagonal=True, module parameters,
    a decorated method, a call inside another hoad trace and a function reaching FSDP-sharded
    modules (planted: Compiled gathers those) all run the dense program."""
    import contextlib

    import hoad.compiled

    f, x = _mlp(5, seed=62, dtype=torch.float32 if case == "float32" else torch.float64)
    if case == "fsdp":
        monkeypatch.setattr(hp.AutoPacked, "_fully_sharded", lambda self: [object()])
        monkeypatch.setattr(hoad.compiled, "gathered", lambda states: contextlib.nullcontext())
    options = {"packed=False": dict(packed=False), "diagonal": dict(diagonal=True)}.get(case, {})
    if case == "parameters":
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(5, 1).double()

            def forward(self, x):
                return torch.tanh(self.lin(x)).sum()

        cf = hoad.compile(Net(), order=6, wrt="lin.weight", backend="eager")  # (5 entries: it would pay)
        res = cf(x)
        assert not getattr(cf, "_ran_packed", False) and not isinstance(res._blocks, hp.PackedBlocks)
        return
    if case == "method":
        class Model(nn.Module):
            @hoad.compile(order=6, backend="eager")
            def energy(self, x):
                return f(x)

        res = Model().energy(x)
        assert not isinstance(res._blocks, hp.PackedBlocks)
        assert_close(res[(0,) * 6], hoad.compile(f, order=6, backend="eager", packed=False)(x)[(0,) * 6])
        return
    if case == "nested":
        inner = hoad.compile(f, order=6, backend="eager")
        outer = hoad.compile(lambda x: inner(x)[(0,) * 6].sum(), order=1, backend="eager")
        got = outer(x)[(0,)]
        want = hoad.compile(lambda x: hoad.compile(f, order=6, backend="eager", packed=False)(x)[(0,) * 6].sum(),
                            order=1, backend="eager")(x)[(0,)]
        assert_close(got, want)
        assert not inner._ran_packed
        return
    cf = hoad.compile(f, order=6, backend="eager", **options)
    res = cf(x)
    assert not getattr(cf, "_ran_packed", False) and not isinstance(res._blocks, hp.PackedBlocks)


def test_the_default_runs_dense_where_the_packed_program_cannot_be_built(monkeypatch, caplog):
    """A packed build that fails (here: planted) leaves that signature to the dense program, with
    the reason logged; the next call goes straight to the dense program."""
    import logging

    f, x = _mlp(5, seed=63)
    calls = []

    def refuse(self, *args, **kwargs):
        calls.append(1)
        raise hoad.UnsupportedOperatorError("planted: no Taylor rule for this op")

    monkeypatch.setattr(hp.Packed, "__call__", refuse)
    caplog.set_level(logging.INFO, logger="hoad")
    cf = hoad.compile(f, order=6, backend="eager")
    res = cf(x)
    assert not cf._ran_packed and not isinstance(res._blocks, hp.PackedBlocks)
    assert any("packed program could not be built (UnsupportedOperatorError: planted" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    cf(x)
    assert calls == [1]
    assert_close(res[(0,) * 6], hoad.compile(f, order=6, backend="eager", packed=False)(x)[(0,) * 6])


def test_threads_calling_the_default_at_sizes_on_either_side_of_the_choice():
    """8 threads x 6 calls at 4 entries (dense) and 5 entries (packed) of one compiled function:
    every result equals the dense program's; each size is built once."""
    W, v = rand(5, 6, seed=64) / 2, rand(6, seed=65)
    f = lambda x: torch.tanh(x @ W[: x.shape[0]]) @ v  # noqa: E731
    cf = hoad.compile(f, order=6, backend="eager")
    points = {n: rand(n, seed=66 + n) for n in (4, 5)}
    want = {n: hoad.compile(f, order=6, backend="eager", packed=False)(x) for n, x in points.items()}

    def work(t):
        for i in range(6):
            n = (4, 5)[(t + i) % 2]
            res = cf(points[n])
            assert isinstance(res._blocks, hp.PackedBlocks) == (n == 5), n
            for k in (2, 6):
                assert_close(res[(0,) * k], want[n][(0,) * k], f"thread {t} n={n} order {k}")

    _in_threads(work)
    cpu = torch.device("cpu")
    assert len(cf._cache) == 1 and cf._choices == {(((4,), torch.float64, cpu),): False,
                                                   (((5,), torch.float64, cpu),): True}
