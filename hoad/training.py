"""Training through compiled derivative programs: results that autograd can differentiate.

An Inductor program records no autograd graph. When a call needs one (grad is enabled and an
input requires grad: a PINN's parameters, closed over or passed), the derivative program is
compiled a second time by AOTAutograd, once per pattern of inputs that require grad: a compiled
forward that keeps what the backward needs (its min-cut partition chooses what to recompute
instead) and a compiled backward. Measured against a backward that recomputes the whole forward
from the inputs (a Laplacian-residual step, 16-64-64-1 MLP, 256 points, one thread): 5.6 vs 7.3
ms per step, eager autograd 7.6. Compiled with fake inputs, so it reuses Inductor's and
AOTAutograd's on-disk caches across processes.

The AOTAutograd program runs inside :class:`_Guard` on detached aliases of the inputs, so its
backward is reached only through the guard. Its backward cannot itself be differentiated, and it
runs once (its buffers are donated). A plain backward calls it directly (its node's ``apply``,
without a second run of the autograd engine; :func:`_compiled_backward`); a backward with
``create_graph=True`` (a gradient penalty, meta-learning) or a second backward after the caller's
``retain_graph=True`` runs the same derivative program eagerly under autograd instead, so double
backward works as in the eager backend.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from hoad.errors import CompileError, ExecutionError
from hoad.lowering.inductor import cpu_codegen_problem, hoad_inductor, use_cache_dir
from hoad.passes.compile import described, eager_program, graph_state, like, rebuilt, symbolic_inputs
from hoad.passes.graph import written_inputs
from hoad.passes.lower import OrientProducts
from hoad.pipeline import in_background
from hoad.progress import Progress
from hoad.tiers import BUILDS, Tiered

log = logging.getLogger("hoad")
aten = torch.ops.aten


class Trainable:
    """One program's differentiable runs: AOTAutograd compilations keyed by the inputs that
    require grad, and the eager twin for double backward."""

    def __init__(self, main: fx.GraphModule, label: str, prefix: fx.GraphModule | None = None,
                 reads: Sequence[int] = (), first_free: int = 0, samples: Sequence[int] = ()):
        self.main, self.prefix = main, (prefix, tuple(reads), first_free)  # folded into gm on first use
        self.samples = tuple(samples)   # inputs whose dim 0 is the sample count, a symbol in main
        self.label = label
        self._eager: Callable | None = None
        self._compiled: dict[tuple[int, ...], Callable] = {}
        self._compiling: dict[tuple[int, ...], Tiered] = {}  # (HOAD_COMPILE=background) compiles in flight
        self._starting = threading.Lock()
        # inputs the program writes into (batch norm's running statistics): the eager
        # recomputation of a double backward works on copies, so the call stays the only write
        # (main's inputs are the call's tensors then the hoisted values, which are never written)
        self.written = written_inputs(main)

    @functools.cached_property
    def gm(self) -> fx.GraphModule:
        """The program of the call's tensors alone (:func:`with_prefix`): built when a call first
        needs autograd, not with every inference program."""
        return with_prefix(self.main, *self.prefix)

    @functools.cached_property
    def reaches(self) -> list[frozenset[int]]:
        """For each input, the outputs that depend on it: an input that reaches no output with a
        cotangent gets no gradient (None, as autograd gives), not the compiled backward's zeros
        (an optimizer's weight decay would move a parameter the loss never saw)."""
        deps: dict[fx.Node, frozenset[int]] = {}
        inputs = []
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                deps[node] = frozenset([len(inputs)])
                inputs.append(node)
            elif node.op == "output":
                outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
                reach: list[set[int]] = [set() for _ in inputs]
                for k, o in enumerate(outs):
                    for i in deps.get(o, ()) if isinstance(o, fx.Node) else ():
                        reach[i].add(k)
                return [frozenset(r) for r in reach]
            else:
                deps[node] = frozenset().union(*(deps.get(a, frozenset()) for a in node.all_input_nodes))
        return [frozenset() for _ in inputs]

    @property
    def eager(self) -> Callable:
        if self._eager is None:
            self._eager = eager_program(self.gm)
        return self._eager

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        return _Guard.apply(self, *inputs)

    @functools.cached_property
    def miscompiled(self) -> bool:
        """Whether the program pools with ceil_mode: Inductor (torch 2.13) compiles the backward of
        such an average pooling wrongly where the last window is partial (a parameter's gradient
        through a Hessian 0.56 off), so such programs train through the eager program."""
        ceil_mode_at = {aten.avg_pool2d.default: 4, aten.avg_pool3d.default: 4,
                        aten.avg_pool2d_backward.default: 5, aten.avg_pool3d_backward.default: 5}
        return any(node.target in ceil_mode_at and len(node.args) > ceil_mode_at[node.target]
                   and node.args[ceil_mode_at[node.target]] for node in self.gm.graph.nodes)

    def compiled(self, inputs: Sequence[torch.Tensor]) -> Callable:
        if self.miscompiled:
            return self.eager
        needs = tuple(i for i, t in enumerate(inputs) if t.requires_grad)
        run = self._compiled.get(needs)
        if run is None and in_background():
            # the eager program under autograd until the AOTAutograd program is compiled beside it
            # (HOAD_COMPILE=background): the first training steps run at once
            problem = cpu_codegen_problem(inputs)
            if problem is not None:
                raise CompileError(problem)
            tier = self._compiling.get(needs)
            if tier is None:
                with self._starting:  # (not BUILDS, which a compile in flight holds)
                    if needs not in self._compiling:
                        examples = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
                        self._compiling[needs] = Tiered(
                            self.eager, functools.partial(self._compile, examples), f"{self.label} for autograd", {},
                            job=lambda: ("hoad.training", "compile_for_cache",
                                         (graph_state(self.gm), described(examples), self.label, self.samples)))
                    self._compiling[needs].start()
                tier = self._compiling[needs]
            if tier.compiled is not None:
                run = self._compiled[needs] = tier.compiled
            return run if run is not None else self.eager
        if run is None:
            with BUILDS:
                run = self._compiled.get(needs)
                if run is None:
                    run = self._compiled[needs] = self._compile(inputs)
        return run

    def _compile(self, inputs: Sequence[torch.Tensor]) -> Callable:
        from torch._dynamo.utils import counters
        from torch._inductor.compile_fx import compile_fx

        problem = cpu_codegen_problem(inputs)
        if problem is not None:
            raise CompileError(problem)
        use_cache_dir()
        # only the sample count is a symbol: with every size one (duck-sized), a backward whose
        # inputs carry only a product of two sizes failed in Inductor's codegen (an [B, N, d] input)
        examples, _ = symbolic_inputs(inputs, self.samples)
        gm = fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))  # compile_fx changes what it gets
        log.info("hoad: compiling %s for autograd (forward and backward) with Inductor", self.label)
        start = time.perf_counter()
        hits_before = counters["inductor"]["fxgraph_cache_hit"]
        try:
            # the backward now too, not at the first backward (AOTAutograd's default where no size is
            # a symbol): that compile ran in the user's step, from an empty cache on a first run
            with Progress(f"{self.label} for autograd") as progress, hoad_inductor(), \
                    torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                progress.stage("compile (forward and backward)")
                # cpp_wrapper pinned off: a process that turned it on (torch._inductor.config) got a
                # program whose outputs carried no autograd graph, so every gradient was silently zero
                run = compile_fx(gm, examples, config_patches={"cpp_wrapper": False,
                                                               "post_grad_custom_post_pass": OrientProducts()})
        except Exception as e:  # noqa: BLE001 - any failure becomes one error naming the way out
            raise CompileError(f"Inductor failed to compile {self.label} for autograd ({type(e).__name__}: {e}); "
                               "backend='eager' trains through the same program without compiling it") from e
        log.info("hoad: compiled %s for autograd in %.1f s (%s)", self.label, time.perf_counter() - start,
                 "cache hit" if counters["inductor"]["fxgraph_cache_hit"] > hits_before else "cache miss")
        return run

    def _private(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() if i in self.written else t for i, t in enumerate(inputs)]


