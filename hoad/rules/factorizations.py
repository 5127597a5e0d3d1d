"""Matrix factorizations: symmetric eigendecomposition, SVD, QR, LU, pseudo-inverse, every order.

Each factorization is a set of single-output ``hoad_linalg`` operators (the adjoint form needs
one output per nonlinear node; capture routes torch's tuple-returning ops to them, see
``CAPTURE_DECOMPOSITIONS`` in :mod:`hoad.rules.linalg`). Their values are torch's own kernels',
sign conventions included; their derivative blocks come from differentiating the defining
equations K times with Leibniz, order by order, so every order and every mixed block comes from
the same few lines. At order K the terms that read no order-K block of a factor are collected
(``leibniz`` skips them by itself while the factor has no order-K block yet), and the order-K
blocks solve a small linear system:

- eigh, A = Q Λ Qᵀ (symmetric part of A): with M = Qᵀ(Σ_{K1≠∅} D^{K1}A D^{K∖K1}Q − Σ D^{K1}Q D^{K2}Λ),
  N = Σ D^{K1}Qᵀ D^{K2}Q (both parts ≠ ∅): D^K λ_i = M_ii and D^K Q = Q C with
  C_ij = M_ij / (λ_j − λ_i) (i ≠ j), C_ii = −N_ii / 2;
- SVD, A = U S Vᵀ (m ≥ n, else of Aᵀ): the eigendecomposition of B = AᵀA gives V and λ = S²,
  then S = √λ and U = A V diag(λ^{-1/2}) by Faà di Bruno and Leibniz;
- QR, A = Q R (m ≥ n): with Y = (D^K A − Σ D^{K1}Q D^{K2}R) R⁻¹, M = QᵀY and N as above,
  C = tril(M, −1) − (triu(N, 1) + triu(Mᵀ, 1)) − diag(N)/2, T = M − C: D^K R = T R, D^K Q = Y − Q T;
- LU, PᵀA = L U (P constant): with S = PᵀD^K A − Σ D^{K1}L D^{K2}U and M = L⁻¹ S U⁻¹ on the
  leading square, D^K L = L tril(M, −1), D^K U = triu(M) U (the trapezoidal rest by one solve);
- pseudo-inverse X = A⁺ at constant rank: D X = −X DA X + X Xᵀ DAᵀ (I − A X) + (I − X A) DAᵀ Xᵀ X,
  a polynomial in A, X and DA, so D^K X = D^{K∖{first slot}} of it by Leibniz;
- matrix exponential: Mathias' block-triangular form, one matrix exponential per block (below).

Preconditions (the derivatives do not exist otherwise, and values cannot be inspected at trace
time): distinct eigenvalues (eigh) and distinct nonzero singular values (SVD) at the point, full
rank for QR and LU (nonzero pivots), constant rank for the pseudo-inverse. The formulas divide by
eigenvalue gaps and pivots: an exact tie gives inf or NaN, a near tie the huge derivatives the
function has there. The pseudo-inverse checks its own precondition at run time (NaN blocks where
torch's cutoff drops a singular value that is not zero while keeping others).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import torch

from hoad.algebra import Block, add, contract, force, map_out
from hoad.algebra.block import _canonical
from hoad.algebra.maps import along
from hoad.algebra.multiindex import closure
from hoad.rules.base import Ctx, Jet, RuleTable
from hoad.rules.combinators import chain, leibniz, scaled, sum_blocks

aten = torch.ops.aten
RULES = RuleTable("factorizations")
VJPS = RuleTable("factorizations")


def _eye(n: int, like: torch.Tensor) -> torch.Tensor:
    idx = torch.arange(n, device=like.device)
    return (idx.unsqueeze(1) == idx).to(like.dtype)


# --------------------------------------------------------------------- single-output operators
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
# derivatives). The VJP rules below run the same functions on the program output's axes.
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


# ------------------------------------------------------------------------------ jet helpers
def _labels(nb: int):
    b = [("b", d) for d in range(nb)]
    return b, ("m", 0), ("m", 1), ("m", 2)


def _level(ctx: Ctx, keys, k: int) -> Ctx:
    return replace(ctx, keys=tuple(K for K in keys if len(K) == k))


def _inner(ctx: Ctx, out) -> Ctx:
    """Every block up to the top order, no adjoint: the factors' jets are intermediate values."""
    return replace(ctx.inner(out), keys=tuple(closure(ctx.keys)))


