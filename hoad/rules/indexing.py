"""Indexed reads and writes: embedding, index_put, scatter and scatter_reduce.

Each is linear in its differentiated arguments with coefficients that depend on the (constant)
indices alone, or, for amax/amin, on which entries win (constant almost everywhere): every block
goes through the same indexed op, its slots carried along as trailing axes of the data.
"""

from __future__ import annotations

import math

import torch

from hoad.algebra import Block, along, map_out
from hoad.errors import UnsupportedOperatorError
from hoad.rules.base import Ctx, Jet, RuleTable
from hoad.rules.combinators import broadcast, linear, scale_out, scaled, sum_blocks, unbroadcast

aten = torch.ops.aten
OPS = RuleTable("linear")


def _varies(x) -> bool:
    return isinstance(x, Jet) and x.varies


def _value(x):
    return x.primal if isinstance(x, Jet) else x


# ------------------------------------------------------------------------------ embedding
def _embedding_mask(indices: torch.Tensor, padding_idx: int, scale_grad_by_freq: bool):
    """Positions whose rows carry a derivative (None: all). torch's backward skips padding_idx."""
    if scale_grad_by_freq:
        raise UnsupportedOperatorError(
            "embedding with scale_grad_by_freq=True: torch scales the gradient by how often each index "
            "occurs, which is not a derivative; hoad computes derivatives only. Pass scale_grad_by_freq=False.")
    return None if padding_idx < 0 else indices != padding_idx


