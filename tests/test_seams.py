"""Functions at the points where their formulas have seams: the kinks of piecewise-linear ops, domain
edges, zero bases and zero vectors, the origin of atan2, a loss at zero residual or at its
threshold. hoad's derivatives there follow torch's own convention, checked against nested
torch.func in float64 (or the same maths in plain ops where torch.func has no answer), in both
directions. (tests/test_special_points.py sweeps torch's elementwise ops at such points, -m slow.)"""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check, rand
from torch.func import jacfwd, jacrev

import hoad

MODES = ["forward", "reverse"]


# ------------------------------------------------------------------- piecewise-linear modulo
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [torch.fmod, torch.remainder])
def test_modulo_is_linear_in_both_arguments(op, mode):
    """d/da = 1 and d/db = -q with q the rounded quotient, not the zero of a step function."""
    check(lambda a, b: op(a * 3, b.exp()).sin() * a, (rand(2, 3), rand(3)), wrt=(0, 1), order=3, mode=mode)


# ---------------------------------------------------------------------------- domain edges
@pytest.mark.parametrize("mode", MODES)
def test_sinc_derivatives_at_and_near_zero(mode):
    """sinc's derivatives at 0 are its series' (-π²/3 at order 2, π⁴/5 at order 4, 0 at odd
    orders): the core decomposition's where() gave 0 at every order, and NaN in reverse mode.
    Elsewhere against torch.func of sin(πx)/(πx), on both sides of |πx| = 1, where the rule
    switches from its series to the closed form."""
    x = torch.tensor([0.0, 0.2, -0.25, 0.3, 0.33, -0.5, 1.3], dtype=torch.float64)
    res = hoad.compile(lambda x: torch.sinc(x).sum(), order=4, mode=mode, backend="eager")(x)
    at_zero = [0.0, -math.pi ** 2 / 3, 0.0, math.pi ** 4 / 5]
    g = jacrev(lambda x: (torch.sin(math.pi * x) / (math.pi * x)).sum())
    for k in range(1, 5):
        diagonal = torch.stack([res[(0,) * k][(i,) * k] for i in range(len(x))])
        assert abs(float(diagonal[0]) - at_zero[k - 1]) < 1e-12, f"order {k} at 0: {float(diagonal[0])}"
        ref = g(x[1:])
        assert_close(diagonal[1:], torch.stack([ref[(i,) * k] for i in range(len(x) - 1)]), f"order {k}")
        g = jacfwd(g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn,ref", [
    (lambda x: F.hardtanh(x).sum(), None), (lambda x: F.hardtanh(x, -2.0, 3.0).sum(), None),
    (lambda x: F.relu6(x).sum(), None), (lambda x: (F.hardswish(x) * x).sum(), None),
    (lambda x: F.hardsigmoid(x).sum(),
     lambda x: torch.where((x > -3) & (x < 3), x / 6 + 0.5, (x >= 3).to(x.dtype)).sum()),
], ids=["hardtanh", "hardtanh(-2,3)", "relu6", "hardswish", "hardsigmoid"])
def test_kinks_of_piecewise_linear_activations_follow_torch(fn, ref, mode):
    """At a kink torch's backward gives 0 (min < x < max strictly): relu6 at 0 and 6, hardtanh at
    its ends, hardsigmoid and hardswish at ±3. Clamp's decomposition gave 1 there, hardsigmoid
    1/6 and hardswish its inner slope. (torch's hardsigmoid has no second derivative and a slope
    of float32's 1/6 in float64: its convention in plain ops is the reference.)"""
    order = 3
    x = torch.tensor([-3.0, -2.0, -1.0, 0.0, 0.5, 1.0, 3.0, 6.0, -3.5, 7.0], dtype=torch.float64)
    res = hoad.compile(fn, order=order, mode=mode, backend="eager")(x)
    g = jacrev(ref or fn)
    for k in range(1, order + 1):
        assert_close(res[(0,) * k], g(x), f"order {k}")
        g = jacfwd(g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p", [2, 3, 1, float("inf")])
def test_vector_norm_at_a_zero_vector_has_torchs_subgradient(p, mode):
    """‖x − y‖ where a row of x equals y (a coincident point, a residual that reached zero):
    core ATen's pow(Σ x², 1/2) gave 0 · inf = NaN gradients, torch's own formula the subgradient 0
    at every order. Compared at orders 1..3 on rows with zero, mixed and nonzero entries."""
    x = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0], [0.0, 1.5, -0.5]], dtype=torch.float64)
    y = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    def f(x):
        return torch.linalg.vector_norm(x - y, p, dim=1).sin() + x.norm(p=p) * x[:, 0]

    res, _ = check(f, (x,), order=3, mode=mode, backend="eager")
    assert all(torch.isfinite(res[(0,) * k]).all() for k in (1, 2, 3))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn", [
    lambda x: torch.special.entr(x).sum(),
    lambda x: torch.pow(0.0, x).sum(),
    lambda x: torch.pow(torch.tensor([0.0, 0.0, 2.0, 0.0, 0.0], dtype=torch.float64), x).sum(),
], ids=["entr", "zero-base", "zero-base-tensor"])
def test_domain_edges_follow_torch(fn, mode):
    """At the edge, torch's own formula gives inf or 0 (entr' = -(1 + log x) is +inf at 0; 0**x has
    derivative 0 for x >= 0), where a where() decomposition gave NaN or 0. Compared on the
    diagonal: off it, torch's Hessian holds 0·inf NaNs of its forward tangents, hoad exact zeros."""
    x = torch.tensor([0.0, 0.5, 1.5, -0.3, 0.0], dtype=torch.float64)
    res = hoad.compile(fn, order=3, mode=mode)(x)
    g = jacrev(fn)
    torch.testing.assert_close(res[0], g(x), equal_nan=True)
    h = jacfwd(g)(x)
    torch.testing.assert_close(res[0, 0].diagonal(), h.diagonal(), equal_nan=True)
    off = ~torch.eye(5, dtype=torch.bool)
    assert (res[0, 0][off] == 0).all()