def _mul(level: Ctx, x: Jet, lx, y: Jet, ly, lo, shape) -> dict:
    """Blocks of the product of two matrix jets, evaluated (recurrences read each several times)."""
    return {K: force(v) for K, v in leibniz(level, [(x, lx), (y, ly)], lo, shape).items()}


def _const(M: torch.Tensor) -> Jet:
    return Jet(M)


def _sub(a: dict, b: dict) -> dict:
    return sum_blocks(a, {K: v.neg() for K, v in b.items()})


def _masked(level: Ctx, blocks: dict, mask, like: torch.Tensor) -> dict:
    return scaled(level, Jet(like, blocks), mask, tuple(like.shape))


def _transposed(blocks: dict, r: int) -> dict:
    """Each block with the last two output axes swapped."""
    out = {}
    for K, blk in blocks.items():
        perm = list(range(r - 2)) + [r - 1, r - 2] + list(range(r, blk.ndim))
        out[K] = blk.permute(perm)
    return out


def _diagonal(blocks: dict, r: int) -> dict:
    """The diagonal of the last two output axes: (…, n, n) -> (…, n)."""
    def fn(t):
        return torch.diagonal(t, 0, r - 2, r - 1).movedim(-1, r - 2)

    batch = {a: a for a in range(r - 2)}  # acted on one matrix at a time: samples stay apart
    return {K: map_out(blk, r, fn, list(blk.shape[:r - 1]), batch) for K, blk in blocks.items()}


def _forced(blocks: dict, top: int) -> dict:
    return {K: force(b) if len(K) < top else b for K, b in blocks.items()}


def _result(ctx: Ctx, blocks: dict) -> dict:
    return {K: blocks[K] for K in ctx.keys if K in blocks}


def _transposed_jet(A: Jet) -> Jet:
    return Jet(A.primal.mT, _transposed(A.blocks, A.ndim), A.varies)


def _symmetric(A: Jet) -> Jet:
    """(A + Aᵀ)/2: the eigendecomposition's derivatives are those of the symmetric part."""
    r = A.ndim
    T = _transposed(A.blocks, r)
    return Jet(A.primal, {K: add([b, T[K]]).scale(0.5) for K, b in A.blocks.items()}, A.varies)


# --------------------------------------------------------------------------- eigh recurrence
def eigh_jets(inner: Ctx, B: Jet, lam: torch.Tensor, Q: torch.Tensor) -> tuple[dict, dict]:
    """Blocks of λ and Q (every key of ``inner``) for a symmetric B = Q diag(λ) Qᵀ."""
    nb = Q.ndim - 2
    b, i, k, j = _labels(nb)
    shape = tuple(Q.shape)
    n = Q.shape[-1]
    F = _gap_inverse(lam)
    half = -0.5 * _eye(n, Q)
    q, l = Jet(Q, {}), Jet(lam, {})
    keys = inner.keys
    top = max((len(K) for K in keys), default=0)
    for order in range(1, top + 1):
        level = _level(inner, keys, order)
        if not level.keys:
            continue
        R = _sub(_mul(level, B, b + [i, k], q, b + [k, j], b + [i, j], shape),
                 _mul(level, q, b + [i, j], l, b + [j], b + [i, j], shape))
        M = _mul(level, _const(Q), b + [k, i], Jet(Q, R), b + [k, j], b + [i, j], shape)
        N = _mul(level, q, b + [k, i], q, b + [k, j], b + [i, j], shape)
        C = sum_blocks(_masked(level, M, F, Q), _masked(level, N, half, Q))
        l.blocks.update(_forced(_diagonal(M, Q.ndim), top))
        q.blocks.update(_forced(_mul(level, _const(Q), b + [i, k], Jet(Q, C), b + [k, j], b + [i, j], shape), top))
    return l.blocks, q.blocks


