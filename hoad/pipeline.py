"""The pipeline, declared once: capture → differentiate → prune → clean → lower → hoist → choose → plan → compile.

Each stage takes the :class:`Build` so far and returns it with its own product filled in; the
list :data:`PIPELINE` is the architecture, every rewrite named. Node counts and times of each
stage and rewrite land in ``build.stats`` for :func:`hoad.explain`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from hoad.algebra import EAGER, Target
from hoad.algebra.multiindex import key_name
from hoad.algebra.target import Recorded
from hoad.binding import CallLayout, Keyword, Source, StateEntry, every_source, untouched
from hoad.budget import Budget, default_budget, human
from hoad.distributed import share_of
from hoad.errors import CaptureError, HoadError, HoadInternalError, InvalidArgumentError, first_line
from hoad.explanation import Explanation
from hoad.lowering.inductor import cpu_codegen_problem, this_machine
from hoad.lowering.kernels import in_background
from hoad.passes import clean, over_reverse
from hoad.passes.capture import REWRITES, Captured, capture
from hoad.passes.clean import fold_broadcasts, own_outputs
from hoad.passes.compile import cache_job, compile_program, eager_program
from hoad.passes.cost import estimate
from hoad.passes.decompositions import decomposition_table
from hoad.passes.differentiate import Overgrown, differentiate
from hoad.passes.dynamic import difference, generalize
from hoad.passes.hoist import Prefix, hoist
from hoad.passes.lower import fuse_jet_squares, lower_products, sink_permutes
from hoad.passes.memory import memory_plan
from hoad.passes.program import OperatorInputs, Program
from hoad.passes.prune import prune
from hoad.passes.rewrite import calls, rewrite
from hoad.passes.samples import keep_samples_apart
from hoad.progress import Progress
from hoad.rules import USER_OPS
from hoad.source import locate
from hoad.tiers import Tiered

log = logging.getLogger(__name__)


@dataclass
class Config:
    """The options a program is built with: order, backend, mode, samples, diagonal, operator."""

    order: int
    backend: str = "inductor"
    mode: str = "auto"          # "forward", "reverse", "forward-over-reverse", or "auto": the cheapest
    batch_dim: int | None = None  # 0: dim 0 of the output and of every wrt input indexes samples
    diagonal: bool = False        # pure derivatives only (∂²/∂x_i², the diagonal of each block)
    operator: OperatorSpec | None = None   # a differential operator (hoad.operators)
    nestable: bool = False        # the program will be differentiated again (per sample: no mixed rows)
    target: Target | None = None  # how products become ops; None: the backend's (tests pass their own)
    memory_budget: float | None = None  # bytes a program may plan to use; None: a share of free memory
    chunk_size: int | None = None       # samples per run under batch_dim (the program is built for them)
    split_blocks: Any = None            # True or a process group: the top order's blocks dealt to its ranks
    # under batch_dim: the program of this function built for another number of samples; when the
    # two differ only in sample counts, the compiled program serves every count (passes/dynamic.py)
    sized: Sized | None = None

    def resolve_target(self) -> Target:
        """The program's target. For Inductor this prepares hoad's kernel library, so that a
        build never starts in the middle of a trace."""
        if self.target is not None:
            return self.target
        lowering = this_machine() if self.backend == "inductor" else EAGER
        return Target(lowering, sample_axes=self.nestable)

    @property
    def directions(self) -> tuple[str, ...]:
        if self.sized is not None:  # (the first build's: the costs of the two may cross between counts)
            return (self.sized.direction,)
        return ("forward", "reverse") if self.mode == "auto" else (self.mode,)


@dataclass(frozen=True)
class Sized:
    """A function's program as built for one number of samples, which a build for another count
    compares its own with. That build takes the same direction and the same lowering choices
    (:class:`~hoad.algebra.target.Recorded`), so that where the function uses the count as a size
    alone the two programs differ in sizes alone."""

    gm: fx.GraphModule                 # the main program
    captured: fx.GraphModule           # the function's trace
    samples: int
    prefix: fx.GraphModule | None      # its hoisted part
    direction: str
    choices: tuple                     # the lowering's choices by size, in order
    lazy: bool = True                  # whether its jets stayed lazy (see _weigh_evaluated_jets)

    @staticmethod
    def of(b: Build) -> Sized:
        p = b.program
        return Sized(p.gm, b.captured.gm, b.captured.out_shape[0], p.prefix, p.direction, p.stats["choices"],
                     b.target.lazy)


@dataclass(frozen=True)
class OperatorSpec:
    """How an operator's extra inputs arrive: keyword tensors of the call (hoad.operators)."""

    collapse: int | None = None          # the order summed over the directions (2: Laplacian)
    directions: str | None = None        # keyword carrying the directions V (S, *x)
    weights: str | None = None           # keyword carrying the collapse's weights (S,)

    def inputs(self, layout: CallLayout) -> OperatorInputs:
        def leaf(name):
            return None if name is None else layout.leaf(Keyword(name))

        return OperatorInputs(leaf(self.directions), self.collapse, leaf(self.weights))