# ------------------------------------------------------- smooth functions at their seams
ZEROS = torch.tensor([0.0, 0.0, 1.5, -1.5], dtype=torch.float64)  # exact zeros: where the seams are


@pytest.mark.parametrize("mode", MODES)
def test_log_sigmoid_is_smooth_at_zero(mode):
    """Core ATen writes log σ(x) as min(0, x) - log1p(e^-|x|): its kinks cancel in value only,
    and hoad differentiated the pieces (Hessian 0 at x = 0, not -1/4: Newton's first step of a
    logistic regression from w = 0 was wrong). Checked against the plain-op formula -log1p(e^-x)."""
    X = rand(6, 4, seed=73)
    check(lambda w: F.logsigmoid(X @ w).sum() + F.logsigmoid(w).sum(), (ZEROS.clone(),), order=4, mode=mode,
          reference_fn=lambda w: -torch.log1p(torch.exp(-(X @ w))).sum() - torch.log1p(torch.exp(-w)).sum())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", ["smooth_l1", "huber"])
def test_robust_losses_are_quadratic_at_zero_residual(loss, mode):
    """Inside |d| < β they are d²/2 (over β): core wrote d² as |d|², whose Hessian is 0 at d = 0
    (prediction equal to target), not 1/β. The reference is the same loss in plain ops."""
    target = torch.tensor([0.0, 0.5, 1.5, -3.0], dtype=torch.float64)
    fn = {"smooth_l1": lambda x: F.smooth_l1_loss(x, target, beta=0.7),
          "huber": lambda x: F.huber_loss(x, target, delta=0.7)}[loss]
    scale = 1 / 0.7 if loss == "smooth_l1" else 1.0

    def plain(x):
        d = x - target
        inner = 0.5 * d * d * scale
        outer = (d.abs() - 0.35) * (1.0 if loss == "smooth_l1" else 0.7)
        return torch.where(d.abs() < 0.7, inner, outer).mean()

    check(fn, (torch.tensor([0.0, 0.5, 0.2, 1.0], dtype=torch.float64),), order=3, mode=mode, reference_fn=plain)


@pytest.mark.parametrize("mode", MODES)
def test_robust_losses_at_their_seam_follow_torch(mode):
    """|d| = δ exactly (a zero-initialised output and targets ±δ): Huber's curvature there is
    torch's 1 (it was 0, a singular Newton step), smooth L1's torch's 0."""
    target = torch.tensor([1.0, -1.0, 0.25], dtype=torch.float64)
    x = torch.zeros(3, dtype=torch.float64)
    for fn in (lambda x: F.huber_loss(x, target, delta=1.0, reduction="sum"),
               lambda x: F.smooth_l1_loss(x, target, beta=1.0, reduction="sum")):
        res = hoad.compile(fn, order=2, mode=mode, backend="eager")(x)
        assert_close(res[0, 0], jacrev(jacrev(fn))(x), "Hessian at the seam")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["elu", "celu", "selu"])
