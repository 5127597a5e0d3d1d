"""The workloads: each builds one derivative problem, deterministically, in torch and in JAX.

A workload builds its problem on a device in a dtype (``build(device, dtype)``; the CPU suite is
float64, ``--device cuda`` runs :data:`CUDA_WORKLOADS` in ``--dtype``): the tensors are drawn on
the CPU in float64 from fixed seeds, so every device and dtype sees the same numbers, then moved.
The differential operators and training steps (:mod:`benchmarks.operators`) are workloads too,
with problems of their own kind.

A :class:`Problem` says what to differentiate (``fn`` at ``args``), with respect to which
arguments (``wrt``) and to which ``order``. Its *answer* is the set of canonical top-order
blocks in torch.func's dense layout, or, for per-sample problems, one block per sample
(``vmap`` over dim 0), or, for Laplacian problems, the trace of each sample's Hessian.
Every contender must produce the same answer (see :mod:`benchmarks.reference`).

:data:`WORKLOADS` lists them all, in table order; ``quick`` marks the ones ``--quick`` runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks import jets, operators, shared_params

DT = torch.float64


@dataclass
class Problem:
    """A derivative problem: the function, its arguments, the order and what to differentiate."""

    fn: Callable[..., torch.Tensor]
    args: tuple
    order: int
    wrt: tuple[int, ...] = (0,)
    # fn works on one sample and on a batch; dim 0 of args[0] and of the output are samples.
    per_sample: bool = False
    # the answer is the trace of each sample's Hessian (order 2, per sample)
    laplacian: bool = False
    # builds the same function and arguments in JAX: () -> (jax_fn, jax_args)
    jax: Callable[[], tuple[Callable, tuple]] | None = None
    # hoad computes the unique entries of each block (hoad.compile(..., packed=True))
    packed: bool = False

    @property
    def sample(self) -> torch.Tensor:
        """The per-sample input (argument 0) of a per-sample problem."""
        return self.args[0]


@dataclass(frozen=True)
class Workload:
    """A named benchmark row: how to build its problem and which peers run in --quick."""

    id: str  # unique, stable: the name --only matches and the worker rebuilds by
    group: str
    label: str
    build: Callable[..., object]  # (device="cpu", dtype=float64) -> Problem | operators.OperatorProblem | ...
    quick: bool = False
    # run the torch.compile peers in --quick too (they cost 5-30 s each): all, or the named columns
    compile_in_quick: bool | tuple[str, ...] = False
    device: str = "cpu"  # the suite it belongs to: "cpu" (python -m benchmarks) or "cuda" (--device cuda)

    def compiles_in_quick(self, column: str) -> bool:
        return column in self.compile_in_quick if isinstance(self.compile_in_quick, tuple) else self.compile_in_quick

    def make(self, dtype: torch.dtype = DT):
        """The workload's problem on its device, in ``dtype``."""
        return self.build(device=self.device, dtype=dtype)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _to_jax(*tensors: torch.Tensor) -> tuple:
    import jax.numpy as jnp

    return tuple(jnp.asarray(t.detach().cpu().numpy()) for t in tensors)


