"""The result of a compiled call: the value and every derivative block, indexed by wrt keys."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Hashable, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from hoad.algebra.multiindex import MultiIndex
from hoad.distributed import Split
from hoad.errors import InvalidArgumentError


class ResultSpec:
    """What every result of one compiled signature shares: built once, not per call."""

    __slots__ = ("keys", "zeros", "wrt", "aliases", "slot_shapes", "order", "diagonal", "split", "outputs")

    def __init__(self, keys: Sequence[MultiIndex], zeros: Sequence[MultiIndex], wrt: Sequence[Hashable],
                 aliases: Mapping[Hashable, int], slot_shapes: Sequence[tuple[int, ...]], order: int,
                 diagonal: bool = False, split: Split | None = None, outputs=None):
        self.keys = tuple(keys)
        self.zeros = frozenset(zeros)
        self.wrt = list(wrt)
        self.aliases = dict(aliases)
        self.slot_shapes = [tuple(s) for s in slot_shapes]
        self.order = order
        self.diagonal = diagonal
        self.split = split  # split_blocks: which rank holds each top-order block
        # a function returning several tensors: how the joined output splits back
        # (hoad.passes.capture.OutputTree; read by Derivatives.per_output)
        self.outputs = outputs

    def result(self, outs) -> Derivatives:
        """Wrap a program's outputs ``(value, *blocks)``."""
        return Derivatives(outs[0], dict(zip(self.keys, outs[1:])), self)


