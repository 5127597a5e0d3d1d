"""Differential operators and training steps of tanh MLPs, and every library's way to compute them.

Issue 16 (operators), per point of a batch X (N, D) of a network u: R^D -> R:

- ``laplacian``: Δu = tr ∇²u;
- ``weighted``: tr(C ∇²u) for a fixed symmetric positive definite C (every peer takes it as
  C = L Lᵀ in one pass: torch-jet's ``weighting=``, folx through the change of variables
  y -> u(x + L y); hoad takes C itself, ``weights=C``);
- ``stochastic``: (1/S) Σ_s v_sᵀ ∇²u v_s over fixed directions V (S, D): no contender draws its
  own, so every one computes the same number (hoad ``directions=V``, torch-jet ``weighting=`` with
  the rows of V / √S, folx the change of variables y -> u(x + Vᵀ y / √S));
- ``biharmonic``: Δ²u = Δ(Δu), and ``stochastic-biharmonic``: Δ_V(Δ_V u) with Δ_V the stochastic
  Laplacian over the same V.

Issue 15 (training): one step of the residual loss mean_n (Δu(x_n) + f_n)² and its gradient with
respect to every parameter of u.

A problem's *answer* is a dict: ``{"laplacian": (N,)}`` or ``{"biharmonic": (N,)}`` for an
operator, ``{"loss": (), "W1": ∂loss/∂W1, ...}`` for a training step; the reference is torch.func
in float64. The networks, points, C, V and f are drawn on the CPU in float64 from fixed seeds and
then moved to the device and dtype of the run, so every contender and every device sees the same
numbers.

:func:`ways` lists, per problem, how each column computes it (:class:`Way`); the same builders
serve the in-process contenders (:mod:`benchmarks.peers`), the torch.compile workers
(:mod:`benchmarks.worker`) and the memory measurement of a training step (:mod:`benchmarks.fresh`).
Optional peers are imported only when a column is built: a missing one is reported ``n/a``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from unittest import mock

import torch

DT = torch.float64
OPERATORS = ("laplacian", "weighted", "stochastic", "biharmonic", "stochastic-biharmonic")
DIRECTIONS = 8  # S, the directions of the stochastic operators
PAPER_MLP = (50, 768, 768, 512, 512, 1)  # the torch-jet paper's network


# ----------------------------------------------------------------------------------- network
@dataclass
class TanhNet:
    """u(x) = W_L tanh(... tanh(x W_1 + b_1) ...) + b_L, on one point (D,) -> () or a batch (N, D) -> (N,)."""

    sizes: tuple[int, ...]
    params: list[torch.Tensor]  # W1 (fan_in, fan_out), b1, W2, b2, ...

    @property
    def names(self) -> list[str]:
        return [f"{kind}{k}" for k in range(1, len(self.sizes)) for kind in ("W", "b")]

    def u(self, x: torch.Tensor) -> torch.Tensor:
        return tanh_mlp(self.params, x)

    def trainable(self) -> list[torch.Tensor]:
        """A copy of the parameters as leaves that require grad (one per training contender)."""
        return [p.detach().clone().requires_grad_() for p in self.params]

    def to_jax(self) -> list:
        import jax.numpy as jnp

        return [jnp.asarray(p.detach().cpu().numpy()) for p in self.params]


def tanh_mlp(params, x, tanh=torch.tanh):
    """The network as a function of its parameters (torch, or JAX with ``tanh=jnp.tanh``)."""
    h = x
    for W, b in zip(params[0:-2:2], params[1:-2:2]):
        h = tanh(h @ W + b)
    return (h @ params[-2] + params[-1]).squeeze(-1)


def _jax_mlp(params, x):
    import jax.numpy as jnp

    return tanh_mlp(params, x, tanh=jnp.tanh)


def draw_net(sizes: tuple[int, ...], device: str, dtype: torch.dtype) -> TanhNet:
    """nn.Linear's initialisation (uniform in ±1/√fan_in), seed 0, drawn in float64 on the CPU."""
    g = torch.Generator().manual_seed(0)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        bound = fan_in ** -0.5
        params += [(torch.rand(fan_in, fan_out, generator=g, dtype=DT) * 2 - 1) * bound,
                   (torch.rand(fan_out, generator=g, dtype=DT) * 2 - 1) * bound]
    return TanhNet(tuple(sizes), [p.to(device=device, dtype=dtype) for p in params])


