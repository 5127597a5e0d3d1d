"""Compile: turn a derivative program into the callable a compiled function runs.

- ``eager``: the FX program itself, with ATen overload calls swapped for the public torch
  functions that do the same thing. ``torch.ops.aten.mul.Tensor(a, b)`` goes through the
  OpOverload dispatch path (~2.3 µs per call here); ``torch.mul(a, b)`` runs the same kernel in
  ~1.2 µs, and small derivative programs are dominated by per-call overhead.
- ``inductor``: ``torch._inductor.standalone_compile`` on the program with the call's example
  inputs. It goes through Inductor's FX graph cache, kept in a persistent directory
  (:func:`hoad.lowering.inductor.cache_dir`), so a second process compiling the same program does
  not run gcc again. On CUDA, with ``HOAD_CUDA_GRAPHS=1``, the program is replayed as a CUDA
  graph (:class:`CudaGraphs`).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from hoad.budget import human
from hoad.errors import CompileError, HoadError
from hoad.lowering.inductor import INDUCTOR_OPTIONS, cpu_codegen_problem, hoad_inductor, use_cache_dir
from hoad.lowering.malloc import keep_freed_memory
from hoad.passes.graph import written_inputs
from hoad.passes.memory import memory_plan
from hoad.progress import COMPILE_THREAD

aten = torch.ops.aten
log = logging.getLogger("hoad")

# ATen overload -> public function with the same positional/keyword signature. Only used when
# the first argument is a tensor (torch.sub(1, t) is not valid Python API).
FAST = {
    aten.mul.Tensor: torch.mul, aten.add.Tensor: torch.add, aten.sub.Tensor: torch.sub, aten.div.Tensor: torch.div,
    aten.neg.default: torch.neg, aten.mm.default: torch.mm, aten.bmm.default: torch.bmm,
    aten.view.default: torch.Tensor.view, aten.permute.default: torch.permute, aten.expand.default: torch.Tensor.expand,
    aten.unsqueeze.default: torch.unsqueeze, aten.squeeze.dims: torch.squeeze, aten.select.int: torch.select,
    aten.clone.default: torch.clone, aten.cat.default: torch.cat, aten.where.self: torch.where,
    aten.exp.default: torch.exp, aten.log.default: torch.log, aten.sin.default: torch.sin, aten.cos.default: torch.cos,
    aten.tanh.default: torch.tanh, aten.sigmoid.default: torch.sigmoid, aten.sqrt.default: torch.sqrt,
    aten.rsqrt.default: torch.rsqrt, aten.reciprocal.default: torch.reciprocal, aten.abs.default: torch.abs,
    aten.relu.default: torch.relu, aten.erf.default: torch.erf, aten.pow.Tensor_Scalar: torch.pow,
    aten.pow.Tensor_Tensor: torch.pow, aten.amax.default: torch.amax,
    aten.constant_pad_nd.default: torch.constant_pad_nd,
}

BACKENDS = ("inductor", "eager")

def _fast_ok(node: fx.Node) -> bool:
    return node.target in FAST and bool(node.args) and isinstance(node.args[0], (fx.Node, list, tuple))


def eager_program(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose ATen calls go through the fast public bindings where identical."""
    fast = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for node in fast.graph.nodes:
        if node.op == "call_function" and _fast_ok(node):
            node.target = FAST[node.target]
        elif node.op == "get_attr" and isinstance(getattr(fast, node.target, None), torch.Tensor):
            # a constant the trace made (a one-hot of an index, say): another program tracing
            # this one keeps it a constant instead of an input it cannot find (hoad.passes.capture)
            getattr(fast, node.target)._hoad_constant = True
    fast.recompile()
    return fast


