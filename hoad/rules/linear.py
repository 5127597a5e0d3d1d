"""Ops linear in their differentiated argument(s): views, layout, indexing, sums and means,
scatters into views, cat, split, repeat, sort and topk. (The entrywise ones, add/sub, where and
clamp, are in :mod:`hoad.rules.arithmetic`.)

Each block goes through the same op on its output part, slots carried along; most of these
relabel axes of the compact data without touching it. Each op's VJP, beside its rule, is the
transpose of that map: it takes the cotangent g (output axes first, then the program output's
axes) and returns the cotangent of each varying argument.
"""

from __future__ import annotations

import math

import torch

from hoad.algebra import Block, add, along, expand_out, map_out, permute_out, reshape_out, sum_out
from hoad.rules.base import Ctx, Jet, RuleTable
from hoad.rules.combinators import linear, on_0d, on_0d_vjp, sum_blocks, unbroadcast
from hoad.rules.flat import _cat, _reduced, _same_view

aten = torch.ops.aten
OPS = RuleTable("linear")


def _dims(dim, r: int) -> list[int]:
    """Normalise a dim argument (int, list, or None/[] for all dims); a 0-d tensor has none."""
    if r == 0:
        return []
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(r))
    if isinstance(dim, int):
        dim = [dim]
    return [d % r for d in dim]


def view_rule(ctx: Ctx, x: Jet, *shape_args):
    r, new = x.ndim, tuple(ctx.out.shape)
    return linear(ctx, x, lambda b: reshape_out(b, r, new))


def view_vjp(v, g: Block, x: Jet, *shape_args):
    return [(x, reshape_out(g, v.out.ndim, x.shape))]


OPS.register(aten.view.default, rule=view_rule, vjp=view_vjp, flat=_same_view(aten.reshape.default))
OPS.register(aten.squeeze.dims, rule=view_rule, vjp=view_vjp, flat=_same_view(aten.squeeze.dims))
OPS.register(aten.unsqueeze.default, rule=view_rule, vjp=view_vjp, flat=_same_view(aten.unsqueeze.default))


def identity_rule(ctx: Ctx, x: Jet, *args, **kwargs):
    return linear(ctx, x, lambda b: b)


def identity_vjp(v, g: Block, x: Jet, *args, **kwargs):
    return [(x, g)]


OPS.register(aten.clone.default, rule=identity_rule, vjp=identity_vjp, flat=_same_view(aten.clone.default))
OPS.register(aten.alias.default, rule=identity_rule, vjp=identity_vjp, flat=_same_view(aten.alias.default))


def to_copy_rule(ctx: Ctx, x: Jet, *args, **kwargs):
    dtype = ctx.out.dtype
    return linear(ctx, x, lambda b: b.to(dtype))


def to_copy_vjp(v, g: Block, x: Jet, *args, **kwargs):
    return [(x, g.to(x.primal.dtype))]


OPS.register(aten._to_copy.default, rule=to_copy_rule, vjp=to_copy_vjp)


def permute_rule(ctx: Ctx, x: Jet, dims):
    r = x.ndim
    return linear(ctx, x, lambda b: permute_out(b, r, _dims(dims, r)))


def permute_vjp(v, g: Block, x: Jet, dims):
    r = x.ndim
    perm = _dims(dims, r)
    inverse = [perm.index(a) for a in range(r)]
    return [(x, permute_out(g, r, inverse))]


OPS.register(aten.permute.default, rule=permute_rule, vjp=permute_vjp, flat=_same_view(aten.permute.default))


def expand_rule(ctx: Ctx, x: Jet, size, implicit: bool = False):
    r, new = x.ndim, tuple(ctx.out.shape)
    return linear(ctx, x, lambda b: expand_out(b, r, new))


def expand_vjp(v, g: Block, x: Jet, size, implicit: bool = False):
    return [(x, unbroadcast(g, v.out.ndim, x.shape))]


