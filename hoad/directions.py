"""Where an operator's directions come from when not from one fixed tensor: drawn anew at every
call (:class:`Resampled`, ``randomization=``), or given point by point (:class:`PerPoint`: a
tensor with a direction set per sample, or a function of the points), and curves instead of
lines (a Taylor jet of arbitrary coefficients).

Directions per point are a change of variables, exact at every order: with g(t) = u(x + Σ_s t_s v_s)
for the point's own v_s, ∂^k g/∂t_s^k at t = 0 is ∂^k u[v_s, …, v_s], so the operator over the
coordinate axes of t is the operator over each point's directions. The program receives t
(zeros) and the directions as inputs; the directions are read at every call and never
differentiated by the operator (torch-jet's point-dependent weighting S(x) means the same).
A curve x + t v + Σ_k tᵏ/k! V_k is the same change of variables with powers of t_s.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
from collections.abc import Callable

import torch
import torch._dynamo
import torch.utils._pytree as pytree
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import _disable_current_modes

from hoad.binding import MISSING, Keyword, Positional, holder_of, leaf_at, with_tensor_at
from hoad.errors import InvalidArgumentError
from hoad.methods import Rebuilt, unbound_method
from hoad.options import GRAPH_BREAK


def _point_of(u: Callable, wrt, args: tuple, kwargs: dict) -> torch.Tensor:
    """The operator's input ``wrt`` in a call of ``u``: at its place (:func:`_point_place`), or
    inside the container argument there."""
    if isinstance(wrt, int) and wrt >= len(args):  # (the wrt-th parameter, passed by name)
        names = parameter_names(u)
        if wrt >= len(names) or kwargs.get(names[wrt]) is None:
            raise InvalidArgumentError(f"wrt={wrt} but the call passes {len(args)} positional arguments "
                                       "and not that parameter by name")
    place = _point_place(u, wrt, args, kwargs)
    x = args[place.index] if isinstance(place, Positional) else kwargs.get(place.name)
    holder = _holder(u, wrt, kwargs)
    if holder is not None:  # a tensor inside a container argument ("inputs['x']")
        container, x = x, leaf_at(wrt, holder, x)
        if x is MISSING:
            paths = [holder + pytree.keystr(keys) for keys, leaf in pytree.tree_flatten_with_path(container)[0]
                     if isinstance(leaf, torch.Tensor)]
            raise InvalidArgumentError(f"the operator's input {wrt!r} is not in the call's argument {holder!r}; the "
                                       f"tensors in it are {paths or 'none'}")
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        got = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else f"{x!r} ({type(x).__name__})"
        raise InvalidArgumentError(f"the operator's input {wrt!r} must be a floating-point tensor, got {got}")
    return x



def values_hidden() -> bool:
    """Whether a tensor's values cannot steer Python here: inside a function hoad is tracing (its
    program reads each call's tensors), or inside ``torch.func.vmap`` (one call for every sample)."""
    if get_proxy_mode() is not None:
        return True
    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def parameter_names(u) -> list[str]:
    """The names of u's parameters, in order (none where its signature cannot be read)."""
    sig = _signature(u)
    return list(sig.parameters) if sig is not None else []


def _signature(u):
    """u's signature; a module's is its forward's (calling a module takes ``*args, **kwargs``)."""
    try:
        return inspect.signature(u.forward if isinstance(u, torch.nn.Module) else u)
    except (TypeError, ValueError):
        return None



DISTRIBUTIONS = ("normal", "rademacher")  # of randomization=(distribution, S), as torch-jet names them


