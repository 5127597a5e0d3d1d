"""Capture's routes for torch.linalg: its tuple-returning ops as single-output ones.

The adjoint form needs a single-output node for every nonlinear op, while the factorizing ATen
ops return (value, LU, pivots, info) tuples. :data:`CAPTURE_DECOMPOSITIONS` (merged into capture's
table, :mod:`hoad.passes.decompositions`) routes them to single-output ops:
``aten.linalg_solve_triangular`` and the ``hoad_linalg`` operators of :mod:`hoad.rules.linalg_ops`
(``inv``, ``solve``, ``logabsdet``, ``cholesky``), which run torch's own kernels and carry autograd
formulas, so results stay differentiable for training.

The same table routes the rest of torch.linalg: det (its Laplace expansion up to 4 rows, a polynomial
with exact derivatives at singular A; sign · exp log|det| above), cholesky_inverse and
the deprecated triangular_solve (triangular solves), lu_solve and lu_unpack (triangular solves
and masks of the packed factors, the permutation constant), householder_product and ormqr
(products of reflectors), and the factorizations eigh, svd, qr, lu_factor, lu and pinv to the
factorizations' single-output operators (their rules: :mod:`hoad.rules.factorizations`).
"""

from __future__ import annotations

import itertools

import torch

from hoad.errors import UnsupportedOperatorError
from hoad.rules.linalg_ops import _eye

aten = torch.ops.aten


def _no_info(A: torch.Tensor) -> torch.Tensor:
    return torch.zeros(A.shape[:-2], dtype=torch.int32, device=A.device)


def _inv_ex(A, check_errors=False):
    return torch.ops.hoad_linalg.inv(A), _no_info(A)


def _is_vector_rhs(A, B) -> bool:
    """torch.linalg.solve's rule for a vector right-hand side."""
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and tuple(B.shape) == tuple(A.shape[:-1]))


def _solve_ex(A, B, left=True, check_errors=False):
    """(result, LU, pivots, info): the result by ``hoad_linalg.solve`` on broadcast batches (a row
    problem X A = B as Aᵀ Xᵀ = Bᵀ); LU and pivots, which only torch's backward reads, from A."""
    vector = _is_vector_rhs(A, B)
    Bc = B.unsqueeze(-1) if vector else (B if left else B.mT)
    Ac = A if left else A.mT
    batch = torch.broadcast_shapes(Ac.shape[:-2], Bc.shape[:-2])
    Ac = Ac.expand(*batch, *Ac.shape[-2:])
    X = torch.ops.hoad_linalg.solve(Ac, Bc.expand(*batch, *Bc.shape[-2:]))
    X = X.squeeze(-1) if vector else (X if left else X.mT)
    LU, pivots, _ = aten.linalg_lu_factor_ex(A.detach().expand(*batch, *A.shape[-2:]))
    return X, LU, pivots, _no_info(Ac)


def _slogdet(A):
    """(sign, log|det|, LU, pivots): the sign, piecewise constant, from the LU factors of A."""
    LU, pivots, _ = aten.linalg_lu_factor_ex(A.detach())
    n = A.shape[-1]
    swaps = (pivots != torch.arange(1, n + 1, dtype=pivots.dtype, device=pivots.device)).sum(-1)
    parity = 1 - 2 * (swaps % 2)
    sign = LU.diagonal(dim1=-2, dim2=-1).sign().prod(-1) * parity.to(A.dtype)
    return sign, torch.ops.hoad_linalg.logabsdet(A), LU, pivots


def _cholesky_ex(A, upper=False, check_errors=False):
    return torch.ops.hoad_linalg.cholesky(A, upper), _no_info(A)


def _cholesky_solve(B, L, upper=False):
    """(L Lᵀ)⁻¹ B (or (Uᵀ U)⁻¹ B) as two triangular solves, batches broadcast. Derivatives are
    those of what is computed: the solves read one triangle of L, so entries off it have none
    (torch's backward treats L as a full matrix there; the two agree for a triangular dL)."""
    lower = L.mT if upper else L
    Y = aten.linalg_solve_triangular(lower, B, upper=False)
    return aten.linalg_solve_triangular(lower.mT, Y, upper=True)


# Up to this size det is its Laplace expansion, a polynomial in A (n·2ⁿ⁻¹ products).
EXPANDED_DET = 4


def _det(A):
    """(det, LU, pivots). Up to :data:`EXPANDED_DET` rows det is the polynomial
    :func:`_expanded_det`, whose derivatives are exact at every A. Above it det = sign · exp(log|det|),
    the sign piecewise constant: the derivatives are det · (terms in A⁻¹), as accurate as A is well
    conditioned (NaN at an exactly singular A)."""
    if A.shape[-1] <= EXPANDED_DET:
        LU, pivots, _ = aten.linalg_lu_factor_ex(A.detach())
        return _expanded_det(A), LU, pivots
    sign, logabs, LU, pivots = _slogdet(A)
    return sign * torch.exp(logabs), LU, pivots


