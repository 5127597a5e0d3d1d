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
from dataclasses import dataclass, field

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


def _safe_softmax(x, dim, dtype=None):
    """Softmax that is 0 on rows where every entry is -inf (attention rows that see no key).

    Core ATen's decomposition computes the softmax of such a row (NaN) and then replaces it with
    zeros: the value is right but NaN flows through every derivative of that row. Here the row is
    made finite before the softmax, so no NaN is ever computed.
    """
    if dtype is not None:
        x = x.to(dtype)
    masked = (x == -math.inf).all(dim, keepdim=True)
    finite = torch.where(masked, torch.zeros((), dtype=x.dtype, device=x.device), x)
    return torch.where(masked, torch.zeros((), dtype=x.dtype, device=x.device), torch.softmax(finite, dim))


def _contiguous_strides(size) -> list[int]:
    strides, step = [], 1
    for n in reversed(list(size)):
        strides.append(step)
        step *= max(int(n), 1)
    return strides[::-1]


def _as_strided(x, size, stride, storage_offset=None):
    """as_strided of a contiguous tensor (decompositions such as group_norm's emit it) as what it
    reads: a view when the strides are those of ``size`` laid out densely, else the entries at
    offset + Σ i_k·stride_k of the flat tensor, a gather with a constant index. A strided view of a
    non-contiguous tensor reads its storage, not its entries: left to the rule table (unsupported)."""
    if not x.is_contiguous():
        return NotImplemented
    offset = int(storage_offset or 0)
    size, stride = [int(n) for n in size], [int(s) for s in stride]
    if offset == 0 and math.prod(size) == x.numel() and stride == _contiguous_strides(size):
        return x.view(size)
    index = torch.full(size, offset, dtype=torch.long, device=x.device)
    for k, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[k] = n
        index = index + torch.arange(n, device=x.device).reshape(shape) * s
    return x.reshape(-1)[index]


@functools.lru_cache(maxsize=None)
def decomposition_table() -> dict:
    """Core ATen decompositions, keeping ``detach`` (a stop-gradient) and splitting composites
    (softmax, layer_norm, gelu, silu, addmm, variance) into ops with rules."""
    table = dict(core_aten_decompositions())
    table.pop(aten.detach.default, None)
    # ops torch differentiates by their own formula, which the decomposition's where() branches
    # do not reproduce at the domain edge (entr at 0)
    table.pop(aten.special_entr.default, None)
    table.update(get_decompositions([
        aten._softmax, aten._log_softmax, aten.native_layer_norm, aten.gelu, aten.silu, aten.addmm,
        aten.logsumexp, aten.softplus, aten.mish, aten.hardtanh, aten.leaky_relu, aten.elu,
        aten.baddbmm, aten.linalg_vector_norm, aten.native_group_norm, aten.native_batch_norm,
        aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
        aten._native_batch_norm_legit_functional,
    ]))
    table[aten._safe_softmax.default] = _safe_softmax
    table[aten.as_strided.default] = _as_strided
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
    # tensors the function reached without receiving them (closed over, globals, module state):
    # the last placeholders, after the call's own tensor leaves
    free: list[torch.Tensor] = field(default_factory=list)


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


def capture(fn: Callable, layout: CallLayout, tensors: Sequence[torch.Tensor], wrt_leaves: Sequence[int],
            name_free: Callable[[list[torch.Tensor]], list[str]] | None = None) -> Captured:
    """Trace ``fn`` called with ``tensors`` placed into ``layout`` to an ATen GraphModule.

    Tensors the function reaches without receiving them become placeholders after the call's own
    (``Captured.free``, named by ``name_free``), so the program reads them at every call.
    """

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
        free = _lift_free_tensors(gm)
        gm = _functional(gm, fresh + [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in free])
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - sorted into the errors a user can act on
        _raise_capture_error(e)
        raise CaptureError(f"tracing the function failed: {type(e).__name__}: {_first_line(e)}"
                           f"{_at(user_frame(e.__traceback__))}") from e

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
    names = list(layout.names) + _unique_after(list(layout.names), name_free(free) if name_free else
                                                [f"c{i}" for i in range(len(free))])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        node._rename(name)
        node.target = name
    gm.recompile()
    return Captured(gm, names, list(wrt_leaves), tuple(val.shape), free)


