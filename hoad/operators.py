"""Differential operators, computed collapsed: Laplacian (weighted, stochastic) and biharmonic;
the machinery they share with the Taylor jets of :mod:`hoad.jets`.

Each is a contraction of derivative slots (DESIGN §8). hoad computes it in diagonal mode, where
all slots of the input share their labels, with two additions:

- *direction seeds*: the input's first-order seed is a set of directions V (S, *x) instead of
  the identity, so every slot runs over the S directions (``directions=``, and the eigenvectors
  of ``weights=C``, the columns of ``factor=L``);
- *collapse*: at the top order the direction label is summed away, weighted, inside every
  contraction that forms a top-order block, so Σ_s w_s ∂²u/∂v_s² is propagated as one value per
  entry instead of S of them (the forward Laplacian of folx, torch-jet's collapsed Taylor mode).

The biharmonic is the Laplacian of the Laplacian program. Either direction (forward jets, or the
adjoint form) is built, and the cost model keeps the cheaper, as for :func:`hoad.compile`.
"""

from __future__ import annotations

import functools
import inspect
import math
import types
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
import torch.utils._pytree as pytree

from hoad.compiled import Compiled
from hoad.derivatives import Derivatives
from hoad.directions import (
    SHIFT,
    PerPoint,
    _point_of,
    _randomization,
    _randomized,
    _signature,
    parameter_names,
    per_point,
    values_hidden,
)
from hoad.errors import InvalidArgumentError
from hoad.methods import Rebuilt, bind_per_instance, in_class_body
from hoad.options import DEFAULT_OPTIONS, GRAPH_BREAK, Options, refuse_unknown
from hoad.pipeline import OperatorSpec

DIRECTIONS, WEIGHTS = "hoad_directions", "hoad_weights"


class OperatorResult:
    """What an operator returns. A Laplacian: ``value``, ``directional`` (first derivatives along
    each direction, the gradient itself when there are no directions), ``gradient`` (∇u, when the
    directions determine it) and ``laplacian``. A biharmonic: ``laplacian`` and ``biharmonic``
    only. A field it does not hold is an AttributeError naming the ones it does."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"this operator result has no {name!r}; it holds {', '.join(self.__dict__)}")

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return f"OperatorResult({shapes})"


def leafwise(fn: Callable, first, *rest):
    """``fn`` of one result (``Derivatives`` or ``OperatorResult``), or of the corresponding results of
    each tensor a function returns when it returns several (a tuple, list or dict), in their structure."""
    def one(r) -> bool:
        return isinstance(r, (Derivatives, OperatorResult))

    return fn(first, *rest) if one(first) else pytree.tree_map(fn, first, *rest, is_leaf=one)


def _wrapper(u: Callable, extra: tuple[str, ...]) -> Callable:
    """``u`` taking the operator's tensors as extra keyword arguments (program inputs, unused by u)."""

    def wrapped(*args, **kwargs):
        for name in extra:
            kwargs.pop(name, None)
        return u(*args, **kwargs)

    sig = _signature(u)
    if sig is not None:
        params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        tail = [p for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in extra] + tail
        try:
            wrapped.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        except ValueError:  # (a parameter order the extra ones cannot join)
            pass
    wrapped.__name__ = getattr(u, "__name__", type(u).__name__)
    wrapped.__qualname__ = getattr(u, "__qualname__", wrapped.__name__)
    wrapped.__wrapped__ = u  # (the user's function, for hoad.compiled's count of remade operators)
    return wrapped


def _check_wrt(wrt, u=None) -> None:
    if isinstance(wrt, bool) or not isinstance(wrt, (int, str)) or (isinstance(wrt, int) and wrt < 0):
        raise InvalidArgumentError(f"an operator differentiates with respect to one input: wrt must be an argnum "
                                   f"(int >= 0) or an argument name, got {wrt!r}")
    module = u if isinstance(u, torch.nn.Module) else getattr(u, "__self__", None)
    if isinstance(wrt, str) and isinstance(module, torch.nn.Module) and wrt not in parameter_names(u) and \
            wrt in dict(module.named_parameters()) | dict(module.named_buffers()):
        raise InvalidArgumentError(
            f"wrt names {wrt!r}, a parameter of the module: an operator differentiates with respect to an input "
            f"of the function. Along directions in parameter space, hoad.compile(module, order=K, wrt=[{wrt!r}]) "
            "gives every derivative block, and res.along(v) their Taylor model along v")