def _eigh_rule(ctx: Ctx, A, UPLO: str, part: int):
    lam, Q = torch.linalg.eigh(A.primal, UPLO=UPLO)
    inner = _inner(ctx, ctx.out)
    blocks = eigh_jets(inner, _symmetric(A), lam, Q)[part]
    return _result(ctx, blocks)


@RULES.register(torch.ops.hoad_linalg.eigvalsh.default)
def eigvalsh_rule(ctx: Ctx, A: Jet, UPLO: str = "L"):
    return _eigh_rule(ctx, A, UPLO, 0)


@RULES.register(torch.ops.hoad_linalg.eigvecsh.default)
def eigvecsh_rule(ctx: Ctx, A: Jet, UPLO: str = "L"):
    return _eigh_rule(ctx, A, UPLO, 1)


# ---------------------------------------------------------------------------- SVD recurrence
def _power_coeffs(x: torch.Tensor, p: float, top: int) -> list:
    """d^m/dλ^m λ^p at λ = x, m = 1..top."""
    coeffs, c = [], 1.0
    for m in range(1, top + 1):
        c *= p - (m - 1)
        coeffs.append(c * x ** (p - m))
    return coeffs


def svd_jets(ctx: Ctx, A: Jet, part: str) -> dict:
    """Blocks of the reduced SVD's ``part`` ("U", "S" or "Vh"; every key of ``closure(ctx.keys)``),
    for torch's own factors (their signs: those of svd(Aᵀ) may differ)."""
    U, S, Vh = torch.linalg.svd(A.primal, full_matrices=False)
    if A.shape[-2] < A.shape[-1]:  # Aᵀ = V S Uᵀ
        swapped = {"U": "V", "S": "S", "Vh": "U"}[part]
        blocks = _tall_svd_jets(ctx, _transposed_jet(A), Vh.mT, S, U, swapped)
        return blocks if part == "S" else _transposed(blocks, A.ndim)
    blocks = _tall_svd_jets(ctx, A, U, S, Vh.mT, "V" if part == "Vh" else part)
    return _transposed(blocks, A.ndim) if part == "Vh" else blocks


def _tall_svd_jets(ctx: Ctx, A: Jet, U, S, V, part: str) -> dict:
    """Blocks of ``part`` ("U", "S" or "V") of A = U S Vᵀ, m >= n: V and λ = S² from the
    eigendecomposition of AᵀA, then S = √λ, U = A V diag(λ^{-1/2})."""
    inner = _inner(ctx, U)
    nb = A.ndim - 2
    b, i, k, j = _labels(nb)
    lam = S * S
    B = Jet(lam, _mul(inner, A, b + [k, i], A, b + [k, j], b + [i, j], tuple(V.shape)))
    lam_blocks, v_blocks = eigh_jets(inner, B, lam, V)
    if part == "V":
        return v_blocks
    top = max((len(K) for K in inner.keys), default=0)
    lam_jet = Jet(lam, lam_blocks)
    if part == "S":
        return chain(inner, lam_jet, _power_coeffs(lam, 0.5, top))
    rs = Jet(1 / S, chain(inner, lam_jet, _power_coeffs(lam, -0.5, top)))
    return leibniz(inner, [(A, b + [i, k]), (Jet(V, v_blocks), b + [k, j]), (rs, b + [j])], b + [i, j],
                   tuple(U.shape))


@RULES.register(torch.ops.hoad_linalg.svd_u.default)
def svd_u_rule(ctx: Ctx, A: Jet):
    return _result(ctx, svd_jets(ctx, A, "U"))