def _draw(seed: int, *shape: int, normal: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=DT) if normal else torch.rand(*shape, generator=g, dtype=DT)


# ----------------------------------------------------------------------------------- problems
@dataclass
class OperatorProblem:
    """One operator of ``net`` at every row of X; C for ``weighted``, V for the stochastic ones."""

    operator: str
    net: TanhNet
    X: torch.Tensor
    C: torch.Tensor | None = None  # (D, D) symmetric positive definite
    V: torch.Tensor | None = None  # (S, D)

    @property
    def key(self) -> str:
        return "biharmonic" if self.operator.endswith("biharmonic") else "laplacian"

    @property
    def L(self) -> torch.Tensor:
        """C = L Lᵀ (Cholesky): the factor the peers that take C = S Sᵀ are given."""
        return torch.linalg.cholesky(self.C)

    @property
    def scaled_V(self) -> torch.Tensor:
        """V / √S: Σ_s (v_s/√S)ᵀ ∇²u (v_s/√S) is the stochastic Laplacian as a plain sum."""
        return self.V / math.sqrt(self.V.shape[0])

    def record(self) -> dict:
        return {"operator": self.operator, "sizes": list(self.net.sizes), "points": self.X.shape[0],
                "directions": None if self.V is None else self.V.shape[0], "dtype": str(self.X.dtype),
                "device": str(self.X.device)}

    def reference(self) -> dict[str, torch.Tensor]:
        return _answer_of(TORCH_FUNC, self)()


def operator_problem(operator: str, sizes: tuple[int, ...], points: int) -> Callable[..., OperatorProblem]:
    """The builder of one operator workload (see :mod:`benchmarks.workloads`)."""
    assert operator in OPERATORS, operator

    def build(device: str = "cpu", dtype: torch.dtype = DT) -> OperatorProblem:
        D = sizes[0]
        net = draw_net(sizes, device, dtype)
        X = _draw(1, points, D, normal=False)  # points in the unit cube
        C = V = None
        if operator == "weighted":
            B = _draw(2, D, D) / math.sqrt(D)
            C = B @ B.T + 0.1 * torch.eye(D, dtype=DT)  # symmetric positive definite, full rank
            C = (C + C.T) / 2
        if operator.startswith("stochastic"):
            V = _draw(3, DIRECTIONS, D)
        on = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
        return OperatorProblem(operator, net, on(X), on(C), on(V))

    return build


@dataclass
class TrainProblem:
    """One training step: loss = mean_n (Δu(x_n) + f_n)², and ∂loss/∂θ for every parameter θ of u."""

    net: TanhNet
    X: torch.Tensor
    f: torch.Tensor
    operator: str = field(default="train", init=False)

    def record(self) -> dict:
        return {"operator": "train", "sizes": list(self.net.sizes), "points": self.X.shape[0],
                "parameters": sum(p.numel() for p in self.net.params), "dtype": str(self.X.dtype),
                "device": str(self.X.device)}

    def reference(self) -> dict[str, torch.Tensor]:
        return _train_answer_of_func(self, compiled=False)[0]()

    def answer(self, loss: torch.Tensor, grads) -> dict[str, torch.Tensor]:
        return {"loss": loss.detach(), **dict(zip(self.net.names, grads))}


def train_problem(sizes: tuple[int, ...], points: int) -> Callable[..., TrainProblem]:
    def build(device: str = "cpu", dtype: torch.dtype = DT) -> TrainProblem:
        net = draw_net(sizes, device, dtype)
        X = _draw(1, points, sizes[0], normal=False)
        f = _draw(4, points)
        return TrainProblem(net, X.to(device=device, dtype=dtype), f.to(device=device, dtype=dtype))

    return build


# ----------------------------------------------------------------------------------- the ways
@dataclass
class Way:
    """One column's way to compute a problem. ``build()`` does the set-up (trace, capture, compile
    preparations: it is part of the first call's time) and returns ``(answer, timed)``: ``answer()``
    is a dict of torch tensors checked against the reference, ``timed()`` the same work as timed
    (for JAX without the conversion to torch). An ``answer`` with a ``chosen()`` attribute says,
    after its first call, what it chose (hoad: the direction of ``mode="auto"``)."""

    name: str
    config: str
    build: Callable[[], tuple[Callable[[], dict], Callable[[], object]]]
    needs: tuple[str, ...] = ()  # distributions whose absence makes the column n/a
    worker: bool = False  # torch.compile: built and timed in a worker process of its own
    full_only: bool = False  # left out of --quick
    bound: bool = False  # not a contender but a reference cost (FLOOR): its answer is not checked


