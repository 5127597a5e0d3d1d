"""Capture: trace the user's function to an ATen graph with a shape on every node.

``make_fx`` in fake mode over a functionalized wrapper, with hoad's decomposition table
(:mod:`hoad.passes.decompositions`), so the graph holds only the small set of ops the rule table
covers. Every tensor leaf of the call becomes a placeholder (new values never need a retrace), and
so does every tensor the function reaches from outside (:func:`_lift_free_tensors`); Python
scalars and other non-tensor arguments are baked in and belong to the signature the compiled
callable caches on (:mod:`hoad.binding`). In-place ops left by decompositions are functionalized
(:func:`_functional`), in-place view ops rewritten out of place.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import _disable_current_modes

from hoad.binding import CallLayout, StateEntry, _identifier, _unique, aliases_of
from hoad.distributed import traced_as_module
from hoad.errors import CaptureError, DataDependentControlFlowError, HoadError, OutputError, RandomnessError, first_line
from hoad.passes.branches import safe_branches, squares_of_norms
from hoad.passes.clean import cse
from hoad.passes.decompositions import FunctionOverrides, decomposition_table
from hoad.passes.graph import traced_call, written_inputs
from hoad.passes.rewrite import Rewrite, calls, rewrite
from hoad.passes.tracing import tracing, value_read
from hoad.rules import is_random
from hoad.source import locate, user_frame

aten = torch.ops.aten


# ------------------------------------------------------------------------------------ capture
@dataclass
class OutputTree:
    """A function that returns several tensors (a tuple, list or dict of them, nested): the
    program's one output joins their entries along one axis (after the samples' under
    ``batch_dim``), and each result splits back along it (:meth:`hoad.derivatives.Derivatives.per_output`)."""

    treedef: pytree.TreeSpec
    shapes: tuple[tuple[int, ...], ...]   # each output's shape, samples included
    batched: bool                         # joined per sample: along dim 1

    def sizes(self) -> list[int]:
        """Each output's entries along the joined axis."""
        return [math.prod(shape[1:] if self.batched else shape) for shape in self.shapes]


def _joined(out, batched: bool, tree: list):
    """The function's output as one tensor: itself, or several tensors' entries joined (their tree
    appended to ``tree``). Anything else is left for the output check to name."""
    if isinstance(out, torch.Tensor):
        return out
    pathed, treedef = pytree.tree_flatten_with_path(out)
    if not pathed:
        raise OutputError(f"the function returns an empty {type(out).__name__}: there is no tensor to differentiate")
    if treedef.num_nodes == 1:
        return out
    for path, leaf in pathed:
        if not isinstance(leaf, torch.Tensor):
            raise OutputError(f"the function's output{pytree.keystr(path)} is {_describe(leaf)}, not a tensor: every "
                              "value in a returned tuple, list or dict must be a tensor; return other values from "
                              "another function")
    leaves = [t for _, t in pathed]
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in leaves})
    if len(dtypes) > 1:
        each = ", ".join(f"output{pytree.keystr(path)} {str(t.dtype).removeprefix('torch.')}" for path, t in pathed)
        raise OutputError(f"the function returns tensors of different dtypes ({each}); hoad differentiates them in "
                          "one program: give them one floating-point dtype, and return integer or boolean values "
                          "from another function")
    if batched and (any(t.ndim == 0 for t in leaves) or len({t.shape[0] for t in leaves}) > 1):
        raise OutputError("under batch_dim=0 every tensor the function returns holds its samples along dim 0; got "
                          f"shapes {[tuple(t.shape) for t in leaves]}")
    tree.append(OutputTree(treedef, tuple(tuple(t.shape) for t in leaves), batched))
    if batched:
        return torch.cat([t.reshape(t.shape[0], -1) for t in leaves], dim=1)
    return torch.cat([t.reshape(-1) for t in leaves])


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
    # the function calls as_strided: the program reads each input as if it owned its storage
    strided: bool = False
    # (tensor, value) of the .item()s of free tensors the program keeps as numbers
    values: list = field(default_factory=list)
    # the DistributedDataParallel modules the function calls (traced as the modules they wrap)
    ddp: list = field(default_factory=list)
    # a function returning several tensors: the program returns them joined (OutputTree)
    out_tree: OutputTree | None = None
    # positions of the inputs the program writes into (copy_: a running statistic)
    written: set[int] = field(default_factory=set)
    # (free tensor, wrt placeholder) pairs: a free tensor that is a differentiated parameter of the module, read as it
    aliases: tuple[tuple[int, int], ...] = ()
    joinable: list[int] = field(default_factory=list)  # the wrt placeholders a free tensor may be read as

    def samples(self, batch_dim: int | None) -> int | None:
        """The number of samples under ``batch_dim`` where there are several (the count the
        cleaning and hoisting passes keep sizes of apart), else None."""
        count = self.out_shape[0] if batch_dim is not None and self.out_shape else None
        return count if count is not None and count > 1 else None