def _unique_after(taken: list[str], names: list[str]) -> list[str]:
    """``names`` made identifiers distinct from each other and from ``taken``."""
    return _unique(taken + [_identifier(n) for n in names])[len(taken):]


def _lift_free_tensors(gm: fx.GraphModule) -> list[torch.Tensor]:
    """Turn the tensors tracing saw as constants into placeholders (after the existing ones),
    one per tensor object; returns those objects in placeholder order.

    Tracing records a tensor the function reached from outside (a closure, a global, a module's
    parameter) as a ``get_attr`` holding that very object. A tensor the function builds from
    Python data (``torch.tensor([1., 2.])``) also becomes a ``get_attr``, but only ever read
    through ``lift_fresh_copy``: it is the same at every call and stays a constant.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    free: list[torch.Tensor] = []
    lifted: dict[int, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor):
            continue
        if node.users and all(u.target is aten.lift_fresh_copy.default for u in node.users):
            continue
        ph = lifted.get(id(value))
        if ph is None:
            if last is None:
                with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
                    ph = gm.graph.placeholder(f"c{len(free)}")
            else:
                with gm.graph.inserting_after(last):
                    ph = gm.graph.placeholder(f"c{len(free)}")
            ph.meta = dict(node.meta)
            ph.meta.setdefault("val", value)
            last = lifted[id(value)] = ph
            free.append(value)
        node.replace_all_uses_with(ph)
        gm.graph.erase_node(node)
    if free:
        used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        for name in [n for n, _ in gm.named_buffers()] + [n for n, _ in gm.named_parameters()]:
            if name not in used and "." not in name:
                delattr(gm, name)
        for name in list(vars(gm)):
            if name.startswith("_tensor_constant") and name not in used:
                delattr(gm, name)
        gm.recompile()
    return free


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _at(line: str | None) -> str:
    return f" at {line}" if line else ""


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


# In-place ops that make_fx leaves after functionalization: those a decomposition emits (it runs
# below the functionalization layer: rms_norm's ``add_``, circular padding's ``copy_`` into an
# ``empty``) and the in-place view ops (matmul's ``squeeze_``), rewritten separately.
MAX_FUNCTIONALIZE = 4


def _functional(gm: fx.GraphModule, example: Sequence[torch.Tensor]) -> fx.GraphModule:
    """``gm`` without in-place ops, but for view ops and writes into its inputs: traced again under
    functionalization until the decompositions leave none (each pass decomposes one level
    deeper). A write into an input (``copy_`` into a placeholder: functionalization's write-back
    of an argument or a buffer the function updates, batch norm's running statistics in training
    mode) is kept, and the derivative program replays it as the function would."""
    for _ in range(MAX_FUNCTIONALIZE):
        left = [n for n in gm.graph.nodes if _mutates(n) and not _is_view_mutation(n) and not _writes_input(n)]
        if not left:
            return gm
        gm = make_fx(torch.func.functionalize(gm, remove="mutations"), decomposition_table=decomposition_table(),
                     tracing_mode="fake", _allow_non_fake_inputs=True)(*example)
    left = sorted({str(n.target) for n in left})
    raise CaptureError(f"in-place operations {left} are left in the traced program after functionalization; "
                       "rewrite them out of place (e.g. x = x + y instead of x.add_(y))")


def _writes_input(node: fx.Node) -> bool:
    return (node.target is aten.copy_.default and isinstance(node.args[0], fx.Node)
            and node.args[0].op == "placeholder")


def _is_view_mutation(node: fx.Node) -> bool:
    return _out_of_place_target(node.target)


def _out_of_place_target(target) -> bool:
    return target in (aten.squeeze_.dim, aten.squeeze_.dims, aten.squeeze_.default, aten.unsqueeze_.default,
                      aten.transpose_.default, aten.t_.default)


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
