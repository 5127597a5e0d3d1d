"""Decompositions of the ops that read or write by position: strided views of an input's own
storage, scatters, index puts, segment and bag reductions, grid sampling. Each is written in
ops with rules and keeps what the op computes exactly (issue 17)."""

from __future__ import annotations

import functools
import math
import operator

import torch

from hoad.passes.tracing import reads_input, strided_read

aten = torch.ops.aten

_BAG_SUM, _BAG_MEAN, _BAG_MAX = 0, 1, 2


def _contiguous_strides(size) -> list[int]:
    strides, step = [], 1
    for n in reversed(list(size)):
        strides.append(step)
        step *= max(int(n), 1)
    return strides[::-1]


def _own_positions(x, size, stride, storage_offset):
    """The positions in x's own entries that a strided view of x's storage reads, or None where it
    reads outside them (or x is not contiguous, its storage order unlike its entries')."""
    if not x.is_contiguous():
        return None
    size, stride = [int(n) for n in size], [int(s) for s in stride]
    start = (x.storage_offset() if storage_offset is None else int(storage_offset)) - x.storage_offset()
    if any(s < 0 for s in stride):
        return None
    last = start + sum((n - 1) * s for n, s in zip(size, stride))
    if math.prod(size) and (start < 0 or last >= x.numel()):
        return None
    return size, stride, start


def _copy(x, src, non_blocking=False):
    """The functional ``copy`` (functionalization's form of ``copy_`` into a fresh buffer: circular
    padding's) as src broadcast to x's shape in x's dtype: torch's autograd has no formula for
    ``copy``, so training through a program holding it failed ("derivative for aten::copy is not
    implemented")."""
    return src.to(device=x.device, dtype=x.dtype).expand(x.shape).clone()


def _flat_strided_index(size, stride, offset: int, device):
    """The flat positions a strided view reads: offset + Σ i_k·stride_k."""
    index = torch.full(size, offset, dtype=torch.long, device=device)
    for k, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[k] = n
        index = index + torch.arange(n, device=device).reshape(shape) * s
    return index


def _as_strided(x, size, stride, storage_offset=None):
    """as_strided of a contiguous tensor (decompositions such as group_norm's emit it on their
    intermediates) as what it reads: a view when the strides are those of ``size`` laid out
    densely, else the entries at offset + Σ i_k·stride_k of the flat tensor, a gather with a
    constant index. A view that reads outside x's own entries, or of a non-contiguous x, reads
    storage, not entries: left to the rule table (unsupported)."""
    positions = _own_positions(x, size, stride, storage_offset)
    if positions is None:
        return NotImplemented
    if reads_input(x):
        strided_read()  # capture records that the program assumes its inputs own their storage
    size, stride, offset = positions
    if offset == 0 and math.prod(size) == x.numel() and stride == _contiguous_strides(size):
        return x.view(size)
    return x.reshape(-1)[_flat_strided_index(size, stride, offset, x.device)]


# ops traced as themselves inside their own decomposition (see _op_itself)
_AS_ITSELF: set = set()


def _op_itself(op, *args):
    """``op`` called inside its own decomposition, traced as one node: for the outputs that carry
    no derivative (frexp's exponent, embedding_bag's bookkeeping), on values that carry none."""
    _AS_ITSELF.add(op)
    try:
        return op(*args)
    finally:
        _AS_ITSELF.discard(op)


def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    """x with the entries a strided view reads replaced by src: an index_put into the flat x.
    Overlapping views (an entry written twice) and non-contiguous x are left unsupported."""
    positions = _own_positions(x, size, stride, storage_offset)
    if positions is None or not _disjoint(*positions[:2]):
        return NotImplemented
    if reads_input(x):
        strided_read()
    size, stride, offset = positions
    index = _flat_strided_index(size, stride, offset, x.device)
    return x.reshape(-1).index_put((index.reshape(-1),), src.reshape(-1)).view(x.shape)