def capture(fn: Callable, layout: CallLayout, tensors: Sequence[torch.Tensor], wrt_leaves: Sequence[int],
            name_free: Callable[[list[torch.Tensor]], list[str]] | None = None, batched: bool = False,
            stats: dict | None = None) -> Captured:
    """Trace ``fn`` called with ``tensors`` placed into ``layout`` to an ATen GraphModule.

    Tensors the function reaches without receiving them become placeholders after the call's own
    (``Captured.free``, named by ``name_free``), so the program reads them at every call. Several
    tensors returned (a tuple, list or dict) are joined into one output (:class:`OutputTree`; per
    sample when ``batched``). The traced graph then gets :data:`REWRITES`, each timed into
    ``stats`` by name (with ``"trace"``, the tracing itself).
    """

    call = layout.flat(fn)
    tree: list[OutputTree] = []

    def flat_fn(*ts):
        return _joined(call(*ts), batched, tree)

    # fresh storage per leaf, so one tensor passed twice still gives two independent inputs
    fresh = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    functional = torch.func.functionalize(flat_fn, remove="mutations")

    def recorded(*args):  # the traced inputs' storages: an as_strided of one reads the caller's storage
        state.input_storages = {a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor)}
        return functional(*args)

    traced = make_fx(
        recorded,
        decomposition_table={**decomposition_table(), torch.ops.aten._local_scalar_dense.default: _read_value},
        tracing_mode="fake",
        _allow_non_fake_inputs=True,
    )
    start = time.perf_counter()
    with tracing() as state:
        try:
            with FunctionOverrides(), _quiet_fake_tensors(), _uncached_parametrizations(), _without_mkldnn(), \
                    traced_as_module([]) as ddp, torch.enable_grad():
                gm = traced(*fresh)
            free = _lift_free_tensors(gm)
            # (a module's parameter is the same variable wherever it is read; an argument's tensor held
            # elsewhere too is other data that equals it at this call, as under torch.func)
            joinable = [j for j in wrt_leaves if isinstance(layout.places[j], StateEntry)]
            aliases = _read_as_inputs(gm, tensors, joinable, free, [getattr(p, 'name', None) for p in layout.places])
            _stand_in_traced_free(gm, len(fresh))
            gm = _functional(gm, fresh + [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in free])
        except CaptureError:
            raise
        except HoadError as e:  # a refusal of hoad's own decompositions (svd full_matrices=True, ...): where
            raise type(e)(f"{e}{_at(user_frame(e.__traceback__))}") from e
        except Exception as e:  # noqa: BLE001 - sorted into the errors a user can act on
            _raise_capture_error(e)
            raise CaptureError(f"tracing the function failed: {type(e).__name__}: {first_line(e)}"
                               f"{_at(user_frame(e.__traceback__))}") from e

    if stats is not None:
        stats["trace"] = {"seconds": time.perf_counter() - start, "nodes": calls(gm), "changed": True}
    rewrite(gm, REWRITES, stats)
    out = _output_node(gm)
    val = out.meta.get("val") if isinstance(out, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise OutputError(
            f"the function must return a single tensor, got "
            f"{type(val).__name__ if val is not None else _describe(out)}; "
            "several tensors may come as a tuple, list or dict of them"
        )
    if not val.dtype.is_floating_point:
        raise OutputError(f"the function's output has dtype {val.dtype}; derivatives need a floating-point output")
    for node in gm.graph.nodes:
        shape = getattr(node.meta.get("val"), "shape", ())
        if any(isinstance(n, torch.SymInt) for n in shape):
            op = node.args[0] if node.target is operator.getitem else node  # (unique's values, counts)
            where = locate(fn, layout, tensors, op, decomposed=decomposition_table())
            raise DataDependentControlFlowError(
                f"a shape depends on tensor values ({op.target}){where}, e.g. boolean-mask indexing, nonzero() or "
                "unique(); "
                "one derivative program must serve every input value. Use torch.where(mask, x, 0) instead of x[mask]."
            )
        if node.op == "call_function" and node.target is aten._local_scalar_dense.default:
            where = locate(fn, layout, tensors, node, decomposed=decomposition_table())
            raise DataDependentControlFlowError(
                f"the function reads a tensor value into Python (.item(), float(t), int(t)){where}; the derivative "
                "program cannot follow values through Python numbers. Keep the computation in tensor ops."
            )
        if node.op == "call_function" and is_random(node.target):
            where = locate(fn, layout, tensors, match=is_random, decomposed=decomposition_table())
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
    writes = written_inputs(gm)
    written = {id(free[i - len(fresh)]) for i in writes if i >= len(fresh)}
    for t, _value in state.value_reads:
        if id(t) in written:  # read after the function's own update: no value before a call tells it
            raise CaptureError(
                f"the function reads the value of a tensor it also updates (float() or .item() of a "
                f"{'0-d' if t.ndim == 0 else tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} tensor, as "
                "BatchNorm(momentum=None) does in training mode with num_batches_tracked); the program would keep "
                "the first call's number. Keep the computation in tensor ops (BatchNorm: a momentum, or eval())")
    return Captured(gm, names, list(wrt_leaves), tuple(val.shape), free, strided=state.strided_reads > 0,
                    values=list(state.value_reads), ddp=list(dict.fromkeys(ddp)), out_tree=tree[-1] if tree else None,
                    written=writes, aliases=aliases, joinable=joinable)


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
        if getattr(value, "_hoad_constant", False):  # a constant of a hoad program this one calls
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


def _read_as_inputs(gm: fx.GraphModule, tensors: Sequence[torch.Tensor], wrt_leaves: Sequence[int],
                    free: list[torch.Tensor], names: list[str]) -> tuple[tuple[int, int], ...]:
    """A free tensor that is a differentiated parameter of the module itself, reached another way
    than the module's attribute (a list, a closure or an operator holding it: ``hoad.taylor(self.u,
    ..., weights=self.w)``), read as that parameter, in place: the derivatives follow every path to
    it, where as a free tensor of its own it was a constant and the derivatives along that path
    were lost. ``wrt_leaves``: the module's parameters in wrt (an argument's tensor held elsewhere
    too is other data that equals it at this call, a constant as under torch.func). Returns the
    pairs (:func:`aliases_of`); each call checks that they still hold (``Entry.read_free``)."""
    pairs = aliases_of(free, tensors, wrt_leaves)
    wrt = {id(tensors[j]): j for j in wrt_leaves}
    for t in free:  # a view of such an input, made before the call and kept, autograd follows; hoad cannot
        if t.requires_grad and t._base is not None and id(t._base) in wrt:
            raise CaptureError(
                f"the function reads a {tuple(t.shape)} view of {names[wrt[id(t._base)]]!r}, which it differentiates, "
                "made before the call and kept (self.wT = self.lin.weight.t(), say): "
                "hoad differentiates that input where the function reads it, not through a view made outside. "
                "Make the view inside the function (self.lin.weight.t() in forward)")
    if not pairs:
        return pairs
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    own = len(placeholders) - len(free)
    for i, j in pairs:
        if not tensors[j].is_contiguous():  # (traced on a dense copy: its views would not be the free tensor's)
            raise CaptureError(
                f"the module's parameter {names[j]!r}, which the function differentiates, is also held by a list, "
                "a closure or an operator it reads, and it is not contiguous: make it contiguous "
                "(nn.Parameter(w.contiguous())), or read it one way only")
        placeholders[own + i].replace_all_uses_with(placeholders[j])
    gm.recompile()
    return pairs


def _stand_in_traced_free(gm: fx.GraphModule, own: int) -> None:
    """Free tensors that belong to the trace calling this function (hoad.laplacian(net) called
    inside a loss that hoad.compile traces: the module's parameters are that trace's values) get
    placeholder values of this trace's fake mode: the program is built on stand-ins, and each call
    reads the caller's values then (``Entry.read_free``), so its ops join the caller's program."""
    from torch._subclasses.fake_tensor import FakeTensor

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ours = placeholders[:own] + [n for n in gm.graph.nodes if n.op == "call_function"]
    mode = next((n.meta["val"].fake_mode for n in ours if isinstance(n.meta.get("val"), FakeTensor)), None)
    for node in placeholders[own:]:
        t = node.meta.get("val")
        if isinstance(t, FakeTensor) and t.fake_mode is not mode and mode is not None:
            with mode:
                node.meta["val"] = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                                       device=t.device)


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


