"""Compile: turn a derivative program into the callable a compiled function runs.

- ``eager``: the FX program itself, with ATen overload calls swapped for the public torch
  functions that do the same thing. ``torch.ops.aten.mul.Tensor(a, b)`` goes through the
  OpOverload dispatch path (~2.3 µs per call here); ``torch.mul(a, b)`` runs the same kernel in
  ~1.2 µs, and small derivative programs are dominated by per-call overhead.
- ``inductor``: ``torch._inductor.standalone_compile`` on the program with the call's example
  inputs. It goes through Inductor's FX graph cache, kept in a persistent directory
  (:func:`hoad.lowering.inductor.cache_dir`), so a second process compiling the same program does
  not run gcc again.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Sequence

import torch
import torch.fx as fx

from hoad.errors import CompileError, HoadError
from hoad.lowering.inductor import INDUCTOR_OPTIONS, hoad_inductor, use_cache_dir
from hoad.lowering.malloc import keep_freed_memory

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
    aten.pow.Tensor_Tensor: torch.pow, aten.amax.default: torch.amax, aten.constant_pad_nd.default: torch.constant_pad_nd,
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
    fake = None
    if samples:
        example_inputs, fake = symbolic_inputs(example_inputs, samples)
    from torch._dynamo.utils import counters

    where = use_cache_dir()
    calls = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    hits_before = counters["inductor"]["fxgraph_cache_hit"]
    log.info("hoad: compiling %s (%d ATen calls) with Inductor", label, calls)
    start = time.perf_counter()
    slow = threading.Timer(3.0, lambda: log.warning(
        "hoad: Inductor is still compiling %s (%d ATen calls); a cold compile takes 5-30 s on a small CPU, "
        "later processes reuse the cache in %s", label, calls, where))
    slow.daemon = True
    slow.start()
    try:
        with torch._inductor.config.patch(INDUCTOR_OPTIONS), hoad_inductor():
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

    __slots__ = ("artifact", "seconds", "cache_hit")

    def __init__(self, artifact, seconds: float, cache_hit: bool):
        self.artifact = artifact
        self.seconds = seconds
        self.cache_hit = cache_hit

    def __call__(self, *tensors):
        return self.artifact(*tensors)


def compile_program(program, backend: str, example_inputs=None, samples: Sequence[int] = ()):
    keep_freed_memory()
    if backend == "eager":
        return eager_program(program.gm)
    if backend == "inductor":
        return inductor_program(program.gm, example_inputs, f"the order-{program.order} {program.direction} program",
                                samples=samples)
    raise HoadError(f"unknown backend {backend!r}")
