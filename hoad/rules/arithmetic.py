"""Entrywise linear ops: sums (neg, add, sub), fmod, remainder and nextafter (an argument plus a
piecewise-constant multiple of another), and selections between arguments (where, clamp with
tensor bounds), each entry taken from one branch.

Blocks are combined with constant coefficients or chosen by constant masks, entry by entry; the
helpers here (``_combine``, ``_select`` and their VJPs ``_spread``, ``_select_vjp``) serve the
elementwise and multilinear families too.
"""

from __future__ import annotations

import torch

from hoad.algebra import Block, select_out
from hoad.rules.base import Ctx, Jet, RuleTable
from hoad.rules.combinators import broadcast, linear, scale_out, scaled, sum_blocks, unbroadcast
from hoad.rules.flat import _all, _branches, _chosen

aten = torch.ops.aten
OPS = RuleTable("linear")


def neg_rule(ctx: Ctx, x: Jet):
    return linear(ctx, x, Block.neg)


def neg_vjp(v, g: Block, x: Jet):
    return [(x, g.neg())]


OPS.register(aten.neg.default, rule=neg_rule, vjp=neg_vjp, flat=lambda *args, **kwargs: _all(*args))


def _combine(ctx: Ctx, terms: list[tuple[object, float]]) -> dict:
    """Blocks of Σ c_i x_i with constant c_i, broadcasting to the output (numbers carry no blocks)."""
    shape = tuple(ctx.out.shape)
    parts = [scaled(ctx, x, c, shape) for x, c in terms if isinstance(x, Jet) and not x.constant]
    return {K: b.to(ctx.out.dtype) for K, b in sum_blocks(*parts).items()}


def add_rule(ctx: Ctx, a, b, alpha=1):
    return _combine(ctx, [(a, 1.0), (b, alpha)])


def add_vjp(v, g: Block, a, b, alpha=1):
    return _spread(v, g, [(a, 1.0), (b, alpha)])


OPS.register(aten.add.Tensor, rule=add_rule, vjp=add_vjp, flat=lambda *args, **kwargs: _all(*args))


def sub_rule(ctx: Ctx, a, b, alpha=1):
    return _combine(ctx, [(a, 1.0), (b, -alpha)])


def sub_vjp(v, g: Block, a, b, alpha=1):
    return _spread(v, g, [(a, 1.0), (b, -alpha)])


OPS.register(aten.sub.Tensor, rule=sub_rule, vjp=sub_vjp, flat=lambda *args, **kwargs: _all(*args))


def add_scalar_rule(ctx: Ctx, a: Jet, other, alpha=1):
    return _combine(ctx, [(a, 1.0)])


def add_scalar_vjp(v, g: Block, a: Jet, other, alpha=1):
    return [(a, g)]


OPS.register(aten.add.Scalar, aten.sub.Scalar, rule=add_scalar_rule, vjp=add_scalar_vjp,
             flat=lambda *args, **kwargs: _all(*args))


def _quotient(a, b, mode: str) -> torch.Tensor:
    """The piecewise-constant q of ``a - q·b``: a/b rounded by ``mode`` ("trunc" or "floor")."""
    va, vb = (x.primal if isinstance(x, Jet) else x for x in (a, b))
    if not isinstance(va, torch.Tensor):
        va = torch.as_tensor(va, dtype=vb.dtype, device=vb.device)
    return torch.div(va, vb, rounding_mode=mode)


def _modulo_terms(a, b, mode: str) -> list[tuple[object, object]]:
    """fmod(a, b) = a - trunc(a/b)·b, remainder(a, b) = a - floor(a/b)·b: linear in (a, b) with
    the quotient constant almost everywhere, as torch's derivatives have it."""
    varies = isinstance(b, Jet) and not b.constant
    return [(a, 1.0), (b, -_quotient(a, b, mode) if varies else 0.0)]


def fmod_rule(ctx: Ctx, a, b):
    return _combine(ctx, _modulo_terms(a, b, "trunc"))


def fmod_vjp(v, g: Block, a, b):
    return _spread(v, g, _modulo_terms(a, b, "trunc"))


OPS.register(aten.fmod.Tensor, aten.fmod.Scalar, rule=fmod_rule, vjp=fmod_vjp)


def remainder_rule(ctx: Ctx, a, b):
    return _combine(ctx, _modulo_terms(a, b, "floor"))


def remainder_vjp(v, g: Block, a, b):
    return _spread(v, g, _modulo_terms(a, b, "floor"))


