"""Linear maps of a block's output part (its first ``r`` dense axes), the slots carried along.

These are the derivatives of linear ops: a view, a permutation, a sum, a broadcast, a slice.
Most relabel the compact data's axes without touching it; only axes the op mixes are written
out densely first (:func:`map_out`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from hoad.algebra.block import Block, _canonical
from hoad.algebra.einsum import _arrange, _diagonal
from hoad.algebra.terms import Lazy, _Fresh, force
from hoad.errors import internal_check


def map_out(blk: Block | Lazy, r: int, fn: Callable[[torch.Tensor], torch.Tensor], new_out: Sequence[int],
            keep: dict[int, int] | None = None) -> Block:
    """Apply a linear map to the first ``r`` dense axes (the output part), carrying the slots.

    ``fn`` receives data whose leading ``r`` axes are the output axes at full size (size-1 axes
    included), followed by one axis per other class, and must return data whose leading axes
    are ``new_out``. ``keep`` maps output axes the op acts independently along (old position ->
    new position, same size); they keep their ties, so e.g. slicing features leaves the sample
    axis of a per-sample block diagonal. Every other output axis is written out densely first.
    """
    blk = force(blk)
    keep = dict(keep or {})
    for a in list(keep):
        c = blk.dims[a]
        if c is not None and any(blk.dims[b] == c for b in range(r) if b != a):
            del keep[a]  # tied to another output axis: fn needs it as an axis of its own
    blk = blk.untie([a for a in range(r) if a not in keep])
    sizes = list(blk.data.shape)
    for a in keep:
        if blk.dims[a] is not None:
            sizes[blk.dims[a]] = blk.shape[a]
    data = blk.data.expand(sizes) if sizes != list(blk.data.shape) else blk.data
    out_classes = [blk.dims[a] for a in range(r)]
    rest = [c for c in range(data.ndim) if c not in out_classes]
    perm = [c for c in out_classes if c is not None] + rest
    data = data.permute(perm) if perm != list(range(len(perm))) else data
    if None in out_classes:
        data = data.reshape(list(blk.shape[:r]) + [data.shape[len(perm) - len(rest) + i] for i in range(len(rest))])
    new = fn(data)
    r2 = len(new_out)
    internal_check(tuple(new.shape[:r2]) == tuple(new_out),
                   f"map_out: got {tuple(new.shape)}, expected leading {tuple(new_out)}")
    index = {blk.dims[a]: b for a, b in keep.items() if blk.dims[a] is not None}
    index.update({c: r2 + i for i, c in enumerate(rest)})
    dims = list(range(r2)) + [None if d is None else index[d] for d in blk.dims[r:]]
    return _canonical(new, dims, list(new_out) + list(blk.shape[r:]))


def select_out(blk: Block | Lazy, r: int, mask: torch.Tensor) -> Block:
    """``where(mask, blk, 0)`` with ``mask`` a boolean tensor over the output part (broadcast to
    it): entries not selected become exact zeros, even where ``blk`` holds inf or NaN (a product
    with a 0/1 mask would leak them, e.g. the derivative of the branch ``where`` did not take).
    Ties stay: the mask is laid over the data's classes, one diagonal per shared class."""
    blk = force(blk)
    out = list(blk.shape[:r])
    m = mask.expand(out) if list(mask.shape) != out else mask
    labels = list(blk.dims[:r])
    keep = [a for a, c in enumerate(labels) if c is not None]
    m = m.reshape([out[a] for a in keep]) if len(keep) != r else m
    labels = [labels[a] for a in keep]
    m, labels = _diagonal(m, labels)
    m = _arrange(m, labels, list(range(blk.data.ndim)))
    return Block(torch.where(m, blk.data, torch.zeros((), dtype=blk.data.dtype, device=blk.data.device)),
                 blk.dims, blk.shape)


def along(r: int, axes: Sequence[int], removed: bool = False) -> dict[int, int]:
    """``keep`` for an op acting along ``axes`` of an ``r``-axis output: every other axis passes
    through, shifting left past the acted-on axes when ``removed`` (select, diagonal)."""
    axes = {a % r for a in axes} if r else set()
    others = [a for a in range(r) if a not in axes]
    return {a: (i if removed else a) for i, a in enumerate(others)}


def permute_out(blk: Block, r: int, perm: Sequence[int]) -> Block:
    return blk.permute(list(perm) + list(range(r, blk.ndim)))


def sum_out(blk: Block | Lazy, r: int, axes: Sequence[int], keepdim: bool = False) -> Block | Lazy:
    """Sum over output axes. A summed axis tied to a slot just leaves the diagonal to the slot."""
    axes = sorted({a % r for a in axes}) if r else []
    if isinstance(blk, Lazy):
        return blk.relabel([None if a in axes and not keepdim else (_Fresh(1) if a in axes else a)
                            for a in range(blk.ndim)])
    data, dims = blk.data, list(blk.dims)
    reduce_classes, factor = [], 1
    alive = list(range(blk.ndim))
    for a in axes:
        c = dims[a]
        alive.remove(a)
        if c is None or any(dims[b] == c for b in alive):
            continue
        if data.shape[c] == 1:
            factor *= blk.shape[a]
        else:
            reduce_classes.append(c)
    if reduce_classes:
        data = data.sum(reduce_classes, keepdim=True)
    if factor != 1:
        data = data * factor
    unit = blk.unit and not reduce_classes and factor == 1
    if keepdim:
        shape = list(blk.shape)
        for a in axes:
            dims[a], shape[a] = None, 1
        return _canonical(data, dims, shape, unit)
    keep = [a for a in range(blk.ndim) if a not in axes]
    return _canonical(data, [dims[a] for a in keep], [blk.shape[a] for a in keep], unit)


