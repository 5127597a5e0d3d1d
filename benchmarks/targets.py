"""The targets: what the project's issues ask of hoad, each as one number against a named baseline.

``python -m benchmarks --targets`` measures every line of :data:`TARGETS` in one run (the full run
and ``--quick`` include them). A line names hoad's configuration and its baseline; both are
checked against nested torch.func in float64 before they are timed, then timed in interleaved
rounds like the workloads (:func:`benchmarks.runner.measure`). The *measured* value is hoad /
baseline for times, or a size or a time of hoad alone, and ``met`` says whether it is within the
line's :class:`Goal`. Memory growth and first calls in a fresh process are measured in processes
of their own (:mod:`benchmarks.fresh`).

The operator and training-step targets (issues 16 and 15) are read off the workloads of the same
run (:class:`FromWorkloads`: the same process, the same pinned thread, the same interleaved
rounds): ``--targets`` runs those workloads first; ``--quick`` reads the ones it ran and skips
the lines whose workload or baselines it left out.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import hoad
from benchmarks import workloads
from benchmarks.fresh import run_fresh
from benchmarks.peers import (
    HoadOption,
    InProcess,
    Outcome,
    Skipped,
    hoad_answer,
    hoad_config,
    jax_jit,
    torch_func,
)
from benchmarks.reference import answer_fn, canonical, reference
from benchmarks.runner import Settings, measure, run_workload
from benchmarks.timing import Budget, median
from benchmarks.workloads import Problem


@dataclass(frozen=True)
class Goal:
    """A line's target: the measured value is at most ``limit`` (below it, when ``strict``)."""

    limit: float
    unit: str = ""  # "" for a ratio hoad / baseline; "MB", "s" for hoad's own numbers
    strict: bool = False

    def met(self, value: float | None) -> bool:
        return value is not None and (value < self.limit if self.strict else value <= self.limit)

    def __str__(self) -> str:
        return f"{'<' if self.strict else '≤'} {self.limit:g}" + (f" {self.unit}" if self.unit else "")


@dataclass(frozen=True)
class Line:
    """One line of the targets table: what hoad runs, against what, and the goal."""

    hoad: str
    baseline: str
    goal: Goal


@dataclass
class Measured:
    """What one line measured: the cells for hoad and the baseline, and the value held against
    the goal (None when a side failed, was wrong or was skipped: ``status`` says which)."""

    hoad: str
    baseline: str
    value: float | None
    status: str = "ok"  # ok | failed | skipped
    note: str = ""
    detail: dict = field(default_factory=dict)  # every contender's Outcome, for the results file


@dataclass(frozen=True)
class Target:
    """One row of the targets table: the issue it serves, its lines, and how they are measured."""

    row: int
    issue: int
    lines: tuple[Line, ...]
    # one Measured per line: measure(budget), or for a target read off workloads (``workloads``
    # names them) measure({id: that workload's record in this run})
    measure: Callable[..., list[Measured]]
    workloads: tuple[str, ...] = ()


# --------------------------------------------------------------------------- the contenders
class HoadContender(InProcess):
    """hoad in one given configuration (:class:`benchmarks.peers.Hoad` picks the best one instead):
    ``answer(every_order)`` calls ``cf``; the config label says which direction it chose."""

    def __init__(self, name: str, cf: hoad.Compiled, option: HoadOption, answer: Callable[[bool], dict]):
        self.cf, self.option = cf, option
        super().__init__(name, "", first=functools.partial(answer, True), timed=functools.partial(answer, False))

    def start(self, ref) -> Outcome:
        outcome = super().start(ref)
        outcome.config = hoad_config(self.cf, self.option)
        return outcome


def fixed_hoad(p: Problem, name: str = "hoad", **options) -> HoadContender:
    """hoad on ``p`` compiled with ``options`` (backend, mode, batch_dim)."""
    samples = "batch_dim" if options.get("batch_dim") == 0 else "dense"
    cf = hoad.compile(p.fn, order=p.order, wrt=p.wrt, **options)
    option = HoadOption(cf.config.backend, samples, bool(options.get("diagonal")))
    return HoadContender(name, cf, option, functools.partial(hoad_answer, p, cf, option))


