"""Branches of ``torch.where`` (passes/branches.py): the branch a where does not take is computed at
a safe point, so a singular op there (1/r at r = 0, log 0) brings no NaN or inf into the
derivatives, in either direction, while a value read elsewhere, or by both branches, keeps its
entries. And a 2-norm squared is the sum of squares: smooth where the norm is not."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check, rand
from torch.func import jacfwd, jacrev, vmap

import hoad

MODES = ["forward", "reverse"]


# -------------------------------------------------------------------------- untaken branches
def test_where_does_not_leak_the_untaken_branch():
    """Forward propagation selects: the derivatives of x·log x, untaken at x = 0, do not leak."""
    x = torch.tensor([0.0, 0.5, 2.0, 0.0], dtype=torch.float64)

    def f(x):
        return torch.where(x > 0, x * x.log(), torch.zeros_like(x)).sum() + x.sin().sum()

    def safe(x):  # the same function with the log's argument kept away from 0
        return torch.where(x > 0, x * torch.where(x > 0, x, 1.0).log(), torch.zeros_like(x)).sum() + x.sin().sum()

    res = hoad.compile(f, order=3, mode="forward")(x)
    g = jacrev(safe)
    assert_close(res[0], g(x), "gradient")
    assert_close(res[0, 0], jacfwd(g)(x), "Hessian")
    assert torch.isfinite(res[0, 0, 0]).all()
    # the adjoint sweep multiplied the zero cotangent of the untaken branch by log 0 (NaN, as
    # torch's backward does); capture now gives the log a safe argument there (safe_branches)
    rev = hoad.compile(f, order=2, mode="reverse")(x)
    assert_close(rev[0], g(x), "gradient, reverse")
    assert_close(rev[0, 0], jacfwd(g)(x), "Hessian, reverse")


@pytest.mark.parametrize("mode", ["auto", "reverse"])
def test_masked_self_interaction_is_finite_in_every_direction(mode):
    """A Coulomb sum with its self pairs masked by where(eye, 0, 1 / r), r_ii = 0: the adjoint
    form (the default for one energy of many coordinates) gave NaN gradient and Hessian."""
    def coulomb(x):
        eye = torch.eye(x.shape[-2], dtype=torch.bool)
        d = x[..., :, None, :] - x[..., None, :, :]
        return torch.where(eye, 0.0, 1 / (d * d).sum(-1).sqrt()).sum((-1, -2))

    def safe(x):  # the self pairs removed before the division
        eye = torch.eye(x.shape[-2], dtype=torch.bool)
        d = x[..., :, None, :] - x[..., None, :, :]
        return (1 / (d * d).sum(-1).masked_fill(eye, 1.0).sqrt()).masked_fill(eye, 0.0).sum((-1, -2))

    X = rand(3, 5, 3, seed=92)
    res = hoad.compile(coulomb, order=2, batch_dim=0, mode=mode, backend="eager")(X)
    assert_close(res[0], vmap(jacrev(safe))(X), "gradient")
    assert_close(res[0, 0], vmap(jacfwd(jacrev(safe)))(X), "Hessian")


def test_a_branch_value_read_elsewhere_keeps_its_entries():
    """The rewrite changes a branch only where nothing but the where reads it: log x read again
    outside keeps its NaN at x < 0 (0 · NaN is NaN), as the function computes it."""
    x = torch.tensor([-1.0, 0.5], dtype=torch.float64)
    f = lambda x: (lambda l: torch.where(x > 0, l, 0.0).sum() + 0 * l.sum())(x.log())  # noqa: E731
    assert hoad.compile(f, order=1, mode="reverse", backend="eager")(x).value.isnan()


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_two_masked_pair_terms_sharing_a_distance(mode):
    """Coulomb and Lennard-Jones terms, each where(eye, 0, g(r)), read one r = √Σd²: the √ at
    r_ii = 0 was in neither where's region alone, and reverse mode gave an all-NaN gradient."""
    n = 4
    eye = torch.eye(n, dtype=torch.bool)
    q = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    iu = torch.triu_indices(n, n, 1)

    def energy(x):
        r = ((x[:, None] - x[None]) ** 2).sum(-1).sqrt()
        s6 = torch.where(eye, 0.0, r ** -6)
        return 0.5 * (torch.where(eye, 0.0, q[:, None] * q[None] / r) + 4 * (s6 * s6 - s6)).sum()

    def pairs(x):  # the same sum over i < j
        r = ((x[iu[0]] - x[iu[1]]) ** 2).sum(-1).sqrt()
        return (q[iu[0]] * q[iu[1]] / r + 4 * (r ** -12 - r ** -6)).sum()

    x = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 1.5
    res = hoad.compile(energy, order=2, mode=mode, backend="eager")(x)
    torch.testing.assert_close(res[0, 0], torch.func.hessian(pairs)(x))


