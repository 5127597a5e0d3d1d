"""The ``hoad_linalg`` operators: torch.linalg as single-output ops, with their autograd.

The adjoint form needs a single-output node for every nonlinear op, while torch's factorizing
ops return tuples; capture routes them here (:mod:`hoad.passes.linalg_routes`). Each operator
runs torch's own kernel and has a fake kernel and an autograd formula, so results stay
differentiable for training: ``inv``, ``solve``, ``logabsdet`` and ``cholesky``, and the
factorizations' ``eigvalsh``, ``eigvecsh``, ``svdvals``, ``svd_u``, ``svd_vh``, ``qr_q``, ``qr_r``,
``lu_packed``, ``pinv`` and ``matrix_exp`` (with ``lu_pivots`` and ``lu_permutation``, which
carry no derivatives), whose first-order cotangents in plain torch are here too. Their derivative
rules of every order are in :mod:`hoad.rules.linalg` and :mod:`hoad.rules.factorizations`.
"""

from __future__ import annotations

import math

import torch

from hoad.algebra.block import _eye


def _phi(n: int, like: torch.Tensor) -> torch.Tensor:
    """The mask of Φ: 1 below the diagonal, 1/2 on it, 0 above."""
    ones = torch.ones(n, n, dtype=like.dtype, device=like.device)
    return ones.tril(-1) + 0.5 * _eye(n, like)


# ------------------------------------------------------ inverse, solve, log|det| and Cholesky
@torch.library.custom_op("hoad_linalg::inv", mutates_args=())
def inv(A: torch.Tensor) -> torch.Tensor:
    """A⁻¹ over the last two axes (torch.linalg.inv: raises on a singular matrix)."""
    return torch.linalg.inv(A).contiguous()