def torch_func_of(p: Problem, name: str, config: str, fn: Callable | None = None) -> InProcess:
    """Nested torch.func on ``p`` (of ``fn`` instead of ``p.fn`` when given), as a named contender."""
    answer = answer_fn(p, fn)
    return InProcess(name, config, lambda: answer(*p.args))


# ------------------------------------------------------------------------------ the cells
def _ms(outcome: Outcome) -> str:
    seconds = median(outcome.times)
    if seconds is None:
        return outcome.status if outcome.status != "ok" else "not timed"
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def _summary(outcomes: dict[str, Outcome]) -> str:
    """Each contender's config and time, and what went wrong where something did."""
    parts = []
    for name, o in outcomes.items():
        shown = _ms(o)  # the status itself when it was not timed
        trouble = o.note if o.status in ("ok", shown) else f"{o.status}: {o.note}"
        parts.append(f"{name} ({o.config})" if o.config else name)
        parts[-1] += f": {shown}" + (f" [{trouble}]" if trouble else "")
    return "; ".join(parts)


def _detail(outcomes: dict[str, Outcome]) -> dict:
    return {name: o.as_dict() for name, o in outcomes.items()}


def ratio(hoad_side: tuple, baselines: list[tuple], budget: Budget) -> Measured:
    """hoad's median time over the fastest baseline's; each side is ``(contender, reference)``."""
    outcomes = measure([hoad_side, *baselines], budget)
    mine = outcomes[hoad_side[0].name]
    theirs = {c.name: outcomes[c.name] for c, _ in baselines}
    timed = {name: median(o.times) for name, o in theirs.items() if median(o.times) is not None}
    best = min(timed, key=timed.get) if timed else next(iter(theirs))
    value = median(mine.times) / timed[best] if median(mine.times) is not None and timed else None
    baseline = _ms(theirs[best]) + (f" ({best})" if len(baselines) > 1 else "")
    status = "ok" if value is not None else "failed"
    return Measured(_ms(mine), baseline, value, status, _summary(outcomes), _detail(outcomes))


def _fresh_failed(reply: dict) -> Measured:
    """A fresh process (:func:`run_fresh`) that did not answer ok: its status is this line's result."""
    return Measured(reply.get("status", "failed"), "—", None, "failed", reply.get("note", ""), reply)


