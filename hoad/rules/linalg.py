"""Linear algebra: inverse, solves, Cholesky, log|det|, every order by matrix-calculus recurrences.

Each rule computes the primal with the op itself and its derivative blocks from recurrences in
products of blocks (Leibniz over two matrix factors, as for ``mm``), so every order and every
mixed block comes from the same few lines:

- X = T⁻¹B (inverse: B = I; solves; triangular solves with T the read triangle of A):
  T X = B gives D^K X = T⁻¹ (D^K B − Σ D^{K1}T · D^{K2}X) over the splits of K with K1 ≠ ∅;
- Cholesky A = L Lᵀ: with S_K = D^K A − Σ D^{K1}L · D^{K2}Lᵀ (both parts ≠ ∅),
  D^K L = L Φ(L⁻¹ S_K L⁻ᵀ), Φ the lower triangle with the diagonal halved;
- ℓ = log|det A|: Dℓ = tr(A⁻¹ DA), so D^K ℓ = Σ_{S ⊆ K∖{first slot}} tr(D^S A⁻¹ · D^{K∖S} A).

Every term that reads a top-order block of an argument is the op's linear part, so on the
adjoint form's jets (cut below the top order) the same code yields the remainder R^K.

The adjoint form needs a single-output node for every nonlinear op, while the factorizing ATen
ops return (value, LU, pivots, info) tuples. :data:`CAPTURE_DECOMPOSITIONS` (merged into capture's
table) routes them to single-output ops: ``aten.linalg_solve_triangular`` and four
``hoad_linalg`` operators defined here (``inv``, ``solve``, ``logabsdet``, ``cholesky``), which run torch's
own kernels and carry autograd formulas, so results stay differentiable for training.

The same table routes the rest of torch.linalg: det (its Laplace expansion up to 4 rows, a polynomial
with exact derivatives at singular A; sign · exp log|det| above), cholesky_inverse and
the deprecated triangular_solve (triangular solves), lu_solve and lu_unpack (triangular solves
and masks of the packed factors, the permutation constant), householder_product and ormqr
(products of reflectors), and the factorizations eigh, svd, qr, lu_factor, lu and pinv to the
single-output operators of :mod:`hoad.rules.factorization_ops`.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from hoad.algebra import Block, add, contract, force
from hoad.algebra.multiindex import closure
from hoad.errors import UnsupportedOperatorError
from hoad.rules.base import Ctx, Jet, RuleTable
from hoad.rules.combinators import broadcast, leibniz, scaled, unbroadcast

aten = torch.ops.aten
RULES = RuleTable("linalg")
VJPS = RuleTable("linalg")


# --------------------------------------------------------------------- single-output operators
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


# ------------------------------------------------------------------------- capture's routes
def _no_info(A: torch.Tensor) -> torch.Tensor:
    return torch.zeros(A.shape[:-2], dtype=torch.int32, device=A.device)


def _eye(n: int, like: torch.Tensor) -> torch.Tensor:
    """The n x n identity (torch.eye's decomposition counts in uint16 from n = 256, which arange
    has no CPU kernel for)."""
    idx = torch.arange(n, device=like.device)
    return (idx.unsqueeze(1) == idx).to(like.dtype)


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


# The factorizations route to single-output operators of hoad/rules/factorization_ops.py (looked up
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


# ------------------------------------------------------------------------------ recurrences
def _jet(x) -> Jet:
    return x if isinstance(x, Jet) else Jet(x)


def _labels(nb: int) -> tuple[list, tuple, tuple, tuple]:
    b = [("b", d) for d in range(nb)]
    return b, ("m", 0), ("m", 1), ("m", 2)


def _at_order(ctx: Ctx, keys, k: int) -> Ctx:
    return replace(ctx, keys=tuple(K for K in keys if len(K) == k))


def _times_const(ctx: Ctx, M: torch.Tensor, x: Jet, lm: list, lx: list, lo: list, shape) -> dict:
    """Blocks of the einsum M·x with M constant."""
    return leibniz(ctx, [(Jet(M), lm), (x, lx)], lo, shape)


def _solve_blocks(ctx: Ctx, keys, T: Jet, B: Jet | None, X: torch.Tensor, Tinv: torch.Tensor, left: bool) -> dict:
    """Blocks ``keys`` (and all they need) of X = T⁻¹B (``left``) or X = B T⁻¹, T and B broadcast
    to X's batch axes; B None is the identity (X = T⁻¹)."""
    b, i, k, j = _labels(X.ndim - 2)
    shape = tuple(X.shape)
    lo = b + [i, j]
    x = Jet(X, {})
    inner = replace(ctx, adjoint=None)
    top = max((len(K) for K in keys), default=0)
    for order in range(1, top + 1):
        level = _at_order(inner, keys, order)
        if not level.keys:
            continue
        # Σ D^{K1}T · D^{K2}X (K1 ≠ ∅: X has no block of this order yet)
        if left:
            prods = leibniz(level, [(T, b + [i, k]), (x, b + [k, j])], lo, shape)
            applied = _times_const(level, Tinv, Jet(X, prods), b + [i, k], b + [k, j], lo, shape)
        else:
            prods = leibniz(level, [(x, b + [i, k]), (T, b + [k, j])], lo, shape)
            applied = _times_const(level, Tinv, Jet(X, prods), b + [k, j], b + [i, k], lo, shape)
        blocks = {K: blk.neg() for K, blk in applied.items()}
        if B is not None:
            if left:
                direct = _times_const(level, Tinv, B, b + [i, k], b + [k, j], lo, shape)
            else:
                direct = _times_const(level, Tinv, B, b + [k, j], b + [i, k], lo, shape)
            for K, blk in direct.items():
                blocks[K] = add([blocks[K], blk]) if K in blocks else blk
        x.blocks.update(_forced(blocks, top))
    return x.blocks