@torch.library.custom_op("hoad_linalg::solve", mutates_args=())
def solve(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """X with A X = B: A (…, n, n), B (…, n, k), the same batch axes."""
    return torch.linalg.solve(A, B).contiguous()


@torch.library.custom_op("hoad_linalg::logabsdet", mutates_args=())
def logabsdet(A: torch.Tensor) -> torch.Tensor:
    """log|det A| over the last two axes."""
    return torch.linalg.slogdet(A)[1].contiguous()


@torch.library.custom_op("hoad_linalg::cholesky", mutates_args=())
def cholesky(A: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """torch.linalg.cholesky (aten.cholesky computes the same but warns that it is deprecated)."""
    return torch.linalg.cholesky(A, upper=upper).contiguous()


@cholesky.register_fake
def _cholesky_shape(A, upper=False):
    return torch.empty_like(A, memory_format=torch.contiguous_format)


@inv.register_fake
def _inv_shape(A):
    return torch.empty_like(A, memory_format=torch.contiguous_format)


@solve.register_fake
def _solve_shape(A, B):
    return torch.empty_like(B, memory_format=torch.contiguous_format)


@logabsdet.register_fake
def _logabsdet_shape(A):
    return A.new_empty(A.shape[:-2])


# autograd formulas in differentiable ops, so programs that contain these ops train
def _save_out(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output)


def _inv_backward(ctx, g):
    _A, X = ctx.saved_tensors
    return -(X.mT @ g @ X.mT)


def _solve_backward(ctx, g):
    A, _B, X = ctx.saved_tensors
    gB = torch.ops.hoad_linalg.solve(A.mT.contiguous(), g.contiguous())
    return -(gB @ X.mT), gB


def _logabsdet_backward(ctx, g):
    A, _ = ctx.saved_tensors
    return g[..., None, None] * torch.ops.hoad_linalg.inv(A).mT


def _save_cholesky(ctx, inputs, output):
    ctx.upper = inputs[1]
    ctx.save_for_backward(output)


def _cholesky_backward(ctx, g):
    """ḡ_A = sym(L⁻ᵀ Φ(Lᵀ ḡ_L) L⁻¹), as :func:`cholesky_vjp`."""
    (out,) = ctx.saved_tensors
    L, gL = (out.mT, g.mT) if ctx.upper else (out, g)
    n = L.shape[-1]
    Linv = torch.linalg.solve_triangular(L, _eye(n, L), upper=False)
    Q = Linv.mT @ ((L.mT @ gL) * _phi(n, L)) @ Linv
    return 0.5 * (Q + Q.mT), None


cholesky.register_autograd(_cholesky_backward, setup_context=_save_cholesky)
inv.register_autograd(_inv_backward, setup_context=_save_out)
solve.register_autograd(_solve_backward, setup_context=_save_out)
logabsdet.register_autograd(_logabsdet_backward, setup_context=_save_out)


# ------------------------------------------------------------------------- the factorizations
@torch.library.custom_op("hoad_linalg::eigvalsh", mutates_args=())
def eigvalsh(A: torch.Tensor, UPLO: str = "L") -> torch.Tensor:
    """Eigenvalues of a symmetric matrix, ascending (torch.linalg.eigh's first output)."""
    return torch.linalg.eigh(A, UPLO=UPLO)[0].contiguous()


@torch.library.custom_op("hoad_linalg::eigvecsh", mutates_args=())
def eigvecsh(A: torch.Tensor, UPLO: str = "L") -> torch.Tensor:
    """Eigenvectors of a symmetric matrix, columns in the order of :func:`eigvalsh`, torch's signs."""
    return torch.linalg.eigh(A, UPLO=UPLO)[1].contiguous()


@torch.library.custom_op("hoad_linalg::svdvals", mutates_args=())
def svdvals(A: torch.Tensor) -> torch.Tensor:
    """Singular values, descending."""
    return torch.linalg.svd(A, full_matrices=False)[1].contiguous()


@torch.library.custom_op("hoad_linalg::svd_u", mutates_args=())
def svd_u(A: torch.Tensor) -> torch.Tensor:
    """The left singular vectors of the reduced SVD (m x min(m, n)), torch's signs."""
    return torch.linalg.svd(A, full_matrices=False)[0].contiguous()


@torch.library.custom_op("hoad_linalg::svd_vh", mutates_args=())
def svd_vh(A: torch.Tensor) -> torch.Tensor:
    """The right singular vectors of the reduced SVD, transposed (min(m, n) x n), torch's signs."""
    return torch.linalg.svd(A, full_matrices=False)[2].contiguous()


@torch.library.custom_op("hoad_linalg::qr_q", mutates_args=())
def qr_q(A: torch.Tensor) -> torch.Tensor:
    """Q of the reduced QR decomposition (m x min(m, n))."""
    return torch.linalg.qr(A, mode="reduced")[0].contiguous()


@torch.library.custom_op("hoad_linalg::qr_r", mutates_args=())
def qr_r(A: torch.Tensor) -> torch.Tensor:
    """R of the reduced QR decomposition (min(m, n) x n)."""
    return torch.linalg.qr(A, mode="reduced")[1].contiguous()


@torch.library.custom_op("hoad_linalg::lu_packed", mutates_args=())
def lu_packed(A: torch.Tensor) -> torch.Tensor:
    """The LU factors with partial pivoting packed in one matrix (torch.linalg.lu_factor's LU)."""
    return torch.linalg.lu_factor_ex(A)[0].contiguous()


@torch.library.custom_op("hoad_linalg::lu_pivots", mutates_args=())
def lu_pivots(A: torch.Tensor) -> torch.Tensor:
    """The pivots of :func:`lu_packed` (int32, 1-based, LAPACK's convention)."""
    return torch.linalg.lu_factor_ex(A)[1].contiguous()


@torch.library.custom_op("hoad_linalg::lu_permutation", mutates_args=())
def lu_permutation(pivots: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """P with A = P L U for the ``pivots`` of an LU of an m x n matrix ``like`` (m x m, like's dtype)."""
    return torch.lu_unpack(like, pivots, unpack_data=False)[0].contiguous()


@torch.library.custom_op("hoad_linalg::pinv", mutates_args=())
def pinv(A: torch.Tensor, atol: torch.Tensor | None = None, rtol: torch.Tensor | None = None,
         hermitian: bool = False) -> torch.Tensor:
    """torch.linalg.pinv (singular values at or below max(atol, rtol·σ_max) are dropped)."""
    return torch.linalg.pinv(A, atol=atol, rtol=rtol, hermitian=hermitian).contiguous()


@torch.library.custom_op("hoad_linalg::matrix_exp", mutates_args=())
def matrix_exp(A: torch.Tensor) -> torch.Tensor:
    """torch.linalg.matrix_exp as an op of hoad's own: Inductor's C++ wrapper cannot call
    aten.linalg_matrix_exp (its dispatcher fallback fails), it calls custom ops."""
    return torch.linalg.matrix_exp(A).contiguous()


def _same_shape(A, *args, **kwargs):
    return torch.empty_like(A, memory_format=torch.contiguous_format)


def _vector_shape(A, UPLO="L"):
    return A.new_empty(A.shape[:-1])


def _k(A) -> int:
    return min(A.shape[-2], A.shape[-1])


eigvalsh.register_fake(_vector_shape)
matrix_exp.register_fake(_same_shape)
eigvecsh.register_fake(_same_shape)
lu_packed.register_fake(_same_shape)
svdvals.register_fake(lambda A: A.new_empty(A.shape[:-2] + (_k(A),)))
svd_u.register_fake(lambda A: A.new_empty(A.shape[:-1] + (_k(A),)))
svd_vh.register_fake(lambda A: A.new_empty(A.shape[:-2] + (_k(A), A.shape[-1])))
qr_q.register_fake(lambda A: A.new_empty(A.shape[:-1] + (_k(A),)))
qr_r.register_fake(lambda A: A.new_empty(A.shape[:-2] + (_k(A), A.shape[-1])))
lu_pivots.register_fake(lambda A: A.new_empty(A.shape[:-2] + (_k(A),), dtype=torch.int32))
lu_permutation.register_fake(lambda pivots, like: like.new_empty(like.shape[:-1] + (like.shape[-2],)))
pinv.register_fake(lambda A, atol=None, rtol=None, hermitian=False:
                   A.new_empty(A.shape[:-2] + (A.shape[-1], A.shape[-2])))


# ------------------------------------------------------------------- cotangents (plain torch)
# Each takes the op's input and the cotangent of its output, batch axes broadcasting in front,
# and calls the operators above, so the result is itself differentiable (training through
# derivatives). The VJP rules (hoad.rules.factorizations) run them on the program output's axes.
def _sym(X):
    return 0.5 * (X + X.mT)


def _gap_inverse(lam):
    """F_ij = 1 / (λ_j − λ_i) off the diagonal, 0 on it."""
    n = lam.shape[-1]
    eye = _eye(n, lam)
    return (1 - eye) / (lam.unsqueeze(-2) - lam.unsqueeze(-1) + eye)


def eigvalsh_grad(A, g, UPLO="L"):
    Q = torch.ops.hoad_linalg.eigvecsh(A, UPLO)
    return (Q * g.unsqueeze(-2)) @ Q.mT


def eigvecsh_grad(A, g, UPLO="L"):
    Q = torch.ops.hoad_linalg.eigvecsh(A, UPLO)
    F = _gap_inverse(torch.ops.hoad_linalg.eigvalsh(A, UPLO))
    return _sym(Q @ (F * (Q.mT @ g)) @ Q.mT)


def _svd_grad(A, gU, gS, gVh):
    """The reduced SVD's cotangent (Townsend, "Differentiating the singular value decomposition"):
    U[(F∘(UᵀḡU − ḡUᵀU))S + diag(ḡS) + S(F∘(VᵀḡV − ḡVᵀV))]Vᵀ + (I − UUᵀ)ḡU S⁻¹Vᵀ + U S⁻¹ḡVᵀ(I − VVᵀ),
    F_ij = 1/(s_j² − s_i²); absent cotangents are zero."""
    U, S, Vh = (torch.ops.hoad_linalg.svd_u(A), torch.ops.hoad_linalg.svdvals(A), torch.ops.hoad_linalg.svd_vh(A))
    V = Vh.mT
    F = _gap_inverse(S * S)
    terms, extra = [], 0
    if gS is not None:
        terms.append(torch.diag_embed(gS))
    if gU is not None:
        J = U.mT @ gU
        terms.append((F * (J - J.mT)) * S.unsqueeze(-2))
        if A.shape[-2] > A.shape[-1]:
            extra = extra + ((gU - U @ J) / S.unsqueeze(-2)) @ Vh
    if gVh is not None:
        gV = gVh.mT
        K = V.mT @ gV
        terms.append(S.unsqueeze(-1) * (F * (K - K.mT)))
        if A.shape[-1] > A.shape[-2]:
            extra = extra + (U / S.unsqueeze(-2)) @ (gV - V @ K).mT
    inner = terms[0]
    for t in terms[1:]:
        inner = inner + t
    return U @ inner @ Vh + extra


def svdvals_grad(A, g):
    return _svd_grad(A, None, g, None)


def svd_u_grad(A, g):
    return _svd_grad(A, g, None, None)


def svd_vh_grad(A, g):
    return _svd_grad(A, None, None, g)


def _qr_grad(A, gQ, gR):
    """m >= n: Ā = (ḡQ + Q copyltu(M)) R⁻ᵀ, M = R ḡRᵀ − ḡQᵀ Q, copyltu(M) = tril(M) + tril(M, −1)ᵀ;
    m < n: the square part A1 = Q R1 as above with ḡQ + A2 ḡR2ᵀ, and Ā2 = Q ḡR2."""
    Q, R = torch.ops.hoad_linalg.qr_q(A), torch.ops.hoad_linalg.qr_r(A)
    m, n = A.shape[-2], A.shape[-1]
    if gQ is None:
        gQ = torch.zeros_like(Q)
    if gR is None:
        gR = torch.zeros_like(R)
    if m < n:
        A2, gR1, gR2 = A[..., m:], gR[..., :m], gR[..., m:]
        gA1 = _qr_square_grad(Q, R[..., :m], gQ + A2 @ gR2.mT, gR1)
        return torch.cat([gA1, Q @ gR2], -1)
    return _qr_square_grad(Q, R, gQ, gR)


def _qr_square_grad(Q, R, gQ, gR):
    M = R @ gR.mT - gQ.mT @ Q
    M = M.tril() + M.tril(-1).mT
    B = gQ + Q @ M
    return torch.linalg.solve_triangular(R, B.mT, upper=True).mT


def qr_q_grad(A, g):
    return _qr_grad(A, g, None)


def qr_r_grad(A, g):
    return _qr_grad(A, None, g)


def lu_packed_grad(A, g):
    """PᵀA = L U: Ā = P L⁻ᵀ (tril(Lᵀ ḡL, −1) + triu(ḡU Uᵀ)) U⁻ᵀ on the leading square, ḡL and ḡU
    the strict lower and the upper part of the cotangent of the packed factors; the trapezoidal
    rest (L2 = Ã2 U1⁻¹ when m > n, U2 = L1⁻¹ Ã12 when m < n) adds its own term and one to Φ."""
    LU = torch.ops.hoad_linalg.lu_packed(A)
    P = torch.ops.hoad_linalg.lu_permutation(torch.ops.hoad_linalg.lu_pivots(A.detach()), LU.detach())
    m, n = A.shape[-2], A.shape[-1]
    k = min(m, n)
    L = LU[..., :, :k].tril(-1) + _eye(m, A)[:, :k]
    U = LU[..., :k, :].triu()
    gL, gU = g[..., :, :k].tril(-1), g[..., :k, :].triu()
    L1, U1 = L[..., :k, :], U[..., :, :k]
    phi = (L1.mT @ gL[..., :k, :]).tril(-1) + (gU[..., :, :k] @ U1.mT).triu()
    if m > n:  # L2 = Ã2 U⁻¹: its cotangent adds to Ã2 and to U
        L2, gL2 = L[..., k:, :], gL[..., k:, :]
        phi = phi - (L2.mT @ gL2).triu()
    if n > m:
        U2, gU2 = U[..., :, k:], gU[..., :, k:]
        phi = phi - (gU2 @ U2.mT).tril(-1)
    X = torch.linalg.solve_triangular(L1.mT, phi, upper=True, unitriangular=True)
    X = torch.linalg.solve_triangular(U1.mT, X, upper=False, left=False)
    if m > n:
        gA = torch.cat([X, torch.linalg.solve_triangular(U1.mT, gL[..., k:, :], upper=False, left=False)], -2)
    elif n > m:
        gA = torch.cat([X, torch.linalg.solve_triangular(L1.mT, gU[..., :, k:], upper=True, unitriangular=True)], -1)
    else:
        gA = X
    return P @ gA


def pinv_grad(A, g, atol=None, rtol=None, hermitian=False):
    """Adjoint of D X = −X DA X + X Xᵀ DAᵀ (I − A X) + (I − X A) DAᵀ Xᵀ X."""
    X = torch.ops.hoad_linalg.pinv(A, atol, rtol, hermitian) * _pinv_checked(A, atol, rtol, hermitian)
    Pm = _eye(A.shape[-2], A) - A @ X
    Pn = _eye(A.shape[-1], A) - X @ A
    return -(X.mT @ g @ X.mT) + (Pm @ g.mT @ X @ X.mT) + (X.mT @ X @ g.mT @ Pn)


def matrix_exp_grad(A: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Ā = D exp(Aᵀ)[ḡ], the upper-right block of exp([[Aᵀ, ḡ], [0, Aᵀ]])."""
    At = A.mT.expand(g.shape)
    n = A.shape[-1]
    top = torch.cat([At, g], -1)
    bottom = torch.cat([torch.zeros_like(At), At], -1)
    return torch.ops.hoad_linalg.matrix_exp(torch.cat([top, bottom], -2))[..., :n, n:]


def _pinv_checked(A, atol=None, rtol=None, hermitian=False):
    """1, or NaN where the derivatives of torch's pinv are not those of A⁺ at constant rank: some
    singular value it drops is not numerically zero (> √eps·σ_max) while it keeps others. (With
    none kept the pinv is 0 near A; with all nonzero ones kept it is A⁺.) Shape: A's batch, 1, 1."""
    S = torch.linalg.svdvals(A.detach())
    m, n = A.shape[-2], A.shape[-1]
    smax = S[..., :1]
    eps = torch.finfo(A.dtype).eps
    if rtol is None:
        rtol_v = torch.zeros((), dtype=A.dtype, device=A.device) + eps * max(m, n)
        if atol is not None:
            rtol_v = torch.where(atol > 0, torch.zeros_like(rtol_v), rtol_v)
    else:
        rtol_v = rtol.to(A.dtype)
    atol_v = torch.zeros((), dtype=A.dtype, device=A.device) if atol is None else atol.to(A.dtype)
    cutoff = torch.maximum(atol_v.unsqueeze(-1) if atol_v.ndim else atol_v,
                           (rtol_v.unsqueeze(-1) if rtol_v.ndim else rtol_v) * smax)
    kept = S > cutoff
    dropped_nonzero = (~kept) & (S > math.sqrt(eps) * smax)
    bad = dropped_nonzero.any(-1) & kept.any(-1)
    one = torch.ones((), dtype=A.dtype, device=A.device)
    return torch.where(bad, one * math.nan, one)[..., None, None]


def _with_cotangent(fn):
    def backward(ctx, g):
        return (fn(*ctx.saved_tensors, g, *ctx.extra),) + (None,) * len(ctx.extra)

    return backward


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.extra = tuple(inputs[1:])


def _pinv_backward(ctx, g):
    A, atol, rtol = ctx.saved_tensors
    return pinv_grad(A, g, atol, rtol, ctx.hermitian), None, None, None


def _save_pinv(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])
    ctx.hermitian = inputs[3]


for _op, _grad in ((eigvalsh, eigvalsh_grad), (eigvecsh, eigvecsh_grad), (svdvals, svdvals_grad),
                   (svd_u, svd_u_grad), (svd_vh, svd_vh_grad), (qr_q, qr_q_grad), (qr_r, qr_r_grad),
                   (lu_packed, lu_packed_grad)):
    _op.register_autograd(_with_cotangent(_grad), setup_context=_save_input)
pinv.register_autograd(_pinv_backward, setup_context=_save_pinv)
matrix_exp.register_autograd(_with_cotangent(lambda A, g: matrix_exp_grad(A, g)), setup_context=_save_input)
# P is piecewise constant: no cotangent reaches the pivots or the factors it was read from
lu_permutation.register_autograd(lambda ctx, g: (None, None), setup_context=lambda ctx, inputs, output: None)