@dataclass
class Build:
    """Everything one call signature's compilation produces."""

    fn: Callable
    layout: CallLayout
    tensors: Sequence[torch.Tensor]      # the program's inputs: the call's tensor leaves, then free tensors
    wrt_leaves: list[int]
    config: Config
    roots: dict = field(default_factory=dict)   # where free tensors are searched for (hoad.binding)
    sources: list[Source | None] = field(default_factory=list)   # one per free tensor
    also: list[tuple[Source, ...]] = field(default_factory=list)  # each free tensor's other sources
    target: Target | None = None
    lowerings: dict[str, Recorded] = field(default_factory=dict)  # each candidate's, its choices recorded
    captured: Captured | None = None
    candidates: dict[str, Program] = field(default_factory=dict)
    program: Program | None = None
    prefix: Prefix | None = None         # the hoisted part, run before main when its inputs changed
    main: Callable | None = None         # the compiled program (after the prefix)
    run: Callable | None = None          # prefix and main together: run(*tensors) -> outputs
    samples: list[int] = field(default_factory=list)   # inputs whose dim 0 is a symbol in the compiled main
    shared: frozenset = frozenset()      # under batch_dim, the wrt positions every sample shares (parameters)
    # under batch_dim, the inputs that hold the samples in dim 0: the wrt inputs other than
    # parameters, or where wrt names parameters only, the call's tensors with a row per sample
    sample_leaves: list[int] = field(default_factory=list)
    sample_wrt: int = 0  # how many of them lead: the rest are other tensors that had a row per sample
    # what the API reads at call time, so that it walks no graph: the inputs the program writes
    # into (in place), user ops of hoad.extend in it, the plan against the memory budget
    written: set[int] = field(default_factory=set)
    user_ops: list = field(default_factory=list)
    budget: Budget | None = None
    stats: dict = field(default_factory=dict)
    # its twin with jets evaluated, built before the lazy candidates where those may multiply out
    # (_evaluated_first)
    evaluated: Build | None = None

    @property
    def n_user(self) -> int:
        """How many of ``tensors`` are the call's own leaves (the free tensors follow)."""
        return len(self.tensors) - len(self.captured.free)

    @functools.cached_property
    def shared_bytes(self) -> int:
        """Bytes of the program's inputs that are not per sample (parameters, free tensors): a
        chunk of any number of samples holds all of them. (Not the hoisted terms of weights
        alone: a program for fewer samples may hoist fewer, as the cost model finds them worth it.)
        Read once the build is done (each call of the program for every count checks its budget)."""
        count = self.captured.out_shape[0] if self.captured.out_shape else None
        places = list(self.layout.places) + [None] * len(self.captured.free)
        return sum(t.numel() * t.element_size() for i, (t, place) in enumerate(zip(self.tensors, places))
                   if i >= self.n_user or isinstance(place, StateEntry) or not t.ndim or t.shape[0] != count)


