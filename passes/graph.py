"""Queries over an FX graph and the one helper that builds a traced node, shared by the passes.

What a node's traced shape is, which nodes depend on given inputs, which inputs a program writes
into, whose memory a view is, which of an op's arguments hold sizes, whether a call is pure, and
:func:`traced_call`, which adds a call with its traced value. None of them rewrites a graph: the
passes that do (``clean``, ``capture``, ``lower`` ...) build on them.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from hoad.rules import is_random


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


def depending(gm: fx.GraphModule, wrt: list[int]) -> set[fx.Node]:
    """The placeholders at positions ``wrt`` and every call that depends on one of them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    varies = {placeholders[i] for i in wrt}
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(a in varies for a in node.all_input_nodes):
            varies.add(node)
    return varies


def written_inputs(gm: fx.GraphModule) -> set[int]:
    """Positions of the placeholders the program writes into (``copy_``: batch norm's running
    statistics, a functionalized in-place update of a free tensor)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {placeholders.index(n.args[0]) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] in placeholders}


def storage_base(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` is (itself, unless it is a view)."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None or not node.args:
            return node
        node = node.args[0]
    return node


@functools.cache
def size_arguments(target) -> frozenset[str]:
    """The arguments of an ATen op that hold sizes: SymInt ones in its schema (view's size, slice's
    bounds), and arange's bounds (its length follows them). Empty for anything else."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return frozenset()
    if schema.name == "aten::arange":
        return frozenset(a.name for a in schema.arguments if a.name in ("start", "end", "step"))
    text = str(schema)
    inside, depth, parts, part = text[text.index("(") + 1:text.rindex(") ->")], 0, [], ""
    for ch in inside:  # split at the commas outside brackets (defaults such as dims=[0, 1])
        depth += 1 if ch in "([" else -1 if ch in ")]" else 0
        if ch == "," and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    parts.append(part)
    declared = [p.strip().split("=")[0].split() for p in parts if p.strip() not in ("", "*")]
    return frozenset(words[-1] for words in declared if words[0].startswith("SymInt"))


def pure(node: fx.Node) -> bool:
    """A call that neither writes into a tensor nor draws random numbers: one that may be merged
    with its twin, folded, hoisted or moved."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and not is_random(node.target) and (schema is None or not schema.is_mutable)
