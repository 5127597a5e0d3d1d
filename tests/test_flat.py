"""Flat regions: an op with an infinite derivative after relu, clamp or a where that picked a
constant (``sqrt(relu(x))``, ``acos(clamp(c, -1, 1))``, Hertzian ``relu(σ - r) ** 2.5``).

The function is constant there, so every derivative is 0; Faà di Bruno multiplies the infinite
coefficient by the zero blocks, and ``inf · 0`` was NaN. The reference is nested ``jacrev``:
torch's reverse mode masks at the relu before the infinity can meet a zero.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from torch.func import jacrev

import hoad

DT = torch.float64
MODES = ["forward", "reverse"]
X = torch.tensor([-0.5, 0.7, 2.0, -0.2, -1.5, 0.3], dtype=DT)  # none on a kink (see the last test)
C23 = torch.tensor([[0.2, 0.3, 0.4], [0.5, 0.5, 0.5]], dtype=DT)
KEEP = torch.tensor([[True, False, True], [False, True, True]])

FUNCTIONS = {
    "sqrt-relu": lambda x: torch.sqrt(torch.relu(x)),
    "pow-relu": lambda x: torch.relu(1.0 - x) ** 2.5,
    "pow-relu-1.5": lambda x: torch.relu(x) ** 1.5,
    "acos-clamp": lambda x: torch.acos(torch.clamp(1.5 * x, -1, 1)),
    "log-relu": lambda x: torch.log(torch.relu(x)),
    "reciprocal-relu": lambda x: 1 / torch.relu(x),
    "sqrt-clamp-min": lambda x: torch.sqrt(torch.clamp_min(x, 0)),
    "sqrt-where": lambda x: torch.sqrt(torch.where(x > 0, x, 0.0)),
    "sqrt-maximum": lambda x: torch.sqrt(torch.maximum(x, torch.zeros((), dtype=DT))),
    "sqrt-clamp-tensor": lambda x: torch.sqrt(torch.clamp(x, torch.zeros(6, dtype=DT), torch.ones(6, dtype=DT))),
    "rsqrt-hardtanh": lambda x: torch.rsqrt(F.hardtanh(x, 0.0, 1.0)),
    "through-affine-and-views": lambda x: torch.sqrt(3 * torch.relu(x).reshape(2, 3).t() + 0).reshape(-1),
    "product-of-two-flat": lambda x: torch.sqrt(torch.relu(x) * torch.relu(x + 0.2)),
    "times-x": lambda x: torch.sqrt(torch.relu(x)) * x,
    "flip": lambda x: torch.sqrt(torch.relu(x).flip(0)),
    "roll": lambda x: torch.sqrt(torch.relu(x).roll(2)),
    "cat": lambda x: torch.sqrt(torch.cat([torch.relu(x[:3]), torch.relu(-x[3:])])),
    "index": lambda x: torch.sqrt(torch.relu(x)[[1, 0, 3, 2, 5, 4]]),
    "gather": lambda x: torch.sqrt(torch.relu(x).gather(0, torch.tensor([5, 4, 3, 2, 1, 0]))),
    # the broadcast mask of relu(x) + C must be C's shape before a row is taken: the rows differ
    "broadcast-then-row": lambda x: torch.sqrt(torch.relu(x.reshape(2, 3)[:1]) + C23)[1].repeat(2),
    "where-broadcast-then-transpose": lambda x: torch.sqrt(torch.where(KEEP, x.reshape(2, 3)[:1].exp(), 0.0)
                                                           * C23).t().reshape(-1),
}

# sqrt(relu(x)) · x is 0 for x < 0; torch's product rule meets sqrt's inf there from order 2
TORCH_NAN = {"times-x"}


def _nested_jacrev(f, x, order):
    g = f
    for _ in range(order):
        g = jacrev(g)
    return g(x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_flat_region_derivatives_are_zero_not_nan(name, mode):
    fn = FUNCTIONS[name]
    f = lambda x: (fn(x) * torch.linspace(0.5, 1.5, 6, dtype=DT)).sum()  # noqa: E731
    res = hoad.compile(f, order=3, backend="eager", mode=mode)(X)
    for k in (1, 2, 3):
        got, want = res[(0,) * k], _nested_jacrev(f, X, k)
        known = want.isfinite()
        assert got.isfinite().all(), (k, got)
        torch.testing.assert_close(got[known], want[known], rtol=1e-10, atol=1e-12)
        if not known.all():  # torch's own inf · 0, on the flat entries only
            assert name in TORCH_NAN and got[~known].eq(0).all(), (k, got, want)


def test_hertzian_contact_energy_third_order():
    """Pair energy Σ relu(σ - r_ij)^(5/2) of particles, some out of contact: order 3 was all NaN."""
    torch.manual_seed(0)
    x = torch.tensor([[0.0, 0.0], [0.8, 0.1], [2.5, 0.3], [0.4, 0.9]], dtype=DT)
    i, j = torch.triu_indices(4, 4, 1)

    def energy(x):
        r = (x[i] - x[j]).pow(2).sum(-1).sqrt()
        return (torch.relu(1.0 - r) ** 2.5).sum()

    for mode in MODES:
        res = hoad.compile(energy, order=3, backend="eager", mode=mode)(x)
        for k in (1, 2, 3):
            want = _nested_jacrev(energy, x, k)
            assert res[(0,) * k].isfinite().all()
            torch.testing.assert_close(res[(0,) * k], want, rtol=1e-10, atol=1e-12)


def test_flat_masks_compile_with_inductor():
    f = lambda x: (torch.acos(torch.clamp(1.5 * x, -1, 1)) + torch.relu(x) ** 1.5).sum()  # noqa: E731
    got, want = hoad.compile(f, order=2)(X)[0, 0], _nested_jacrev(f, X, 2)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_vanishing_blocks_without_a_flat_region_stay_nan():
    """sqrt(x⁴) = x² at 0: x⁴'s blocks to order 2 are 0 there, but x⁴ is not constant near 0, so
    the truth is 2 and zeroing the infinite coefficient would be silently wrong. NaN stays."""
    res = hoad.compile(lambda x: torch.sqrt(x ** 4).sum(), order=2, backend="eager")(torch.zeros(1, dtype=DT))
    assert res[0, 0].isnan().all()


@pytest.mark.parametrize("mode", MODES)
def test_on_the_kink_the_selection_decides_as_in_torch(mode):
    """At 0, relu and where take their constant (flat: 0), a maximum tie takes half of each side
    (not flat: inf), as torch's reverse mode does."""
    x = torch.tensor([0.0, 1.0], dtype=DT)
    for name in ("sqrt-relu", "sqrt-where", "sqrt-maximum"):
        f = lambda x: FUNCTIONS[name](x).sum()  # noqa: E731
        torch.testing.assert_close(hoad.compile(f, order=1, backend="eager", mode=mode)(x)[0], jacrev(f)(x))


