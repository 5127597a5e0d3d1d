"""Compact derivative blocks: the tensors hoad's rules compute with.

Densely, the block of node ``v`` for the multi-index ``K`` has the axes of ``v`` (the *output
part*) followed by the axes of every wrt input named in ``K`` (the *slots*). Most of its entries
are structural zeros: elementwise ops have diagonal Jacobians and independent samples never mix.
A :class:`Block` stores only the compact part::

    dense[i_0, ..., i_{n-1}] = data[j_0, ..., j_{m-1}]  when the dense indices agree within
                                                        every class, j_c being their common value
                             = 0                        otherwise

``dims[a]`` is the data axis (the *class*) of dense axis ``a``. Dense axes that share a class form
a diagonal: an einsum label used more than once. A data axis of size 1 under dense axes of size
``n`` means the block is constant (broadcast) along them.

Everything here is plain torch on ``data``, so it runs eagerly in tests and emits ATen nodes when
the derivative program is traced.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from typing import Callable

import opt_einsum
import torch

from hoad.errors import internal_check

Label = Hashable


class Block:
    """A derivative block in compact form (see the module docstring)."""

    __slots__ = ("data", "dims", "shape", "unit")

    def __init__(self, data: torch.Tensor, dims: Sequence[int], shape: Sequence[int], unit: bool = False):
        self.data = data
        self.dims = tuple(dims)
        self.shape = tuple(int(s) for s in shape)
        # ``unit``: every stored entry is exactly 1 (an identity seed or a relabelling of one).
        self.unit = unit

    # ----------------------------------------------------------------------------- constructors
    @staticmethod
    def dense(t: torch.Tensor) -> Block:
        """A plain tensor as a block whose dense axes are all distinct."""
        return Block(t, range(t.ndim), t.shape)

    @staticmethod
    def identity(like: torch.Tensor, shape: Sequence[int]) -> Block:
        """∂x/∂x for x of ``shape``: a block with shape ``shape + shape``, one diagonal per axis."""
        r = len(shape)
        ones = like.new_ones((1,) * r)
        return Block(ones, tuple(range(r)) * 2, tuple(shape) * 2, unit=True)

    # ---------------------------------------------------------------------------------- queries
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Entries stored (the compact size), as opposed to ``math.prod(self.shape)``."""
        return self.data.numel()

    def __repr__(self) -> str:
        return f"Block(data={tuple(self.data.shape)}, dims={self.dims}, shape={self.shape}, unit={self.unit})"

    # ---------------------------------------------------------------------------- relabellings
    def permute(self, perm: Sequence[int]) -> Block:
        """Reorder dense axes: the result's axis ``a`` is this block's axis ``perm[a]``. No data moves."""
        return _canonical(self.data, [self.dims[p] for p in perm], [self.shape[p] for p in perm], self.unit)

    def scale(self, c: float) -> Block:
        if c == 1:
            return self
        return Block(self.data * c, self.dims, self.shape)

    def neg(self) -> Block:
        return Block(-self.data, self.dims, self.shape)

    def to(self, dtype: torch.dtype) -> Block:
        if self.data.dtype == dtype:
            return self
        return Block(self.data.to(dtype), self.dims, self.shape, self.unit)

    # ----------------------------------------------------------------------------- densifying
    def refine(self, partition: Sequence[int]) -> Block:
        """The same block stored with a finer class structure.

        ``partition[a]`` names the new class of dense axis ``a``; axes in one new class must share
        an old class. Where an old class splits, its diagonal is written out with identity factors.
        """
        internal_check(len(partition) == self.ndim, "refine: partition has the wrong length")
        new_classes = _first_appearance(partition)
        if len(new_classes) == self.data.ndim:
            return _canonical(self.data, partition, self.shape, self.unit)
        # old class -> the new classes it splits into (in order of first appearance)
        split: dict[int, list[int]] = {}
        for a, (old, new) in enumerate(zip(self.dims, partition)):
            parts = split.setdefault(old, [])
            if new not in parts:
                parts.append(new)
        for old, parts in split.items():
            for new in parts:
                owners = {self.dims[a] for a in range(self.ndim) if partition[a] == new}
                internal_check(owners == {old}, "refine: new class spans several old classes")
        # Build data over the new classes: data axis ``old`` becomes the first of its parts; each
        # further part is a new axis tied to the first through an identity matrix.
        data = self.data
        order = [split[old][0] for old in range(self.data.ndim)]
        extra = [(split[old][0], new) for old in range(self.data.ndim) for new in split[old][1:]]
        for _first, _new in extra:
            data = data.unsqueeze(-1)
        out = data
        for k, (first, _new) in enumerate(extra):
            n = self.shape[partition.index(first)]
            eye = torch.eye(n, dtype=data.dtype, device=data.device)
            view = [1] * out.ndim
            view[order.index(first)] = n
            view[len(order) + k] = n
            out = out * eye.reshape(view)
        classes = order + [new for _first, new in extra]
        remap = {new: i for i, new in enumerate(classes)}
        return _canonical(out, [remap[p] for p in partition], self.shape)

    def untie(self, axes: Iterable[int]) -> Block:
        """Give each dense axis in ``axes`` a class of its own, stored at full size."""
        axes = list(axes)
        partition = list(self.dims)
        fresh = max(partition, default=-1) + 1
        for a in axes:
            if sum(1 for d in partition if d == partition[a]) > 1:
                partition[a] = fresh
                fresh += 1
        blk = self.refine(partition)
        sizes = list(blk.data.shape)
        for a in axes:
            sizes[blk.dims[a]] = blk.shape[a]
        if sizes != list(blk.data.shape):
            blk = Block(blk.data.expand(sizes), blk.dims, blk.shape)
        return blk

    def materialize(self, keep: Sequence[int] = ()) -> torch.Tensor:
        """The dense tensor (contiguous). Axes in ``keep`` stay tied to their class."""
        partition = list(range(self.ndim))
        for a in keep:
            partition[a] = next(b for b in keep if self.dims[b] == self.dims[a])
        blk = self.refine(_relabel(partition))
        # now each class is a single dense axis (except kept ties); expand broadcast data
        keep_first = [a for a in range(self.ndim) if blk.dims.index(blk.dims[a]) == a]
        sizes = [blk.shape[a] for a in keep_first]
        data = blk.data.expand(sizes) if list(blk.data.shape) != sizes else blk.data
        return data.contiguous()


