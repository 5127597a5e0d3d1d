"""The compact derivative block: the tensor type hoad's rules compute with.

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

import weakref
from collections.abc import Iterable, Sequence

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from hoad.errors import internal_check


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
    def identity(like: torch.Tensor, shape: Sequence[int], dense: bool = False) -> Block:
        """∂x/∂x for x of ``shape``: a block with shape ``shape + shape``, one diagonal per axis
        (``dense``: written out in full, no ties: tests compare such programs with compact ones)."""
        dims, c = [], 0
        for n in shape:
            dims.append(None if n == 1 else c)
            c += n != 1
        ones = like.new_ones((1,) * c)
        seed = Block(ones, dims * 2, tuple(shape) * 2, unit=True)
        return seed.untie(range(len(shape))) if dense else seed

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




def _eye(n: int, like: torch.Tensor) -> torch.Tensor:
    """The n x n identity in ``like``'s dtype and device, once per trace of a program for each
    size (four traced ops each time: about 10% of building the rules' test programs, where blocks
    write out their diagonals). (torch.eye's decomposition counts in the smallest integer dtype
    that fits, uint16 from n = 256, which arange has no CPU kernel for.)"""
    mode = get_proxy_mode()
    made = _EYES.setdefault(mode, {}) if mode is not None else {}
    key = (n, like.dtype, like.device)
    if key not in made:
        idx = torch.arange(n, device=like.device)
        made[key] = (idx.unsqueeze(1) == idx).to(like.dtype)
    return made[key]


# the identities made in each trace (its proxy mode), gone with it
_EYES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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

