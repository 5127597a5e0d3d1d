"""Matrix factorizations: symmetric eigendecomposition, SVD, QR, LU, pseudo-inverse, every order.

Each factorization is a set of single-output ``hoad_linalg`` operators (the adjoint form needs
one output per nonlinear node; capture routes torch's tuple-returning ops to them, see
``CAPTURE_DECOMPOSITIONS`` in :mod:`hoad.passes.linalg_routes`), defined with their cotangents in
:mod:`hoad.rules.linalg_ops`. Their values are torch's own kernels', sign conventions
included; their derivative blocks come from differentiating the defining equations K times with
Leibniz, order by order, so every order and every mixed block comes from the same few lines.
At order K the terms that read no order-K block of a factor are collected (``leibniz`` skips
them by itself while the factor has no order-K block yet), and the order-K blocks solve a small
linear system:

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
from hoad.rules.linalg_ops import (
    _eye,
    _gap_inverse,
    _pinv_checked,
    eigvalsh_grad,
    eigvecsh_grad,
    lu_packed_grad,
    matrix_exp_grad,
    pinv_grad,
    qr_q_grad,
    qr_r_grad,
    svd_u_grad,
    svd_vh_grad,
    svdvals_grad,
)

aten = torch.ops.aten
OPS = RuleTable("factorizations")


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


def eigvalsh_rule(ctx: Ctx, A: Jet, UPLO: str = "L"):
    return _eigh_rule(ctx, A, UPLO, 0)


OPS.register(torch.ops.hoad_linalg.eigvalsh.default, rule=eigvalsh_rule, vjp=_vjp_of(eigvalsh_grad))


def eigvecsh_rule(ctx: Ctx, A: Jet, UPLO: str = "L"):
    return _eigh_rule(ctx, A, UPLO, 1)


OPS.register(torch.ops.hoad_linalg.eigvecsh.default, rule=eigvecsh_rule, vjp=_vjp_of(eigvecsh_grad))


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


def svd_u_rule(ctx: Ctx, A: Jet):
    return _result(ctx, svd_jets(ctx, A, "U"))


OPS.register(torch.ops.hoad_linalg.svd_u.default, rule=svd_u_rule, vjp=_vjp_of(svd_u_grad))


def svdvals_rule(ctx: Ctx, A: Jet):
    return _result(ctx, svd_jets(ctx, A, "S"))


OPS.register(torch.ops.hoad_linalg.svdvals.default, rule=svdvals_rule, vjp=_vjp_of(svdvals_grad))


def svd_vh_rule(ctx: Ctx, A: Jet):
    return _result(ctx, svd_jets(ctx, A, "Vh"))


OPS.register(torch.ops.hoad_linalg.svd_vh.default, rule=svd_vh_rule, vjp=_vjp_of(svd_vh_grad))


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


def qr_q_rule(ctx: Ctx, A: Jet):
    return _result(ctx, qr_jets(ctx, A)[0])


OPS.register(torch.ops.hoad_linalg.qr_q.default, rule=qr_q_rule, vjp=_vjp_of(qr_q_grad))


def qr_r_rule(ctx: Ctx, A: Jet):
    return _result(ctx, qr_jets(ctx, A)[1])


OPS.register(torch.ops.hoad_linalg.qr_r.default, rule=qr_r_rule, vjp=_vjp_of(qr_r_grad))


# ---------------------------------------------------------------------------- LU recurrence
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


OPS.register(torch.ops.hoad_linalg.lu_packed.default, rule=lu_packed_rule, vjp=_vjp_of(lu_packed_grad))


# ---------------------------------------------------------------------------- pseudo-inverse
# D X = −X DA X + X Xᵀ DAᵀ − X Xᵀ DAᵀ A X + DAᵀ Xᵀ X − X A DAᵀ Xᵀ X, as words in the factors:
# "D" is DA along the first slot, "d" its transpose, "X"/"x" and "A" likewise.
_PINV_TERMS = ((-1, "XDX"), (1, "Xxd"), (-1, "XxdAX"), (1, "dxX"), (-1, "XAdxX"))


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


OPS.register(torch.ops.hoad_linalg.pinv.default, rule=pinv_rule, vjp=_vjp_of(pinv_grad))


def _factor_block(letter: str, sub: tuple, A: Jet, X: torch.Tensor, xb: dict):
    if letter in "Dd":
        return A.blocks.get(sub)
    if letter == "A":
        return Block.dense(A.primal) if not sub else A.blocks.get(sub)
    return Block.dense(X) if not sub else xb.get(sub)


# ------------------------------------------------------------------------- matrix exponential
def matrix_exp_rule(ctx: Ctx, A: Jet):
    """D^K exp(A) by Mathias' block-triangular form over the nilpotent directions of K: with one
    ε_p (ε_p² = 0) per slot p, exp(A(x + Σ ε_p e_p)) is exp of the block matrix indexed by subsets
    of the slots, block (S, T) = D^{T∖S}A for S ⊆ T (A on the diagonal, 0 elsewhere), and its
    block (∅, all slots) is D^K exp(A), every slot entry at once along batch axes.

    The slots of one input share their entries in diagonal mode (pure derivatives: one matrix per
    direction, not one per tuple of them). Under a collapse, A's top-order block arrives summed
    over the collapsed axes; it enters D^K exp(A) linearly, through the Fréchet derivative
    L(A, D^K A) = exp([[A, D^K A], [0, A]])₁₂, so the block matrix leaves it out and that term
    is added, already collapsed."""
    nb = A.ndim - 2
    n = A.shape[-1]
    b, i, _k, j = _labels(nb)
    batch = tuple(A.shape[:-2])
    full = replace(ctx, collapse=None)
    tie = _sample_axis(ctx, A, nb)
    result = {}
    for K in ctx.keys:
        o = len(K)
        top = ctx.collapse is not None and o == ctx.collapse.order
        groups = _entry_groups(ctx, K)
        group_of = {p: g for g, members in enumerate(groups) for p in members}
        # a group's entries: all of them, or (one matrix per sample) those of its own sample
        kept = [ctx.slot_shapes[K[members[0]]][1 if tie is not None else 0:] for members in groups]
        sizes = [math.prod(d) for d in kept]
        grid = batch + tuple(sizes)

        def entry(S: int, T: int, K=K, o=o, top=top, grid=grid, sizes=sizes, group_of=group_of):
            # (called in this iteration only)
            if S == T:
                return A.primal.reshape(batch + (1,) * len(sizes) + (n, n)).expand(grid + (n, n))
            mine = [p for p in range(o) if (T & ~S) >> p & 1]
            sub = tuple(K[p] for p in mine)
            blk = None if S & ~T or (top and len(mine) == o) else A.blocks.get(sub)
            if blk is None:
                return A.primal.new_zeros(()).expand(grid + (n, n))
            t = _by_entry_group(ctx, blk, sub, [group_of[p] for p in mine], nb, tie)
            present = sorted(set(group_of[p] for p in mine))
            t = t.reshape(batch + (n, n) + tuple(sizes[g] for g in present)).movedim((nb, nb + 1), (-2, -1))
            shape = batch + tuple(sizes[g] if g in present else 1 for g in range(len(sizes))) + (n, n)
            return t.reshape(shape).expand(grid + (n, n))

        rows = [torch.cat([entry(S, T) for T in range(2 ** o)], -1) for S in range(2 ** o)]
        E = torch.ops.hoad_linalg.matrix_exp(torch.cat(rows, -2))
        corner = E[..., :n, (2 ** o - 1) * n:].movedim((-2, -1), (nb, nb + 1))
        data = corner.reshape(batch + (n, n) + tuple(d for dims in kept for d in dims))
        # each slot's axes are its group's data axes (and its sample axis the tied batch axis)
        firsts = list(itertools.accumulate((len(d) for d in kept[:-1]), initial=nb + 2))
        dims = list(range(nb + 2))
        for p in range(o):
            g = group_of[p]
            dims += ([tie] if tie is not None else []) + list(range(firsts[g], firsts[g] + len(kept[g])))
        blk = _canonical(data, dims, batch + (n, n) + tuple(d for k in K for d in ctx.slot_shapes[k]))
        out = b + [i, j] + ctx.slots(K)
        result[K] = contract(ctx.weigh([(blk, b + [i, j] + full.slots(K))], out), out, target=ctx.target)
        if top and A.blocks.get(K) is not None:
            frechet = _on_rest(force(A.blocks[K]), A.ndim, lambda t: matrix_exp_grad(A.primal.mT, t), A.shape, nb)
            result[K] = add([result[K], frechet])
    return result


def _entry_groups(ctx: Ctx, K) -> list[list[int]]:
    """The positions of ``K`` that share their entries: in diagonal mode those of one input, else
    each slot alone."""
    by: dict = {}
    for p, k in enumerate(K):
        by.setdefault(k if ctx.diagonal else p, []).append(p)
    return list(by.values())


def _by_entry_group(ctx: Ctx, blk, sub, groups: list[int], nb: int, tie: int | None) -> torch.Tensor:
    """A block of key ``sub`` (its slots in entry groups ``groups``) as batch + (n, n) + each
    group's entries once, groups in increasing order: the diagonal of the slots that share their
    entries, and of each slot's sample axis with the tied batch axis."""
    b, i, _k, j = _labels(nb)
    labels, out = b + [i, j], b + [i, j]
    first, tied = (1, [b[tie]]) if tie is not None else (0, [])
    for p, k in enumerate(sub):
        labels += tied + [("e", groups[p], a) for a in range(first, len(ctx.slot_shapes[k]))]
    for g in sorted(set(groups)):
        out += [("e", g, a) for a in range(first, len(ctx.slot_shapes[sub[groups.index(g)]]))]
    entries = force(contract([(force(blk), labels)], out, target=ctx.target))
    # (a diagonal written out by identity factors: a scatter into zeros along the sample axis
    # would read as mixing samples to a program that differentiates this one, the biharmonic)
    return entries.untie(range(entries.ndim)).materialize()


