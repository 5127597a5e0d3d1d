"""Capture: trace the user's function to an ATen graph with a shape on every node.

``make_fx`` in fake mode over a functionalized wrapper, with hoad's decomposition table, so the
graph holds only the small set of ops the rule table covers. Every tensor leaf of the call
becomes a placeholder (new values never need a retrace); Python scalars and other non-tensor
arguments are baked in and belong to the signature the compiled callable caches on.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._decomp import core_aten_decompositions, get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from hoad.errors import (
    CaptureError,
    DataDependentControlFlowError,
    OutputError,
    RandomnessError,
)
from hoad.rules import RANDOM

aten = torch.ops.aten


# ------------------------------------------------------------------------ decomposition table
def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    dims = list(range(x.ndim)) if dim is None or len(dim) == 0 else [d % max(x.ndim, 1) for d in dim]
    n = math.prod(x.shape[d] for d in dims)
    c = 1 if correction is None else correction
    mean = x.sum(dims, keepdim=True) / n
    centred = x - mean
    denom = n - c
    var = (centred * centred).sum(dims, keepdim=keepdim) * (1.0 / denom if denom > 0 else math.nan)
    return var, (mean if keepdim else mean.squeeze(dims))


def _var(x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(x, dim, correction=correction, keepdim=keepdim)[0]


def _std(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dim, correction=correction, keepdim=keepdim).sqrt()


# Core ATen turns mv and dot into an elementwise product and a sum; their derivative blocks
# would then be materialised at the product's full size. As matrix products they stay contractions.
def _mv(a, v):
    return (a @ v.unsqueeze(1)).squeeze(1)


def _dot(a, b):
    return (a.unsqueeze(0) @ b.unsqueeze(1)).reshape(())


@functools.lru_cache(maxsize=None)
def decomposition_table() -> dict:
    """Core ATen decompositions, keeping ``detach`` (a stop-gradient) and splitting composites
    (softmax, layer_norm, gelu, silu, addmm, variance) into ops with rules."""
    table = dict(core_aten_decompositions())
    table.pop(aten.detach.default, None)
    table.update(get_decompositions([
        aten._softmax, aten._log_softmax, aten.native_layer_norm, aten.gelu, aten.silu, aten.addmm,
        aten.logsumexp, aten.softplus, aten.mish, aten.hardtanh, aten.leaky_relu, aten.elu,
        aten.baddbmm, aten.linalg_vector_norm, aten.native_group_norm, aten.native_batch_norm,
        aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
        aten._native_batch_norm_legit_functional,
    ]))
    table[aten.mv.default] = _mv
    table[aten.dot.default] = _dot
    table[aten.vdot.default] = _dot
    table[aten.var_mean.correction] = _var_mean
    table[aten.var.correction] = _var
    table[aten.std.correction] = _std
    return table


# ------------------------------------------------------------------------------------ capture
@dataclass
class Captured:
    """A traced primal program and how the call's arguments map onto its placeholders."""

    gm: fx.GraphModule
    leaf_names: list[str]            # one per placeholder, in order
    wrt_leaves: list[int]            # placeholder index of each wrt entry
    out_shape: tuple[int, ...]


@dataclass(frozen=True)
class CallLayout:
    """How one call's arguments flatten: the pytree, which leaves are tensors, the static rest."""

    treedef: pytree.TreeSpec
    tensor_slots: tuple[int, ...]
    static: tuple
    names: tuple[str, ...]           # a readable name per tensor leaf
    tops: tuple                      # per tensor leaf: ("pos", i) / ("kw", name) if it is an argument itself

    def flat(self, fn: Callable) -> Callable:
        """``fn`` as a function of this call's tensor leaves alone (the rest is fixed)."""

        def flat_fn(*ts):
            leaves = list(self.static)
            for slot, t in zip(self.tensor_slots, ts):
                leaves[slot] = t
            args, kwargs = pytree.tree_unflatten(leaves, self.treedef)
            return fn(*args, **kwargs)

        return flat_fn