@RULES.register(torch.ops.hoad_linalg.svdvals.default)
def svdvals_rule(ctx: Ctx, A: Jet):
    return _result(ctx, svd_jets(ctx, A, "S"))


@RULES.register(torch.ops.hoad_linalg.svd_vh.default)
def svd_vh_rule(ctx: Ctx, A: Jet):
    return _result(ctx, svd_jets(ctx, A, "Vh"))


# ----------------------------------------------------------------------------- VJP wrappers
def _on_rest(g: Block, r: int, fn, new_out, nb: int) -> Block:
    """``fn`` (a cotangent formula over batch axes) applied to every program-output entry of a
    cotangent block: those axes move in front as batch axes and back after. The ``nb`` batch
    axes of the matrices keep their ties (one matrix per sample under batch_dim stays one)."""
    def on_entries(t):
        rest = t.ndim - r
        res = fn(t.movedim(list(range(r, t.ndim)), list(range(rest))))
        return res.movedim(list(range(rest)), list(range(res.ndim - rest, res.ndim)))

    return map_out(g, r, on_entries, list(new_out), {a: a for a in range(nb)})


def _value(x):
    """A tensor argument's value (the tolerances of pinv are never differentiated)."""
    return x.primal if isinstance(x, Jet) else x


def _vjp_of(grad):
    def vjp(v, g: Block, A: Jet, *args, **kwargs):
        args = [_value(a) for a in args]
        kwargs = {key: _value(a) for key, a in kwargs.items()}
        return [(A, _on_rest(g, v.out.ndim, lambda t: grad(A.primal, t, *args, **kwargs), A.shape, A.ndim - 2))]

    vjp.__name__ = grad.__name__.replace("_grad", "_vjp")
    return vjp


for _op, _grad in ((torch.ops.hoad_linalg.eigvalsh.default, eigvalsh_grad),
                   (torch.ops.hoad_linalg.eigvecsh.default, eigvecsh_grad),
                   (torch.ops.hoad_linalg.svdvals.default, svdvals_grad),
                   (torch.ops.hoad_linalg.svd_u.default, svd_u_grad),
                   (torch.ops.hoad_linalg.svd_vh.default, svd_vh_grad),
                   (torch.ops.hoad_linalg.qr_q.default, qr_q_grad),
                   (torch.ops.hoad_linalg.qr_r.default, qr_r_grad),
                   (torch.ops.hoad_linalg.lu_packed.default, lu_packed_grad),
                   (torch.ops.hoad_linalg.pinv.default, pinv_grad)):
    VJPS.register(_op)(_vjp_of(_grad))


# ------------------------------------------------------------------ slices of output parts
def _narrow(blocks: dict, r: int, axis: int, start: int, length: int) -> dict:
    """Each block's output axis ``axis`` (counted from the end, -1 or -2) narrowed."""
    a = r + axis

    def fn(t):
        return t.narrow(a, start, length)

    out = {}
    for K, blk in blocks.items():
        shape = list(blk.shape[:r])
        shape[a] = length
        out[K] = map_out(blk, r, fn, shape, along(r, [a]))
    return out


def _padded(blocks: dict, r: int, axis: int, before: int, after: int) -> dict:
    """Each block's output axis ``axis`` (from the end) grown by zeros before and after."""
    a = r + axis

    def fn(t):
        parts = []
        for n in (before, after):
            shape = list(t.shape)
            shape[a] = n
            parts.append(t.new_zeros(shape))
        return torch.cat([parts[0], t, parts[1]], a)

    out = {}
    for K, blk in blocks.items():
        shape = list(blk.shape[:r])
        shape[a] += before + after
        out[K] = map_out(blk, r, fn, shape, along(r, [a]))
    return out


def _tri(n: int, m: int, like: torch.Tensor, diagonal: int, upper: bool) -> torch.Tensor:
    ones = torch.ones(n, m, dtype=like.dtype, device=like.device)
    return ones.triu(diagonal) if upper else ones.tril(diagonal)


