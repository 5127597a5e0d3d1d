"""Static cost of a derivative program: FLOPs and bytes from the shapes on its nodes.

Sizes are known at trace time, so the cost model compares the actual programs of both
directions rather than guessing from the primal graph.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

aten = torch.ops.aten

# ops that only relabel memory
_FREE = {aten.view.default, aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dims,
         aten.alias.default, aten.slice.Tensor, aten.select.int, aten.diagonal.default, aten._unsafe_view.default}


def _custom(name: str):
    """``torch.ops.hoad.<name>.default`` where hoad's kernels are loaded, else None."""
    namespace = getattr(torch.ops, "hoad", None)
    packet = getattr(namespace, name, None) if namespace is not None and hasattr(namespace, name) else None
    return getattr(packet, "default", None)


def _products() -> set:
    return {aten.mm.default, aten.bmm.default} | ({_custom("mm")} - {None})


def is_view(node: fx.Node) -> bool:
    """Whether a node only relabels memory (costs no arithmetic)."""
    return node.op == "call_function" and node.target in _FREE


def _numel(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel()
    if isinstance(v, (tuple, list)):
        return sum(_numel(x) for x in v)
    return 0


def node_cost(node: fx.Node) -> tuple[int, int]:
    """(flops, bytes written and read) of one call."""
    if node.op != "call_function" or node.target in _FREE:
        return 0, 0
    out = node.meta.get("val")
    n_out = _numel(out)
    ins = [a.meta.get("val") for a in node.all_input_nodes]
    n_in = sum(_numel(v) for v in ins)
    size = out.element_size() if isinstance(out, torch.Tensor) else 8
    if node.target in _products():
        a, b = (arg.meta["val"] for arg in node.args[:2])
        flops = 2 * math.prod(a.shape) * b.shape[-1]
    elif node.target is not None and node.target is _custom("gram"):  # J [B,K,N] -> [B,N,N]
        j = node.args[0].meta["val"]
        flops = 2 * math.prod(j.shape) * j.shape[-1]
    elif node.target is not None and node.target in {_custom("jet_sqnorm"), _custom("jet_mm")} - {None}:
        # J [(P,)S,K], c [P,K], W [K,M] -> q [P,M] (and jet_mm's X [P,S,M])
        j, c, w = (arg.meta["val"] for arg in node.args[:3])
        flops = 2 * c.shape[0] * j.shape[-2] * math.prod(w.shape)
    else:
        flops = max(n_out, n_in)
    return flops, (n_out + n_in) * size


# FLOP-equivalents of one ATen call's overhead: ~2-5 µs of dispatch when run eagerly, far less
# once Inductor has fused the elementwise calls into a few kernels
CALL_COST = {"eager": 1e4, "inductor": 1e3}


def estimate(gm: fx.GraphModule, backend: str = "eager") -> dict:
    flops = bytes_ = calls = 0
    for node in gm.graph.nodes:
        f, b = node_cost(node)
        flops += f
        bytes_ += b
        calls += node.op == "call_function"
    # one number to compare: FLOPs, memory traffic at ~4 bytes per FLOP, and per-call overhead
    score = flops + bytes_ / 4 + CALL_COST.get(backend, 1e4) * calls
    return {"flops": flops, "bytes": bytes_, "calls": calls, "score": math.floor(score)}
