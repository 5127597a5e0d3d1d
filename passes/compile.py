"""Compile: turn a derivative program into the callable a compiled function runs.

- ``eager``: the FX program itself, with ATen overload calls swapped for the public torch
  functions that do the same thing. ``torch.ops.aten.mul.Tensor(a, b)`` goes through the
  OpOverload dispatch path (~2.3 µs per call here); ``torch.mul(a, b)`` runs the same kernel in
  ~1.2 µs, and small derivative programs are dominated by per-call overhead.
- ``inductor``: ``torch._inductor.standalone_compile`` on the program with the call's example
  inputs. It goes through Inductor's FX graph cache, kept in a persistent directory
  (:func:`cache_dir`), so a second process compiling the same program does not run gcc again.
"""

from __future__ import annotations

import copy
import ctypes
import logging
import os
import platform
import sys
import threading
import time

import torch
import torch.fx as fx

from hoad.errors import HoadError

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

# cpp_wrapper: the compiled program calls its kernels from C++ rather than Python, which cuts
# ~30% off small programs (order-2 MLP Hessian at a point: 38 -> 27 µs per call here).
INDUCTOR_OPTIONS = {"cpp_wrapper": True}


class CompileError(HoadError):
    """Inductor could not compile a derivative program."""


def _fast_ok(node: fx.Node) -> bool:
    return node.target in FAST and bool(node.args) and isinstance(node.args[0], (fx.Node, list, tuple))


def eager_program(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose ATen calls go through the fast public bindings where identical."""
    fast = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for node in fast.graph.nodes:
        if node.op == "call_function" and _fast_ok(node):
            node.target = FAST[node.target]
    fast.recompile()
    return fast


def cache_dir() -> str:
    """Where Inductor's compiled programs persist across processes.

    ``TORCHINDUCTOR_CACHE_DIR`` when the user set it; otherwise ``$HOAD_CACHE_DIR/inductor``, by
    default ``~/.cache/hoad/inductor`` (kept across reboots, unlike Inductor's own default under
    /tmp, which importing Inductor writes into the environment).
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        root = os.environ.get("HOAD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hoad")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def inductor_program(gm: fx.GraphModule, example_inputs: list[torch.Tensor], label: str = "program"):
    """Compile ``gm`` with Inductor for inputs shaped like ``example_inputs``."""
    from torch._dynamo.utils import counters

    where = cache_dir()
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
        with torch._inductor.config.patch(INDUCTOR_OPTIONS):
            artifact = torch._inductor.standalone_compile(gm, list(example_inputs), dynamic_shapes="from_example_inputs")
    except Exception as e:  # noqa: BLE001 - any Inductor failure becomes one error naming the way out
        raise CompileError(f"Inductor failed to compile the derivative program ({type(e).__name__}: {e}); "
                           "backend='eager' runs the same program without compiling it") from e
    finally:
        slow.cancel()
    seconds = time.perf_counter() - start
    hit = counters["inductor"]["fxgraph_cache_hit"] > hits_before
    log.info("hoad: compiled %s in %.1f s (%s, cache %s)", label, seconds, "cache hit" if hit else "cache miss", where)
    return _Compiled(artifact, seconds, hit)


class _Compiled:
    """An Inductor artifact called with positional tensors, returning the program's tuple."""

    __slots__ = ("artifact", "seconds", "cache_hit")

    def __init__(self, artifact, seconds: float, cache_hit: bool):
        self.artifact = artifact
        self.seconds = seconds
        self.cache_hit = cache_hit

    def __call__(self, *tensors):
        return self.artifact(*tensors)


# glibc's malloc returns the large blocks a program frees to the OS (munmap, heap trimming), so
# the next call page-faults its intermediates back in: Inductor allocates every buffer of every
# call afresh. Measured on the per-sample Hessian of a 16-64-64-1 MLP (256 samples): 800-1500
# minor faults per call in most processes, 3.6-6.3 ms per call instead of 2.0-2.3 ms.
# Keeping freed blocks up to this size in the heap removes the faults.
KEEP_FREED_BYTES = 32 * 2**20  # glibc's largest mmap threshold on 64-bit
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
_malloc_tuned: bool | None = None


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks for reuse instead of returning them to the OS.

    Process-wide, once, on Linux with glibc only; left alone when ``HOAD_MALLOC=system`` or when
    the process already tunes malloc through glibc's ``MALLOC_*_`` variables. The cost is that the
    process's resident memory does not shrink after a large call. Returns whether it applied.
    """
    global _malloc_tuned
    if _malloc_tuned is not None:
        return _malloc_tuned
    _malloc_tuned = False
    if (os.environ.get("HOAD_MALLOC", "").lower() == "system" or any(v in os.environ for v in _MALLOC_ENV)
            or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    _malloc_tuned = bool(libc.mallopt(m_mmap_threshold, KEEP_FREED_BYTES)) and bool(
        libc.mallopt(m_trim_threshold, 2 * KEEP_FREED_BYTES))
    if _malloc_tuned:
        log.info("hoad: glibc malloc keeps freed blocks up to %d MB for reuse (HOAD_MALLOC=system leaves it alone)",
                 KEEP_FREED_BYTES >> 20)
    return _malloc_tuned


def compile_program(program, backend: str, example_inputs=None):
    keep_freed_memory()
    if backend == "eager":
        return eager_program(program.gm)
    if backend == "inductor":
        return inductor_program(program.gm, example_inputs, f"the order-{program.order} {program.direction} program")
    raise HoadError(f"unknown backend {backend!r}")
