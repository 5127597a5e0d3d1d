"""Operators whose directions differ from point to point (hoad.directions.PerPoint): a factor
L(x) per sample or from a function of the points (torch-jet's point-dependent weighting),
directions per sample for the Laplacian and for Taylor jets, and Taylor jets along curves
(arbitrary higher coefficients); against torch.func per sample."""

import math

import pytest
import torch
from helpers import assert_close, rand
from torch.func import hessian, jacfwd, jvp, vmap

import hoad

DT = torch.float64
W1, W2 = rand(3, 7, seed=701), rand(7, seed=702)


def u(x):  # (..., 3) -> (...,)
    return torch.tanh(x @ W1 + 0.3) @ W2 + (x ** 3).sum(-1)


def two(y, x):  # the operator's input second, by name; y shifts the output
    return u(x) * y.sum(-1)


def _along(f, x, v, k):
    for _ in range(k):
        f = (lambda g: (lambda y: jvp(g, (y,), (v,))[1]))(f)
    return f(x)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_laplacian_with_a_factor_per_point(mode):
    """tr(L(x)ᵀ ∇²u L(x)) per sample: L as a (B, D, S) tensor and as a function of the points (the
    function read at every call, never differentiated by the operator), the operator's input
    passed by name among others; the gradient of a loss on it reaches the weights."""
    X, L = rand(6, 3, seed=703), rand(6, 3, 2, seed=704)
    H = vmap(hessian(u))(X)
    res = hoad.laplacian(u, batch_dim=0, factor=L, mode=mode)(X)
    assert_close(res.laplacian, torch.einsum("bds,bde,bes->b", L, H, L), "tensor factor")
    assert_close(res.directional, torch.einsum("bd,bds->bs", vmap(torch.func.grad(u))(X), L), "directional")
    assert res.gradient is None and res.value.shape == (6,)

    def factor(P):
        return L * P.sum(-1).cos()[:, None, None]

    op = hoad.laplacian(two, "x", batch_dim=0, factor=factor, mode=mode)
    Y = rand(6, 2, seed=705)
    for scale in (1.0, 2.0):  # a new set of points: the function is read again
        P = X * scale
        want = torch.einsum("bds,bde,bes->b", factor(P), vmap(hessian(u))(P), factor(P)) * Y.sum(-1)
        assert_close(op(Y, x=P).laplacian, want, f"factor of the points, scale {scale}")
    w = W2.clone().requires_grad_()

    def with_w(x):
        return torch.tanh(x @ W1 + 0.3) @ w

    (got,) = torch.autograd.grad(hoad.laplacian(with_w, batch_dim=0, factor=L, mode=mode)(X).laplacian.sum(), w)
    ref = torch.func.grad(lambda ww: torch.einsum(
        "bds,bde,bes->b", L, vmap(hessian(lambda x: torch.tanh(x @ W1 + 0.3) @ ww))(X), L).sum())(W2)
    assert_close(got, ref, "gradient in the weights")


def test_directions_per_point_for_the_laplacian_and_taylor_jets():
    X, V = rand(5, 3, seed=706), rand(5, 4, 3, seed=707)
    H = vmap(hessian(u))(X)
    lap = hoad.laplacian(u, batch_dim=0, directions=lambda P: V)(X)
    assert_close(lap.laplacian, torch.einsum("bsd,bde,bse->b", V, H, V) / 4, "(1/S) Σ v_sᵀ H v_s per point")
    jets = hoad.taylor(u, order=3, batch_dim=0, directions=lambda P: V)(X)
    want = [torch.stack([torch.stack([_along(u, X[b], V[b, s], k) for s in range(4)]) for b in range(5)])
            for k in range(4)]
    for k in (1, 2, 3):
        assert_close(jets[k], want[k], f"order {k} along each point's directions")
    w = rand(4, seed=708)
    top = hoad.taylor(u, order=3, batch_dim=0, directions=lambda P: V, collapse=True, weights=w)(X)
    assert_close(top.collapsed, want[3] @ w, "collapsed, weighted")
    assert_close(top[2], want[2], "below the top")
    one = hoad.taylor(u, order=2, directions=lambda x: V[0])(X[0])  # one point, its directions from a function
    assert_close(one[2], want[2][0], "one point")


