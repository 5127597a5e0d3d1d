"""Variants of the factorization rules (hoad/rules/factorizations.py) and the linear-algebra
routes of capture (hoad/rules/linalg.py) that the one-case-per-rule table does not reach:
trapezoidal shapes, the LU and triangular-solve APIs, refusals, and the operators' autograd.
The costlier variants run under -m slow (the OpInfo sweep covers those ops at order 3)."""

import itertools
import math

import pytest
import torch
from helpers import assert_close, check, rand

import hoad

aten = torch.ops.aten


def _plain_det(a):
    """± Π U_ii of the LU factors (torch.func's third derivative of det is wrong, lu_factor's right)."""
    lu, pivots = torch.linalg.lu_factor(a)
    n = a.shape[-1]
    swaps = (pivots != torch.arange(1, n + 1, dtype=pivots.dtype)).sum(-1)
    return lu.diagonal(dim1=-2, dim2=-1).prod(-1) * (1 - 2 * (swaps % 2)).to(a.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(3, 3), (2, 4)], ids=str)
def test_svd_factors_together(shape):
    """U S Vh of a square and a wide matrix (the wide one through Aᵀ, torch's signs kept)."""
    w = rand(*shape, seed=41)

    def f(a):
        U, S, Vh = torch.linalg.svd(a, full_matrices=False)
        return (U.sin().sum() + (S * S.cos()).sum() + (Vh * w[: Vh.shape[0]]).sum()).reshape(1)

    check(f, (rand(*shape, seed=42),), order=2)


def _leibniz_det(a):
    """Σ_σ sgn(σ) Π_i a[i, σ(i)]: det in products of entries, exact derivatives everywhere (by
    `*`: torch.func's derivatives of prod are wrong at an exact zero)."""
    n = a.shape[-1]
    terms = []
    for perm in itertools.permutations(range(n)):
        inversions = sum(perm[i] > perm[j] for i in range(n) for j in range(i + 1, n))
        terms.append((-1) ** inversions * math.prod(a[..., i, perm[i]] for i in range(n)))
    return sum(terms)


@pytest.mark.parametrize("n", [3, 5])
def test_det_is_exact_where_torch_func_is_not(n):
    """Up to 4 rows det is a polynomial in A, above it sign · exp(log|det|)."""
    check(lambda a: torch.linalg.det(a).sin(), (rand(2, n, n, seed=43),), order=3,
          reference_fn=lambda a: _plain_det(a).sin())


# (ranks n-1 of 3x3 and 4x4 under -m slow: the default keeps rank 1 of 2x2 and of 3x3)
@pytest.mark.parametrize("n,rank", [(2, 1), pytest.param(3, 2, marks=pytest.mark.slow), (3, 1),
                                    pytest.param(4, 3, marks=pytest.mark.slow)])
def test_det_at_a_singular_matrix(n, rank):
    """The derivatives of det at a singular A are the adjugate's: they were NaN at an exactly
    singular A and O(1) off at a numerically singular one (det · A⁻ᵀ for det ~ 1e-16)."""
    g = torch.Generator().manual_seed(47 + n + rank)
    A = torch.randn(3, n, rank, generator=g, dtype=torch.float64) @ torch.randn(3, rank, n, generator=g,
                                                                                dtype=torch.float64)
    A[0, 0] = 0  # an exact zero row and column (rank n - 1 or less)
    A[0, :, 0] = 0
    for mode in ("forward", "reverse"):
        check(lambda a: torch.linalg.det(a) * a[..., 0, -1], (A,), order=4 if n < 4 else 3,
              reference_fn=lambda a: _leibniz_det(a) * a[..., 0, -1], mode=mode)
    check(lambda a: torch.linalg.det(a).exp(), (A,), order=2, reference_fn=lambda a: _leibniz_det(a).exp(),
          batch_dim=0)


def test_cholesky_inverse_reads_one_triangle():
    """(L Lᵀ)⁻¹ by two triangular solves: torch.func's second derivative of cholesky_inverse is
    wrong (torch 2.13), that of inv(L Lᵀ) is right."""
    def tri(a):
        return a.tril() + 3 * torch.eye(3, dtype=a.dtype)

    check(lambda a: torch.cholesky_inverse(tri(a)).sin().sum(0), (rand(3, 3, seed=44),), order=2,
          reference_fn=lambda a: torch.linalg.inv(tri(a) @ tri(a).mT).sin().sum(0))