def _forced(blocks: dict, top: int) -> dict:
    """Lower-order blocks that later orders read many times are evaluated once."""
    return {K: force(b) if len(K) < top else b for K, b in blocks.items()}


def _result(ctx: Ctx, blocks: dict) -> dict:
    return {K: blocks[K] for K in ctx.keys if K in blocks}


def _batched(a: Jet, b: Jet) -> tuple[Jet, Jet]:
    """Both matrices broadcast to their common batch axes."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return broadcast(a, batch + a.shape[-2:]), broadcast(b, batch + b.shape[-2:])


@RULES.register(torch.ops.hoad_linalg.inv.default)
def inv_rule(ctx: Ctx, A: Jet):
    X = ctx.out
    return _result(ctx, _solve_blocks(ctx, closure(ctx.keys), _jet(A), None, X, X, left=True))


@RULES.register(torch.ops.hoad_linalg.solve.default)
def solve_rule(ctx: Ctx, A, B):
    A, B = _jet(A), _jet(B)
    Ainv = torch.ops.hoad_linalg.inv(A.primal)
    return _result(ctx, _solve_blocks(ctx, closure(ctx.keys), A, B, ctx.out, Ainv, left=True))


def _triangle(n: int, upper: bool, unitriangular: bool, like: torch.Tensor) -> torch.Tensor:
    """1 on the entries of A a triangular solve reads (the diagonal too unless unit), else 0."""
    ones = torch.ones(n, n, dtype=like.dtype, device=like.device)
    if unitriangular:
        return ones.triu(1) if upper else ones.tril(-1)
    return ones.triu() if upper else ones.tril()


@RULES.register(aten.linalg_solve_triangular.default)
def solve_triangular_rule(ctx: Ctx, A, B, *, upper: bool, left: bool = True, unitriangular: bool = False):
    A, B = _batched(_jet(A), _jet(B))
    n = A.shape[-1]
    inner = ctx.inner(ctx.out)
    T = Jet(A.primal, scaled(inner, A, _triangle(n, upper, unitriangular, A.primal), A.shape)) if A.varies else A
    Tinv = aten.linalg_solve_triangular(A.primal, _eye(n, A.primal), upper=upper, unitriangular=unitriangular)
    return _result(ctx, _solve_blocks(ctx, closure(ctx.keys), T, B, ctx.out, Tinv, left))


def _phi(n: int, like: torch.Tensor) -> torch.Tensor:
    """The mask of Φ: 1 below the diagonal, 1/2 on it, 0 above."""
    ones = torch.ones(n, n, dtype=like.dtype, device=like.device)
    return ones.tril(-1) + 0.5 * _eye(n, like)


def _symmetric(ctx: Ctx, A: Jet) -> Jet:
    """(A + Aᵀ)/2: torch's derivatives of a Cholesky factor are those of the symmetric part."""
    r = A.ndim
    perm = list(range(r - 2)) + [r - 1, r - 2]
    blocks = {K: add([b, b.permute(perm + list(range(r, b.ndim)))]).scale(0.5) for K, b in A.blocks.items()
              if K in ctx.keys}
    return Jet(A.primal, blocks)