class Resampled(Rebuilt):
    """A randomized operator that draws new directions at every call: ``randomization=(kind, S)``
    with ``kind`` "normal" or "rademacher" (torch-jet's), from ``generator`` (the points' device's
    default one when None). Each call draws a tensor V (S, *x) of its own, on the points' device
    and dtype, and points the operator at it: V is an input its program reads at every call, so
    the program is built once. ``directions`` is the last call's V. A seeded generator makes the
    sequence of results reproducible. The same V serves every sample of a call (``batch_dim=0``).

    A V is never written again once drawn: a result's backward reads the V it was computed with
    (a loss of two calls, interior and boundary points, failed its backward when the second call
    overwrote the first one's V in place). Calls from several threads take turns, from the draw
    to the results (one thread's program read another's half-drawn V).

    ``make(directions=V)`` builds the operator over V: a partial of its class, which copies
    (``copy.deepcopy``, pickle) carry with the rest of the arguments (:class:`~hoad.methods.Rebuilt`)."""

    def __init__(self, u: Callable, wrt, batch_dim, randomization, generator, make: Callable):
        self._keep_arguments(u, wrt, batch_dim, randomization, generator, make)
        kind, count = _randomization(randomization)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise InvalidArgumentError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.u, self.wrt, self.batch_dim = u, wrt, batch_dim
        self.kind, self.count, self.generator, self._make = kind, count, generator, make
        self.operator = None  # the last call's
        self._operators: dict[tuple, object] = {}  # by the shape and device of V
        self._drawn: torch.Tensor | None = None  # the last call's V (directions)
        self._turns = threading.Lock()

    def resample(self, x: torch.Tensor) -> torch.Tensor:
        """New directions for a call at points ``x``, which the operator reads at its next call."""
        point = tuple(x.shape[1:]) if self.batch_dim is not None else tuple(x.shape)
        g = self.generator
        if g is not None and g.device.type != x.device.type:
            raise InvalidArgumentError(f"generator is on {g.device} and the points on {x.device}: draw on the "
                                       f"points' device (torch.Generator(device={str(x.device)!r}))")
        shape = (self.count, *point)
        try:
            with torch.no_grad():  # (drawn out of place: under vmap(randomness="different") a draw per sample)
                if self.kind == "normal":
                    V = torch.randn(shape, dtype=x.dtype, device=x.device, generator=g)
                else:
                    V = torch.randint(0, 2, shape, device=x.device, generator=g).to(x.dtype) * 2 - 1
        except RuntimeError as e:
            if "vmap" not in str(e) or "randomness" not in str(e):
                raise
            raise InvalidArgumentError(
                "a randomized operator (randomization=) called inside torch.func.vmap draws its directions there: "
                "pass randomness='different' to vmap (a draw per sample, as torch-jet's paper times it) or "
                "randomness='same' (one draw for every sample, which batch_dim=0 gives without vmap)") from e
        operator = self._operators.get((V.shape, V.device))
        if operator is None:  # (a new shape of points: an operator of its own)
            # made outside inference mode: the operator's own tensors (its weights 1/S) outlive this
            # call, and made in a first call under torch.inference_mode() every later call that
            # trains failed ("Inference tensors cannot be saved for backward")
            with torch.inference_mode(False):
                operator = self._operators[V.shape, V.device] = self._make(directions=V)
        else:
            operator.redirect(V)
        self.operator, self._drawn = operator, V
        return V

    @property
    def directions(self) -> torch.Tensor | None:
        """The last call's V (S, *x); under ``torch.func.vmap`` one per sample, readable inside it."""
        V = self._drawn
        if V is not None and torch._C._functorch.is_batchedtensor(V) and not values_hidden():
            raise InvalidArgumentError(
                "the last call of this randomized operator ran inside torch.func.vmap, which drew its directions "
                "per sample: they exist only inside the vmapped function. Read op.directions there (return it "
                "from the function), or call the operator outside vmap")
        return V

    @torch._dynamo.disable(reason=GRAPH_BREAK)  # (a graph break under torch.compile, as hoad.compile's call)
    def __call__(self, *args, **kwargs):
        x = _point_of(self.u, self.wrt, args, kwargs)
        if get_proxy_mode() is not None:
            raise InvalidArgumentError(
                "a randomized operator (randomization=) was called inside a function hoad is tracing (hoad.compile "
                "of a loss, say): its program would keep the one draw it was traced with, and never draw again. Hold "
                "the directions in a tensor V (S, *x) instead, build the operator with directions=V, and draw into V "
                "before each call of the compiled function (V.normal_()): the program reads V at every call")
        with self._turns:
            self.resample(x)
            return self.operator(*args, **kwargs)

    @property
    def graph(self):
        if self.operator is None:
            raise InvalidArgumentError("call the operator once before asking for its graph")
        return self.operator.graph

    def explain(self):
        """The explanation of the last call's program (one program serves every draw)."""
        if self.operator is None:
            raise InvalidArgumentError("call the operator once before asking for its explanation")
        return self.operator.explain()

    def __repr__(self) -> str:
        name = getattr(self.u, "__qualname__", type(self.u).__name__).split("<locals>.")[-1]
        return f"<hoad randomized operator of {name}: {self.kind}, S={self.count}>"


