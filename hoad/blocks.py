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
``n`` means the block is constant (broadcast) along them. Dense axes of size 1 have no class
(``dims[a] is None``) and no storage, so adding or removing them never touches ``data``.

Everything here is plain torch on ``data``, so it runs eagerly in tests and emits ATen nodes when
the derivative program is traced.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import math
from collections.abc import Hashable, Iterable, Sequence
from typing import Callable

import opt_einsum
import torch

from hoad import kernels
from hoad.errors import HoadInternalError, internal_check

Label = Hashable

# Tests set this to seed every input with a dense identity: no ties anywhere, so the whole
# program runs on dense blocks, and its results must equal the compact program's.
DENSE_SEEDS = False

# Whether pairwise contractions put the larger side of a matrix product on the right even at
# the price of extra permutes: worth it when a compiler fuses the permutes into neighbouring
# kernels (Inductor), not when each permute is a copy of its own (eager). Set per program.
WIDE_GEMMS: contextvars.ContextVar[bool] = contextvars.ContextVar("hoad_wide_gemms", default=False)
# Set while building a program that will itself be differentiated under batch_dim (the inner
# Laplacian of a biharmonic): labels this predicate accepts are sample axes, and products keep
# them as batch axes (bmm against a broadcast operand) instead of folding them into the rows of
# a matrix product, which would mix samples for the outer transform.
SAMPLE_LABELS: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("hoad_sample_labels", default=None)
# Under the same flag, batched products of matrices no larger than this on either side are
# emitted as a broadcast multiply and sum for the compiler to fuse (see ``_pair``).
SMALL_MATRIX = 64
# and so are vector-matrix products (one row or one column) of at most this many multiply-adds:
# fused, about 1 us, where an extern call to MKL costs ~3 (order 3 at a point: 61 -> 59 us).
# Not matrix-matrix ones: [40,10]@[10,10] chains as reductions took a seed-MLP gradient 29 -> 68 us.
TINY_PRODUCT = 4096