@pytest.mark.parametrize("mode", MODES)
def test_biharmonic_differentiates_the_flat_laplacian_program(mode):
    """The outer Laplacian differentiates the inner one's program, whose coefficients are inf on
    the flat entries: its products and its reverse sweep must not turn them into NaN."""
    torch.manual_seed(0)
    W = torch.randn(3, 8, dtype=DT)
    u = lambda x: torch.sqrt(torch.relu(x @ W)).sum(-1)  # noqa: E731
    X = torch.randn(5, 3, dtype=DT)
    got = hoad.biharmonic(u, batch_dim=0, mode=mode, backend="eager")(X).biharmonic

    def bih(x):
        f = lambda y: u(y[None])[0]  # noqa: E731
        return torch.einsum("iijj->", jacrev(jacrev(jacrev(jacrev(f))))(x))

    torch.testing.assert_close(got, torch.stack([bih(x) for x in X]), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_a_constant_chosen_at_a_point_is_not_flat(mode):
    """‖x‖ is where(total = 0, 0, √total): at 0 the where picks its constant on an equality, a
    point, and ‖x‖ is not constant near it. ‖x‖^1.5 and 1/‖x‖ have no finite Hessian there: NaN,
    not the 0 a flat region would give."""
    x = torch.zeros(3, dtype=DT)
    for f in (lambda x: x.norm() ** 1.5, lambda x: 1 / x.norm()):
        assert hoad.compile(f, order=2, backend="eager", mode=mode)(x)[0, 0].isnan().all()


@pytest.mark.parametrize("mode", MODES)
def test_flat_value_into_an_op_with_several_outputs(mode):
    """max(dim) returns (values, indices): the reverse sweep reads no mask off the tuple."""
    f = lambda x: torch.relu(x.reshape(2, 3)).sqrt().max(dim=0).values.sum()  # noqa: E731
    res = hoad.compile(f, order=2, backend="eager", mode=mode)(X)
    torch.testing.assert_close(res[0], _nested_jacrev(f, X, 1))
    torch.testing.assert_close(res[0, 0], _nested_jacrev(f, X, 2))


@pytest.mark.parametrize("mode", MODES)
def test_distance_to_a_box_is_flat_inside(mode):
    """√(Σ relu(x - 1)²) per row (and √ of the mean), a penalty for leaving a box: 0 on rows
    inside the box, through the sum and the mean."""
    x = torch.tensor([[0.5, 0.2, -0.3], [1.5, 0.2, 2.0]], dtype=DT)
    for f in (lambda x: torch.sqrt(torch.relu(x - 1).pow(2).sum(-1)).sum(),
              lambda x: torch.sqrt(torch.relu(x[:1] - 1).pow(2).mean()) + x[1].sum() ** 2):
        res = hoad.compile(f, order=3, backend="eager", mode=mode)(x)
        for k in (1, 2, 3):
            torch.testing.assert_close(res[(0,) * k], _nested_jacrev(f, x, k), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_a_product_with_a_flat_zero_is_flat(mode):
    """√(relu(x)·|y|) is 0 for every y where x < 0: d/dx is 0 there, not inf · 0."""
    x, y = X, torch.tensor([0.5, 0.3, -2.0, 1.5, 0.7, -0.4], dtype=DT)
    f = lambda x, y: torch.sqrt(torch.relu(x) * y.abs()).sum()  # noqa: E731
    res = hoad.compile(f, order=2, wrt=(0, 1), backend="eager", mode=mode)(x, y)
    live = x > 0
    for got, want in ((res[0], jacrev(f, 0)(x, y)), (res[1], jacrev(f, 1)(x, y)),
                      (res[0, 0], jacrev(jacrev(f, 0), 0)(x, y)), (res[0, 1], jacrev(jacrev(f, 0), 1)(x, y))):
        assert got.isfinite().all()
        if got.ndim == 2:  # a sum over entries: the blocks are diagonal
            assert got.equal(got.diagonal().diag())
            got, want = got.diagonal(), want.diagonal()
        torch.testing.assert_close(got[live], want[live])  # torch: ∂/∂y = inf · 0 where x < 0
        assert got[~live].eq(0).all()


def test_a_mask_that_loses_the_sample_axis_reshapes_per_sample():
    """Under batch_dim a where with a fixed feature mask (no sample axis) then a per-sample
    reshape: the flat mask is kept at the value's shape, so the reshape applies to it too."""
    torch.manual_seed(0)
    valid = torch.tensor([True, True, False, True])
    W = torch.randn(2, 3, dtype=DT)

    def u(X):
        h = torch.where(valid, X, 0.0).reshape(X.shape[0], 2, 2)
        return torch.tanh(h.transpose(1, 2) @ W).sum((1, 2))

    X = torch.randn(5, 4, dtype=DT)
    got = hoad.laplacian(u, batch_dim=0, backend="eager")(X).laplacian
    want = torch.stack([jacrev(jacrev(lambda x: u(x[None])[0]))(x).trace() for x in X])
    torch.testing.assert_close(got, want)


def _pair_energy(clamped: bool):
    def energy(X):  # the diagonal r_ii = 0 is clamped to ε, where √'s derivative is infinite
        D = X[:, None, :] - X[None, :, :]
        s = torch.sqrt((D ** 2).sum(-1))
        r = s.clamp(min=1e-3) if clamped else torch.where(s > 1e-3, s, 1e-3)
        return (torch.exp(-r) + 1 / r).sum()
    return energy


@pytest.mark.parametrize("mode", MODES)
def test_a_clamped_value_whose_argument_has_an_infinite_derivative_is_flat(mode):
    """clamp(√Σd², min=ε) at a zero distance: clamp's derivative 0 times √'s infinite one made
    every entry of the gradient NaN (torch.func's too), where the function is flat there; the
    where form was right. clamp now decomposes into wheres, whose untaken branches are guarded."""
    X = torch.tensor([[0.0, 0.0], [1.0, 0.5], [-0.3, 2.0]], dtype=torch.float64)
    got = hoad.compile(_pair_energy(True), order=2, mode=mode, backend="eager")(X)
    want = hoad.compile(_pair_energy(False), order=2, mode=mode, backend="eager")(X)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[0, 0]).all()
    assert_close(got[0], want[0], "gradient")
    assert_close(got[0, 0], want[0, 0], "Hessian")
    off = ~torch.eye(3, dtype=torch.bool)  # the same sum over i != j, by torch.func
    plain = lambda X: (lambda r: (torch.exp(-r) + 1 / r)[off].sum())(  # noqa: E731
        torch.sqrt(((X[:, None, :] - X[None, :, :]) ** 2).sum(-1) + torch.eye(3, dtype=X.dtype)))
    assert_close(got[0], jacrev(plain)(X), "gradient against torch.func")
    x = torch.tensor([0.0, 0.01, 0.5, 2.0], dtype=torch.float64)
    nan_bound = hoad.compile(lambda x: x.clamp(min=math.nan), order=1, mode=mode, backend="eager")(x)
    assert nan_bound.value.isnan().all()  # (torch's; the wheres gave x)
    for f in (lambda x: (x.sqrt() - 0.1).clamp(min=0).pow(2).sum(), lambda x: x.log().clamp(min=-5).exp().sum()):
        res = hoad.compile(f, order=2, mode=mode, backend="eager")(x)
        assert torch.isfinite(res[0]).all() and torch.isfinite(res[0, 0]).all(), res[0]
        assert_close(res[0][1:], jacrev(f)(x)[1:], "gradient away from 0")