OPS.register(aten.expand.default, rule=expand_rule, vjp=expand_vjp, flat=_same_view(aten.expand.default))


def slice_rule(ctx: Ctx, x: Jet, dim: int = 0, start=None, end=None, step: int = 1):
    r, new = x.ndim, tuple(ctx.out.shape)
    d = dim % r
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: aten.slice.Tensor(t, d, start, end, step), new,
                                            along(r, [d])))


def slice_vjp(v, g: Block, x: Jet, dim: int = 0, start=None, end=None, step: int = 1):
    r = x.ndim
    d = dim % r
    return [(x, map_out(g, r, lambda t: aten.slice_scatter(_zeros_like_input(t, x, r), t, d, start, end, step), x.shape,
                        along(r, [d])))]


OPS.register(aten.slice.Tensor, rule=slice_rule, vjp=slice_vjp, flat=_same_view(aten.slice.Tensor))


def select_rule(ctx: Ctx, x: Jet, dim: int, index: int):
    r, new = x.ndim, tuple(ctx.out.shape)
    d = dim % r
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.select(d, index), new, along(r, [d], removed=True)))


def select_vjp(v, g: Block, x: Jet, dim: int, index: int):
    r = x.ndim
    d = dim % r
    keep = {b: a for a, b in along(r, [d], removed=True).items()}
    return [(x, map_out(g, r - 1, lambda t: aten.select_scatter(_zeros_like_input(t, x, r - 1), t, d, index),
                        x.shape, keep))]


OPS.register(aten.select.int, rule=select_rule, vjp=select_vjp, flat=_same_view(aten.select.int))


@on_0d
def index_select_rule(ctx: Ctx, x: Jet, dim: int, index):
    r, new, idx = x.ndim, tuple(ctx.out.shape), index.primal
    d = dim % r
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.index_select(d, idx), new, along(r, [d])))


@on_0d_vjp
def index_select_vjp(v, g: Block, x: Jet, dim: int, index):
    r, idx = x.ndim, index.primal
    d = dim % r
    return [(x, map_out(g, r, lambda t: _zeros_like_input(t, x, r).index_add(d, idx, t), x.shape, along(r, [d])))]


OPS.register(aten.index_select.default, rule=index_select_rule, vjp=index_select_vjp,
             flat=_same_view(aten.index_select.default))


def index_rule(ctx: Ctx, x: Jet, indices):
    r, new = x.ndim, tuple(ctx.out.shape)
    idx = [None if i is None else i.primal for i in indices]
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: aten.index.Tensor(t, idx), new, _leading_kept(idx)))


def index_vjp(v, g: Block, x: Jet, indices):
    r_out = v.out.ndim
    idx = [None if i is None else i.primal for i in indices]
    return [(x, map_out(g, r_out, lambda t: aten.index_put(_zeros_like_input(t, x, r_out), idx, t, True), x.shape,
                        _leading_kept(idx)))]


OPS.register(aten.index.Tensor, rule=index_rule, vjp=index_vjp, flat=_same_view(aten.index.Tensor))


def _leading_kept(idx: list) -> dict[int, int]:
    """``keep`` for advanced indexing: the unindexed dims before the first indexed one stay in
    place when the indexed dims are adjacent (torch then puts the index dims where they were);
    otherwise the index dims move to the front and nothing stays."""
    indexed = [i for i, t in enumerate(idx) if t is not None]
    if not indexed or indexed != list(range(indexed[0], indexed[-1] + 1)):
        return {}
    return {a: a for a in range(indexed[0])}


@on_0d
def gather_rule(ctx: Ctx, x: Jet, dim: int, index, sparse_grad: bool = False):
    return _select_along(ctx, x, dim, index.primal, tuple(ctx.out.shape))


@on_0d_vjp
def gather_vjp(v, g: Block, x: Jet, dim: int, index, sparse_grad: bool = False):
    return [(x, _scatter_along(g, x, dim, index.primal))]


