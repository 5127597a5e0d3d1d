"""Rewrites capture runs on the traced graph that change how values are computed, never what
they are: a norm squared is the sum of squares (:func:`squares_of_norms`, exact derivatives at
0 where the root has none), and a branch of ``torch.where`` that is not taken is computed at a
safe point (:func:`safe_branches`: its derivatives would be NaN, and 0 · NaN is NaN)."""

from __future__ import annotations

import contextlib
import heapq

import torch
from torch import fx

from hoad.errors import HoadInternalError
from hoad.passes.graph import traced_call

aten = torch.ops.aten


# a 2-norm squared (an RBF kernel's cdist(x, y) ** 2, ‖x‖² written as torch.norm(x) ** 2) is the
# sum of squares, smooth where the norm is not: its Hessian at a zero difference is 2I, while the
# chain rule through the norm's subgradient 0 gave 0. After capture, the square of what _norm
# returns (through squeezes and views) is rewritten to the sum of squares it took the root of.
_LAYOUT_OPS = (aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, aten.view.default, aten.reshape.default,
               aten.unsqueeze.default)


def squares_of_norms(gm) -> None:
    """Rewrite, in place, ``norm ** 2`` (and ``norm * norm``) of :func:`_norm`'s p = 2 pattern
    ``where(total = 0, 0, where(total = 0, 1, total) ** 0.5)`` to ``total``."""
    for node in list(gm.graph.nodes):
        total = _root_of_norm(node)
        if total is None:
            continue
        chain, frontier = [], [(node, [])]
        while frontier:
            value, path = frontier.pop()
            for user in list(value.users):
                if user.target in _LAYOUT_OPS and user.args[0] is value:
                    frontier.append((user, path + [user]))
                elif (user.target is aten.pow.Tensor_Scalar and user.args[0] is value and user.args[1] == 2) or (
                        user.target is aten.mul.Tensor and user.args[0] is value and user.args[1] is value):
                    chain.append((user, path))
        for square, path in chain:
            with gm.graph.inserting_before(square):
                out = total
                for step in path:
                    out = gm.graph.node_copy(step, lambda a, step=step, out=out: out if a is step.args[0] else a)
            square.replace_all_uses_with(out)
    gm.graph.eliminate_dead_code()
    gm.recompile()


# where(c, a, b) whose untaken entries compute an infinity (where(eye, 0, 1 / r) with r_ii = 0, a
# masked Coulomb sum; where(x > 0, log x, 0)): the values are right and forward mode selects, but
# the adjoint form's first sweep multiplies the untaken entries' zero cotangent by that infinity
# (NaN, as torch's own backward). The singular ops of a branch read a safe value on the entries
# the where does not take, as the double-where idiom writes by hand: the same function, exactly.
_SAFE = {aten.reciprocal.default: 1.0, aten.log.default: 1.0, aten.log2.default: 1.0, aten.log10.default: 1.0,
         aten.log1p.default: 0.0, aten.sqrt.default: 1.0, aten.rsqrt.default: 1.0, aten.acos.default: 0.0,
         aten.asin.default: 0.0, aten.atanh.default: 0.0, aten.acosh.default: 2.0, aten.erfinv.default: 0.0,
         aten.lgamma.default: 1.0, aten.digamma.default: 1.0, aten.div.Tensor: 1.0, aten.pow.Tensor_Scalar: 1.0,
         aten.pow.Tensor_Tensor: 1.0}


# (a where inside a branch is pointwise too: xlogy's decomposition guards its NaN with one)
_POINTWISE = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
              aten.add.Scalar, aten.mul.Scalar, aten.rsub.Scalar, aten.pow.Tensor_Scalar, aten.where.self)