def _on(device: str, dtype: torch.dtype, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors (drawn on the CPU in float64) on ``device``; floating ones in ``dtype``."""
    return [t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in tensors]


# ------------------------------------------------------------------------- 1. the seed MLP
def seed_mlp(batch: int, size: int, depth: int, order: int, wrt_params: bool = False) -> Callable[[], Problem]:
    """``T = X; T = relu(T @ P)`` for all but the last layer, ``softmax(T @ P, dim=1)`` last, then
    a weighted sum. (``softmax(...).sum()`` alone is constant: every derivative would be zero.)"""

    def build(device: str = "cpu", dtype: torch.dtype = DT) -> Problem:
        g = _generator()
        X = torch.randn(batch, size, generator=g, dtype=DT)
        Ps = [torch.randn(size, size, generator=g, dtype=DT) / math.sqrt(size) for _ in range(depth)]
        weights = torch.randn(batch, size, generator=g, dtype=DT)
        X, weights, *Ps = _on(device, dtype, X, weights, *Ps)

        def mlp(X, *Ps):
            T = X
            for P in Ps[:-1]:
                T = torch.relu(T @ P)
            T = torch.softmax(T @ Ps[-1], dim=1)
            return (T * weights).sum()

        def in_jax():
            import jax

            (w,) = _to_jax(weights)

            def mlp(X, *Ps):
                T = X
                for P in Ps[:-1]:
                    T = jax.nn.relu(T @ P)
                T = jax.nn.softmax(T @ Ps[-1], axis=1)
                return (T * w).sum()

            return mlp, _to_jax(X, *Ps)

        wrt = tuple(range(depth + 1)) if wrt_params else (0,)
        return Problem(mlp, (X, *Ps), order, wrt=wrt, jax=in_jax)

    return build


def seed_mlp_per_sample(batch: int, size: int = 10, depth: int = 3, order: int = 2) -> Callable[[], Problem]:
    """The seed MLP with one output per sample: each row's softmax is weighted and summed on its
    own, so row b depends on X_b only. The weights do not depend on ``batch`` (only X does)."""

    def build(device: str = "cpu", dtype: torch.dtype = DT) -> Problem:
        g = _generator()
        Ps = [torch.randn(size, size, generator=g, dtype=DT) / math.sqrt(size) for _ in range(depth)]
        weights = torch.randn(size, generator=g, dtype=DT)
        X = torch.randn(batch, size, generator=_generator(1), dtype=DT)
        X, weights, *Ps = _on(device, dtype, X, weights, *Ps)

        def mlp(x):  # one sample (size,) -> (), or a batch (B, size) -> (B,)
            T = x
            for P in Ps[:-1]:
                T = torch.relu(T @ P)
            return (torch.softmax(T @ Ps[-1], dim=-1) * weights).sum(-1)

        return Problem(mlp, (X,), order, per_sample=True)

    return build


def _seed_grid(quick: bool) -> list[tuple[int, int, int]]:
    """(batch, size, depth) points: each axis varied around the seed's 10 x 10, depth 3."""
    batches, sizes, depths = ((40,), (40,), (6,)) if quick else ((20, 40, 80), (20, 40, 80), (2, 4, 6, 8, 10))
    points = [(10, 10, 3)]
    points += [(b, 10, 3) for b in batches] + [(10, n, 3) for n in sizes] + [(10, 10, d) for d in depths]
    return list(dict.fromkeys(points))


def _seed_workloads() -> list[Workload]:
    quick_points = set(_seed_grid(quick=True))
    out = []
    for order, what in ((1, "Jacobian"), (2, "Hessian")):
        for b, n, d in _seed_grid(quick=False):
            out.append(Workload(f"seed-mlp/{what.lower()}/B{b}-n{n}-d{d}", "1. seed MLP, w.r.t. X",
                                f"{what}, B={b} n={n} depth={d}", seed_mlp(b, n, d, order),
                                quick=(b, n, d) in quick_points,
                                compile_in_quick=(order, b, n, d) == (2, 10, 10, 3)))
    for n, d in ((10, 3), (20, 3), (10, 5)):
        out.append(Workload(f"seed-mlp/params-hessian/B10-n{n}-d{d}", "1. seed MLP, w.r.t. X and every P",
                            f"Hessian, all blocks, B=10 n={n} depth={d}", seed_mlp(10, n, d, 2, wrt_params=True),
                            quick=(n, d) == (10, 3)))
    return out


# --------------------------------------------------------------------- 2. tanh MLP 16-64-64-1
def _tanh_mlp_weights(dim: int = 16):
    g = _generator()
    return (torch.randn(dim, 64, generator=g, dtype=DT) / math.sqrt(dim), torch.randn(64, generator=g, dtype=DT),
            torch.randn(64, 64, generator=g, dtype=DT) / 8, torch.randn(64, generator=g, dtype=DT),
            torch.randn(64, 1, generator=g, dtype=DT) / 8)


def tanh_mlp(order: int, points: int | None, laplacian: bool = False, dim: int = 16,
             packed: bool = False) -> Callable[[], Problem]:
    """A scalar energy of x in R^dim (tanh MLP dim-64-64-1); ``points=None`` is one point, else a
    batch of samples."""

    def build(device: str = "cpu", dtype: torch.dtype = DT) -> Problem:
        W1, b1, W2, b2, W3 = _on(device, dtype, *_tanh_mlp_weights(dim))

        def energy(x):  # one sample (16,) -> (), or a batch (B, 16) -> (B,)
            h = torch.tanh(x @ W1 + b1)
            h = torch.tanh(h @ W2 + b2)
            return (h @ W3).squeeze(-1)

        def in_jax():
            import jax.numpy as jnp

            w1, c1, w2, c2, w3 = _to_jax(W1, b1, W2, b2, W3)

            def energy(x):
                h = jnp.tanh(x @ w1 + c1)
                h = jnp.tanh(h @ w2 + c2)
                return (h @ w3).squeeze(-1)

            return energy, _to_jax(x)

        x = torch.randn(dim, generator=_generator(1), dtype=DT) if points is None else \
            torch.randn(points, dim, generator=_generator(1), dtype=DT)
        (x,) = _on(device, dtype, x)
        return Problem(energy, (x,), order, per_sample=points is not None, laplacian=laplacian, jax=in_jax,
                       packed=packed)

    return build


# -------------------------------------------------------- 3. cross-entropy of a small classifier
def classifier_loss(batch: int = 64, features: int = 10, hidden: int = 32, classes: int = 5) -> Callable[[], Problem]:
    """Mean cross-entropy of a one-hidden-layer tanh classifier; the parameters are the wrt args."""

    def build(device: str = "cpu", dtype: torch.dtype = DT) -> Problem:
        g = _generator()
        A1 = torch.randn(features, hidden, generator=g, dtype=DT) / math.sqrt(features)
        c1 = torch.randn(hidden, generator=g, dtype=DT) / 10
        A2 = torch.randn(hidden, classes, generator=g, dtype=DT) / math.sqrt(hidden)
        c2 = torch.randn(classes, generator=g, dtype=DT) / 10
        X = torch.randn(batch, features, generator=g, dtype=DT)
        y = torch.randint(0, classes, (batch,), generator=g)
        A1, c1, A2, c2, X, y = _on(device, dtype, A1, c1, A2, c2, X, y)

        def loss(A1, c1, A2, c2, X, y):
            return F.cross_entropy(torch.tanh(X @ A1 + c1) @ A2 + c2, y)

        def in_jax():
            import jax
            import jax.numpy as jnp

            def loss(A1, c1, A2, c2, X, y):
                logp = jax.nn.log_softmax(jnp.tanh(X @ A1 + c1) @ A2 + c2, axis=1)
                return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()

            return loss, _to_jax(A1, c1, A2, c2, X, y)

        return Problem(loss, (A1, c1, A2, c2, X, y), 2, wrt=(0, 1, 2, 3), jax=in_jax)

    return build


# ------------------------------------------------- 5. order 4 of a small vector-valued function
def shared_subexpressions() -> Callable[[], Problem]:
    """R^6 -> R^3 where every output reuses ``s`` (and the tanh of its sum)."""

    def build(device: str = "cpu", dtype: torch.dtype = DT) -> Problem:
        def f(x):
            s = torch.sin(x) * torch.exp(-0.5 * x * x)
            p = s[:3] * s[3:]
            return p * torch.tanh(s.sum()) + torch.cos(p)

        def in_jax():
            import jax.numpy as jnp

            def f(x):
                s = jnp.sin(x) * jnp.exp(-0.5 * x * x)
                p = s[:3] * s[3:]
                return p * jnp.tanh(s.sum()) + jnp.cos(p)

            return f, _to_jax(x)

        (x,) = _on(device, dtype, torch.randn(6, generator=_generator(), dtype=DT))
        return Problem(f, (x,), 4, jax=in_jax)

    return build


# ----------------------------------------------- 6-7. differential operators and training steps
def _net_id(sizes: tuple[int, ...]) -> str:
    return "-".join(map(str, sizes))


def _operator_workloads() -> list[Workload]:
    """Issue 16: hoad.laplacian / hoad.biharmonic against folx and torch-jet (and torch.func, JAX)."""
    group = "6. differential operators per point, tanh MLPs (issue 16)"
    S = operators.DIRECTIONS
    small, wide, paper = (16, 64, 64, 1), (50, 128, 128, 1), operators.PAPER_MLP
    rows = [  # (id, label, operator, sizes, points, quick)
        (f"laplacian/{_net_id(small)}/N256", "Laplacian Δu, 16-64-64-1, 256 points", "laplacian", small, 256, True),
        (f"laplacian/{_net_id(wide)}/N256", "Laplacian Δu, 50-128-128-1, 256 points", "laplacian", wide, 256, False),
        (f"laplacian/{_net_id(paper)}/N64", "Laplacian Δu, 50-768-768-512-512-1 (torch-jet paper), 64 points",
         "laplacian", paper, 64, False),
        (f"laplacian/weighted/{_net_id(small)}/N256", "weighted Laplacian tr(C ∇²u), C SPD, 16-64-64-1, 256 points",
         "weighted", small, 256, False),
        (f"laplacian/stochastic-S{S}/{_net_id(small)}/N256",
         f"stochastic Laplacian, fixed V ({S}, 16), 16-64-64-1, 256 points", "stochastic", small, 256, False),
        (f"biharmonic/{_net_id(small)}/N64", "biharmonic Δ²u, 16-64-64-1, 64 points", "biharmonic", small, 64, False),
        (f"biharmonic/stochastic-S{S}/{_net_id(small)}/N64",
         f"stochastic biharmonic Δ_V(Δ_V u), fixed V ({S}, 16), 16-64-64-1, 64 points", "stochastic-biharmonic",
         small, 64, False),
    ]
    # --quick: the first Laplacian, with the compiled peer its target names (torch.compile of
    # vmap(hessian) would add 30 s); the biharmonic and the rest only in the full run
    return [Workload(id_, group, label, operators.operator_problem(op, sizes, points), quick=quick,
                     compile_in_quick=("torch-jet compiled",) if quick else False)
            for id_, label, op, sizes, points, quick in rows]


def _train_workloads() -> list[Workload]:
    """Issue 15: one step of mean((Δu + f)²) and its gradient w.r.t. every parameter."""
    group = "7. training step: Laplacian-residual loss + backward to every parameter (issue 15)"
    # --quick: the 16-64-64-1 step with both compiled peers, so that its best-peer target is measured
    return [Workload(f"train/{_net_id(sizes)}/N256", group, f"tanh MLP {_net_id(sizes)}, 256 points",
                     operators.train_problem(sizes, 256), quick=sizes == (16, 64, 64, 1),
                     compile_in_quick=sizes == (16, 64, 64, 1))
            for sizes in ((2, 32, 32, 1), (16, 64, 64, 1))]


# ------------------------------------------------------------------------------ the registry
WORKLOADS: list[Workload] = [
    *_seed_workloads(),
    Workload("tanh-mlp/hessian", "2. tanh MLP 16-64-64-1", "Hessian, one point",
             tanh_mlp(2, None), quick=True, compile_in_quick=True),
    Workload("tanh-mlp/order3", "2. tanh MLP 16-64-64-1", "3rd order, one point",
             tanh_mlp(3, None), quick=True, compile_in_quick=True),
    Workload("tanh-mlp/per-sample-hessian", "2. tanh MLP 16-64-64-1", "per-sample Hessian, 256 points",
             tanh_mlp(2, 256), quick=True, compile_in_quick=True),
    Workload("tanh-mlp/per-sample-order3", "2. tanh MLP 16-64-64-1", "per-sample 3rd order, 256 points",
             tanh_mlp(3, 256), quick=True),
    Workload("classifier/cross-entropy-hessian", "3. classifier loss, w.r.t. all parameters",
             "Hessian, 10-32-5 tanh, batch 64 (517 params)", classifier_loss(), quick=True),
    Workload("laplacian/tanh-mlp", "4. Laplacian", "trace of per-sample Hessian, tanh MLP, 256 points",
             tanh_mlp(2, 256, laplacian=True), quick=True),
    Workload("shared/order4", "5. order 4, R^6 -> R^3", "order 4, shared subexpressions",
             shared_subexpressions(), quick=True),
    *(OPERATOR_WORKLOADS := _operator_workloads()),
    *(TRAIN_WORKLOADS := _train_workloads()),
    *shared_params.workloads(Workload),
    *(JET_WORKLOADS := jets.workloads(Workload)),
    # issue 45: orders 3-6 at a point, where the dense blocks outgrow their unique entries
    *(Workload(f"higher-orders/{dim}-64-64-1/order{k}", "10. higher orders of a tanh MLP at a point (issue 45)",
               f"order {k}, tanh MLP {dim}-64-64-1, one point", tanh_mlp(k, None, dim=dim))
      for dim, orders in ((8, (3, 4, 5, 6)), (16, (3, 4, 5))) for k in orders),
    # the same with packed=True: unique entries from jets along lattice directions (hoad.packed)
    *(Workload(f"higher-orders/{dim}-64-64-1/order{k}/packed", "10. higher orders of a tanh MLP at a point (issue 45)",
               f"order {k}, tanh MLP {dim}-64-64-1, one point, packed", tanh_mlp(k, None, dim=dim, packed=True))
      for dim, orders in ((8, (4, 5, 6)), (16, (4, 5))) for k in orders),
]


def _cuda_operator_workloads() -> list[Workload]:
    """Issue 16's operators at GPU sizes: 4096 points (1024 for the biharmonics, whose float64
    torch.func reference holds a [N, D, D, D, width] intermediate)."""
    S = operators.DIRECTIONS
    small, wide, paper = (16, 64, 64, 1), (50, 128, 128, 1), operators.PAPER_MLP
    n, n_bih = CUDA_POINTS, CUDA_POINTS // 4
    rows = [  # (id, label, operator, sizes, points): the ones furthest behind on the CPU first
        (f"laplacian/{_net_id(small)}/N{n}", f"Laplacian Δu, 16-64-64-1, {n} points", "laplacian", small, n),
        (f"biharmonic/{_net_id(small)}/N{n_bih}", f"biharmonic Δ²u, 16-64-64-1, {n_bih} points", "biharmonic",
         small, n_bih),
        (f"laplacian/{_net_id(paper)}/N{n}", f"Laplacian Δu, 50-768-768-512-512-1 (torch-jet paper), {n} points",
         "laplacian", paper, n),
        (f"laplacian/stochastic-S{S}/{_net_id(small)}/N{n}",
         f"stochastic Laplacian, fixed V ({S}, 16), 16-64-64-1, {n} points", "stochastic", small, n),
        (f"laplacian/weighted/{_net_id(small)}/N{n}", f"weighted Laplacian tr(C ∇²u), 16-64-64-1, {n} points",
         "weighted", small, n),
        (f"laplacian/{_net_id(wide)}/N{n}", f"Laplacian Δu, 50-128-128-1, {n} points", "laplacian", wide, n),
        (f"biharmonic/stochastic-S{S}/{_net_id(small)}/N{n_bih}",
         f"stochastic biharmonic Δ_V(Δ_V u), fixed V ({S}, 16), 16-64-64-1, {n_bih} points",
         "stochastic-biharmonic", small, n_bih),
    ]
    return [Workload(f"cuda/{id_}", _CUDA_GROUP, label, operators.operator_problem(op, sizes, points))
            for id_, label, op, sizes, points in rows]


# ``--device cuda``: GPU-sized problems, in --dtype (ids start with "cuda/": a worker knows the
# device of a workload by its id before it imports torch)
CUDA_POINTS = 4096
_CUDA_GROUP = "CUDA: GPU-sized workloads"
CUDA_WORKLOADS: list[Workload] = [
    Workload(f"cuda/tanh-mlp/per-sample-hessian/N{CUDA_POINTS}", _CUDA_GROUP,
             f"per-sample Hessian, tanh MLP 16-64-64-1, {CUDA_POINTS} points", tanh_mlp(2, CUDA_POINTS)),
    Workload(f"cuda/tanh-mlp/per-sample-order3/N{CUDA_POINTS}", _CUDA_GROUP,
             f"per-sample 3rd order, tanh MLP 16-64-64-1, {CUDA_POINTS} points", tanh_mlp(3, CUDA_POINTS)),
    Workload("cuda/classifier/cross-entropy-hessian", _CUDA_GROUP,
             "parameter Hessian, 10-32-5 tanh classifier, batch 64 (517 params)", classifier_loss()),
    *_cuda_operator_workloads(),
    Workload(f"cuda/train/16-64-64-1/N{CUDA_POINTS}", _CUDA_GROUP,
             f"training step (Δu + f)², tanh MLP 16-64-64-1, {CUDA_POINTS} points",
             operators.train_problem((16, 64, 64, 1), CUDA_POINTS)),
    # issue 44's rows at the paper's sizes (the jets and randomized operators of its network)
    *jets.workloads(Workload, _CUDA_GROUP, "cuda/", jets.GPU_POINTS),
]
CUDA_WORKLOADS = [Workload(w.id, w.group, w.label, w.build, quick=True, compile_in_quick=True, device="cuda")
                  for w in CUDA_WORKLOADS]

_BY_ID = {w.id: w for w in WORKLOADS + CUDA_WORKLOADS}
assert len(_BY_ID) == len(WORKLOADS) + len(CUDA_WORKLOADS), "workload ids must be unique"
assert all((w.device == "cuda") == w.id.startswith("cuda/") for w in _BY_ID.values())


def get(workload_id: str) -> Workload:
    return _BY_ID[workload_id]


def select(quick: bool, only: str | None = None, device: str = "cpu") -> list[Workload]:
    """The workloads a run measures on ``device``: all, or the quick ones; filtered by an id
    substring (or any of several, comma-separated). ``--quick --only S`` where no quick workload
    matches S runs the ones that do, with --quick's short timing (and no torch.compile peers unless
    the workload compiles in --quick)."""
    suite = CUDA_WORKLOADS if device == "cuda" else WORKLOADS
    matching = [w for w in suite if not only or any(part in w.id for part in only.split(","))]
    return [w for w in matching if w.quick or not quick] or (matching if only else [])
