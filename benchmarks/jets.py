"""Issue 44: Taylor jets and randomized operators of the torch-jet paper's network, against
torch-jet (eager and torch.compile'd) and folx.

Per point x_n of a batch X (N, D) of a tanh MLP u: R^D -> R:

- ``general``: the 4-jet along each of S curves x(t) = x + t v_s + Σ_k tᵏ/k! V_k,s (k = 2..4):
  dᵏ/dtᵏ u(x(t)) at t = 0 for k = 1..4, each (N, S) (hoad ``taylor(u, order=4, directions=V,
  higher=(V2, V3, V4))``, torch-jet ``jet.jet`` vmapped over the curves);
- ``collapsed``: the same with the top order summed over the curves, (N,) (hoad ``collapse=True``,
  torch-jet's collapsed jet: ``jet.jet(..., collapsed=True)`` on 1.0.0, the vmapped jet whose sum
  ``jet.simplify`` pulls through the graph on its earlier trees, the paper's recipe);
- ``random-laplacian``: (1/S) Σ_s v_sᵀ ∇²u v_s over S normal directions;
- ``random-biharmonic``: torch-jet's estimate of Δ²u, (1/(3S)) Σ_s ∂⁴u[v_s, v_s, v_s, v_s]
  (hoad ``estimator="gaussian"``).

The jets' directions and coefficients are fixed (drawn once, seed 3): every contender computes
the same numbers, checked against nested ``torch.func.jacfwd`` in t in float64.

The randomized operators are checked and timed in two parts. The checked first call uses the
same fixed directions V in every contender (hoad ``directions=V``, torch-jet ``weighting=`` with
Vᵀ/√S for the Laplacian and its collapsed 4-jet along V for the biharmonic, folx the change of
variables y -> u(x + Vᵀy/√S)), against torch.func in float64. What is timed is each contender's
resampling variant, new directions drawn inside every call: hoad ``randomization=("normal", S)``
with a seeded generator (one draw per call, shared by the points), torch-jet its own
``randomization=("normal", S)`` vmapped with ``randomness="different"`` (a draw per point, as its
paper times it), folx ``jax.random.normal`` inside the jitted program (one draw per call). A
resampling variant is only timed after two calls of it gave finite results of the right shape
that differ from each other (new directions were drawn); its values are not compared, since
every library draws differently. folx has no fourth-order operator, so the biharmonic rows have
no folx column.

The sizes follow the torch-jet paper's figures (its jet/exp/exp01_benchmark_laplacian), cut to
one CPU thread: the network 768-768-512-512-1 on D = 50 for the Laplacian (the paper: 2048
points, S from 1 to 50; here 64 points, S = 6 and 50) and on D = 5 for the biharmonic (the paper:
256 points, S from 1 to 36; here 16 points, S = 4 and 36).

torch-jet: the operator columns (:mod:`benchmarks.operators`) use the 1.0.0 API (``jet.jet(f,
(x0,))`` with tuples of coefficients); :class:`JetAPI` serves that API and the one of its
repository's trees before it (``jet.jet(f, K, x0)`` as a graph module, ``jet.simplify``), so the
columns run with either. Measured in the commit that introduced them with torch-jet's tree
f3db443 (2026-02-27, installed from its repository as 0.0.2.dev0+gf3db443): 1.0.0 was not
installable there.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.operators import (
    DT,
    PAPER_MLP,
    TanhNet,
    Way,
    _from_jax,
    _jax_mlp,
    _same,
    chosen_mode,
    draw_net,
    load_jet,
)

KINDS = ("general", "collapsed", "random-laplacian", "random-biharmonic")
ORDER = 4  # of the jets


# ----------------------------------------------------------------------------------- problems
@dataclass
class JetProblem:
    """One jet or randomized operator of ``net`` at every row of X, along V (S, D); ``higher``
    holds the curves' coefficients V_2..V_4 (the jets) and is empty for the operators."""

    kind: str
    net: TanhNet
    X: torch.Tensor
    V: torch.Tensor
    higher: tuple[torch.Tensor, ...] = ()
    operator: str = field(init=False)

    def __post_init__(self):
        self.operator = self.kind

    @property
    def S(self) -> int:
        return self.V.shape[0]

    @property
    def key(self) -> str:
        return {"random-laplacian": "laplacian", "random-biharmonic": "biharmonic"}.get(self.kind, "jet")

    @property
    def scaled_V(self) -> torch.Tensor:
        return self.V / math.sqrt(self.S)

    def record(self) -> dict:
        return {"operator": self.kind, "sizes": list(self.net.sizes), "points": self.X.shape[0],
                "directions": self.S, "order": ORDER if self.key == "jet" else None, "dtype": str(self.X.dtype),
                "device": str(self.X.device)}

    def jet_answer(self, coefficients) -> dict[str, torch.Tensor]:
        """{"f1": ..., "f4": ...} from the derivatives of orders 1..4 (f4 (N,) when collapsed)."""
        return {f"f{k}": c for k, c in enumerate(coefficients, 1)}

    def reference(self) -> dict[str, torch.Tensor]:
        """Nested torch.func.jacfwd in t of u(x(t)), per point and direction, in float64."""
        if self.kind == "random-laplacian":
            second = _along_curves(self, zeros=True, orders=2)[1]
            return {"laplacian": second.sum(-1) / self.S}
        if self.kind == "random-biharmonic":
            fourth = _along_curves(self, zeros=True, orders=4)[3]
            return {"biharmonic": fourth.sum(-1) / (3 * self.S)}
        out = list(_along_curves(self, zeros=False, orders=ORDER))
        if self.kind == "collapsed":
            out[-1] = out[-1].sum(-1)
        return self.jet_answer(out)

    def ways(self) -> list[Way]:
        out = [Way("hoad", f"{_hoad_call(self)}, inductor", lambda: _hoad(self, "inductor")),
               Way("hoad eager", f"{_hoad_call(self)}, eager", lambda: _hoad(self, "eager")),
               Way("torch-jet", _jet_label(self), lambda: _jet(self, compiled=False), needs=("jet-for-pytorch",)),
               Way("torch-jet compiled", f"torch.compile({_jet_label(self)})", lambda: _jet(self, compiled=True),
                   needs=("jet-for-pytorch",), worker=True)]
        if self.kind == "random-laplacian":
            out.append(Way("folx", "jit(vmap(forward_laplacian of y -> u(x + Vᵀy/√S))), V = jax.random.normal "
                           "in the program", lambda: _folx(self), needs=("jax", "folx")))
        return out