def compile_for_cache(state: tuple, descriptions: Sequence[tuple], label: str, samples: Sequence[int]) -> None:
    """The AOTAutograd compile of :meth:`Trainable.compiled` for the program in ``state``
    (:func:`~hoad.passes.compile.graph_state`) in a process of its own (:mod:`hoad.warm`), for the
    cache entries the compile in the caller's process then finds."""
    Trainable(rebuilt(state), label, samples=samples)._compile(like(descriptions))


class _Guard(torch.autograd.Function):
    """One differentiable call: the AOTAutograd program runs on detached aliases of the inputs,
    so its backward is reached only from here; a backward with ``create_graph`` goes around it,
    through the eager program (see the module docstring)."""

    @staticmethod
    def forward(ctx, program: Trainable, *inputs):
        primals = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            outs = tuple(program.compiled(primals)(*primals))
        ctx.program, ctx.primals, ctx.outs = program, primals, outs
        ctx.set_materialize_grads(False)  # an output the loss does not use has no cotangent
        ctx.save_for_backward(*inputs)
        results = tuple(o.detach() for o in outs)
        ctx.mark_non_differentiable(*[r for r in results if not r.dtype.is_floating_point])
        return results

    @staticmethod
    def backward(ctx, *cotangents):
        if torch._C._functorch.peek_interpreter_stack() is not None or any(
                c is not None and (torch._C._functorch.is_legacy_batchedtensor(c)
                                   or torch._C._functorch.is_batchedtensor(c)) for c in cotangents):
            raise ExecutionError(
                f"the backward of {ctx.program.label}, compiled by Inductor, ran under a torch.func transform "
                "(autograd.grad(..., is_grads_batched=True) vmaps it); hoad's compiled kernels have no batching rules. "
                "backend='eager' runs the same program under any transform")
        inputs = ctx.saved_tensors
        used = {k for k, c in enumerate(cotangents) if c is not None}
        reaches = ctx.program.reaches
        needs = [i for i in range(len(inputs)) if ctx.needs_input_grad[1 + i] and reaches[i] & used]
        grads: list = [None] * len(inputs)
        create = torch.is_grad_enabled()
        if create or ctx.outs is None:
            # create_graph, or a second backward (the caller's retain_graph=True) after the
            # compiled backward, which runs once, freed its buffers: the eager program under
            # autograd. Fresh aliases: gradients with respect to them count only the paths
            # through this program, not those that join the inputs upstream (a prefix computes
            # some inputs from others), and stay connected to the inputs for the next derivative
            program: Trainable = ctx.program
            with torch.enable_grad():
                primals = [t.view_as(t) if i in needs else t.detach()
                           for i, t in enumerate(program._private(inputs))]
                outs = program.eager(*primals)
        else:  # a plain backward: the compiled one
            primals, outs, ctx.primals, ctx.outs = ctx.primals, ctx.outs, None, None
            zeros = [torch.zeros_like(o) if c is None and o.dtype.is_floating_point else c
                     for o, c in zip(outs, cotangents)]
            with _compile_errors(ctx.program):
                direct = _compiled_backward(outs, primals, zeros)
            if direct is not None:
                return (None, *_laid_out_like([g if i in needs else None for i, g in enumerate(direct)], inputs))
        pairs = [(o, c) for o, c in zip(outs, cotangents) if c is not None and o.requires_grad]
        if pairs and needs:
            with _compile_errors(ctx.program):
                got = torch.autograd.grad([o for o, _ in pairs], [primals[i] for i in needs],
                                          [c for _, c in pairs], create_graph=create, allow_unused=True)
            for i, g in zip(needs, got):
                grads[i] = g
        return (None, *_laid_out_like(grads, inputs))