def _detach_writes(gm: fx.GraphModule) -> None:
    """A write into an input copies a value with no derivative (a running statistic): detached,
    so that a call under autograd leaves the written tensor (a module's buffer) without a graph."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and _writes_input(node) and isinstance(node.args[1], fx.Node):
            with gm.graph.inserting_before(node):
                value = gm.graph.call_function(aten.detach.default, (node.args[1],))
            value.meta = dict(node.args[1].meta)
            node.args = (node.args[0], value) + tuple(node.args[2:])
    gm.recompile()


def _renorm_in_place(gm: fx.GraphModule) -> None:
    """F.embedding(max_norm=) renormalises the table's rows in place under no_grad: later reads
    see the new values, and autograd still sees the table itself (derivative 1). The functional
    graph reads ``embedding_renorm(detach(W))`` instead, a constant (all derivatives were 0): here
    those reads get ``renorm + (W - detach(W))``, the new value with W's derivatives."""
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is aten.embedding_renorm.default):
            continue
        source = node.args[0]
        if not (isinstance(source, fx.Node) and source.target is aten.detach.default):
            continue
        table = source.args[0]
        with gm.graph.inserting_after(node):
            zero = traced_call(gm.graph, aten.sub.Tensor, (table, source))
            with gm.graph.inserting_after(zero):
                read = traced_call(gm.graph, aten.add.Tensor, (node, zero))
        for user in list(node.users):
            if user is not zero and user is not read and not (user.target is aten.detach.default
                                                              and all(_writes_input(u) for u in user.users)):
                user.replace_input_with(node, read)
    gm.recompile()


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