def _randomization(randomization) -> tuple[str, int]:
    if (not isinstance(randomization, (tuple, list)) or len(randomization) != 2
            or randomization[0] not in DISTRIBUTIONS or isinstance(randomization[1], bool)
            or not isinstance(randomization[1], int) or randomization[1] < 1):
        raise InvalidArgumentError(f"randomization must be (distribution, S) with a distribution in {DISTRIBUTIONS} "
                                   f"and S >= 1 directions drawn per call, got {randomization!r}")
    return randomization[0], randomization[1]


def _randomized(name: str, u, wrt, batch_dim, randomization, generator, given: dict, make: Callable):
    """``u``'s operator that draws its directions at every call, or None when not asked to."""
    if randomization is None:
        if generator is not None:
            raise InvalidArgumentError(f"{name}: generator= draws the directions of randomization=(kind, S); "
                                       "pass randomization too")
        return None
    clash = [k for k, v in given.items() if v is not None]
    if clash:
        raise InvalidArgumentError(f"{name}: randomization= draws its own directions; it cannot be combined with "
                                   f"{', '.join(f'{k}=' for k in clash)}")
    if unbound_method(u):
        raise InvalidArgumentError(f"{name}(randomization=...) on a method: build the operator over the bound "
                                   "method instead (self.lap = hoad.laplacian(self.u, randomization=...) in __init__)")
    return Resampled(u, wrt, batch_dim, randomization, generator, make)




# ------------------------------------------------------------------------ directions per point
SHIFT, SEEDS = "hoad_t", "hoad_seeds"  # the change of variables' inputs: t (zeros) and the directions


def _holder(u: Callable, wrt, kwargs: dict) -> str | None:
    """The container argument of u that ``wrt`` addresses a tensor inside (``"inputs"`` for
    ``"inputs['x']"``), or None where ``wrt`` names an argument itself."""
    if not isinstance(wrt, str) or wrt in kwargs:
        return None
    names = parameter_names(u)
    return None if wrt in names else holder_of(wrt, names + list(kwargs))


def _point_place(u: Callable, wrt, args: tuple, kwargs: dict) -> Positional | Keyword:
    """Where the operator's input ``wrt`` is in a call of ``u``: a positional or a keyword argument
    (for a tensor inside a container argument, ``"inputs['x']"``, that argument's place)."""
    if isinstance(wrt, int) and wrt < len(args):
        return Positional(wrt)
    name = wrt
    if isinstance(wrt, int) or wrt not in kwargs:
        names = parameter_names(u)
        name = _holder(u, wrt, kwargs) or wrt
        if name in kwargs:
            return Keyword(name)
        if isinstance(name, str) and name in names and names.index(name) < len(args):
            return Positional(names.index(name))
        name = names[wrt] if isinstance(wrt, int) else name
    return Keyword(name)