class Block:
    """A derivative block in compact form (see the module docstring)."""

    __slots__ = ("data", "dims", "shape", "unit")

    def __init__(self, data: torch.Tensor, dims: Sequence[int | None], shape: Sequence[int], unit: bool = False):
        self.data = data
        self.dims = tuple(dims)
        self.shape = tuple(int(s) for s in shape)
        # ``unit``: every stored entry is exactly 1 (an identity seed or a relabelling of one).
        self.unit = unit

    # ----------------------------------------------------------------------------- constructors
    @staticmethod
    def dense(t: torch.Tensor) -> Block:
        """A plain tensor as a block whose dense axes are all distinct."""
        return _canonical(t, range(t.ndim), t.shape)

    @staticmethod
    def identity(like: torch.Tensor, shape: Sequence[int]) -> Block:
        """∂x/∂x for x of ``shape``: a block with shape ``shape + shape``, one diagonal per axis."""
        dims, c = [], 0
        for n in shape:
            dims.append(None if n == 1 else c)
            c += n != 1
        ones = like.new_ones((1,) * c)
        seed = Block(ones, dims * 2, tuple(shape) * 2, unit=True)
        return seed.untie(range(len(shape))) if DENSE_SEEDS else seed

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
    def refine(self, partition: Sequence[int | None]) -> Block:
        """The same block stored with a finer class structure.

        ``partition[a]`` names the new class of dense axis ``a`` (None for size-1 axes); axes in
        one new class must share an old class. Where an old class splits, its diagonal is
        written out with identity factors.
        """
        internal_check(len(partition) == self.ndim, "refine: partition has the wrong length")
        partition = [None if self.dims[a] is None else p for a, p in enumerate(partition)]
        if len(_first_appearance(partition)) == self.data.ndim:
            return self  # a refinement with as many classes is the same structure
        # old class -> the new classes it splits into (in order of first appearance)
        split: dict[int, list] = {}
        for old, new in zip(self.dims, partition):
            if old is None:
                continue
            parts = split.setdefault(old, [])
            if new not in parts:
                parts.append(new)
        for a, new in enumerate(partition):
            if new is not None:
                internal_check(all(self.dims[b] == self.dims[a] for b in range(self.ndim) if partition[b] == new),
                               "refine: a new class spans several old classes")
        # data axis ``old`` becomes the first of its parts; each further part is a new trailing
        # axis tied to the first through an identity matrix
        order = [split[old][0] for old in range(self.data.ndim)]
        extra = [(split[old][0], new) for old in range(self.data.ndim) for new in split[old][1:]]
        out = self.data.reshape(list(self.data.shape) + [1] * len(extra))
        for k, (first, _new) in enumerate(extra):
            n = self.shape[partition.index(first)]
            eye = _eye(n, out)
            view = [1] * out.ndim
            view[order.index(first)] = n
            view[len(order) + k] = n
            out = out * eye.reshape(view)
        classes = order + [new for _first, new in extra]
        remap = {new: i for i, new in enumerate(classes)}
        return _canonical(out, [None if p is None else remap[p] for p in partition], self.shape)

    def untie(self, axes: Iterable[int]) -> Block:
        """Give each dense axis in ``axes`` a class of its own, stored at full size."""
        axes = [a for a in axes if self.dims[a] is not None]
        partition = list(self.dims)
        fresh = max((d for d in partition if d is not None), default=-1) + 1
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

    def materialize(self, groups: Sequence[Sequence[int]] = ()) -> torch.Tensor:
        """The dense tensor (contiguous). Each group of dense axes, which must share a class, is
        kept as one axis at the position of its first member (per-sample or diagonal blocks).

        Where a class still spans several output axes (a diagonal), the stored entries are
        scattered into zeros: the cost is the dense size once, not a product per entry."""
        for group in groups:
            internal_check(len({self.dims[a] for a in group if self.dims[a] is not None}) <= 1,
                           "materialize: a kept group is not tied")
        collapsed = {a for group in groups for a in group[1:]}
        axes = [a for a in range(self.ndim) if a not in collapsed]
        classes = [self.dims[a] for a in axes]
        shape = [self.shape[a] for a in axes]
        sizes = [0] * self.data.ndim
        for a in range(self.ndim):
            if self.dims[a] is not None:
                sizes[self.dims[a]] = self.shape[a]
        data = self.data.expand(sizes) if list(self.data.shape) != sizes else self.data
        present = [c for c in classes if c is not None]
        if len(present) == len(set(present)):  # no diagonal left: a permutation of the data
            if present != list(range(len(present))):
                data = data.permute(present)
            return data.reshape(shape).contiguous()
        index = []
        for c in classes:
            view = [1] * data.ndim
            if c is None:
                index.append(torch.zeros(view, dtype=torch.long, device=data.device))
            else:
                view[c] = sizes[c]
                index.append(torch.arange(sizes[c], device=data.device).reshape(view))
        return torch.index_put(data.new_zeros(shape), index, data)


# ---------------------------------------------------------------------------------- helpers
def _eye(n: int, like: torch.Tensor) -> torch.Tensor:
    """The n x n identity in ``like``'s dtype and device. (torch.eye's decomposition counts in
    the smallest integer dtype that fits, uint16 from n = 256, which arange has no CPU kernel for.)"""
    idx = torch.arange(n, device=like.device)
    return (idx.unsqueeze(1) == idx).to(like.dtype)


def _first_appearance(dims: Sequence) -> list:
    seen: list = []
    for d in dims:
        if d is not None and d not in seen:
            seen.append(d)
    return seen


def _canonical(data: torch.Tensor, dims: Sequence, shape: Sequence[int], unit: bool = False) -> Block:
    """Number classes by first appearance, give size-1 axes no class, and drop unused data axes."""
    dims = [None if n == 1 else d for d, n in zip(dims, shape)]
    order = _first_appearance(dims)
    orphans = [c for c in range(data.ndim) if c not in order]
    internal_check(all(data.shape[c] == 1 for c in orphans), "block data has a full axis that no dense axis uses")
    if orphans:  # size-1 axes left behind by a squeeze or a sum
        data = data.reshape([data.shape[c] for c in range(data.ndim) if c in order])
        shift = {c: c - sum(1 for o in orphans if o < c) for c in order}
        dims = [None if d is None else shift[d] for d in dims]
        order = [shift[c] for c in order]
    if order != list(range(len(order))):
        data = data.permute(order)
    index = {c: i for i, c in enumerate(order)}
    return Block(data, [None if d is None else index[d] for d in dims], shape, unit)


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