OPS.register(aten.gather.default, rule=gather_rule, vjp=gather_vjp, flat=_same_view(aten.gather.default))


@on_0d
def flip_rule(ctx: Ctx, x: Jet, dims):
    r = x.ndim
    ds = _dims(dims, r)
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.flip(ds), x.shape, along(r, ds)))


@on_0d_vjp
def flip_vjp(v, g: Block, x: Jet, dims):
    r = x.ndim
    ds = _dims(dims, r)
    return [(x, map_out(g, r, lambda t: t.flip(ds), x.shape, along(r, ds)))]


OPS.register(aten.flip.default, rule=flip_rule, vjp=flip_vjp, flat=_same_view(aten.flip.default))


def _padded_axes(r: int, pad) -> list[int]:
    """The axes a pad spec grows or cuts: (before, after) pairs from the last axis back; a (0, 0)
    pair leaves its axis alone (a sample axis keeps its tie)."""
    return [r - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]]


def pad_rule(ctx: Ctx, x: Jet, pad, value=0):
    r, new = x.ndim, tuple(ctx.out.shape)
    padded = _padded_axes(r, pad)
    def padded_block(t):
        return aten.constant_pad_nd(t, [0, 0] * (t.ndim - r) + list(pad), 0.0)

    return linear(ctx, x, lambda b: map_out(b, r, padded_block, new, along(r, padded)))


def pad_vjp(v, g: Block, x: Jet, pad, value=0):
    r = x.ndim
    padded = _padded_axes(r, pad)
    def cropped(t):
        return aten.constant_pad_nd(t, [0, 0] * (t.ndim - r) + [-p for p in pad], 0.0)

    return [(x, map_out(g, r, cropped, x.shape, along(r, padded)))]


OPS.register(aten.constant_pad_nd.default, rule=pad_rule, vjp=pad_vjp)


@on_0d
def cumsum_rule(ctx: Ctx, x: Jet, dim: int, dtype=None):
    r = x.ndim
    d = dim % r
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.cumsum(d), x.shape, along(r, [d])))


@on_0d_vjp
def cumsum_vjp(v, g: Block, x: Jet, dim: int, dtype=None):
    r = x.ndim
    d = dim % r
    return [(x, map_out(g, r, lambda t: t.flip(d).cumsum(d).flip(d), x.shape, along(r, [d])))]


OPS.register(aten.cumsum.default, rule=cumsum_rule, vjp=cumsum_vjp)


def diagonal_rule(ctx: Ctx, x: Jet, offset: int = 0, dim1: int = 0, dim2: int = 1):
    r, new = x.ndim, tuple(ctx.out.shape)
    d1, d2 = dim1 % r, dim2 % r
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.diagonal(offset, d1, d2).movedim(-1, r - 2), new,
                                            along(r, [d1, d2], removed=True)))


def diagonal_vjp(v, g: Block, x: Jet, offset: int = 0, dim1: int = 0, dim2: int = 1):
    r = x.ndim
    d1, d2 = dim1 % r, dim2 % r
    keep = {b: a for a, b in along(r, [d1, d2], removed=True).items()}
    return [(x, map_out(g, r - 1, lambda t: aten.diagonal_scatter(_zeros_like_input(t, x, r - 1), t.movedim(r - 2, -1),
                                                                   offset, d1, d2), x.shape, keep))]


OPS.register(aten.diagonal.default, rule=diagonal_rule, vjp=diagonal_vjp)


def sum_rule(ctx: Ctx, x: Jet, dim=None, keepdim: bool = False, dtype=None):
    r = x.ndim
    axes = _dims(dim, r)
    return linear(ctx, x, lambda b: sum_out(b, r, axes, keepdim).to(ctx.out.dtype))


def sum_vjp(v, g: Block, x: Jet, dim=None, keepdim: bool = False, dtype=None):
    return [(x, _unsum(g, x, dim, keepdim).to(x.primal.dtype))]


OPS.register(aten.sum.dim_IntList, rule=sum_rule, vjp=sum_vjp, flat=_reduced)