# ---------------------------------------------------------------------------- QR recurrence
def qr_jets(ctx: Ctx, A: Jet) -> tuple[dict, dict]:
    """Blocks of Q and R of the reduced QR (every key of ``closure(ctx.keys)``)."""
    Q, R = torch.linalg.qr(A.primal, mode="reduced")
    m, n = A.shape[-2], A.shape[-1]
    inner = _inner(ctx, Q)
    r = A.ndim
    if m >= n:
        return _square_qr_jets(inner, A.blocks, Q, R)
    # A = [A1 A2]: Q R1 = A1, R2 = Qᵀ A2
    q_blocks, r1_blocks = _square_qr_jets(inner, _narrow(A.blocks, r, -1, 0, m), Q, R[..., :m])
    b, i, k, j = _labels(r - 2)
    A2 = Jet(A.primal[..., m:], _narrow(A.blocks, r, -1, m, n - m))
    r2_blocks = _mul(inner, Jet(Q, q_blocks), b + [k, i], A2, b + [k, j], b + [i, j], (*A.shape[:-2], m, n - m))
    return q_blocks, sum_blocks(_padded(r1_blocks, r, -1, 0, n - m), _padded(r2_blocks, r, -1, m, 0))


def _square_qr_jets(inner: Ctx, a_blocks: dict, Q: torch.Tensor, R: torch.Tensor) -> tuple[dict, dict]:
    """A = Q R with A m x n, m >= n, R n x n invertible."""
    b, i, k, j = _labels(Q.ndim - 2)
    n = R.shape[-1]
    qshape, rshape = tuple(Q.shape), tuple(R.shape)
    Rinv = torch.linalg.solve_triangular(R, _eye(n, R), upper=True)
    strict_lower, strict_upper = _tri(n, n, R, -1, False), _tri(n, n, R, 1, True)
    half = 0.5 * _eye(n, R)
    q, rr = Jet(Q, {}), Jet(R, {})
    keys = inner.keys
    top = max((len(K) for K in keys), default=0)
    for order in range(1, top + 1):
        level = _level(inner, keys, order)
        if not level.keys:
            continue
        S = _sub({K: a_blocks[K] for K in level.keys if K in a_blocks},
                 _mul(level, q, b + [i, k], rr, b + [k, j], b + [i, j], qshape))
        Y = _mul(level, Jet(Q, S), b + [i, k], _const(Rinv), b + [k, j], b + [i, j], qshape)
        M = _mul(level, _const(Q), b + [k, i], Jet(Q, Y), b + [k, j], b + [i, j], rshape)
        N = _mul(level, q, b + [k, i], q, b + [k, j], b + [i, j], rshape)
        # T = M − C, C = tril(M, −1) − triu(N, 1) − triu(Mᵀ, 1) − diag(N)/2 (upper triangular)
        T = sum_blocks(_masked(level, M, 1 - strict_lower, R), _masked(level, N, strict_upper + half, R),
                       _masked(level, _transposed(M, R.ndim), strict_upper, R))
        dR = _mul(level, Jet(R, T), b + [i, k], _const(R), b + [k, j], b + [i, j], rshape)
        dQ = _sub(Y, _mul(level, _const(Q), b + [i, k], Jet(R, T), b + [k, j], b + [i, j], qshape))
        rr.blocks.update(_forced(dR, top))
        q.blocks.update(_forced(dQ, top))
    return q.blocks, rr.blocks


@RULES.register(torch.ops.hoad_linalg.qr_q.default)
def qr_q_rule(ctx: Ctx, A: Jet):
    return _result(ctx, qr_jets(ctx, A)[0])


@RULES.register(torch.ops.hoad_linalg.qr_r.default)
def qr_r_rule(ctx: Ctx, A: Jet):
    return _result(ctx, qr_jets(ctx, A)[1])