def matrix_exp_vjp(v, g: Block, A: Jet):
    return [(A, _on_rest(g, v.out.ndim, lambda t: matrix_exp_grad(A.primal, t), A.shape, A.ndim - 2))]


OPS.register(torch.ops.hoad_linalg.matrix_exp.default, rule=matrix_exp_rule, vjp=matrix_exp_vjp)


def _slot_starts(ctx: Ctx, sub, r: int) -> list[int]:
    """The first axis of each slot of a block of key ``sub`` whose output has ``r`` axes."""
    return list(itertools.accumulate(ctx.slot_ranks(sub)[:-1], initial=r))


def _sample_axis(ctx: Ctx, A: Jet, nb: int) -> int | None:
    """Under batch_dim, the batch axis of A that every block ties to the first axis of each of
    its slots (one matrix per sample), or None (then every entry pairs with every other)."""
    if not ctx.batched or not A.blocks:
        return None
    tie = None
    for sub, blk in A.blocks.items():
        blk = force(blk)
        for start, rank in zip(_slot_starts(ctx, sub, A.ndim), ctx.slot_ranks(sub)):
            if rank == 0:  # (every axis of the slot collapsed)
                continue
            c = blk.dims[start]
            axes = [a for a in range(A.ndim) if blk.dims[a] == c]
            if c is None or len(axes) != 1 or axes[0] >= nb or tie not in (None, axes[0]):
                return None
            tie = axes[0]
    return tie