def _laid_out_like(grads: list, inputs: Sequence[torch.Tensor]) -> list:
    """Each gradient with its input's strides where both are dense and differ only along axes of
    size 1 (a (1, 64) gradient with strides (1, 1) for a (64, 1)-strided weight): the same memory,
    seen as torch lays out the parameter, so DDP's gradient buckets take it without a copy (it
    warned "Grad strides do not match bucket view strides" at every first step)."""
    out = list(grads)
    for i, (g, t) in enumerate(zip(grads, inputs)):
        if (g is not None and g.shape == t.shape and g.stride() != t.stride() and g.is_contiguous()
                and t.is_contiguous()):
            out[i] = g.as_strided(t.shape, t.stride(), g.storage_offset())
    return out


@contextlib.contextmanager
def _compile_errors(program: Trainable):
    """AOTAutograd compiles a backward with a symbolic size when it first runs: an Inductor
    failure there is the same :class:`CompileError` as one at the forward's compile."""
    from torch._inductor.exc import InductorError

    try:
        yield
    except InductorError as e:
        raise CompileError(f"Inductor failed to compile the backward of {program.label} ({e}); "
                           "backend='eager' trains through the same program without compiling it") from e


def _compiled_backward(outs: Sequence[torch.Tensor], primals: Sequence[torch.Tensor], cotangents) -> list | None:
    """The gradients of ``primals`` from the AOTAutograd program's backward node, called directly
    (``apply``), or None where its shape is not the plain one: every output of that node is one of
    ``outs`` with a cotangent, and each of its inputs a primal's gradient accumulator. Saves the
    autograd engine's second run (``torch.autograd.grad`` from inside this backward): 1.128 -> 1.080
    ms per PINN step on a 2-32-32-1 MLP (256 points, same process)."""
    node = outs[0].grad_fn if outs else None
    if (node is None or type(node).__name__ != "CompiledFunctionBackward"
            or any(o.grad_fn is not node for o in outs)
            or sorted(o.output_nr for o in outs) != list(range(len(outs)))
            or len(getattr(node, "_input_metadata", ())) != len(outs)
            or any(c is None for c in cotangents)):
        return None
    # the caller's retain_graph: the program's donated buffers refuse a graph task that keeps its
    # graph, which the engine's own run from here does not
    keeps = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if keeps is None or keeps():
        return None
    index = {id(t): i for i, t in enumerate(primals)}
    targets = []
    for fn, _ in node.next_functions:
        if fn is None:
            targets.append(None)
        elif type(fn).__name__ == "AccumulateGrad" and id(fn.variable) in index:
            targets.append(index[id(fn.variable)])
        else:
            return None
    ordered = [None] * len(outs)
    for o, c in zip(outs, cotangents):
        ordered[o.output_nr] = c
    got = node.apply(*ordered)
    got = got if isinstance(got, tuple) else (got,)
    grads: list = [None] * len(primals)
    for i, g in zip(targets, got):
        if i is not None and g is not None:
            grads[i] = g if grads[i] is None else grads[i] + g
    return grads