def ways(p: OperatorProblem | TrainProblem) -> list[Way]:
    """Every column of ``p``, in table order (a problem with its own columns lists them)."""
    if hasattr(p, "ways"):
        return p.ways()
    return train_ways(p) if isinstance(p, TrainProblem) else operator_ways(p)


def way(p, name: str) -> Way:
    for w in ways(p):
        if w.name == name:
            return w
    raise KeyError(f"no contender {name!r} for {type(p).__name__} {p.operator!r}")


def _same(thunk: Callable[[], dict]) -> tuple[Callable[[], dict], Callable[[], dict]]:
    return thunk, thunk


def _from_jax(out: dict) -> dict[str, torch.Tensor]:
    import numpy as np

    return {k: torch.from_numpy(np.array(v)) for k, v in out.items()}


# -------------------------------------------------------------------- second-order contractions
@dataclass(frozen=True)
class Library:
    """What the torch.func and JAX formulas need from their library."""

    hessian: Callable
    vmap: Callable
    mlp: Callable  # (params, x) -> u


TORCH_FUNC = Library(torch.func.hessian, torch.func.vmap, tanh_mlp)


def _jax_library() -> Library:
    import jax

    return Library(jax.hessian, jax.vmap, _jax_mlp)


def _contract(p: OperatorProblem, lib: Library, C, V) -> Callable[[Callable], Callable]:
    """f -> (x -> the operator's second-order contraction of f's Hessian at one point x), in plain
    products and sums (torch.compile of nested torch.func fails on einsum's fake-tensor call)."""
    S = None if V is None else V.shape[0]
    if p.operator == "weighted":
        return lambda f: lambda x: (C * lib.hessian(f)(x)).sum()
    if p.operator.startswith("stochastic"):
        return lambda f: lambda x: ((V @ lib.hessian(f)(x)) * V).sum() / S
    return lambda f: lambda x: lib.hessian(f)(x).diagonal().sum()


def _per_point(p: OperatorProblem, lib: Library, params, C, V) -> Callable:
    """x -> the operator at one point, by nested Hessians of ``lib`` (twice for the biharmonic)."""
    contract = _contract(p, lib, C, V)
    once = contract(lambda x: lib.mlp(params, x))
    return contract(once) if p.key == "biharmonic" else once


def _answer_of(lib: Library, p: OperatorProblem, compiled: bool = False) -> Callable[[], dict]:
    batched = lib.vmap(_per_point(p, lib, p.net.params, p.C, p.V))
    if compiled:
        batched = torch.compile(batched)
    return lambda: {p.key: batched(p.X)}


def operator_ways(p: OperatorProblem) -> list[Way]:
    nested = "vmap(hessian(Δ(hessian)))" if p.key == "biharmonic" else "vmap(hessian)"
    jet_nested = p.key == "biharmonic"
    out = [
        Way("hoad", f"hoad.{_hoad_call(p)}, inductor", lambda: _same(_hoad_operator(p, "inductor"))),
        Way("hoad eager", f"hoad.{_hoad_call(p)}, eager", lambda: _same(_hoad_operator(p, "eager"))),
    ]
    if p.X.is_cuda:  # the same Inductor program replayed from a CUDA graph
        out.append(Way("hoad graphs", f"hoad.{_hoad_call(p)}, inductor, HOAD_CUDA_GRAPHS=1",
                       lambda: _same(_hoad_operator(p, "inductor", graphs=True))))
    out += [
        Way("torch.func", nested, lambda: _same(_answer_of(TORCH_FUNC, p))),
        Way("torch.compile", f"torch.compile({nested})", lambda: _same(_answer_of(TORCH_FUNC, p, compiled=True)),
            worker=True),
        Way("jax.jit", f"jit({nested})", lambda: _jax_operator(p), needs=("jax",)),
        Way("folx", "jit(vmap(" + ("forward_laplacian(forward_laplacian)" if jet_nested else "forward_laplacian")
            + "))" + _change_of_variables(p), lambda: _folx_operator(p), needs=("jax", "folx")),
        Way("torch-jet", "vmap(" + _jet_call(p) + ")", lambda: _same(_jet_operator(p, compiled=False)),
            needs=("jet-for-pytorch",)),
        Way("torch-jet compiled", "torch.compile(vmap(" + _jet_call(p) + "))",
            lambda: _same(_jet_operator(p, compiled=True)), needs=("jet-for-pytorch",), worker=True),
    ]
    if p.operator == "biharmonic":  # torch-jet's own operator: 4-jets along D² directions
        out.append(Way("torch-jet bilaplacian", "vmap(jet.bilaplacian(u))",
                       lambda: _same(_jet_bilaplacian(p)), needs=("jet-for-pytorch",), full_only=True))
    if p.key == "laplacian":
        shapes = jet_products(p)
        out.append(Way(FLOOR, "mm " + " + ".join(f"[{m},{k}]@[{k},{n}]" for m, k, n in shapes)
                       + f", {sum(m * k * n for m, k, n in shapes) / 1e6:.1f} M multiply-adds",
                       lambda: _products_alone(shapes, p.X), bound=True))
    return out