@pytest.mark.slow
@pytest.mark.parametrize("left,adjoint", [(True, False), (True, True), (False, False), (False, True)])
def test_lu_solve_every_side(left, adjoint):
    a0 = rand(3, 3, seed=45) + 3 * torch.eye(3, dtype=torch.float64)
    B = rand(3, 2, seed=46) if left else rand(2, 3, seed=46)

    def f(a):
        LU, piv = torch.linalg.lu_factor(a)
        return torch.linalg.lu_solve(LU, piv, B, left=left, adjoint=adjoint).sin().sum(0)

    def ref(a):
        A = a.mT if adjoint else a
        return (torch.linalg.inv(A) @ B if left else B @ torch.linalg.inv(A)).sin().sum(0)

    check(f, (a0,), order=2, reference_fn=ref)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(3, 2), (2, 3)], ids=str)
def test_linalg_lu_trapezoidal(shape):
    check(lambda a: (lambda P, L, U: (P @ L).sin().sum() + U.exp().sum())(*torch.linalg.lu(a)),
          (rand(*shape, seed=47),), order=2)


def test_triangular_solve_transposed_unit():
    A = rand(3, 3, seed=48) + 3 * torch.eye(3, dtype=torch.float64)
    check(lambda a, b: torch.triangular_solve(b.sin(), a, upper=False, transpose=True, unitriangular=True)[0].sum(0),
          (A, rand(3, 2, seed=49)), wrt=(0, 1), order=2,
          reference_fn=lambda a, b: torch.linalg.solve_triangular(a.tril(-1).mT + torch.eye(3, dtype=a.dtype), b.sin(),
                                                                  upper=True).sum(0))


@pytest.mark.slow
def test_householder_product_and_ormqr():
    geqrf, tau = torch.geqrf(rand(4, 3, seed=50))
    C = rand(4, 2, seed=51)
    def full_q(a, t):  # (ormqr has no forward AD: the reference forms Q with a fourth, trivial reflector)
        return torch.linalg.householder_product(torch.cat([a, 0 * a[:, :1]], 1), torch.cat([t, 0 * t[:1]]))

    check(lambda a, t: torch.linalg.householder_product(a, t).sin().sum(0) + torch.ormqr(a, t, C, transpose=True).sum(),
          (geqrf, tau), wrt=(0, 1), order=2,
          reference_fn=lambda a, t: torch.linalg.householder_product(a, t).sin().sum(0) + (full_q(a, t).mT @ C).sum())


@pytest.mark.slow
def test_pinv_constant_rank():
    """A = a bᵀ keeps rank 1 as a moves: A⁺ is differentiable there, with two zero singular values."""
    b = torch.linalg.qr(rand(3, 1, seed=52)).Q
    check(lambda a: torch.linalg.pinv(a @ b.mT).sin().sum(0), (rand(3, 1, seed=53),), order=3)


def test_pinv_truncation_is_nan_not_wrong():
    """Dropping a singular value that is not zero (rtol=0.5) makes pinv a truncated SVD, whose
    derivatives the constant-rank formula does not give: NaN, never a wrong number."""
    a = torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64)) + 0.1 * rand(2, 2, seed=54)
    res = hoad.compile(lambda a: torch.linalg.pinv(a, rtol=0.5).sum(), order=1)(a)
    assert torch.equal(res.value, torch.linalg.pinv(a, rtol=0.5).sum())
    assert res[0].isnan().all()


@pytest.mark.parametrize("fn,fix", [
    (lambda a: torch.linalg.svd(a, full_matrices=True)[0].sum(), "full_matrices=False"),
    (lambda a: torch.linalg.qr(a, mode="complete")[0].sum(), "mode='reduced'"),
], ids=["svd_full_matrices", "qr_complete"])
def test_undetermined_factors_are_refused(fn, fix):
    """Singular vectors / columns of Q beyond min(m, n) are any orthonormal completion: the error
    names the cause, the fix and the user's line."""
    with pytest.raises(hoad.UnsupportedOperatorError, match="orthonormal completion") as info:
        hoad.compile(fn, order=1)(rand(3, 2, seed=55))
    assert fix in str(info.value) and "test_linalg_rules.py" in str(info.value)