def _capture(b: Build) -> Build:
    def name_free(free: list[torch.Tensor]) -> list[str]:
        paths = every_source(b.roots, free)
        b.sources, b.also = [p[0] if p else None for p in paths], [p[1:] for p in paths]
        return [s.name if s is not None else f"c{i}" for i, s in enumerate(b.sources)]

    rewrites: dict = {}
    b.stats["capture"] = {"rewrites": rewrites}
    with untouched(b.roots) as rebound:
        b.captured = capture(b.fn, b.layout, b.tensors, b.wrt_leaves, name_free=name_free,
                             batched=b.config.batch_dim is not None, stats=rewrites)
    b.tensors = list(b.tensors) + b.captured.free
    b.written = b.captured.written
    b.user_ops = list(dict.fromkeys(n.target for n in b.captured.gm.graph.nodes if n.target in USER_OPS))
    _check_stores(b, rebound)
    if b.config.batch_dim is not None:
        out = b.captured.out_shape
        if not out:
            raise InvalidArgumentError("batch_dim=0 needs an output whose dim 0 indexes the samples, but the function "
                                       "returns a scalar; return one value per sample (e.g. drop the final .sum())")
        shared = []
        for k, leaf in enumerate(b.wrt_leaves):
            shape = tuple(b.tensors[leaf].shape)
            if isinstance(b.layout.places[leaf], StateEntry):  # a parameter: every sample shares it
                shared.append(k)
            elif not shape or shape[0] != out[0]:
                raise InvalidArgumentError(
                    f"batch_dim=0: wrt input {b.layout.names[leaf]!r} has shape {shape}, but the output has {out[0]} "
                    "samples along dim 0; every wrt input must have the same number of samples in dim 0 (a tensor "
                    "that every sample shares is a module's parameter or buffer: hold it in a torch.nn.Module and "
                    "name it in wrt by its name, as in wrt=['layer.weight'])")
        b.shared = frozenset(shared)
        rows = [i for i, t in enumerate(b.tensors[:b.n_user]) if t.ndim and t.shape[0] == out[0]
                and not isinstance(b.layout.places[i], StateEntry)]
        wrt_rows = [leaf for k, leaf in enumerate(b.wrt_leaves) if k not in b.shared]
        # the wrt inputs first (the count a later call is read from), then the call's other tensors
        # with a row per sample (a loss's labels): their counts change together
        b.sample_leaves = wrt_rows + [i for i in rows if i not in wrt_rows] if wrt_rows else rows
        b.sample_wrt = len(wrt_rows) or len(rows)
    _settle(b.captured, b.config, rewrites)
    return b


def _settle(captured: Captured, config: Config, stats: dict | None = None) -> None:
    """The rewrites every captured program gets after capture's own: samples kept apart
    (batch_dim), broadcasts folded."""
    wrt = captured.wrt_leaves
    rewrite(captured.gm, [(name, lambda gm, step=step: step(gm, wrt)) for name, (step, wanted) in SETTLE.items()
                          if wanted(config)], stats)


# the rewrites of a captured graph after capture's own, by name: (the rewrite, which builds want it)
SETTLE: dict[str, tuple[Callable, Callable[[Config], bool]]] = {
    "keep_samples_apart": (keep_samples_apart, lambda config: config.batch_dim is not None),
    "fold_broadcasts": (fold_broadcasts, lambda config: True),
}


def _check_stores(b: Build, rebound: list) -> None:
    """Tensors the trace stored on objects (see :func:`hoad.binding.untouched`), now restored. A
    store into a tensor the program writes in place (spectral norm's ``out=self._u``) is replayed
    at every call, and so is a compiled module's buffer assignment. Assigning a new tensor to a
    buffer reached otherwise (``self.ema = 0.9 * self.ema + ...``) is state the program would
    drop: refused. Any other store (a hook's features, a cached
    activation) is a value of the trace's Python, which calls do not run: a warning."""
    n = b.n_user
    written = {id(b.tensors[i]) for i in b.written if i >= n}
    caches = [r.where for r in rebound if r.cache]
    if caches:
        log.info("hoad: tracing %s filled %s with values of its trace; hoad emptied them, so that calls outside "
                 "compute those values again", name_of(b.fn), ", ".join(caches))
    left = [r for r in rebound if not r.cache and not (isinstance(r.old, torch.Tensor) and id(r.old) in written)]
    if any(isinstance(place, StateEntry) for place in b.layout.places):
        # a compiled module: its state is the program's input, assignments were written back
        # (hoad.api), and what is left in its tables is reparametrization's
        left = [r for r in left if not r.buffer]
    buffers = [r.where for r in left if r.buffer]
    if buffers:
        raise CaptureError(
            f"the function assigns a new tensor to the module state {', '.join(buffers)}; a derivative program "
            "replays in-place updates of buffers (as batch norm's running statistics) but not assignments. Update "
            "it in place, e.g. self.ema.mul_(0.9).add_(0.1 * value.detach()), or outside the compiled function")
    if left:
        log.warning("hoad: tracing %s stored tensors on objects (%s); hoad put the old values back, since its "
                    "program does not run the function's Python: values saved that way (a hook's features, a cached "
                    "activation) are not updated by its calls", name_of(b.fn), ", ".join(r.where for r in left))