# The column that prices, through torch's BLAS, what every forward-jet Laplacian (hoad's, folx's,
# torch-jet's) computes: the matrix products that carry the S first-order directions of each of
# the N points through the hidden layers after the first, timed alone in the faster of the two
# orientations. The first layer's jet is the constant W1ᵀV (computed once) and the last layer's is
# never needed: its second derivative is zero and the collapsed sum Σ_s w_s (∂z_l)² is formed at
# each hidden layer. A program goes below this column only with fewer multiply-adds or a faster
# product than MKL's: hoad's fused hoad::jet_sqnorm runs the last hidden layer's (40 GFLOP/s of
# a 44 peak on one core of the AMD EPYC these were measured on; MKL 25-33).
FLOOR = "jet products alone"


def jet_products(p: OperatorProblem) -> list[tuple[int, int, int]]:
    """(m, k, n) of each product of the jets: the hidden layers' weights [n_l, n_{l-1}] times the
    jets [n_{l-1}, S·N] of the previous hidden layer."""
    S = p.V.shape[0] if p.V is not None else p.X.shape[1]
    hidden = p.net.sizes[1:-1]
    return [(n_l, n_prev, S * p.X.shape[0]) for n_prev, n_l in zip(hidden, hidden[1:])]


def _products_alone(shapes: list[tuple[int, int, int]], like: torch.Tensor) -> tuple[Callable, Callable]:
    g = torch.Generator(device="cpu").manual_seed(0)
    draw = lambda *size: torch.randn(*size, generator=g, dtype=DT).to(like)  # noqa: E731
    runs = []
    for m, k, n in shapes:
        wide = (draw(m, k), draw(k, n), like.new_empty(m, n))   # W [m,k] @ J [k, S·N]
        tall = (draw(n, k), draw(k, m), like.new_empty(n, m))   # Jᵀ [S·N, k] @ Wᵀ [k, m]
        runs.append(min(wide, tall, key=lambda abc: _seconds(lambda: torch.mm(abc[0], abc[1], out=abc[2])))
                    if like.device.type == "cpu" else wide)

    def timed():
        for a, b, out in runs:
            torch.mm(a, b, out=out)

    return (lambda: {}), timed


def _seconds(fn: Callable[[], object], calls: int = 5) -> float:
    fn()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - begin


def _hoad_call(p: OperatorProblem) -> str:
    extra = {"weighted": ", weights=C", "stochastic": ", directions=V",
             "stochastic-biharmonic": ", directions=V, estimator='nested'"}.get(p.operator, "")
    return f"{'biharmonic' if p.key == 'biharmonic' else 'laplacian'}(u, batch_dim=0{extra})"