class _Method(Rebuilt):
    _POSITIONAL = ("wrt",)  # the constructor's positional arguments after u, as __repr__ names them
    """An operator decorating a method (``@hoad.laplacian`` on ``def u(self, x)``): each instance
    gets the operator of its bound method, kept on the instance as ``hoad.compile`` keeps its own."""

    def __get__(self, instance, owner=None):
        args, kwargs = self._arguments
        u = args[0]
        if instance is None or not (isinstance(u, types.FunctionType) and in_class_body(u)
                                    and u.__name__ != "<lambda>"):  # (a lambda in the body is no method)
            return self

        def make():
            return type(self)(types.MethodType(u, instance), *args[1:], **kwargs)

        return bind_per_instance(self, instance, u.__name__, make, lambda b: b._arguments[0][0].__self__ is instance)

    def __repr__(self) -> str:
        args, kwargs = self._arguments

        def shown(v):
            return f"<tensor {tuple(v.shape)}>" if isinstance(v, torch.Tensor) else repr(v)

        kwargs = dict(kwargs)
        options = kwargs.pop("options", DEFAULT_OPTIONS)
        named = dict(zip(self._POSITIONAL, args[1:]), **options.given(), **kwargs)
        shown_options = [f"{k}={shown(v)}" for k, v in named.items()
                         if v is not None and (k, v) not in (("mode", "auto"), ("wrt", 0), ("collapse", False))
                         and k not in ("nestable", "roots")]
        name = (getattr(args[0], "__qualname__", None) or type(args[0]).__name__).split("<locals>.")[-1]
        return f"<hoad.{type(self).__name__.lower()}({', '.join([name] + shown_options)})>"


class _Operator(_Method):
    """Shared machinery: a compiled program of ``u`` over the first-order directions."""

    def __init__(self, u: Callable, order: int, wrt, *, directions, weights, collapse: int | None, options: Options,
                 roots: dict | None = None, nestable: bool = False):
        if not callable(u):
            raise InvalidArgumentError(f"expected a function, got {type(u).__name__}")
        _check_wrt(wrt, u)
        self.u, self.wrt, self.batch_dim = u, wrt, options.batch_dim
        self.directions, self.weights = directions, weights
        extra = tuple(n for n, t in ((DIRECTIONS, directions), (WEIGHTS, weights)) if t is not None)
        spec = OperatorSpec(collapse=collapse, directions=DIRECTIONS if directions is not None else None,
                            weights=WEIGHTS if weights is not None else None)
        self.compiled = Compiled(_wrapper(u, extra), order, wrt, diagonal=True, operator=spec, roots=roots or {"u": u},
                                 nestable=nestable, **options.kwargs())

    @property
    def graph(self):
        """The generated program of the last call (print it to read it)."""
        return self.compiled.graph

    def explain(self, *args, **kwargs):
        """:meth:`hoad.compile(...).explain <hoad.api.Compiled.explain>` of the operator's program,
        for these arguments (or the last call)."""
        if not args and not kwargs:
            return self.compiled.explain()
        return self.compiled.explain(*args, **self._extra(args, kwargs))

    def _point(self, args: tuple, kwargs: dict) -> torch.Tensor:
        return _point_of(self.u, self.wrt, args, kwargs)

    def _operator_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
        """The directions (S, ...) and collapse weights (S,) of this call, and the argument they
        come from (for messages)."""
        return self.directions, self.weights, "directions"

    def redirect(self, directions: torch.Tensor) -> None:
        """Read ``directions`` (S, *x), of the same S, from the next call on (a new draw of
        :class:`~hoad.directions.Resampled`): an input of the same program."""
        self.directions = directions

    def _extra(self, args: tuple, kwargs: dict) -> dict:
        x = self._point(args, kwargs)
        kwargs = dict(kwargs)
        per_point = tuple(x.shape[1:]) if self.batch_dim is not None else tuple(x.shape)
        directions, weights, given = self._operator_tensors()
        if directions is not None:
            if given == "directions" and tuple(directions.shape[1:]) != per_point:
                raise InvalidArgumentError(
                    f"directions must have shape (S, {', '.join(map(str, per_point))}) for an input of shape "
                    f"{tuple(x.shape)}{' (per sample: batch_dim=0)' if self.batch_dim is not None else ''}, "
                    f"got {tuple(directions.shape)}; directions that differ from point to point come from a "
                    "function of the points (directions=lambda X: V, V (B, S, *x))")
            if given != "directions":  # rows of D = the entries of one point
                d = math.prod(per_point)
                if directions.shape[1] != d:
                    want = "(D, D)" if given == "weights" else "(D, S)"
                    raise InvalidArgumentError(
                        f"{given} must be {want} with D = {d}, the entries of one point of shape {per_point} (input "
                        f"{tuple(x.shape)}{', per sample: batch_dim=0' if self.batch_dim is not None else ''}), "
                        f"got {tuple(self._given.shape)}")
                directions = directions.reshape(directions.shape[0], *per_point)
            kwargs[DIRECTIONS] = directions.to(dtype=x.dtype, device=x.device)
        if weights is not None:
            kwargs[WEIGHTS] = weights.to(dtype=x.dtype, device=x.device)
        return kwargs


