"""Blocks of one input at the cost of their unique entries: ``hoad.compile(..., packed=True)``.

The block of order k of one input x with n entries has C(n+k-1, k) distinct values among its nᵏ
(12x fewer at n = 8, k = 4; 153x at k = 6). The packed program never forms a dense block. It
propagates Taylor jets of order K (hoad.taylor's program, hoad's own rules) along the
C(n+K-1, K) directions of the lattice {j ∈ ℕⁿ : |j| = K}, and reads every unique entry of every
order k <= K off them by one fixed sparse linear map (Griewank, Utke and Walther, "Evaluating
higher derivative tensors by forward propagation of univariate Taylor series", Math. Comp. 69,
2000, eq. 13)::

    ∂ⁱu = Σ_j γ_ij ∂ᵏu[j, …, j] / k!      for every multi-index i with |i| = k <= K,
    γ_ij = Σ_{0 < l <= i} (-1)^|i-l| C(i, l) C(K l / |l|, j) (|l| / K)ᵏ

with C of multi-indices the product of binomials (generalized to rational tops). γ_ij is zero
unless j lies on i's support, and it depends only on the counts (i, j) there, so the map is
built once per (n, K) from the compositions of each order (:func:`interpolation`); it is sparse
(5% of 1716² at n = 8, K = 6). Each node carries C(n+K-1, K)·K jet entries, where the dense
program's carry O(n^(K-1)) and more: the packed program is the faster where nᴷ far outgrows
C(n+K-1, K) (a tanh MLP at a point: order 6 at n = 8, order 5 at n = 16; not order 4).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
import warnings
from collections.abc import Mapping
from fractions import Fraction

import numpy as np
import torch
import torch._dynamo
from tabulate import tabulate
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from hoad.algebra.multiindex import all_multi_indices, multi_indices
from hoad.compiled import Compiled
from hoad.derivatives import Derivatives, ResultSpec
from hoad.directions import _point_of, parameter_names
from hoad.errors import HoadError, InvalidArgumentError, first_line
from hoad.explanation import packed_pays
from hoad.operators import DIRECTIONS, _Operator, leafwise
from hoad.options import DEFAULT_OPTIONS, GRAPH_BREAK, Options, plain_int, wrt_entries

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ index maps
def _rank_table(n: int, d: int) -> np.ndarray:
    """table[t, a]: the multisets of size d over n values, with a prefix fixed up to position t,
    whose entry t is below a (from 0): rank(a) = Σ_t table[t, a_t] - table[t, a_(t-1)]."""
    table = np.zeros((d, n + 1), dtype=np.int64)
    for t in range(d):
        rest = d - t - 1  # entries after position t, each >= its value v: C(n - v + rest - 1, rest) ways
        counts = [math.comb(n - v + rest - 1, rest) for v in range(n)]
        table[t, 1:] = np.cumsum(counts)
    return table


def _rank(tuples: np.ndarray, n: int) -> np.ndarray:
    """Positions on a packed axis (:func:`hoad.derivatives.index_map`'s order) of sorted tuples (..., d)."""
    d = tuples.shape[-1]
    table = _rank_table(n, d)
    previous = np.concatenate([np.zeros(tuples.shape[:-1] + (1,), dtype=np.int64), tuples[..., :-1]], axis=-1)
    steps = np.arange(d)
    return (table[steps, tuples] - table[steps, previous]).sum(-1)


def _counts(n: int, d: int) -> np.ndarray:
    """(C(n+d-1, d), n): the count vectors j with |j| = d, in the packed axis' order."""
    out = np.zeros((math.comb(n + d - 1, d), n), dtype=np.int64)
    for row, multiset in enumerate(multi_indices(n, d)):
        for v in multiset:
            out[row, v] += 1
    return out


# ------------------------------------------------------------------------------ the map
def _binomials(r: Fraction, d: int) -> np.ndarray:
    """C(r, m) for m = 0..d, r rational (zero from m > r where r is a whole number)."""
    out, c = [1.0], Fraction(1)
    for m in range(d):
        c = c * (r - m) / (m + 1)
        out.append(float(c))
    return np.array(out)


@functools.lru_cache(maxsize=None)
def _face(q: tuple[int, ...], d: int) -> tuple[np.ndarray, np.ndarray]:
    """γ for a target whose counts on its support are ``q`` (|q| = k), against the directions of
    degree ``d`` on that support: their counts (F, s) and weights (F,), zeros dropped."""
    k, s = sum(q), len(q)
    J = _counts(s, d)
    w = np.zeros(len(J))
    for l in itertools.product(*(range(qt + 1) for qt in q)):
        t = sum(l)
        if t == 0:
            continue
        coef = (-1) ** (k - t) * math.prod(math.comb(qt, lt) for qt, lt in zip(q, l)) * float(Fraction(t, d) ** k)
        vec = np.ones(len(J))
        for col, lt in enumerate(l):
            vec = vec * _binomials(Fraction(d * lt, t), d)[J[:, col]]
        w += coef * vec
    keep = w != 0
    return J[keep], w[keep]


@functools.lru_cache(maxsize=32)
def interpolation(n: int, d: int, k: int) -> torch.Tensor:
    """The sparse map (C(n+k-1, k), C(n+d-1, d)), float64 CSR, taking the order-k derivatives
    ∂ᵏu[j, …, j] along the degree-d lattice directions j (:func:`lattice`) to the unique entries
    of the order-k block (1/k! included)."""
    rows, cols, vals = [], [], []
    targets = _counts(n, k)
    groups: dict[tuple, list[int]] = {}
    for row, i in enumerate(targets):
        support = tuple(int(c) for c in np.nonzero(i)[0])
        groups.setdefault(tuple(int(i[c]) for c in support), []).append(row)
    for q, members in groups.items():
        J, w = _face(q, d)
        supports = np.array([np.nonzero(targets[r])[0] for r in members], dtype=np.int64)  # (m, s)
        slots = np.stack([np.repeat(np.arange(len(q)), j) for j in J]) if len(J) else np.zeros((0, d), np.int64)
        tuples = supports[:, slots]  # (m, F, d): support ascending, so each multiset comes sorted
        cols.append(_rank(tuples, n).reshape(-1))
        rows.append(np.repeat(np.array(members, dtype=np.int64), len(J)))
        vals.append(np.tile(w, len(members)))
    index = torch.from_numpy(np.stack([np.concatenate(rows), np.concatenate(cols)]))
    values = torch.from_numpy(np.concatenate(vals)) / math.factorial(k)
    shape = (math.comb(n + k - 1, k), math.comb(n + d - 1, d))
    with warnings.catch_warnings():  # ("Sparse CSR tensor support is in beta state": products with dense work)
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_coo_tensor(index, values, shape, check_invariants=False).coalesce().to_sparse_csr()


@functools.lru_cache(maxsize=64)
def _on(n: int, d: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return interpolation(n, d, k).to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=32)
def lattice(n: int, d: int) -> torch.Tensor:
    """(C(n+d-1, d), n) float64: the directions j ∈ ℕⁿ with |j| = d, in the packed axis' order."""
    return torch.from_numpy(_counts(n, d)).to(torch.float64)


@functools.lru_cache(maxsize=32)
def _dense_positions(sizes: tuple[int, ...], offsets: tuple[int, ...], n: int, device: torch.device) -> torch.Tensor:
    """(Π sizes,): for each entry of a dense block whose slot t runs over the ``sizes[t]`` coordinates
    from ``offsets[t]`` of the n joined ones, read row-major, its position on the packed axis."""
    every = np.stack(np.unravel_index(np.arange(math.prod(sizes)), sizes), axis=-1) + np.array(offsets)
    return torch.from_numpy(_rank(np.sort(every, axis=-1), n)).to(device)


# ------------------------------------------------------------------------------ results
class PackedBlocks(Mapping):
    """A packed result's blocks by canonical multi-index. ``by_order[k]`` holds the unique entries
    of order k over the wrt inputs' coordinates joined in wrt order (*lead, C(n+k-1, k)); a block
    is gathered from them, dense, when read (once)."""

    def __init__(self, by_order: dict, value: torch.Tensor, slots: list, keys: list):
        self.by_order, self._value, self._slots, self._keys = by_order, value, slots, keys
        self._lead = tuple(value.shape)
        self._sizes = [math.prod(s) for s in slots]
        self._offsets = [sum(self._sizes[:p]) for p in range(len(slots))]
        self._dense: dict = {}
        self._lock = threading.Lock()

    def packed_of(self, K) -> torch.Tensor:
        """The unique entries of a block of one input, (p, …, p): the joined entries on its coordinates."""
        values = self.by_order.get(len(K))
        n, k = self._sizes[K[0]], len(K)
        if values is None:  # (the order's jets are structurally zero)
            return self._value.new_zeros(self._lead + (math.comb(n + k - 1, k),))
        if len(self._slots) == 1:
            return values
        return values[..., _block_positions(n, k, self._offsets[K[0]], sum(self._sizes), values.device)]

    def __getitem__(self, K):
        with self._lock:
            if K not in self._dense:
                if K not in self._keys:
                    raise KeyError(K)
                values = self.by_order[len(K)]
                positions = _dense_positions(tuple(self._sizes[p] for p in K), tuple(self._offsets[p] for p in K),
                                             sum(self._sizes), values.device)
                shape = self._lead + tuple(d for p in K for d in self._slots[p])
                self._dense[K] = values[..., positions].reshape(shape)
            return self._dense[K]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@functools.lru_cache(maxsize=32)
def _block_positions(n: int, k: int, offset: int, total: int, device: torch.device) -> torch.Tensor:
    """(C(n+k-1, k),): the positions, among the unique entries over ``total`` joined coordinates,
    of those whose k coordinates all lie in one input's n from ``offset``."""
    tuples = np.stack([np.repeat(np.arange(n), c) for c in _counts(n, k)]) + offset  # sorted, per multiset
    return torch.from_numpy(_rank(tuples, total)).to(device)


def _entries(wrt) -> list:
    """wrt as a list of distinct argnums or argument names, or a refusal naming what works."""
    entries = [plain_int(e) for e in wrt_entries(wrt)]
    for e in entries:
        if isinstance(e, bool) or not isinstance(e, (int, str)) or (isinstance(e, int) and e < 0):
            raise InvalidArgumentError(
                f"packed=True differentiates inputs named by argnum (int >= 0) or argument name, got {e!r} in "
                f"wrt={wrt!r}; for every parameter of a module (wrt=hoad.parameters) leave packed off")
    if not entries or len(set(entries)) != len(entries):
        raise InvalidArgumentError(f"wrt must name one input or several distinct ones, got {wrt!r}")
    return entries


def _takes(wrt) -> bool:
    """Whether packed=True takes ``wrt`` (:func:`_entries` would not refuse it)."""
    try:
        _entries(wrt)
    except InvalidArgumentError:
        return False
    return True


def _put(u, entry, args: list, kwargs: dict, value) -> None:
    """Replace the input ``entry`` (as :func:`hoad.directions._point_of` finds it) in a call of ``u``."""
    if isinstance(entry, int) and entry < len(args):
        args[entry] = value
        return
    names = parameter_names(u)
    name = names[entry] if isinstance(entry, int) else entry
    if isinstance(entry, str) and name not in kwargs and name in names and names.index(name) < len(args):
        args[names.index(name)] = value
    else:
        kwargs[name] = value


def _joined(u, entries: list, batched: bool):
    """``u`` of one input z, the wrt inputs' entries joined in wrt order (per sample under
    ``batch_dim``): ``joined(z, *args, **kwargs)`` calls u with each wrt input a view of z, shaped
    as the one the call passes (read for its shape only)."""
    lead = 1 if batched else 0

    def joined(z, *args, **kwargs):
        args, kwargs, at = list(args), dict(kwargs), 0
        for e in entries:
            x = _point_of(u, e, args, kwargs)
            n = math.prod(x.shape[lead:])
            _put(u, e, args, kwargs, z[..., at:at + n].reshape(tuple(z.shape[:lead]) + tuple(x.shape[lead:])))
            at += n
        return u(*args, **kwargs)

    joined.__name__ = getattr(u, "__name__", type(u).__name__)
    joined.__qualname__ = getattr(u, "__qualname__", joined.__name__)
    return joined


class Packed(_Operator):
    """``hoad.compile(u, order=K, wrt=..., packed=True)``: every block of orders 1..K between the wrt
    inputs, computed as the unique entries of the symmetric tensor over their joined entries (see
    the module docstring); returns :class:`~hoad.Derivatives` whose ``packed(key)`` gives a block
    of one input as computed and whose ``res[key]`` gathers any block, dense, when read."""

    _POSITIONAL = ("order", "wrt")

    def __init__(self, u, order: int, wrt=0, *, options: Options = DEFAULT_OPTIONS):
        self._keep_arguments(u, order, wrt, options=options)
        order = plain_int(order)
        if isinstance(order, bool) or not isinstance(order, int) or order < 1:
            raise InvalidArgumentError(f"order must be an int >= 1, got {order!r}")
        self.entries, self._user = _entries(wrt), u
        joined = len(self.entries) > 1
        inner = _joined(u, self.entries, options.batch_dim is not None) if joined else u
        super().__init__(inner, order, 0 if joined else self.entries[0], directions=torch.zeros(1, 1), weights=None,
                         collapse=None, options=options)
        self.order, self.joined = order, joined

    def __repr__(self) -> str:
        shown = super().__repr__().removeprefix("<hoad.packed(").removesuffix(")>")
        return f"<hoad.compile({shown}, packed=True)>"

    def _inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        xs = [_point_of(self._user, e, args, kwargs) for e in self.entries]
        if len({(x.dtype, x.device) for x in xs}) > 1:
            raise InvalidArgumentError(
                f"packed=True joins the wrt inputs into one: they must share a dtype and device, got "
                f"{', '.join(f'{e!r}: {x.dtype} on {x.device}' for e, x in zip(self.entries, xs))}")
        if self.batch_dim is not None and len({x.shape[:1] for x in xs}) > 1:
            raise InvalidArgumentError(
                f"under batch_dim=0 every wrt input holds the samples along dim 0, got sizes "
                f"{', '.join(f'{e!r}: {tuple(x.shape)}' for e, x in zip(self.entries, xs))}")
        return xs

    def _slots(self, xs: list[torch.Tensor]) -> list[tuple]:
        """The shape of one point (one sample under ``batch_dim``) of each wrt input."""
        return [tuple(x.shape[1:]) if self.batch_dim is not None else tuple(x.shape) for x in xs]

    def _call_args(self, args: tuple, kwargs: dict) -> tuple[tuple, list[tuple]]:
        """The program's positional arguments (the joined input first, where there are several) and
        each wrt input's point shape."""
        xs = self._inputs(args, kwargs)
        if not self.joined:
            return args, self._slots(xs)
        lead = tuple(xs[0].shape[:1]) if self.batch_dim is not None else ()
        z = torch.cat([x.reshape(lead + (-1,)) for x in xs], -1)
        return (z, *args), self._slots(xs)

    def _extra(self, args: tuple, kwargs: dict) -> dict:
        x = self._point(args, kwargs)
        slot = tuple(x.shape[1:]) if self.batch_dim is not None else tuple(x.shape)
        V = lattice(math.prod(slot), self.order)
        kwargs = dict(kwargs)
        kwargs[DIRECTIONS] = V.reshape((V.shape[0],) + slot).to(dtype=x.dtype, device=x.device)
        return kwargs

    @torch._dynamo.disable(reason=GRAPH_BREAK)  # (a graph break under torch.compile, as hoad.compile's call)
    def __call__(self, *args, **kwargs) -> Derivatives:
        args, slots = self._call_args(args, kwargs)
        self._last_slots = slots
        return leafwise(lambda res: self._result(res, slots), self.compiled(*args, **self._extra(args, kwargs)))

    def explain(self, *args, **kwargs):
        """Each order's dense and unique entries, then the program of Taylor jets that computes
        them (:meth:`hoad.compile(...).explain <hoad.api.Compiled.explain>`), for these arguments
        (or the last call)."""
        if args or kwargs:
            args, slots = self._call_args(args, kwargs)
            inner = super().explain(*args, **kwargs)
        else:
            inner, slots = super().explain(), self._last_slots
        names = parameter_names(self._user)
        shown = [names[e] if isinstance(e, int) and e < len(names) else str(e) for e in self.entries]
        return PackedExplanation(inner, [math.prod(s) for s in slots], shown, self.order)

    def _result(self, res: Derivatives, slots: list[tuple]) -> Derivatives:
        n, lead, top = sum(math.prod(s) for s in slots), tuple(res.value.shape), self.order
        by_order = {}
        for k in range(1, top + 1):
            if (0,) * k in res._spec.zeros:
                continue
            along = res._block((0,) * k).reshape(-1, math.comb(n + top - 1, top))  # (*lead, S) as (m, S)
            gamma = _on(n, top, k, along.dtype, along.device)
            by_order[k] = (gamma @ along.T).T.reshape(lead + (gamma.shape[0],))
        every = all_multi_indices(len(slots), top)
        keys = [K for K in every if len(K) in by_order]
        aliases = _aliases(self._user, self.entries)
        return Derivatives(res.value, PackedBlocks(by_order, res.value, slots, keys),
                           ResultSpec(keys, [K for K in every if len(K) not in by_order], self.entries, aliases,
                                      slots, top))


def _aliases(u, entries: list) -> dict:
    """Each wrt entry's position, under its argnum and its name where the signature says both."""
    names = parameter_names(u)
    aliases = {}
    for p, e in enumerate(entries):
        aliases[e] = p
        other = names[e] if isinstance(e, int) and e < len(names) else names.index(e) if e in names else None
        if other is not None:
            aliases.setdefault(other, p)
    return aliases


class PackedExplanation:
    """:meth:`Packed.explain`: the packed blocks' sizes above the Taylor program's explanation."""

    def __init__(self, program, sizes: list[int], names: list[str], order: int):
        self.program, self.sizes, self.names, self.order = program, sizes, names, order

    def __str__(self) -> str:
        p = self.program.program
        out, n, names = math.prod(p.out_shape), sum(self.sizes), self.names
        rows = []
        for K in all_multi_indices(len(self.sizes), self.order):
            key = f"({', '.join(names[q] for q in K)})"
            unique = math.prod(math.comb(self.sizes[q] + K.count(q) - 1, K.count(q)) for q in set(K))
            rows.append([len(K), key, out * math.prod(self.sizes[q] for q in K), out * unique])
        what = (f"{names[0]} ({n} entries)" if len(self.sizes) == 1
                else f"{', '.join(names)} ({' + '.join(map(str, self.sizes))} = {n} entries, joined)")
        head = (f"packed=True: every block of {what} as its unique entries, read off Taylor jets of order "
                f"{self.order} along the {math.comb(n + self.order - 1, self.order)} lattice directions (the "
                "program below); a dense block is formed only where res[key] reads one")
        table = tabulate(rows, headers=["order", "block", "dense entries", "unique entries (computed)"])
        return f"{head}\n\n{table}\n\n{self.program}"

    __repr__ = __str__


# ------------------------------------------------------------------------------ the choice
class AutoPacked(Compiled):
    """``hoad.compile``'s default, ``packed="auto"``: a call whose top order over the wrt inputs'
    n entries has far more dense entries than unique ones (:func:`hoad.explanation.packed_pays`:
    order 5 from n = 7, order 6 from n = 5) runs the packed program (:class:`Packed`); any
    other call runs the dense one. Results read the same: ``res[key]`` is the dense block either
    way. Packed is chosen for float64 inputs only (in float32 its map costs one to two digits),
    for a plain function whose wrt names its inputs, outside another hoad trace or a torch.func
    transform and where it reaches no FSDP-sharded module; where the packed program cannot be
    built, the call runs dense."""

    def __init__(self, fn, order, wrt=0, **options):
        super().__init__(fn, order, wrt, **options)
        c = self.config
        self._packable = (self.module is None and not self._method and not c.diagonal and c.split_blocks is None
                          and self.order >= 5 and _takes(self.wrt))
        self._choices: dict[tuple, bool] = {}  # per signature of the wrt inputs: packed or not
        self._proven: set[tuple] = set()  # signatures whose packed program ran
        self._packed: Packed | None = None
        self._packed_lock = threading.Lock()
        self._ran_packed = False  # whether the last call ran packed (for graph and explain)

    def _unsharded_call(self, args: tuple, kwargs: dict) -> Derivatives:
        key = self._packed_signature(args, kwargs)
        if key is not None:
            program = self._packed_program()
            if key in self._proven:
                self._ran_packed = True
                return program(*args, **kwargs)
            try:
                res = program(*args, **kwargs)
            except HoadError as e:  # (a rule the Taylor program lacks, say): the dense program serves
                log.info("hoad: %s: the packed program could not be built (%s: %s); computing the dense one",
                         getattr(self.fn, "__name__", "function"), type(e).__name__, first_line(str(e)))
                self._choices[key] = False
            else:
                self._proven.add(key)
                self._ran_packed = True
                return res
        self._ran_packed = False
        return super()._unsharded_call(args, kwargs)

    def _packed_signature(self, args: tuple, kwargs: dict) -> tuple | None:
        """The wrt inputs' shapes, dtypes and devices where this call runs packed, else None."""
        if not self._packable or get_proxy_mode() is not None or \
                torch._C._functorch.peek_interpreter_stack() is not None or self._fully_sharded():
            return None  # (FSDP-sharded modules it reaches: their gathering is Compiled's)
        try:
            xs = [_point_of(self.fn, e, args, kwargs) for e in self.wrt]
        except (HoadError, IndexError, ValueError):  # (dense says what is wrong with the call)
            return None
        key = tuple((tuple(x.shape), x.dtype, x.device) for x in xs)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = self._pays(xs)
        return key if choice else None

    def _pays(self, xs: list[torch.Tensor]) -> bool:
        lead = 1 if self.config.batch_dim is not None else 0
        if any(type(x) is not torch.Tensor or x.dtype != torch.float64 or x.device != xs[0].device
               or x.dim() < lead for x in xs) or len({x.shape[:lead] for x in xs}) > 1:
            return False
        n, k = sum(math.prod(x.shape[lead:]) for x in xs), self.order
        if not packed_pays(n, k):
            return False
        log.info("hoad: %s: order %d over %d entries has %d dense entries and %d unique ones; computing the unique "
                 "ones alone (the packed program; hoad.compile(..., packed=False) for the dense one)",
                 getattr(self.fn, "__name__", "function"), k, n, n ** k, math.comb(n + k - 1, k))
        return True

    def _packed_program(self) -> Packed:
        with self._packed_lock:
            if self._packed is None:
                c = self.config
                options = Options(c.batch_dim, c.backend, c.mode, c.chunk_size, c.memory_budget)
                wrt = self.wrt[0] if len(self.wrt) == 1 else tuple(self.wrt)
                self._packed = Packed(self.fn, self.order, wrt, options=options)
            return self._packed

    @property
    def graph(self):
        """The program of the most recent call: the packed program's where it ran packed."""
        return self._packed.graph if self._ran_packed else super().graph

    def explain(self, *args, **kwargs):
        """:meth:`Packed.explain` where the call (these arguments, or the last call) runs packed,
        else the dense program's explanation."""
        if args or kwargs:
            self(*args, **kwargs)
        return self._packed.explain() if self._ran_packed else super().explain()