# ---------------------------------------------------------------------------- LU recurrence
@RULES.register(torch.ops.hoad_linalg.lu_packed.default)
def lu_packed_rule(ctx: Ctx, A: Jet):
    """Pᵀ A = L U (P constant), L m x k unit lower, U k x n upper, k = min(m, n)."""
    LU = ctx.out
    m, n = A.shape[-2], A.shape[-1]
    k = min(m, n)
    r = A.ndim
    b, i, c, j = _labels(r - 2)
    batch = tuple(A.shape[:-2])
    P = torch.ops.hoad_linalg.lu_permutation(torch.ops.hoad_linalg.lu_pivots(A.primal.detach()), LU.detach())
    L = LU[..., :, :k] * _tri(m, k, LU, -1, False) + _eye(m, LU)[:, :k]
    U = LU[..., :k, :] * _tri(k, n, LU, 0, True)
    L1, U1 = L[..., :k, :], U[..., :, :k]
    L1inv = torch.linalg.solve_triangular(L1, _eye(k, LU), upper=False, unitriangular=True)
    U1inv = torch.linalg.solve_triangular(U1, _eye(k, LU), upper=True)
    strict_lower, upper = _tri(k, k, LU, -1, False), _tri(k, k, LU, 0, True)
    inner = _inner(ctx, LU)
    PtA = _mul(inner, _const(P), b + [c, i], A, b + [c, j], b + [i, j], tuple(A.shape))
    l, u = Jet(L, {}), Jet(U, {})
    sq = batch + (k, k)
    keys = inner.keys
    top = max((len(K) for K in keys), default=0)
    for order in range(1, top + 1):
        level = _level(inner, keys, order)
        if not level.keys:
            continue
        S = _sub({K: PtA[K] for K in level.keys if K in PtA},
                 _mul(level, l, b + [i, c], u, b + [c, j], b + [i, j], tuple(A.shape)))
        S11 = _narrow(_narrow(S, r, -2, 0, k), r, -1, 0, k)
        M = _mul(level, _const(L1inv), b + [i, c], Jet(L1, S11), b + [c, j], b + [i, j], sq)
        M = _mul(level, Jet(L1, M), b + [i, c], _const(U1inv), b + [c, j], b + [i, j], sq)
        dL1 = _mul(level, _const(L1), b + [i, c], Jet(L1, _masked(level, M, strict_lower, L1)), b + [c, j],
                   b + [i, j], sq)
        dU1 = _mul(level, Jet(U1, _masked(level, M, upper, U1)), b + [i, c], _const(U1), b + [c, j], b + [i, j], sq)
        dL, dU = dL1, dU1
        if m > n:  # L2 = Ã2 U1⁻¹: D L2 = (S21 − L2 D U1) U1⁻¹
            S21 = _narrow(S, r, -2, k, m - k)
            L2 = L[..., k:, :]
            rest = _sub(S21, _mul(level, _const(L2), b + [i, c], Jet(U1, dU1), b + [c, j], b + [i, j], L2.shape))
            dL2 = _mul(level, Jet(L2, rest), b + [i, c], _const(U1inv), b + [c, j], b + [i, j], tuple(L2.shape))
            dL = sum_blocks(_padded(dL1, r, -2, 0, m - k), _padded(dL2, r, -2, k, 0))
        if n > m:  # U2 = L1⁻¹ Ã12: D U2 = L1⁻¹ (S12 − D L1 U2)
            S12 = _narrow(S, r, -1, k, n - k)
            U2 = U[..., :, k:]
            rest = _sub(S12, _mul(level, Jet(L1, dL1), b + [i, c], _const(U2), b + [c, j], b + [i, j], U2.shape))
            dU2 = _mul(level, _const(L1inv), b + [i, c], Jet(U2, rest), b + [c, j], b + [i, j], tuple(U2.shape))
            dU = sum_blocks(_padded(dU1, r, -1, 0, n - k), _padded(dU2, r, -1, k, 0))
        l.blocks.update(_forced(dL, top))
        u.blocks.update(_forced(dU, top))
    packed = sum_blocks(_padded(l.blocks, r, -1, 0, n - k), _padded(u.blocks, r, -2, 0, m - k))
    return _result(ctx, packed)


