"""Lower products: each 2-D matrix product as the program's lowering prefers it.

The algebra emits ``aten.mm`` everywhere; on a machine whose lowering knows better (Inductor on a
CPU with hoad's kernels, see :mod:`hoad.lowering.inductor`), this pass, run after clean, rewrites
each one into ``hoad::mm`` (operands made contiguous first) or into a broadcast product summed
over the inner dimension, which Inductor fuses. The primal layers' products are included.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from hoad.algebra.target import Lowering

aten = torch.ops.aten


def lower_products(gm: fx.GraphModule, lowering: Lowering) -> fx.GraphModule:
    """Rewrite ``aten.mm`` nodes as ``lowering.product`` says; a no-op for the eager lowering."""
    if not hasattr(lowering, "product"):
        return gm
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.mm.default or node.kwargs:
            continue
        a, b = node.args
        va, vb = a.meta.get("val"), b.meta.get("val")
        if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
            continue
        how = lowering.product(va, vb)
        if how == "mm":
            continue
        with gm.graph.inserting_before(node), va.fake_mode:
            if how == "kernel":
                ca, cb = _contiguous(gm, a), _contiguous(gm, b)
                new = _call(gm, torch.ops.hoad.mm.default, (ca, cb))
            else:  # a vector-matrix product as a fused reduction: (a[:, :, None] * b[None]).sum(1)
                left = _call(gm, aten.unsqueeze.default, (a, 2))
                right = _call(gm, aten.unsqueeze.default, (b, 0))
                new = _call(gm, aten.sum.dim_IntList, (_call(gm, aten.mul.Tensor, (left, right)), [1]))
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm


def _call(gm: fx.GraphModule, target, args: tuple) -> fx.Node:
    """A new node with its traced value (shapes and strides) in ``meta["val"]``."""
    node = gm.graph.call_function(target, args)
    values = fx.node.map_arg(args, lambda n: n.meta["val"])
    node.meta["val"] = target(*values)
    return node


def _contiguous(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """``node``, or a contiguous copy of it (hoad::mm reads dense row-major operands)."""
    if node.meta["val"].is_contiguous():
        return node
    new = gm.graph.call_function(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    new.meta["val"] = node.meta["val"].clone(memory_format=torch.contiguous_format)
    return new