@pytest.mark.parametrize("mask", ["nan_to_num", "isfinite", "masked_fill"])
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_branch_masked_by_its_own_infinity(mask, mode):
    """1 / r at r_ii = 0 masked by a condition computed from 1 / r itself (nan_to_num, isfinite,
    isinf): reverse mode's Hessian was NaN in every entry (the second-order term of the division
    multiplies the untaken entries' zero cotangent by 1/0³). The branch reads a guarded copy."""
    n = 4
    iu = torch.triu_indices(n, n, 1)
    masks = {"nan_to_num": lambda y: torch.nan_to_num(y, posinf=0.0),
             "isfinite": lambda y: torch.where(torch.isfinite(y), y, 0.0),
             "masked_fill": lambda y: y.masked_fill(y.isinf(), 0.0)}

    def energy(x):
        return masks[mask](1 / torch.cdist(x, x)).sum()

    def pairs(x):  # the same sum over i ≠ j
        return 2 * (1 / ((x[iu[0]] - x[iu[1]]) ** 2).sum(-1).sqrt()).sum()

    x = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    res = hoad.compile(energy, order=3, mode=mode, backend="eager")(x)
    torch.testing.assert_close(res[0], torch.func.grad(pairs)(x))
    torch.testing.assert_close(res[0, 0], torch.func.hessian(pairs)(x))
    torch.testing.assert_close(res[0, 0, 0], torch.func.jacfwd(torch.func.hessian(pairs))(x))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_two_singular_ops_in_a_branch_the_second_read_by_a_condition(mode):
    """log(1/x - 1) with the log's NaN counted by a condition elsewhere: after the division was
    copied, the log's original (kept for the condition) was guarded in place, and the count it
    feeds lost its NaN (value 5.10 where torch gives 6.10)."""
    def f(x):
        z = torch.log(1 / x - 1)
        return torch.where((x > 0) & (x < 1), z, x * x).sum() + (~torch.isfinite(z)).double().sum()

    def plain(x):  # the same function with the log's argument kept in its domain, and the count
        inside = (x > 0) & (x < 1)
        z = torch.log(torch.where(inside, 1 / torch.where(inside, x, 0.5) - 1, 1.0))
        return torch.where(inside, z, x * x).sum() + (~inside).double().sum()

    x = torch.tensor([0.5, 2.0, 0.25], dtype=torch.float64)
    res = hoad.compile(f, order=2, mode=mode, backend="eager")(x)
    torch.testing.assert_close(res.value, f(x))
    torch.testing.assert_close(res[0], torch.func.grad(plain)(x))
    torch.testing.assert_close(res[0, 0], torch.func.hessian(plain)(x))


@pytest.mark.parametrize("name", ["pow", "acosh", "xlogy", "erfinv", "lgamma", "digamma", "log1p"])
def test_singular_ops_in_an_untaken_branch_in_reverse_mode(name):
    """Their argument is made safe where the branch is not taken: NaN in reverse mode before."""
    p = torch.tensor(2.5, dtype=torch.float64)
    op, inside, safe = {"pow": (lambda u: torch.pow(2.0 - u, p), lambda x: x < 2, 0.0),
                        "acosh": (torch.acosh, lambda x: x > 1, 2.0),
                        "xlogy": (lambda u: torch.xlogy(u, u), lambda x: x > 0, 1.0),
                        "erfinv": (torch.erfinv, lambda x: x.abs() < 1, 0.0),
                        "lgamma": (torch.lgamma, lambda x: x > 0, 1.0),
                        "digamma": (torch.digamma, lambda x: x > 0, 1.0),
                        "log1p": (torch.log1p, lambda x: x > -1, 0.0)}[name]
    x = torch.linspace(-2.5, 3, 12, dtype=torch.float64)

    def f(x):
        return torch.where(inside(x), op(x), 0.0).sin().sum()

    def plain(x):  # the double-where idiom
        return torch.where(inside(x), op(torch.where(inside(x), x, safe)), 0.0).sin().sum()

    res = hoad.compile(f, order=2, mode="reverse", backend="eager")(x)
    torch.testing.assert_close(res[0, 0], torch.func.hessian(plain)(x))


