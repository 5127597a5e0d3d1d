"""Data parallelism: a hoad program over a ``DistributedDataParallel`` module keeps DDP's contract.

DDP averages gradients across ranks through hooks on its parameters' gradient accumulators, and
its reducer expects each forward to announce the backward that follows (``_pre_forward`` before
the module runs, ``_post_forward`` on its outputs). A derivative program reads the parameters at
every call but runs no module: traced once, DDP's forward ran at trace time only, so its reducer
met every later backward unannounced (measured: "Expected to mark a variable ready only once"
under the eager backend, parameters silently off by 8.5e-3 under Inductor).

So hoad traces the module DDP wraps (:func:`traced_as_module`: DDP's forward is bookkeeping and
communication, not maths), records which DDP modules the function called, and runs DDP's own
forward protocol around every call of the program (:func:`synchronized`): the reducer sees one
forward per call and averages the gradients the program's backward produces, exactly as after
``ddp_model(x)``. Nothing is home-made: the hooks, buckets, collectives and ``no_sync`` are
DDP's. A program that reads a module DDP wraps without calling DDP (a decorated method,
``ddp_model.module.lap(x)``) is found by its wrapper (:func:`wrappers_of`) and synchronised the
same way while gradients are on (under ``torch.no_grad()`` it runs no collective, as
``ddp_model.module(x)`` runs none).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from hoad.errors import CaptureError, DistributedError

_LOCAL = threading.local()  # the DDP modules a capture in progress on this thread has called


def _ddp_class():
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


@contextlib.contextmanager
def traced_as_module(called: list):
    """While a capture traces on this thread, a ``DistributedDataParallel`` module runs the module
    it wraps, and is appended to ``called``; other threads' DDP calls are untouched."""
    ddp = _ddp_class()
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(called)
    patched = ddp is not None and not getattr(ddp.forward, "_hoad_traced", False)
    if patched:
        original = ddp.forward

        def forward(self, *inputs, **kwargs):
            records = getattr(_LOCAL, "stack", None)
            if not records:
                return original(self, *inputs, **kwargs)
            if self.mixed_precision is not None:
                raise CaptureError("the function calls a DistributedDataParallel module with mixed_precision=: hoad "
                                   "traces the module it wraps in its own dtype; cast the module instead "
                                   "(module.to(dtype)) and wrap it without mixed_precision")
            records[-1].append(self)
            return self.module(*inputs, **kwargs)

        forward._hoad_traced = True
        ddp.forward = forward
    try:
        yield called
    finally:
        stack.pop()
        if patched:
            ddp.forward = original


def record_nested(ddps: Sequence) -> None:
    """A program called inside another capture: the outer program calls its DDP modules too."""
    stack = getattr(_LOCAL, "stack", None)
    if stack:
        stack[-1].extend(ddps)


def wrappers_of(objects: Iterable) -> list:
    """The ``DistributedDataParallel`` modules that wrap any module among ``objects`` (looked for
    only while a process group is initialized: DDP keeps the module it wraps in its ``_modules``
    table, and nothing on the module points back; three scans of the garbage collector's objects,
    once per program built)."""
    ddp = _ddp_class()
    if ddp is None or not torch.distributed.is_initialized():
        return []
    modules = [o for o in objects if isinstance(o, torch.nn.Module) and not isinstance(o, ddp)]
    if not modules:
        return []
    ids = {id(m) for m in modules}
    found: list = []
    # module <- its wrapper's _modules table <- the wrapper's __dict__ <- the wrapper (a hop fewer
    # where an object holds its attributes without a dict of their own)
    layer = [t for t in gc.get_referrers(*modules) if isinstance(t, dict) and any(id(v) in ids for v in t.values())]
    for _hop in range(2):
        if not layer:
            break
        referrers = gc.get_referrers(*layer)
        found += [o for o in referrers if isinstance(o, ddp) and id(o.module) in ids and o not in found]
        tables = {id(t) for t in layer}
        layer = [d for d in referrers if isinstance(d, dict) and any(id(v) in tables for v in d.values())]
    return found


def synchronized(ddps: Sequence, run: Callable[[], tuple]) -> tuple:
    """``run()`` between DDP's ``_pre_forward`` and ``_post_forward`` of each module in ``ddps``
    (its outputs go through ``_post_forward``, as a DDP forward's do: unused-parameter search and
    the static graph's sink)."""
    for d in ddps:
        try:
            d._pre_forward()
        except RuntimeError as e:
            if "finished reduction in the prior iteration" not in str(e):
                raise
            raise DistributedError(
                "DistributedDataParallel did not get a gradient for every parameter in the last backward, so it "
                "could not finish averaging them. A loss of derivatives leaves some parameters out (a Laplacian "
                "never reaches the last layer's bias), and DDP needs to be told: wrap the model with "
                "DistributedDataParallel(model, find_unused_parameters=True). The last step's gradients were not "
                "all averaged across ranks") from e
    outs = run()
    for d in ddps:
        outs = tuple(d._post_forward(tuple(outs)))
    return outs