def _curve_derivatives(f, x, coefficients, K):
    """dᵏ/dtᵏ f(x + Σ_j tʲ/j! c_j) at t = 0, k = 1..K, by nested jacfwd in t."""
    g = lambda t: f(x + sum(t ** (j + 1) / math.factorial(j + 1) * c for j, c in enumerate(coefficients)))  # noqa: E731
    out = []
    for _ in range(K):
        g = jacfwd(g)
        out.append(g(torch.zeros((), dtype=DT)))
    return out


@pytest.mark.parametrize("mode", ["forward", pytest.param("reverse", marks=pytest.mark.slow)])
def test_taylor_jets_along_curves(mode):
    """higher=(V_2, V_3): each direction's line bent into x + t v + t²/2 V_2 + t³/6 V_3 (torch-jet's
    jet with arbitrary coefficients), at one point and per sample (the coefficients shared or from
    a function of the points), collapsed too."""
    x, V, V2, V3 = rand(3, seed=711), rand(2, 3, seed=712), rand(2, 3, seed=713), rand(2, 3, seed=714)
    jets = hoad.taylor(u, order=4, directions=V, higher=(V2, V3), mode=mode)(x)
    want = [torch.stack(d) for d in zip(*[_curve_derivatives(u, x, (V[s], V2[s], V3[s]), 4) for s in range(2)])]
    for k in range(1, 5):
        assert_close(jets[k], want[k - 1], f"order {k} along the curves")
    top = hoad.taylor(u, order=4, directions=V, higher=(V2, V3), collapse=True, mode=mode)(x)
    assert_close(top.collapsed, want[3].sum(0), "collapsed along the curves")
    X = rand(4, 3, seed=715)
    per = hoad.taylor(u, order=3, batch_dim=0, directions=V, higher=(lambda P: V2 * P[:, None, :],), mode=mode)(X)
    for b in range(4):
        got = [per[k][b] for k in (1, 2, 3)]
        ref = zip(*[_curve_derivatives(u, X[b], (V[s], V2[s] * X[b]), 3) for s in range(2)])
        for k, (g, w) in enumerate(zip(got, ref), start=1):
            assert_close(g, torch.stack(w), f"sample {b}, order {k}")


def test_curves_and_directions_per_point_keep_one_program_for_every_count():
    """Their points and seeds have a row per sample too, beside the shift they differentiate: each
    count was a program of its own (4 counts, 4 programs); the curves' coefficients also led their
    seeds ahead of the samples."""
    V, V2 = rand(2, 3, seed=716), rand(2, 3, seed=717)
    curves = hoad.taylor(u, order=3, batch_dim=0, directions=V, higher=(V2,))
    lines = hoad.taylor(u, order=3, batch_dim=0, directions=lambda P: V * P.sum(-1)[:, None, None])
    for count in (6, 9, 4, 13):
        X = rand(count, 3, seed=718 + count)
        got, per = curves(X), lines(X)
        for b in (0, count - 1):
            ref = zip(*[_curve_derivatives(u, X[b], (V[s], V2[s]), 3) for s in range(2)])
            for k, w in enumerate(ref, start=1):
                assert_close(got[k][b], torch.stack(w), f"{count} samples, sample {b}, order {k}")
            line = zip(*[_curve_derivatives(u, X[b], (V[s] * X[b].sum(),), 3) for s in range(2)])
            for k, w in enumerate(line, start=1):
                assert_close(per[k][b], torch.stack(w), f"{count} samples, sample {b}, order {k} per point")
    for op in (curves, lines):
        assert len({id(e) for e in op.operator.compiled._cache.values()}) == 2


def test_calls_alternating_between_numbers_of_directions_keep_their_programs():
    """Directions from a function whose number S changes between calls: the operator kept one
    program, for the last S, and built it again at every change (0.05 s each); each S now keeps
    its own."""

    def dirs(P):  # two directions for an even number of points, three for an odd one
        return torch.stack([P * (s + 1) for s in range(2 + P.shape[0] % 2)], 1)

    op = hoad.laplacian(u, batch_dim=0, directions=dirs, backend="eager")
    kept = {}
    for n in (4, 5, 6, 7, 4, 5, 8, 9):
        X = rand(n, 3, seed=730 + n)
        V = dirs(X)
        want = torch.einsum("bsd,bde,bse->b", V, vmap(hessian(u))(X), V) / V.shape[1]
        assert_close(op(X).laplacian, want, f"{n} points, {V.shape[1]} directions")
        assert kept.setdefault(V.shape[1], op.operator) is op.operator, f"S = {V.shape[1]} built again"