def safe_branches(gm) -> None:
    """Rewrite, in place, each singular op in a branch of a ``where`` (a region of pointwise ops
    of the where's shape that only the where reads) to read ``where(taken, u, safe)``."""
    from hoad.rules import elementwise, special

    pointwise = set(_POINTWISE) | set(elementwise.OPS.rules) | set(special.OPS.rules)
    changed = False
    # the branches taken under the same condition, of wheres of one shape, share a region: a
    # distance read by two masked pair terms (Coulomb and Lennard-Jones over r = √Σd²) is the
    # region of both, and its √ at r = 0 is guarded too (it was NaN in reverse mode)
    groups: dict[tuple, list] = {}
    for node in list(gm.graph.nodes):
        if node.target is aten.where.self:
            cond, *branches = node.args
            for k, branch in enumerate(branches):
                groups.setdefault((cond, k, _shape(node)), []).append((node, branch))
    for (cond, k, _), members in groups.items():
        wheres = [w for w, _b in members]
        region = _branch_region([b for _w, b in members], wheres, pointwise, k)
        position = {n: j for j, n in enumerate(gm.graph.nodes)}
        region.sort(key=position.get)
        first = min(wheres, key=position.get)
        at = 0
        while at < len(region):  # (the live region: a guarded copy replaces its original in place)
            op = region[at]
            at += 1
            for i in _singular_inputs(op):
                u = op.args[i]
                if _already_safe(u, cond, k) or not _fits(cond, u):
                    continue
                tail = _tail(op, region)
                if _reads(cond, op) or any(not all(u in region or _as_branch(u, n, wheres, k) for u in n.users)
                                           for n in tail):
                    _guard_a_copy(gm.graph, op, i, tail, region, wheres, first, cond, k)
                else:
                    op.update_arg(i, _where_safe(gm.graph, op, cond, k, u, _SAFE[op.target]))
                changed = True
    if changed:
        _stable_sort(gm.graph)
        gm.graph.lint()
        gm.recompile()


def _guard_a_copy(graph, op, i: int, tail: list, region: list, wheres: list, first, cond, k: int) -> None:
    """The wheres read a copy of ``op`` and of the region after it (``tail``), ``op`` reading a
    guarded argument, where the condition is computed from ``op`` or its value is read by one
    (nan_to_num(1 / r) masks 1 / r by its own isinf): the originals keep their entries for the
    conditions (booleans, not differentiated). The region is updated to the copies."""
    copies: dict = {}
    with graph.inserting_before(first):
        for node in tail:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: copies.get(a, a))
            if node is op:
                args = list(args)
                args[i] = _where_safe(graph, None, cond, k, op.args[i], _SAFE[op.target])
            copies[node] = traced_call(graph, node.target, tuple(args), dict(kwargs))
    for w in wheres:
        w.args = fx.node.map_arg(w.args, lambda a: copies.get(a, a))
    region[:] = [copies.get(n, n) for n in region]


def _tail(op, region: list) -> list:
    """``op`` and the nodes of ``region`` that read it, directly or not, in ``region``'s order."""
    reached = {op}
    for n in region:
        if any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    return [n for n in region if n in reached]


