"""Prune: arithmetic the rules leave in a derivative program that computes nothing new.

Schwarz symmetry and diagonal structure are pruned by construction in the transform (only
canonical multi-indices are requested; blocks stay compact). What remains for this pass are
local identities where a rule's constant factor turned out trivial: ``x * 1``, ``x + 0``,
``-(-x)``, a product of scalar factors applied one after the other, a multiplication by a
tensor of ones that does not change the shape.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``b`` can stand in for ``a``: the same shape, dtype and strides. ``x * 1`` of an
    expanded or transposed x is a dense copy, and the program's views of it were traced on that
    layout (a factor ``V.T.expand(B, D, S) * 1.0`` inside a traced loss: a later view of it could
    not be taken on the expand)."""
    va, vb = _val(a), _val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.stride() == vb.stride())


def _scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_ones(n) -> bool:
    return isinstance(n, fx.Node) and n.target == aten.full.default and n.args[1] == 1


def _replacement(node: fx.Node):
    """What ``node`` can be replaced by: an existing node, new (target, args), or None."""
    t, a = node.target, node.args
    if t in (aten.mul.Tensor, aten.div.Tensor) and len(a) == 2 and _scalar(a[1]) and a[1] == 1:
        return a[0] if _same_meta(node, a[0]) else None
    if t in (aten.add.Tensor, aten.sub.Tensor) and len(a) == 2 and _scalar(a[1]) and a[1] == 0 and not node.kwargs:
        return a[0] if _same_meta(node, a[0]) else None
    if t == aten.neg.default and isinstance(a[0], fx.Node) and a[0].target == aten.neg.default:
        return a[0].args[0] if _same_meta(node, a[0].args[0]) else None
    if t == aten.mul.Tensor and len(a) == 2 and _scalar(a[1]) and isinstance(a[0], fx.Node):
        inner = a[0]
        if (inner.target == aten.mul.Tensor and len(inner.args) == 2 and _scalar(inner.args[1])
                and len(inner.users) == 1):
            return aten.mul.Tensor, (inner.args[0], inner.args[1] * a[1])
        if inner.target == aten.neg.default and len(inner.users) == 1:
            return aten.mul.Tensor, (inner.args[0], -a[1])
    if t == aten.mul.Tensor and len(a) == 2:
        for ones, other in ((a[0], a[1]), (a[1], a[0])):
            if _is_ones(ones) and isinstance(other, fx.Node) and _same_meta(node, other):
                return other
    return None


def prune(gm: fx.GraphModule) -> fx.GraphModule:
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            new = _replacement(node)
            if new is None:
                continue
            if isinstance(new, fx.Node):
                node.replace_all_uses_with(new)
            else:
                node.target, node.args = new
            changed = True
        gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