def user_frame(tb) -> str | None:
    """The innermost traceback frame outside torch and hoad, as 'file:line: code'."""
    import hoad

    skip = tuple(os.path.join(d, "") for d in (os.path.dirname(torch.__file__), os.path.dirname(hoad.__file__),
                                                os.path.dirname(__file__)))
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        filename = frame.f_code.co_filename
        if not filename.startswith(skip) and "<" not in filename[:1]:
            found = (filename, lineno)
    if found is None:
        return None
    filename, lineno = found
    code = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno}: {code}"


def capture(fn: Callable, layout: CallLayout, tensors: Sequence[torch.Tensor], wrt_leaves: Sequence[int]) -> Captured:
    """Trace ``fn`` called with ``tensors`` placed into ``layout`` to an ATen GraphModule."""

    flat_fn = layout.flat(fn)

    # fresh storage per leaf, so one tensor passed twice still gives two independent inputs
    fresh = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    traced = make_fx(
        torch.func.functionalize(flat_fn, remove="mutations"),
        decomposition_table=decomposition_table(),
        tracing_mode="fake",
        _allow_non_fake_inputs=True,
    )
    try:
        gm = traced(*fresh)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - sorted into the errors a user can act on
        _raise_capture_error(e)
        raise

    _replace_view_mutations(gm)
    out = _output_node(gm)
    val = out.meta.get("val") if isinstance(out, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise OutputError(
            f"the function must return a single tensor, got {type(val).__name__ if val is not None else _describe(out)}; "
            "to differentiate several outputs, stack them into one tensor or compile one function per output"
        )
    if not val.dtype.is_floating_point:
        raise OutputError(f"the function's output has dtype {val.dtype}; derivatives need a floating-point output")
    for node in gm.graph.nodes:
        shape = getattr(node.meta.get("val"), "shape", ())
        if any(isinstance(n, torch.SymInt) for n in shape):
            where = locate(fn, layout, tensors, node)
            raise DataDependentControlFlowError(
                f"a shape depends on tensor values ({node.target}){where}, e.g. boolean-mask indexing or nonzero(); "
                "one derivative program must serve every input value. Use torch.where(mask, x, 0) instead of x[mask]."
            )
        if node.op == "call_function" and node.target is aten._local_scalar_dense.default:
            where = locate(fn, layout, tensors, node)
            raise DataDependentControlFlowError(
                f"the function reads a tensor value into Python (.item(), float(t), int(t)){where}; the derivative "
                "program cannot follow values through Python numbers. Keep the computation in tensor ops."
            )
        if node.op == "call_function" and node.target in RANDOM:
            where = locate(fn, layout, tensors, match=lambda func: func in RANDOM)
            raise RandomnessError(
                f"the function draws random numbers ({node.target}){where}; a derivative program must be "
                "deterministic. Put modules in eval() mode (dropout), or pass the noise in as an argument."
            )
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, layout.names):
        node._rename(name)
        node.target = name
    gm.recompile()
    return Captured(gm, list(layout.names), list(wrt_leaves), tuple(val.shape))


def _out_of_place(node: fx.Node) -> tuple:
    """(target, args) of the out-of-place op an in-place view op stands for, or None."""
    x, rest = node.args[0], node.args[1:]
    r = x.meta["val"].ndim
    t = node.target
    if t is aten.squeeze_.dim:
        return aten.squeeze.dims, (x, [rest[0] % max(r, 1)])
    if t is aten.squeeze_.dims:
        return aten.squeeze.dims, (x, list(rest[0]))
    if t is aten.squeeze_.default:
        return aten.squeeze.dims, (x, [d for d, n in enumerate(x.meta["val"].shape) if n == 1])
    if t is aten.unsqueeze_.default:
        return aten.unsqueeze.default, (x, rest[0])
    if t in (aten.transpose_.default, aten.t_.default):
        a, b = (rest[0] % r, rest[1] % r) if rest else (0, r - 1)
        perm = list(range(r))
        perm[a], perm[b] = perm[b], perm[a]
        return aten.permute.default, (x, perm)
    return None