def _expanded_det(A):
    """det A by Laplace expansion from the bottom row up: the minors on the last k rows, for every
    k-subset of columns, from those on the last k - 1 rows. At a singular A its derivatives are the
    adjugate's (the exp(log|det|) form was NaN there, and O(1) off a numerically singular one)."""
    n, batch = A.shape[-1], A.shape[:-2]
    subsets, minors = [()], A.new_ones(*batch, 1)
    for k in range(1, n + 1):
        at = {S: i for i, S in enumerate(subsets)}
        subsets = list(itertools.combinations(range(n), k))
        terms = [(j, at[S[:i] + S[i + 1:]], (-1) ** i) for S in subsets for i, j in enumerate(S)]
        cols, rest, signs = (list(t) for t in zip(*terms))
        row = A[..., n - k, :]
        products = row[..., cols] * minors[..., rest] * torch.tensor(signs, dtype=A.dtype, device=A.device)
        minors = products.reshape(*batch, len(subsets), k).sum(-1)
    return minors[..., 0]


def _cholesky_inverse(L, upper=False):
    """(L Lᵀ)⁻¹ (or (Uᵀ U)⁻¹) as :func:`_cholesky_solve` of the identity."""
    return _cholesky_solve(_eye(L.shape[-1], L).expand(L.shape), L, upper)


def _triangular_solve(B, A, upper=True, transpose=False, unitriangular=False):
    """The deprecated (solution, cloned coefficient) API: X with op(A) X = B, op(A) = A or Aᵀ."""
    T = A.mT if transpose else A
    X = aten.linalg_solve_triangular(T, B, upper=upper != transpose, unitriangular=unitriangular)
    return X, A.clone()


# The factorizations route to single-output operators of hoad/rules/linalg_ops.py (looked up
# at call time: that module defines them). Complex inputs, and the variants whose outputs are
# not functions of A, are left to the table (unsupported, naming the ATen op).
def _real(A) -> bool:
    return not A.is_complex()


def _eigh(A, UPLO="L", compute_v=True):
    if not _real(A):
        return NotImplemented
    ops = torch.ops.hoad_linalg
    lam = ops.eigvalsh(A, UPLO)
    return lam, ops.eigvecsh(A, UPLO) if compute_v else A.new_empty(0)


def _svd(A, full_matrices=False, compute_uv=True, driver=None):
    """Reduced SVD parts. full_matrices=True on a non-square matrix asks for singular vectors
    that A does not determine (any orthonormal completion will do): left unsupported."""
    m, n = A.shape[-2], A.shape[-1]
    if not _real(A):
        return NotImplemented
    if compute_uv and full_matrices and m != n:
        raise _undetermined(f"torch.linalg.svd(A, full_matrices=True) of a {m}x{n} matrix: the last {abs(m - n)} "
                            "singular vectors", "full_matrices=False (the reduced SVD determines every factor)")
    ops = torch.ops.hoad_linalg
    S = ops.svdvals(A)
    if not compute_uv:
        return A.new_empty(0), S, A.new_empty(0)
    return ops.svd_u(A), S, ops.svd_vh(A)


def _undetermined(what: str, fix: str) -> UnsupportedOperatorError:
    """The refusal of factors beyond min(m, n): ``what`` they are, the argument that avoids them."""
    return UnsupportedOperatorError(f"{what} are any orthonormal completion, which A does not determine, so they "
                                    f"have no derivatives. Pass {fix}.")


def _qr(A, mode="reduced"):
    """mode 'complete' on a tall matrix asks for columns of Q that A does not determine: left unsupported."""
    m, n = A.shape[-2], A.shape[-1]
    if not _real(A):
        return NotImplemented
    if mode == "complete" and m > n:
        raise _undetermined(f"torch.linalg.qr(A, mode='complete') of a tall {m}x{n} matrix: the last {m - n} "
                            "columns of Q", "mode='reduced' (or 'r')")
    ops = torch.ops.hoad_linalg
    R = ops.qr_r(A)
    return (A.new_empty(0) if mode == "r" else ops.qr_q(A)), R


def _lu_factor_ex(A, pivot=True, check_errors=False):
    if not _real(A) or not pivot:
        return NotImplemented
    ops = torch.ops.hoad_linalg
    return ops.lu_packed(A), ops.lu_pivots(A.detach()), _no_info(A)


def _unit_lower(LU, k: int):
    """L of packed factors: the strict lower part of the first k columns, ones on the diagonal."""
    m = LU.shape[-2]
    mask = torch.ones(m, k, dtype=LU.dtype, device=LU.device).tril(-1)
    return LU[..., :, :k] * mask + _eye(m, LU)[:, :k]