@RULES.register(aten.cholesky.default, torch.ops.hoad_linalg.cholesky.default)
def cholesky_rule(ctx: Ctx, A: Jet, upper: bool = False):
    L = ctx.out.mT if upper else ctx.out
    n = L.shape[-1]
    b, i, k, j = _labels(L.ndim - 2)
    shape = tuple(L.shape)
    lo = b + [i, j]
    keys = closure(ctx.keys)
    inner = replace(ctx.inner(L), keys=tuple(keys))
    S = _symmetric(inner, A)
    Linv = aten.linalg_solve_triangular(L, _eye(n, L), upper=False)
    mask = _phi(n, L)
    x = Jet(L, {})
    for order in range(1, len(keys[-1]) + 1 if keys else 1):
        level = _at_order(inner, keys, order)
        # S_K = D^K A − Σ D^{K1}L · D^{K2}Lᵀ (neither part empty: L has no block of this order yet)
        prods = leibniz(level, [(x, b + [i, k]), (x, b + [j, k])], lo, shape)
        s = {K: add([S.blocks[K], p.neg()]) if K in S.blocks else p.neg() for K, p in prods.items()}
        s.update({K: blk for K, blk in S.blocks.items() if len(K) == order and K not in s})
        if not s:
            continue
        # L Φ(L⁻¹ S_K L⁻ᵀ)
        left = _times_const(level, Linv, Jet(L, s), b + [i, k], b + [k, j], lo, shape)
        m = _times_const(level, Linv, Jet(L, left), b + [j, k], b + [i, k], lo, shape)
        z = scaled(level, Jet(L, m), mask, shape)
        x.blocks.update(_times_const(level, L, Jet(L, z), b + [i, k], b + [k, j], lo, shape))
        x.blocks.update(_forced({K: x.blocks[K] for K in level.keys if K in x.blocks}, ctx.max_order))
    blocks = _result(ctx, x.blocks)
    if upper:
        r = L.ndim
        perm = list(range(r - 2)) + [r - 1, r - 2]
        blocks = {K: blk.permute(perm + list(range(r, blk.ndim))) for K, blk in blocks.items()}
    return blocks


@RULES.register(torch.ops.hoad_linalg.logabsdet.default)
def logabsdet_rule(ctx: Ctx, A: Jet):
    """D^K ℓ = Σ_{S ⊆ K∖{slot 0}} tr(D^S A⁻¹ · D^{K∖S} A): the inverse's jet to one order less."""
    import itertools

    X = torch.ops.hoad_linalg.inv(A.primal)
    keys = closure(ctx.keys)
    below = [K for K in keys if len(K) < ctx.max_order]
    xb = _solve_blocks(ctx, below, A, None, X, X, left=True) if below else {}
    xb = {K: force(b) for K, b in xb.items()}
    b, i, _k, j = _labels(A.ndim - 2)
    result = {}
    for K in ctx.keys:
        rest = range(1, len(K))
        terms = []
        for s in range(len(K)):
            for S in itertools.combinations(rest, s):
                other = [0] + [p for p in rest if p not in S]
                a_blk = A.blocks.get(tuple(K[p] for p in other))
                x_blk = Block.dense(X) if not S else xb.get(tuple(K[p] for p in S))
                if a_blk is None or x_blk is None:
                    continue
                operands = [(x_blk, b + [j, i] + ctx.slots(K, list(S))), (a_blk, b + [i, j] + ctx.slots(K, other))]
                out = b + ctx.slots(K)
                terms.append(contract(ctx.weigh(operands, out), out, target=ctx.target, samples=ctx.samples(K)))
        if terms:
            result[K] = add(terms)
    return result


# ---------------------------------------------------------------------------------- VJPs
def _rest(g: Block, r: int) -> list:
    return [("f", a) for a in range(g.ndim - r)]


@VJPS.register(torch.ops.hoad_linalg.inv.default)
def inv_vjp(v, g: Block, A: Jet):
    X = Block.dense(v.out)
    b, i, k, j = _labels(v.out.ndim - 2)
    l = ("m", 3)
    rest = _rest(g, v.out.ndim)
    return [(A, contract([(X, b + [k, i]), (g, b + [k, l] + rest), (X, b + [j, l])], b + [i, j] + rest,
                         target=v.target).neg())]