@on_0d(reduces=True)
def mean_rule(ctx: Ctx, x: Jet, dim=None, keepdim: bool = False, dtype=None):
    r = x.ndim
    axes = _dims(dim, r)
    n = math.prod(x.shape[a] for a in axes)
    return linear(ctx, x, lambda b: sum_out(b, r, axes, keepdim).scale(1.0 / n).to(ctx.out.dtype))


@on_0d_vjp(reduces=True)
def mean_vjp(v, g: Block, x: Jet, dim=None, keepdim: bool = False, dtype=None):
    n = math.prod(x.shape[a] for a in _dims(dim, x.ndim))
    return [(x, _unsum(g, x, dim, keepdim).scale(1.0 / n).to(x.primal.dtype))]


OPS.register(aten.mean.dim, rule=mean_rule, vjp=mean_vjp, flat=_reduced)
OPS.register(aten.mean.default, rule=mean_rule, vjp=mean_vjp, flat=lambda x, *args, **kwargs: _reduced(x))


def _zero_region(t: torch.Tensor, region, scatter) -> torch.Tensor:
    """``t`` with the entries a view op reads set to zero (the part a scatter overwrites)."""
    return scatter(t, torch.zeros_like(region(t)))


def slice_scatter_rule(ctx: Ctx, x: Jet, src: Jet, dim: int = 0, start=None, end=None, step: int = 1):
    """x with a slice replaced by src: x's blocks outside the slice plus src's placed into it."""
    r, new = x.ndim, tuple(ctx.out.shape)
    d = dim % r
    region = lambda t: aten.slice.Tensor(t, d, start, end, step)  # noqa: E731
    scatter = lambda t, u: aten.slice_scatter(t, u, d, start, end, step)  # noqa: E731
    kept = linear(ctx, x, lambda b: map_out(b, r, lambda t: _zero_region(t, region, scatter), new, along(r, [d])))
    placed = linear(ctx, src, lambda b: map_out(b, r, lambda t: scatter(t.new_zeros(new + t.shape[r:]), t), new,
                                                along(r, [d])))
    return sum_blocks(kept, placed)


def slice_scatter_vjp(v, g: Block, x: Jet, src: Jet, dim: int = 0, start=None, end=None, step: int = 1):
    r = x.ndim
    d = dim % r
    return _scatter_view_vjp(g, x, src, r, lambda t: aten.slice.Tensor(t, d, start, end, step),
                             lambda t, u: aten.slice_scatter(t, u, d, start, end, step), along(r, [d]), along(r, [d]))


OPS.register(aten.slice_scatter.default, rule=slice_scatter_rule, vjp=slice_scatter_vjp)


def diagonal_scatter_rule(ctx: Ctx, x: Jet, src: Jet, offset: int = 0, dim1: int = 0, dim2: int = 1):
    r, new = x.ndim, tuple(ctx.out.shape)
    d1, d2 = dim1 % r, dim2 % r
    region = lambda t: t.diagonal(offset, d1, d2)  # noqa: E731
    scatter = lambda t, u: aten.diagonal_scatter(t, u, offset, d1, d2)  # noqa: E731
    kept = linear(ctx, x, lambda b: map_out(b, r, lambda t: _zero_region(t, region, scatter), new, along(r, [d1, d2])))
    to_out = {b: a for a, b in along(r, [d1, d2], removed=True).items()}
    placed = linear(ctx, src, lambda b: map_out(
        b, r - 1, lambda t: scatter(t.new_zeros(new + t.shape[r - 1:]), t.movedim(r - 2, -1)), new, to_out))
    return sum_blocks(kept, placed)


def diagonal_scatter_vjp(v, g: Block, x: Jet, src: Jet, offset: int = 0, dim1: int = 0, dim2: int = 1):
    r = x.ndim
    d1, d2 = dim1 % r, dim2 % r
    return _scatter_view_vjp(g, x, src, r, lambda t: t.diagonal(offset, d1, d2).movedim(-1, r - 2),
                             lambda t, u: aten.diagonal_scatter(t, u.movedim(r - 2, -1), offset, d1, d2),
                             along(r, [d1, d2]), along(r, [d1, d2], removed=True))


