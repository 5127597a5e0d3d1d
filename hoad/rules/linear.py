"""Ops linear in their differentiated argument(s): views, layout, indexing, sums, add/sub.

Each block goes through the same op on its output part, slots carried along; most of these
relabel axes of the compact data without touching it.
"""

from __future__ import annotations

import math

import torch

from hoad.blocks import Block, expand_out, map_out, permute_out, reshape_out, sum_out
from hoad.rules.base import Ctx, Jet, RuleTable
from hoad.rules.combinators import linear, scaled, sum_blocks

aten = torch.ops.aten
RULES = RuleTable("linear")


def _dims(dim, r: int) -> list[int]:
    """Normalise a dim argument (int, list, or None/[] for all dims)."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(r))
    if isinstance(dim, int):
        dim = [dim]
    return [d % r if r else 0 for d in dim]


@RULES.register(aten.view.default, aten.squeeze.dims, aten.unsqueeze.default)
def view_rule(ctx: Ctx, x: Jet, *shape_args):
    r, new = x.ndim, tuple(ctx.out.shape)
    return linear(ctx, x, lambda b: reshape_out(b, r, new))


@RULES.register(aten.clone.default, aten.alias.default)
def identity_rule(ctx: Ctx, x: Jet, *args, **kwargs):
    return linear(ctx, x, lambda b: b)


@RULES.register(aten._to_copy.default)
def to_copy_rule(ctx: Ctx, x: Jet, *args, **kwargs):
    dtype = ctx.out.dtype
    return linear(ctx, x, lambda b: b.to(dtype))


@RULES.register(aten.permute.default)
def permute_rule(ctx: Ctx, x: Jet, dims):
    r = x.ndim
    return linear(ctx, x, lambda b: permute_out(b, r, _dims(dims, r)))


@RULES.register(aten.expand.default)
def expand_rule(ctx: Ctx, x: Jet, size, implicit: bool = False):
    r, new = x.ndim, tuple(ctx.out.shape)
    return linear(ctx, x, lambda b: expand_out(b, r, new))


@RULES.register(aten.slice.Tensor)
def slice_rule(ctx: Ctx, x: Jet, dim: int = 0, start=None, end=None, step: int = 1):
    r, new = x.ndim, tuple(ctx.out.shape)
    d = dim % r
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: aten.slice.Tensor(t, d, start, end, step), new))


@RULES.register(aten.select.int)
def select_rule(ctx: Ctx, x: Jet, dim: int, index: int):
    r, new = x.ndim, tuple(ctx.out.shape)
    d = dim % r
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.select(d, index), new))


@RULES.register(aten.index_select.default)
def index_select_rule(ctx: Ctx, x: Jet, dim: int, index):
    r, new, idx = x.ndim, tuple(ctx.out.shape), index.primal
    d = dim % r
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.index_select(d, idx), new))


@RULES.register(aten.index.Tensor)
def index_rule(ctx: Ctx, x: Jet, indices):
    r, new = x.ndim, tuple(ctx.out.shape)
    idx = [None if i is None else i.primal for i in indices]
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: aten.index.Tensor(t, idx), new))


@RULES.register(aten.gather.default)
def gather_rule(ctx: Ctx, x: Jet, dim: int, index, sparse_grad: bool = False):
    return _select_along(ctx, x, dim, index.primal, tuple(ctx.out.shape))


@RULES.register(aten.flip.default)
def flip_rule(ctx: Ctx, x: Jet, dims):
    r = x.ndim
    ds = _dims(dims, r)
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.flip(ds), x.shape))


@RULES.register(aten.constant_pad_nd.default)
def pad_rule(ctx: Ctx, x: Jet, pad, value=0):
    r, new = x.ndim, tuple(ctx.out.shape)
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: aten.constant_pad_nd(t, [0, 0] * (t.ndim - r) + list(pad), 0.0), new))


@RULES.register(aten.cumsum.default)
def cumsum_rule(ctx: Ctx, x: Jet, dim: int, dtype=None):
    r = x.ndim
    d = dim % r
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.cumsum(d), x.shape))


@RULES.register(aten.diagonal.default)
def diagonal_rule(ctx: Ctx, x: Jet, offset: int = 0, dim1: int = 0, dim2: int = 1):
    r, new = x.ndim, tuple(ctx.out.shape)
    d1, d2 = dim1 % r, dim2 % r
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.diagonal(offset, d1, d2).movedim(-1, r - 2), new))


@RULES.register(aten.sum.dim_IntList)
def sum_rule(ctx: Ctx, x: Jet, dim=None, keepdim: bool = False, dtype=None):
    r = x.ndim
    axes = _dims(dim, r)
    return linear(ctx, x, lambda b: sum_out(b, r, axes, keepdim).to(ctx.out.dtype))


@RULES.register(aten.mean.dim, aten.mean.default)
def mean_rule(ctx: Ctx, x: Jet, dim=None, keepdim: bool = False, dtype=None):
    r = x.ndim
    axes = _dims(dim, r)
    n = math.prod(x.shape[a] for a in axes)
    return linear(ctx, x, lambda b: sum_out(b, r, axes, keepdim).scale(1.0 / n).to(ctx.out.dtype))


@RULES.register(aten.neg.default)
def neg_rule(ctx: Ctx, x: Jet):
    return linear(ctx, x, Block.neg)


def _combine(ctx: Ctx, terms: list[tuple[object, float]]) -> dict:
    """Blocks of Σ c_i x_i with constant c_i, broadcasting to the output (numbers carry no blocks)."""
    shape = tuple(ctx.out.shape)
    parts = [scaled(ctx, x, c, shape) for x, c in terms if isinstance(x, Jet) and not x.constant]
    return {K: b.to(ctx.out.dtype) for K, b in sum_blocks(*parts).items()}


@RULES.register(aten.add.Tensor)
def add_rule(ctx: Ctx, a, b, alpha=1):
    return _combine(ctx, [(a, 1.0), (b, alpha)])


@RULES.register(aten.sub.Tensor)
def sub_rule(ctx: Ctx, a, b, alpha=1):
    return _combine(ctx, [(a, 1.0), (b, -alpha)])


@RULES.register(aten.add.Scalar, aten.sub.Scalar)
def add_scalar_rule(ctx: Ctx, a: Jet, other, alpha=1):
    return _combine(ctx, [(a, 1.0)])


@RULES.register(aten.where.self)
def where_rule(ctx: Ctx, cond, a, b):
    """where(c, a, b) with a constant condition: c ⊙ Da + (1 - c) ⊙ Db."""
    mask = cond.primal if isinstance(cond, Jet) else cond
    dtype = ctx.out.dtype
    return _combine(ctx, [(a, mask.to(dtype)), (b, (~mask).to(dtype))])


@RULES.register(aten.copy.default)
def copy_rule(ctx: Ctx, dst, src, non_blocking: bool = False):
    """copy(dst, src) is src broadcast to dst's shape and dtype; dst's values are overwritten."""
    return _combine(ctx, [(src, 1.0)])


@RULES.register(aten.cat.default)
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

        parts.append(linear(ctx, x, lambda b, pad=pad: map_out(b, r, pad, new)))
    return sum_blocks(*parts)


@RULES.register(aten.split_with_sizes.default)
def split_rule(ctx: Ctx, x: Jet, split, dim: int = 0):
    r = x.ndim
    d = dim % r
    results, offset = [], 0
    for piece in ctx.out:
        n = piece.shape[d]
        new = tuple(piece.shape)
        results.append(linear(ctx, x, lambda b, s=offset, n=n, new=new: map_out(b, r, lambda t: t.narrow(d, s, n), new)))
        offset += n
    return results


@RULES.register(aten.repeat.default)
def repeat_rule(ctx: Ctx, x: Jet, repeats):
    r, new = x.ndim, tuple(ctx.out.shape)
    lead = len(repeats) - r
    return linear(ctx, x, lambda b: map_out(reshape_lead(b, r, lead), len(repeats),
                                            lambda t: t.repeat(list(repeats) + [1] * (t.ndim - len(repeats))), new))


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

    return linear(ctx, x, lambda b: map_out(b, r, fn, new))


@RULES.register(aten.sort.default)
def sort_rule(ctx: Ctx, x: Jet, dim: int = -1, descending: bool = False):
    """(values, indices): the values are x gathered at the indices."""
    values, indices = ctx.out
    return [_select_along(ctx, x, dim, indices, tuple(values.shape)), {}]


@RULES.register(aten.topk.default)
def topk_rule(ctx: Ctx, x: Jet, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    values, indices = ctx.out
    return [_select_along(ctx, x, dim, indices, tuple(values.shape)), {}]