def with_prefix(main: fx.GraphModule, prefix: fx.GraphModule | None, reads: Sequence[int],
                first_free: int) -> fx.GraphModule:
    """``main`` computing its hoisted inputs itself, from ``prefix``'s program: one program of the
    call's tensors alone, which AOTAutograd compiles and differentiates whole. Hoisting pays where
    the prefix's outputs are reused between calls; a call that needs autograd computes them anyway,
    and run eagerly (their ops and their autograd nodes) they took a PINN step on a 2-32-32-1 MLP
    (256 points) from 0.916 to 1.069 ms. ``prefix`` reads the free tensors at ``reads``, counted from
    ``first_free`` among main's inputs; None: ``main`` itself."""
    if prefix is None:
        return main
    placeholders = [n for n in main.graph.nodes if n.op == "placeholder"]
    hoisted = placeholders[len(placeholders) - len(prefix.graph.output_node().args[0]):]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in placeholders[:len(placeholders) - len(hoisted)]:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    inputs = [n for n in prefix.graph.nodes if n.op == "placeholder"]
    values = graph.graph_copy(prefix.graph, {p: env[placeholders[first_free + i]] for p, i in zip(inputs, reads)})
    env.update(zip(hoisted, values))
    graph.output(graph.graph_copy(main.graph, env))
    return fx.GraphModule(main, graph)
