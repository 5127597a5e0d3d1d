"""The driver every in-place graph rewrite runs under: each step by name, timed, with the node
count after it (its ATen calls) and whether it changed the graph, for :func:`hoad.explain`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch.fx as fx

# a rewrite changes the graph it is given in place, or returns the GraphModule that replaces it
# (anything else it returns, such as whether it changed something, is not read)
Rewrite = tuple[str, Callable[[fx.GraphModule], object]]


def rewrite(gm: fx.GraphModule, steps: Sequence[Rewrite], stats: dict | None = None) -> fx.GraphModule:
    """Run ``steps`` on ``gm`` in order; with ``stats``, record each one's seconds, node count
    after it and whether it changed the graph (a node, an op or an edge), by name."""
    for name, step in steps:
        before = _wiring(gm) if stats is not None else None
        start = time.perf_counter()
        out = step(gm)
        gm = out if isinstance(out, fx.GraphModule) else gm
        if stats is not None:
            stats[name] = {"seconds": time.perf_counter() - start, "nodes": calls(gm),
                           "changed": _wiring(gm) != before}
    return gm


def _wiring(gm: fx.GraphModule) -> list:
    """Each node with its op and the nodes it reads: what a rewrite changes (a fifteenth of the
    cost of the printed graph, which each build paid 16 times)."""
    return [(n, n.target, tuple(n.all_input_nodes)) for n in gm.graph.nodes]


def calls(gm: fx.GraphModule) -> int:
    """The graph's ATen calls (its call_function nodes)."""
    return sum(n.op == "call_function" for n in gm.graph.nodes)