OPS.register(aten.diagonal_scatter.default, rule=diagonal_scatter_rule, vjp=diagonal_scatter_vjp)


def cat_rule(ctx: Ctx, tensors, dim: int = 0):
    """Each input's blocks padded with zeros to its place along ``dim``, then added."""
    r = ctx.out.ndim
    d = dim % r
    total = ctx.out.shape[d]
    parts, offset = [], 0
    for x in tensors:
        if x.ndim == 1 and x.shape[0] == 0 and r > 1:  # legacy empty tensors take no place
            continue
        n = x.shape[d]
        before, after = offset, total - offset - n
        offset += n
        if x.constant:
            continue
        new = tuple(ctx.out.shape)

        def pad(t, before=before, after=after):
            spec = [0, 0] * (t.ndim - d - 1) + [before, after]
            return aten.constant_pad_nd(t, spec, 0.0)

        parts.append(linear(ctx, x, lambda b, pad=pad, new=new: map_out(b, r, pad, new, along(r, [d]))))
    return sum_blocks(*parts)


def cat_vjp(v, g: Block, tensors, dim: int = 0):
    r = v.out.ndim
    d = dim % r
    pairs, offset = [], 0
    for x in tensors:
        if x.ndim == 1 and x.shape[0] == 0 and r > 1:
            continue
        n = x.shape[d]
        if not x.constant:
            pairs.append((x, map_out(g, r, lambda t, s=offset, n=n: t.narrow(d, s, n), x.shape, along(r, [d]))))
        offset += n
    return pairs


OPS.register(aten.cat.default, rule=cat_rule, vjp=cat_vjp, flat=_cat)


def split_rule(ctx: Ctx, x: Jet, split, dim: int = 0):
    r = x.ndim
    d = dim % r
    results, offset = [], 0
    for piece in ctx.out:
        n = piece.shape[d]
        new = tuple(piece.shape)
        results.append(linear(ctx, x, lambda b, s=offset, n=n, new=new: map_out(b, r, lambda t: t.narrow(d, s, n), new,
                                                                                along(r, [d]))))
        offset += n
    return results


def split_vjp(v, g, x: Jet, split, dim: int = 0):
    r = x.ndim
    d = dim % r
    parts, offset = [], 0
    for piece, gi in zip(v.out, g):
        n = piece.shape[d]
        if gi is not None:
            before, after = offset, x.shape[d] - offset - n
            spec = lambda t, b=before, a=after: [0, 0] * (t.ndim - d - 1) + [b, a]  # noqa: E731
            parts.append(map_out(gi, r, lambda t, spec=spec: aten.constant_pad_nd(t, spec(t), 0.0), x.shape,
                                 along(r, [d])))
        offset += n
    return [(x, add(parts))] if parts else []


OPS.register(aten.split_with_sizes.default, rule=split_rule, vjp=split_vjp)


def repeat_rule(ctx: Ctx, x: Jet, repeats):
    """Axes repeated once pass through (a sample axis under ``x.repeat(1, k)`` keeps its ties)."""
    r, new = x.ndim, tuple(ctx.out.shape)
    lead = len(repeats) - r
    once = {a: a for a, k in enumerate(repeats) if k == 1}
    return linear(ctx, x, lambda b: map_out(reshape_lead(b, r, lead), len(repeats),
                                            lambda t: t.repeat(list(repeats) + [1] * (t.ndim - len(repeats))), new,
                                            once))


def repeat_vjp(v, g: Block, x: Jet, repeats):
    r_out = v.out.ndim
    lead = len(repeats) - x.ndim
    shape = [1] * lead + list(x.shape)
    interleaved = [n for rep, s in zip(repeats, shape) for n in (rep, s)]
    g = reshape_out(g, r_out, interleaved)
    g = sum_out(g, 2 * r_out, range(0, 2 * r_out, 2))
    return [(x, reshape_out(g, r_out, x.shape))]