# the rewrites of every traced graph, in order (hoad.pipeline's PIPELINE lists them under capture)
REWRITES: tuple[Rewrite, ...] = (
    ("view_mutations", _replace_view_mutations),  # y = x.squeeze_(): x's later uses read y
    ("renorm", _renorm_in_place),  # embedding max_norm's in-place renorm, kept a function of W
    ("cse", cse),  # one node per repeated call (x.norm() * x.norm() is then a square)
    ("squares_of_norms", squares_of_norms),  # ‖x‖² as Σx², smooth where ‖x‖ is not
    ("safe_branches", safe_branches),  # a where's untaken singular entries read a safe value
    ("detach_writes", _detach_writes),  # a write-back (a running statistic) carries no derivative
)


def _output_node(gm: fx.GraphModule):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return out.args[0]


def _describe(x) -> str:
    if isinstance(x, (list, tuple)):  # (fx holds a returned list as its immutable_list)
        return f"a {'tuple' if isinstance(x, tuple) else 'list'} of {len(x)} values"
    if isinstance(x, dict):
        return "a dict"
    if x is None or isinstance(x, (bool, int, float, complex, str)):
        return repr(x)
    return type(x).__name__


def _read_value(t: torch.Tensor):
    """``.item()``, ``float()``, ``int()`` of a tensor the function closes over (narrow's start,
    momentum=None batch norm's 1/float(num_batches_tracked)): the program keeps the number, so
    the call records it and every later call compares it (hoad.cache, Entry.read_free) and builds
    again when it changed. A traced tensor's value is refused as data-dependent by the fake trace."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(t, FakeTensor) and t.numel() == 1:
        with _disable_current_modes():  # read outside the trace (not through this decomposition again)
            value_read(t, t.item())
    return NotImplemented


@contextlib.contextmanager
def _without_mkldnn():
    """A float32 LSTM on the CPU dispatches to aten.mkldnn_rnn_layer, a fused kernel with no rule:
    traced without mkldnn it is torch's plain gate arithmetic (as float64's is). (The switch is
    process-wide, as torch's own flags context is: another thread's ops run without mkldnn while a
    trace runs, slower, not different.)"""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@contextlib.contextmanager
def _uncached_parametrizations():
    """A trace inside ``parametrize.cached()`` stored its fake values in torch's cache (the model's
    next plain call in the block returned them) and read values cached before it as constants
    (no derivative reaches the parametrized parameter). The trace computes parametrizations
    afresh; the caller's cache is kept as it was."""
    from torch.nn.utils import parametrize

    enabled, cache = parametrize._cache_enabled, parametrize._cache
    parametrize._cache_enabled, parametrize._cache = 0, {}
    try:
        yield
    finally:
        parametrize._cache_enabled, parametrize._cache = enabled, cache