def _failed(e: Exception) -> Measured:
    """hoad (or a baseline) raised before it could be measured: that is this line's result."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return Measured(f"error: {type(e).__name__}", "—", None, "failed", f"{type(e).__name__}: {first}")


# ---------------------------------------------------------------------- issue 3: eager speed
def _eager(p: Problem, **options) -> tuple[HoadContender, dict]:
    return fixed_hoad(p, backend="eager", **options), reference(p)


def hessian_at_point(budget: Budget) -> list[Measured]:
    p = workloads.tanh_mlp(2, None)()
    return [ratio(_eager(p), [(torch_func(p), reference(p))], budget)]


def order3_at_point(budget: Budget) -> list[Measured]:
    p = workloads.tanh_mlp(3, None)()
    return [ratio(_eager(p), [(torch_func(p), reference(p))], budget)]


def auto_vs_forward(budget: Budget) -> list[Measured]:
    p = workloads.tanh_mlp(2, None)()
    ref = reference(p)
    forward = fixed_hoad(p, "hoad forward", backend="eager", mode="forward")
    return [ratio((fixed_hoad(p, "hoad auto", backend="eager", mode="auto"), ref), [(forward, ref)], budget)]


def parameter_hessian(budget: Budget) -> list[Measured]:
    p = workloads.classifier_loss()()
    return [ratio(_eager(p), [(torch_func(p), reference(p))], budget)]


# ------------------------------------------------------------- issue 4: per-sample structure
def per_sample_hessians(budget: Budget) -> list[Measured]:
    p = workloads.tanh_mlp(2, 256)()
    ref = reference(p)

    def row_of_batch(x):  # the batched function, on a batch of one
        return p.fn(x.unsqueeze(0)).squeeze(0)

    baselines = [(torch_func_of(p, "point", "vmap(hessian(point_fn))"), ref),
                 (torch_func_of(p, "row", "vmap(hessian(row_of_batched_fn))", row_of_batch), ref)]
    return [ratio(_eager(p, batch_dim=0), baselines, budget)]


MEMORY_BATCH = 4096


def memory_growth(budget: Budget) -> list[Measured]:
    return [_memory(backend) for backend in ("eager", "inductor")]


def _memory(backend: str) -> Measured:
    # malloc as the system has it: blocks that hoad's malloc setting keeps from the checking call
    # would otherwise be reused by the measured one and hide part of its working set
    reply = run_fresh(["memory", backend, str(MEMORY_BATCH), "3"], timeout_s=600, environ={"HOAD_MALLOC": "system"})
    if reply.get("status") != "ok":
        return _fresh_failed(reply)
    note = (f"hoad ({reply['config']}): one call {reply['call_s']:.2f} s (first call, compile included: "
            f"{reply['first_call_s']:.1f} s; first {reply['checked_rows']} samples checked)")
    return Measured(f"{reply['growth_mb']:.0f} MB, {reply['call_s']:.2f} s", "—", reply["growth_mb"], note=note,
                    detail=reply)


DENSE_BATCH = 64


def dense_vs_compact(budget: Budget) -> list[Measured]:
    per_row = workloads.tanh_mlp(2, DENSE_BATCH)()

    def summed(X):  # F(X) = Σ_b g(X_b)
        return per_row.fn(X).sum(0)

    dense = Problem(summed, per_row.args, 2)
    sides = [(fixed_hoad(dense, "dense", backend="eager"), reference(dense)),
             (fixed_hoad(per_row, "compact", backend="eager", batch_dim=0), reference(per_row))]
    return [ratio(sides[0], sides[1:], budget)]


SEED_BATCHES = (10, 20, 40, 80)


def seed_mlp_scaling(budget: Budget) -> list[Measured]:
    problems = {b: workloads.seed_mlp_per_sample(b)() for b in SEED_BATCHES}
    entries = [(fixed_hoad(p, f"B={b}", backend="eager", batch_dim=0), reference(p)) for b, p in problems.items()]
    outcomes = measure(entries, budget)
    first, last = outcomes[f"B={SEED_BATCHES[0]}"], outcomes[f"B={SEED_BATCHES[-1]}"]
    both = median(first.times) is not None and median(last.times) is not None
    value = median(last.times) / median(first.times) if both else None
    status = "ok" if both else "failed"
    return [Measured(_ms(last), _ms(first), value, status, _summary(outcomes), _detail(outcomes))]


ELEMENTS = 10**6


def elementwise_order3(budget: Budget) -> list[Measured]:
    """Order 3 of torch.sin, per element (batch_dim=0), against three plain elementwise kernels on
    the same tensor: the yardstick the issue names (its own outputs are what it is checked on)."""
    x = torch.randn(ELEMENTS, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p = Problem(torch.sin, (x,), 3, per_sample=True)
    ref = reference(p)

    def three():
        return {"sin": torch.sin(x), "cos": torch.cos(x), "exp": torch.exp(x)}

    yardstick = (InProcess("three kernels", "torch.sin, torch.cos, torch.exp (eager)", three), three())
    return [ratio((fixed_hoad(p, backend=backend, batch_dim=0), ref), [yardstick], budget)
            for backend in ("eager", "inductor")]


# ----------------------------------------------------------- issue 5: compiled, first calls
def _jax(p: Problem, budget: Budget) -> list[Measured]:
    peer = jax_jit(p)
    if isinstance(peer, Skipped):  # jax is not installed
        return [Measured("—", "skipped", None, "skipped", peer.outcome.note)]
    ref = reference(p)
    mine = fixed_hoad(p, backend="inductor", batch_dim=0 if p.per_sample else None)
    return [ratio((mine, ref), [(peer, ref)], budget)]


def order3_vs_jax(budget: Budget) -> list[Measured]:
    return _jax(workloads.tanh_mlp(3, None)(), budget)


def per_sample_vs_jax(budget: Budget) -> list[Measured]:
    return _jax(workloads.tanh_mlp(2, 256)(), budget)


def fresh_first_calls(budget: Budget) -> list[Measured]:
    """Import + compile + first call in a fresh process: with an empty Inductor cache, then with
    the cache the first process left."""
    with tempfile.TemporaryDirectory(prefix="hoad-cache-") as cache:
        where = {"HOAD_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor")}
        out = []
        for state in ("empty", "warm"):
            reply = run_fresh(["first-call"], timeout_s=600, environ=where)
            if reply.get("status") != "ok":
                out.append(_fresh_failed(reply))
                continue
            note = f"hoad ({reply['config']}): {state} cache"
            out.append(Measured(f"{reply['seconds']:.1f} s", "—", reply["seconds"], note=note, detail=reply))
        return out


# ------------------------------------------------------ issue 18: every number of samples
def new_sample_counts(budget: Budget) -> list[Measured]:
    """Per-sample Hessians (inductor, batch_dim=0): a compiled function that has seen two counts
    (100 and 128 samples, which build the program for every count) called with a third (256):
    that call's time; then its steady state against a program compiled for 256 samples alone."""
    p = workloads.tanh_mlp(2, 256)()
    ref = reference(p)
    try:
        general = hoad.compile(p.fn, order=p.order, wrt=p.wrt, backend="inductor", batch_dim=0)
        general(p.sample[:100])
        general(p.sample[:128])
        start = time.perf_counter()
        general(*p.args)
        first = time.perf_counter() - start
    except hoad.HoadError as e:
        return [_failed(e), _failed(e)]
    if not any(e.build.stats.get("any_samples") for e in general._cache.values()):
        note = "no general program was built (the structure depends on the count)"
        return [Measured("none", "—", None, "failed", note), Measured("none", "—", None, "failed", note)]
    option = HoadOption("inductor", "batch_dim")
    mine = HoadContender("hoad, every count", general, option, functools.partial(hoad_answer, p, general, option))
    static = fixed_hoad(p, name="hoad, 256 only", backend="inductor", batch_dim=0)
    return [Measured(f"{first * 1e3:.1f} ms", "—", first, note="first call at a third count, nothing built"),
            ratio((mine, ref), [(static, ref)], budget)]