OPS.register(aten.repeat.default, rule=repeat_rule, vjp=repeat_vjp, flat=_same_view(aten.repeat.default))


def reshape_lead(b: Block, r: int, lead: int) -> Block:
    """Give the output part ``lead`` extra leading size-1 axes."""
    return reshape_out(b, r, [1] * lead + list(b.shape[:r])) if lead > 0 else b


def _select_along(ctx: Ctx, x: Jet, dim: int, indices: torch.Tensor, new) -> dict:
    """Blocks of x.gather(dim, indices): the derivative follows the selected entries."""
    r = x.ndim
    d = dim % r

    def fn(t):
        rest = list(t.shape[r:])
        i = indices.reshape(list(indices.shape) + [1] * len(rest)).expand(list(indices.shape) + rest)
        return t.gather(d, i)

    return linear(ctx, x, lambda b: map_out(b, r, fn, new, along(r, [d])))


@on_0d
def sort_rule(ctx: Ctx, x: Jet, dim: int = -1, descending: bool = False):
    """(values, indices): the values are x gathered at the indices."""
    values, indices = ctx.out
    return [_select_along(ctx, x, dim, indices, tuple(values.shape)), {}]


@on_0d_vjp
def sort_vjp(v, g, x: Jet, dim: int = -1, descending: bool = False):
    return [(x, _scatter_along(g[0], x, dim, v.out[1]))] if g[0] is not None else []


OPS.register(aten.sort.default, rule=sort_rule, vjp=sort_vjp)


@on_0d
def topk_rule(ctx: Ctx, x: Jet, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    values, indices = ctx.out
    return [_select_along(ctx, x, dim, indices, tuple(values.shape)), {}]


@on_0d_vjp
def topk_vjp(v, g, x: Jet, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    return [(x, _scatter_along(g[0], x, dim, v.out[1]))] if g[0] is not None else []


OPS.register(aten.topk.default, rule=topk_rule, vjp=topk_vjp)


# ------------------------------------------------------------------------- the VJPs' helpers
def _zeros_like_input(t: torch.Tensor, x: Jet, r: int) -> torch.Tensor:
    return t.new_zeros(list(x.shape) + list(t.shape[r:]))


def _scatter_along(g: Block, x: Jet, dim: int, indices: torch.Tensor) -> Block:
    """Transpose of gathering x along ``dim`` at ``indices``: scatter-add the cotangent back."""
    r = x.ndim
    d = dim % r

    def fn(t):
        rest = list(t.shape[r:])
        i = indices.reshape(list(indices.shape) + [1] * len(rest)).expand(list(indices.shape) + rest)
        return _zeros_like_input(t, x, r).scatter_add(d, i, t)

    return map_out(g, r, fn, x.shape, along(r, [d]))


def _unsum(g: Block, x: Jet, dim, keepdim: bool) -> Block:
    """Transpose of a sum over ``dim``: put the summed axes back and broadcast along them."""
    r = x.ndim
    axes = _dims(dim, r)
    kept = [1 if a in axes else n for a, n in enumerate(x.shape)]
    g = reshape_out(g, r if keepdim else r - len(axes), kept)
    return expand_out(g, r, x.shape)


def _scatter_view_vjp(g: Block, x: Jet, src: Jet, r: int, region, scatter, keep_x: dict, keep_src: dict) -> list:
    """Cotangents of a scatter of ``src`` into the view ``region`` of ``x``: x's is g outside the
    view, src's is the view of g."""
    pairs = []
    if not x.constant:
        pairs.append((x, map_out(g, r, lambda t: _zero_region(t, region, scatter), x.shape, keep_x)))
    if not src.constant:
        pairs.append((src, map_out(g, r, region, src.shape, keep_src)))
    return pairs