def _moves(labels: list, target: list) -> int:
    """1 if arranging ``labels`` into ``target`` order needs a permute, else 0."""
    present = [l for l in target if l in labels]
    return int([labels.index(l) for l in present] != sorted(labels.index(l) for l in present))


def _share_samples(x: torch.Tensor, xs: list, y: torch.Tensor, ys: list, keep: set, samples: set):
    """Give each operand the kept sample labels only the other has (broadcast), so they become
    batch labels of the product (see SAMPLE_LABELS)."""
    for l in samples & keep:
        if l in xs and l not in ys and x.shape[xs.index(l)] > 1:
            y, ys = y.unsqueeze(-1).expand(*y.shape, x.shape[xs.index(l)]), ys + [l]
        elif l in ys and l not in xs and y.shape[ys.index(l)] > 1:
            x, xs = x.unsqueeze(-1).expand(*x.shape, y.shape[ys.index(l)]), xs + [l]
    return x, xs, y, ys


def _pair(x: torch.Tensor, xs: list, y: torch.Tensor, ys: list, keep: set, order: list | None = None,
          samples: set = frozenset()):
    """Contract two labelled tensors, keeping the labels in ``keep``; emits one mul or (b)mm.

    Among the equivalent layouts (which operand goes left, the order of labels inside each
    group) it picks the one needing the fewest permutes, ending in ``order`` when given.
    """
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

    contracted = [l for l in xs if l in ys and l not in keep]
    if samples and contracted:
        x, xs, y, ys = _share_samples(x, xs, y, ys, keep, samples)
    if not contracted:
        out = [l for l in (order or []) if l in xs or l in ys] or xs + [l for l in ys if l not in xs]
        return _arrange(x, xs, out) * _arrange(y, ys, out), out

    def sizes(t, ls, names):
        return [t.shape[ls.index(n)] for n in names]

    best = None
    for a, as_, b, bs in ((x, xs, y, ys), (y, ys, x, xs)):
        batch = [l for l in as_ if l in bs and l in keep]
        left = [l for l in as_ if l not in bs]
        right = [l for l in bs if l not in as_]
        m, n = math.prod(sizes(a, as_, left)), math.prod(sizes(b, bs, right))
        for con in (contracted, [l for l in bs if l in contracted]):
            out = batch + left + right
            cost = _moves(as_, batch + left + con) + _moves(bs, batch + con + right)
            cost += int(order is not None and out != [l for l in order if l in out])
            # BLAS runs a short-wide product (m <= n) up to twice as fast as a tall-skinny one
            # (MKL dgemm, one thread: 64x64 @ 64x4096 at 51 GFLOP/s, 4096x64 @ 64x64 at 27).
            # hoad::mm runs a tall one with 32+ columns as fast (4096x64 @ 64x64 in 344 us,
            # 64x64 @ 64x4096 in 506), and its result is sample-major for per-sample products;
            # with 16 columns the wide form still won (order 3 at a point: 66 vs 75 us)
            tall = int(m > 4 * n)
            if WIDE_GEMMS.get():
                k = math.prod(sizes(a, as_, con))
                key = (0 if not batch and n >= kernels.MIN_COLUMNS and kernels.fits(a, m, k, n) else tall, cost)
            else:
                key = (cost, tall)
            if best is None or key < best[0]:
                best = (key, a, as_, b, bs, batch, left, con, right)
    _cost, a, as_, b, bs, batch, left, con, right = best

    nb, m, n, k = sizes(a, as_, batch), sizes(a, as_, left), sizes(b, bs, right), sizes(a, as_, con)
    if batch and math.prod(m) == 1 and math.prod(n) == 1:
        # batched inner products (Σ_s (∂u/∂v_s)² of a collapsed operator): a product summed over
        # the contracted labels, not bmm of 1×k by k×1 matrices (and the copies that lays out)
        out = batch + left + right  # left and right: size-1 axes only
        full = out + con
        z = _arrange(a, as_, full) * _arrange(b, bs, full)
        return z.sum(list(range(len(out), len(full)))), out
    if (batch and WIDE_GEMMS.get() and max(math.prod(m), math.prod(n)) <= SMALL_MATRIX
            and not _innermost(con, (a, as_), (b, bs))):
        # Many small products (per-sample Gram matrices): a broadcast product summed over the
        # contracted labels, which Inductor fuses into one reduction kernel with the operands'
        # producers. MKL's bmm runs [256,16,64]@[256,64,16] at 20 GFLOP/s (9 with a transposed
        # operand), the fused reduction at 56; up to 64x64 matrices it is 2-4x faster. Not when
        # a contracted axis is an operand's innermost: Inductor then vectorizes the reduction
        # itself, 3.6x slower than bmm (256 Gram matrices, 16x16 over 64, stored [b,i,k]).
        full = batch + left + con + right
        z = _arrange(a, as_, full) * _arrange(b, bs, full)
        return z.sum(list(range(len(batch) + len(left), len(batch) + len(left) + len(con)))), batch + left + right
    lead = [math.prod(nb)] if batch else []
    a2 = _arrange(a, as_, batch + left + con).reshape(lead + [math.prod(m), math.prod(k)])
    b2 = _arrange(b, bs, batch + con + right).reshape(lead + [math.prod(k), math.prod(n)])
    if batch and WIDE_GEMMS.get():
        # MKL's batched product is ~2.5x slower on batches that are not densely packed; under
        # Inductor the copy fuses into the kernel that produces the operand
        a2, b2 = _dense_batches(a2), _dense_batches(b2)
    z = torch.bmm(a2, b2) if batch else mm(a2, b2)
    return z.reshape(nb + m + n), batch + left + right


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D operands. In programs laid out for Inductor: ``hoad::mm`` where it runs
    faster (Inductor writes the operands densely, so the copies are free), a fused reduction for
    a small vector-matrix product; else ``aten.mm``."""
    if WIDE_GEMMS.get() and kernels.suits(a, b):
        return torch.ops.hoad.mm(a.contiguous(), b.contiguous())
    (m, k), n = a.shape, b.shape[1]
    if WIDE_GEMMS.get() and min(m, n) == 1 and m * k * n <= TINY_PRODUCT:
        return (a.unsqueeze(2) * b.unsqueeze(0)).sum(1)
    return torch.mm(a, b)


def _innermost(labels: list, *operands: tuple[torch.Tensor, list]) -> bool:
    """Whether one of ``labels`` is the stride-1 axis (of size > 1) of one of the operands."""
    return any(t.stride(ls.index(l)) == 1 and t.shape[ls.index(l)] > 1 for t, ls in operands for l in labels)


def _path(operands: list[tuple[tuple, list]], out: list) -> list[tuple[int, int]]:
    """Pairwise contraction order (opt_einsum's list format) for a few operands, by exhaustive
    search: least FLOPs plus intermediate entries, so ties go to the path with the smallest
    intermediates (what bounds memory when per-sample blocks are large)."""

    def step(items):
        if len(items) == 1:
            return 0, 0, []
        best = None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (xs, xl), (ys, yl) = items[i], items[j]
                rest = [items[k] for k in range(len(items)) if k not in (i, j)]
                need = set(out).union(*[set(l) for _s, l in rest])
                sizes: dict = {}
                for shp, ls in ((xs, xl), (ys, yl)):
                    for n, l in zip(shp, ls):
                        sizes[l] = max(sizes.get(l, 1), n)
                flops = math.prod(sizes.values())
                kept = [l for l in sizes if l in need]
                inter = math.prod(sizes[l] for l in kept)
                cost, peak, path = step(rest + [(tuple(sizes[l] for l in kept), kept)])
                cand = (flops + inter + cost, max(inter, peak), [(i, j)] + path)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return best

    return step(list(operands))[2]


def _dense_batches(t: torch.Tensor) -> torch.Tensor:
    """``t`` (batch, rows, cols) with each matrix stored densely (row- or column-major)."""
    b, r, c = t.shape
    stride = t.stride()
    if stride[0] == r * c and (stride[1:] == (c, 1) or stride[1:] == (1, r)):
        return t
    return t.contiguous()


def _gram(terms: list[tuple[torch.Tensor, list]], out: list, size: dict) -> torch.Tensor | None:
    """Per-sample weighted Gram matrices as one ``hoad::gram`` call, or None if ``terms`` are not that.

    The pattern is the second-order chain rule through an elementwise node under a batch:
    sum over k of w[b,k] J[b,k,i] J[b,k,j], the same Jacobian J twice (its free labels i and j
    differ), every other term a weight over the batch and contracted labels. Only for programs
    laid out for Inductor (the operator has no autograd), float64 on CPU where the kernel runs.
    """
    if not WIDE_GEMMS.get():
        return None
    twice = [i for i, (t, _ls) in enumerate(terms) if sum(u is t for u, _l in terms) == 2]
    if len(twice) != 2:
        return None
    (j, first), (_j, second) = terms[twice[0]], terms[twice[1]]
    if len(first) != len(second) or len(set(first)) != len(first):
        return None
    shared = [a for a, b in zip(first, second) if a == b]
    free = [(a, b) for a, b in zip(first, second) if a != b]
    f1, f2 = [a for a, _b in free], [b for _a, b in free]
    batch, con = [l for l in shared if l in out], [l for l in shared if l not in out]
    weights = [terms[i] for i in range(len(terms)) if i not in twice]
    if (not (free and batch and con) or len(out) != len(batch + f1 + f2) or set(out) != set(batch + f1 + f2)
            or set(f1) & set(f2) or any(not set(ls) <= set(shared) for _t, ls in weights)
            or any(j.shape[i] != size.get(l) for i, l in enumerate(first))):  # a broadcast J: matrix products do better
        return None
    nb, nk, nf = ([size[l] for l in ls] for ls in (batch, con, f1))
    if not kernels.gram_suits(j, math.prod(nk), math.prod(nf)):
        return None
    w = j.new_ones(())
    for t, ls in weights:
        w = w * _arrange(t, ls, batch + con)
    w = w.expand(nb + nk).reshape(math.prod(nb), math.prod(nk))
    jj = _arrange(j, first, batch + con + f1).reshape(math.prod(nb), math.prod(nk), math.prod(nf))
    g = torch.ops.hoad.gram(jj, w).reshape(nb + nf + nf)
    return _arrange(g, batch + f1 + f2, out)


def _einsum(terms: list[tuple[torch.Tensor, list]], out: list, size: dict, samples: set = frozenset()) -> torch.Tensor:
    """Contract labelled tensors into ``out`` order along a cheap pairwise path."""
    terms = list(terms)
    gram = _gram(terms, out, size)
    if gram is not None:
        return gram
    if 2 < len(terms) <= 5:
        path = _path([(tuple(t.shape), list(ls)) for t, ls in terms], out)
    elif len(terms) > 5:
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
    for step, (i, j) in enumerate(path):
        (x, xs), (y, ys) = terms[i], terms[j]
        rest = [terms[k] for k in range(len(terms)) if k not in (i, j)]
        needed = set(out).union(*[set(ls) for _t, ls in rest])
        last = step == len(path) - 1
        terms = rest + [_pair(x, xs, y, ys, needed, out if last else None, samples)]
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
def contract(operands: Sequence[tuple[Block | Lazy, Sequence[Label]]], out: Sequence[Label],
             sizes: dict | None = None, lazy: bool = False) -> Block | Lazy:
    """Einsum over blocks: multiply the operands, sum labels absent from ``out``.

    Each operand names its dense axes with labels; equal labels across operands are the same
    index. The result's dense axes are named by ``out`` (a label may repeat: a diagonal). Ties
    inside operands are honoured, so a diagonal times a dense block stays compact. ``sizes`` gives
    the sizes of ``out`` labels that no operand has (broadcast axes). Size-1 axes take no part.

    :class:`Lazy` operands are expanded into their products, so the whole expression is
    contracted along one path (a factor W2ᵀ·D² is then never formed when only its contraction
    with an adjoint is needed). With ``lazy`` the result itself stays unevaluated.
    """
    if lazy or any(isinstance(b, Lazy) for b, _ in operands):
        return _lazy_contract(operands, out, sizes or {}, lazy)
    return _contract(operands, out, sizes)


def _contract(operands: Sequence[tuple[Block, Sequence[Label]]], out: Sequence[Label],
              sizes: dict | None = None) -> Block:
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
            if c is None:
                continue
            parent.setdefault(lab, lab)
            if c in owner:
                a, b = find(owner[c]), find(lab)
                if a != b:
                    parent[b] = a
            else:
                owner[c] = lab
    for lab in out:
        internal_check(lab in size, f"contract: output label {lab!r} has no size")
        if size[lab] != 1:
            parent.setdefault(lab, lab)

    out_roots = [find(l) if size[l] != 1 else None for l in out]
    result_classes = _first_appearance(out_roots)
    terms: list[tuple[torch.Tensor, list]] = []
    unit_data = None
    for blk, labels in operands:
        roots: list = [None] * blk.data.ndim
        for lab, c in zip(labels, blk.dims):
            if c is not None:
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
        is_sample = SAMPLE_LABELS.get()
        samples = {find(l) for l in parent if is_sample(l)} if is_sample is not None else frozenset()
        data = _einsum(terms, present, size, samples)
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
    return Block(data, [None if r is None else index[r] for r in out_roots], [size[l] for l in out], unit)


def meet(partitions: Sequence[Sequence]) -> list:
    """The coarsest class structure finer than every given one (axes tied in all of them)."""
    index: dict = {}
    return [None if None in key else index.setdefault(key, len(index)) for key in zip(*partitions)]


def add(blocks: Sequence[Block | Lazy]) -> Block | Lazy:
    """Sum of blocks with the same dense shape (their class structures may differ); a sum with a
    :class:`Lazy` term stays lazy."""
    blocks = list(blocks)
    if len(blocks) == 1:
        return blocks[0]
    if any(isinstance(b, Lazy) for b in blocks):
        return _bounded(Lazy([t for b in blocks for t in _terms(b)], blocks[0].shape))
    shape = blocks[0].shape
    internal_check(all(b.shape == shape for b in blocks), "add: blocks have different shapes")
    partition = meet([b.dims for b in blocks])
    refined = [b.refine(partition) for b in blocks]
    total = refined[0].data
    for b in refined[1:]:
        total = total + b.data
    return Block(total, refined[0].dims, shape)


# -------------------------------------------------------------- linear maps on the output part
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
    internal_check(tuple(new.shape[:r2]) == tuple(new_out), f"map_out: got {tuple(new.shape)}, expected leading {tuple(new_out)}")
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
    return Block(blk.data, blk.dims[:dim] + (None,) + blk.dims[dim:], blk.shape[:dim] + (1,) + blk.shape[dim:], blk.unit)


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


# ------------------------------------------------------------------------------ lazy blocks
# Caps on an unevaluated block: beyond them it is evaluated where it stands.
MAX_TERMS = 8
MAX_OPERANDS = 7
# Tests turn this off to compare lazy programs with fully evaluated ones.
LAZY_JETS = True

_FRESH = itertools.count()


class _Fresh:
    """A dense axis a relabelling adds: a new label of the given size, in no operand."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size


class LTerm:
    """One unevaluated product: ``scale · einsum(operands -> out)`` (``sizes`` for ``out`` labels
    no operand has)."""

    __slots__ = ("scale", "operands", "out", "sizes")

    def __init__(self, scale: float, operands: list, out: list, sizes: dict):
        self.scale, self.operands, self.out, self.sizes = scale, operands, out, sizes

    def evaluate(self) -> Block:
        return _contract(self.operands, self.out, self.sizes).scale(self.scale)


class Lazy:
    """A block held as a sum of unevaluated products, evaluated only when its data is needed.

    Jets of orders >= 2 produced by the combinators stay lazy while their node has one user:
    the consumer either absorbs them into a bigger contraction (a remainder's contraction with
    the adjoint, where the path finder can reassociate W2ᵀ·φ''·W1ᵀ⊗W1ᵀ) or forces them.
    """

    __slots__ = ("terms", "shape", "_value")

    def __init__(self, terms: list[LTerm], shape: Sequence[int]):
        self.terms = terms
        self.shape = tuple(shape)
        self._value: Block | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def force(self) -> Block:
        if self._value is None:
            self._value = add([t.evaluate() for t in self.terms])
        return self._value

    # what needs data forces; relabellings stay lazy
    data = property(lambda self: self.force().data)
    dims = property(lambda self: self.force().dims)
    unit = property(lambda self: False)
    numel = property(lambda self: self.force().numel)

    def materialize(self, groups: Sequence[Sequence[int]] = ()) -> torch.Tensor:
        return self.force().materialize(groups)

    def refine(self, partition):
        return self.force().refine(partition)

    def untie(self, axes):
        return self.force().untie(axes)

    @property
    def dtype(self) -> torch.dtype:
        dtypes = [force(b).data.dtype for t in self.terms for b, _ls in t.operands]
        return functools.reduce(torch.promote_types, dtypes)

    def to(self, dtype: torch.dtype):
        return self if self.dtype == dtype else self.force().to(dtype)

    def scale(self, c: float) -> Lazy:
        if c == 1:
            return self
        return Lazy([LTerm(t.scale * c, t.operands, t.out, t.sizes) for t in self.terms], self.shape)

    def neg(self) -> Lazy:
        return self.scale(-1.0)

    def permute(self, perm: Sequence[int]) -> Lazy:
        return self.relabel(list(perm))

    def relabel(self, axes: Sequence) -> Lazy:
        """New dense axes from old ones: entry ``a`` (an int) reuses old axis a, a :class:`_Fresh`
        is a new broadcast axis; old axes missing from ``axes`` are summed."""
        kept = {a for a in axes if isinstance(a, int)}
        terms = []
        for t in self.terms:
            out, sizes, scale = [], dict(t.sizes), t.scale
            for a in axes:
                if isinstance(a, _Fresh):
                    label = ("fresh", next(_FRESH))
                    sizes[label] = a.size
                    out.append(label)
                elif a is not None:
                    out.append(t.out[a])
            in_operands = {l for _b, ls in t.operands for l in ls}
            for a in range(self.ndim):  # summing a broadcast axis multiplies by its size
                label = t.out[a]
                if a not in kept and label not in out and label not in in_operands:
                    scale *= sizes.get(label, 1)
            terms.append(LTerm(scale, t.operands, out, sizes))
        shape = [a.size if isinstance(a, _Fresh) else self.shape[a] for a in axes if a is not None]
        return Lazy(terms, shape)


def force(b: Block | Lazy) -> Block:
    return b.force() if isinstance(b, Lazy) else b


def _terms(b: Block | Lazy) -> list[LTerm]:
    if isinstance(b, Lazy):
        return b.terms
    labels = [("b", a) for a in range(b.ndim)]
    return [LTerm(1.0, [(b, labels)], labels, {})]


def _bounded(z: Lazy) -> Block | Lazy:
    """``z``, or its value once it has outgrown the caps."""
    if len(z.terms) > MAX_TERMS or any(len(t.operands) > MAX_OPERANDS for t in z.terms):
        return z.force()
    return z


def _lazy_contract(operands, out, sizes: dict, lazy: bool) -> Block | Lazy:
    """contract() with lazy operands: distribute over their sums, splice their products in."""
    choices = []
    for b, labels in operands:
        tag = next(_FRESH)
        choices.append([_splice(t, list(labels), tag) for t in _terms(b)])
    size = dict(sizes)
    for b, labels in operands:
        size.update(zip(labels, b.shape))
    terms = []
    for combo in itertools.product(*choices):
        scale, ops, extra = 1.0, [], dict(sizes)
        for s_, o_, e_ in combo:
            scale *= s_
            ops += o_
            extra.update(e_)
        terms.append(LTerm(scale, ops, list(out), extra))
    z = Lazy(terms, [size[l] for l in out])
    return _bounded(z) if lazy else z.force()


def _splice(t: LTerm, labels: list, tag: int) -> tuple[float, list, dict]:
    """Term ``t`` with its output axes renamed to ``labels`` and its inner labels made unique."""
    rename: dict = {}
    ties = []
    for a, (inner, outer) in enumerate(zip(t.out, labels)):
        if inner in rename and rename[inner] != outer:
            ties.append((rename[inner], outer, a))
        rename.setdefault(inner, outer)
    ops = []
    for blk, ls in t.operands:
        ops.append((blk, [rename.get(l, ("lz", tag, l)) for l in ls]))
    for first, other, a in ties:  # one inner label on two outer axes: those axes are equal
        like = force(t.operands[0][0]).data
        n = _size_of(t, a)
        ops.append((Block(like.new_ones((1,)), (0, 0), (n, n), unit=True), [first, other]))
    extra = {rename[l]: n for l, n in t.sizes.items() if l in rename}
    return t.scale, ops, extra


def _size_of(t: LTerm, a: int) -> int:
    label = t.out[a]
    if label in t.sizes:
        return t.sizes[label]
    for blk, ls in t.operands:
        if label in ls:
            return blk.shape[ls.index(label)]
    raise HoadInternalError(f"lazy term has no size for label {label!r}")