# ---------------------------------------------------------------- issue 7: model parameters
class Classifier(nn.Module):
    """The classifier of :func:`benchmarks.workloads.classifier_loss` as a module."""

    def __init__(self, A1, c1, A2, c2):
        super().__init__()
        self.hidden, self.out = nn.Linear(*A1.shape, dtype=A1.dtype), nn.Linear(*A2.shape, dtype=A2.dtype)
        with torch.no_grad():
            for layer, A, c in ((self.hidden, A1, c1), (self.out, A2, c2)):
                layer.weight.copy_(A.T)
                layer.bias.copy_(c)

    def forward(self, X):
        return self.out(torch.tanh(self.hidden(X)))

    @hoad.compile(order=2, wrt=hoad.parameters)
    def loss(self, X, y):
        return F.cross_entropy(self(X), y)


def module_parameter_hessian(budget: Budget) -> list[Measured]:
    *weights, X, y = workloads.classifier_loss()().args
    model = Classifier(*weights)
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_of(params):
        return F.cross_entropy(torch.func.functional_call(model, params, (X,)), y)

    def loss_of_values(*values):  # the same loss with the parameters as positional arguments
        return loss_of(dict(zip(names, values)))

    p = Problem(loss_of_values, tuple(params.values()), 2, wrt=tuple(range(len(names))))

    def hoad_blocks(every_order: bool):
        res = model.loss(X, y)
        orders = range(1, 3) if every_order else [2]
        return {K: res[tuple(names[i] for i in K)] for k in orders for K in canonical(len(names), k)}

    def func_blocks():
        out = torch.func.hessian(loss_of)(params)
        return {(i, j): out[names[i]][names[j]] for i, j in canonical(len(names), 2)}

    ref = reference(p)
    mine = HoadContender("hoad", model.loss, HoadOption(model.loss.config.backend, "dense"), hoad_blocks)
    measured = ratio((mine, ref), [(InProcess("torch.func", "hessian(functional_call)", func_blocks), ref)], budget)
    measured.hoad += f" ({sum(t.numel() for t in params.values())} parameters)"
    return [measured]


