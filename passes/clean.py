"""Clean-up passes over a derivative program: fold constants and layout ops, CSE, DCE.

Each pass is ``GraphModule -> GraphModule`` and preserves the program's outputs exactly (they
only remove or merge nodes that compute the same values).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from hoad.rules import RANDOM

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def shape_of(node) -> tuple | None:
    """The traced shape of ``node``'s value, or None where it is not a tensor (or not a node)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def traced_call(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A new node with its traced value (shapes and strides) in ``meta["val"]``; called in the
    fake mode of its arguments' values."""
    node = graph.call_function(target, args, kwargs or {})
    values, kw = fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    node.meta["val"] = target(*values, **kw)
    return node


def fold_layout(gm: fx.GraphModule) -> bool:
    """Remove identity views/permutes/expands and collapse chains of views and of permutes, in
    place (the caller recompiles)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not node.args:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node):
            continue
        target = node.target
        if target in _VIEWS | {aten.expand.default, aten.alias.default} and shape_of(node) == shape_of(src) \
                and shape_of(node) is not None and not node.kwargs:
            node.replace_all_uses_with(src)
            changed = True
        elif target == aten.permute.default and list(node.args[1]) == list(range(len(node.args[1]))):
            node.replace_all_uses_with(src)
            changed = True
        elif target in _VIEWS and src.op == "call_function" and src.target in _VIEWS:
            node.args = (src.args[0],) + tuple(node.args[1:])
            changed = True
        elif target == aten.permute.default and src.op == "call_function" and src.target == aten.permute.default:
            inner, outer = list(src.args[1]), list(node.args[1])
            node.args = (src.args[0], [inner[p] for p in outer])
            changed = True
    return changed


def cse(gm: fx.GraphModule) -> bool:
    """Merge call_function nodes with the same op and the same arguments, in place; never random
    or mutating ops (two identical ``copy_`` write-backs must both replay). Scalars match by type
    and value, so ``mul(x, 0.0)`` and ``mul(x, -0.0)`` or ``add(x, 1)`` and ``add(x, 1.0)`` stay apart."""
    seen: dict[tuple, fx.Node] = {}
    changed = False
    for node in list(gm.graph.nodes):
        if not pure(node):
            continue
        try:
            key = (node.target, _frozen(node.args), _frozen(node.kwargs))
            kept = seen.setdefault(key, node)
        except TypeError:  # an unhashable argument: leave the node alone
            continue
        if kept is not node:
            node.replace_all_uses_with(kept)
            gm.graph.erase_node(node)
            changed = True
    return changed


def _frozen(a):
    if isinstance(a, fx.Node):
        return a
    if isinstance(a, torch.Tensor):  # by identity (== on tensors is elementwise)
        return torch.Tensor, id(a)
    if isinstance(a, (list, tuple)):
        return type(a), tuple(_frozen(x) for x in a)
    if isinstance(a, dict):
        return dict, tuple((k, _frozen(v)) for k, v in a.items())
    if isinstance(a, float):
        return float, a, math.copysign(1.0, a)  # (a nan matches only the same float object)
    return type(a), a


def dce(gm: fx.GraphModule) -> bool:
    return gm.graph.eliminate_dead_code()


# Constants larger than this stay computed at run time rather than stored with the program.
FOLD_LIMIT_BYTES = 64 * 2**20


def fold_constants(gm: fx.GraphModule) -> fx.GraphModule:
    """Compute once, at compile time, every value that depends on no program input.

    A function's closed-over tensors are constants of its program, so their derivative
    products (W1 ⊗ W1 ⊗ W1 for the remainders of a first layer, identity matrices) need not be
    recomputed on every call. Values over FOLD_LIMIT_BYTES stay in the program.
    """
    values: dict[fx.Node, object] = {}
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            values[node] = getattr(gm, node.target)
            continue
        if not pure(node):
            continue
        if not all(a in values for a in node.all_input_nodes) or _nbytes(node.meta.get("val")) > FOLD_LIMIT_BYTES:
            continue  # (a value too large to store is not computed here either)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: values[a])
        values[node] = node.target(*args, **kwargs)
    for node, value in values.items():
        if node.op != "call_function" or not isinstance(value, torch.Tensor):
            continue
        if all(u in values for u in node.users) or value.numel() * value.element_size() > FOLD_LIMIT_BYTES:
            continue
        value = _laid_out_like(value, node.meta.get("val"))
        if value is None:  # a broadcast (stride-0) layout that later views rely on: keep computing it
            continue
        name = f"_folded_{folded}"
        folded += 1
        gm.register_buffer(name, value, persistent=False)
        with gm.graph.inserting_before(node):
            const = gm.graph.get_attr(name)
        const.meta = dict(node.meta)
        node.replace_all_uses_with(const)
    if folded:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def _nbytes(traced) -> int:
    return traced.numel() * traced.element_size() if isinstance(traced, torch.Tensor) else 0


def _laid_out_like(value: torch.Tensor, traced) -> torch.Tensor | None:
    """``value`` with the strides the program was traced with (later views depend on them)."""
    if not isinstance(traced, torch.Tensor) or value.stride() == traced.stride():
        return value
    if 0 in traced.stride():
        return None
    out = torch.empty_strided(tuple(traced.shape), tuple(traced.stride()), dtype=value.dtype, device=value.device)
    return out.copy_(value)


def pure(node: fx.Node) -> bool:
    """A call that neither writes into a tensor nor draws random numbers: one that may be merged
    with its twin, folded, hoisted or moved (hoad's RANDOM list and ATen's seeded tag both)."""
    schema = getattr(node.target, "_schema", None)
    return (node.op == "call_function" and node.target not in RANDOM
            and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())
            and (schema is None or not schema.is_mutable))


def clean(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold constants and layout ops and merge duplicates until nothing changes."""
    gm = fold_constants(gm)
    while fold_layout(gm) | cse(gm) | dce(gm):
        pass
    gm.recompile()
    return gm