def _disjoint(size, stride) -> bool:
    """Whether a strided view reads every entry once (checked on the strides, no tensor values)."""
    offsets = {0}
    for n, s in zip(size, stride):
        offsets = {o + i * s for o in offsets for i in range(n)}
    return len(offsets) == math.prod(size)


def _put(x, index, source, accumulate=False):
    """put writes into the flattened x: an index_put of the flat tensor."""
    flat = x.reshape(-1).index_put((index.reshape(-1),), source.reshape(-1), accumulate)
    return flat.view(x.shape)


def _masked_gather(values, mask, dim: int):
    """values' entries along ``dim`` taken in order by the True entries of ``mask`` (which spans
    the dims from ``dim`` on): the k-th True entry reads entry k. False entries read a valid entry
    that a where() then drops. Shape: values' with ``dim`` replaced by mask's dims."""
    n = values.shape[dim]
    pos = mask.reshape(-1).to(torch.long).cumsum(0) - 1
    pos = pos.clamp(0, max(n - 1, 0))
    taken = values.index_select(dim, pos)
    return taken.reshape(list(values.shape[:dim]) + list(mask.shape) + list(values.shape[dim + 1:]))


def _masked_scatter(x, mask, source):
    """x with its masked entries replaced, in order, by source's first entries."""
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    m, xb = mask.expand(shape), x.expand(shape)
    if source.numel() == 0:
        return xb.clone()
    return torch.where(m, _masked_gather(source.reshape(-1), m, 0), xb)