@contextlib.contextmanager
def _quiet_fake_tensors():
    """The fake-tensor trace logs a traceback (at ERROR) for an op its meta function refuses
    (mm of mismatched shapes) before raising; capture raises it as a CaptureError naming the
    user's line, so the log is only noise on stderr."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _op_name(op) -> str:
    """``aten.linalg_lstsq`` for an ATen overload, else its str."""
    schema = getattr(op, "_schema", None)
    return f"aten.{schema.name.removeprefix('aten::')}" if schema is not None else str(op)


# torch's errors for autograd run inside a traced function (torch.autograd.grad, requires_grad_(),
# .backward())
_AUTOGRAD_INSIDE = ("does not require grad and does not have a grad_fn",
                    "inside of a function being transformed by a functorch transform",
                    "backward() called inside a functorch transform")


def _raise_capture_error(e: Exception) -> None:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(e, DynamicOutputShapeException) and e.args:
        raise DataDependentControlFlowError(
            f"{_op_name(e.args[0])} returns tensors whose shapes depend on its input's values"
            f"{_at(user_frame(e.__traceback__))}; one derivative program must serve every input value. Compute it "
            "with ops of fixed output shapes (for least squares: torch.linalg.solve of the normal equations, or "
            "torch.linalg.pinv)") from e
    if isinstance(e, NotImplementedError) and "torch._C.Generator" in str(e):  # (torch 2.11's fake tensors)
        raise RandomnessError(
            f"the function draws random numbers from an explicit torch.Generator{_at(user_frame(e.__traceback__))}; "
            "a derivative program must be deterministic. Pass the noise in as an argument.") from e
    if "custom_function_call" in str(e) or "autograd.Function with functorch" in str(e):
        if any("checkpoint" in line for line in traceback.format_tb(e.__traceback__)):
            raise CaptureError(
                f"the function calls torch.utils.checkpoint with use_reentrant=True{_at(user_frame(e.__traceback__))}, "
                "a custom autograd.Function; pass use_reentrant=False (hoad traces through it)") from e
        raise CaptureError(
            f"the function calls a custom torch.autograd.Function{_at(user_frame(e.__traceback__))}: hoad "
            "differentiates ATen ops by its own rules to every order and cannot use a hand-written backward. Write "
            "its forward in torch ops, or make it a torch.library custom op and give hoad its derivatives "
            "(hoad.register_elementwise / register_linear / register_rule: docs/how-it-works.md, Adding rules)") from e
    if "Interpreter.cpp" in str(e) and "wrapper" in str(e):  # (functorch's own assert)
        raise CaptureError(
            f"the function reads a tensor a torch.func transform wraps without receiving it"
            f"{_at(user_frame(e.__traceback__))}: a module's parameter that functional_call swapped in inside "
            "torch.func.grad, say. hoad builds its program outside the transform and cannot read that tensor there. "
            "Pass such tensors to the compiled function as arguments (hoad.laplacian(lambda P, ps: "
            "functional_call(net, ps, (P,)))(P, ps)), or differentiate the loss with loss.backward()") from e
    if any(text in str(e) for text in _AUTOGRAD_INSIDE):
        raise CaptureError(
            f"the function runs autograd itself (requires_grad_(), .backward() or torch.autograd.grad)"
            f"{_at(user_frame(e.__traceback__))}: hoad traces it without autograd, so no tensor in it has a gradient "
            "graph. Take that derivative with torch.func inside it (a force as -torch.func.grad(energy)(x)), which "
            "hoad differentiates further, or let hoad take it: compile u itself with one order more (res[0] is its "
            "gradient, res[0, 0] its Hessian), or use hoad.laplacian for a Laplacian") from e
    float_read = isinstance(e, GuardOnDataDependentSymNode) and re.search(r"\bzuf\d", str(e))  # (a float() symbol)
    if float_read or isinstance(e, DataDependentOutputException) and getattr(e, "func", None) is \
            aten._local_scalar_dense.default:
        raise DataDependentControlFlowError(
            f"the function reads into Python (float(t), int(t), .item()) a value it computes"
            f"{_at(user_frame(e.__traceback__))} (float(box[0]) of a tensor it closes over counts: box[0] is "
            "computed); the derivative program cannot follow values through Python numbers. Keep it a tensor "
            "(x / box[0]), or read the number outside the function and pass it in") from e
    data_dependent = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
    if isinstance(e, data_dependent) or "data-dependent" in str(e):
        line = user_frame(e.__traceback__)
        at = f" at {line}" if line else ""
        raise DataDependentControlFlowError(
            f"Python control flow or a shape depends on tensor values{at}. One derivative program must serve "
            "every input value: replace `if tensor_condition:` with torch.where(...) (both branches computed), and "
            "avoid .item()/.tolist()/nonzero() on traced tensors."
        ) from e
    if "mutating a non-functional tensor with a functional tensor" in str(e):  # an in-place update of a free tensor
        raise CaptureError(
            f"the function updates in place a tensor it does not receive{_at(user_frame(e.__traceback__))} (a buffer "
            "of a module it reaches through a closure, say) with a value computed from its inputs; hoad replays such "
            "an update only for a module it compiles itself. Compile the module (hoad.compile(m), or decorate its "
            "method), pass the tensor as an argument, or move the update out of the function") from e
    if "dynamo-optimized" in str(e):  # torch.compile(module) or a @torch.compile function inside
        raise CaptureError(
            f"the function calls a torch.compile'd function or module{_at(user_frame(e.__traceback__))}; hoad "
            "traces plain PyTorch and compiles the derivative program itself. Pass the module or function "
            "without torch.compile (a compiled module's original is its ._orig_mod)") from e