def inductor_program(gm: fx.GraphModule, example_inputs: list[torch.Tensor], label: str = "program",
                     samples: Sequence[int] = ()):
    """Compile ``gm`` with Inductor for inputs shaped like ``example_inputs``; dim 0 of the inputs
    at ``samples`` is a symbol (one program for every number of samples, :mod:`hoad.passes.dynamic`)."""
    problem = cpu_codegen_problem(example_inputs)
    if problem is not None:
        raise CompileError(problem)
    # an inference program: calls that need autograd run Trainable's AOTAutograd program. (The
    # inputs as given made Inductor compile a training program, which also returns the values its
    # backward would save, wherever a parameter requiring grad reached a program for every count.)
    example_inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in example_inputs]
    fake = None
    if samples:
        example_inputs, fake = symbolic_inputs(example_inputs, samples)
    from torch._dynamo.utils import counters

    where = use_cache_dir()
    calls = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    hits_before = counters["inductor"]["fxgraph_cache_hit"]
    log.info("hoad: compiling %s (%d ATen calls) with Inductor", label, calls)
    start = time.perf_counter()
    # (a compile in the background, while the eager program serves the calls, keeps it to the log)
    level = logging.INFO if threading.current_thread().name == COMPILE_THREAD else logging.WARNING
    slow = threading.Timer(3.0, lambda: log.log(
        level, "hoad: Inductor is still compiling %s (%d ATen calls); a cold compile takes 5-30 s on a small CPU, "
        "later processes reuse the cache in %s", label, calls, where))
    slow.daemon = True
    slow.start()
    try:
        # on CUDA, Inductor's own default, the Python wrapper: the C++ one costs a C++ build per
        # program and has not been tried there (with HOAD_CUDA_GRAPHS=1 a graph replays the launches)
        options = {**INDUCTOR_OPTIONS, "cpp_wrapper": False} if _on_cuda(example_inputs) else INDUCTOR_OPTIONS
        with torch._inductor.config.patch(options), hoad_inductor():
            if fake is None:
                artifact = torch._inductor.standalone_compile(gm, list(example_inputs),
                                                              dynamic_shapes="from_example_inputs")
            else:  # standalone_compile specialises symbolic inputs, and so does the C++ wrapper (measured,
                # torch 2.13); compile_fx in their tracing context with the Python wrapper does not
                from torch._inductor.compile_fx import compile_fx

                with torch._guards.tracing(torch._guards.TracingContext(fake)), \
                        torch._inductor.config.patch({"cpp_wrapper": False}):
                    artifact = compile_fx(fx.GraphModule(gm, copy.deepcopy(gm.graph)), list(example_inputs))
    except Exception as e:  # noqa: BLE001 - any Inductor failure becomes one error naming the way out
        raise CompileError(f"Inductor failed to compile the derivative program ({type(e).__name__}: {e}); "
                           "backend='eager' runs the same program without compiling it") from e
    finally:
        slow.cancel()
    seconds = time.perf_counter() - start
    hit = counters["inductor"]["fxgraph_cache_hit"] > hits_before
    log.info("hoad: compiled %s in %.1f s (%s, cache %s)", label, seconds, "cache hit" if hit else "cache miss", where)
    return _Compiled(artifact, seconds, hit)


def described(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """What a compile needs of its example inputs, and pickles: their layouts, not their values."""
    return [(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), t.requires_grad) for t in tensors]


def like(descriptions: Sequence[tuple]) -> list[torch.Tensor]:
    """Uninitialised tensors as :func:`described` describes them."""
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad)
            for shape, stride, dtype, device, grad in descriptions]


def graph_state(gm: fx.GraphModule) -> tuple:
    """``gm`` as picklable data that :func:`rebuilt` turns back into the same program, node names
    and all. A pickled GraphModule is traced again from its code, which renames nodes
    (``permute`` becomes ``permute_default``): Inductor's FX cache still matched, AOTAutograd's
    cache, which reads the graph as given, did not, and a cache hit took 1.8 s instead of ~1."""
    nodes, attrs = [], {}
    for n in gm.graph.nodes:
        target = n.target
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            target = _Op(str(target))
        elif n.op == "get_attr":
            attrs[target] = getattr(gm, target)
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: _Ref(a.name))
        nodes.append((n.op, n.name, target, args, kwargs))
    return nodes, attrs, type(gm).__name__