_BOTH_BRANCHES = {  # a singular op's value read by both branches of a where
    "where": lambda x: torch.where(x > 1, x.sqrt(), 2 * x.sqrt()),
    "where cse": lambda x: torch.where(x > 1, -1 / x + x.sqrt(), 1 / x),
    "leaky_relu(log)": lambda x: F.leaky_relu(x.log(), 0.1),
    "elu(sqrt - 1)": lambda x: F.elu(x.sqrt() - 1),
    "softplus(5 sqrt)": lambda x: F.softplus(5 * x.sqrt()),
    "logsigmoid(sqrt)": lambda x: F.logsigmoid(x.sqrt()),
    "logaddexp": lambda x: torch.logaddexp(x, 2 * x.sqrt()),
    "hardswish(1/x)": lambda x: F.hardswish(1 / x),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(_BOTH_BRANCHES))
def test_a_value_both_branches_of_a_where_read(name, mode):
    """safe_branches counted a value the where reads as its other branch (or the taken one) as its
    branch's own, and gave it the guard's safe value: where(x > 1, √x, 2√x) came out [1.41, 1, 1]
    where torch gives [1.41, 1.41, 2]; leaky_relu(log x) was 3.4 off."""
    x = torch.tensor([0.3, 1.0, 2.0, 30.0, 0.05], dtype=torch.float64)
    f = _BOTH_BRANCHES[name]
    res = hoad.compile(lambda x: f(x), order=2, mode=mode, backend="eager")(x)
    assert_close(res.value, f(x), "value")
    assert_close(res[0], jacrev(f)(x), "first derivative")
    assert_close(res[0, 0], jacfwd(jacrev(f))(x), "second derivative")


def test_a_condition_computed_through_a_longer_chain_still_guards_its_branch():
    """where(((2/x + 1)·3 − 1) > 5, x, 1/x): the condition reads 1/x through four ops; the search
    for conditions stopped at three, left 1/x unguarded, and reverse mode gave NaN at x = 0 where
    the where takes x (derivative 1)."""
    f = lambda x: torch.where(((1 / x) * 2 + 1) * 3 - 1 > 5, x, 1 / x)  # noqa: E731
    x = torch.tensor([0.0, 2.0], dtype=torch.float64)
    got = hoad.compile(f, order=1, mode="reverse", backend="eager", batch_dim=0)(x)[0]
    assert_close(got, torch.tensor([1.0, -0.25], dtype=torch.float64), "per-sample derivative")


# ----------------------------------------------------------------------------- norms squared
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", ["rbf kernel", "norm squared", "norm times norm", "two norm calls", "pdist squared"])
def test_squared_distances_are_smooth_at_coincident_points(form, mode):
    """A 2-norm squared is the sum of squares: Hessian 2I at a zero difference. Through the
    norm's subgradient 0 it was 0 (an RBF kernel's curvature at x = x', on its diagonal)."""
    y = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.float64)
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)  # x[0] = y[0], and a zero row
    w = torch.tensor([1.0, 2.0], dtype=torch.float64)
    fn, plain = {
        "rbf kernel": (lambda x: torch.exp(-torch.cdist(x, y) ** 2).sum(),
                       lambda x: torch.exp(-((x[:, None] - y[None]) ** 2).sum(-1)).sum()),
        "norm squared": (lambda x: (torch.linalg.vector_norm(x, dim=1) ** 2 * w).sum(),
                         lambda x: ((x * x).sum(1) * w).sum()),
        "norm times norm": (lambda x: (lambda n: (n * n).sum())(x.norm(dim=1)), lambda x: (x * x).sum()),
        "two norm calls": (lambda x: (x.norm(dim=1) * x.norm(dim=1)).sum(), lambda x: (x * x).sum()),
        "pdist squared": (lambda x: (F.pdist(torch.cat([x, y])) ** 2).sum(),
                          lambda x: (lambda z: ((z[:, None] - z[None]) ** 2).sum(-1).triu(1).sum())(torch.cat([x, y]))),
    }[form]
    check(fn, (x,), order=3, mode=mode, reference_fn=plain)
