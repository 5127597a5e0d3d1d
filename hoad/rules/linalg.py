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

The ops are ``aten.linalg_solve_triangular`` and four single-output ``hoad_linalg`` operators
(``inv``, ``solve``, ``logabsdet``, ``cholesky``, defined in :mod:`hoad.rules.linalg_ops`), to which
capture routes torch.linalg's tuple-returning ops (:mod:`hoad.passes.linalg_routes`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hoad.algebra import Block, add, contract, force
from hoad.algebra.multiindex import closure
from hoad.rules.base import Ctx, Jet, RuleTable
from hoad.rules.combinators import broadcast, leibniz, scaled, unbroadcast
from hoad.rules.linalg_ops import _eye, _phi

aten = torch.ops.aten
OPS = RuleTable("linalg")


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


def inv_rule(ctx: Ctx, A: Jet):
    X = ctx.out
    return _result(ctx, _solve_blocks(ctx, closure(ctx.keys), _jet(A), None, X, X, left=True))


def inv_vjp(v, g: Block, A: Jet):
    X = Block.dense(v.out)
    b, i, k, j = _labels(v.out.ndim - 2)
    l = ("m", 3)
    rest = _rest(g, v.out.ndim)
    return [(A, contract([(X, b + [k, i]), (g, b + [k, l] + rest), (X, b + [j, l])], b + [i, j] + rest,
                         target=v.target).neg())]


OPS.register(torch.ops.hoad_linalg.inv.default, rule=inv_rule, vjp=inv_vjp)


def solve_rule(ctx: Ctx, A, B):
    A, B = _jet(A), _jet(B)
    Ainv = torch.ops.hoad_linalg.inv(A.primal)
    return _result(ctx, _solve_blocks(ctx, closure(ctx.keys), A, B, ctx.out, Ainv, left=True))


def solve_vjp(v, g: Block, A, B):
    return _solve_cotangents(v, g, A, B, torch.ops.hoad_linalg.inv(_jet(A).primal), v.out, True)


OPS.register(torch.ops.hoad_linalg.solve.default, rule=solve_rule, vjp=solve_vjp)


def _triangle(n: int, upper: bool, unitriangular: bool, like: torch.Tensor) -> torch.Tensor:
    """1 on the entries of A a triangular solve reads (the diagonal too unless unit), else 0."""
    ones = torch.ones(n, n, dtype=like.dtype, device=like.device)
    if unitriangular:
        return ones.triu(1) if upper else ones.tril(-1)
    return ones.triu() if upper else ones.tril()


def solve_triangular_rule(ctx: Ctx, A, B, *, upper: bool, left: bool = True, unitriangular: bool = False):
    A, B = _batched(_jet(A), _jet(B))
    n = A.shape[-1]
    inner = ctx.inner(ctx.out)
    T = Jet(A.primal, scaled(inner, A, _triangle(n, upper, unitriangular, A.primal), A.shape)) if A.varies else A
    Tinv = aten.linalg_solve_triangular(A.primal, _eye(n, A.primal), upper=upper, unitriangular=unitriangular)
    return _result(ctx, _solve_blocks(ctx, closure(ctx.keys), T, B, ctx.out, Tinv, left))


def solve_triangular_vjp(v, g: Block, A, B, *, upper: bool, left: bool = True, unitriangular: bool = False):
    a = _jet(A).primal
    n = a.shape[-1]
    Tinv = aten.linalg_solve_triangular(a, _eye(n, a), upper=upper, unitriangular=unitriangular)
    return _solve_cotangents(v, g, A, B, Tinv, v.out, left, _triangle(n, upper, unitriangular, a))


OPS.register(aten.linalg_solve_triangular.default, rule=solve_triangular_rule, vjp=solve_triangular_vjp)


def _symmetric(ctx: Ctx, A: Jet) -> Jet:
    """(A + Aᵀ)/2: torch's derivatives of a Cholesky factor are those of the symmetric part."""
    r = A.ndim
    perm = list(range(r - 2)) + [r - 1, r - 2]
    blocks = {K: add([b, b.permute(perm + list(range(r, b.ndim)))]).scale(0.5) for K, b in A.blocks.items()
              if K in ctx.keys}
    return Jet(A.primal, blocks)


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


OPS.register(aten.cholesky.default, torch.ops.hoad_linalg.cholesky.default, rule=cholesky_rule,
             vjp=cholesky_vjp)


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


def logabsdet_vjp(v, g: Block, A: Jet):
    b, i, _k, j = _labels(A.ndim - 2)
    rest = _rest(g, v.out.ndim)
    X = Block.dense(torch.ops.hoad_linalg.inv(A.primal))
    return [(A, contract([(g, b + rest), (X, b + [j, i])], b + [i, j] + rest, target=v.target))]


OPS.register(torch.ops.hoad_linalg.logabsdet.default, rule=logabsdet_rule, vjp=logabsdet_vjp)


# ------------------------------------------------------------------------- the VJPs' helpers
def _rest(g: Block, r: int) -> list:
    return [("f", a) for a in range(g.ndim - r)]


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