def name_of(fn) -> str:
    """The user's function (or module class) behind ``fn``, which may be hoad's wrapper method."""
    fn = getattr(getattr(fn, "__self__", None), "fn", fn)
    while isinstance(fn, functools.partial):  # (a decorated method of a plain object: the method, self bound)
        fn = fn.func
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _differentiate(b: Build) -> Build:
    where = lambda node: locate(b.fn, b.layout, b.tensors, node, decomposed=decomposition_table())  # noqa: E731
    op = b.config.operator.inputs(b.layout) if b.config.operator is not None else None
    b.target = b.config.resolve_target()
    if b.config.sized is not None and not b.config.sized.lazy:
        b.target = dataclasses.replace(b.target, lazy=False)
    share = share_of(b.config.split_blocks) if b.config.split_blocks is not None else None
    replay = b.config.sized.choices if b.config.sized is not None else ()
    b.evaluated = _evaluated_first(b)
    for d in b.config.directions:
        lowering = b.lowerings[d] = Recorded(b.target.lowering, replay)
        target = dataclasses.replace(b.target, lowering=lowering)
        if d == over_reverse.NAME:
            b.candidates[d] = over_reverse.forward_over_reverse(b.captured, where, b.config.batch_dim, target,
                                                                b.shared, op, share)
            continue
        twin = b.evaluated.candidates.get(d) if b.evaluated is not None else None
        limit = None if twin is None else tuple(LAZY_GROWTH * n for n in twin.stats["traced"])
        try:
            p = differentiate(b.captured, b.config.order, d, where=where, batch_dim=b.config.batch_dim,
                              target=target, diagonal=b.config.diagonal, operator=op, share=share,
                              shared=b.shared, node_limit=limit)
        except Overgrown as e:
            b.stats.setdefault("dropped", {})[d] = e.nodes
            del b.lowerings[d]
            continue
        b.candidates[d] = p
    # (Inductor only: the eager program's many small tangent ops cost more than the estimate says,
    # 1.3-2.1x the adjoint form on parameter Hessians the estimate gave to it; under Inductor the
    # same programs ran 0.49-1.04x, and a transformer block's per-sample Hessian 0.21x)
    if b.config.mode == "auto" and b.config.sized is None and b.config.backend == "inductor" and b.target.lazy and \
            over_reverse.worth_building(b.captured, b.config.order, b.config.diagonal, op, share,
                                        b.config.batch_dim, b.shared):
        lowering = b.lowerings[over_reverse.NAME] = Recorded(b.target.lowering, ())
        nested = over_reverse.candidate(b.captured, where, b.config.batch_dim,
                                        dataclasses.replace(b.target, lowering=lowering), b.shared)
        if nested is not None:
            b.candidates[over_reverse.NAME] = nested
    return b


def _prune(b: Build) -> Build:
    _rewrite_candidates(b, "prune", lambda d: (("prune", prune),))
    return b


def _clean(b: Build) -> Build:
    _rewrite_candidates(b, "clean", lambda d: clean.steps(b.captured.samples(b.config.batch_dim)))
    return b


# the lowering's rewrites, in order: each reads the candidate's lowering
LOWERING: dict[str, Callable] = {"fuse_jet_squares": fuse_jet_squares, "lower_products": lower_products,
                                 "sink_permutes": sink_permutes}


def _lower(b: Build) -> Build:
    """Matrix products as the target's lowering prefers them (hoad::mm, fused reductions)."""
    _rewrite_candidates(b, "lower", lambda d: [(name, lambda gm, step=step: step(gm, b.lowerings[d]))
                                               for name, step in LOWERING.items()])
    for d, p in b.candidates.items():
        p.stats["choices"] = tuple(b.lowerings[d].made)
    return b


def _rewrite_candidates(b: Build, stage: str, steps_of: Callable[[str], Sequence]) -> None:
    """Run each candidate's rewrites (``steps_of(direction)``) under the driver; each rewrite's
    time is summed over the candidates, its node count kept per candidate."""
    rewrites = b.stats.setdefault(stage, {}).setdefault("rewrites", {})
    for d, p in b.candidates.items():
        mine: dict = {}
        p.gm = rewrite(p.gm, steps_of(d), mine)
        for name, s in mine.items():
            into = rewrites.setdefault(name, {"seconds": 0.0, "nodes": {}, "changed": False})
            into["seconds"] += s["seconds"]
            into["nodes"][d] = s["nodes"]
            into["changed"] |= s["changed"]


def _hoist(b: Build) -> Build:
    """Split off what the free tensors alone determine; it is reused while they do not change."""
    for p in b.candidates.values():
        p.prefix, p.gm, p.prefix_reads = hoist(p.gm, len(b.captured.free), b.captured.samples(b.config.batch_dim))
        p.stats["hoisted"] = 0 if p.prefix is None else len(p.prefix.graph.output_node().args[0])
    return b


