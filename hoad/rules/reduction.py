"""Reductions that are not linear sums (products, maxima, selections) and the scans that are not
cumulative sums (cumprod, logcumsumexp, cummax/cummin)."""

from __future__ import annotations

import functools
import itertools
import math
import operator

import torch

from hoad.algebra import Block, add, along, contract, expand_out, map_out, reshape_out, sum_out, unsqueeze_out
from hoad.rules.base import Ctx, Jet, RuleTable, out_labels
from hoad.rules.combinators import chain, leibniz, linear, on_0d, on_0d_vjp, scale_out, scaled
from hoad.rules.elementwise import log as log_derivatives
from hoad.rules.linear import _dims, _scatter_along, _select_along

aten = torch.ops.aten
OPS = RuleTable("reduction")


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
        def padded(t):
            return aten.constant_pad_nd(t, spec(t, width - n), 0.0)

        x = Jet(primal, linear(inner, x, lambda b: map_out(b, r, padded, new, along(r, [d]))))
    while x.shape[d] > 1:
        h = x.shape[d] // 2
        lo = _narrow(inner, x, d, 0, h, x.primal.narrow(d, 0, h))
        hi = _narrow(inner, x, d, h, h, x.primal.narrow(d, h, h))
        value = lo.primal * hi.primal
        o = out_labels(value.ndim)
        x = Jet(value, leibniz(inner.inner(value), [(lo, o), (hi, o)], o, tuple(value.shape)))
    return x


@on_0d(reduces=True)
def prod_rule(ctx: Ctx, x: Jet, dim=None, keepdim: bool = False, dtype=None):
    out_shape = tuple(ctx.out.shape)
    if dtype is not None and dtype != x.primal.dtype:
        x = Jet(x.primal.to(dtype), {K: b.to(dtype) for K, b in x.blocks.items()}, x.varies, x.flat)
    d = 0 if dim is None else dim % max(x.ndim, 1)
    if dim is None:  # all elements: flatten first
        x = Jet(x.primal.reshape(-1),
                linear(ctx.inner(x.primal), x, lambda b: reshape_out(b, x.ndim, [x.primal.numel()])))
    if _by_derivatives(ctx, x.shape[d]):
        keep = keepdim and dim is not None
        return chain(ctx, x, _product_derivatives(x.primal, d, ctx.max_order, keep), axis=d, keepdim=keep)
    p = _tree_product(ctx, x, d)
    return {K: reshape_out(b, p.ndim, out_shape) for K, b in p.blocks.items() if K in ctx.keys}


@on_0d_vjp(reduces=True)
def prod_vjp(v, g: Block, x: Jet, dim=None, keepdim: bool = False, dtype=None):
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


OPS.register(aten.prod.dim_int, aten.prod.default, rule=prod_rule, vjp=prod_vjp)


def _by_derivatives(ctx: Ctx, n: int) -> bool:
    """Whether a product of ``n`` entries is cheaper from its derivative tensors (Faà di Bruno:
    about n^k products per output entry at order k) than as a tree of pairwise products (about
    n·S^k for slots of S entries, 2^k Leibniz terms each): the tensors win unless the slots are
    much smaller than the line (a product over a wide hidden layer of a few inputs). In diagonal
    mode (pure derivatives, the operators, packed=True) the slots share one label, so the tree
    costs about n·2^k whatever S is, and the tensors win only for n <= 2: an order-6 product over
    8 entries along 1716 directions built 15000 ATen calls in 20 s from the tensors."""
    if ctx.diagonal:
        return n >= 1 and (ctx.max_order <= 1 or n <= 2)
    sizes = [math.prod(s[1:] if ctx.batched and k not in ctx.shared else s) for k, s in enumerate(ctx.slot_shapes)]
    return n >= 1 and (ctx.max_order <= 1 or n <= 2 * max(sizes, default=1))