# ------------------------------------------- issues 15 and 16: read off this run's workloads
def _seconds_cell(o: dict) -> str:
    if o.get("median_s") is None:
        return o.get("status", "—") if o.get("status") != "ok" else "not timed"
    ms = o["median_s"] * 1e3
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


@dataclass(frozen=True)
class FromWorkloads:
    """A line per workload: hoad's column (``mine``) over the fastest of ``baselines`` (None: every
    column that is not hoad's), all from that workload's record in this run. A baseline that failed
    or is not installed is left out (the note says so); one that this run left out (``--quick``,
    ``--no-compile``) makes the line skipped rather than measured against fewer peers."""

    mine: str = "hoad"
    baselines: tuple[str, ...] | None = None

    def __call__(self, records: dict[str, dict | None], ids: tuple[str, ...]) -> list[Measured]:
        return [self.line(records.get(i), i) for i in ids]

    def line(self, record: dict | None, workload_id: str) -> Measured:
        if record is None:
            return Measured("—", "—", None, "skipped",
                            f"{workload_id} is not in this run (python -m benchmarks --only {workload_id})")
        outcomes = record["outcomes"]
        mine = outcomes.get(self.mine, {"status": "missing"})
        names = self.baselines or tuple(n for n in outcomes if not n.startswith("hoad"))
        timed, left_out, failed = {}, [], []
        for name in names:
            o = outcomes.get(name, {"status": "skipped", "note": "no such column"})
            if o.get("median_s") is not None:
                timed[name] = o["median_s"]
            elif o["status"] == "skipped":
                left_out.append(f"{name} ({o.get('note', '')})")
            else:
                failed.append(f"{name}: {o['status']}" + (f" ({o['note']})" if o.get("note") else ""))
        notes = [f"{n} ({o.get('config', '')}): {_seconds_cell(o)}" for n, o in outcomes.items()
                 if n == self.mine or n in names]
        notes += [f"not compared: {f}" for f in failed]
        if left_out:
            return Measured(_seconds_cell(mine), "—", None, "skipped",
                            "; ".join([f"left out of this run: {', '.join(left_out)}", *notes]), outcomes)
        if mine.get("median_s") is None or not timed:
            return Measured(_seconds_cell(mine), "—", None, "failed", "; ".join(notes), outcomes)
        best = min(timed, key=timed.get)
        baseline = _seconds_cell(outcomes[best]) + (f" ({best})" if len(names) > 1 else "")
        return Measured(_seconds_cell(mine), baseline, mine["median_s"] / timed[best], "ok", "; ".join(notes),
                        outcomes)


OPERATOR_IDS = tuple(w.id for w in workloads.OPERATOR_WORKLOADS)
TRAIN_IDS = tuple(w.id for w in workloads.TRAIN_WORKLOADS)
SHARED_PARAM_IDS = tuple(w.id for w in workloads.WORKLOADS if w.id.startswith("per-sample-params/"))
JET_IDS = tuple(w.id for w in workloads.JET_WORKLOADS)
# issue 45: orders >= 4 at a point, dense and packed=True
HIGHER_ORDER_IDS = tuple(w.id for w in workloads.WORKLOADS
                         if w.id.startswith("higher-orders/") and "/order3" not in w.id)


