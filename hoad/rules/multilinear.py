"""Multilinear ops: Leibniz over the factors, each factor named by its einsum labels."""

from __future__ import annotations

from dataclasses import replace

import torch

from hoad.algebra import Block, contract
from hoad.errors import HoadInternalError
from hoad.rules.arithmetic import _select, _spread
from hoad.rules.base import Ctx, Jet, RuleTable, out_labels
from hoad.rules.combinators import Scaled, broadcast, chain, leibniz, scaled
from hoad.rules.elementwise import atan, reciprocal
from hoad.rules.flat import _all, _extremum
from hoad.rules.flat import _product as _product_flat

aten = torch.ops.aten
OPS = RuleTable("multilinear")


def _varies(x) -> bool:
    return isinstance(x, Jet) and not x.constant


def _value(x):
    return x.primal if isinstance(x, Jet) else x


def _product(ctx: Ctx, a, b) -> dict:
    """Elementwise a ⊙ b with broadcasting."""
    shape = tuple(ctx.out.shape)
    if not _varies(a):
        return scaled(ctx, b, _value(a), shape)
    if not _varies(b):
        return scaled(ctx, a, _value(b), shape)
    o = out_labels(len(shape))
    return leibniz(ctx, [(broadcast(a, shape), o), (broadcast(b, shape), o)], o, shape)


def mul_rule(ctx: Ctx, a, b):
    return _product(ctx, a, b)


def mul_vjp(v, g: Block, a, b):
    return _product_vjp(v, g, a, b)


OPS.register(aten.mul.Tensor, rule=mul_rule, vjp=mul_vjp, flat=_product_flat)


def mul_scalar_rule(ctx: Ctx, a: Jet, s):
    return scaled(ctx, a, s, tuple(ctx.out.shape))


def mul_scalar_vjp(v, g: Block, a: Jet, s):
    return [(a, g.scale(s))]


OPS.register(aten.mul.Scalar, rule=mul_scalar_rule, vjp=mul_scalar_vjp, flat=lambda *args, **kwargs: _all(*args))


def div_rule(ctx: Ctx, a, b):
    """a / b: linear in a when b is constant; otherwise a ⊙ reciprocal(b)."""
    if not _varies(b):
        return scaled(ctx, a, 1.0 / _value(b) if not isinstance(_value(b), torch.Tensor) else _value(b).reciprocal(),
                      tuple(ctx.out.shape))
    inner = ctx.inner(b.primal.reciprocal())
    rb = Jet(inner.out, chain(inner, b, reciprocal(inner.max_order, b.primal, inner.out)))
    return _product(ctx, a, rb)


def div_vjp(v, g: Block, a, b):
    vb = _value(b)
    inv = vb.reciprocal() if isinstance(vb, torch.Tensor) else 1.0 / vb
    terms = [(a, inv)]
    if _varies(b):
        terms.append((b, -v.out * inv))
    return _spread(v, g, terms)


OPS.register(aten.div.Tensor, rule=div_rule, vjp=div_vjp, flat=lambda *args, **kwargs: _all(*args))


def div_scalar_rule(ctx: Ctx, a: Jet, s):
    return scaled(ctx, a, 1.0 / s, tuple(ctx.out.shape))


def div_scalar_vjp(v, g: Block, a: Jet, s):
    return [(a, g.scale(1.0 / s))]


OPS.register(aten.div.Scalar, rule=div_scalar_rule, vjp=div_scalar_vjp, flat=lambda *args, **kwargs: _all(*args))


def _contraction(ctx: Ctx, a, b, la: str, lb: str, lo: str) -> dict:
    a = a if isinstance(a, Jet) else Jet(a)
    b = b if isinstance(b, Jet) else Jet(b)
    return leibniz(ctx, [(a, list(la)), (b, list(lb))], list(lo), tuple(ctx.out.shape))


def mm_rule(ctx: Ctx, a, b):
    return _contraction(ctx, a, b, "ik", "kj", "ij")


def mm_vjp(v, g: Block, a, b):
    return _contraction_vjp(v, g, a, b, "ik", "kj", "ij")


OPS.register(aten.mm.default, rule=mm_rule, vjp=mm_vjp)


def bmm_rule(ctx: Ctx, a, b):
    return _contraction(ctx, a, b, "bik", "bkj", "bij")


def bmm_vjp(v, g: Block, a, b):
    return _contraction_vjp(v, g, a, b, "bik", "bkj", "bij")


OPS.register(aten.bmm.default, rule=bmm_rule, vjp=bmm_vjp)


def _matmul_labels(a, b) -> tuple[str, str, str]:
    """``a [..., k] @ b [k, j]`` or ``a [..., i, k] @ b [..., k, j]`` (the same leading axes), the
    only matmuls in a captured graph: torch decomposes the user's, and hoad's sample pass
    (passes/samples.py) writes these, keeping the leading axes apart."""
    va, vb = _value(a), _value(b)
    ra, rb = va.ndim, vb.ndim
    if rb == 2 and 2 <= ra <= len(_KEPT) + 1:
        kept = _KEPT[:ra - 1]
        return kept + "k", "kj", kept + "j"
    if ra == rb and 3 <= ra <= len(_KEPT) + 2 and va.shape[:-2] == vb.shape[:-2]:
        kept = _KEPT[:ra - 2]
        return kept + "ik", kept + "kj", kept + "ij"
    raise HoadInternalError(f"matmul of shapes {tuple(va.shape)} and {tuple(vb.shape)} in a captured graph: hoad "
                            "writes only [..., k] @ [k, j] and [..., i, k] @ [..., k, j]")


