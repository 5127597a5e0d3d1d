"""Reductions that are not linear sums: products and maxima."""

from __future__ import annotations

import torch

from hoad.algebra import along, map_out, reshape_out, sum_out
from hoad.rules.base import Ctx, Jet, RuleTable, out_labels
from hoad.rules.combinators import leibniz, linear, on_0d, on_0d_vjp, scaled
from hoad.rules.linear import _dims

aten = torch.ops.aten
RULES = RuleTable("reduction")


def _narrow(ctx: Ctx, x: Jet, d: int, start: int, n: int, value: torch.Tensor) -> Jet:
    r = x.ndim
    new = tuple(value.shape)
    return Jet(value, linear(ctx, x, lambda b: map_out(b, r, lambda t: t.narrow(d, start, n), new, along(r, [d]))))


def _tree_product(ctx: Ctx, x: Jet, d: int) -> Jet:
    """Product along axis ``d`` (kept with size 1) as a tree of elementwise products.

    Exact where x has zeros (no division). The axis is padded with ones to a power of two and
    halved; every level is an elementwise product, differentiated by Leibniz.
    """
    inner = ctx.inner(x.primal)
    n = x.shape[d]
    width = 1
    while width < n:
        width *= 2
    if width != n:
        r, new = x.ndim, list(x.shape)
        new[d] = width
        spec = lambda t, pad: [0, 0] * (t.ndim - d - 1) + [0, pad]  # noqa: E731
        primal = aten.constant_pad_nd(x.primal, spec(x.primal, width - n), 1.0)
        x = Jet(primal, linear(inner, x, lambda b: map_out(b, r, lambda t: aten.constant_pad_nd(t, spec(t, width - n), 0.0),
                                                           new, along(r, [d]))))
    while x.shape[d] > 1:
        h = x.shape[d] // 2
        lo = _narrow(inner, x, d, 0, h, x.primal.narrow(d, 0, h))
        hi = _narrow(inner, x, d, h, h, x.primal.narrow(d, h, h))
        value = lo.primal * hi.primal
        o = out_labels(value.ndim)
        x = Jet(value, leibniz(inner.inner(value), [(lo, o), (hi, o)], o, tuple(value.shape)))
    return x


@RULES.register(aten.prod.dim_int, aten.prod.default)
@on_0d(reduces=True)
def prod_rule(ctx: Ctx, x: Jet, dim=None, keepdim: bool = False, dtype=None):
    out_shape = tuple(ctx.out.shape)
    if dim is None:  # all elements: flatten first
        flat = Jet(x.primal.reshape(-1), linear(ctx.inner(x.primal), x, lambda b: reshape_out(b, x.ndim, [x.primal.numel()])))
        p = _tree_product(ctx, flat, 0)
    else:
        p = _tree_product(ctx, x, dim % max(x.ndim, 1))
    r = p.ndim
    return {K: reshape_out(b, r, out_shape).to(ctx.out.dtype) for K, b in p.blocks.items() if K in ctx.keys}


def _select_max(ctx: Ctx, x: Jet, dims: list[int], keepdim: bool, mask: torch.Tensor) -> dict:
    """Blocks of a max-like reduction: Σ_dims mask ⊙ Dx, with mask the (weighted) arg-max."""
    r = x.ndim
    picked = scaled(ctx, x, mask, x.shape)
    return {K: sum_out(b, r, dims, keepdim) for K, b in picked.items()}


@RULES.register(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
@on_0d(reduces=True)
def amax_rule(ctx: Ctx, x: Jet, dim=(), keepdim: bool = False):
    """Ties share the derivative equally, as torch's backward does."""
    dims = _dims(dim, x.ndim)
    kept = ctx.out
    if not keepdim:
        shape = [1 if a in dims else n for a, n in enumerate(x.shape)]
        kept = ctx.out.reshape(shape)
    hit = (x.primal == kept).to(x.primal.dtype)
    weight = hit / hit.sum(dims, keepdim=True) if dims else hit
    return _select_max(ctx, x, dims, keepdim, weight)


@RULES.register(aten.max.dim, aten.min.dim)
@on_0d(reduces=True)
def max_dim_rule(ctx: Ctx, x: Jet, dim: int, keepdim: bool = False):
    """(values, indices): the derivative follows the returned index, as torch's backward does."""
    d = dim % max(x.ndim, 1)
    values, indices = ctx.out
    idx = indices if keepdim else indices.unsqueeze(d)
    one_hot = torch.zeros_like(x.primal).scatter(d, idx, 1.0)
    return [_select_max(ctx, x, [d], keepdim, one_hot), {}]


# ---------------------------------------------------------------------------------- VJPs
VJPS = RuleTable("reduction")


def _exclusive_product(x: torch.Tensor, d: int) -> torch.Tensor:
    """Π_{j≠i} x_j along ``d`` for every i, without division (exact where x has zeros)."""
    n = x.shape[d]
    ones = torch.ones_like(x.narrow(d, 0, 1))
    left = torch.cat([ones, x.narrow(d, 0, n - 1)], d).cumprod(d)
    flipped = x.flip(d)
    right = torch.cat([ones, flipped.narrow(d, 0, n - 1)], d).cumprod(d).flip(d)
    return left * right


@VJPS.register(aten.prod.dim_int, aten.prod.default)
@on_0d_vjp(reduces=True)
def prod_vjp(v, g: Block, x: Jet, dim=None, keepdim: bool = False, dtype=None):
    from hoad.rules.combinators import scale_out
    from hoad.rules.linear import _unsum

    if dim is None:
        flat = x.primal.reshape(-1)
        coeff = _exclusive_product(flat, 0).reshape(x.shape) if flat.numel() else flat.reshape(x.shape)
        spread = _unsum(g, x, None, False)
    else:
        d = dim % max(x.ndim, 1)
        coeff = _exclusive_product(x.primal, d)
        spread = _unsum(g, x, [d], keepdim)
    return [(x, scale_out(spread, coeff, x.shape).to(x.primal.dtype))]


def _max_vjp(g: Block, x: Jet, dims: list[int], keepdim: bool, weight: torch.Tensor) -> list:
    from hoad.rules.combinators import scale_out
    from hoad.rules.linear import _unsum

    return [(x, scale_out(_unsum(g, x, dims, keepdim), weight, x.shape))]


@VJPS.register(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default)
@on_0d_vjp(reduces=True)
def amax_vjp(v, g: Block, x: Jet, dim=(), keepdim: bool = False):
    dims = _dims(dim, x.ndim)
    kept = v.out if keepdim else v.out.reshape([1 if a in dims else n for a, n in enumerate(x.shape)])
    hit = (x.primal == kept).to(x.primal.dtype)
    weight = hit / hit.sum(dims, keepdim=True) if dims else hit
    return _max_vjp(g, x, dims, keepdim, weight)


@VJPS.register(aten.max.dim, aten.min.dim)
@on_0d_vjp(reduces=True)
def max_dim_vjp(v, g, x: Jet, dim: int, keepdim: bool = False):
    if g[0] is None:
        return []
    d = dim % max(x.ndim, 1)
    values, indices = v.out
    idx = indices if keepdim else indices.unsqueeze(d)
    one_hot = torch.zeros_like(x.primal).scatter(d, idx, 1.0)
    return _max_vjp(g[0], x, [d], keepdim, one_hot)