# ---------------------------------------------------------------------------- pseudo-inverse
# D X = −X DA X + X Xᵀ DAᵀ − X Xᵀ DAᵀ A X + DAᵀ Xᵀ X − X A DAᵀ Xᵀ X, as words in the factors:
# "D" is DA along the first slot, "d" its transpose, "X"/"x" and "A" likewise.
_PINV_TERMS = ((-1, "XDX"), (1, "Xxd"), (-1, "XxdAX"), (1, "dxX"), (-1, "XAdxX"))


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


@RULES.register(torch.ops.hoad_linalg.pinv.default)
def pinv_rule(ctx: Ctx, A: Jet, atol=None, rtol=None, hermitian: bool = False):
    X = ctx.out
    atol, rtol = _value(atol), _value(rtol)
    inner = _inner(ctx, X)
    nb = A.ndim - 2
    b = [("b", d) for d in range(nb)]
    xb: dict = {}
    for K in sorted(inner.keys, key=len):
        terms = []
        rest = range(1, len(K))
        for sign, word in _PINV_TERMS:
            chain_labels = [("c", t) for t in range(len(word) + 1)]
            for owner in itertools.product(range(len(word)), repeat=len(K) - 1):
                operands = []
                for f, letter in enumerate(word):
                    mine = [p for p, o in zip(rest, owner) if o == f]
                    if letter in "Dd":
                        mine = [0] + mine
                    blk = _factor_block(letter, tuple(K[p] for p in mine), A, X, xb)
                    if blk is None:
                        break
                    row, col = chain_labels[f], chain_labels[f + 1]
                    axes = [col, row] if letter in "dx" else [row, col]
                    operands.append((blk, b + axes + inner.slots(K, mine)))
                else:
                    out = b + [chain_labels[0], chain_labels[-1]] + inner.slots(K)
                    term = contract(inner.weigh(operands, out), out, target=inner.target, samples=inner.samples(K))
                    terms.append(term if sign > 0 else term.neg())
        if terms:
            xb[K] = force(add(terms)) if len(K) < ctx.max_order else add(terms)
    blocks = _result(ctx, xb)
    return scaled(ctx, Jet(X, blocks), _pinv_checked(A.primal, atol, rtol, hermitian), tuple(X.shape)) \
        if blocks else blocks


def _factor_block(letter: str, sub: tuple, A: Jet, X: torch.Tensor, xb: dict):
    if letter in "Dd":
        return A.blocks.get(sub)
    if letter == "A":
        return Block.dense(A.primal) if not sub else A.blocks.get(sub)
    return Block.dense(X) if not sub else xb.get(sub)


