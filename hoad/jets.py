"""Taylor jets: ``hoad.taylor``, the derivatives of u along directions, lines or curves, each
direction's or collapsed at the top order (torch-jet's jets and collapsed jets), with the
directions shared, drawn at every call or given point by point (:mod:`hoad.directions`).
Built on the operators' machinery (:mod:`hoad.operators`): direction seeds, and the top-order
collapse the Laplacian uses."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch._dynamo

from hoad.directions import SHIFT, PerPoint, _randomized, per_point
from hoad.errors import InvalidArgumentError
from hoad.operators import _check_wrt, _directions, _Operator, _unit_weights, leafwise
from hoad.options import DEFAULT_OPTIONS, GRAPH_BREAK, Options, plain_int, refuse_unknown


class Taylor(_Operator):
    """``hoad.taylor(u, order=K, directions=V)``: ``result[k]`` is ∂^k u[v, …, v] for every direction
    v (last axis S), k = 0..K. With ``collapse=True`` the top order is summed over the directions
    as it is formed, Σ_s w_s ∂^K u[v_s, …, v_s] (w: ``weights``, ones by default): torch-jet's
    collapsed jet, from which the weighted and randomized operators of every order are made."""

    _POSITIONAL = ("order", "wrt")

    def __init__(self, u, order: int, wrt=0, *, directions, collapse: bool = False, weights=None,
                 options: Options = DEFAULT_OPTIONS):
        self._keep_arguments(u, order, wrt, directions=directions, collapse=collapse, weights=weights, options=options)
        order = plain_int(order)
        if isinstance(order, bool) or not isinstance(order, int) or order < 1:
            raise InvalidArgumentError(f"order must be an int >= 1, got {order!r}")
        if not isinstance(collapse, bool):
            raise InvalidArgumentError(f"collapse must be True or False, got {collapse!r}")
        if weights is not None and not collapse:
            raise InvalidArgumentError("hoad.taylor: weights= weighs the directions in the collapsed top order "
                                       "(Σ_s w_s ∂^K u[v_s, …]); pass collapse=True with it")
        V = _directions(directions)
        self._given_weights = None if weights is None else _direction_weights(weights, V)
        # (order 1 collapsed is the derivative along Σ_s w_s v_s: the directions are summed afterwards)
        folded = collapse and order > 1
        super().__init__(u, order, wrt, directions=V,
                         weights=(self._given_weights if weights is not None else _unit_weights(V)) if folded
                         else None,
                         collapse=order if folded else None, options=options)
        self.order, self.collapse = order, collapse

    def _operator_tensors(self):
        if self.collapse and self.weights is not None:
            if self._given_weights is not None:  # (either resized in place)
                _direction_weights(self._given_weights, self.directions)
            elif self.weights.shape[0] != self.directions.shape[0]:
                self.weights = _unit_weights(self.directions)
        return self.directions, self.weights, "directions"

    @torch._dynamo.disable(reason=GRAPH_BREAK)  # (a graph break under torch.compile, as hoad.compile's call)
    def __call__(self, *args, **kwargs) -> TaylorResult:
        count = self.directions.shape[0]
        summed = None
        if self.collapse and self.weights is None:  # (order 1: summed here)
            summed = (self._given_weights if self._given_weights is not None else _unit_weights(self.directions))
            _direction_weights(summed, self.directions)
        return leafwise(lambda res: TaylorResult(res, self.wrt, self.order, self.collapse, count, summed),
                        self.compiled(*args, **self._extra(args, kwargs)))


def _direction_weights(w, V: torch.Tensor) -> torch.Tensor:
    """``weights`` of a collapsed Taylor jet: one real number per direction, (S,)."""
    if not isinstance(w, torch.Tensor) or w.ndim != 1 or w.shape[0] != V.shape[0] or not w.dtype.is_floating_point:
        shown = f"a {tuple(w.shape)} {str(w.dtype).removeprefix('torch.')} tensor" if isinstance(w, torch.Tensor) \
            else type(w).__name__
        raise InvalidArgumentError(f"weights must be a floating-point tensor of shape (S,) = ({V.shape[0]},), one per "
                                   f"direction, got {shown}")
    return w  # (it may require grad: the collapsed top order is linear in it)


class TaylorResult:
    """Derivatives along each of the S directions v: ``result[k]`` is dᵏ/dtᵏ u(x + t v) at t = 0,
    ``(*u, S)`` (``result[0]`` is the value, ``(*u,)``). :attr:`derivatives` stacks them all as
    ``(K + 1, *u, S)``, the value repeated along the directions; :attr:`coefficients` are the
    Taylor coefficients, dᵏ/dtᵏ u / k!, in the same layout, so that u(x + t v) ≈ Σ_k c_k tᵏ.

    Collapsed (``collapse=True``): ``result[K]`` and :attr:`collapsed` are Σ_s w_s ∂^K u[v_s, …],
    ``(*u,)``; orders below K keep their directions, and :attr:`derivatives` and
    :attr:`coefficients` stack those, orders 0..K−1."""

    def __init__(self, res, wrt, order: int, collapse: bool = False, count: int | None = None,
                 summed: torch.Tensor | None = None):
        self._res, self._wrt, self.order, self.collapse, self._count = res, wrt, order, collapse, count
        self._summed = summed  # the weights an order-1 result is collapsed with here
        self.value = res.value

    def __getitem__(self, k: int) -> torch.Tensor:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.order:
            raise InvalidArgumentError(f"a Taylor result holds derivatives of orders 0 to {self.order}, got {k!r}")
        if k == 0:
            return self.value
        key = (self._wrt,) * k
        if self._res.is_structural_zero(key):
            return torch.zeros_like(self.value if self.collapse and k == self.order else self._res[(self._wrt,)])
        if self._summed is not None:
            return self._res[key] @ self._summed.to(self.value.dtype)
        return self._res[key]

    @property
    def collapsed(self) -> torch.Tensor:
        """``(*u,)``: the top order summed over the directions, Σ_s w_s ∂^K u[v_s, …, v_s]."""
        if not self.collapse:
            raise InvalidArgumentError("this Taylor result keeps every direction (result[K] is (*u, S)); "
                                       "hoad.taylor(..., collapse=True) sums the top order over them")
        return self[self.order]

    @property
    def derivatives(self) -> torch.Tensor:
        """``(K + 1, *u, S)``: dᵏ/dtᵏ u(x + t v) for k = 0..K along each direction (collapsed: k = 0..K−1)."""
        top = self.order - 1 if self.collapse else self.order
        value = self.value.unsqueeze(-1).expand(*self.value.shape, self._count if top == 0 else self[1].shape[-1])
        return torch.stack([value] + [self[k] for k in range(1, top + 1)])

    @property
    def coefficients(self) -> torch.Tensor:
        """``(K + 1, *u, S)``: the Taylor coefficients dᵏ/dtᵏ u(x + t v) / k! (collapsed: k = 0..K−1)."""
        d = self.derivatives
        factorials = torch.tensor([float(math.factorial(k)) for k in range(d.shape[0])], dtype=d.dtype,
                                  device=d.device)
        return d / factorials.reshape((-1,) + (1,) * (d.ndim - 1))

    def __len__(self) -> int:
        return self.order + 1

    def __iter__(self):
        return (self[k] for k in range(self.order + 1))

    def __repr__(self) -> str:
        collapsed = ", collapsed=True" if self.collapse else ""
        return f"TaylorResult(order={self.order}{collapsed}, shapes={[tuple(self[k].shape) for k in range(len(self))]})"


def taylor(u: Callable | None = None, order: int | None = None, directions: torch.Tensor | None = None, wrt=0, *,
           batch_dim: int | None = None, higher: tuple | None = None, collapse: bool = False,
           weights: torch.Tensor | None = None, backend: str | None = None, mode: str = "auto",
           chunk_size: int | None = None, memory_budget: float | None = None, randomization: tuple | None = None,
           generator: torch.Generator | None = None, **unknown) -> Taylor:
    """Directional derivatives: ``taylor(u, order=K, directions=V)(x)[k]`` is ∂^k u[v, …, v] =
    d^k/dt^k u(x + t v) at t = 0 for each of the S directions (last axis); ``.derivatives`` stacks
    orders 0..K, ``.coefficients`` divides each by k! (:class:`TaylorResult`).

    ``collapse=True`` sums the top order over the directions as the program forms it,
    Σ_s w_s ∂^K u[v_s, …, v_s] with ``weights`` w (S,) (ones by default): the collapsed K-jet, whose
    cost grows with one top coefficient instead of S. ``randomization=("normal" | "rademacher", S)``
    draws S new directions at every call (from ``generator``), with one program for every draw.

    ``higher=(V_2, …, V_K)`` follows curves instead of lines, x(t) = x + t V + Σ_k tᵏ/k! V_k per
    direction (torch-jet's jet of arbitrary coefficients): ``result[k]`` is dᵏ/dtᵏ u(x(t)) at 0.
    ``directions`` (and each V_k) may be a function of the points, returning ``(B, S, *x)`` under
    ``batch_dim`` (one set of directions per sample)."""
    refuse_unknown("hoad.taylor", unknown, ["order", "directions", "wrt", "batch_dim", "higher", "collapse",
                                            "weights", "backend", "mode", "chunk_size", "memory_budget",
                                            "randomization", "generator"])
    if order is None or (directions is None and randomization is None):
        raise InvalidArgumentError("hoad.taylor needs order=K and directions=V (S, *x) (or randomization=(kind, S)): "
                                   "the derivatives d^k/dt^k u(x + t v) for k = 1..K along each direction v")
    options = Options(batch_dim, backend, mode, chunk_size, memory_budget)
    if u is None:  # @hoad.taylor(order=K, directions=V)
        return lambda u: taylor(u, order, directions, wrt, higher=higher, collapse=collapse, weights=weights,
                                randomization=randomization, generator=generator, **options.kwargs())
    resampled = _randomized("hoad.taylor", u, wrt, batch_dim, randomization, generator, {"directions": directions},
                            functools.partial(Taylor, u, order, wrt, collapse=collapse, weights=weights,
                                              options=options))
    if resampled is not None:
        return resampled
    if higher is not None:
        if not isinstance(higher, (tuple, list)) or not 1 <= len(higher) <= plain_int(order) - 1:
            raise InvalidArgumentError(
                f"hoad.taylor: higher= gives the curve's coefficients (V_2, ..., V_K) after the directions V = V_1, "
                f"x(t) = x + t V + Σ_k tᵏ/k! V_k: a tuple of 1 to K - 1 = {plain_int(order) - 1} of them, got "
                f"{type(higher).__name__ if not isinstance(higher, (tuple, list)) else len(higher)}")
        if randomization is not None:
            raise InvalidArgumentError("hoad.taylor: higher= bends given directions into curves; it cannot be "
                                       "combined with randomization=")
    if higher is not None or per_point(directions, batch_dim, columns=False):
        _check_wrt(wrt, u)

        along = functools.partial(_along_axes, order=order, collapse=collapse, weights=weights, options=options)
        return PerPoint("hoad.taylor", u, wrt, batch_dim, directions, False, along, higher=higher or ())
    return Taylor(u, order, wrt, directions=directions, collapse=collapse, weights=weights, options=options)


def _along_axes(g: Callable, count: int, *, order: int, collapse: bool, weights, options: Options):
    """g's Taylor jets along its own axes t_s (directions per point, curves: :class:`PerPoint`), and
    the result they make (the jets themselves)."""
    axes = torch.eye(count, dtype=torch.float64)
    return Taylor(g, order, SHIFT, directions=axes, collapse=collapse, weights=weights, options=options), _same


def _same(res):
    return res