def test_elu_family_at_zero_follows_torch(name, mode):
    """At x = 0 torch differentiates the negative branch once (slope s·α) and the positive one
    after that (no curvature); hoad took the negative branch at every order (Hessian α, not 0)."""
    fn = {"elu": F.elu, "celu": lambda x: F.celu(x, alpha=2.0), "selu": F.selu}[name]
    check(lambda x: (fn(x) * torch.arange(1.0, 5.0, dtype=torch.float64)).sum(), (ZEROS.clone(),), order=3,
          mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_powers_at_a_zero_base_follow_torch(mode):
    """x ** p with a tensor p: at x = 0, torch's p·x^(p-1) is 1 for p = 1 and 0 for p = 0
    (forward mode formed y · x⁻¹ = 0 · inf = NaN); sqrt and rsqrt are inf at 0, not NaN."""
    p = torch.tensor([1.0, 0.0, 2.0, 3.0], dtype=torch.float64)
    x = torch.tensor([0.0, 0.0, 0.0, 1.5], dtype=torch.float64)
    check(lambda x: (x ** p).sum(), (x,), order=3, mode=mode)
    # base and exponent both differentiated: a^b = exp(b log a) has log 0 = -inf at a = 0, where
    # the blocks in a were NaN; torch takes them as the power's (those in b, and mixed, as 0:
    # the limit a^(b-1) log a -> 0 for b > 1 at order 2; from order 3 the mixed ones are log 0)
    q = torch.tensor([2.0, 3.0, 2.0, 0.5], dtype=torch.float64)
    check(lambda x, q: (x ** q).sum(), (torch.tensor([0.0, 0.0, 1.0, 2.0], dtype=torch.float64), q), wrt=(0, 1),
          order=2, mode=mode)
    for fn, slope in ((torch.sqrt, math.inf), (torch.rsqrt, -math.inf)):
        assert hoad.compile(lambda x: fn(x).sum(), order=1, mode=mode, backend="eager")(x)[0][0] == slope


@pytest.mark.parametrize("mode", MODES)
def test_atan2_at_the_origin_is_nan_and_xlogy_at_zero_follows_torch(mode):
    """The angle is discontinuous at the origin: its derivatives there are NaN at every order
    (torch's 0 at order 1 let r² cos 2θ = x² - y² come out with Hessian diag(2, 2), not
    diag(2, -2)); elsewhere torch's. ∂ xlogy(x, y)/∂x at x = 0 is log y (it was 0), and 0 at
    x = y = 0 in reverse mode too (0 · log 0 = NaN before)."""
    a = torch.tensor([0.0, 1.0, -2.0, 0.0], dtype=torch.float64)
    b = torch.tensor([0.0, 0.5, 1.0, 2.0], dtype=torch.float64)
    res = hoad.compile(lambda a, b: torch.atan2(a, b).sum(), order=2, wrt=(0, 1), mode=mode, backend="eager")(a, b)
    ref = jacrev(lambda a: torch.atan2(a, b).sum())(a)
    assert bool(res[0][0].isnan()) and bool(res[0, 0][0, 0].isnan()) and bool(res[0, 1][0, 0].isnan())
    assert_close(res[0][1:], ref[1:], "away from the origin")
    check(lambda a, b: torch.atan2(a, b).sum(), (a[1:], b[1:]), wrt=(0, 1), order=3, mode=mode)
    check(lambda x: torch.xlogy(x, b).sum() + torch.special.xlog1py(x, b - 1).sum(), (a.clone(),), order=2,
          mode=mode)
    # with y a number (another overload): x · log 2 has derivative log 2 at x = 0 too
    check(lambda x: torch.xlogy(x, 2.0).sum() + torch.special.xlog1py(x, 1.0).sum(), (a.clone(),), order=2,
          mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_std_of_a_constant_row_has_torchs_zero_derivative(mode):
    """√var at var = 0 gave inf · 0 = NaN; torch's derivative there is 0 (a subgradient)."""
    X = torch.tensor([[1.0, 1.0, 1.0], [1.0, 2.0, 4.0]], dtype=torch.float64)
    check(lambda X: X.std(dim=1).sum() + torch.std_mean(X, dim=1, keepdim=True)[0].sum(), (X,), order=2,
          mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_binary_cross_entropy_at_certain_predictions_is_finite(mode):
    """At p = 0 (target 0) and p = 1 (target 1) the clamped log's derivative was inf · 0 = NaN.
    There the loss is the other term alone: -log(1 - p) has slope 1 at p = 0. Elsewhere it is the
    plain formula (torch's own backward divides by max(p(1 - p), 1e-12): 0 at the ends)."""
    t = torch.tensor([0.0, 1.0, 1.0, 0.2], dtype=torch.float64)

    def f(p):
        return F.binary_cross_entropy(p, t, reduction="sum")

    def plain(p):
        return -(t * torch.log(p) + (1 - t) * torch.log1p(-p)).sum()

    check(f, (torch.tensor([0.1, 0.7, 0.5, 0.3], dtype=torch.float64),), order=3, mode=mode, reference_fn=plain)
    res = hoad.compile(f, order=2, mode=mode, backend="eager")(torch.tensor([0.0, 1.0, 0.5, 0.3], dtype=torch.float64))
    assert_close(res[0][:2], torch.tensor([1.0, -1.0], dtype=torch.float64), "slopes at p = 0 and 1")
    assert_close(res[0, 0].diagonal()[:2], torch.tensor([1.0, 1.0], dtype=torch.float64), "curvatures there")


@pytest.mark.parametrize("mode", MODES)
def test_nextafter_at_equal_arguments_follows_torch(mode):
    a = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    b = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)
    check(lambda a, b: (torch.nextafter(a, b) * a).sum(), (a, b), wrt=(0, 1), order=2, mode=mode)