# ------------------------------------------------------------------------- matrix exponential
def matrix_exp_grad(A: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Ā = D exp(Aᵀ)[ḡ], the upper-right block of exp([[Aᵀ, ḡ], [0, Aᵀ]])."""
    At = A.mT.expand(g.shape)
    n = A.shape[-1]
    top = torch.cat([At, g], -1)
    bottom = torch.cat([torch.zeros_like(At), At], -1)
    return torch.ops.hoad_linalg.matrix_exp(torch.cat([top, bottom], -2))[..., :n, n:]


@RULES.register(torch.ops.hoad_linalg.matrix_exp.default)
def matrix_exp_rule(ctx: Ctx, A: Jet):
    """D^K exp(A) by Mathias' block-triangular form over the nilpotent directions of K: with one
    ε_p (ε_p² = 0) per slot p, exp(A(x + Σ ε_p e_p)) is exp of the block matrix indexed by subsets
    of the slots, block (S, T) = D^{T∖S}A for S ⊆ T (A on the diagonal, 0 elsewhere), and its
    block (∅, all slots) is D^K exp(A), every slot entry at once along batch axes."""
    nb = A.ndim - 2
    n = A.shape[-1]
    b, i, _k, j = _labels(nb)
    batch = tuple(A.shape[:-2])
    full = replace(ctx, collapse=None)
    tie = _sample_axis(ctx, A, nb)
    result = {}
    for K in ctx.keys:
        o = len(K)
        # a slot's entries: all of them, or (one matrix per sample) those of its own sample
        kept = [ctx.slot_shapes[k][1:] if tie is not None else ctx.slot_shapes[k] for k in K]
        sizes = [math.prod(d) for d in kept]
        grid = batch + tuple(sizes)

        def entry(S: int, T: int, K=K, o=o, grid=grid, sizes=sizes):  # (called in this iteration only)
            if S == T:
                return A.primal.reshape(batch + (1,) * o + (n, n)).expand(grid + (n, n))
            if S & ~T:
                return A.primal.new_zeros(()).expand(grid + (n, n))
            mine = [p for p in range(o) if (T & ~S) >> p & 1]
            blk = A.blocks.get(tuple(K[p] for p in mine))
            if blk is None:
                return A.primal.new_zeros(()).expand(grid + (n, n))
            groups = [] if tie is None else [[tie] + _slot_starts(ctx, tuple(K[p] for p in mine), A.ndim)]
            t = blk.materialize(groups).reshape(batch + (n, n) + tuple(sizes[p] for p in mine))
            t = t.movedim((nb, nb + 1), (-2, -1))
            shape = batch + tuple(sizes[p] if p in mine else 1 for p in range(o)) + (n, n)
            return t.reshape(shape).expand(grid + (n, n))

        rows = [torch.cat([entry(S, T) for T in range(2 ** o)], -1) for S in range(2 ** o)]
        E = torch.ops.hoad_linalg.matrix_exp(torch.cat(rows, -2))
        corner = E[..., :n, (2 ** o - 1) * n:].movedim((-2, -1), (nb, nb + 1))
        data = corner.reshape(batch + (n, n) + tuple(d for dims in kept for d in dims))
        if tie is None:
            blk = Block.dense(data)
        else:  # each slot's sample axis is the tied batch axis's class
            dims, c = list(range(nb + 2)), nb + 2
            for k in K:
                dims.append(tie)
                dims += range(c, c + len(ctx.slot_shapes[k]) - 1)
                c += len(ctx.slot_shapes[k]) - 1
            blk = _canonical(data, dims, batch + (n, n) + tuple(d for k in K for d in ctx.slot_shapes[k]))
        out = b + [i, j] + ctx.slots(K)
        result[K] = contract(ctx.weigh([(blk, b + [i, j] + full.slots(K))], out), out, target=ctx.target)
    return result


def _slot_starts(ctx: Ctx, sub, r: int) -> list[int]:
    """The first axis of each slot of a block of key ``sub`` whose output has ``r`` axes."""
    return list(itertools.accumulate(ctx.slot_ranks(sub)[:-1], initial=r))


def _sample_axis(ctx: Ctx, A: Jet, nb: int) -> int | None:
    """Under batch_dim, the batch axis of A that every block ties to the first axis of each of
    its slots (one matrix per sample), or None (then every entry pairs with every other)."""
    if not ctx.batched or ctx.collapse is not None or not A.blocks:
        return None
    tie = None
    for sub, blk in A.blocks.items():
        blk = force(blk)
        for start in _slot_starts(ctx, sub, A.ndim):
            c = blk.dims[start]
            axes = [a for a in range(A.ndim) if blk.dims[a] == c]
            if c is None or len(axes) != 1 or axes[0] >= nb or tie not in (None, axes[0]):
                return None
            tie = axes[0]
    return tie


@VJPS.register(torch.ops.hoad_linalg.matrix_exp.default)
def matrix_exp_vjp(v, g: Block, A: Jet):
    return [(A, _on_rest(g, v.out.ndim, lambda t: matrix_exp_grad(A.primal, t), A.shape, A.ndim - 2))]