def unsqueeze_out(blk: Block | Lazy, r: int, dim: int) -> Block | Lazy:
    dim = dim % (r + 1)
    if isinstance(blk, Lazy):
        return blk.relabel(list(range(dim)) + [_Fresh(1)] + list(range(dim, blk.ndim)))
    return Block(blk.data, blk.dims[:dim] + (None,) + blk.dims[dim:], blk.shape[:dim] + (1,) + blk.shape[dim:],
                 blk.unit)


def squeeze_out(blk: Block | Lazy, r: int, dims_to_drop: Sequence[int]) -> Block | Lazy:
    drop = {d % r for d in dims_to_drop if blk.shape[d % r] == 1} if r else set()
    keep = [a for a in range(blk.ndim) if a not in drop]
    if isinstance(blk, Lazy):
        return blk.relabel([a if a in keep else None for a in range(blk.ndim)])
    return Block(blk.data, [blk.dims[a] for a in keep], [blk.shape[a] for a in keep], blk.unit)


def expand_out(blk: Block | Lazy, r: int, new_out: Sequence[int]) -> Block | Lazy:
    """Broadcast the output part to ``new_out`` (leading axes may be added)."""
    lead = len(new_out) - r
    internal_check(lead >= 0, "expand_out: cannot drop axes")
    if isinstance(blk, Lazy):
        grown = [_Fresh(n) for n in new_out[:lead]]
        grown += [a if blk.shape[a] == new_out[lead + a] else _Fresh(new_out[lead + a]) for a in range(r)]
        return blk.relabel(grown + list(range(r, blk.ndim)))
    for _ in range(lead):
        blk = unsqueeze_out(blk, r, 0)
        r += 1
    grow = [a for a in range(r) if blk.shape[a] != new_out[a]]
    if not grow:
        return blk
    internal_check(all(blk.shape[a] == 1 for a in grow), "expand_out: only size-1 axes can grow")
    dims, c = list(blk.dims), blk.data.ndim
    for a in grow:  # each grown axis gets a broadcast class (a stored axis of size 1)
        dims[a] = c
        c += 1
    data = blk.data.reshape(list(blk.data.shape) + [1] * len(grow))
    shape = list(new_out) + list(blk.shape[r:])
    return _canonical(data, dims, shape, blk.unit)


def reshape_out(blk: Block | Lazy, r: int, new_out: Sequence[int]) -> Block | Lazy:
    """View the output part as ``new_out``; axes the view leaves alone keep their ties."""
    old_out = list(blk.shape[:r])
    new_out = list(new_out)
    if old_out == new_out:
        return blk
    if isinstance(blk, Lazy) and [n for n in old_out if n != 1] == [n for n in new_out if n != 1]:
        # only size-1 axes come or go: a relabelling
        kept = [a for a in range(r) if old_out[a] != 1]
        it = iter(kept)
        axes = [next(it) if n != 1 else _Fresh(1) for n in new_out]
        return blk.relabel(axes + list(range(r, blk.ndim)))
    blk = force(blk)
    groups = _view_groups(old_out, new_out)
    if groups is None:
        return map_out(blk, r, lambda d: d.reshape(new_out + list(d.shape[r:])), new_out)
    moved = [(g_old, g_new) for g_old, g_new in groups if not _same(g_old, g_new, old_out, new_out)]
    moved_old = [a for g_old, _ in moved for a in g_old]
    moved_new = [b for _, g_new in moved for b in g_new]
    blk = blk.untie(moved_old)
    moved_classes = [blk.dims[a] for a in moved_old if blk.dims[a] is not None]
    rest = [c for c in range(blk.data.ndim) if c not in moved_classes]
    data = blk.data
    if moved_classes:
        perm = moved_classes + rest
        data = data.permute(perm) if perm != list(range(len(perm))) else data
        data = data.reshape([new_out[b] for b in moved_new if new_out[b] != 1] + [blk.data.shape[c] for c in rest])
    index = {c: i + sum(1 for b in moved_new if new_out[b] != 1) for i, c in enumerate(rest)}
    new_class, k = {}, 0
    for b in moved_new:
        if new_out[b] != 1:
            new_class[b] = k
            k += 1
    kept = {}
    for g_old, g_new in groups:
        if _same(g_old, g_new, old_out, new_out):
            kept.update(zip(g_new, g_old))
    dims = []
    for b in range(len(new_out)):
        if b in new_class:
            dims.append(new_class[b])
        elif b in kept and blk.dims[kept[b]] is not None:
            dims.append(index[blk.dims[kept[b]]])
        else:
            dims.append(None)
    dims += [None if d is None else index[d] for d in blk.dims[r:]]
    return _canonical(data, dims, new_out + list(blk.shape[r:]), blk.unit and not moved_classes)


def _same(g_old, g_new, old, new) -> bool:
    return len(g_old) == len(g_new) and all(old[a] == new[b] for a, b in zip(g_old, g_new))


def _view_groups(old: list[int], new: list[int]) -> list[tuple[list[int], list[int]]] | None:
    """Split a reshape into groups of old/new axes with equal products (size-1 axes separate)."""
    if math.prod(old) != math.prod(new):
        return None
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        if i < len(old) and old[i] == 1 and (j >= len(new) or new[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(new) and new[j] == 1 and (i >= len(old) or old[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(old) or j >= len(new):
            return None
        gi, gj, pi, pj = [i], [j], old[i], new[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                if i >= len(old):
                    return None
                gi.append(i)
                pi *= old[i]
                i += 1
            else:
                if j >= len(new):
                    return None
                gj.append(j)
                pj *= new[j]
                j += 1
        groups.append((gi, gj))
    return groups