def _index_put(x, indices, values, accumulate=False):
    """index_put with one boolean mask (its number of writes depends on the mask's values): each
    True entry reads the next row of values, or the one broadcast row. Other indices: the rule."""
    masks = [k for k, i in enumerate(indices) if i is not None]
    if len(masks) != 1 or indices[masks[0]].dtype != torch.bool:
        return NotImplemented
    if not 0 < indices[masks[0]].ndim <= x.ndim - masks[0]:
        return NotImplemented
    p, mask = masks[0], indices[masks[0]]
    k = mask.ndim
    rest = list(x.shape[p + k:])
    count = values.shape[values.ndim - len(rest) - 1] if values.ndim > len(rest) else 1
    rows = values.expand(list(x.shape[:p]) + [count] + rest)
    taken = _masked_gather(rows, mask, p)
    m = mask.reshape([1] * p + list(mask.shape) + [1] * len(rest))
    if accumulate:
        return x + torch.where(m, taken, torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.where(m, taken.to(x.dtype), x)


def _scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    """scatter_reduce with "prod", without division (exact where src has zeros): each output
    entry multiplies the src entries aimed at it, all others replaced by 1, along a new axis.
    Other reductions: the rule (hoad/rules/indexing.py)."""
    if reduce != "prod":
        return NotImplemented
    if x.ndim == 0:
        return _scatter_reduce(x.reshape(1), 0, index.reshape(1), src.reshape(1), reduce,
                               include_self=include_self).reshape(())
    d = dim % x.ndim
    m = x.shape[d]
    s = src[tuple(slice(0, n) for n in index.shape)]
    hit = index.movedim(d, -1).unsqueeze(-2) == torch.arange(m, device=x.device).unsqueeze(-1)   # (..., m, n)
    one = torch.ones((), dtype=x.dtype, device=x.device)
    prod = torch.where(hit, s.movedim(d, -1).unsqueeze(-2), one).prod(-1).movedim(-1, d)
    touched = hit.any(-1).movedim(-1, d)
    spec = []
    for a in reversed(range(x.ndim)):
        spec += [0, 0 if a == d else x.shape[a] - index.shape[a]]
    if any(spec):
        prod = aten.constant_pad_nd(prod, spec, 1.0)
        touched = aten.constant_pad_nd(touched.to(torch.uint8), spec, 0).to(torch.bool)
    if include_self:
        return x * prod
    return torch.where(touched, prod, x)


def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """index_reduce is scatter_reduce with the index repeated along every other dim."""
    if x.ndim == 0:
        return torch.scatter_reduce(x.reshape(1), 0, index.reshape(1), source.reshape(1), reduce,
                                    include_self=include_self).reshape(())
    d = dim % x.ndim
    shape = [1] * source.ndim
    shape[d] = -1
    index = index.reshape(shape).expand(source.shape)
    return torch.scatter_reduce(x, d, index, source, reduce, include_self=include_self)


_SEGMENT_REDUCE = {"sum": "sum", "mean": "sum", "max": "amax", "min": "amin", "prod": "prod"}


_SEGMENT_EMPTY = {"sum": 0.0, "mean": 0.0, "max": -math.inf, "min": math.inf, "prod": 1.0}


def _segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """Segments along ``axis`` reduced by a scatter_reduce to segment ids found from the lengths
    (or offsets); entries outside every segment go to one extra id, dropped. ``initial`` joins
    every segment (and fills the empty ones); a mean divides by the segment's own count."""
    if indices is not None or reduce not in _SEGMENT_REDUCE:
        return NotImplemented
    a = axis % data.ndim
    if offsets is None:
        ends = lengths.cumsum(-1)
        offsets = torch.cat([torch.zeros_like(ends[..., :1]), ends], -1)
    S, n = offsets.shape[-1] - 1, data.shape[a]
    at = torch.arange(n, device=data.device)
    ids = (offsets[..., :-1].unsqueeze(-1) <= at).sum(-2) - 1                   # (..., n)
    inside = (at >= offsets[..., :1]) & (at < offsets[..., -1:])
    ids = torch.where(inside, ids, S)
    ids = ids.reshape(list(ids.shape) + [1] * (data.ndim - a - 1)).expand(data.shape)
    shape = list(data.shape)
    shape[a] = S + 1
    fill = _SEGMENT_EMPTY[reduce] if initial is None else float(initial)
    start = torch.full(shape, fill, dtype=data.dtype, device=data.device)
    out = torch.scatter_reduce(start, a, ids, data, _SEGMENT_REDUCE[reduce], include_self=initial is not None)
    if reduce == "mean":
        count = torch.zeros(shape, dtype=data.dtype, device=data.device).scatter_add(a, ids, torch.ones_like(data))
        if initial is not None:
            count = count.clamp(min=1)
        out = out / count
    return out.narrow(a, 0, S)


def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1, *, op):
    """Bags of embedding rows summed, averaged or maxed: rows gathered (an embedding) and reduced
    per bag by an index_add or a scatter_reduce; padding rows take no part. The bookkeeping
    outputs (offset2bag, bag sizes, max indices) carry no derivative: the op itself computes them."""
    if op in _AS_ITSELF or indices.ndim != 1:
        return NotImplemented
    n, B = indices.shape[0], offsets.shape[0] - (1 if include_last_offset else 0)
    at = torch.arange(n, device=weight.device)
    ids = (offsets[:B].unsqueeze(-1) <= at).sum(0) - 1
    end = offsets[B] if include_last_offset else n
    used = (at >= offsets[0]) & (at < end)
    if padding_idx >= 0:
        used = used & (indices != padding_idx)
    ids = torch.where(used, ids, B)
    rows = aten.embedding.default(weight, indices, -1, scale_grad_by_freq)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(1)
    D = weight.shape[1]
    if mode == _BAG_MAX:
        start = torch.zeros(B + 1, D, dtype=weight.dtype, device=weight.device)
        out = start.scatter_reduce(0, ids.unsqueeze(1).expand(n, D), rows, "amax", include_self=False)
    else:
        out = torch.zeros(B + 1, D, dtype=rows.dtype, device=weight.device).index_add(0, ids, rows)
        if mode == _BAG_MEAN:
            count = torch.zeros(B + 1, dtype=weight.dtype, device=weight.device).index_add(
                0, ids, torch.ones(n, dtype=weight.dtype, device=weight.device))
            out = out / count.clamp(min=1).unsqueeze(1)
    psw = None if per_sample_weights is None else per_sample_weights.detach()
    _out, offset2bag, bag_size, max_indices = _op_itself(
        op, weight.detach(), indices, offsets, scale_grad_by_freq, mode, sparse, psw, include_last_offset, padding_idx)
    return out[:B], offset2bag, bag_size, max_indices