OPS.register(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, rule=remainder_rule,
             vjp=remainder_vjp)


def nextafter_rule(ctx: Ctx, a, b):
    """nextafter(a, b) is a moved by one ulp towards b: a plus a piecewise-constant step, so its
    derivative is a's (b's is zero almost everywhere); where a = b it is b, and torch takes both
    derivatives as 0 there."""
    return _combine(ctx, [(a, _moved(a, b))])


def nextafter_vjp(v, g: Block, a, b):
    return _spread(v, g, [(a, _moved(a, b))])


OPS.register(aten.nextafter.default, rule=nextafter_rule, vjp=nextafter_vjp)


def _moved(a, b) -> torch.Tensor:
    """1 where nextafter(a, b) moves a, 0 where a = b."""
    va = a.primal if isinstance(a, Jet) else a
    vb = b.primal if isinstance(b, Jet) else b
    return (va != vb).to(va.dtype)


def _select(ctx: Ctx, branches: list[tuple[object, torch.Tensor]]) -> dict:
    """Blocks of an entrywise choice between arguments, each supplying the entries of its mask:
    Σ where(mask, Dx, 0). A selection, not a product with the mask: the branch not taken may
    have inf or NaN derivatives (log at 0 in ``xlogy``, a fully masked softmax row), and they
    must not leak."""
    shape, r = tuple(ctx.out.shape), ctx.out.ndim
    parts = []
    for x, mask in branches:
        if isinstance(x, Jet) and not x.constant:
            xb = broadcast(x, shape)
            parts.append({K: select_out(blk, r, mask) for K, blk in xb.blocks.items() if K in ctx.keys})
    return {K: blk.to(ctx.out.dtype) for K, blk in sum_blocks(*parts).items()}


def _select_vjp(v, g: Block, branches: list[tuple[object, torch.Tensor]]) -> list:
    r = v.out.ndim
    return [(x, unbroadcast(select_out(g, r, mask), r, x.shape).to(x.primal.dtype))
            for x, mask in branches if isinstance(x, Jet) and not x.constant]


def where_rule(ctx: Ctx, cond, a, b):
    """where(c, a, b) with a constant condition: where(c, Da, 0) + where(c, 0, Db)."""
    return _select(ctx, _branches(cond, a, b))


def where_vjp(v, g: Block, cond, a, b):
    return _select_vjp(v, g, _branches(cond, a, b))


OPS.register(aten.where.self, rule=where_rule, vjp=where_vjp, flat=lambda cond, a, b: _chosen(_branches(cond, a, b)))


def _clamp_branches(x: Jet, lo, hi) -> list[tuple[object, torch.Tensor]]:
    """clamp(x, lo, hi) with tensor bounds, as torch's backward assigns it: x where lo <= x <= hi,
    lo where x < lo < hi, hi where x > hi or hi < lo (then every entry is hi)."""
    v, vlo, vhi = x.primal, lo.primal if isinstance(lo, Jet) else lo, hi.primal if isinstance(hi, Jet) else hi
    inside = torch.ones_like(v, dtype=torch.bool)
    branches = []
    if vlo is not None:
        inside = inside & (v >= vlo)
        below = v < vlo
        if vhi is not None:
            below = below & (vlo < vhi)
        branches.append((lo, below))
    if vhi is not None:
        inside = inside & (v <= vhi)
        above = v > vhi
        if vlo is not None:
            above = above | (vhi < vlo)
        branches.append((hi, above))
    return [(x, inside)] + branches


def clamp_tensor_rule(ctx: Ctx, x: Jet, min=None, max=None):
    return _select(ctx, _clamp_branches(x, min, max))


def clamp_tensor_vjp(v, g: Block, x: Jet, min=None, max=None):
    return _select_vjp(v, g, _clamp_branches(x, min, max))


OPS.register(aten.clamp.Tensor, rule=clamp_tensor_rule, vjp=clamp_tensor_vjp,
             flat=lambda x, min=None, max=None: _chosen(_clamp_branches(x, min, max)))


# ------------------------------------------------------------------ helpers of other families
def _spread(v, g: Block, terms: list[tuple[object, object]]) -> list:
    """Cotangents of Σ c_i x_i: g ⊙ c_i summed back to each varying x_i's shape."""
    r = v.out.ndim
    shape = tuple(v.out.shape)
    return [(x, unbroadcast(scale_out(g, c, shape), r, x.shape).to(x.primal.dtype))
            for x, c in terms if isinstance(x, Jet) and not x.constant]