def _with_point(u: Callable, wrt, args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    """The call's arguments with the operator's input ``wrt`` replaced by ``x``."""
    place = _point_place(u, wrt, args, kwargs)
    holder = _holder(u, wrt, kwargs)
    if holder is not None:  # a tensor inside a container argument: the container with x in its place
        x = with_tensor_at(wrt, holder, args[place.index] if isinstance(place, Positional) else kwargs[place.name], x)
    if isinstance(place, Positional):
        return args[:place.index] + (x,) + args[place.index + 1:], kwargs
    return args, {**kwargs, place.name: x}


class PerPoint(Rebuilt):
    """An operator whose directions differ from point to point, or whose curves bend.

    ``given`` holds the directions, or is a function of the points returning them, read at every
    call: rows ``(B, S, *x)`` per sample under ``batch_dim=0`` (``(S, *x)`` without, or shared by
    every sample), or, for a factor, columns ``(B, D, S)`` (``(D, S)``) with D the entries of one
    point. ``higher`` (V₂, …, V_K), in the form of the rows, bends each direction's line into the
    curve x + t v + Σ_k tᵏ/k! V_k (torch-jet's jet of arbitrary coefficients). ``make(g, S)``
    builds the operator of ``g`` over the coordinate axes of its input ``hoad_t`` (S of them) and
    returns it with the function that turns its result into this operator's: a partial of a
    module's function, which copies (``copy.deepcopy``, pickle) carry with the rest of the
    arguments (:class:`~hoad.methods.Rebuilt`)."""

    def __init__(self, name: str, u: Callable, wrt, batch_dim, given, columns: bool, make: Callable,
                 higher: tuple = ()):
        self._keep_arguments(name, u, wrt, batch_dim, given, columns, make, higher=higher)
        if unbound_method(u):
            raise InvalidArgumentError(f"{name} with directions per point on a method: build the operator over the "
                                       f"bound method instead (self.op = {name}(self.u, ...) in __init__)")
        self.name, self.u, self.wrt, self.batch_dim = name, u, wrt, batch_dim
        self.given, self.columns, self._make, self.higher = given, columns, make, tuple(higher)
        self.operator = None  # the last call's
        self._operators: dict[int, tuple] = {}  # (operator, finish) by the number of directions

    def seeds(self, x: torch.Tensor) -> torch.Tensor:
        """This call's directions as rows, ``(B, S, *x)`` (``(S, *x)`` without samples), and the
        curves' higher coefficients after them along a new axis after the samples' (``(B, K, S,
        *x)``: the samples lead, so that one program serves every number of them)."""
        given = [(self.given, "directions" if not self.columns else "factor", self.columns)]
        given += [(h, f"higher[{k}] (V_{k + 2})", False) for k, h in enumerate(self.higher)]
        made = [self._rows(g, x, what, columns) for g, what, columns in given]
        self._check_finite([(raw, what) for (raw, _), (_, what, _) in zip(made, given)])
        rows, more = made[0][1], [m for _, m in made[1:]]
        if not self.higher:
            return rows
        for k, h in enumerate(more):
            if h.shape != rows.shape:
                raise InvalidArgumentError(f"{self.name}: higher[{k}] (V_{k + 2}) has shape {tuple(h.shape)}, and "
                                           f"the directions {tuple(rows.shape)}: one coefficient per direction")
        return torch.stack([rows, *more], dim=1 if self.batch_dim is not None else 0)

    def _check_finite(self, given: list[tuple[torch.Tensor, str]]) -> None:
        """Refuse NaN or infinite entries in any of the call's direction tensors, as given (before a
        shared one is spread over the samples): one host sync for all of them. Inside a function hoad
        is tracing (a loss compiled into one training step) or inside torch.func.vmap there are no
        values to look at: the program reads the directions at each of its calls, and NaN in them
        gives NaN out."""
        if values_hidden():
            return
        flags = [torch.isfinite(t.detach()).all() if t.device.type != "meta" else None for t, _ in given]
        if any(f is None for f in flags) or not bool(flags[0] if len(flags) == 1 else torch.stack(flags).all()):
            what = next(w for (_, w), f in zip(given, flags) if f is None or not bool(f))
            raise InvalidArgumentError(f"{self.name}: the {what} have entries that are NaN or infinite")

    def _rows(self, given, x: torch.Tensor, what: str, columns: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensor ``given`` is or returns, and its rows for this call."""
        v = raw = given(x) if callable(given) and not isinstance(given, torch.Tensor) else given
        batched = self.batch_dim is not None
        point = tuple(x.shape[1:]) if batched else tuple(x.shape)
        d = math.prod(point)
        lead = (x.shape[0],) if batched else ()
        want = f"({', '.join(map(str, lead + (d,)))}, S)" if columns else \
            f"({', '.join(map(str, lead + ('S',) + point))})"
        if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
            got = f"a {v.dtype} tensor" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"
            raise InvalidArgumentError(f"{self.name}: {what} must be a floating-point tensor {want}, got {got}")
        if columns:
            if tuple(v.shape[:-1]) != lead + (d,) or v.shape[-1] == 0:
                raise InvalidArgumentError(f"{self.name}: {what} per point must be {want} for points of shape "
                                           f"{tuple(x.shape)}, got {tuple(v.shape)}")
            v = v.movedim(-1, len(lead)).reshape(*lead, v.shape[-1], *point)
        else:
            if lead and v.ndim == 1 + len(point) and tuple(v.shape[1:]) == point:  # shared by every sample
                v = v.expand(*lead, *v.shape)
            if tuple(v.shape[:len(lead)]) != lead or tuple(v.shape[len(lead) + 1:]) != point or \
                    v.ndim != len(lead) + 1 + len(point) or v.shape[len(lead)] == 0:
                raise InvalidArgumentError(f"{self.name}: {what} must be {want} for points of shape "
                                           f"{tuple(x.shape)}, got {tuple(v.shape)}")
        return raw, v.to(dtype=x.dtype, device=x.device)

    def _shifted(self, *args, hoad_t: torch.Tensor, hoad_seeds: torch.Tensor, **kwargs):
        """u at x + Σ_s t_s v_s (curves: + Σ_s Σ_k t_sᵏ/k! V_k,s)."""
        x = _point_of(self.u, self.wrt, args, kwargs)
        lead, count = hoad_t.shape[:-1], hoad_t.shape[-1]
        if self.higher and lead:  # (B, K, S, *x): the coefficients' axis first
            hoad_seeds = hoad_seeds.movedim(len(lead), 0)
        rows = hoad_seeds.reshape(-1, *lead, count, math.prod(x.shape[len(lead):]))
        power, step = hoad_t, 0
        for k in range(rows.shape[0]):  # t, t²/2, t³/6, ...
            step = step + (power.unsqueeze(-1) * rows[k]).sum(-2)
            power = power * hoad_t / (k + 2)
        moved = x + step.reshape(x.shape)
        args, kwargs = _with_point(self.u, self.wrt, args, kwargs, moved)
        return self.u(*args, **kwargs)

    @torch._dynamo.disable(reason=GRAPH_BREAK)  # (a graph break under torch.compile, as hoad.compile's call)
    def __call__(self, *args, **kwargs):
        x = _point_of(self.u, self.wrt, args, kwargs)
        v = self.seeds(x)
        lead = (x.shape[0],) if self.batch_dim is not None else ()
        count = v.shape[len(lead) + (1 if self.higher else 0)]
        made = self._operators.get(count)
        if made is None:  # (calls alternating between counts each keep their program)
            # its tensors outlive this call: made outside inference mode (see Resampled.resample) and
            # outside a trace that calls it (a loss compiled into one training step), as real tensors
            with torch.inference_mode(False), \
                    (_disable_current_modes() if get_proxy_mode() is not None else contextlib.nullcontext()):
                made = self._make(self._shifted, count)
            made[0].compiled.sample_places = self._sample_places
            made = self._operators.setdefault(count, made)  # (another thread's, if it came first)
        operator, finish = made
        self.operator = operator
        t = torch.zeros((*lead, count), dtype=x.dtype, device=x.device)
        return finish(operator(*args, **kwargs, **{SHIFT: t, SEEDS: v}))

    def _sample_places(self, args: tuple, kwargs: dict) -> list[Positional | Keyword]:
        """Besides the shift it differentiates, what holds the samples in a call of the operator:
        the points and their seeds (``chunk_size`` splits them together)."""
        if self.batch_dim is None:
            return []
        if _holder(self.u, self.wrt, kwargs) is not None:
            raise InvalidArgumentError(
                f"chunk_size splits tensor arguments along dim 0, and the operator's input {self.wrt!r} is inside a "
                "container argument: pass the points as a tensor argument of their own, or drop chunk_size")
        return [_point_place(self.u, self.wrt, args, kwargs), Keyword(SEEDS)]

    @property
    def graph(self):
        if self.operator is None:
            raise InvalidArgumentError("call the operator once before asking for its graph")
        return self.operator.graph

    def explain(self, *args, **kwargs):
        if self.operator is None:
            raise InvalidArgumentError("call the operator once before asking for its explanation")
        return self.operator.explain()

    def __repr__(self) -> str:
        name = getattr(self.u, "__qualname__", type(self.u).__name__).split("<locals>.")[-1]
        what = "curves" if self.higher else "a factor per point" if self.columns else "directions per point"
        return f"<{self.name}({name}) along {what}>" if self.higher else f"<{self.name}({name}) with {what}>"


def per_point(given, batch_dim, columns: bool) -> bool:
    """Whether ``directions=`` (rows) or ``factor=`` (columns) are given point by point: a function
    of the points, or under ``batch_dim`` a factor ``(B, D, S)`` (a shared one is ``(D, S)``).
    Directions per sample come from a function (a shared ``(S, *x)`` and a per-sample
    ``(B, S, *x)`` cannot be told apart for points of several axes)."""
    if callable(given) and not isinstance(given, torch.Tensor):
        return True
    return columns and isinstance(given, torch.Tensor) and batch_dim is not None and given.ndim == 3