class Laplacian(_Operator):
    """``hoad.laplacian(u, ...)``: call it like ``u``; returns an :class:`OperatorResult` with
    ``value``, ``directional``, ``gradient`` and ``laplacian``."""

    def __init__(self, u, wrt=0, *, weights=None, factor=None, directions=None, options: Options = DEFAULT_OPTIONS,
                 nestable: bool = False):
        self._keep_arguments(u, wrt, weights=weights, factor=factor, directions=directions, options=options,
                             nestable=nestable)
        given = [n for n, v in (("weights", weights), ("factor", factor), ("directions", directions)) if v is not None]
        if len(given) > 1:
            raise InvalidArgumentError(f"give one of weights=, factor= and directions=, got {given}")
        # C, L or V as given: read at every call, so in-place updates are seen (C's eigh is redone
        # when C changed); L and V may require grad, and results are differentiable in them
        self._given = weights if weights is not None else factor if factor is not None else directions
        self._kind = given[0] if given else None
        self._eigh: tuple = (None, None, None)   # (C's copy, eigenvalues, eigenvectors)
        seeds, collapse_weights = None, None
        if weights is not None:
            _refuse_grad(_matrix(weights, "weights"))
            seeds, collapse_weights = self._eigenpairs()
        elif factor is not None:
            seeds = _matrix(factor, "factor", square=False).mT  # tr(L Lᵀ ∇²u) = Σ_k l_kᵀ ∇²u l_k
            if seeds.shape[0] == 0:
                raise InvalidArgumentError("factor=L has no columns: L must be (D, S) with S >= 1")
        elif directions is not None:
            seeds = _directions(directions)
            collapse_weights = _mean_weights(seeds)
        self._identity = seeds is None
        super().__init__(u, 2, wrt, directions=seeds, weights=collapse_weights, collapse=2, options=options,
                         nestable=nestable)

    def _eigenpairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """C = Q diag(λ) Qᵀ as (Qᵀ, λ): Σ_k λ_k q_kᵀ ∇²u q_k; redone when C's values changed."""
        c = self._given
        kept, lam, q = self._eigh
        if kept is None or kept.shape != c.shape or not torch.equal(kept, c):
            _check_symmetric(c)
            sym = c.detach().to(torch.float64)  # at the points' precision or above
            # eigh reads one triangle: C symmetric to its rounding is made exactly so (a float32 C
            # within its tolerance was off by 3.6e-5 relative on float64 points)
            lam, q = torch.linalg.eigh((sym + sym.mT) / 2)
            self._eigh = (c.detach().clone(), lam, q)
        return q.mT, lam

    def redirect(self, directions: torch.Tensor) -> None:
        super().redirect(directions)
        self._given = directions

    def _operator_tensors(self):
        if self._kind == "weights":
            if torch.is_grad_enabled():
                _refuse_grad(self._given)
            seeds, lam = self._eigenpairs()
            return seeds, lam, "weights"
        if self._kind == "factor":
            return self._given.mT, None, "factor"
        if self._kind == "directions":
            if self.weights.shape[0] != self._given.shape[0]:  # V resized in place: 1/S anew
                self.weights = _mean_weights(self._given)
            return self._given, self.weights, "directions"
        return None, None, "directions"

    @torch._dynamo.disable(reason=GRAPH_BREAK)  # (a graph break under torch.compile, as hoad.compile's call)
    def __call__(self, *args, **kwargs) -> OperatorResult:
        x = self._point(args, kwargs)
        return leafwise(lambda res: self._result(res, x), self.compiled(*args, **self._extra(args, kwargs)))

    def _result(self, res, x: torch.Tensor) -> OperatorResult:
        # the two blocks by their canonical keys (res[wrt] and res[wrt, wrt] resolve and check
        # each key: ~10 us a call, a tenth of a Laplacian at one point)
        p = res._position(self.wrt)
        directional = res._block((p,))
        lap = res._blocks.get((p, p))
        if lap is None:  # a structural zero: u is linear in x
            lap = torch.zeros_like(res.value)
        return OperatorResult(value=res.value, directional=directional, gradient=self._gradient(directional, x),
                              laplacian=lap)

    def _gradient(self, directional: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        if self._identity:
            return directional
        if self._kind != "weights":
            return None
        point = x.shape[1:] if self.batch_dim is not None else x.shape
        q = self._eigenpairs()[0].to(dtype=directional.dtype, device=directional.device)  # ∇u = Q (Qᵀ ∇u)
        return (directional @ q.reshape(q.shape[0], -1)).reshape(*directional.shape[:-1], *point)


def _mean_weights(v: torch.Tensor) -> torch.Tensor:
    """1/S for each of the S directions, in float64: cast to the points' dtype, never rounded to
    V's first."""
    return torch.full((v.shape[0],), 1.0 / v.shape[0], dtype=torch.float64, device=v.device)


def _matrix(m: torch.Tensor, name: str, square: bool = True) -> torch.Tensor:
    if not isinstance(m, torch.Tensor) or m.ndim != 2:
        raise InvalidArgumentError(f"{name} must be a floating-point matrix, got "
                                   f"{tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__}")
    if not m.dtype.is_floating_point:
        raise InvalidArgumentError(f"{name} must be a floating-point matrix, got one of {m.dtype} "
                                   f"(pass {name}.double() or .float())")
    if square and m.shape[0] != m.shape[1]:
        raise InvalidArgumentError(f"{name} must be square (D, D), got {tuple(m.shape)}")
    _check_values(m, name)
    return m


def _check_values(t: torch.Tensor, name: str) -> None:
    if t.device.type == "meta":
        raise InvalidArgumentError(f"{name} is a meta tensor, which holds no values: pass it on the points' device")
    if values_hidden():  # (torch.func.vmap over the directions, say)
        return
    if not bool(torch.isfinite(t).all()):
        raise InvalidArgumentError(f"{name} has entries that are NaN or infinite")


def _refuse_grad(c: torch.Tensor) -> None:
    if c.requires_grad:
        raise InvalidArgumentError(
            "weights=C requires grad: hoad factors C (eigh), and gradients with respect to it are not "
            "computed. Pass factor=L (C = L Lᵀ), which is differentiable, or C.detach()")


def _check_symmetric(c: torch.Tensor) -> None:
    """tr(C ∇²u) only sees C's symmetric part, and eigh reads one triangle: refuse a C that is not
    symmetric to its dtype's rounding (C = Qᵀ diag(λ) Q in float32 is off by ~1e-7)."""
    _check_values(c, "weights")
    rtol = max(1e-10, 1000 * torch.finfo(c.dtype).eps)
    c = c.detach()
    if not torch.allclose(c, c.mT, rtol=rtol, atol=rtol * 1e-2 * float(c.abs().max().clamp_min(1))):
        raise InvalidArgumentError("weights=C must be symmetric (tr(C ∇²u) only sees its symmetric part: "
                                   "pass (C + C.T) / 2); for C = L Lᵀ pass factor=L")


def _directions(v: torch.Tensor) -> torch.Tensor:
    if not isinstance(v, torch.Tensor) or v.ndim < 1 or not v.dtype.is_floating_point or v.shape[0] == 0:
        got = (type(v).__name__ if not isinstance(v, torch.Tensor) else
               f"a {v.dtype} tensor" if not v.dtype.is_floating_point else tuple(v.shape))
        raise InvalidArgumentError(f"directions must be a floating-point tensor (S, *x) of S >= 1 directions, "
                                   f"got {got}")
    _check_values(v, "directions")
    return v


# what hoad.biharmonic(u, directions=V) estimates (T = ∂⁴u, its slots along the rows v_s of V)
ESTIMATORS = {
    "pairs": "(1/(S(S-1))) Σ_{s≠t} T[v_s, v_s, v_t, v_t]: unbiased for independent directions with "
             "E[v vᵀ] = I (Gaussian or Rademacher), S >= 2",
    "gaussian": "(1/(3S)) Σ_s T[v_s, v_s, v_s, v_s] (torch-jet's): unbiased for standard Gaussian directions only",
    "nested": "(1/S²) Σ_{s,t} T[v_s, v_s, v_t, v_t], the stochastic Laplacian over V applied twice: biased, "
              "its mean is (1 + 2/S) Δ²u for Gaussian directions",
}


class Biharmonic(_Method):
    """``hoad.biharmonic(u, ...)``: Δ²u = Σ_ij ∂⁴u/∂x_i²∂x_j², the Laplacian of the Laplacian.

    The inner Laplacian is built as an eager program; the outer Laplacian differentiates that
    program (collapsed again), so Δ²u costs about a Laplacian over a Laplacian's jets, never the
    order-4 tensor. Returns an :class:`OperatorResult` with ``laplacian`` (Δu) and ``biharmonic``.
    With ``weights=C`` (or ``factor=L``) both are the weighted one, L_C u = tr(C ∇²u): the result
    is L_C(L_C u). With ``directions=V`` (S, *x) the result is a randomized estimate of Δ²u over
    the rows v_s of V, the one ``estimator=`` names (:data:`ESTIMATORS`), exact for the given V:

    - ``"pairs"`` (default): (1/(S(S-1))) Σ_{s≠t} ∂⁴u[v_s, v_s, v_t, v_t], unbiased for independent
      directions with E[v vᵀ] = I, Gaussian or Rademacher (S >= 2). Two programs: the nested one
      and the collapsed fourth-order one, combined.
    - ``"gaussian"``: (1/(3S)) Σ_s ∂⁴u[v_s, v_s, v_s, v_s], torch-jet's, computed collapsed (one
      program of order 4 that propagates one value per entry at order 4): unbiased for standard
      Gaussian directions only. For Rademacher ones its mean is Δ²u - (2/3) Σ_i ∂⁴u/∂x_i⁴.
    - ``"nested"``: (1/S²) Σ_{s,t} ∂⁴u[v_s, v_s, v_t, v_t], the stochastic Laplacian over V applied
      twice. Biased: its mean is (1 + 2/S) Δ²u for Gaussian directions, and
      Δ²u + (2/S) (Δ²u - Σ_i ∂⁴u/∂x_i⁴) for Rademacher ones.

    ``.laplacian`` is then the unbiased stochastic Laplacian (1/S) Σ_s ∂²u[v_s, v_s].
    """

    def __init__(self, u, wrt=0, *, weights=None, factor=None, directions=None, estimator=None,
                 options: Options = DEFAULT_OPTIONS):
        self._keep_arguments(u, wrt, weights=weights, factor=factor, directions=directions, estimator=estimator,
                             options=options)
        if estimator is not None and directions is None:
            raise InvalidArgumentError("estimator= chooses what a randomized biharmonic estimates: it needs "
                                       "directions=V (S, *x); weights= and factor= are exact operators")
        if directions is not None:
            estimator = "pairs" if estimator is None else estimator
            if estimator not in ESTIMATORS:
                raise InvalidArgumentError(
                    f"estimator must be one of {', '.join(map(repr, ESTIMATORS))}, got {estimator!r}: "
                    + "; ".join(f"{k!r}: {v}" for k, v in ESTIMATORS.items()))
            if estimator == "pairs":
                _check_pairs(_directions(directions))
        self.estimator = estimator
        self.directions = directions
        self.inner = self.outer = self.fourth = None
        if estimator != "gaussian":
            self.inner = Laplacian(u, wrt, weights=weights, factor=factor, directions=directions,
                                   options=options.replace(backend="eager", chunk_size=None), nestable=True)
            inner = self.inner

            def laplacian_of_u(*args, **kwargs):
                return leafwise(lambda r: r.laplacian, inner(*args, **kwargs))

            laplacian_of_u.__signature__ = _signature(u)  # type: ignore[attr-defined]
            self.outer = Laplacian(laplacian_of_u, wrt, weights=weights, factor=factor, directions=directions,
                                   options=options)
            self.outer.compiled._extra_roots = {"u": u}  # the weights u reads are found through u itself
        if estimator in ("gaussian", "pairs"):
            self.fourth = _FourthAlong(u, wrt, directions=directions, options=options)

    def redirect(self, directions: torch.Tensor) -> None:
        """Read ``directions`` (S, *x), of the same S, from the next call on, in every program."""
        self.directions = directions
        for op in (self.inner, self.outer, self.fourth):
            if op is not None:
                op.redirect(directions)

    @property
    def graph(self):
        """The program of the last call (the outer Laplacian's, or the fourth-order one's for
        ``estimator="gaussian"``)."""
        return (self.outer or self.fourth).graph

    def explain(self, *args, **kwargs):
        """The outer Laplacian's explanation (its program runs the inner one's), or the
        fourth-order program's for ``estimator="gaussian"``."""
        return (self.outer or self.fourth).explain(*args, **kwargs)

    @torch._dynamo.disable(reason=GRAPH_BREAK)  # (a graph break under torch.compile, as hoad.compile's call)
    def __call__(self, *args, **kwargs) -> OperatorResult:
        if self.estimator == "gaussian":
            S = self.directions.shape[0]
            return leafwise(lambda r: OperatorResult(laplacian=r.laplacian, biharmonic=r.fourth / (3 * S)),
                            self.fourth(*args, **kwargs))
        outer = self.outer(*args, **kwargs)
        if self.estimator != "pairs":
            return leafwise(lambda r: OperatorResult(laplacian=r.value, biharmonic=r.laplacian), outer)
        s = _check_pairs(self.directions)
        # Σ_{s,t} T[v_s, v_s, v_t, v_t] (S² times the nested estimate) less its S terms s = t
        return leafwise(lambda r, f: OperatorResult(laplacian=r.value,
                                                    biharmonic=(s * s * r.laplacian - f.fourth) / (s * (s - 1))),
                        outer, self.fourth(*args, **kwargs))


def _check_pairs(v: torch.Tensor) -> int:
    if v.shape[0] < 2:
        raise InvalidArgumentError(
            f"estimator='pairs' averages over pairs of distinct directions and needs S >= 2, got V of shape "
            f"{tuple(v.shape)}; pass more directions, or estimator='gaussian' for Gaussian ones")
    return v.shape[0]


class _FourthAlong(_Operator):
    """Σ_s ∂⁴u[v_s, v_s, v_s, v_s] over the rows of V, collapsed (the direction label is summed
    away as order 4 is formed), and the stochastic Laplacian (1/S) Σ_s ∂²u[v_s, v_s] beside it."""

    def __init__(self, u, wrt, *, directions, options: Options):
        self._given = _directions(directions)
        super().__init__(u, 4, wrt, directions=self._given, weights=_unit_weights(self._given), collapse=4,
                         options=options, roots={"u": u})

    def redirect(self, directions: torch.Tensor) -> None:
        super().redirect(directions)
        self._given = directions

    def _operator_tensors(self):
        if self.weights.shape[0] != self._given.shape[0]:  # V resized in place
            self.weights = _unit_weights(self._given)
        return self._given, self.weights, "directions"

    def __call__(self, *args, **kwargs) -> OperatorResult:
        """``.laplacian`` (the stochastic one) and ``.fourth`` (the collapsed fourth order)."""
        return leafwise(self._result, self.compiled(*args, **self._extra(args, kwargs)))

    def _result(self, res) -> OperatorResult:
        p = res._position(self.wrt)
        second = res._blocks.get((p, p))
        lap = torch.zeros_like(res.value) if second is None else second.mean(-1)
        fourth = res._blocks.get((p, p, p, p))
        return OperatorResult(laplacian=lap, fourth=torch.zeros_like(res.value) if fourth is None else fourth)


def _unit_weights(v: torch.Tensor) -> torch.Tensor:
    return torch.ones((v.shape[0],), dtype=torch.float64, device=v.device)


# the options of hoad.laplacian and hoad.biharmonic (after u)
_OPTIONS = ["wrt", "batch_dim", "weights", "factor", "directions", "backend", "mode", "chunk_size", "memory_budget"]


def laplacian(u: Callable | None = None, wrt=0, *, batch_dim: int | None = None, weights: torch.Tensor | None = None,
              factor: torch.Tensor | None = None, directions: torch.Tensor | None = None, backend: str | None = None,
              mode: str = "auto", chunk_size: int | None = None, memory_budget: float | None = None,
              randomization: tuple | None = None, generator: torch.Generator | None = None,
              **unknown) -> Laplacian:
    """The Laplacian Δu = Σ_i ∂²u/∂x_i² of ``u`` with respect to input ``wrt``, computed collapsed.

    ``weights=C`` (symmetric D×D, D the entries of one point): tr(C ∇²u). ``factor=L`` (D×S):
    tr(L Lᵀ ∇²u). ``directions=V`` (S, *x): the stochastic estimate (1/S) Σ_s v_sᵀ ∇²u v_s (exact
    for the given V; resample by writing new values into V, or build a new operator). C, L and V
    are read at every call (in-place updates are seen); the result is differentiable in L and V,
    not in C (a C that requires grad is refused: pass its factor). ``batch_dim=0``: one
    Laplacian per sample. Non-scalar outputs get one Laplacian per output entry. The result is
    differentiable (train through it); ``.gradient`` is ∇u (None for ``factor`` and
    ``directions``, where ``.directional`` holds the derivatives along each direction).
    ``chunk_size`` and ``memory_budget`` mean what they mean for :func:`hoad.compile`.
    ``randomization=("normal" | "rademacher", S)`` draws S new directions at every call (from
    ``generator``, seeded for a reproducible sequence) for the stochastic estimate, with one
    program for every draw (:class:`Resampled`).
    """
    refuse_unknown("hoad.laplacian", unknown, _OPTIONS + ["randomization", "generator"])
    if u is None:  # @hoad.laplacian(batch_dim=0)
        return lambda u: laplacian(u, wrt, batch_dim=batch_dim, weights=weights, factor=factor,
                                   directions=directions, backend=backend, mode=mode, chunk_size=chunk_size,
                                   memory_budget=memory_budget, randomization=randomization, generator=generator)
    options = Options(batch_dim, backend, mode, chunk_size, memory_budget)
    resampled = _randomized("hoad.laplacian", u, wrt, batch_dim, randomization, generator,
                            {"weights": weights, "factor": factor, "directions": directions},
                            functools.partial(Laplacian, u, wrt, options=options))
    if resampled is not None:
        return resampled
    if per_point(weights, batch_dim, columns=True):  # (C per point is (B, D, D), as a factor (B, D, S))
        raise InvalidArgumentError("hoad.laplacian: weights per point (C(x)) are taken as a factor: pass factor=L "
                                   "with C = L Lᵀ per point, (B, D, S) or a function of the points returning it "
                                   "(torch.linalg.cholesky(C) for a positive definite C)")
    for given, columns in ((factor, True), (directions, False)):
        if given is not None and per_point(given, batch_dim, columns):
            _check_wrt(wrt, u)
            return PerPoint("hoad.laplacian", u, wrt, batch_dim, given, columns,
                            functools.partial(_laplacian_along_axes, mean=not columns, options=options))
    return Laplacian(u, wrt, weights=weights, factor=factor, directions=directions, options=options)


def _laplacian_along_axes(g: Callable, count: int, *, mean: bool, options: Options):
    """The Laplacian of g in its input ``hoad_t`` (directions per point: :class:`PerPoint`), and
    the result it makes: Σ_s ∂²u[v_s, v_s], divided by S where ``mean`` (directions; a factor's
    columns are summed); ``.directional`` the first derivatives along each point's directions, no
    ``.gradient`` (as for a shared factor or directions)."""
    op = Laplacian(g, SHIFT, options=options)
    scale = 1.0 / count if mean else 1.0

    def finish(res):
        return leafwise(lambda r: OperatorResult(value=r.value, directional=r.directional, gradient=None,
                                                 laplacian=r.laplacian * scale if scale != 1.0 else r.laplacian), res)

    return op, finish


def biharmonic(u: Callable | None = None, wrt=0, *, batch_dim: int | None = None, weights: torch.Tensor | None = None,
               factor: torch.Tensor | None = None, directions: torch.Tensor | None = None, estimator: str | None = None,
               backend: str | None = None, mode: str = "auto", chunk_size: int | None = None,
               memory_budget: float | None = None, randomization: tuple | None = None,
               generator: torch.Generator | None = None, **unknown) -> Biharmonic:
    """The biharmonic Δ²u = Σ_ij ∂⁴u/∂x_i²∂x_j² of ``u`` (``.biharmonic``; ``.laplacian`` is Δu).

    ``weights=C`` and ``factor=L`` mean what they mean for :func:`laplacian`, applied twice:
    ``.biharmonic`` is L(L u) for that operator L, ``.laplacian`` is L u. ``directions=V`` (S, *x)
    gives a randomized estimate of Δ²u, exact for the given V; ``estimator=`` says which:
    ``"pairs"`` (default, unbiased for independent directions with E[v vᵀ] = I),
    ``"gaussian"`` (torch-jet's (1/(3S)) Σ_s ∂⁴u[v_s⁴], unbiased for Gaussian directions only) or
    ``"nested"`` (the stochastic Laplacian applied twice, biased by (1 + 2/S) for Gaussian
    directions); :class:`Biharmonic` gives each one's formula and mean. ``randomization=`` and
    ``generator=`` draw new directions at every call, as for :func:`laplacian`."""
    refuse_unknown("hoad.biharmonic", unknown, _OPTIONS + ["estimator", "randomization", "generator"])
    if u is None:  # @hoad.biharmonic(batch_dim=0)
        return lambda u: biharmonic(u, wrt, batch_dim=batch_dim, weights=weights, factor=factor,
                                    directions=directions, estimator=estimator, backend=backend, mode=mode,
                                    chunk_size=chunk_size, memory_budget=memory_budget, randomization=randomization,
                                    generator=generator)
    options = Options(batch_dim, backend, mode, chunk_size, memory_budget)
    if per_point(factor, batch_dim, columns=True) or any(per_point(g, None, False) for g in (weights, directions)):
        raise InvalidArgumentError("hoad.biharmonic takes one operator for every point (weights=, factor= or "
                                   "directions= as tensors shared by the samples); directions or factors per point "
                                   "work in hoad.laplacian and hoad.taylor")
    if randomization is not None and estimator in (None, "pairs"):  # (pairs: the default estimator)
        if _randomization(randomization)[1] < 2:
            raise InvalidArgumentError("estimator='pairs' averages over pairs of distinct directions and needs "
                                       f"S >= 2, got randomization={randomization!r}")
    resampled = _randomized("hoad.biharmonic", u, wrt, batch_dim, randomization, generator,
                            {"weights": weights, "factor": factor, "directions": directions},
                            functools.partial(Biharmonic, u, wrt, estimator=estimator, options=options))
    if resampled is not None:
        return resampled
    return Biharmonic(u, wrt, weights=weights, factor=factor, directions=directions, estimator=estimator,
                      options=options)