# ---------------------------------------------------------------------------------- helpers
def _first_appearance(dims: Sequence[int]) -> list[int]:
    seen: list[int] = []
    for d in dims:
        if d not in seen:
            seen.append(d)
    return seen


def _relabel(dims: Sequence[int]) -> list[int]:
    order = _first_appearance(dims)
    index = {d: i for i, d in enumerate(order)}
    return [index[d] for d in dims]


def _canonical(data: torch.Tensor, dims: Sequence[int], shape: Sequence[int], unit: bool = False) -> Block:
    """Number classes by first appearance among the dense axes and drop classes without axes."""
    order = _first_appearance(dims)
    orphans = [c for c in range(data.ndim) if c not in order]
    internal_check(all(data.shape[c] == 1 for c in orphans), "block data has a full axis that no dense axis uses")
    if orphans:  # size-1 axes left behind by a squeeze or a sum
        data = data.reshape([data.shape[c] for c in range(data.ndim) if c in order])
        shift = {c: c - sum(1 for o in orphans if o < c) for c in order}
        dims = [shift[d] for d in dims]
        order = [shift[c] for c in order]
    if order != list(range(len(order))):
        data = data.permute(order)
    index = {c: i for i, c in enumerate(order)}
    return Block(data, [index[d] for d in dims], shape, unit)