def _reads(node, op) -> bool:
    """``node`` is computed from ``op``."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is op:
            return True
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return False


def _stable_sort(graph) -> None:
    """Reorder ``graph``'s nodes, in place, so each follows its inputs, keeping the order
    otherwise (guarded copies were inserted before the first where that reads them)."""
    nodes = list(graph.nodes)
    index = {n: j for j, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [index[n] for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        order.append(n)
        for user in n.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, index[user])
    if len(order) != len(nodes):
        raise HoadInternalError("safe_branches made a cycle in the captured graph")
    for before, n in zip(order, order[1:]):
        before.append(n)


def _where_safe(graph, op, cond, k: int, u, value: float):
    """``where(taken, u, value)`` before ``op`` (where the graph inserts, for None), with the
    values (meta) later passes read: taken is ``cond`` for the where's first branch, ``¬cond``
    for its second."""
    val = u.meta["val"]
    with graph.inserting_before(op) if op is not None else contextlib.nullcontext():
        taken = cond if k == 0 else traced_call(graph, aten.logical_not.default, (cond,))
        scalar = traced_call(graph, aten.scalar_tensor.default, (value,), {"dtype": val.dtype, "device": val.device})
        return traced_call(graph, aten.where.self, (taken, u, scalar))


def _branch_region(branches: list, wheres: list, pointwise, k: int) -> list:
    """The pointwise nodes of the ``wheres``' shape that compute ``branches`` (the wheres' branch k)
    and that nothing but the region and the wheres' branch k reads (a value read elsewhere must keep
    its entries: where(x > 1, √x, 2√x) reads √x as both branches, and the second's region took √x,
    so the first branch read its guarded 1)."""
    shape = _shape(wheres[0])
    region, todo = [], [b for b in branches if hasattr(b, "op") and b.op == "call_function"]
    while todo:
        node = todo.pop()
        if node in region or node.target not in pointwise or _shape(node) != shape or shape is None:
            continue
        region.append(node)
        todo += [a for a in node.all_input_nodes if a.op == "call_function"]
    inside = set(region)
    while True:  # drop nodes read from outside, and what only they led to
        outside = [n for n in region if not all(u in inside or _as_branch(u, n, wheres, k) or _condition_of(u)
                                                for u in n.users)]
        if not outside:
            return region
        for n in outside:
            region.remove(n)
            inside.discard(n)


def _as_branch(user, node, wheres: list, k: int) -> bool:
    """``user`` is one of ``wheres`` and reads ``node`` as its branch k only."""
    if user not in wheres:
        return False
    cond, *branches = user.args
    return branches[k] is node and cond is not node and branches[1 - k] is not node


def _condition_of(user, depth: int = 8) -> bool:
    """``user`` is boolean (``isinf(1 / r)``), or only leads to booleans (``|1 / r| ≠ ∞``): a
    condition, which a guarded copy of the branch leaves its entries (:func:`_guard_a_copy`). So
    is a detach (clamp's value outside its bounds, :func:`_clamp`): a constant, not differentiated."""
    if user.target is aten.detach.default:
        return True
    val = user.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype is torch.bool:
        return True
    return depth > 0 and bool(user.users) and all(_condition_of(u, depth - 1) for u in user.users)


def _singular_inputs(op) -> list[int]:
    """Positions of ``op``'s arguments at which it can be infinite (its singular points)."""
    if op.target not in _SAFE:
        return []
    if op.target is aten.div.Tensor:
        return [1] if hasattr(op.args[1], "op") else []
    if op.target is aten.pow.Tensor_Scalar:
        p = op.args[1]
        return [0] if isinstance(p, (int, float)) and (p < 0 or p != int(p)) else []
    return [0]


def _already_safe(u, cond, k: int) -> bool:
    """u is where(cond, x, …) for the first branch, where(cond, …, x) or where(¬cond, x, …) for the second."""
    if getattr(u, "target", None) is not aten.where.self:
        return False
    c = u.args[0]
    if k == 0:
        return c is cond
    return c is cond or (getattr(c, "target", None) is aten.logical_not.default and c.args[0] is cond)


def _fits(cond, u) -> bool:
    """where(cond, u, safe) has u's shape."""
    a, b = _shape(cond), _shape(u)
    if a is None or b is None:
        return False
    try:
        return tuple(torch.broadcast_shapes(a, b)) == tuple(b)
    except RuntimeError:
        return False


def _shape(node):
    val = getattr(node, "meta", {}).get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _root_of_norm(node):
    """``total`` where ``node`` is ``where(total == 0, 0, where(total == 0, 1, total) ** 0.5)``."""
    if not (getattr(node, "target", None) is aten.where.self and len(node.args) == 3):
        return None
    empty, _zero, root = node.args
    if not (getattr(root, "target", None) is aten.pow.Tensor_Scalar and root.args[1] == 0.5):
        return None
    inner = root.args[0]
    if not (getattr(inner, "target", None) is aten.where.self and inner.args[0] is empty):
        return None
    total = inner.args[2]
    if not (getattr(empty, "target", None) is aten.eq.Scalar and empty.args[0] is total and empty.args[1] == 0):
        return None
    return total