def jet_problem(kind: str, sizes: tuple[int, ...], points: int, directions: int) -> Callable[..., JetProblem]:
    """The builder of one workload of :func:`workloads` (see :mod:`benchmarks.workloads`)."""
    assert kind in KINDS, kind

    def build(device: str = "cpu", dtype: torch.dtype = DT) -> JetProblem:
        D = sizes[0]
        net = draw_net(sizes, device, dtype)
        g = torch.Generator().manual_seed(1)
        X = torch.rand(points, D, generator=g, dtype=DT)  # points in the unit cube
        g = torch.Generator().manual_seed(3)
        count = 1 if kind.startswith("random") else ORDER
        V, *higher = [torch.randn(directions, D, generator=g, dtype=DT) for _ in range(count)]
        on = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
        return JetProblem(kind, net, on(X), on(V), tuple(on(h) for h in higher))

    return build


def _along_curves(p: JetProblem, zeros: bool, orders: int) -> tuple[torch.Tensor, ...]:
    """dᵏ/dtᵏ u(x + t v + Σ_k tᵏ/k! V_k) at t = 0, k = 1..``orders``, each (N, S); along the lines
    x + t v when ``zeros``."""
    d = torch.func.jacfwd
    t0 = torch.zeros((), dtype=p.X.dtype, device=p.X.device)
    higher = [torch.zeros_like(p.V)] * (ORDER - 1) if zeros else list(p.higher)

    def one(x, v, v2, v3, v4):
        def g(t):
            return p.net.u(x + t * v + t ** 2 / 2 * v2 + t ** 3 / 6 * v3 + t ** 4 / 24 * v4)

        out, f = [], g
        for _ in range(orders):
            f = d(f)
            out.append(f(t0))
        return tuple(out)

    per_point = torch.func.vmap(one, in_dims=(None, 0, 0, 0, 0), out_dims=-1)  # (S,) each
    return torch.func.vmap(per_point, in_dims=(0, None, None, None, None))(p.X, p.V, *higher)


