"""The memory plan of a derivative program: what its inputs, results and peak take, from the
shapes on its nodes, before it runs.

The peak comes from liveness over the program graph in execution order: a node's output is
allocated when it runs and freed after its last use; a view keeps its base alive instead of
allocating; the program's inputs are held by the caller throughout, its results to the end. It
is an estimate of what the eager program allocates: Inductor fuses elementwise chains and
usually stays below it. The budget it is held against is :mod:`hoad.budget`'s.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from hoad.budget import MemoryPlan
from hoad.passes.cost import is_view
from hoad.passes.graph import storage_base


def _bytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_bytes(x) for x in v)
    return 0


def _aliases(node: fx.Node) -> bool:
    """Whether a node's output shares its first input's memory (a view, or a tuple's element)."""
    return is_view(node) or (node.op == "call_function" and node.target is operator.getitem)


def memory_plan(gm: fx.GraphModule) -> MemoryPlan:
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    base: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        base[n] = base[first] if _aliases(n) and first is not None else n
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            b = base[a]
            last_use[b] = max(last_use.get(b, 0), position[n])
    inputs = sum(_bytes(n.meta.get("val")) for n in nodes if n.op == "placeholder")
    constants = sum(_bytes(n.meta.get("val")) for n in nodes if n.op == "get_attr")  # (folded: held throughout)
    out = gm.graph.output_node()
    # results that are views (an expanded block) take their base's memory, once
    results = sum(_bytes(b.meta.get("val")) for b in dict.fromkeys(base[a] for a in out.all_input_nodes))
    # results that are an input or a folded constant, or share another result's memory, are copied
    # as the program returns (hoad.passes.clean.own_outputs; the compile stage adds those copies)
    returned = [a for a in torch.utils._pytree.tree_leaves(out.args) if isinstance(a, fx.Node)]
    seen: set = set()
    copied = 0
    for a in returned:  # (own_outputs' own test)
        b = storage_base(a)
        if b.op in ("placeholder", "get_attr") or b in seen:
            copied += _bytes(a.meta.get("val"))
        seen.add(b)
    live = peak = inputs + constants
    frees: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n is out:
            live += copied
        if n.op == "call_function" and base[n] is n:
            size = _bytes(n.meta.get("val"))
            live += size
            end = last_use.get(n, i)  # an unused node is freed at once
            frees[end] = frees.get(end, 0) + size
        peak = max(peak, live)
        live -= frees.pop(i, 0)
    return MemoryPlan(inputs, results, peak)