def _train_lines(records: dict[str, dict | None], ids: tuple[str, ...]) -> list[Measured]:
    """Per training workload: hoad over torch.func, then hoad over the best peer."""
    out = []
    for i in ids:
        out += [FromWorkloads(baselines=("torch.func",)).line(records.get(i), i),
                FromWorkloads().line(records.get(i), i)]
    return out


# ------------------------------------------------------------------------------ the registry
TARGETS: list[Target] = [
    Target(1, 3, (Line("Hessian, tanh MLP, one point (eager)", "torch.func.hessian", Goal(0.5)),),
           hessian_at_point),
    Target(2, 3, (Line("3rd order, tanh MLP, one point (eager)", "jacfwd(jacfwd(jacrev))", Goal(0.5)),),
           order3_at_point),
    Target(3, 3, (Line("Hessian, tanh MLP, one point (eager), mode=auto", "hoad mode=forward", Goal(0.5)),),
           auto_vs_forward),
    Target(4, 3, (Line("Hessian of a 10-32-5 classifier loss, all 4 parameter tensors (eager)",
                       "torch.func.hessian(argnums=(0,1,2,3))", Goal(1)),), parameter_hessian),
    Target(5, 4, (Line("per-sample Hessians, X (256, 16) (eager, batch_dim=0)",
                       "faster of vmap(hessian(point_fn)), vmap(hessian(row_of_batched_fn))", Goal(0.5)),),
           per_sample_hessians),
    Target(6, 4, tuple(Line(f"per-sample order 3, B={MEMORY_BATCH}: peak memory growth of one call, call time "
                            f"({backend}, batch_dim=0)", "—", Goal(1500, "MB", strict=True))
                       for backend in ("eager", "inductor")), memory_growth),
    Target(7, 4, (Line(f"Hessian of Σ_b g(X_b), B={DENSE_BATCH}: dense (B,16,B,16), no batch_dim (eager)",
                       "per-row g with batch_dim=0 (compact)", Goal(4)),), dense_vs_compact),
    Target(8, 4, (Line(f"seed MLP per-sample Hessian w.r.t. X (eager, batch_dim=0): time at B={SEED_BATCHES[-1]}",
                       f"time at B={SEED_BATCHES[0]}", Goal(8)),), seed_mlp_scaling),
    Target(9, 5, (Line("3rd order, tanh MLP, one point (inductor)", "jax.jit(jacfwd(jacfwd(jacrev)))", Goal(1)),),
           order3_vs_jax),
    Target(10, 5, (Line("per-sample Hessians, X (256, 16) (inductor, batch_dim=0)", "jax.jit(vmap(hessian))",
                        Goal(1)),), per_sample_vs_jax),
    Target(11, 5, (Line("fresh process: import + compile + first call, order 3 at a point, empty Inductor cache",
                        "—", Goal(60, "s")),
                   Line("the same, second fresh process, warm cache", "—", Goal(8, "s"))), fresh_first_calls),
    Target(12, 7, (Line("Hessian of a classifier's cross-entropy w.r.t. hoad.parameters, @hoad.compile "
                        "on a module method", "torch.func.hessian(functional_call)", Goal(1)),),
           module_parameter_hessian),
    Target(13, 4, tuple(Line(f"order 3 of torch.sin on {ELEMENTS:.0e} elements ({backend}, batch_dim=0): "
                             "value and 3 derivatives", "three elementwise kernels (sin, cos, exp; eager)",
                             Goal(1.5)) for backend in ("eager", "inductor")), elementwise_order3),
    Target(14, 16, tuple(Line(f"{workloads.get(i).label} (hoad.{'biharmonic' if 'biharmonic' in i else 'laplacian'}, "
                              "inductor, batch_dim=0)", "faster of folx and torch-jet compiled", Goal(0.5))
                         for i in OPERATOR_IDS),
           FromWorkloads(baselines=("folx", "torch-jet compiled")), workloads=OPERATOR_IDS),
    Target(15, 15, tuple(Line(f"training step, {workloads.get(i).label}: hoad.laplacian + backward (inductor)",
                              baseline, Goal(limit))
                         for i in TRAIN_IDS
                         for baseline, limit in (("torch.func (grad of vmap(hessian))", 0.25),
                                                 ("best peer (torch.func, torch.compile, JAX, folx, torch-jet)", 0.5))),
           _train_lines, workloads=TRAIN_IDS),
    Target(16, 18, (Line("per-sample Hessians, tanh MLP (inductor, batch_dim=0): first call at a new count "
                         "(256 after 100 and 128)", "—", Goal(1, "s", strict=True)),
                    Line("the same program's steady state at 256 samples", "a program compiled for 256 alone",
                         Goal(1.1))), new_sample_counts),
    Target(17, 47, tuple(Line(f"{workloads.get(i).label} (inductor, batch_dim=0, wrt=parameters)",
                              "faster of vmap(grad|hessian) and torch.compile of it",
                              Goal(1 if i.endswith("/grad") else 0.5)) for i in SHARED_PARAM_IDS),
           FromWorkloads(baselines=("torch.func", "torch.compile")), workloads=SHARED_PARAM_IDS),
    # every column but hoad's: torch-jet eager and compiled, and folx where it has the operator
    Target(18, 44, tuple(Line(f"{workloads.get(i).label} (inductor, batch_dim=0)",
                              "faster of torch-jet, torch-jet compiled" + (", folx" if "laplacian" in i else ""),
                              Goal(0.5)) for i in JET_IDS),
           FromWorkloads(), workloads=JET_IDS),
    Target(19, 45, tuple(Line(f"{workloads.get(i).label} (inductor)", "jax.jit of nested jacfwd, jacrev", Goal(0.1))
                         for i in HIGHER_ORDER_IDS),
           FromWorkloads(baselines=("jax.jit",)), workloads=HIGHER_ORDER_IDS),
]