# ----------------------------------------------------------------------------------------- hoad
def _hoad_call(p: JetProblem) -> str:
    S = p.S
    return {"general": f"hoad.taylor(u, order=4, directions=V ({S}, D), higher=(V2, V3, V4), batch_dim=0)",
            "collapsed": f"hoad.taylor(u, order=4, directions=V ({S}, D), higher=(V2, V3, V4), collapse=True, "
                         "batch_dim=0)",
            "random-laplacian": f"hoad.laplacian(u, batch_dim=0, randomization=('normal', {S}), generator=g) "
                                "[checked: directions=V]",
            "random-biharmonic": f"hoad.biharmonic(u, batch_dim=0, randomization=('normal', {S}), "
                                 "estimator='gaussian', generator=g) [checked: directions=V]"}[p.kind]


def _program(op):
    """The hoad.compile program under an operator, once it has been called (None before)."""
    for name in ("operator", "outer", "fourth"):  # randomized / per point, then the biharmonic's parts
        inner = getattr(op, name, None)
        if inner is not None:
            return _program(inner)
    return getattr(op, "compiled", None)


def _with_chosen(answer: Callable[[], dict], op) -> Callable[[], dict]:
    """``answer`` that says, once called, the direction hoad's cost model chose for ``op``."""

    def chosen() -> str:
        program = _program(op)
        return chosen_mode(program) if program is not None else "auto"

    answer.chosen = chosen
    return answer


def _hoad(p: JetProblem, backend: str) -> tuple[Callable[[], dict], Callable[[], object]]:
    import hoad

    u = lambda x: p.net.u(x)  # noqa: E731 - (hoad refuses a bound method when the curves go point by point)
    if p.key == "jet":
        op = hoad.taylor(u, order=ORDER, directions=p.V, higher=p.higher, batch_dim=0,
                         collapse=p.kind == "collapsed", backend=backend)

        def answer():
            res = op(p.X)
            return p.jet_answer([res[k] for k in range(1, ORDER + 1)])

        return _same(_with_chosen(answer, op))
    g = torch.Generator(device=p.X.device).manual_seed(0)
    if p.kind == "random-laplacian":
        fixed = hoad.laplacian(u, batch_dim=0, directions=p.V, backend=backend)
        drawn = hoad.laplacian(u, batch_dim=0, randomization=("normal", p.S), generator=g, backend=backend)
        answer, timed = (lambda: {"laplacian": fixed(p.X).laplacian}), (lambda: drawn(p.X).laplacian)
    else:
        kwargs = dict(batch_dim=0, estimator="gaussian", backend=backend)
        fixed = hoad.biharmonic(u, directions=p.V, **kwargs)
        drawn = hoad.biharmonic(u, randomization=("normal", p.S), generator=g, **kwargs)
        answer, timed = (lambda: {"biharmonic": fixed(p.X).biharmonic}), (lambda: drawn(p.X).biharmonic)
    return _with_chosen(answer, fixed), resampling(p, timed)


def resampling(p: JetProblem, timed: Callable[[], object]) -> Callable[[], object]:
    """``timed``, once two calls of it gave finite (N,) results that differ (new directions)."""
    first, second = (torch.as_tensor(_to_torch(timed())) for _ in range(2))
    N = p.X.shape[0]
    for got in (first, second):
        if tuple(got.shape) != (N,) or not torch.isfinite(got).all():
            raise RuntimeError(f"the resampling variant gave {tuple(got.shape)} (finite: "
                               f"{bool(torch.isfinite(got).all())}), expected finite ({N},)")
    if torch.equal(first, second):
        raise RuntimeError("the resampling variant gave the same values twice: it drew no new directions")
    return timed