def _product_derivatives(x: torch.Tensor, d: int, order: int, keepdim: bool) -> list:
    """∂^m Π_l x_l along axis ``d`` for m = 1..order, at every output entry: tensors with the
    output's axes then m axes of the line, holding Π_{l ∉ {i1..im}} x_l at distinct indices and
    0 at repeated ones (None past the line's length, where a product of n entries has no terms).

    No division (exact where x has zeros): for i1 < ... < im the entry is the product of the runs
    between the indices, L[i1] · M[i1, i2] ··· M[i(m-1), im] · R[im], with L and R the products
    before and after an index and M[i, j] the product strictly between; the other orders of the
    indices are permutations of it."""
    line = x.movedim(d, -1)
    n, rest = line.shape[-1], line.shape[:-1]
    ones = torch.ones_like(line.narrow(-1, 0, 1))
    before = torch.cat([ones, line.narrow(-1, 0, n - 1)], -1).cumprod(-1)
    after = torch.cat([line.flip(-1).narrow(-1, 0, n - 1).cumprod(-1).flip(-1), ones], -1)
    idx = torch.arange(n, device=x.device)
    past = idx[None, :] > idx[:, None]                                          # [i, l]: l > i
    if order >= 2:  # M[i, j] for i < j, else 0
        upto = torch.where(past, line.unsqueeze(-2), 1.0).cumprod(-1)          # Π_{i < l' <= l}
        between = torch.cat([ones.unsqueeze(-1).expand(*line.shape, 1), upto.narrow(-1, 0, n - 1)], -1)
        between = torch.where(past, between, 0.0)
    coeffs = []
    for m in range(1, order + 1):
        if m > n:
            coeffs.append(None)
            continue

        def on_axes(t: torch.Tensor, axes: list[int]) -> torch.Tensor:  # t's line axes onto these of m
            return t.reshape(*rest, *[n if a in axes else 1 for a in range(m)])  # noqa: B023

        # multiplied small first, so only one product has all m axes
        runs = [on_axes(between, [k - 1, k]) for k in range(1, m)] or [torch.ones_like(ones)]
        runs[0] = on_axes(before, [0]) * runs[0]
        runs[-1] = runs[-1] * on_axes(after, [m - 1])
        rising = functools.reduce(operator.mul, runs)
        lead = len(rest)
        coeff = functools.reduce(operator.add, (rising.permute(*range(lead), *[lead + p for p in perm])
                                                for perm in itertools.permutations(range(m))))
        coeffs.append(coeff.unsqueeze(d) if keepdim else coeff)
    return coeffs


def _select_max(ctx: Ctx, x: Jet, dims: list[int], keepdim: bool, mask: torch.Tensor) -> dict:
    """Blocks of a max-like reduction: Σ_dims mask ⊙ Dx, with mask the (weighted) arg-max."""
    r = x.ndim
    picked = scaled(ctx, x, mask, x.shape)
    return {K: sum_out(b, r, dims, keepdim) for K, b in picked.items()}


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


@on_0d_vjp(reduces=True)
def amax_vjp(v, g: Block, x: Jet, dim=(), keepdim: bool = False):
    dims = _dims(dim, x.ndim)
    kept = v.out if keepdim else v.out.reshape([1 if a in dims else n for a, n in enumerate(x.shape)])
    hit = (x.primal == kept).to(x.primal.dtype)
    weight = hit / hit.sum(dims, keepdim=True) if dims else hit
    return _max_vjp(g, x, dims, keepdim, weight)


OPS.register(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default, rule=amax_rule,
             vjp=amax_vjp)


@on_0d(reduces=True)
def max_dim_rule(ctx: Ctx, x: Jet, dim: int, keepdim: bool = False):
    """(values, indices): the derivative follows the returned index, as torch's backward does."""
    d = dim % max(x.ndim, 1)
    values, indices = ctx.out
    idx = indices if keepdim else indices.unsqueeze(d)
    one_hot = torch.zeros_like(x.primal).scatter(d, idx, 1.0)
    return [_select_max(ctx, x, [d], keepdim, one_hot), {}]


@on_0d_vjp(reduces=True)
def max_dim_vjp(v, g, x: Jet, dim: int, keepdim: bool = False):
    if g[0] is None:
        return []
    d = dim % max(x.ndim, 1)
    values, indices = v.out
    idx = indices if keepdim else indices.unsqueeze(d)
    one_hot = torch.zeros_like(x.primal).scatter(d, idx, 1.0)
    return _max_vjp(g[0], x, [d], keepdim, one_hot)


OPS.register(aten.max.dim, aten.min.dim, aten.median.dim, aten.nanmedian.dim, rule=max_dim_rule,
             vjp=max_dim_vjp)


def mode_rule(ctx: Ctx, x: Jet, dim: int = -1, keepdim: bool = False):
    return max_dim_rule(ctx, x, dim, keepdim)