def _solve_cotangents(v, g: Block, A, B, Tinv: torch.Tensor, X: torch.Tensor, left: bool, mask=None) -> list:
    """X = T⁻¹B: ḡ_B = T⁻ᵀ g, ḡ_T = −ḡ_B Xᵀ (rows: X = B T⁻¹, ḡ_B = g T⁻ᵀ, ḡ_T = −Xᵀ ḡ_B),
    each summed back over the batch axes broadcasting added."""
    r = X.ndim
    b, i, k, j = _labels(r - 2)
    rest = _rest(g, r)
    Tinv = Tinv.expand(tuple(X.shape[:-2]) + tuple(Tinv.shape[-2:]))
    gl = b + [i, j] + rest
    if left:
        gB = contract([(Block.dense(Tinv), b + [i, k]), (g, gl)], b + [k, j] + rest, target=v.target)
        gT = contract([(gB, b + [i, j] + rest), (Block.dense(X), b + [k, j])], b + [i, k] + rest, target=v.target)
    else:
        gB = contract([(g, gl), (Block.dense(Tinv), b + [k, j])], b + [i, k] + rest, target=v.target)
        gT = contract([(Block.dense(X), b + [i, k]), (gB, b + [i, j] + rest)], b + [k, j] + rest, target=v.target)
    pairs = []
    if isinstance(A, Jet) and A.varies:
        if mask is not None:
            gT = contract([(Block.dense(mask), [i, j]), (gT, b + [i, j] + rest)], b + [i, j] + rest, target=v.target)
        pairs.append((A, unbroadcast(gT.neg(), r, A.shape)))
    if isinstance(B, Jet) and B.varies:
        pairs.append((B, unbroadcast(gB, r, B.shape)))
    return pairs


@VJPS.register(torch.ops.hoad_linalg.solve.default)
def solve_vjp(v, g: Block, A, B):
    return _solve_cotangents(v, g, A, B, torch.ops.hoad_linalg.inv(_jet(A).primal), v.out, True)


@VJPS.register(aten.linalg_solve_triangular.default)
def solve_triangular_vjp(v, g: Block, A, B, *, upper: bool, left: bool = True, unitriangular: bool = False):
    a = _jet(A).primal
    n = a.shape[-1]
    Tinv = aten.linalg_solve_triangular(a, _eye(n, a), upper=upper, unitriangular=unitriangular)
    return _solve_cotangents(v, g, A, B, Tinv, v.out, left, _triangle(n, upper, unitriangular, a))


@VJPS.register(aten.cholesky.default, torch.ops.hoad_linalg.cholesky.default)
def cholesky_vjp(v, g: Block, A: Jet, upper: bool = False):
    """ḡ_A = sym(L⁻ᵀ Φ(Lᵀ ḡ_L) L⁻¹)."""
    r = v.out.ndim
    swap = list(range(r - 2)) + [r - 1, r - 2]
    L = v.out.mT if upper else v.out
    if upper:
        g = g.permute(swap + list(range(r, g.ndim)))
    n = L.shape[-1]
    b, i, k, j = _labels(r - 2)
    l, m = ("m", 3), ("m", 4)
    rest = _rest(g, r)
    P = contract([(Block.dense(L), b + [m, k]), (g, b + [m, l] + rest), (Block.dense(_phi(n, L)), [k, l])],
                 b + [k, l] + rest, target=v.target)
    Linv = Block.dense(aten.linalg_solve_triangular(L, _eye(n, L), upper=False))
    Q = contract([(Linv, b + [k, i]), (P, b + [k, l] + rest), (Linv, b + [l, j])], b + [i, j] + rest,
                 target=v.target)
    return [(A, add([Q, Q.permute(swap + list(range(r, Q.ndim)))]).scale(0.5))]


@VJPS.register(torch.ops.hoad_linalg.logabsdet.default)
def logabsdet_vjp(v, g: Block, A: Jet):
    b, i, _k, j = _labels(A.ndim - 2)
    rest = _rest(g, v.out.ndim)
    X = Block.dense(torch.ops.hoad_linalg.inv(A.primal))
    return [(A, contract([(g, b + rest), (X, b + [j, i])], b + [i, j] + rest, target=v.target))]