class _Op(str):
    """An ATen (or hoad) operator by its name, in :func:`graph_state`."""


class _Ref(str):
    """A node by its name, in :func:`graph_state`."""


def rebuilt(state: tuple) -> fx.GraphModule:
    """The program :func:`graph_state` describes."""
    nodes, attrs, class_name = state
    graph, env = fx.Graph(), {}

    def resolve(a):
        if isinstance(a, _Ref):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(resolve(x) for x in a)
        if isinstance(a, dict):
            return {k: resolve(v) for k, v in a.items()}
        return a

    for op, name, target, args, kwargs in nodes:
        if isinstance(target, _Op):
            target = functools.reduce(getattr, target.split("."), torch.ops)
        env[name] = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name)
    root = torch.nn.Module()
    for path, value in attrs.items():
        *parents, leaf = path.split(".")
        owner = root
        for p in parents:
            if not hasattr(owner, p):
                owner.add_module(p, torch.nn.Module())
            owner = getattr(owner, p)
        setattr(owner, leaf, value)
    return fx.GraphModule(root, graph, class_name=class_name)


def compile_for_cache(state: tuple, descriptions: Sequence[tuple], label: str, samples: Sequence[int]) -> None:
    """:func:`inductor_program` of the program in ``state`` (:func:`graph_state`) in a process of
    its own (:mod:`hoad.warm`), for the cache entries the compile in the caller's process then
    finds."""
    inductor_program(rebuilt(state), like(descriptions), label, samples=samples)


def cache_job(program, examples: Sequence[torch.Tensor], samples: Sequence[int]) -> tuple:
    """The :data:`hoad.tiers.Job` that compiles ``program`` as :func:`compile_program` does."""
    return ("hoad.passes.compile", "compile_for_cache",
            (graph_state(program.gm), described(examples), _label(program), tuple(samples)))


def symbolic_inputs(tensors: Sequence[torch.Tensor], samples: Sequence[int]) -> tuple[list[torch.Tensor], object]:
    """Fake inputs for a compile: dim 0 of the tensors at ``samples`` is a symbol, every other size
    is fixed (sizes that happen to be equal stay independent, as they are in the program)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    fake = FakeTensorMode(shape_env=ShapeEnv())
    out = []
    for i, t in enumerate(tensors):
        sizes = [DimDynamic.DYNAMIC if i in samples and d == 0 else DimDynamic.STATIC for d in range(t.ndim)]
        out.append(fake.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes)))
    return out, fake


class _Compiled:
    """An Inductor artifact called with positional tensors, returning the program's tuple."""

    __slots__ = ("artifact", "seconds", "cache_hit", "graphs")

    def __init__(self, artifact, seconds: float, cache_hit: bool):
        self.artifact = artifact
        self.seconds = seconds
        self.cache_hit = cache_hit
        self.graphs: CudaGraphs | None = None  # on CUDA: replays of the program (compile_program)

    def __call__(self, *tensors):
        if self.graphs is not None:
            return self.graphs(*tensors)
        return self.artifact(*tensors)


def compile_program(program, backend: str, example_inputs=None, samples: Sequence[int] = ()):
    keep_freed_memory()
    if backend == "eager":
        return eager_program(program.gm)
    if backend == "inductor":
        label = _label(program)
        compiled = inductor_program(program.gm, example_inputs, label, samples=samples)
        if _on_cuda(example_inputs) and graphs_suit(program.gm, label):
            compiled.graphs = CudaGraphs(compiled.artifact, label)
        return compiled
    raise HoadError(f"unknown backend {backend!r}")


def _label(program) -> str:
    return f"the order-{program.order} {program.direction} program"


def _on_cuda(tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors or ())