def _replace_view_mutations(gm: fx.GraphModule) -> None:
    """Rewrite in-place view ops that functionalization leaves (matmul's ``squeeze_``) out of place.

    After ``y = x.squeeze_()`` every later use of ``x`` sees the squeezed tensor, so those uses
    are redirected to ``y``.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        replacement = _out_of_place(node) if node.target._schema.name.endswith("_") else None
        if replacement is None:
            continue
        src = node.args[0]
        node.target, node.args = replacement
        for user in list(src.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(src, node)
        changed = True
    if changed:
        gm.recompile()


def _output_node(gm: fx.GraphModule):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return out.args[0]


def _describe(x) -> str:
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)} values"
    if isinstance(x, dict):
        return "a dict"
    return type(x).__name__


def _raise_capture_error(e: Exception) -> None:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    data_dependent = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
    if isinstance(e, data_dependent) or "data-dependent" in str(e):
        line = user_frame(e.__traceback__)
        at = f" at {line}" if line else ""
        raise DataDependentControlFlowError(
            f"Python control flow or a shape depends on tensor values{at}. One derivative program must serve "
            "every input value: replace `if tensor_condition:` with torch.where(...) or torch.cond, and avoid "
            ".item()/.tolist()/nonzero() on traced tensors."
        ) from e


def locate(fn: Callable, layout: CallLayout, tensors: Sequence[torch.Tensor], node: fx.Node | None = None,
           match: Callable | None = None) -> str:
    """' at file:line: code' for the user's line that emitted ``node``, or '' when unknown.

    Re-runs the function eagerly on zeros under a dispatch mode that stops at the node's op the
    same number of times it occurs before ``node`` in the graph (or at the first op ``match``
    accepts). Only called on the way to an error, so it costs nothing otherwise.
    """
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


def bind_layout(fn: Callable, args: tuple, kwargs: dict, state: bool = False,
                names: Sequence[str] | None = None) -> tuple[CallLayout, list[torch.Tensor]]:
    """Flatten a call into tensor leaves and the static rest, with readable leaf names.

    With ``state``, ``args[0]`` is a module's {name: tensor} state: its leaves are named and
    addressed by parameter name, and positions count from ``args[1]``.
    """
    leaves_with_path, treedef = pytree.tree_flatten_with_path((args, kwargs))
    params = list(names) if names is not None else positional_names(fn)
    slots, leaf_names, static, tensors, tops = [], [], [], [], []
    for i, (path, leaf) in enumerate(leaves_with_path):
        if isinstance(leaf, torch.Tensor):
            slots.append(i)
            if state and path[0].idx == 0 and path[1].idx == 0:
                leaf_names.append(str(path[2].key))
                tops.append(("param", path[2].key))
            else:
                if state and path[0].idx == 0:
                    path = (path[0], type(path[1])(path[1].idx - 1)) + tuple(path[2:])
                leaf_names.append(_leaf_name(path, params))
                tops.append(_top(path))
            tensors.append(leaf)
            static.append(None)
        else:
            static.append(leaf)
    leaf_names = _unique([_identifier(n) for n in leaf_names])
    return CallLayout(treedef, tuple(slots), tuple(static), tuple(leaf_names), tuple(tops)), tensors


def _top(path) -> tuple | None:
    if len(path) != 2:
        return None
    return ("pos", path[1].idx) if path[0].idx == 0 else ("kw", path[1].key)


def _leaf_name(path, params: list[str]) -> str:
    top, *rest = path
    parts = []
    if top.idx == 0:  # positional arguments
        i = rest[0].idx
        parts.append(params[i] if i < len(params) else f"arg{i}")
    else:
        parts.append(str(rest[0].key))
    for p in rest[1:]:
        parts.append(str(getattr(p, "idx", getattr(p, "key", getattr(p, "name", "")))))
    return "_".join(parts)


def positional_names(fn: Callable) -> list[str]:
    """Names of the parameters that positional arguments bind to, in order."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _identifier(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    if not out or out[0].isdigit():
        out = "t" + out
    return out


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if n in seen:
            seen[n] += 1
            out.append(f"{n}_{seen[n]}")
        else:
            seen[n] = 0
            out.append(n)
    return out