def _hoad_operator(p: OperatorProblem, backend: str, graphs: bool = False) -> Callable[[], dict]:
    """hoad's operator; ``graphs=True``: its CUDA programs replayed from CUDA graphs (its first
    call is made here, where ``HOAD_CUDA_GRAPHS=1`` is read)."""
    import hoad

    kwargs = {"weights": p.C} if p.operator == "weighted" else {"directions": p.V} if p.V is not None else {}
    if p.key == "biharmonic":
        if p.V is not None:  # Δ_V(Δ_V u), as every peer computes it
            kwargs["estimator"] = "nested"
        op = hoad.biharmonic(p.net.u, batch_dim=0, backend=backend, **kwargs)
        answer = _with_mode(lambda: {"biharmonic": op(p.X).biharmonic}, op.outer.compiled)
    else:
        op = hoad.laplacian(p.net.u, batch_dim=0, backend=backend, **kwargs)
        answer = _with_mode(lambda: {"laplacian": op(p.X).laplacian}, op.compiled)
    if graphs:
        with mock.patch.dict(os.environ, HOAD_CUDA_GRAPHS="1"):
            answer()
    return answer


def chosen_mode(cf) -> str:
    """The mode asked for, and under "auto" the direction hoad chose (where its program says)."""
    import hoad

    asked = cf.config.mode
    try:
        program = cf.graph.program
    except hoad.HoadError:
        return asked
    chosen = getattr(program, "direction", None)
    if not isinstance(chosen, str) or chosen == asked:
        return asked
    return f"{asked}→{chosen}"


def _with_mode(answer: Callable[[], dict], compiled) -> Callable[[], dict]:
    """``answer`` that, once called, says the direction hoad chose (``auto→reverse``, ...)."""

    def chosen() -> str:
        return chosen_mode(compiled)

    answer.chosen = chosen
    return answer


def _jax_operator(p: OperatorProblem):
    import jax
    import jax.numpy as jnp

    lib = _jax_library()
    on = lambda t: None if t is None else jnp.asarray(t.detach().cpu().numpy())  # noqa: E731
    params, X = p.net.to_jax(), on(p.X)
    batched = jax.jit(jax.vmap(_per_point(p, lib, params, on(p.C), on(p.V))))

    def timed():
        return {p.key: batched(X).block_until_ready()}

    return lambda: _from_jax(timed()), timed


def _change_of_variables(p: OperatorProblem) -> str:
    return {"weighted": ", of y -> u(x + L y) (C = L Lᵀ)", "stochastic": ", of y -> u(x + Vᵀy/√S)",
            "stochastic-biharmonic": ", of y -> u(x + Vᵀy/√S)"}.get(p.operator, "")


def _folx_operator(p: OperatorProblem):
    import folx
    import jax
    import jax.numpy as jnp

    on = lambda t: jnp.asarray(t.detach().cpu().numpy())  # noqa: E731
    params, X = p.net.to_jax(), on(p.X)
    if p.operator == "weighted":
        M = on(p.L).T  # x + y @ Lᵀ = x + L y
    elif p.V is not None:
        M = on(p.scaled_V)  # x + y @ (V/√S)
    else:
        M = None

    def laplacian_of(f):
        """x -> the (weighted, stochastic) forward Laplacian of f at x, as folx computes it."""
        if M is None:
            return lambda x: folx.forward_laplacian(f, sparsity_threshold=0)(x).laplacian
        y0 = jnp.zeros(M.shape[0], dtype=X.dtype)
        return lambda x: folx.forward_laplacian(lambda y: f(x + y @ M), sparsity_threshold=0)(y0).laplacian

    once = laplacian_of(lambda x: _jax_mlp(params, x))
    batched = jax.jit(jax.vmap(laplacian_of(once) if p.key == "biharmonic" else once))

    def timed():
        return {p.key: batched(X).block_until_ready()}

    return lambda: _from_jax(timed()), timed


# --------------------------------------------------------------------------------- torch-jet
def load_jet():
    """Import torch-jet (jet-for-pytorch). It declares Python >= 3.12 for one PEP 695 statement,
    ``type PyTree[Leaf] = ...`` in jet/utils.py; on an older Python that module is compiled with
    the statement replaced by an equivalent ``typing.Union`` alias (in memory, nothing is written);
    a torch-jet without the statement (its trees before 1.0.0) is imported as it is."""
    if sys.version_info >= (3, 12) or "jet.utils" in sys.modules:
        import jet

        return jet
    import importlib.abc
    import importlib.machinery
    import re

    alias = ("from typing import TypeVar as _LeafVar, Union as _Union\n"
             "_Leaf = _LeafVar('_Leaf')\nPyTree = _Union[_Leaf, tuple, list, dict]\n")

    class Rewriting(importlib.machinery.SourceFileLoader):
        def get_code(self, fullname):
            path = self.get_filename(fullname)
            source = self.get_data(path).decode("utf-8")
            source, count = re.subn(r"^type PyTree\[Leaf\] = \(.*?^\)\n", alias, source, flags=re.S | re.M)
            if count != 1 and re.search(r"^type \w", source, flags=re.M):
                raise ImportError(f"torch-jet's {path} no longer has the PyTree alias this loader rewrites "
                                  "for Python < 3.12")
            return compile(source, path, "exec", dont_inherit=True)

        def set_data(self, *args, **kwargs):  # never cache the rewritten module as a .pyc
            pass

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "jet.utils":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.origin:
                spec.loader = Rewriting(name, spec.origin)
            return spec

    sys.meta_path.insert(0, Finder())
    import jet

    return jet