# ------------------------------------------------------------------------------ CUDA graphs
# A derivative program is a few dozen to a few hundred kernels on tensors of fixed shapes, each
# launched from Python: at the sizes PINN and per-sample work has on a GPU (4096 points through a
# 16-64-64-1 MLP) the launches, not the kernels, should take the time. Replayed from a CUDA graph,
# the whole program is one launch. The graph keeps its intermediate memory between calls (a
# private pool), so programs whose planned peak is above GRAPH_MAX_BYTES run as launched; so do
# programs that write into their inputs (batch norm's running statistics), whose writes must
# reach the caller's tensors, not the graph's copies of them.
# HOAD_CUDA_GRAPHS=1 turns graphs on. They are off by default until they have been run and timed
# on a GPU (tests/test_cuda.py, the "hoad graphs" column of python -m benchmarks --device cuda).
GRAPH_MAX_BYTES = 1 << 30
GRAPHS_KEPT = 4  # input layouts (sample counts) whose graphs one program keeps, the most recent


def graphs_suit(gm: fx.GraphModule, label: str) -> bool:
    if os.environ.get("HOAD_CUDA_GRAPHS", "0") != "1":
        return False
    if written_inputs(gm):
        return False
    peak = memory_plan(gm).peak
    if peak > GRAPH_MAX_BYTES:
        log.info("hoad: %s is launched without a CUDA graph: its planned peak %s is over %s", label, human(peak),
                 human(GRAPH_MAX_BYTES))
        return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class CudaGraphs:
    """Runs a compiled program by replaying a CUDA graph of it, one per layout of its inputs.

    Each call copies the caller's tensors into the graph's inputs (one multi-tensor copy), replays
    the graph, and copies its results out into fresh tensors (one more): results are the caller's
    own, never overwritten by a later call, and every input is read afresh at each call (a weight
    updated in place, a new batch of points). A program that cannot be captured (an operation a
    graph may not hold) is run as launched from then on, with a warning."""

    def __init__(self, fn: Callable, label: str):
        self.fn, self.label = fn, label
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.broken: str | None = None  # why capture failed: the program runs as launched
        # calls from several threads (or streams) share the graphs' input and output buffers: each
        # call's work is queued under the lock, after the previous call's has run (its event)
        self.lock = threading.Lock()
        self.done: torch.cuda.Event | None = None

    def __call__(self, *tensors):
        if self.broken is not None or not tensors or not all(type(t) in _PLAIN and t.is_cuda for t in tensors) \
                or torch.cuda.is_current_stream_capturing():  # (fake or traced tensors, another capture)
            return self.fn(*tensors)
        key = tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)
        with self.lock:
            entry = self.graphs.get(key)
            if entry is None:
                entry = self._capture(tensors)
                if entry is None:
                    return self.fn(*tensors)
                self.graphs[key] = entry
                while len(self.graphs) > GRAPHS_KEPT:
                    self.graphs.popitem(last=False)
            else:
                self.graphs.move_to_end(key)
            graph, inputs, outputs = entry
            stream = torch.cuda.current_stream(tensors[0].device)
            if self.done is not None:
                stream.wait_event(self.done)
            if inputs:
                torch._foreach_copy_(inputs, list(tensors))
            graph.replay()
            fresh = [torch.empty_like(o) for o in outputs]
            if fresh:
                torch._foreach_copy_(fresh, outputs)
            self.done = torch.cuda.Event()
            self.done.record(stream)
        return tuple(fresh)

    def _capture(self, tensors) -> tuple | None:
        device = tensors[0].device if tensors else torch.device("cuda")
        try:
            with torch.no_grad(), torch.cuda.device(device):
                inputs = [t.clone() for t in tensors]
                side = torch.cuda.Stream()  # warm up off the caller's stream, as capture requires
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.fn(*inputs)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # (other threads may run)
                    outputs = self.fn(*inputs)
            if not isinstance(outputs, (tuple, list)) or not all(isinstance(o, torch.Tensor) for o in outputs):
                raise TypeError(f"the program returned {type(outputs).__name__}, not a tuple of tensors")
        except Exception as e:  # noqa: BLE001 - a program a graph cannot hold still runs, launched
            self.broken = f"{type(e).__name__}: {e}"
            self.graphs.clear()
            log.warning("hoad: %s runs without a CUDA graph (capturing it failed: %s)", self.label, self.broken)
            return None
        return graph, inputs, list(outputs)