_KEPT = "abcdefghlmnopqrstuvwxyz"   # labels of the leading axes (not i, j, k)


def matmul_rule(ctx: Ctx, a, b):
    return _contraction(ctx, a, b, *_matmul_labels(a, b))


def matmul_vjp(v, g: Block, a, b):
    return _contraction_vjp(v, g, a, b, *_matmul_labels(a, b))


OPS.register(aten.matmul.default, rule=matmul_rule, vjp=matmul_vjp)


def _pick(ctx: Ctx, a, b, take_a: torch.Tensor) -> dict:
    """Blocks of an elementwise choice between a and b; ``take_a`` weighs a (ties share)."""
    from hoad.rules.arithmetic import _combine

    return _combine(ctx, [(a, take_a), (b, 1 - take_a)])


def maximum_rule(ctx: Ctx, a, b):
    """Ties give each side half the derivative, as torch's backward does."""
    va, vb = _value(a), _value(b)
    return _pick(ctx, a, b, (va > vb).to(ctx.out.dtype) + 0.5 * (va == vb).to(ctx.out.dtype))


def maximum_vjp(v, g: Block, a, b):
    va, vb = _value(a), _value(b)
    return _pick_vjp(v, g, a, b, (va > vb).to(v.out.dtype) + 0.5 * (va == vb).to(v.out.dtype))


OPS.register(aten.maximum.default, rule=maximum_rule, vjp=maximum_vjp, flat=_extremum(True))


def minimum_rule(ctx: Ctx, a, b):
    va, vb = _value(a), _value(b)
    return _pick(ctx, a, b, (va < vb).to(ctx.out.dtype) + 0.5 * (va == vb).to(ctx.out.dtype))


def minimum_vjp(v, g: Block, a, b):
    va, vb = _value(a), _value(b)
    return _pick_vjp(v, g, a, b, (va < vb).to(v.out.dtype) + 0.5 * (va == vb).to(v.out.dtype))


OPS.register(aten.minimum.default, rule=minimum_rule, vjp=minimum_vjp, flat=_extremum(False))


# ------------------------------------------------------------------------- the VJPs' helpers
def _product_vjp(v, g: Block, a, b) -> list:
    """g ⊙ (the other factor), summed back to each factor's shape."""
    return _spread(v, g, [(a, _value(b)), (b, _value(a))])


def _contraction_vjp(v, g: Block, a, b, la: str, lb: str, lo: str) -> list:
    """Cotangents of an einsum of two factors: contract g with the other factor's value."""
    rest = [("f", i) for i in range(g.ndim - len(lo))]
    pairs = []
    for x, lx, other, lother in ((a, la, b, lb), (b, lb, a, la)):
        if _varies(x):
            got = contract([(g, list(lo) + rest), (Block.dense(_value(other)), list(lother))], list(lx) + rest,
                           target=v.target)
            pairs.append((x, got))
    return pairs


def _pick_vjp(v, g: Block, a, b, take_a: torch.Tensor) -> list:
    return _spread(v, g, [(a, take_a), (b, 1 - take_a)])


def _ratio(ctx: Ctx, num: Jet, den: Jet, taken: torch.Tensor) -> Jet:
    """num / den, with den replaced by 1 where ``taken`` is false (no inf or NaN made there)."""
    safe = Jet(torch.where(taken, den.primal, torch.ones_like(den.primal)), den.blocks, den.varies)
    value = num.primal / safe.primal
    return Jet(value, div_rule(ctx.inner(value), num, safe))


def atan2_rule(ctx: Ctx, a: Jet, b: Jet):
    """atan2(a, b) has the derivatives of atan(a/b) where |a| <= |b| and of -atan(b/a) elsewhere
    (each differs from it by a constant where defined): one branch per entry, each ratio
    formed only where it is taken. At the origin, where the angle is discontinuous, every
    derivative is NaN: torch's 0 at order 1 made a smooth composite silently wrong (r² cos 2θ =
    x² - y² had Hessian diag(2, 2) there, not diag(2, -2)). The blocks are returned uncontracted,
    also as remainders."""
    shape = tuple(ctx.out.shape)
    a, b = broadcast(a, shape), broadcast(b, shape)
    first = a.primal.abs() <= b.primal.abs()
    plain = replace(ctx, adjoint=None)
    branches = []
    for (num, den, taken), sign in (((a, b, first), 1), ((b, a, ~first), -1)):
        q = _ratio(ctx, num, den, taken)
        d = atan(ctx.max_order, q.primal, q.primal.atan())
        coeffs = Scaled([c * sign for c in d.coeffs], d.scale)
        branches.append((Jet(ctx.out, chain(plain, q, coeffs)), taken))
    return _select(plain, branches)


def atan2_vjp(v, g: Block, a, b):
    va, vb = _value(a), _value(b)
    r2 = va * va + vb * vb  # (0 / 0 = NaN at the origin, as in the forward rule)
    return _spread(v, g, [(a, vb / r2), (b, -va / r2)])


OPS.register(aten.atan2.default, rule=atan2_rule, vjp=atan2_vjp)