def _workload_records(t: Target, settings: Settings, records: dict[str, dict]) -> dict[str, dict | None]:
    """The records of ``t``'s workloads from this run; without --quick, a missing one is run now
    (``--targets`` runs no workloads of its own)."""
    out = {}
    for i in t.workloads:
        if i not in records and not settings.quick:
            print(f"    running {i} for target {t.row}", file=sys.stderr, flush=True)
            records[i] = run_workload(workloads.get(i), settings)
        out[i] = records.get(i)
    return out


def run_targets(settings: Settings, workload_records: list[dict] | None = None) -> list[dict]:
    """Every line of :data:`TARGETS`, measured (or read off ``workload_records``, this run's), as
    records for the results file."""
    budget = settings.budget
    by_id = {r["id"]: r for r in workload_records or []}
    records = []
    for t in TARGETS:
        print(f"[target {t.row}] issue {t.issue}: {t.lines[0].hoad}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            measured = t.measure(_workload_records(t, settings, by_id), t.workloads) if t.workloads \
                else t.measure(budget)
        except Exception as e:  # noqa: BLE001 - hoad raising outside a contender is a result too
            measured = [_failed(e)] * len(t.lines)
        seconds = time.perf_counter() - start
        for line, m in zip(t.lines, measured):
            records.append({"row": t.row, "issue": t.issue, "hoad": line.hoad, "baseline": line.baseline,
                            "target": str(line.goal), "limit": line.goal.limit, "unit": line.goal.unit,
                            "hoad_cell": m.hoad, "baseline_cell": m.baseline, "value": m.value,
                            "met": line.goal.met(m.value) if m.status != "skipped" else None,
                            "status": m.status, "note": m.note, "detail": m.detail, "seconds": seconds})
    return records