def _jet_weighting(p: OperatorProblem):
    """torch-jet's ``weighting=(apply_S, rank)`` for C = S Sᵀ: S = L (weighted) or Vᵀ/√S (stochastic)."""
    if p.operator == "weighted":
        S = p.L
    elif p.V is not None:
        S = p.scaled_V.T
    else:
        return None

    def apply_S(x, M):  # M (K, rank) -> M Sᵀ, (K, *x.shape)
        return (M @ S.T).reshape(M.shape[0], *x.shape)

    return apply_S, S.shape[1]


def _jet_call(p: OperatorProblem) -> str:
    weighting = ", weighting=(L, D)" if p.operator == "weighted" else \
        ", weighting=(V/√S, S)" if p.V is not None else ""
    lap = f"jet.laplacian(u{weighting})"
    return f"jet.laplacian({lap}{weighting})" if p.key == "biharmonic" else lap


def _jet_graph(jet, fn: Callable, x0: torch.Tensor) -> torch.fx.GraphModule:
    """The paper's recipe: capture the per-point operator as one FX graph, then CSE it."""
    graph, _ = jet.capture_graph(fn, (x0,))
    jet.common_subexpression_elimination(graph.graph)
    graph.recompile()
    return graph


def _jet_operator(p: OperatorProblem, compiled: bool) -> Callable[[], dict]:
    """torch-jet's collapsed Taylor mode: ``jet.laplacian`` (weighted / along V through
    ``weighting=``), nested for the biharmonic (jet.laplacian of jet.laplacian: measured 5x faster
    than jet.bilaplacian's 4-jets, so it is the stronger peer), vmapped over the points."""
    jet = load_jet()
    x0 = torch.zeros_like(p.X[0])
    weighting = _jet_weighting(p)
    operator = jet.laplacian(p.net.u, (x0,), weighting=weighting)
    if p.key == "biharmonic":
        operator = jet.laplacian(operator, (x0,), weighting=weighting)
    batched = torch.func.vmap(_jet_graph(jet, operator, x0))
    if compiled:
        batched = torch.compile(batched)
    return lambda: {p.key: batched(p.X)}


def _jet_bilaplacian(p: OperatorProblem) -> Callable[[], dict]:
    jet = load_jet()
    x0 = torch.zeros_like(p.X[0])
    batched = torch.func.vmap(_jet_graph(jet, jet.bilaplacian(p.net.u, (x0,)), x0))
    return lambda: {"biharmonic": batched(p.X)}


# ----------------------------------------------------------------------------- training steps
def train_ways(p: TrainProblem) -> list[Way]:
    return [
        Way("hoad", "hoad.laplacian(u, batch_dim=0) + loss.backward(), inductor",
            lambda: _same(_hoad_step(p, "inductor"))),
        Way("hoad eager", "hoad.laplacian(u, batch_dim=0) + loss.backward(), eager",
            lambda: _same(_hoad_step(p, "eager"))),
        Way("hoad one program", "hoad.compile(loss through hoad.laplacian, order=1, wrt=params), inductor",
            lambda: _same(_hoad_one_program(p, "inductor"))),
        Way("torch.func", "grad_and_value(loss of vmap(hessian))", lambda: _train_answer_of_func(p, compiled=False)),
        Way("torch.compile", "torch.compile(grad_and_value(loss of vmap(hessian)))",
            lambda: _train_answer_of_func(p, compiled=True), worker=True),
        Way("jax.jit", "jit(value_and_grad(loss of vmap(hessian)))", lambda: _jax_step(p, folx=False),
            needs=("jax",)),
        Way("folx", "jit(value_and_grad(loss of vmap(forward_laplacian)))", lambda: _jax_step(p, folx=True),
            needs=("jax", "folx")),
        Way("torch-jet", "vmap(jet.laplacian(u)) + loss.backward()", lambda: _same(_jet_step(p, compiled=False)),
            needs=("jet-for-pytorch",)),
        Way("torch-jet compiled", "torch.compile(loss of vmap(jet.laplacian(u))) + loss.backward()",
            lambda: _same(_jet_step(p, compiled=True)), needs=("jet-for-pytorch",), worker=True),
    ]