def _upper(LU, k: int):
    n = LU.shape[-1]
    return LU[..., :k, :] * torch.ones(k, n, dtype=LU.dtype, device=LU.device).triu()


def _lu_unpack(LU, pivots, unpack_data=True, unpack_pivots=True):
    m, n = LU.shape[-2], LU.shape[-1]
    k = min(m, n)
    P = torch.ops.hoad_linalg.lu_permutation(pivots, LU.detach()) if unpack_pivots else LU.new_empty(0)
    if not unpack_data:
        return P, LU.new_empty(0), LU.new_empty(0)
    return P, _unit_lower(LU, k), _upper(LU, k)


def _lu(A, pivot=True):
    if not _real(A) or not pivot:
        return NotImplemented
    ops = torch.ops.hoad_linalg
    return _lu_unpack(ops.lu_packed(A), ops.lu_pivots(A.detach()))


def _lu_solve(LU, pivots, B, left=True, adjoint=False):
    """A = P L U from packed factors: two triangular solves reading the triangles of LU, and the
    permutation (constant)."""
    P = torch.ops.hoad_linalg.lu_permutation(pivots, LU.detach())
    if left and not adjoint:      # X = U⁻¹ L⁻¹ Pᵀ B
        Y = aten.linalg_solve_triangular(LU, P.mT @ B, upper=False, unitriangular=True)
        return aten.linalg_solve_triangular(LU, Y, upper=True)
    if left:                      # Aᵀ X = B: X = P L⁻ᵀ U⁻ᵀ B
        Y = aten.linalg_solve_triangular(LU.mT, B, upper=False)
        return P @ aten.linalg_solve_triangular(LU.mT, Y, upper=True, unitriangular=True)
    if not adjoint:               # X A = B: X = B U⁻¹ L⁻¹ Pᵀ
        Y = aten.linalg_solve_triangular(LU, B, upper=True, left=False)
        return aten.linalg_solve_triangular(LU, Y, upper=False, unitriangular=True, left=False) @ P.mT
    # X Aᵀ = B: X = B P L⁻ᵀ U⁻ᵀ
    Y = aten.linalg_solve_triangular(LU.mT, B @ P, upper=True, unitriangular=True, left=False)
    return aten.linalg_solve_triangular(LU.mT, Y, upper=False, left=False)


def _pinv(A, atol=None, rtol=None, hermitian=False):
    if not _real(A):
        return NotImplemented
    return torch.ops.hoad_linalg.pinv(A, atol, rtol, hermitian)


def _reflectors(A, tau):
    """H_1 ⋯ H_k (m x m), H_i = I − τ_i v_i v_iᵀ, v_i the i-th column of A below the diagonal with
    a unit on it (LAPACK's geqrf storage): products and sums only."""
    m = A.shape[-2]
    k = tau.shape[-1]
    mask = torch.ones(m, k, dtype=A.dtype, device=A.device).tril(-1)
    V = A[..., :, :k] * mask + _eye(m, A)[:, :k]
    batch = torch.broadcast_shapes(A.shape[:-2], tau.shape[:-1])
    Q = _eye(m, A).expand(*batch, m, m)
    for i in range(k):
        v = V[..., :, i:i + 1]
        Q = Q - (Q @ v) @ (v.mT * tau[..., i, None, None])
    return Q


def _householder_product(A, tau):
    return _reflectors(A, tau)[..., :, :A.shape[-1]]


def _ormqr(A, tau, C, left=True, transpose=False):
    Q = _reflectors(A, tau)
    Q = Q.mT if transpose else Q
    return Q @ C if left else C @ Q


CAPTURE_DECOMPOSITIONS = {
    aten.linalg_householder_product.default: _householder_product,
    aten.ormqr.default: _ormqr,
    aten.linalg_inv_ex.default: _inv_ex,
    aten._linalg_solve_ex.default: _solve_ex,
    aten._linalg_slogdet.default: _slogdet,
    aten.linalg_cholesky_ex.default: _cholesky_ex,
    aten.cholesky_solve.default: _cholesky_solve,
    aten._linalg_det.default: _det,
    aten.cholesky_inverse.default: _cholesky_inverse,
    aten.triangular_solve.default: _triangular_solve,
    aten._linalg_eigh.default: _eigh,
    aten._linalg_svd.default: _svd,
    aten.linalg_qr.default: _qr,
    aten.linalg_lu_factor_ex.default: _lu_factor_ex,
    aten.linalg_lu.default: _lu,
    aten.lu_unpack.default: _lu_unpack,
    aten.linalg_lu_solve.default: _lu_solve,
    aten.linalg_pinv.atol_rtol_tensor: _pinv,
    aten.linalg_matrix_exp.default: lambda A: torch.ops.hoad_linalg.matrix_exp(A),
}
