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
import math
import threading
import warnings
from collections.abc import Mapping
from fractions import Fraction

import numpy as np
import torch
import torch._dynamo
from tabulate import tabulate

from hoad.derivatives import Derivatives, ResultSpec
from hoad.errors import InvalidArgumentError
from hoad.operators import DIRECTIONS, _check_wrt, _Operator, leafwise
from hoad.options import DEFAULT_OPTIONS, GRAPH_BREAK, Options, plain_int


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
    for row, combo in enumerate(itertools.combinations_with_replacement(range(n), d)):
        for v in combo:
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
def _dense_positions(n: int, k: int, device: torch.device) -> torch.Tensor:
    """(nᵏ,): for each entry of a dense block, read row-major, its position on the packed axis."""
    every = np.stack(np.unravel_index(np.arange(n ** k), (n,) * k), axis=-1)
    return torch.from_numpy(_rank(np.sort(every, axis=-1), n)).to(device)


# ------------------------------------------------------------------------------ results
class PackedBlocks(Mapping):
    """A packed result's blocks by canonical multi-index (0,)*k: the unique entries ``packed[K]``
    (*lead, M), expanded to the dense block when read (once)."""

    def __init__(self, packed: dict, lead: tuple, slot: tuple):
        self.packed, self._lead, self._slot = packed, lead, slot
        self._dense: dict = {}
        self._lock = threading.Lock()

    def __getitem__(self, K):
        with self._lock:
            if K not in self._dense:
                values = self.packed[K]
                n, k = math.prod(self._slot), len(K)
                positions = _dense_positions(n, k, values.device)
                self._dense[K] = values[..., positions].reshape(self._lead + self._slot * k)
            return self._dense[K]

    def __iter__(self):
        return iter(self.packed)

    def __len__(self) -> int:
        return len(self.packed)


class Packed(_Operator):
    """``hoad.compile(u, order=K, wrt=x, packed=True)``: every order 1..K of one input x, computed
    as unique entries (see the module docstring); returns :class:`~hoad.Derivatives` whose
    ``packed(key)`` gives them as computed and whose ``res[key]`` expands the dense block."""

    _POSITIONAL = ("order", "wrt")

    def __init__(self, u, order: int, wrt=0, *, options: Options = DEFAULT_OPTIONS):
        self._keep_arguments(u, order, wrt, options=options)
        order = plain_int(order)
        if isinstance(order, bool) or not isinstance(order, int) or order < 1:
            raise InvalidArgumentError(f"order must be an int >= 1, got {order!r}")
        if isinstance(wrt, (tuple, list)) and len(wrt) == 1:
            wrt = wrt[0]
        if isinstance(wrt, (tuple, list)) or not isinstance(wrt, (int, str)) or isinstance(wrt, bool):
            raise InvalidArgumentError(
                f"packed=True computes the blocks of one input, ∂ᵏu/∂xᵏ: wrt must be one argnum or argument "
                f"name, got {wrt!r}; for mixed blocks of several inputs leave packed off (dense blocks), or pass "
                "the inputs as one tensor")
        _check_wrt(wrt)
        super().__init__(u, order, wrt, directions=torch.zeros(1, 1, dtype=torch.float64), weights=None,
                         collapse=None, options=options)
        self.order = order

    def __repr__(self) -> str:
        shown = super().__repr__().removeprefix("<hoad.packed(").removesuffix(")>")
        return f"<hoad.compile({shown}, packed=True)>"

    def _point_shape(self, args: tuple, kwargs: dict) -> tuple:
        """The shape of one point of x (of one sample under ``batch_dim``)."""
        x = self._point(args, kwargs)
        return tuple(x.shape[1:]) if self.batch_dim is not None else tuple(x.shape)

    def _extra(self, args: tuple, kwargs: dict) -> dict:
        x, slot = self._point(args, kwargs), self._point_shape(args, kwargs)
        V = lattice(math.prod(slot), self.order)
        kwargs = dict(kwargs)
        kwargs[DIRECTIONS] = V.reshape((V.shape[0],) + slot).to(dtype=x.dtype, device=x.device)
        return kwargs

    @torch._dynamo.disable(reason=GRAPH_BREAK)  # (a graph break under torch.compile, as hoad.compile's call)
    def __call__(self, *args, **kwargs) -> Derivatives:
        slot = self._point_shape(args, kwargs)
        self._last_slot = slot
        return leafwise(lambda res: self._result(res, slot), self.compiled(*args, **self._extra(args, kwargs)))

    def explain(self, *args, **kwargs):
        """Each order's dense and unique entries, then the program of Taylor jets that computes
        them (:meth:`hoad.compile(...).explain <hoad.api.Compiled.explain>`), for these arguments
        (or the last call)."""
        inner = super().explain(*args, **kwargs)
        slot = self._point_shape(args, kwargs) if args or kwargs else self._last_slot
        return PackedExplanation(inner, math.prod(slot), self.order)

    def _result(self, res: Derivatives, slot: tuple) -> Derivatives:
        n, lead, K_top = math.prod(slot), tuple(res.value.shape), self.order
        packed, zeros = {}, []
        for k in range(1, K_top + 1):
            K = (0,) * k
            if K in res._spec.zeros:
                zeros.append(K)
                continue
            along = res._block(K).reshape(-1, math.comb(n + K_top - 1, K_top))  # (*lead, S) as (m, S)
            gamma = _on(n, K_top, k, along.dtype, along.device)
            packed[K] = (gamma @ along.T).T.reshape(lead + (gamma.shape[0],))
        keys = [K for K in ((0,) * k for k in range(1, K_top + 1)) if K in packed]
        spec = res._spec
        return Derivatives(res.value, PackedBlocks(packed, lead, slot),
                           ResultSpec(keys, zeros, spec.wrt, spec.aliases, [slot], K_top))


class PackedExplanation:
    """:meth:`Packed.explain`: the packed blocks' sizes above the Taylor program's explanation."""

    def __init__(self, program, n: int, order: int):
        self.program, self.n, self.order = program, n, order

    def __str__(self) -> str:
        p = self.program.program
        name, out = p.wrt_names[0], math.prod(p.out_shape)
        rows = [[k, f"({', '.join([name] * k)})", out * self.n ** k, out * math.comb(self.n + k - 1, k)]
                for k in range(1, self.order + 1)]
        head = (f"packed=True: every block of {name} ({self.n} entries) as its unique entries, read off Taylor jets "
                f"of order {self.order} along the {math.comb(self.n + self.order - 1, self.order)} lattice "
                "directions (the program below); a dense block is formed only where res[key] reads one")
        table = tabulate(rows, headers=["order", "block", "dense entries", "unique entries (computed)"])
        return f"{head}\n\n{table}\n\n{self.program}"

    __repr__ = __str__