class Derivatives(Mapping):
    """Value and derivative blocks of orders 1..N.

    ``res[k]`` is ∂f/∂k; ``res[i, j, ...]`` the mixed block, in torch.func's dense layout
    ``f.shape + shape(i) + shape(j) + …`` (equal to nested ``jacfwd(jacrev(f, i), j)``). Keys are
    the wrt entries as given to :func:`hoad.compile` (argnums or names); any ordering works and a
    non-canonical one returns a permuted view of the stored block. Iterating yields the canonical
    keys, lower orders first; :meth:`order` gives one order's canonical blocks.
    """

    def __init__(self, value: torch.Tensor, blocks: dict[MultiIndex, torch.Tensor], spec: ResultSpec):
        self.value = value
        self._blocks = blocks
        self._spec = spec
        self._zeros = spec.zeros
        self._wrt = spec.wrt
        self._aliases = spec.aliases
        self._slot_shapes = spec.slot_shapes
        self._max_order = spec.order
        self._zero_cache: dict[MultiIndex, torch.Tensor] = {}

    def owner(self, key) -> int | None:
        """Under ``split_blocks``: the rank (of the group) that computed this block; None where
        every rank has it (lower orders, structural zeros, or no split)."""
        K, _ = self._resolve(key)
        split = self._spec.split
        return split.owners.get(K) if split is not None and K not in self._zeros else None

    def gather(self, dst: int | None = None) -> Derivatives:
        """Under ``split_blocks``, every block: each broadcast from the rank that computed it. A
        collective: every rank of the group calls it. With ``dst``, that rank's result holds them
        all, and the others' hold their own (the broadcasts still reach every rank)."""
        split = self._spec.split
        if split is None:
            return self
        blocks = split.gather(self._blocks, self._zero_shape, self.value, dst)
        return Derivatives(self.value, blocks, self._spec)

    def per_output(self):
        """For a function that returns several tensors (a tuple, list or dict, nested), one
        result per tensor in the same structure, each with its own value and blocks; this result
        itself for a function returning one tensor."""
        tree = self._spec.outputs
        if tree is None:
            return self
        spec = ResultSpec(self._spec.keys, self._spec.zeros, self._spec.wrt, self._spec.aliases,
                          self._spec.slot_shapes, self._spec.order, self._spec.diagonal, self._spec.split)
        axis, sizes = (1 if tree.batched else 0), tree.sizes()
        values = self.value.split(sizes, dim=axis)
        parts = {K: b.split(sizes, dim=axis) for K, b in self._blocks.items()}
        results = []
        for i, shape in enumerate(tree.shapes):
            if tree.batched:  # (the samples of this call: a program serves every count, and chunks join)
                shape = (self.value.shape[0],) + tuple(shape[1:])
            blocks = {K: pieces[i].reshape(shape + tuple(pieces[i].shape[axis + 1:])) for K, pieces in parts.items()}
            results.append(Derivatives(values[i].reshape(shape), blocks, spec))
        return pytree.tree_unflatten(results, tree.treedef)

    def mapped(self, fn) -> Derivatives:
        """The same result with ``fn`` applied to the value and to every computed block."""
        return Derivatives(fn(self.value), {K: fn(b) for K, b in self._blocks.items()}, self._spec)

    # ------------------------------------------------------------------------------- flat
    @property
    def flat_index(self) -> dict[Hashable, slice]:
        """Where each wrt entry's entries sit along a :meth:`flat` axis, in wrt order (for
        ``wrt=hoad.parameters``, the module's ``named_parameters()`` order): {key: slice}."""
        index, at = {}, 0
        for key, shape in zip(self._wrt, self._slot_shapes):
            n = math.prod(shape)
            index[key] = slice(at, at + n)
            at += n
        return index

    def flat(self, order: int = 2) -> torch.Tensor:
        """Every wrt entry flattened into one axis of P entries, and the order-``order``
        derivatives over it as one tensor: the gradient ``(P,)`` at order 1, the Hessian
        ``(P, P)`` at order 2, ``(P,)*k`` at order k, each behind the value's axes (``(B, P, P)``
        under ``batch_dim``). Under ``diagonal=True`` the pure derivatives ``(…, P)``. The
        entries of each key lie at :attr:`flat_index`; :meth:`unflat` maps a ``(…, P)`` vector
        (a Newton step) back to one tensor per key. A Hessian comes exactly symmetric, as
        ``torch.linalg.eigh`` and ``cholesky`` assume: each block below the diagonal is the
        transpose of the one above it, and a key's own block is the mean of it and its transpose
        (computed, its two triangles differ by rounding)."""
        if isinstance(order, bool) or not isinstance(order, int) or not 1 <= order <= self._max_order:
            raise InvalidArgumentError(f"flat(order=...) takes an int in 1..{self._max_order}, got {order!r}")
        if self._spec.split is not None:
            raise InvalidArgumentError("flat() needs every block, and under split_blocks each rank holds its own: "
                                       "call res.gather().flat(...) on every rank of the group")
        lead = tuple(self.value.shape)
        index = list(self.flat_index.values())
        P = index[-1].stop if index else 0
        if self._spec.diagonal or order == 1:
            return torch.cat([self[(key,) * order].reshape(lead + (-1,)) for key in self._wrt], dim=-1)
        out = self.value.new_empty(lead + (P,) * order)
        for positions in itertools.product(range(len(self._wrt)), repeat=order):
            key = tuple(self._wrt[p] for p in positions)
            sizes = tuple(index[p].stop - index[p].start for p in positions)
            where = (Ellipsis,) + tuple(index[p] for p in positions)
            block = self[key].reshape(lead + sizes)
            if order == 2 and positions[0] == positions[1]:  # (its two triangles differ by rounding)
                block = (block + block.transpose(-1, -2)) / 2
            out[where] = block
        return out

    def unflat(self, vector: torch.Tensor) -> dict[Hashable, torch.Tensor]:
        """A ``(…, P)`` tensor along :meth:`flat`'s axis as one tensor per wrt key, each shaped
        like its input (behind the leading axes): ``res.unflat(torch.linalg.solve(H, g))``."""
        index = self.flat_index
        P = next(reversed(index.values())).stop if index else 0
        if not isinstance(vector, torch.Tensor) or vector.ndim < 1 or vector.shape[-1] != P:
            shape = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
            raise InvalidArgumentError(f"unflat takes a tensor whose last axis has the P = {P} flat entries, "
                                       f"got {shape}")
        lead = tuple(vector.shape[:-1])
        return {key: vector[..., where].reshape(lead + shape)
                for (key, where), shape in zip(index.items(), self._slot_shapes)}

    # ------------------------------------------------------------------------------- along
    def along(self, direction) -> list[torch.Tensor]:
        """The derivatives along a line through the point: ``[d/dt f(x + t v), …, dᴺ/dtᴺ f(x + t v)]``
        at t = 0, each shaped like the value, so that ``f(x + s v) ≈ res.value + Σ_k sᵏ/k! ·
        res.along(v)[k-1]`` (a Taylor model). ``direction``: v for the one wrt input; with several,
        a tuple (wrt order) or a dict (wrt keys) with one per input, moved together (mixed blocks
        enter with their multiplicity). A v shaped like one point of its input is shared; one with
        leading axes of the value's (the samples under ``batch_dim``) goes entry by entry. Blocks
        computed packed (``packed=True``) are contracted as computed: no dense block is formed."""
        if self._spec.diagonal:
            raise InvalidArgumentError("along() needs the mixed entries of every block, and a diagonal=True result "
                                       "holds pure derivatives only: compile without diagonal=True")
        if self._spec.split is not None:
            raise InvalidArgumentError("along() needs every block, and under split_blocks each rank holds its own: "
                                       "call res.gather().along(...) on every rank of the group")
        vs = self._directions(direction)
        joined = getattr(self._blocks, "by_order", None)  # (hoad.packed.PackedBlocks: orders over joined inputs)
        out = []
        for k in range(1, self._max_order + 1):
            if joined is not None:
                out.append(self._along_packed(joined.get(k), vs, k))
                continue
            total = torch.zeros_like(self.value)
            for K in itertools.combinations_with_replacement(range(len(self._wrt)), k):
                if K in self._zeros:
                    continue
                total = total + _multiplicity(K) * self._contracted(self._block(K),
                                                                    [(vs[p], self._slot_shapes[p]) for p in K])
            out.append(total)
        return out

    def _directions(self, direction) -> list[torch.Tensor]:
        """One direction per wrt input, each checked against the input's point shape."""
        n = len(self._wrt)
        if isinstance(direction, Mapping):
            given = {self._position(k): v for k, v in direction.items()}
            missing = [self._wrt[p] for p in range(n) if p not in given]
            if missing:
                raise InvalidArgumentError(f"along() takes one direction per wrt input; missing {missing}")
            vs = [given[p] for p in range(n)]
        elif isinstance(direction, (tuple, list)):
            vs = list(direction)
        else:
            vs = [direction]
        if len(vs) != n:
            raise InvalidArgumentError(f"along() takes one direction per wrt input ({n}: {self._wrt}), got {len(vs)}; "
                                       "with several inputs pass a tuple in wrt order or a dict by wrt key")
        lead = tuple(self.value.shape)
        for key, v, shape in zip(self._wrt, vs, self._slot_shapes):
            if not isinstance(v, torch.Tensor):
                raise InvalidArgumentError(f"along()'s direction for {key!r} must be a tensor, got {type(v).__name__}")
            front = tuple(v.shape[:v.ndim - len(shape)])
            if tuple(v.shape[v.ndim - len(shape):]) != shape or len(front) > len(lead) or front != lead[:len(front)]:
                raise InvalidArgumentError(
                    f"along()'s direction for {key!r} has shape {tuple(v.shape)}: it takes one point's shape {shape} "
                    f"(shared), or that behind leading axes of the value's {lead} (entry by entry)")
        return vs

    @staticmethod
    def _contracted(block: torch.Tensor, pairs: list[tuple[torch.Tensor, tuple]]) -> torch.Tensor:
        """``block`` (the value's axes, then each slot's) contracted with one (direction, point
        shape) per slot, the last slot first."""
        for v, shape in reversed(pairs):
            slot, front = len(shape), v.ndim - len(shape)
            shaped = v.reshape(tuple(v.shape[:front]) + (1,) * (block.ndim - slot - front) + tuple(shape))
            block = block * shaped
            if slot:  # (sum over no dims would sum over all of them)
                block = block.sum(dim=tuple(range(block.ndim - slot, block.ndim)))
        return block

    def _along_packed(self, values: torch.Tensor | None, vs: list[torch.Tensor], k: int) -> torch.Tensor:
        """Σ over the unique entries of order k (over the joined inputs) of their multiplicity,
        value and the product of the joined direction's entries they hold."""
        if values is None:  # (the order is a structural zero)
            return torch.zeros_like(self.value)
        lead = tuple(self.value.shape)
        fronts = [tuple(v.shape[: v.ndim - len(s)]) for v, s in zip(vs, self._slot_shapes)]
        front = max(fronts, key=len)
        z = torch.cat([v.reshape(f + (1,) * (len(front) - len(f)) + (-1,)).expand(front + (math.prod(s),))
                       for v, f, s in zip(vs, fronts, self._slot_shapes)], dim=-1)
        index = _index_map(z.shape[-1], k, z.device)
        weights = _multiplicities(z.shape[-1], k, z.device).to(z.dtype)
        products = z[..., index].prod(-1) * weights  # (front, M)
        products = products.reshape(front + (1,) * (len(lead) - len(front)) + products.shape[-1:])
        return (values * products).sum(-1)

    # ---------------------------------------------------------------------------------- keys
    @property
    def max_order(self) -> int:
        return self._max_order

    @property
    def wrt(self) -> list:
        return list(self._wrt)

    def _position(self, k: Hashable) -> int:
        if isinstance(k, (bool, float)) or not isinstance(k, Hashable) or k not in self._aliases:
            # (0.0 == 0 and True == 1 hash alike; a list or slice is no key: a tuple of wrt keys is)
            raise KeyErrorWithHelp(f"{k!r} is not a wrt key; valid keys are {self._wrt}, and a block's key is a tuple "
                                   "of them (res[0, 1])")
        return self._aliases[k]

    def _resolve(self, key) -> tuple[MultiIndex, list[int]]:
        """(canonical multi-index, positions as requested)."""
        if not isinstance(key, tuple):
            key = (key,)
        if not 1 <= len(key) <= self._max_order:
            raise KeyErrorWithHelp(f"key {key!r} has order {len(key)}; this result holds orders 1..{self._max_order}")
        positions = [self._position(k) for k in key]
        return tuple(sorted(positions)), positions

    def _canonical_key(self, K: MultiIndex) -> tuple:
        return tuple(self._wrt[p] for p in K)

    # ------------------------------------------------------------------------------- access
    def __getitem__(self, key) -> torch.Tensor:
        K, positions = self._resolve(key)
        block = self._block(K)
        if self._slots(positions) == self._slots(K):
            return block
        return block.permute(self._slot_permutation(K, positions))

    def packed(self, key) -> tuple[torch.Tensor, torch.Tensor]:
        """The unique entries of a block whose slots are all one input x, ∂ᵏf/∂xᵏ, as ``(values,
        index)``: ``index`` (M, k) holds the flat entries i_1 <= … <= i_k of x each value is the
        derivative in (``torch.triu_indices``' idea in k dimensions; M = C(n+k-1, k) for n
        entries, against nᵏ dense) and ``values`` has shape ``f.shape + (M,)``. Every permutation
        of a row of ``index`` holds the same value in ``res[key]``. Under ``packed=True`` the
        program computed these values; otherwise they are read off the dense block."""
        K, _ = self._resolve(key)
        if len(set(K)) != 1 or self._spec.diagonal:
            raise InvalidArgumentError(
                f"packed() takes a block whose slots are all one wrt input, as (x, x, x), got {key!r}"
                + (" of a diagonal result (its blocks hold only pure derivatives already)" if self._spec.diagonal
                   else "; read mixed blocks with res[key]"))
        k, n = len(K), math.prod(self._slot_shapes[K[0]])
        index = index_map(n, k, self.value.device)
        flat = (index * torch.tensor([n ** (k - 1 - j) for j in range(k)], device=index.device)).sum(-1)
        lead = tuple(self.value.shape)
        computed = getattr(self._blocks, "packed_of", None)  # (hoad.packed.PackedBlocks)
        if computed is not None:
            return computed(K), index
        return self._block(K).reshape(lead + (n ** k,))[..., flat], index

    def is_structural_zero(self, key) -> bool:
        """True when the block is zero by the structure of the program (no tensor was computed)."""
        K, _ = self._resolve(key)
        return K in self._zeros

    def order(self, k: int) -> dict[tuple, torch.Tensor]:
        """The canonical blocks of order ``k``, keyed by wrt entries in wrt order."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self._max_order:
            raise InvalidArgumentError(f"order must be an int in 1..{self._max_order}, got {k!r}")
        keys = itertools.combinations_with_replacement(range(len(self._wrt)), k)
        return {self._canonical_key(K): self._block(K) for K in keys}

    def __iter__(self) -> Iterator[tuple]:
        for k in range(1, self._max_order + 1):
            for K in itertools.combinations_with_replacement(range(len(self._wrt)), k):
                yield self._canonical_key(K)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key) -> bool:
        try:
            self._resolve(key)
        except KeyError:
            return False
        return True

    def __eq__(self, other):
        if not isinstance(other, Mapping):
            return NotImplemented
        raise InvalidArgumentError(
            "Derivatives are not compared with == (a block's == is elementwise): compare the value and "
            "each block, e.g. torch.allclose(a.value, b.value) and all(torch.allclose(a[k], b[k]) for k in a)")

    __hash__ = None

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {self._shape(self._resolve(k)[0])}" for k in self)
        return f"Derivatives(value={tuple(self.value.shape)}, order={self._max_order}, {{{shapes}}})"

    # ----------------------------------------------------------------------------- internals
    def _block(self, K: MultiIndex) -> torch.Tensor:
        if K in self._blocks:
            return self._blocks[K]
        if self._spec.split is not None:
            self._spec.split.refuse(K, self._canonical_key(K))
        if K not in self._zero_cache:
            self._zero_cache[K] = self.value.new_zeros(self._zero_shape(K))
        return self._zero_cache[K]

    def _shape(self, K: MultiIndex) -> tuple[int, ...]:
        """A canonical block's shape, without making a structural zero's tensor (repr showed 2 GB)."""
        return tuple(self._blocks[K].shape) if K in self._blocks else self._zero_shape(K)

    def _slots(self, K) -> list[int]:
        """The wrt positions whose axes a block of K carries, in order (once each when diagonal)."""
        return list(dict.fromkeys(K)) if self._spec.diagonal else list(K)

    def _zero_shape(self, K: MultiIndex) -> tuple[int, ...]:
        shape = list(self.value.shape)
        for p in self._slots(K):
            shape += self._slot_shapes[p]
        return tuple(shape)

    def _slot_permutation(self, K: MultiIndex, positions: list[int]) -> list[int]:
        """Axis permutation taking the canonical block to the requested slot order."""
        r = self.value.ndim
        K, positions = self._slots(K), self._slots(positions)
        ranks = [len(self._slot_shapes[p]) for p in K]
        offsets = [r + sum(ranks[:i]) for i in range(len(K))]
        used = [False] * len(K)
        perm = list(range(r))
        for p in positions:
            i = next(i for i in range(len(K)) if K[i] == p and not used[i])
            used[i] = True
            perm += range(offsets[i], offsets[i] + ranks[i])
        return perm


def index_map(n: int, k: int, device=None) -> torch.Tensor:
    """(C(n+k-1, k), k): the multisets i_1 <= … <= i_k of n entries in lexicographic order, the
    order of a packed axis (:meth:`Derivatives.packed`). A copy of a cached map: making it forms
    all nᵏ tuples (milliseconds from n = 8, k = 5, longer than the packed program)."""
    return _index_map(n, k, torch.device(device) if device is not None else torch.device("cpu")).clone()


@functools.lru_cache(maxsize=64)
def _index_map(n: int, k: int, device: torch.device) -> torch.Tensor:
    index = torch.combinations(torch.arange(n, device=device), r=k, with_replacement=True)
    return index.reshape(-1, k)  # (k = 1: one column)


def _multiplicity(K: Sequence[int]) -> int:
    """How many orderings a multiset of entries has, k! / Π (count of each entry)!: the times one
    unique entry of a symmetric tensor occurs in the dense one."""
    return math.factorial(len(K)) // math.prod(math.factorial(K.count(p)) for p in set(K))


@functools.lru_cache(maxsize=64)
def _multiplicities(n: int, k: int, device: torch.device) -> torch.Tensor:
    """(C(n+k-1, k),) float64: :func:`_multiplicity` of each multiset of :func:`index_map`."""
    rows = _index_map(n, k, torch.device("cpu")).tolist()
    return torch.tensor([_multiplicity(K) for K in rows], dtype=torch.float64, device=device)


def each_output(results, fn):
    """``fn`` applied to a call's result, or to each of its results where the function returned
    several tensors (:meth:`Derivatives.per_output`), in their structure."""
    if isinstance(results, Derivatives):
        return fn(results)
    return pytree.tree_map(fn, results, is_leaf=lambda r: isinstance(r, Derivatives))


class KeyErrorWithHelp(KeyError, InvalidArgumentError):
    """A bad key into :class:`Derivatives` (a KeyError that prints its message plainly)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