def _choose(b: Build) -> Build:
    """Keep the candidate with the lowest estimated cost (the only one unless mode="auto")."""
    for p in b.candidates.values():
        p.stats["cost"] = estimate(p.gm, b.config.backend)
    b.program = min(b.candidates.values(), key=lambda p: p.stats["cost"]["score"]) if b.candidates else None
    b.stats["costs"] = {d: p.stats["cost"] for d, p in b.candidates.items()}
    if b.program is None or (b.target.lazy and b.config.target is None and b.config.sized is None and
                             b.program.direction in ("forward", "reverse") and
                             (b.program.stats["cost"]["score"] > EVALUATED_SCORE or b.stats.get("dropped"))):
        _weigh_evaluated_jets(b)
    b.stats["direction"] = b.program.direction
    if b.config.mode != "auto" and b.config.sized is None and b.program.stats["cost"]["score"] > WEIGH_OTHER_SCORE:
        _weigh_the_other_direction(b)
    return b


# a program estimated above this (about 0.1 GFLOP: calls of 10 ms or more) is built a second time
# with its jets evaluated (see _weigh_evaluated_jets); below it, that build costs more than it saves
EVALUATED_SCORE = 1e8
EVALUATED = ", jets evaluated"  # (the costs table's name for such a twin of a direction)


def _weigh_evaluated_jets(b: Build) -> None:
    """Build the candidates again with jets of order >= 2 evaluated as they are formed (a Target
    with ``lazy=False``), and keep the cheapest of all by the estimate.

    Lazy jets let a contraction with the adjoint reassociate a remainder (an MLP's order 5 at a
    point: 3.0 against 6.3 ms evaluated, eager), but where jets pass through wide layers, a lazy sum
    reaches each weight term by term and products of sums multiply out: a 4-jet of the torch-jet
    paper's network (768-wide) ran 8 products per layer where its 4 coefficients need 4, 43
    against 23 ms (eager), and built in 6.0 against 0.8 s. The estimate ranked the two right on
    the 8 programs measured (both ways)."""
    twin = b.evaluated if b.evaluated is not None else _evaluated_twin(b)
    if twin is None:
        return  # (the estimate of the lazy build stands)
    for d, p in twin.candidates.items():
        p.stats["cost"] = estimate(p.gm, b.config.backend)
        p.stats["label"] = d + EVALUATED
        b.stats["costs"][d + EVALUATED] = p.stats["cost"]
    best = min(twin.candidates.values(), key=lambda p: p.stats["cost"]["score"])
    if b.program is None or best.stats["cost"]["score"] < b.program.stats["cost"]["score"]:
        b.program, b.target = best, twin.target
        b.candidates.update({d + EVALUATED: p for d, p in twin.candidates.items()})


def _evaluated_twin(b: Build) -> Build | None:
    """``b`` built again with its jets evaluated as they are formed, through the hoist (None where
    that build fails: the lazy build stands)."""
    twin = _twin(b, dataclasses.replace(b.config, target=dataclasses.replace(b.target, lazy=False)))
    try:
        for stage in (_differentiate, _prune, _clean, _lower, _hoist):
            twin = stage(twin)
    except HoadError:
        return None
    return twin


# a lazy candidate stops once its transform has traced this many times the nodes its evaluated
# twin's had at the same primal node (see _evaluated_first)
LAZY_GROWTH = 2


def _evaluated_first(b: Build) -> Build | None:
    """The evaluated twin (:func:`_weigh_evaluated_jets`) of a program whose lazy jets are likely to
    multiply out, built before its lazy candidates, so that those stop early.

    Likely: the function's own FLOPs times (order + 1)² reach EVALUATED_SCORE (the twin is built
    anyway once a lazy candidate is estimated above it), or from order 3 the function multiplies
    values that vary with its input to degree 3 or more (:func:`_polynomial`). A lazy candidate whose
    transform has traced more than LAZY_GROWTH times the nodes the twin's had at the same primal
    node stops there (Overgrown), and every candidate left is weighed against the twin.

    The 4-jets along curves of the torch-jet paper's network (50-768-768-512-512-1) traced 3722
    and 4430 lazy nodes against 661 and 1135 evaluated, the evaluated reverse program was chosen
    at a third of their estimated cost, and they built in 5.8 s, 4.0 of them in the lazy
    transforms; now in 1.6-1.7 s, the same program. Along the curves of a 4-32-32-1 MLP the lazy
    program was kept (under the bound), estimated at twice the evaluated one; built in 3.4 s, now
    1.3. Other programs build as before, lazy first."""
    if not (b.target.lazy and b.config.target is None and b.config.sized is None and b.config.split_blocks is None
            and set(b.config.directions) <= {"forward", "reverse"}):  # (a forced forward-over-reverse: no twin)
        return None
    if estimate(b.captured.gm, b.config.backend)["flops"] * (b.config.order + 1) ** 2 < EVALUATED_SCORE and \
            not (b.config.order >= 3 and _polynomial(b.captured)):
        return None
    try:
        return _evaluated_twin(b)
    except Exception as e:  # noqa: BLE001 - a shortcut only: without it the build goes on as it did before it
        log.debug("the evaluated twin of %s failed before the lazy candidates: %s", name_of(b.fn), e)
        return None