def test_operators_autograd():
    """The hoad_linalg operators train: their autograd formulas against torch.linalg's."""
    ops = torch.ops.hoad_linalg
    a = rand(3, 2, seed=56)
    s = rand(3, 3, seed=57)
    s = s + s.mT
    cases = [
        (ops.svd_u, lambda x: torch.linalg.svd(x, full_matrices=False)[0], a),
        (ops.svd_vh, lambda x: torch.linalg.svd(x, full_matrices=False)[2], a.mT.contiguous()),
        (ops.svdvals, torch.linalg.svdvals, a),
        (ops.qr_q, lambda x: torch.linalg.qr(x)[0], a),
        (ops.qr_r, lambda x: torch.linalg.qr(x)[1], a.mT.contiguous()),
        (ops.lu_packed, lambda x: torch.linalg.lu_factor(x)[0], a),
        (ops.eigvecsh, lambda x: torch.linalg.eigh(x)[1], s),
        (ops.eigvalsh, lambda x: torch.linalg.eigh(x)[0], s),
        (ops.pinv, torch.linalg.pinv, a),
    ]
    for op, ref, x in cases:
        x = x.clone().requires_grad_()
        g = rand(*op(x).shape, seed=58)
        got = torch.autograd.grad(op(x), x, g)[0]
        want = torch.autograd.grad(ref(x), x, g)[0]
        torch.testing.assert_close(got, want, msg=lambda m, op=op: f"{op}: {m}")