def embedding_rule(ctx: Ctx, weight: Jet, indices, padding_idx: int = -1, scale_grad_by_freq: bool = False,
                   sparse: bool = False):
    """Rows of the weight at the indices: each block gathers the same rows (padding rows: none)."""
    idx = _value(indices)
    mask = _embedding_mask(idx, padding_idx, scale_grad_by_freq)
    new, q = tuple(ctx.out.shape), idx.ndim

    def fn(t: torch.Tensor) -> torch.Tensor:
        rows = t.index_select(0, idx.reshape(-1)).reshape(list(idx.shape) + list(t.shape[1:]))
        if mask is not None:
            m = mask.reshape(list(mask.shape) + [1] * (rows.ndim - q))
            rows = torch.where(m, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        return rows

    return linear(ctx, weight, lambda b: map_out(b, 2, fn, new, {1: q}))


def embedding_vjp(v, g: Block, weight: Jet, indices, padding_idx: int = -1, scale_grad_by_freq: bool = False,
                  sparse: bool = False):
    idx = _value(indices)
    mask = _embedding_mask(idx, padding_idx, scale_grad_by_freq)
    q = idx.ndim

    def fn(t: torch.Tensor) -> torch.Tensor:
        if mask is not None:
            m = mask.reshape(list(mask.shape) + [1] * (t.ndim - q))
            t = torch.where(m, t, torch.zeros((), dtype=t.dtype, device=t.device))
        rows = t.reshape([-1] + list(t.shape[q:]))
        return t.new_zeros(list(weight.shape) + list(t.shape[q + 1:])).index_add(0, idx.reshape(-1), rows)

    return [(weight, map_out(g, q + 1, fn, weight.shape, {q: 1}))]


OPS.register(aten.embedding.default, rule=embedding_rule, vjp=embedding_vjp)


# ------------------------------------------------------------------------------ index_put
def _indexed_shape(shape, idx: list) -> list[int]:
    """The shape of ``x[idx]`` (advanced indexing with integer tensors and None for full slices)."""
    shape = list(shape)
    adv = [a for a, i in enumerate(idx) if i is not None]
    bshape = list(torch.broadcast_shapes(*[idx[a].shape for a in adv]))
    if adv == list(range(adv[0], adv[-1] + 1)):
        return shape[:adv[0]] + bshape + shape[adv[-1] + 1:]
    return bshape + [n for a, n in enumerate(shape) if a not in adv]


def _passing(r: int, idx: list, n_values: int) -> dict[int, int]:
    """Output axis -> axis of ``x[idx]`` for the axes no index acts on (a sample axis indexed by
    a full slice stays one: ``x[:, dst] += m`` per sample)."""
    adv = [a for a, i in enumerate(idx) if i is not None]
    plain = [a for a in range(r) if a not in adv]
    nb = n_values - len(plain)  # the broadcast index axes of x[idx]
    if adv == list(range(adv[0], adv[-1] + 1)):  # in place of the indexed axes
        return {a: (a if a < adv[0] else a - len(adv) + nb) for a in plain}
    return {a: nb + j for j, a in enumerate(plain)}  # in front


def _index_list(indices) -> list:
    idx = [None if i is None else _value(i) for i in indices]
    if any(i is not None and i.dtype == torch.bool for i in idx):
        raise UnsupportedOperatorError(
            "no derivative rule for aten.index_put.default with a boolean mask index (the number of entries it "
            "writes depends on the mask's values); write it as torch.where(mask, values, x)")
    return idx


def _put_winners(out: torch.Tensor, idx: list, ishape: list) -> torch.Tensor:
    """Which entries of the (broadcast) values an overwriting index_put keeps: with duplicate
    indices only one write survives, and only it carries a derivative (in both directions)."""
    ids = torch.arange(math.prod(ishape), device=out.device).reshape(ishape)
    written = aten.index_put(torch.full(out.shape, -1, dtype=ids.dtype, device=out.device), idx, ids)
    return aten.index.Tensor(written, idx) == ids


def _masked(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``t`` (mask's axes, then trailing axes) with the unmasked entries set to zero."""
    if mask is None:
        return t
    m = mask.reshape(list(mask.shape) + [1] * (t.ndim - mask.ndim))
    return torch.where(m, t, torch.zeros((), dtype=t.dtype, device=t.device))


def index_put_rule(ctx: Ctx, x, indices, values, accumulate: bool = False):
    """x with the indexed entries replaced by (or, accumulating, added to) values: x's blocks with
    the overwritten entries dropped, plus values' blocks added at the indices (of duplicate
    overwriting writes, only the surviving one's)."""
    r, new = ctx.out.ndim, tuple(ctx.out.shape)
    idx = _index_list(indices)
    untouched = along(r, [a for a, i in enumerate(idx) if i is not None])
    parts = []
    if _varies(x):
        if accumulate:
            parts.append(linear(ctx, x, lambda b: b))
        else:
            zero = torch.zeros((), dtype=ctx.out.dtype, device=ctx.out.device)
            parts.append(linear(ctx, x, lambda b: map_out(b, r, lambda t: aten.index_put(t, idx, zero), new,
                                                          untouched)))
    if _varies(values):
        ishape = _indexed_shape(new, idx)
        won = None if accumulate else _put_winners(ctx.out, idx, ishape)
        vb = broadcast(values, ishape)
        keep = {v: a for a, v in _passing(r, idx, len(ishape)).items()}
        parts.append(linear(ctx, vb, lambda b: map_out(
            b, len(ishape), lambda t: aten.index_put(t.new_zeros(list(new) + list(t.shape[len(ishape):])), idx,
                                                     _masked(t, won), True), new, keep)))
    return sum_blocks(*parts)


def index_put_vjp(v, g: Block, x, indices, values, accumulate: bool = False):
    r = v.out.ndim
    idx = _index_list(indices)
    pairs = []
    if _varies(x):
        if accumulate:
            pairs.append((x, g))
        else:
            zero = torch.zeros((), dtype=v.out.dtype, device=v.out.device)
            untouched = along(r, [a for a, i in enumerate(idx) if i is not None])
            pairs.append((x, map_out(g, r, lambda t: aten.index_put(t, idx, zero), x.shape, untouched)))
    if _varies(values):
        ishape = _indexed_shape(v.out.shape, idx)
        won = None if accumulate else _put_winners(v.out, idx, ishape)
        got = map_out(g, r, lambda t: _masked(aten.index.Tensor(t, idx), won), ishape, _passing(r, idx, len(ishape)))
        pairs.append((values, unbroadcast(got, len(ishape), values.shape)))
    return pairs


OPS.register(aten.index_put.default, rule=index_put_rule, vjp=index_put_vjp)


# -------------------------------------------------------------------------------- scatter
def _expand_index(index: torch.Tensor, rest: list) -> torch.Tensor:
    return index.reshape(list(index.shape) + [1] * len(rest)).expand(list(index.shape) + rest)


def _within(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The leading part of ``t`` that ``index``'s shape covers (the src entries a scatter reads)."""
    if all(t.shape[a] == n for a, n in enumerate(index.shape)):
        return t
    return t[tuple(slice(0, n) for n in index.shape)]


def _counts(out: torch.Tensor, d: int, index: torch.Tensor) -> torch.Tensor:
    """How many src entries each output entry receives."""
    return torch.zeros_like(out).scatter_add(d, index, torch.ones(index.shape, dtype=out.dtype, device=out.device))


def _coefficients(out: torch.Tensor, x, d: int, index: torch.Tensor, src, reduce: str, include_self: bool):
    """out = c_self ⊙ x + scatter_add(c_src ⊙ src): the coefficients (numbers or tensors over the
    output, resp. the index's shape) of a scatter with ``reduce`` (None: overwrite)."""
    count = _counts(out, d, index)
    touched = count > 0
    keep = (~touched).to(out.dtype)
    if reduce is None:  # of duplicate writes only the surviving one carries a derivative
        ids = torch.arange(index.numel(), device=out.device).reshape(index.shape)
        written = torch.full(out.shape, -1, dtype=ids.dtype, device=out.device).scatter(d, index, ids)
        return keep, (written.gather(d, index) == ids).to(out.dtype)
    if reduce == "sum":
        return (1.0 if include_self else keep), 1.0
    if reduce == "mean":
        denom = torch.where(touched, count + float(include_self), torch.ones((), dtype=out.dtype, device=out.device))
        return torch.where(touched, float(include_self) / denom, keep), denom.reciprocal().gather(d, index)
    if reduce in ("amax", "amin"):
        # the winners share the derivative evenly, as torch's backward does
        self_wins = (_value(x) == out) & (~touched if not include_self else torch.ones_like(touched))
        src_wins = _within(_value(src), index) == out.gather(d, index)
        n = self_wins.to(out.dtype).scatter_add(d, index, src_wins.to(out.dtype))
        return self_wins.to(out.dtype) / n, src_wins.to(out.dtype) / n.gather(d, index)
    raise UnsupportedOperatorError(f"no derivative rule for aten.scatter_reduce.two with reduce={reduce!r}: hoad has "
                                   "rules for sum, mean, amax and amin")


def _src_blocks(ctx: Ctx, src: Jet, d: int, index: torch.Tensor, c_src) -> dict:
    """Blocks of scatter_add(zeros, d, index, c_src ⊙ src)."""
    r, new = ctx.out.ndim, tuple(ctx.out.shape)

    def fn(t: torch.Tensor) -> torch.Tensor:
        rest = list(t.shape[r:])
        s = _within(t, index)
        if isinstance(c_src, torch.Tensor):
            s = s * c_src.reshape(list(c_src.shape) + [1] * len(rest))
        return t.new_zeros(list(new) + rest).scatter_add(d, _expand_index(index, rest), s)

    return linear(ctx, src, lambda b: map_out(b, r, fn, new, _alongside(new, d, index, src.shape)))


def _alongside(out_shape, d: int, index: torch.Tensor, src_shape) -> dict[int, int]:
    """The axes a scatter or gather along ``d`` maps one to one (index, src and output of one
    size there): a sample axis of a per-sample scatter (GNN messages into (B, N, F)) stays one."""
    return {a: a for a in range(len(out_shape)) if a != d and out_shape[a] == index.shape[a] == src_shape[a]}


def _scatter(ctx: Ctx, x, dim: int, index, src, reduce: str | None, include_self: bool = True) -> dict:
    r = ctx.out.ndim
    d = dim % r if r else 0
    idx = _value(index)
    c_self, c_src = _coefficients(ctx.out, x, d, idx, src, reduce, include_self)
    parts = []
    if _varies(x):
        parts.append(scaled(ctx, x, c_self, tuple(ctx.out.shape)))
    if _varies(src):
        parts.append(_src_blocks(ctx, src, d, idx, c_src))
    return {K: b.to(ctx.out.dtype) for K, b in sum_blocks(*parts).items()}


def _scatter_vjp(v, g: Block, x, dim: int, index, src, reduce: str | None, include_self: bool = True) -> list:
    out, r = v.out, v.out.ndim
    d = dim % r if r else 0
    idx = _value(index)
    c_self, c_src = _coefficients(out, x, d, idx, src, reduce, include_self)
    pairs = []
    if _varies(x):
        pairs.append((x, scale_out(g, c_self, tuple(out.shape))))
    if _varies(src):
        sv = _value(src)

        def fn(t: torch.Tensor) -> torch.Tensor:
            rest = list(t.shape[r:])
            s = t.gather(d, _expand_index(idx, rest))
            if isinstance(c_src, torch.Tensor):
                s = s * c_src.reshape(list(c_src.shape) + [1] * len(rest))
            spec = [0, 0] * len(rest)
            for a in reversed(range(r)):
                spec += [0, sv.shape[a] - idx.shape[a]]
            return aten.constant_pad_nd(s, spec, 0.0) if any(spec) else s

        pairs.append((src, map_out(g, r, fn, sv.shape, _alongside(out.shape, d, idx, sv.shape))))
    return pairs


def scatter_rule(ctx: Ctx, x, dim: int, index, src):
    """x with the entries at index (along dim) overwritten by src: x's blocks there dropped, src's placed."""
    return _scatter(ctx, x, dim, index, src, None)


def scatter_vjp(v, g: Block, x, dim: int, index, src):
    return _scatter_vjp(v, g, x, dim, index, src, None)


OPS.register(aten.scatter.src, rule=scatter_rule, vjp=scatter_vjp)


def scatter_value_rule(ctx: Ctx, x, dim: int, index, value):
    return _scatter(ctx, x, dim, index, None, None)


def scatter_value_vjp(v, g: Block, x, dim: int, index, value):
    return _scatter_vjp(v, g, x, dim, index, None, None)


OPS.register(aten.scatter.value, rule=scatter_value_rule, vjp=scatter_value_vjp)


def scatter_add_rule(ctx: Ctx, x, dim: int, index, src):
    return _scatter(ctx, x, dim, index, src, "sum")


def scatter_add_vjp(v, g: Block, x, dim: int, index, src):
    return _scatter_vjp(v, g, x, dim, index, src, "sum")


OPS.register(aten.scatter_add.default, rule=scatter_add_rule, vjp=scatter_add_vjp)


def scatter_reduce_rule(ctx: Ctx, x, dim: int, index, src, reduce: str, include_self: bool = True):
    """sum and mean are linear with coefficients from the index counts; amax/amin follow the winners."""
    return _scatter(ctx, x, dim, index, src, reduce, include_self)


def scatter_reduce_vjp(v, g: Block, x, dim: int, index, src, reduce: str, include_self: bool = True):
    return _scatter_vjp(v, g, x, dim, index, src, reduce, include_self)


OPS.register(aten.scatter_reduce.two, rule=scatter_reduce_rule, vjp=scatter_reduce_vjp)