def test_chunk_size_splits_the_points_and_their_seeds_with_the_shift():
    """chunk_size on curves, directions per point and a factor per point: the points and their
    seeds hold the samples too, beside the shift the program differentiates. They were refused
    ("the tensor argument 0 ... also has 7 rows: hoad cannot tell whether it holds samples"),
    naming the very points the user passed as the operator's input."""
    X, V, V2 = rand(7, 3, seed=724), rand(2, 3, seed=725), rand(2, 3, seed=726)
    curves = hoad.taylor(u, order=3, batch_dim=0, directions=V, higher=(lambda P: V2 * P[:, None, :],), chunk_size=3)
    got = curves(X)
    for b in (0, 3, 6):  # (a chunk's first and the padded last one)
        ref = zip(*[_curve_derivatives(u, X[b], (V[s], V2[s] * X[b]), 3) for s in range(2)])
        for k, w in enumerate(ref, start=1):
            assert_close(got[k][b], torch.stack(w), f"sample {b}, order {k}")
    L, Y = rand(7, 3, 2, seed=727), rand(7, 2, seed=728)
    H = vmap(hessian(u))(X)
    lap = hoad.laplacian(two, "x", batch_dim=0, factor=L, chunk_size=3)
    with pytest.raises(hoad.InvalidArgumentError, match="argument 0 \\(shape \\(7, 2\\)\\) also has 7 rows"):
        lap(Y, x=X)  # (y, with a row per sample, is no input of the operator: chunk_size cannot tell)
    res = lap(Y[0], x=X)
    assert_close(res.laplacian, torch.einsum("bds,bde,bes->b", L, H, L) * Y[0].sum(), "factor per point, by name")
    assert_close(res.directional, torch.einsum("bd,bds->bs", vmap(torch.func.grad(u))(X), L) * Y[0].sum(),
                 "directional")


def test_per_point_operators_refuse_what_they_cannot_mean():
    X = rand(5, 3, seed=709)
    with pytest.raises(hoad.InvalidArgumentError, match="factor per point must be \\(5, 3, S\\)"):
        hoad.laplacian(u, batch_dim=0, factor=lambda P: torch.ones(5, 2, 2, dtype=DT))(X)
    with pytest.raises(hoad.InvalidArgumentError, match="directions must be \\(5, S, 3\\)"):
        hoad.taylor(u, order=2, batch_dim=0, directions=lambda P: torch.ones(5, 4, 2, dtype=DT))(X)
    with pytest.raises(hoad.InvalidArgumentError, match="weights per point \\(C\\(x\\)\\) are taken as a factor"):
        hoad.laplacian(u, batch_dim=0, weights=torch.eye(3, dtype=DT).expand(5, 3, 3))
    with pytest.raises(hoad.InvalidArgumentError, match="come from a function of the points"):
        hoad.laplacian(u, batch_dim=0, directions=rand(5, 4, 3, seed=710))(X)
    with pytest.raises(hoad.InvalidArgumentError, match="work in hoad.laplacian and hoad.taylor"):
        hoad.biharmonic(u, batch_dim=0, factor=lambda P: None)
    V = rand(2, 3, seed=716)
    with pytest.raises(hoad.InvalidArgumentError, match="a tuple of 1 to K - 1 = 2 of them, got 3"):
        hoad.taylor(u, order=3, directions=V, higher=(V, V, V))
    with pytest.raises(hoad.InvalidArgumentError, match="one coefficient per direction"):
        hoad.taylor(u, order=3, directions=V, higher=(rand(3, 3, seed=717),))(X[0])
    bad = V.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(hoad.InvalidArgumentError, match="the higher\\[1\\] \\(V_3\\) have entries that are NaN"):
        hoad.taylor(u, order=3, batch_dim=0, directions=V, higher=(V, bad))(X)
    with pytest.raises(hoad.InvalidArgumentError, match="the directions have entries that are NaN or infinite"):
        hoad.taylor(u, order=2, batch_dim=0, directions=lambda P: bad.expand(5, 2, 3) * P.sum())(X)
    with pytest.raises(hoad.InvalidArgumentError, match="the factor have entries that are NaN or infinite"):
        hoad.laplacian(u, batch_dim=0, factor=lambda P: bad.mT.expand(5, 3, 2) / 0)(X)