def _to_torch(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    import numpy as np

    return torch.from_numpy(np.array(out))


# ------------------------------------------------------------------------------------ torch-jet
class JetAPI:
    """torch-jet's calls in the API of the installed version: 1.0.0's (``jet.jet(f, (x0,),
    collapsed=)`` called with ``(x, c_1, ..., c_K)``; operators return their value) or that of its
    trees before (``jet.jet(f, K, x0)`` a graph module called with ``x, c_1, ..., c_K``; the
    Laplacian returns ``(f, ∂f, Δf)``; collapsing is ``jet.simplify`` pulling the sum of the
    vmapped jets through the graph)."""

    def __init__(self):
        self.jet = load_jet()
        self.tuples = "mock_args" in inspect.signature(self.jet.jet).parameters  # 1.0.0

    def graph(self, fn: Callable, x0: torch.Tensor) -> torch.fx.GraphModule:
        """``fn`` (one point -> tensors) as one FX graph, common subexpressions eliminated (and,
        before 1.0.0, sums pulled through: the collapse)."""
        if self.tuples:
            graph, _ = self.jet.capture_graph(fn, (x0,))
            self.jet.common_subexpression_elimination(graph.graph)
            graph.recompile()
            return graph
        from jet.simplify import simplify

        return simplify(fn, x0)

    def jets(self, u: Callable, x0: torch.Tensor, coefficients: list[torch.Tensor], collapsed: bool) -> Callable:
        """x -> (f_1, ..., f_K) along the S curves whose coefficients are ``coefficients`` (each
        (S, D)); f_K summed over them when ``collapsed``."""
        if self.tuples and collapsed:
            cjet = self.jet.jet(u, (x0,), collapsed=True)
            top = coefficients[-1].sum(0)
            return lambda x: tuple(cjet((x, *coefficients[:-1], top))[1:])
        if self.tuples:
            plain = self.jet.jet(u, (x0,))
            one = lambda x, *c: plain((x, *c))  # noqa: E731
        else:
            one = self.jet.jet(u, len(coefficients), x0)
        along = torch.func.vmap(one, in_dims=(None, *[0] * len(coefficients)),
                                out_dims=(None, *[0] * len(coefficients)))

        def per_point(x):
            out = along(x, *coefficients)[1:]
            return out[:-1] + (out[-1].sum(0),) if collapsed else out

        return per_point

    def laplacian(self, u: Callable, x0: torch.Tensor, **kwargs) -> Callable:
        if self.tuples:
            return self.jet.laplacian(u, (x0,), **kwargs)
        from jet.laplacian import laplacian

        lap = laplacian(u, x0, **kwargs)
        return lambda x: lap(x)[2]

    def bilaplacian(self, u: Callable, x0: torch.Tensor, **kwargs) -> Callable:
        if self.tuples:
            return self.jet.bilaplacian(u, (x0,), **kwargs)
        from jet.bilaplacian import bilaplacian

        return bilaplacian(u, x0, **kwargs)


def _jet_label(p: JetProblem) -> str:
    S = p.S
    return {"general": f"vmap(jet.jet(u) along {S} curves)",
            "collapsed": f"vmap(collapsed jet.jet(u) along {S} curves)",
            "random-laplacian": f"vmap(jet.laplacian(u, randomization=('normal', {S})), randomness='different') "
                                "[checked: weighting=(Vᵀ/√S, S)]",
            "random-biharmonic": f"vmap(jet.bilaplacian(u, randomization=('normal', {S})), randomness='different') "
                                 "[checked: collapsed 4-jet along V / 3S]"}[p.kind]


def _jet(p: JetProblem, compiled: bool) -> tuple[Callable[[], dict], Callable[[], object]]:
    api = JetAPI()
    x0 = torch.zeros_like(p.X[0])
    u = lambda x: p.net.u(x)  # noqa: E731 - (torch-jet's trees before 1.0.0 cannot trace a bound method)

    def batched(fn: Callable, randomness: str = "error") -> Callable:
        out = torch.func.vmap(api.graph(fn, x0), randomness=randomness)
        return torch.compile(out) if compiled else out

    if p.key == "jet":
        jets = batched(api.jets(u, x0, [p.V, *p.higher], collapsed=p.kind == "collapsed"))
        return _same(lambda: p.jet_answer(jets(p.X)))
    if p.kind == "random-laplacian":
        V = p.scaled_V

        def apply_factor(x, M):  # M (K, S) -> M (Vᵀ/√S)ᵀ, (K, D)
            return (M @ V).reshape(M.shape[0], *x.shape)

        fixed = batched(api.laplacian(u, x0, weighting=(apply_factor, p.S)))
        drawn = batched(api.laplacian(u, x0, randomization=("normal", p.S)), randomness="different")
        return (lambda: {"laplacian": fixed(p.X)}), resampling(p, lambda: drawn(p.X))
    zeros = torch.zeros_like(p.V)
    fourth = api.jets(u, x0, [p.V, zeros, zeros, zeros], collapsed=True)
    fixed = batched(lambda x: fourth(x)[-1] / (3 * p.S))
    drawn = batched(api.bilaplacian(u, x0, randomization=("normal", p.S)), randomness="different")
    return (lambda: {"biharmonic": fixed(p.X)}), resampling(p, lambda: drawn(p.X))


# ----------------------------------------------------------------------------------------- folx
def _folx(p: JetProblem) -> tuple[Callable[[], dict], Callable[[], object]]:
    """folx's forward Laplacian of y -> u(x + Vᵀy/√S) at y = 0: with the fixed V (checked), and
    with V drawn by jax.random inside the jitted program from a key it also advances (timed)."""
    import folx
    import jax
    import jax.numpy as jnp

    params = p.net.to_jax()
    X = jnp.asarray(p.X.detach().cpu().numpy())
    S, D = p.V.shape

    def operator(X, M):  # M (S, D): the directions, scaled
        def one(x):
            y0 = jnp.zeros(S, dtype=X.dtype)
            return folx.forward_laplacian(lambda y: _jax_mlp(params, x + y @ M), sparsity_threshold=0)(y0).laplacian

        return jax.vmap(one)(X)

    fixed = jax.jit(operator)
    M = jnp.asarray(p.scaled_V.detach().cpu().numpy())

    @jax.jit
    def drawn(X, key):
        key, draw = jax.random.split(key)
        return operator(X, jax.random.normal(draw, (S, D), dtype=X.dtype) / math.sqrt(S)), key

    state = {"key": jax.random.PRNGKey(0)}

    def timed():
        out, state["key"] = drawn(X, state["key"])
        return out.block_until_ready()

    return (lambda: _from_jax({"laplacian": fixed(X, M).block_until_ready()})), resampling(p, timed)


# ------------------------------------------------------------------------------------ workloads
LAPLACIAN_SAMPLES = (6, 50)  # of the paper's 1, 6, 11, ..., 50 (D = 50)
BIHARMONIC_SAMPLES = (4, 36)  # of the paper's 1, 4, 8, ..., 36 (D = 5)


# points of the jets, the Laplacian and the biharmonic: cut to one CPU thread, and on a GPU those
# of the paper's figures (2048 for the Laplacian, 256 for the biharmonic; 256 for the jets)
CPU_POINTS = (16, 64, 16)
GPU_POINTS = (256, 2048, 256)


def workloads(Workload, group: str = "9. Taylor jets and randomized operators, torch-jet paper's network (issue 44)",
              prefix: str = "", points: tuple[int, int, int] = CPU_POINTS) -> list:
    """Issue 44's rows; none in --quick (an order-4 program of the paper's network takes a while
    to build, and its torch.func reference longer). ``prefix`` and ``points`` make the GPU-sized
    ones (``"cuda/"``, :data:`GPU_POINTS`)."""
    net = "-".join(map(str, PAPER_MLP))
    small = (5, *PAPER_MLP[1:])
    small_net = "-".join(map(str, small))
    (N, n_lap, n_bih), S = points, 4
    rows = [  # (id, label, kind, sizes, points, directions)
        (f"taylor/general-4jet/{net}/N{N}-S{S}", f"general 4-jets along {S} curves, {net}, {N} points",
         "general", PAPER_MLP, N, S),
        (f"taylor/collapsed-4jet/{net}/N{N}-S{S}", f"collapsed 4-jets along {S} curves, {net}, {N} points",
         "collapsed", PAPER_MLP, N, S),
        *((f"laplacian/randomized-S{s}/{net}/N{n_lap}", f"randomized Laplacian, {s} normal directions per call, "
           f"{net}, {n_lap} points", "random-laplacian", PAPER_MLP, n_lap, s) for s in LAPLACIAN_SAMPLES),
        *((f"biharmonic/randomized-S{s}/{small_net}/N{n_bih}", f"randomized biharmonic (Gaussian), {s} directions "
           f"per call, {small_net}, {n_bih} points", "random-biharmonic", small, n_bih, s) for s in BIHARMONIC_SAMPLES),
    ]
    return [Workload(prefix + id_, group, label, jet_problem(kind, sizes, points, directions))
            for id_, label, kind, sizes, points, directions in rows]