def test_slater_determinant_laplacian_per_sample():
    """A VMC kinetic energy: Δ log|det Φ| and ∇ log|det Φ| per sample of electrons (B, n, 3), and
    its gradient in the orbitals' parameters through loss.backward(). The reference is a loop of
    jacrev∘jacrev per sample: torch.func's vmap(hessian) through slogdet is wrong for every
    sample but the first (torch 2.13)."""
    from torch.func import functional_call, jacrev

    n = 3
    orbitals = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, n)).double()
    R = rand(4, n, 3, seed=59)

    def log_psi(r, params=None):
        phi = orbitals(r) if params is None else functional_call(orbitals, params, (r,))
        return torch.linalg.slogdet(phi * torch.exp(-r.norm(dim=-1, keepdim=True)))[1]

    def kinetic(lap, grad):
        return -0.5 * (lap + (grad ** 2).sum((-1, -2)))

    out = hoad.laplacian(log_psi, batch_dim=0, backend="eager")(R)
    kinetic(out.laplacian, out.gradient).mean().backward()

    def reference(params):
        one = lambda r: log_psi(r, params)  # noqa: E731
        flat = lambda y: one(y.reshape(n, 3))  # noqa: E731
        lap = torch.stack([jacrev(jacrev(flat))(r.reshape(-1)).diagonal().sum() for r in R])
        grad = torch.stack([jacrev(one)(r) for r in R])
        return lap, grad, kinetic(lap, grad).mean()

    params = {k: p.detach() for k, p in orbitals.named_parameters()}
    lap, grad, _ = reference(params)
    torch.testing.assert_close(out.laplacian, lap, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out.gradient, grad, rtol=1e-9, atol=1e-9)
    want = torch.func.grad(lambda ps: reference(ps)[2])(params)
    for k, p in orbitals.named_parameters():
        torch.testing.assert_close(p.grad, want[k], rtol=1e-8, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")


def _exp_of_a_curved_matrix(X):
    """exp of a matrix whose entries are quadratic in X (B, 3): A's second derivatives are not 0."""
    A0 = torch.tensor([[0.1, -0.3, 0.2], [0.4, 0.0, -0.1], [-0.2, 0.3, 0.1]], dtype=X.dtype)
    M = A0 + torch.diag_embed(X.sin()) + X[..., :1, None] * X[..., None, 1:2]
    return torch.linalg.matrix_exp(M).sum((-1, -2))


@pytest.mark.slow  # (9 s of the default suite's 10 minutes; matrix_exp runs per sample in test_batch)
def test_matrix_exp_under_the_operators():
    """Pure derivatives, collapsed jets and the Laplacian of exp(A(x)), per sample. The collapsed
    top order of A entered Mathias' block matrix without its direction axes (a HoadInternalError
    for any A curved in x), the sample axis was untied under a collapse (a false
    BatchCouplingError), and in diagonal mode the block matrix was formed for every tuple of
    directions instead of once per direction."""
    from torch.func import hessian, jacfwd, vmap

    u = _exp_of_a_curved_matrix
    one = lambda x: u(x[None])[0]  # noqa: E731
    X = rand(4, 3, seed=60)
    V = rand(5, 3, seed=61)
    w = rand(5, seed=62)
    H = vmap(hessian(one))(X)
    T3 = vmap(jacfwd(hessian(one)))(X)
    T4 = vmap(jacfwd(jacfwd(hessian(one))))(X)
    lap = H.diagonal(0, -2, -1).sum(-1)
    for mode in ("forward", "reverse"):  # (reverse: the top order from the adjoint, below it the rule)
        assert_close(hoad.laplacian(u, batch_dim=0, backend="eager", mode=mode)(X).laplacian, lap, f"Laplacian, {mode}")
    assert_close(hoad.laplacian(one, backend="eager")(X[0]).laplacian, lap[0], "Laplacian, one point")
    pure = hoad.compile(u, order=3, batch_dim=0, diagonal=True, backend="eager", mode="forward")(X)
    assert_close(pure[0, 0, 0], torch.stack([T3[:, i, i, i] for i in range(3)], -1), "pure third derivatives")
    along = torch.einsum("nabc,sa,sb,sc->ns", T3, V, V, V)
    jets = hoad.taylor(u, order=3, directions=V, batch_dim=0, backend="eager", mode="forward")(X)
    assert_close(jets[3], along, "third-order jets")
    collapsed = hoad.taylor(u, order=3, directions=V, weights=w, collapse=True, batch_dim=0, backend="eager",
                            mode="forward")(X)
    assert_close(collapsed[3], along @ w, "collapsed third-order jets")
    biharmonic = sum(T4[:, i, i, j, j] for i in range(3) for j in range(3))
    assert_close(hoad.biharmonic(u, batch_dim=0, backend="eager", mode="forward")(X).biharmonic, biharmonic,
                 "biharmonic")
    # a matrix per sample, itself the input: A's diagonal first-order block, written out inside the
    # Laplacian's program, was a scatter along the samples to the biharmonic's (a BatchCouplingError)
    g = lambda M: torch.linalg.matrix_exp(M + 0.1 * M ** 2).sum((-1, -2))  # noqa: E731
    M = 0.1 * rand(2, 3, 3, seed=65)
    flat = lambda v: g(v.reshape(1, 3, 3))[0]  # noqa: E731
    T4 = torch.stack([jacfwd(jacfwd(jacfwd(jacfwd(flat))))(m.reshape(-1)) for m in M])
    assert_close(hoad.biharmonic(g, batch_dim=0, backend="eager")(M).biharmonic, torch.einsum("biijj->b", T4),
                 "biharmonic of a matrix per sample")


def test_matrix_exp_in_diagonal_mode_forms_one_block_matrix_per_direction():
    """The jets of 20 directions at order 3: 20 block matrices of 8 × 3 rows per sample, not 20³
    (under packed=True, 25 entries at order 3 planned 582.7 TiB)."""
    u = _exp_of_a_curved_matrix
    V = rand(20, 3, seed=63)
    jets = hoad.taylor(u, order=3, directions=V, batch_dim=0, backend="eager")
    X = rand(2, 3, seed=64)
    jets(X)
    exps = [n for n in jets.graph.module.graph.nodes if "matrix_exp" in str(n.target)]
    assert exps, "no matrix_exp in the program"
    biggest = max(math.prod(n.meta["val"].shape) for n in exps)
    assert biggest <= 2 * 20 * 24 * 24, f"a block matrix of {biggest} entries"
