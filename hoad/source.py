"""Where in the user's code something happened: for error messages that name their line."""

from __future__ import annotations

import linecache
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.fx as fx

# hoad's own code: the package, and passes/ beside it where the checkout is installed in place
# (installed from a wheel, hoad.passes lies inside the package)
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
HOAD_DIRECTORIES = (_PACKAGE, os.path.join(os.path.dirname(_PACKAGE), "passes"))


def user_frame(tb=None) -> str | None:
    """The innermost traceback frame outside torch and hoad, as 'file:line: code' (of the stack
    being run when ``tb`` is None), followed by the torch module it called into, if any
    ('(in BatchNorm1d)')."""
    skip = tuple(os.path.join(d, "") for d in (os.path.dirname(torch.__file__), *HOAD_DIRECTORIES))
    found, module = None, None
    frames = traceback.walk_tb(tb) if tb is not None else reversed(list(traceback.walk_stack(None)))
    for frame, lineno in frames:
        filename = frame.f_code.co_filename
        if not filename.startswith(skip) and "<" not in filename[:1]:
            found, module = (filename, lineno), None
        elif found is not None and frame.f_code.co_name == "forward":  # (the innermost module)
            called = frame.f_locals.get("self")
            module = called if isinstance(called, torch.nn.Module) else module
    if found is None:
        return None
    filename, lineno = found
    code = linecache.getline(filename, lineno).strip()
    inside = f" (in {type(module).__name__})" if module is not None else ""
    return f"{filename}:{lineno}: {code}{inside}"


def locate(fn: Callable, layout, tensors: Sequence[torch.Tensor], node: fx.Node | None = None,
           match: Callable | None = None, decomposed: Mapping | None = None) -> str:
    """' at file:line: code' for the user's line that emitted ``node``, or '' when unknown.

    Re-runs the function eagerly on zeros under a dispatch mode that stops at the node's op the
    same number of times it occurs before ``node`` in the graph (or at the first op ``match``
    accepts), decomposing the ops the trace decomposed (``decomposed``: capture's table, so
    that batch norm's sums are seen again). Only called on the way to an error, so it costs
    nothing otherwise. An op that only a decomposition made (unbind's slices) is not run
    eagerly: then ' near' the line of the closest op around it that is (its users first, a few
    tries).
    """
    table = decomposed or {}
    found = _locate(fn, layout, tensors, node, match, table)
    if found or node is None or match is not None:
        return found
    seen, frontier, tries = {node}, [node], 0
    while frontier and tries < 8:
        around = [n for x in frontier for n in [*x.users, *x.all_input_nodes] if n not in seen]
        seen.update(around)
        frontier = [n for n in around if n.op == "call_function"]
        for near in frontier:
            tries += 1
            found = _locate(fn, layout, tensors, near, None, table)
            if found or tries >= 8:
                return found.replace(" at ", " near ", 1)
    return ""


def _locate(fn: Callable, layout, tensors: Sequence[torch.Tensor], node: fx.Node | None,
            match: Callable | None, table: Mapping) -> str:
    from torch.utils._python_dispatch import TorchDispatchMode

    occurrence = 0
    if match is None:
        target = node.target
        packet = getattr(target, "overloadpacket", None)
        occurrence = sum(1 for n in node.graph.nodes if n is not node and n.target is target and _before(n, node))

        def match(func):
            return func is target or (packet is not None and getattr(func, "overloadpacket", None) is packet)

    class _Found(Exception):
        pass

    class Finder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if match(func):
                if self.seen == occurrence:
                    raise _Found()
                self.seen += 1
            decomposed = table.get(func)
            if decomposed is not None:  # the ops the trace saw (batch norm's sums), seen again here
                with self:
                    out = decomposed(*args, **(kwargs or {}))
                if out is not NotImplemented:
                    return out
            return func(*args, **(kwargs or {}))

    flat_fn = layout.flat(fn)

    fresh = [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    try:
        with torch.no_grad(), Finder():
            flat_fn(*fresh)
    except _Found:
        line = user_frame(sys.exc_info()[2])
        return f" at {line}" if line else ""
    except Exception:  # noqa: BLE001 - locating is best effort
        return ""
    return ""


def _before(a: fx.Node, b: fx.Node) -> bool:
    for n in a.graph.nodes:
        if n is a:
            return True
        if n is b:
            return False
    return False