_aten = torch.ops.aten
_PRODUCTS = {_aten.mul.Tensor: (0, 1), _aten.div.Tensor: (0, 1), _aten.mm.default: (0, 1),
             _aten.bmm.default: (0, 1), _aten.matmul.default: (0, 1), _aten.addmm.default: (1, 2),
             _aten.baddbmm.default: (1, 2)}  # (the positions of the two factors)


def _polynomial(captured: Captured) -> bool:
    """Whether the function multiplies values that vary with its wrt inputs to degree 3 or more
    (t·t·t: a curve's powers of t), where lazy jets multiply out whatever the sizes. Each factor
    counts once: a product adds its two factors' degrees, any other op keeps its inputs' highest
    (x·x alone is degree 2, and builds as before)."""
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    degree = {placeholders[i]: 1 for i in captured.wrt_leaves}
    for node in captured.gm.graph.nodes:
        inputs = [degree[a] for a in node.all_input_nodes if a in degree]
        if node.op != "call_function" or not inputs:
            continue
        factors = _PRODUCTS.get(node.target)
        if factors and all(isinstance(node.args[i], fx.Node) and node.args[i] in degree for i in factors):
            degree[node] = sum(degree[node.args[i]] for i in factors)
            if degree[node] >= 3:
                return True
        else:
            degree[node] = max(inputs)
    return False


def _twin(b: Build, config: Config) -> Build:
    """``b`` built again under ``config`` from its capture: the same call, the same sample family
    (the wrt inputs every sample shares, the tensors with a row per sample)."""
    twin = Build(b.fn, b.layout, b.tensors, b.wrt_leaves, config, roots=b.roots)
    twin.captured, twin.shared, twin.sample_leaves, twin.sample_wrt = b.captured, b.shared, b.sample_leaves, \
        b.sample_wrt
    return twin


# a forced direction whose program is estimated above this (about a GFLOP: a call of 0.1 s or
# more) has the other direction built too, for its estimate alone: a forced mode="forward" cost
# 370x mode="auto" (a Lennard-Jones energy of 8 atoms at order 4: 19.9 s per call against 54 ms)
WEIGH_OTHER_SCORE = 1e9
OTHER_COSTS_MORE = 10  # the factor past which a forced direction is reported


def _weigh_the_other_direction(b: Build) -> None:
    """Warn, with both estimates, where the direction the user forced is estimated to cost more
    than OTHER_COSTS_MORE times the other one."""
    forced = b.program.direction
    other = "forward" if forced == "reverse" else "reverse"
    twin = _twin(b, dataclasses.replace(b.config, mode=other))
    try:
        for stage in (_differentiate, _prune, _clean, _lower, _hoist):
            twin = stage(twin)
    except HoadError:
        return  # (the other direction cannot be built: nothing to weigh)
    # (its lazy program, unless that stopped early, and its evaluated twin where built first)
    built = [twin.candidates.get(other), twin.evaluated.candidates.get(other) if twin.evaluated else None]
    costs = [estimate(p.gm, b.config.backend) for p in built if p is not None]
    if not costs:
        return
    mine, theirs = b.program.stats["cost"], min(costs, key=lambda c: c["score"])
    b.stats["costs"][other] = theirs
    if mine["score"] > OTHER_COSTS_MORE * theirs["score"]:
        log.warning("hoad: %s's order-%d program in mode=%r is estimated at %.3g GFLOP and %s per call, mode=%r at "
                    "%.3g GFLOP and %s (%.0fx less); mode='auto' (the default) keeps the cheapest candidate",
                    name_of(b.fn), b.config.order, forced, mine["flops"] / 1e9, human(mine["bytes"]), other,
                    theirs["flops"] / 1e9, human(theirs["bytes"]), mine["score"] / max(theirs["score"], 1))


def _plan(b: Build) -> Build:
    """The memory plan of the chosen program, refused before anything runs when over budget."""
    plan = memory_plan(b.program.gm)
    c = b.config
    limit = c.memory_budget if c.memory_budget is not None else default_budget(b.tensors[b.wrt_leaves[0]].device)
    b.stats["memory"] = {"plan": plan, "budget": limit}
    count = b.program.out_shape[0] if c.batch_dim is not None else None
    b.budget = Budget(plan, limit, c.memory_budget is not None, count, b.shared_bytes if count else 0.0)
    b.budget.check_program(b.program.order, smaller_programs(c))
    return b