def _loss_of_params(p: TrainProblem, lib: Library, X, f) -> Callable:
    def loss(params):
        laplacian = lib.vmap(lambda x: lib.hessian(lambda y: lib.mlp(params, y))(x).diagonal().sum())(X)
        return ((laplacian + f) ** 2).mean()

    return loss


def _train_answer_of_func(p: TrainProblem, compiled: bool):
    step = torch.func.grad_and_value(_loss_of_params(p, TORCH_FUNC, p.X, p.f))
    if compiled:
        step = torch.compile(step)
    params = [q.detach() for q in p.net.params]

    def answer():
        grads, loss = step(params)
        return p.answer(loss, grads)

    return answer, answer


def _backward_step(p: TrainProblem, params: list[torch.Tensor], laplacian: Callable) -> Callable[[], dict]:
    """A training step through autograd: loss from ``laplacian(X)``, then loss.backward()."""

    def answer():
        for q in params:
            q.grad = None
        loss = ((laplacian(p.X) + p.f) ** 2).mean()
        loss.backward()
        return p.answer(loss, [torch.zeros_like(q) if q.grad is None else q.grad for q in params])

    return answer


def _hoad_step(p: TrainProblem, backend: str) -> Callable[[], dict]:
    import hoad

    params = p.net.trainable()
    op = hoad.laplacian(lambda x: tanh_mlp(params, x), batch_dim=0, backend=backend)
    return _with_mode(_backward_step(p, params, lambda X: op(X).laplacian), op.compiled)


def _hoad_one_program(p: TrainProblem, backend: str) -> Callable[[], dict]:
    """The loss and its gradient from one hoad program: hoad.compile differentiates the loss
    (order 1 in every parameter) through the Laplacian's own program; no autograd."""
    import hoad

    params = [q.detach().clone() for q in p.net.params]
    laplacian = hoad.laplacian(lambda x, *ps: tanh_mlp(ps, x), batch_dim=0, backend=backend)

    def loss(*ps):
        return ((laplacian(p.X, *ps).laplacian + p.f) ** 2).mean()

    step = hoad.compile(loss, order=1, wrt=tuple(range(len(params))), backend=backend)

    def answer():
        res = step(*params)
        return p.answer(res.value, [res[i] for i in range(len(params))])

    return _with_mode(answer, step)


def _jet_step(p: TrainProblem, compiled: bool) -> Callable[[], dict]:
    """torch-jet's Laplacian of u closing over trainable parameters: the captured graph holds them
    as constants (the same tensors), so loss.backward() reaches them."""
    jet = load_jet()
    params = p.net.trainable()
    u = lambda x: tanh_mlp(params, x)  # noqa: E731
    x0 = torch.zeros_like(p.X[0])
    batched = torch.func.vmap(_jet_graph(jet, jet.laplacian(u, (x0,)), x0))
    if compiled:
        batched = torch.compile(batched)
    return _backward_step(p, params, batched)


def _jax_step(p: TrainProblem, folx: bool):
    import jax
    import jax.numpy as jnp

    on = lambda t: jnp.asarray(t.detach().cpu().numpy())  # noqa: E731
    params, X, f = p.net.to_jax(), on(p.X), on(p.f)
    if folx:
        import folx as folx_module

        def loss(params):
            def laplacian(x):
                return folx_module.forward_laplacian(lambda y: _jax_mlp(params, y), sparsity_threshold=0)(x).laplacian

            return ((jax.vmap(laplacian)(X) + f) ** 2).mean()
    else:
        loss = _loss_of_params(p, _jax_library(), X, f)
    step = jax.jit(jax.value_and_grad(loss))

    def timed():
        return jax.block_until_ready(step(params))

    def answer():
        value, grads = timed()
        return _from_jax({"loss": value, **dict(zip(p.net.names, grads))})

    return answer, timed