def mode_vjp(v, g, x: Jet, dim: int = -1, keepdim: bool = False):
    return max_dim_vjp(v, g, x, dim, keepdim)


OPS.register(aten.mode.default, rule=mode_rule, vjp=mode_vjp)


def kthvalue_rule(ctx: Ctx, x: Jet, k: int, dim: int = -1, keepdim: bool = False):
    return max_dim_rule(ctx, x, dim, keepdim)


def kthvalue_vjp(v, g, x: Jet, k: int, dim: int = -1, keepdim: bool = False):
    return max_dim_vjp(v, g, x, dim, keepdim)


OPS.register(aten.kthvalue.default, rule=kthvalue_rule, vjp=kthvalue_vjp)


def _median_weight(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The median of all entries: entries equal to it (NaN ones, when it is NaN) share the
    derivative equally, as torch's backward does."""
    hit = ((x == value) | (x.isnan() & value.isnan())).to(x.dtype)
    return hit / hit.sum()


def median_rule(ctx: Ctx, x: Jet):
    return _select_max(ctx, x, list(range(x.ndim)), False, _median_weight(x.primal, ctx.out))


def median_vjp(v, g: Block, x: Jet):
    return _max_vjp(g, x, list(range(x.ndim)), False, _median_weight(x.primal, v.out))


OPS.register(aten.median.default, aten.nanmedian.default, rule=median_rule, vjp=median_vjp)


# ---------------------------------------------------------------------------------- scans
def _shifted(ctx: Ctx, x: Jet, d: int, s: int) -> Jet:
    """x moved ``s`` places along ``d``: entry i holds x_{i-s}, the first ``s`` entries are 1."""
    r, shape = x.ndim, x.shape

    def shift(t, fill):
        return aten.constant_pad_nd(t, [0, 0] * (t.ndim - d - 1) + [s, 0], fill).narrow(d, 0, shape[d])

    return Jet(shift(x.primal, 1.0),
               linear(ctx, x, lambda b: map_out(b, r, lambda t: shift(t, 0.0), shape, along(r, [d]))))


@on_0d
def cumprod_rule(ctx: Ctx, x: Jet, dim: int, dtype=None):
    """A Hillis-Steele scan: log2(n) levels y <- y ⊙ (y moved 2^l places, ones moved in), each a
    product by Leibniz. No division, so exact where x has zeros."""
    d = dim % max(x.ndim, 1)
    inner = ctx.inner(x.primal)
    o, shape = out_labels(x.ndim), x.shape
    y, s = x, 1
    while s < x.shape[d]:
        moved = _shifted(inner, y, d, s)
        value = y.primal * moved.primal
        y = Jet(value, leibniz(inner, [(y, o), (moved, o)], o, shape))
        s *= 2
    return {K: b.to(ctx.out.dtype) for K, b in y.blocks.items() if K in ctx.keys}


@on_0d_vjp
def cumprod_vjp(v, g: Block, x: Jet, dim: int, dtype=None):
    """The scan of :func:`cumprod_rule` run backwards: a level z = y ⊙ m, m = y moved s places,
    sends g_z ⊙ m to y and g_z ⊙ y, moved back s places, to y as well."""
    d = dim % max(x.ndim, 1)
    r, shape, n = x.ndim, x.shape, x.shape[d]
    levels, y, s = [], x.primal, 1
    while s < n:
        moved = aten.constant_pad_nd(y, [0, 0] * (r - d - 1) + [s, 0], 1.0).narrow(d, 0, n)
        levels.append((y, moved, s))
        y, s = y * moved, s * 2

    def back(t, s):  # transpose of moving s places: entry i takes t_{i+s}, the last s take 0
        return aten.constant_pad_nd(t.narrow(d, s, n - s), [0, 0] * (t.ndim - d - 1) + [0, s], 0.0)

    g = g.to(x.primal.dtype)
    for y, moved, s in reversed(levels):
        to_moved = map_out(scale_out(g, y, shape), r, lambda t, s=s: back(t, s), shape, along(r, [d]))
        g = add([scale_out(g, moved, shape), to_moved])
    return [(x, g)]


OPS.register(aten.cumprod.default, rule=cumprod_rule, vjp=cumprod_vjp)


def _lower_triangle(n: int, d: int, r: int, device) -> torch.Tensor:
    """[i >= j] over axes (d, d+1) of an (r+1)-axis tensor, broadcast along the others."""
    tri = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return tri.reshape([1] * d + [n, n] + [1] * (r - d - 1))


def _prefix_weights(x: torch.Tensor, y: torch.Tensor, d: int) -> torch.Tensor:
    """exp(x_j - y_i) for j <= i, else 0, over axes (i, j) = (d, d+1): each in [0, 1]. 0 where
    y_i = -inf (every x_j up to i is -inf, a masked prefix: -inf - -inf was NaN; torch's 0)."""
    n, r = x.shape[d], x.ndim
    u = x.unsqueeze(d) - y.unsqueeze(d + 1)
    below = _lower_triangle(n, d, r, x.device) & (y.unsqueeze(d + 1) > -math.inf)
    return torch.where(below, u, torch.full((), -math.inf, dtype=u.dtype, device=u.device)).exp()


@on_0d
def logcumsumexp_rule(ctx: Ctx, x: Jet, dim: int):
    """y_i = log Σ_{j<=i} e^{x_j} = y_i + log s_i with s_i = Σ_{j<=i} e^{x_j - y_i} (= 1 in value),
    y_i held constant: the chain goes through terms in [0, 1] that never overflow, O(n²) per scan."""
    d = dim % max(x.ndim, 1)
    r, n = x.ndim, x.shape[d]
    wide = list(x.shape[:d]) + [n] + list(x.shape[d:])  # axes (…, i, j, …)
    inner = ctx.inner(x.primal)
    spread = Jet(x.primal.unsqueeze(d).expand(wide),
                 linear(inner, x, lambda b: expand_out(unsqueeze_out(b, r, d), r + 1, wide)))
    e = _prefix_weights(x.primal, ctx.out, d)
    terms = Jet(e, chain(inner, spread, [e] * ctx.max_order))
    s = e.sum(d + 1)
    s = torch.where(s == 0, torch.ones_like(s), s)  # (a masked prefix: no terms, log's 1/s kept finite)
    total = Jet(s, linear(inner, terms, lambda b: sum_out(b, r + 1, [d + 1])))
    return chain(ctx, total, log_derivatives(ctx.max_order, s, None))


@on_0d_vjp
def logcumsumexp_vjp(v, g: Block, x: Jet, dim: int):
    """g_x_j = Σ_{i>=j} exp(x_j - y_i) g_i."""
    d = dim % max(x.ndim, 1)
    r = x.ndim
    o, f = out_labels(r), [("f", a) for a in range(g.ndim - r)]
    weights = Block.dense(_prefix_weights(x.primal, v.out, d))
    j = ("j",)
    w_labels = o[:d] + [o[d], j] + o[d + 1:]
    return [(x, contract([(weights, w_labels), (g, o + f)], o[:d] + [j] + o[d + 1:] + f, target=v.target))]


OPS.register(aten.logcumsumexp.default, rule=logcumsumexp_rule, vjp=logcumsumexp_vjp)


@on_0d
def cummax_rule(ctx: Ctx, x: Jet, dim: int):
    """(values, indices): the values are x gathered at the indices, as torch's backward has it."""
    values, indices = ctx.out
    return [_select_along(ctx, x, dim, indices, tuple(values.shape)), {}]


@on_0d_vjp
def cummax_vjp(v, g, x: Jet, dim: int):
    return [(x, _scatter_along(g[0], x, dim, v.out[1]))] if g[0] is not None else []


OPS.register(aten.cummax.default, aten.cummin.default, rule=cummax_rule, vjp=cummax_vjp)


# ------------------------------------------------------------------------- the VJPs' helpers
def _exclusive_product(x: torch.Tensor, d: int) -> torch.Tensor:
    """Π_{j≠i} x_j along ``d`` for every i, without division (exact where x has zeros)."""
    n = x.shape[d]
    ones = torch.ones_like(x.narrow(d, 0, 1))
    left = torch.cat([ones, x.narrow(d, 0, n - 1)], d).cumprod(d)
    flipped = x.flip(d)
    right = torch.cat([ones, flipped.narrow(d, 0, n - 1)], d).cumprod(d).flip(d)
    return left * right


def _max_vjp(g: Block, x: Jet, dims: list[int], keepdim: bool, weight: torch.Tensor) -> list:
    from hoad.rules.linear import _unsum

    return [(x, scale_out(_unsum(g, x, dims, keepdim), weight, x.shape))]