def smaller_programs(c: Config) -> list[str]:
    """The ways out of a memory budget that compute less, where the call does not take them already."""
    ways = []
    if c.mode != "auto":
        ways.append(f"mode='auto' (mode={c.mode!r} was asked for; the other direction may need less memory)")
    if not c.diagonal:
        ways.append("diagonal=True when pure derivatives (∂^k/∂x_i^k) are enough")
    if c.operator is None:
        ways.append("an operator (hoad.laplacian, hoad.biharmonic, hoad.taylor) when a contraction of the blocks is "
                    "what you need")
        ways.append("a lower order or fewer wrt inputs")
    return ways


def _name_outputs(p: Program) -> None:
    """Name each returned block's node after its block (``d2_f_x_x``), as differentiate did: the
    passes since replaced most of the nodes it named, and print(cf.graph) returned ``add_3``."""
    if not isinstance(p.gm.graph.output_node().args[0], (tuple, list)):
        return
    graph = fx.Graph()  # (a copy: the names of erased nodes are free again)
    returned = graph.graph_copy(p.gm.graph, {})
    graph.output(returned)
    if len(returned) != 1 + len(p.keys):
        return
    for K, node in zip(p.keys, returned[1:]):
        if isinstance(node, fx.Node) and node.op == "call_function" and returned.count(node) == 1:
            node._rename(f"d{len(K)}_f_{key_name(K, p.wrt_names)}")
    p.gm.graph = graph  # (the module keeps its attributes: folded constants)
    p.gm.recompile()


def _compile(b: Build) -> Build:
    p = b.program
    n_user = b.n_user
    # an Inductor program is called with the call's tensors dense (hoad.cache, Entry.result)
    dense = list(b.tensors)
    if b.config.backend == "inductor":
        dense[:n_user] = [t.contiguous() for t in dense[:n_user]]
    hoisted: tuple = ()
    if p.prefix is not None:
        b.prefix = Prefix(eager_program(p.prefix), p.prefix_reads, n_user)
        with torch.no_grad():
            hoisted = b.prefix(dense[n_user:])
    own_outputs(p.gm)  # (before a comparison with the first count's program, which has its copies)
    samples = b.samples = []
    if b.config.sized is not None:
        first = b.config.sized
        count = first.samples
        here = b.captured.out_shape[0]
        general = None
        why = _in_words(b, difference(first.captured, count, b.captured.gm, here), "the function's trace")
        if why is None:
            why = _in_words(b, difference(first.prefix, 1, p.prefix, 1),
                            "the part hoad computes from the parameters alone")
        if why is None and not b.sample_leaves:
            why = "no input of the call holds the samples"
        if why is None:
            general = generalize(first.gm, count, p.gm, here, b.sample_leaves[0])
            why = _in_words(b, difference(first.gm, count, p.gm, here), "hoad's program") if general is None else None
        # a third count: two can agree by chance on a number computed from the count
        # (X.shape[0] % 7 at 100 and 128), which the one program for every count would keep
        if general is not None:
            why = count_dependence(b, count + here + 1)
            general = general if why is None else None
        b.stats["samples_differ"] = why
        if general is not None:
            p.gm = general
            samples += b.sample_leaves
        b.stats["any_samples"] = general is not None
        if general is not None:  # (the sizes its nodes were traced with)
            shown = [n for n in general.graph.nodes if n.op == "placeholder"][b.sample_leaves[0]].meta.get("val")
            b.stats["samples_shown"] = shown.shape[0] if isinstance(shown, torch.Tensor) else None
    _name_outputs(p)
    examples = dense + list(hoisted)
    if b.config.backend == "inductor" and in_background() and cpu_codegen_problem(examples) is None:
        b.main = Tiered(eager_program(p.gm), lambda: compile_program(p, "inductor", examples, samples),
                        f"{name_of(b.fn)}'s order-{p.order} program", b.stats,
                        job=lambda: cache_job(p, examples, samples))
    else:
        b.main = compile_program(p, b.config.backend, example_inputs=examples, samples=samples)
        if hasattr(b.main, "cache_hit"):
            b.stats["inductor"] = {"seconds": b.main.seconds, "cache_hit": b.main.cache_hit}
    b.run = b.main if b.prefix is None else _WithPrefix(b.main, b.prefix, n_user)
    return b