def _grid_unnormalize(coords, size: int, align_corners: bool):
    mul = (size * 0.5 - 0.5) if align_corners else (size * 0.5)
    return coords * mul + (size * 0.5 - 0.5)


def _grid_reflect(coords, twice_low: int, twice_high: int):
    """Coordinates reflected until they fall in [low, high] (the bounds given doubled)."""
    if twice_low == twice_high:
        return torch.zeros_like(coords)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    dist = (coords - low).abs()
    extra = torch.fmod(dist, span)
    flips = (dist / span).floor().to(torch.int64)
    return torch.where(flips % 2 == 0, extra + low, span + low - extra)


def _grid_source(coords, size: int, padding_mode: int, align_corners: bool):
    c = _grid_unnormalize(coords, size, align_corners)
    if padding_mode == 1:  # border
        return c.clamp(0, size - 1)
    if padding_mode == 2:  # reflection
        c = _grid_reflect(c, 0, 2 * (size - 1)) if align_corners else _grid_reflect(c, -1, 2 * size - 1)
        return c.clamp(0, size - 1)
    return c


def _grid_sampler(a, grid, interpolation_mode: int = 0, padding_mode: int = 0, align_corners: bool = False):
    """Bilinear or trilinear (or nearest) sampling of a (N, C, *spatial) at grid (N, *out, k)
    points, k = 2 or 3: 2ᵏ gathers from the flattened image, each sample's from its own, weighted
    by products of the fractional parts (constant in a, polynomial in the grid between the
    integer crossings). Corners outside the image contribute nothing (a where, so no inf or NaN
    of a reaches through a zero weight). torch's 2-D decomposition indexes a by
    ``arange(N)`` instead, which ties the samples together (a false BatchCouplingError); its
    bicubic mode is kept."""
    k = grid.shape[-1]
    if interpolation_mode not in (0, 1):
        if k == 2:
            from torch._decomp.decompositions import _grid_sampler_2d as grid_sampler_2d

            return grid_sampler_2d(a, grid, interpolation_mode, padding_mode, align_corners, _expand_grid=False)
        return NotImplemented
    N, C = a.shape[:2]
    sizes = list(a.shape[2:])
    out = [N, C] + list(grid.shape[1:-1])
    flat = a.reshape(N, C, -1)
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    # grid[..., 0] indexes the last axis of a, grid[..., 1] the one before: per axis of a, in order
    src = [_grid_source(grid[..., k - 1 - j], sizes[j], padding_mode, align_corners) for j in range(k)]
    strides = [math.prod(sizes[j + 1:]) for j in range(k)]

    def axis(c, j):
        """Whether integer coordinate c is inside axis j, and its offset in the flat image."""
        return (c >= 0) & (c < sizes[j]), c.clamp(0, sizes[j] - 1).to(torch.int64) * strides[j]

    def picked(per_axis):
        """a at one corner, given (inside, offset) per axis, and whether the corner is inside."""
        index = sum(i for _inside, i in per_axis)
        inside = functools.reduce(operator.and_, [inside for inside, _i in per_axis])
        index = index.reshape(N, 1, -1).expand(N, C, index[0].numel())
        return flat.gather(2, index).reshape(out), inside.unsqueeze(1)

    if interpolation_mode == 1:  # nearest
        values, inside = picked([axis(c.round(), j) for j, c in enumerate(src)])
        return torch.where(inside, values, zero)
    lo = [c.floor() for c in src]
    ends = [(axis(l, j), axis(l + 1, j)) for j, l in enumerate(lo)]
    weights = [((l + 1 - c), (c - l)) for c, l in zip(src, lo)]
    total = None
    for bits in range(2 ** k):
        up = [(bits >> (k - 1 - j)) & 1 for j in range(k)]
        values, inside = picked([ends[j][u] for j, u in enumerate(up)])
        w = functools.reduce(operator.mul, [weights[j][u] for j, u in enumerate(up)])
        term = torch.where(inside, values * w.unsqueeze(1), zero)
        total = term if total is None else total + term
    return total