def test_per_point_operators_take_a_bound_method_and_refuse_an_unbound_one():
    """Curves and drawn directions over ``net.u`` work as over a function; over ``Net.u`` (a
    decorator in the class body) they are refused, naming the bound form."""

    class Net:
        def __init__(self, w):
            self.w = w

        def u(self, x):
            return (x * self.w).tanh().sum(-1)

    net, x, V, V2 = Net(rand(3, seed=720)), rand(3, seed=721), rand(2, 3, seed=722), rand(2, 3, seed=723)
    jets = hoad.taylor(net.u, order=2, directions=V, higher=(V2,))(x)
    want = [torch.stack(d) for d in zip(*[_curve_derivatives(net.u, x, (V[s], V2[s]), 2) for s in range(2)])]
    assert_close(jets[2], want[1], "order 2 along the curves of a bound method")
    with pytest.raises(hoad.InvalidArgumentError, match="build the operator over the bound method"):
        hoad.taylor(Net.u, order=2, directions=V, higher=(V2,))
    drawn = hoad.laplacian(net.u, randomization=("normal", 4), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(drawn(x).laplacian).all()
    with pytest.raises(hoad.InvalidArgumentError, match="build the operator over the bound method"):
        hoad.laplacian(Net.u, randomization=("normal", 4))


@pytest.mark.parametrize("kind", ["curves", "directions per point", "factor per point"])
def test_per_point_operators_inside_a_one_program_training_step(kind):
    """A loss calling curves, directions per point or a factor function, compiled into one
    program returning the loss and its gradient (the guide's PINN step). Curves and directions
    per point were refused as data-dependent control flow blaming the user's loss: the operator
    was made inside the trace, checking fake tensors for NaN. A factor ``V.T.expand(B, D, S) *
    1.0`` failed with "a bug in hoad": prune took x * 1 for x and lost the copy a view needed.
    The loss and gradient equal torch.func's, and the operator made in the trace serves eager
    calls afterwards."""
    V, V2, VP = rand(2, 3, seed=730), rand(2, 3, seed=731), rand(5, 2, 3, seed=732)
    X = rand(5, 3, seed=733)

    class PINN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
            self.op = {"curves": lambda: hoad.taylor(self.u, order=2, directions=V, higher=(V2,), batch_dim=0),
                       "directions per point": lambda: hoad.taylor(self.u, order=2, batch_dim=0,
                                                                    directions=lambda X: VP[:X.shape[0]] * 1.0),
                       "factor per point": lambda: hoad.laplacian(self.u, batch_dim=0,
                                                                  factor=lambda X: V.T.expand(X.shape[0], 3, 2) * 1.0),
                       }[kind]()

        def u(self, X):
            return self.net(X).squeeze(-1)

        def residual(self, X):
            res = self.op(X)
            return res.laplacian if kind == "factor per point" else res[2].sum(-1)

        def loss(self, X):
            return (self.residual(X) ** 2).mean()

    pinn = PINN()
    params = {k: p.detach() for k, p in pinn.net.named_parameters()}

    def reference(params):
        def one(x, b):
            f = lambda y: torch.func.functional_call(pinn.net, params, (y,)).squeeze(-1)  # noqa: E731
            rows = {"curves": (V, V2), "directions per point": (VP[b], 0 * V), "factor per point": (V, 0 * V)}[kind]
            return sum(_curve_derivatives(f, x, (rows[0][s], rows[1][s]), 2)[1] for s in range(2))
        return (torch.stack([one(X[b], b) for b in range(5)]) ** 2).mean()

    with torch.no_grad():
        step = hoad.compile(pinn.loss, order=1, wrt=hoad.parameters)(X)
    assert_close(step.value, reference(params), "the loss")
    gradient = torch.func.grad(reference)(params)
    for name in params:
        assert_close(step[f"net.{name}"], gradient[name], f"∂loss/∂{name}")
    assert_close((pinn.residual(X) ** 2).mean(), reference(params), "an eager call afterwards")