def count_dependence(b: Build, count: int) -> str | None:
    """How the function traced at ``count`` samples differs from its trace at its own count, sizes
    aside, or None where it does not: it uses the number of samples only as a size, never as a
    value (``/ X.shape[0]``)."""
    here = b.captured.out_shape[0]
    n_user = b.n_user
    tensors = [t.new_empty((count, *t.shape[1:])) if i in b.sample_leaves else t
               for i, t in enumerate(b.tensors[:n_user])]
    try:
        with untouched(b.roots):
            captured = capture(b.fn, b.layout, tensors, b.wrt_leaves, batched=b.config.batch_dim is not None)
        _settle(captured, b.config)  # (as the program it is compared with: a (B, N, d) product unmerged)
    except HoadError as e:
        return f"the function fails at {count} samples ({first_line(e)})"
    if count == here:
        return None
    differs = difference(captured.gm, count, b.captured.gm, here)  # (its node in the build's own trace)
    return _in_words(b, differs, "the function's trace")


def _in_words(b: Build, differs: tuple | None, what: str) -> str | None:
    """A :func:`~hoad.passes.dynamic.difference` as a reason, with the user's line where the node
    is one of the function's own."""
    if differs is None:
        return None
    node, text = differs
    where = (locate(b.fn, b.layout, b.tensors, node, decomposed=decomposition_table())
             if node is not None and node.graph is b.captured.gm.graph else "")
    return f"in {what}, {text}{where}"


class _WithPrefix:
    """A main program fed by a prefix program's (reused) outputs."""

    __slots__ = ("main", "prefix", "n_user")

    def __init__(self, main, prefix: Prefix, n_user: int):
        self.main, self.prefix, self.n_user = main, prefix, n_user

    def __call__(self, *tensors):
        return self.main(*tensors, *self.prefix(tensors[self.n_user:]))


# every stage in order, with the rewrites a stage runs by name (capture: the trace, then each
# rewrite of the traced graph); explain() shows each one's time and node count
PIPELINE: tuple[tuple[str, Callable[[Build], Build], tuple[str, ...]], ...] = (
    ("capture", _capture, ("trace", *(name for name, _ in REWRITES), *SETTLE)),
    ("differentiate", _differentiate, ()),
    ("prune", _prune, ("prune",)),
    ("clean", _clean, clean.STEPS),
    ("lower", _lower, tuple(LOWERING)),
    ("hoist", _hoist, ()),
    ("choose", _choose, ()),
    ("plan", _plan, ()),
    ("compile", _compile, ()),
)


def build(fn: Callable, layout: CallLayout, tensors: Sequence[torch.Tensor], wrt_leaves: list[int], config: Config,
          roots: dict | None = None) -> Build:
    b = Build(fn, layout, tensors, wrt_leaves, config, roots=dict(roots or {"fn": fn}))
    # (graph modules regenerate their Python code when first run or read, not at every rewrite's
    # recompile(): 14 code generations a build were a fifth of it)
    with Progress(f"{name_of(fn)}'s order-{config.order} program") as progress, _use_lazy_graph_module(True):
        for name, stage, _rewrites in PIPELINE:
            progress.stage(name)
            start = time.perf_counter()
            try:
                b = stage(b)
            except HoadError:
                raise
            except Exception as e:  # noqa: BLE001 - every failure leaves hoad as a HoadError
                raise HoadInternalError(f"the {name} stage failed: {type(e).__name__}: {e}") from e
            gms = [p.gm for p in b.candidates.values()] or ([b.captured.gm] if b.captured is not None else [])
            b.stats[name] = {**b.stats.get(name, {}), "seconds": time.perf_counter() - start,
                             "nodes": {d: _count(p.gm) for d, p in b.candidates.items()}
                             if b.candidates else _count(gms[0]) if gms else None}
            log.debug("%s: %.3fs, %s nodes", name, b.stats[name]["seconds"], b.stats[name]["nodes"])
        progress.advice = _packed_advice(b)
    return b


def _packed_advice(b: Build) -> str:
    """Where computing a dense program's unique entries alone pays (:func:`hoad.explanation.packed_pays`),
    the way to do it (said when the build is slow enough to be reported)."""
    p = b.program
    if p is None or b.config.operator is not None or b.config.split_blocks is not None or any(
            isinstance(b.layout.places[leaf], StateEntry) for leaf in b.wrt_leaves):  # (packed: inputs only)
        return ""
    return Explanation(b).packed_advice()


def _count(gm: fx.GraphModule | None) -> int | None:
    return None if gm is None else calls(gm)