def _squeeze_axes(t: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
    if not axes:
        return t
    keep = [t.shape[i] for i in range(t.ndim) if i not in axes]
    return t.reshape(keep)


def _arrange(t: torch.Tensor, labels: list, target: list) -> torch.Tensor:
    """Permute ``t`` (axes named by ``labels``) into ``target`` order, size-1 axes where missing."""
    present = [l for l in target if l in labels]
    perm = [labels.index(l) for l in present]
    if perm != list(range(len(perm))):
        t = t.permute(perm)
    shape = [t.shape[present.index(l)] if l in labels else 1 for l in target]
    if list(t.shape) != shape:
        t = t.reshape(shape)
    return t


def _reduce_private(t: torch.Tensor, labels: list, needed: set) -> tuple[torch.Tensor, list]:
    """Sum out the axes whose labels nothing downstream needs."""
    drop = [i for i, l in enumerate(labels) if l not in needed]
    if not drop:
        return t, labels
    full = [i for i in drop if t.shape[i] != 1]
    if full:
        t = t.sum(full, keepdim=True)
    return _squeeze_axes(t, drop), [l for i, l in enumerate(labels) if i not in drop]


def _pair(x: torch.Tensor, xs: list, y: torch.Tensor, ys: list, keep: set) -> tuple[torch.Tensor, list]:
    """Contract two labelled tensors, keeping the labels in ``keep``; emits mul or (b)mm."""
    x, xs = _reduce_private(x, xs, set(ys) | keep)
    y, ys = _reduce_private(y, ys, set(xs) | keep)
    # A shared label of size 1 in one operand: that operand is constant along it, so drop it there.
    sx = [i for i, l in enumerate(xs) if l in ys and x.shape[i] == 1 and (l not in keep or y.shape[ys.index(l)] != 1)]
    if sx:
        x, xs = _squeeze_axes(x, sx), [l for i, l in enumerate(xs) if i not in sx]
    sy = [i for i, l in enumerate(ys) if l in xs and y.shape[i] == 1]
    if sy:
        y, ys = _squeeze_axes(y, sy), [l for i, l in enumerate(ys) if i not in sy]
    x, xs = _reduce_private(x, xs, set(ys) | keep)
    y, ys = _reduce_private(y, ys, set(xs) | keep)

    batch = [l for l in xs if l in ys and l in keep]
    contracted = [l for l in xs if l in ys and l not in keep]
    left = [l for l in xs if l not in ys]
    right = [l for l in ys if l not in xs]
    out = batch + left + right
    if not contracted:
        return _arrange(x, xs, out) * _arrange(y, ys, out), out

    def sizes(t, ls, names):
        return [t.shape[ls.index(n)] for n in names]

    b, m, n, k = sizes(x, xs, batch), sizes(x, xs, left), sizes(y, ys, right), sizes(x, xs, contracted)
    lead = [math.prod(b)] if batch else []
    x2 = _arrange(x, xs, batch + left + contracted).reshape(lead + [math.prod(m), math.prod(k)])
    y2 = _arrange(y, ys, batch + contracted + right).reshape(lead + [math.prod(k), math.prod(n)])
    z = torch.bmm(x2, y2) if batch else torch.mm(x2, y2)
    return z.reshape(b + m + n), out


def _einsum(terms: list[tuple[torch.Tensor, list]], out: list, size: dict) -> torch.Tensor:
    """Contract labelled tensors into ``out`` order along a path chosen by opt_einsum."""
    terms = list(terms)
    if len(terms) > 2:
        symbols: dict = {}
        for _t, ls in terms:
            for l in ls:
                symbols.setdefault(l, opt_einsum.get_symbol(len(symbols)))
        for l in out:
            symbols.setdefault(l, opt_einsum.get_symbol(len(symbols)))
        expr = ",".join("".join(symbols[l] for l in ls) for _t, ls in terms) + "->" + "".join(symbols[l] for l in out)
        path, _info = opt_einsum.contract_path(expr, *[tuple(t.shape) for t, _ls in terms], shapes=True)
    else:
        path = [(0, 1)] if len(terms) == 2 else []
    for i, j in path:
        (x, xs), (y, ys) = terms[i], terms[j]
        rest = [terms[k] for k in range(len(terms)) if k not in (i, j)]
        needed = set(out).union(*[set(ls) for _t, ls in rest])
        terms = rest + [_pair(x, xs, y, ys, needed)]
    (t, ls), = terms
    t, ls = _reduce_private(t, ls, set(out))
    return _arrange(t, ls, out)


def _diagonal(t: torch.Tensor, labels: list) -> tuple[torch.Tensor, list]:
    """Collapse repeated labels of one operand onto a single axis (its diagonal)."""
    while len(set(labels)) < len(labels):
        for i, l in enumerate(labels):
            j = labels.index(l)
            if j != i:
                break
        if t.shape[i] == 1:
            t, labels = _squeeze_axes(t, [i]), labels[:i] + labels[i + 1:]
        elif t.shape[j] == 1:
            t, labels = _squeeze_axes(t, [j]), labels[:j] + labels[j + 1:]
        else:
            t = torch.diagonal(t, 0, j, i)
            labels = [m for k, m in enumerate(labels) if k not in (i, j)] + [l]
    return t, labels


# --------------------------------------------------------------------------------- algebra
def contract(operands: Sequence[tuple[Block, Sequence[Label]]], out: Sequence[Label],
             sizes: dict | None = None) -> Block:
    """Einsum over blocks: multiply the operands, sum labels absent from ``out``.

    Each operand names its dense axes with labels; equal labels across operands are the same
    index. The result's dense axes are named by ``out`` (a label may repeat: a diagonal). Ties
    inside operands are honoured, so a diagonal times a dense block stays compact. ``sizes`` gives
    the sizes of ``out`` labels that no operand has (broadcast axes).
    """
    size: dict = dict(sizes or {})
    parent: dict = {}

    def find(l):
        while parent[l] != l:
            parent[l] = parent[parent[l]]
            l = parent[l]
        return l

    for blk, labels in operands:
        internal_check(len(labels) == blk.ndim, f"contract: {len(labels)} labels for a block of {blk.ndim} axes")
        owner: dict = {}
        for lab, c, n in zip(labels, blk.dims, blk.shape):
            internal_check(size.setdefault(lab, n) == n, f"contract: label {lab!r} has sizes {size[lab]} and {n}")
            parent.setdefault(lab, lab)
            if c in owner:
                a, b = find(owner[c]), find(lab)
                if a != b:
                    parent[b] = a
            else:
                owner[c] = lab
    for lab in out:
        internal_check(lab in size, f"contract: output label {lab!r} has no size")
        parent.setdefault(lab, lab)

    out_roots = [find(l) for l in out]
    result_classes = _first_appearance(out_roots)
    terms: list[tuple[torch.Tensor, list]] = []
    unit_data = None
    for blk, labels in operands:
        roots: list = [None] * blk.data.ndim
        for lab, c in zip(labels, blk.dims):
            roots[c] = find(lab)
        if blk.unit:
            unit_data = blk.data
            continue
        terms.append(_diagonal(blk.data, roots))

    factor = 1
    for r in {find(l) for l in parent} - set(result_classes):
        if all(t.shape[ls.index(r)] == 1 for t, ls in terms if r in ls):
            factor *= size[r]

    if terms:
        present = [r for r in result_classes if any(r in ls for _t, ls in terms)]
        data = _einsum(terms, present, size)
        if len(present) < len(result_classes):
            data = data.reshape([data.shape[present.index(r)] if r in present else 1 for r in result_classes])
        unit = False
    else:
        internal_check(unit_data is not None, "contract: no operands")
        data = unit_data.new_ones((1,) * len(result_classes))
        unit = factor == 1
    if factor != 1:
        data = data * factor
    index = {r: i for i, r in enumerate(result_classes)}
    return Block(data, [index[r] for r in out_roots], [size[l] for l in out], unit)


def meet(partitions: Sequence[Sequence[int]]) -> list[int]:
    """The coarsest class structure finer than every given one (axes tied in all of them)."""
    keys = list(zip(*partitions))
    index: dict = {}
    return [index.setdefault(k, len(index)) for k in keys]


def add(blocks: Sequence[Block]) -> Block:
    """Sum of blocks with the same dense shape (their class structures may differ)."""
    blocks = list(blocks)
    if len(blocks) == 1:
        return blocks[0]
    shape = blocks[0].shape
    internal_check(all(b.shape == shape for b in blocks), "add: blocks have different shapes")
    partition = meet([b.dims for b in blocks])
    refined = [b.refine(partition) for b in blocks]
    total = refined[0].data
    for b in refined[1:]:
        total = total + b.data
    return Block(total, refined[0].dims, shape)


# -------------------------------------------------------------- linear maps on the output part
def map_out(blk: Block, r: int, fn: Callable[[torch.Tensor], torch.Tensor], new_out: Sequence[int]) -> Block:
    """Apply a linear map to the first ``r`` dense axes (the output part), carrying the slots.

    ``fn`` receives data whose leading ``r`` axes are the output axes at full size, followed by
    one axis per other class, and must return data whose leading axes are ``new_out``.
    """
    blk = blk.untie(range(r))
    out_classes = [blk.dims[a] for a in range(r)]
    rest = [c for c in range(blk.data.ndim) if c not in out_classes]
    perm = out_classes + rest
    data = blk.data.permute(perm) if perm != list(range(len(perm))) else blk.data
    new = fn(data)
    r2 = len(new_out)
    internal_check(tuple(new.shape[:r2]) == tuple(new_out), f"map_out: got {tuple(new.shape)}, expected leading {tuple(new_out)}")
    index = {c: r2 + i for i, c in enumerate(rest)}
    dims = list(range(r2)) + [index[d] for d in blk.dims[r:]]
    return _canonical(new, dims, list(new_out) + list(blk.shape[r:]))


def permute_out(blk: Block, r: int, perm: Sequence[int]) -> Block:
    return blk.permute(list(perm) + list(range(r, blk.ndim)))


def sum_out(blk: Block, r: int, axes: Sequence[int], keepdim: bool = False) -> Block:
    """Sum over output axes. A summed axis tied to a slot just leaves the diagonal to the slot."""
    axes = sorted({a % r for a in axes}) if r else []
    data, dims = blk.data, list(blk.dims)
    reduce_classes, factor = [], 1
    alive = list(range(blk.ndim))
    for a in axes:
        c = dims[a]
        alive.remove(a)
        if any(dims[b] == c for b in alive):
            continue
        if data.shape[c] == 1:
            factor *= blk.shape[a]
        else:
            reduce_classes.append(c)
    if reduce_classes:
        data = data.sum(reduce_classes, keepdim=True)
    if factor != 1:
        data = data * factor
    if keepdim:
        # each summed output axis becomes a size-1 axis of its own
        fresh = data.ndim
        extra = 0
        shape = list(blk.shape)
        for a in axes:
            dims[a] = fresh + extra
            extra += 1
            shape[a] = 1
        data = data.reshape(list(data.shape) + [1] * extra)
        return _canonical(data, dims, shape)
    keep = [a for a in range(blk.ndim) if a not in axes]
    unit = blk.unit and not reduce_classes and factor == 1
    return _canonical(data, [dims[a] for a in keep], [blk.shape[a] for a in keep], unit)


def unsqueeze_out(blk: Block, r: int, dim: int) -> Block:
    dim = dim % (r + 1)
    fresh = blk.data.ndim
    data = blk.data.reshape(list(blk.data.shape) + [1])
    dims = list(blk.dims[:dim]) + [fresh] + list(blk.dims[dim:])
    shape = list(blk.shape[:dim]) + [1] + list(blk.shape[dim:])
    return _canonical(data, dims, shape, blk.unit)


def squeeze_out(blk: Block, r: int, dims_to_drop: Sequence[int]) -> Block:
    drop = {d % r for d in dims_to_drop if blk.shape[d % r] == 1} if r else set()
    keep = [a for a in range(blk.ndim) if a not in drop]
    return _canonical(blk.data, [blk.dims[a] for a in keep], [blk.shape[a] for a in keep], blk.unit)


def expand_out(blk: Block, r: int, new_out: Sequence[int]) -> Block:
    """Broadcast the output part to ``new_out`` (leading axes may be added)."""
    lead = len(new_out) - r
    internal_check(lead >= 0, "expand_out: cannot drop axes")
    for _ in range(lead):
        blk = unsqueeze_out(blk, r, 0)
        r += 1
    grow = [a for a in range(r) if blk.shape[a] != new_out[a]]
    if not grow:
        return blk
    internal_check(all(blk.shape[a] == 1 for a in grow), "expand_out: only size-1 axes can grow")
    blk = blk.untie(grow)
    shape = list(new_out) + list(blk.shape[r:])
    return Block(blk.data, blk.dims, shape, blk.unit)


def reshape_out(blk: Block, r: int, new_out: Sequence[int]) -> Block:
    """View the output part as ``new_out``; axes the view leaves alone keep their ties."""
    old_out = list(blk.shape[:r])
    new_out = list(new_out)
    if old_out == new_out:
        return blk
    groups = _view_groups(old_out, new_out)
    if groups is None:
        return map_out(blk, r, lambda d: d.reshape(new_out + list(d.shape[r:])), new_out)
    moved_old = [a for g_old, g_new in groups if not _same(g_old, g_new, old_out, new_out) for a in g_old]
    moved_new = [a for g_old, g_new in groups if not _same(g_old, g_new, old_out, new_out) for a in g_new]
    blk = blk.untie(moved_old)
    moved_classes = [blk.dims[a] for a in moved_old]
    rest = [c for c in range(blk.data.ndim) if c not in moved_classes]
    perm = moved_classes + rest
    data = blk.data.permute(perm) if perm != list(range(len(perm))) else blk.data
    data = data.reshape([new_out[a] for a in moved_new] + [blk.data.shape[c] for c in rest])
    index = {c: len(moved_new) + i for i, c in enumerate(rest)}
    new_index = {a: i for i, a in enumerate(moved_new)}
    old_to_new = {}
    for g_old, g_new in groups:
        if _same(g_old, g_new, old_out, new_out):
            for a, b in zip(g_old, g_new):
                old_to_new[b] = a
    dims = []
    for b in range(len(new_out)):
        dims.append(new_index[b] if b in new_index else index[blk.dims[old_to_new[b]]])
    dims += [index[d] for d in blk.dims[r:]]
    return _canonical(data, dims, new_out + list(blk.shape[r:]), blk.unit)


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
