"""Under ``batch_dim``, keep the sample axis out of reshapes that merge it with other axes.

Torch computes ``x @ W`` on an ``[B, N, d]`` input (``nn.Linear`` on a set or a sequence) as
``view(x, [B·N, d])``, ``mm`` and a view back; hoad's own reverse programs contract ``[k, B, c]``
tangents the same way, through ``[k, B·c]``. The block algebra ties the sample axis of a value to
the sample axis of each slot; an axis of size B·N cannot be tied to one of size B, so the view
would untie the samples and the program would stop being per sample (a false
:class:`~hoad.BatchCouplingError`).

This pass rewrites such products to ``aten.matmul`` on the unmerged operand, whose rule
contracts the last axis and keeps every other axis apart, and moves the merging view past
pointwise ops toward the view that splits the axis back, where the two cancel. The rewrites are
exact identities; a merge they cannot move stays, and the algebra then unties it as before.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode

from hoad.passes.clean import fold_layout
from hoad.passes.graph import depending, shape_of, traced_call

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default)


def keep_samples_apart(gm: fx.GraphModule, wrt: list[int]) -> fx.GraphModule:
    """Rewrite, in place, products and pointwise ops that read a view merging leading axes of a
    value that depends on the placeholders at positions ``wrt``."""
    changed = True
    while changed:
        changed = False
        varies = depending(gm, wrt)
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or not node.users:
                continue
            if node.target == aten.mm.default:
                changed |= _unmerge_product(gm, node, varies)
            elif node.target == aten.bmm.default:
                changed |= _unmerge_batched_product(gm, node, varies)
            elif torch.Tag.pointwise in getattr(node.target, "tags", ()):
                changed |= _sink_past_pointwise(gm, node, varies) or _sink_run_past_pointwise(gm, node, varies)
            elif node.target in _REDUCTIONS:
                changed |= _sink_run_past_reduction(gm, node, varies)
            elif node.target in _SIZE_ONE_VIEWS:
                changed |= _as_view(gm, node, varies)
            elif node.target in _VIEWS:
                changed |= _stack_of_cat(gm, node, varies)
            elif node.target is aten.permute.default:
                changed |= _merge_after_permute(gm, node)
            elif node.target is aten.clone.default:
                changed |= _merge_after_clone(gm, node, varies)
            elif node.target is aten.cat.default:
                changed |= _sink_run_past_cat(gm, node, varies)
            elif node.target in (aten.index.Tensor, aten.index_put.default):
                changed |= _index_by_sample(gm, node)
        changed |= fold_layout(gm)
        gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _view_shapes(v, varies: set | None) -> tuple[tuple, tuple] | None:
    """(source shape, shape) of a view whose source is in ``varies`` (any source where None), else
    None."""
    if not (isinstance(v, fx.Node) and v.op == "call_function" and v.target in _VIEWS
            and (varies is None or v.args[0] in varies)):
        return None
    old, new = shape_of(v.args[0]), shape_of(v)
    return None if old is None or new is None else (old, new)


def _merged_rows(v, varies: set | None) -> int:
    """How many leading axes of its source the view ``v`` merges into its first axis (0 where it
    does something else, or where its source is not in ``varies``, if given):
    ``[s1, ..., sn, *t] -> [s1·...·sn, *t]``."""
    shapes = _view_shapes(v, varies)
    if shapes is None or not shapes[1]:
        return 0
    old, new = shapes
    n = len(old) - len(new) + 1
    if n < 2 or list(old[n:]) != list(new[1:]) or math.prod(old[:n]) != new[0]:
        return 2 if _rows_split(old, new) else 0
    return n if sum(s != 1 for s in old[:n]) >= 2 else 0


def _rows_split(old, new) -> list | None:
    """``[s, k, *t]`` where a view ``old -> new = [s·k, *t]`` merges the leading axis s with part
    of the axes after it that it splits first (``[B, 4] -> [B·2, 2]``: a reshape to [B, 2, 2]
    folded into the matmul's merge), else None. The split is a view of ``old`` itself: every cut
    of ``old`` is one of ``[s, k, *t]``."""
    if not old or not new or old[0] == 1 or new[0] <= old[0] or new[0] % old[0]:
        return None
    split = [old[0], new[0] // old[0], *new[1:]]
    cuts = lambda shape: {math.prod(shape[:i + 1]) for i in range(len(shape))}  # noqa: E731
    return split if cuts(list(old)) <= cuts(split) else None


def _merged_rows_reshaped(v) -> int:
    """n where the view ``v`` is ``[s1, ..., sn, *t] -> [s1·...·sn, *u]`` with n >= 2 (two axes
    not of size 1 among them) and t, u the same entries in other shapes (a bmm's matrices), else 0."""
    shapes = _view_shapes(v, None)
    if shapes is None or not shapes[1]:
        return 0
    old, new = shapes
    for n in range(2, len(old) + 1):
        if math.prod(old[:n]) == new[0]:
            return n if sum(s != 1 for s in old[:n]) >= 2 and math.prod(old[n:]) == math.prod(new[1:]) else 0
    return 0


def _rows_source(gm: fx.GraphModule, where: fx.Node, v: fx.Node) -> fx.Node:
    """The source of a view that :func:`_merged_rows` accepts, shaped with the merged axes apart."""
    src = v.args[0]
    split = _rows_split(shape_of(src), shape_of(v))
    return src if split is None else _call_before(gm, where, aten.view.default, (src, split))


def _merged_middle(v, varies) -> bool:
    """Whether the view ``v`` is ``[s1, ..., sn, d] -> [1, s1·...·sn, d]`` of a value in
    ``varies``, size-1 axes aside (n >= 2)."""
    shapes = _view_shapes(v, varies)
    if shapes is None or len(shapes[1]) != 3 or shapes[1][0] != 1:
        return False
    old, new = shapes
    kept = [s for s in old if s != 1]  # (size-1 axes move freely in a view)
    return len(kept) >= 3 and kept[-1] == new[2] and math.prod(kept[:-1]) == new[1]


def _merged_columns(v, varies) -> bool:
    """Whether the view ``v`` is ``[k, s1, ..., sn] -> [k, s1·...·sn]`` with n >= 2."""
    shapes = _view_shapes(v, varies)
    if shapes is None:
        return False
    old, new = shapes
    return len(new) == 2 and len(old) >= 3 and old[0] == new[0] and sum(s != 1 for s in old[1:]) >= 2


def _merged_rows_and_columns(v, varies) -> int:
    """n where the view ``v`` is ``[s1, ..., sn, t1, ..., tm] -> [s1·...·sn, t1·...·tm]`` with
    n >= 2 and m >= 2 (attention's heads joined back before its output projection), else 0."""
    shapes = _view_shapes(v, varies)
    if shapes is None or len(shapes[1]) != 2:
        return 0
    old, (rows, cols) = shapes
    for n in range(2, len(old) - 1):
        if math.prod(old[:n]) == rows and math.prod(old[n:]) == cols and sum(s != 1 for s in old[:n]) >= 2:
            return n
    return 0


def _unmerge_product(gm: fx.GraphModule, mm: fx.Node, varies: set) -> bool:
    a, b = mm.args
    n = _merged_rows_and_columns(a, varies)
    if _merged_rows(a, varies) or n:      # [s..., d] @ [d, h] through [P, d]
        z = a.args[0] if n else _rows_source(gm, mm, a)
        with gm.graph.inserting_before(mm):
            if n:  # the trailing axes joined first: [s..., t...] -> [s..., d]
                z = _call(gm, mm, aten.view.default, (z, list(shape_of(z)[:n]) + [shape_of(a)[1]]))
            out = _call(gm, mm, aten.matmul.default, (z, b))
            merged = _call(gm, mm, aten.view.default, (out, list(shape_of(mm))))
    elif _merged_columns(b, varies):   # [m, k] @ [k, s...] through [k, Q]
        z = b.args[0]
        r = len(shape_of(z))
        with gm.graph.inserting_before(mm):
            zt = _call(gm, mm, aten.permute.default, (z, list(range(1, r)) + [0]))
            at = _call(gm, mm, aten.permute.default, (a, [1, 0]))
            out = _call(gm, mm, aten.matmul.default, (zt, at))                       # [s..., m]
            out = _call(gm, mm, aten.permute.default, (out, [r - 1] + list(range(r - 1))))
            out = _call(gm, mm, aten.clone.default, (out,), {"memory_format": torch.contiguous_format})
            merged = _call(gm, mm, aten.view.default, (out, list(shape_of(mm))))
    else:
        return False
    mm.replace_all_uses_with(merged)
    return True


def _unmerge_batched_product(gm: fx.GraphModule, bmm: fx.Node, varies: set) -> bool:
    """``bmm`` of two views merging the same leading axes (torch's ``W @ x`` on ``[B, n, k, l]``:
    W expanded to ``[B, n, m, k]``, both viewed ``[B·n, ...]``) -> matmul of the unmerged two."""
    a, b = bmm.args
    if shape_of(bmm)[0] == 1 and _merged_middle(a, varies) and isinstance(b, fx.Node):
        # torch's einsum("bnd,de->bne"): [s..., d] viewed [1, P, d], and b [1, d, e]
        with gm.graph.inserting_before(bmm):
            z = a.args[0]
            if 1 in shape_of(z):
                z = _call(gm, bmm, aten.view.default, (z, [s for s in shape_of(z) if s != 1]))
            w = _call(gm, bmm, aten.view.default, (b, list(shape_of(b)[1:])))
            out = _call(gm, bmm, aten.matmul.default, (z, w))
            merged = _call(gm, bmm, aten.view.default, (out, list(shape_of(bmm))))
        bmm.replace_all_uses_with(merged)
        return True
    n = _merged_rows(a, None)
    reshaped = not n or n != _merged_rows(b, None)
    if reshaped:  # each view also reshapes its matrix axes: [B, n, 4, 4, 4, 4] -> [B·n, 16, 16]
        n = _merged_rows_reshaped(a)
        if not n or n != _merged_rows_reshaped(b):
            return False
    if shape_of(a.args[0])[:n] != shape_of(b.args[0])[:n] or (a.args[0] not in varies and b.args[0] not in varies):
        return False
    if reshaped:  # (a view: it only splits the first axis of a view of the same source back)
        za, zb = (_call_before(gm, bmm, aten.view.default, (v.args[0], list(shape_of(v.args[0])[:n])
                                                             + list(shape_of(v)[1:]))) for v in (a, b))
    else:
        za, zb = _rows_source(gm, bmm, a), _rows_source(gm, bmm, b)
    with gm.graph.inserting_before(bmm):
        out = _call(gm, bmm, aten.matmul.default, (za, zb))
        merged = _call(gm, bmm, aten.view.default, (out, list(shape_of(bmm))))
    bmm.replace_all_uses_with(merged)
    return True


# views that only add or drop size-1 axes: torch's ``x @ w`` for a 1-D w squeezes its [B·N, 1]
# product before the view back to [B, N]
_SIZE_ONE_VIEWS = (aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default)


def _as_view(gm: fx.GraphModule, node: fx.Node, varies: set) -> bool:
    """A squeeze or unsqueeze of a view merging leading axes, as a view of the same shape, which
    the layout fold joins to the views around it (so the merge can cancel)."""
    if not _merged_rows(node.args[0], varies) or shape_of(node) is None:
        return False
    with gm.graph.inserting_before(node):
        new = _call(gm, node, aten.view.default, (node.args[0], list(shape_of(node))))
    node.replace_all_uses_with(new)
    return True


def _atoms_of(s0: list, s1: list) -> tuple[list, list] | None:
    """The sizes both shapes group (:func:`_refinement`) and, for each axis of ``s1``, the atoms
    it groups; None where a shape has size-1 axes (they own no atom) or one splits unevenly."""
    atoms = _refinement(s0, s1)
    if atoms is None or 1 in s0 or 1 in s1:
        return None
    groups, at = [], 0
    for size in s1:
        run = []
        while at < len(atoms) and math.prod(atoms[i] for i in run) < size:
            run.append(at)
            at += 1
        groups.append(run)
    return atoms, groups


def _merge_after_permute(gm: fx.GraphModule, perm: fx.Node) -> bool:
    """``permute(view(z, s1), p)`` whose view merges axes, as ``view(permute(view(z, atoms), q))``:
    the merge moved past the permute, toward a product or a view that undoes it (multi-head
    attention with its weights: [L, B, E] viewed [L, B·heads, d], transposed to [B·heads, L, d]
    for its bmm). Constants too: a fixed key meets the varying query at that bmm."""
    inner = perm.args[0]
    shapes = _view_shapes(inner, None)
    if shapes is None:
        return False
    found = _atoms_of(list(shapes[0]), list(shapes[1]))
    if found is None or len(found[0]) == len(shapes[1]):  # (a view that merges nothing)
        return False
    atoms, groups = found
    moved = [i for d in perm.args[1] for i in groups[d % len(groups)]]
    with gm.graph.inserting_before(perm):
        split = _call(gm, perm, aten.view.default, (inner.args[0], atoms))
        new = _call(gm, perm, aten.permute.default, (split, moved))
        merged = _call(gm, perm, aten.view.default, (new, list(shape_of(perm))))
    perm.replace_all_uses_with(merged)
    return True


def _merge_after_clone(gm: fx.GraphModule, clone: fx.Node, varies: set) -> bool:
    """``clone(view(z), contiguous)`` of a view merging leading axes -> ``view(clone(z))``."""
    v = clone.args[0]
    if clone.kwargs.get("memory_format") is not torch.contiguous_format or not _merged_rows(v, varies):
        return False
    with gm.graph.inserting_before(clone):
        new = _call(gm, clone, aten.clone.default, (_rows_source(gm, clone, v),),
                    {"memory_format": torch.contiguous_format})
        merged = _call(gm, clone, aten.view.default, (new, list(shape_of(clone))))
    clone.replace_all_uses_with(merged)
    return True


def _stack_of_cat(gm: fx.GraphModule, view: fx.Node, varies: set) -> bool:
    """``view(cat([x1, ..., xn]), [n, *x.shape])`` of pieces of one shape -> the cat of the pieces
    each unsqueezed (a stack): torch's GRU and LSTM join their steps' [B, h] outputs into
    [T·B, h] and view that as [T, B, h]."""
    cat = view.args[0]
    if not (isinstance(cat, fx.Node) and cat.op == "call_function" and cat.target is aten.cat.default
            and cat in varies and (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) == 0):
        return False
    pieces = list(cat.args[0])
    shapes = {shape_of(x) for x in pieces}
    if len(shapes) != 1 or None in shapes or list(shape_of(view)) != [len(pieces), *next(iter(shapes))]:
        return False
    with gm.graph.inserting_before(view):
        rows = [_call(gm, view, aten.unsqueeze.default, (x, 0)) for x in pieces]
        new = _call(gm, view, aten.cat.default, (rows, 0))
    view.replace_all_uses_with(new)
    return True


def _refinement(a: list, b: list) -> list | None:
    """The coarsest sizes both ``a`` and ``b`` group consecutively (the boundaries of their
    running products, merged), or None where one splits an axis of the other unevenly."""
    cuts = sorted({math.prod(a[:i + 1]) for i in range(len(a))} | {math.prod(b[:i + 1]) for i in range(len(b))})
    if math.prod(a) != math.prod(b) or any(y % x for x, y in zip(cuts, cuts[1:])):
        return None
    return [c // p for c, p in zip(cuts, [1] + cuts[:-1])]


def _sink_past_pointwise(gm: fx.GraphModule, node: fx.Node, varies: set) -> bool:
    """``op(view(z), c)`` -> ``view(op(z, c))`` for a view merging leading axes, where every
    other tensor operand broadcasts over the unmerged trailing axes only."""
    views = {a for a in node.all_input_nodes if _merged_rows(a, varies)}
    if len(views) != 1:
        return False
    (v,) = views
    new = shape_of(v)
    trailing = len(new) - 1
    out_shape = shape_of(node)
    if out_shape is None or len(out_shape) != len(new):
        return False

    def operand(a):
        if a is v:
            return _rows_source(gm, node, v)
        s = shape_of(a)
        if s is None or len(s) > trailing + 1 or (len(s) == trailing + 1 and s[0] != 1):
            return None
        return a if len(s) <= trailing else _call_before(gm, node, aten.view.default, (a, list(s[1:])))

    return _rebuild_pointwise(gm, node, operand, out_shape)


def _rebuild_pointwise(gm: fx.GraphModule, node: fx.Node, operand, out: tuple) -> bool:
    """``node`` (pointwise) computed on each tensor argument as ``operand`` maps it (None:
    refuse), then viewed as ``out``: the merging view moved past it. Refused where a tensor
    arrives in a list or a keyword."""
    args = []
    for a in node.args:
        if isinstance(a, fx.Node):
            a = operand(a)
            if a is None:
                return False
        elif isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
            return False
        args.append(a)
    if any(isinstance(x, fx.Node) for x in fx.node.map_aggregate(node.kwargs, lambda x: x).values()):
        return False
    with gm.graph.inserting_before(node):
        new = _call(gm, node, node.target, tuple(args), dict(node.kwargs))
        view = _call(gm, node, aten.view.default, (new, list(out)))
    node.replace_all_uses_with(view)
    return True


def _merged_run(v, varies, first: int = 1) -> tuple[int, tuple, list] | None:
    """(i, run, unmerged shape) where the view ``v`` merges a run of axes of its source into its
    axis i >= first, the other axes kept: ``[a, s1, ..., sk, b] -> [a, s1·...·sk, b]`` (k >= 2). A
    source without the view's leading size-1 axes counts as having them (instance norm views
    [B, C, L] as [1, B·C, L] for a batch norm of one batch entry). Pointwise ops move merges of
    leading axes (i = 0) by :func:`_sink_past_pointwise` where only one operand is such a view."""
    shapes = _view_shapes(v, varies)
    if shapes is None:
        return None
    old, new = list(shapes[0]), list(shapes[1])
    lead = 0
    while lead < len(new) and new[lead] == 1 and (lead >= len(old) or old[lead] != 1):
        lead += 1
    old = [1] * lead + old
    k = len(old) - len(new) + 1
    if k < 2:
        return None
    for i in range(first, len(new)):
        run = old[i:i + k]
        if (old[:i] == new[:i] and old[i + k:] == new[i + 1:] and math.prod(run) == new[i]
                and sum(n != 1 for n in run) >= 2):
            return i, tuple(run), old
    return None


def _unmerged(gm: fx.GraphModule, where: fx.Node, v: fx.Node, old: list) -> fx.Node:
    src = v.args[0]
    return src if list(shape_of(src)) == old else _call_before(gm, where, aten.view.default, (src, old))


def _sink_run_past_pointwise(gm: fx.GraphModule, node: fx.Node, varies: set) -> bool:
    """``op(view(z), view(y), c)`` -> ``view(op(z, y, c))`` where the views merge the same run of
    axes into one axis and every other tensor operand broadcasts along that axis or is a constant
    split there as the run (instance norm's running statistics, repeated per sample)."""
    runs = {a: _merged_run(a, None, first=0) for a in node.all_input_nodes}  # (constants too: instance norm's
    merged = {a: r for a, r in runs.items() if r is not None}         # weight repeated per sample)
    if (not any(a in varies for a in merged)
            or len({(i, run) for i, run, _old in merged.values()}) != 1):
        return False
    i, run, _old = next(iter(merged.values()))
    out = shape_of(node)
    if out is None or any(len(shape_of(a) or ()) != len(out) for a in merged):
        return False
    at = len(out) - 1 - i  # the merged axis, counted from the right (operands broadcast from the right)

    def operand(a):
        if a in merged:
            return _unmerged(gm, node, a, merged[a][2])
        sa = shape_of(a)
        j = None if sa is None else len(sa) - 1 - at
        if sa is None or (j >= 0 and sa[j] != 1 and (sa[j] != math.prod(run) or a in varies)):
            return None
        if j < 0:
            return a
        # one size-1 axis per axis of the run, or (a constant) its axis split as the run
        split = [1] * len(run) if sa[j] == 1 else list(run)
        return _call_before(gm, node, aten.view.default, (a, list(sa[:j]) + split + list(sa[j + 1:])))

    return _rebuild_pointwise(gm, node, operand, out)


def _sink_run_past_cat(gm: fx.GraphModule, cat: fx.Node, varies: set) -> bool:
    """``cat([view(z), c], d)`` -> ``view(cat([z, c split], d'))`` where the views merge the same
    run of axes into an axis other than d and every other piece is a constant, split there as the
    run (attention's ``add_zero_attn`` joins a zero key to [B·heads, S, d])."""
    pieces = cat.args[0]
    d = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    out = shape_of(cat)
    merged = {a: _merged_run(a, None, first=0) for a in pieces}
    merged = {a: r for a, r in merged.items() if r is not None}
    if (out is None or not any(a in varies for a in merged)
            or len({(i, run) for i, run, _old in merged.values()}) != 1):
        return False
    i, run, _old = next(iter(merged.values()))
    d %= len(out)
    if d == i or any(len(shape_of(a) or ()) != len(out) or (a not in merged and a in varies) for a in pieces):
        return False
    split = []
    for a in pieces:
        if a in merged:
            split.append(_unmerged(gm, cat, a, merged[a][2]))
        else:
            sa = list(shape_of(a))
            split.append(_call_before(gm, cat, aten.view.default, (a, sa[:i] + list(run) + sa[i + 1:])))
    with gm.graph.inserting_before(cat):
        new = _call(gm, cat, aten.cat.default, (split, d if d < i else d + len(run) - 1))
        view = _call(gm, cat, aten.view.default, (new, list(out)))
    cat.replace_all_uses_with(view)
    return True


_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_UNIT_VIEWS = (aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _counts_rows(index, n: int) -> bool:
    """Whether ``index`` is ``arange(n)`` shaped (n, 1, ..., 1): each entry picks its own row."""
    shape = shape_of(index)
    if shape is None or not shape or shape[0] != n or any(s != 1 for s in shape[1:]):
        return False
    while isinstance(index, fx.Node) and index.target in _UNIT_VIEWS:
        index = index.args[0]
    if (not (isinstance(index, fx.Node) and index.target in _ARANGES)
            or index.kwargs.get("dtype") not in (None, torch.int64)):
        return False
    bounds = list(index.args)
    start, end, step = ([0] + bounds + [1])[:3] if len(bounds) == 1 else (bounds + [1])[:3]
    return (start, end, step) == (0, n, 1)


def _index_by_sample(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``x[arange(B)[:, None], idx]`` (read, or written by index_put) with x's dim 0 the samples:
    each sample indexes its own row. With idx the same for every sample it is ``x[:, idx]``;
    with one idx per sample (B, ...) it is a gather (a scatter) along dim 1. Both act on each
    sample apart; the advanced index over dim 0 looked like an op mixing samples."""
    x, indices = node.args[0], list(node.args[1])
    xs = shape_of(x)
    if xs is None or len(indices) < 2 or any(i is None for i in indices) or not _counts_rows(indices[0], xs[0]):
        return False
    rank = len(shape_of(indices[0]))
    others = indices[1:]
    shapes = [shape_of(i) for i in others]
    if any(s is None or len(s) > rank for s in shapes):
        return False
    per_sample = [len(s) == rank and s[0] != 1 for s in shapes]
    if not any(per_sample) and max(len(s) for s in shapes) == rank - 1:
        with gm.graph.inserting_before(node):
            new = _call(gm, node, node.target, (x, [None, *others], *node.args[2:]), dict(node.kwargs))
        node.replace_all_uses_with(new)
        return True
    if len(others) != 1:
        return False
    # one index per sample: positions (B, *s) into dim 1, the rest of x's dims carried along
    (idx,), rest = others, list(xs[2:])
    n, s = xs[0], list(torch.broadcast_shapes(shape_of(idx), (xs[0],) + (1,) * (rank - 1))[1:])
    flat = math.prod(s)
    with gm.graph.inserting_before(node):
        pos = _call(gm, node, aten.expand.default, (idx, [n, *s]))
        pos = _call(gm, node, aten.reshape.default, (pos, [n, flat] + [1] * len(rest)))
        pos = _call(gm, node, aten.expand.default, (pos, [n, flat, *rest]))
        if node.target is aten.index.Tensor:
            taken = _call(gm, node, aten.gather.default, (x, 1, pos))
            new = _call(gm, node, aten.view.default, (taken, [n, *s, *rest]))
        else:
            values = _call(gm, node, aten.expand.default, (node.args[2], [n, *s, *rest]))
            values = _call(gm, node, aten.reshape.default, (values, [n, flat, *rest]))
            accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
            op, args = (aten.scatter_add.default, (x, 1, pos, values)) if accumulate else \
                (aten.scatter.src, (x, 1, pos, values))
            new = _call(gm, node, op, args)
    node.replace_all_uses_with(new)
    return True


# reductions that keep their axes (keepdim=True) and may move past a merging view
_REDUCTIONS = (aten.sum.dim_IntList, aten.amax.default, aten.amin.default)


def _sink_run_past_reduction(gm: fx.GraphModule, node: fx.Node, varies: set) -> bool:
    """``sum(view(z), dims, keepdim=True)`` (or amax, amin) over axes other than the merged one ->
    ``view(sum(z))``: instance norm's statistics, attention's softmax over [B·heads, L, L]."""
    v, dims = node.args[0], node.args[1]
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    found = _merged_run(v, varies, first=0)
    if found is None or not keep or node.kwargs.get("dtype") is not None or not dims:
        return False
    i, run, old = found
    rank = len(shape_of(v))
    dims = [d % rank for d in dims]
    if i in dims:
        return False
    mapped = [d if d < i else d + len(run) - 1 for d in dims]
    with gm.graph.inserting_before(node):
        new = _call(gm, node, node.target, (_unmerged(gm, node, v, old), mapped, True))
        view = _call(gm, node, aten.view.default, (new, list(shape_of(node))))
    node.replace_all_uses_with(view)
    return True


def _call_before(gm: fx.GraphModule, where: fx.Node, target, args, kwargs=None) -> fx.Node:
    with gm.graph.inserting_before(where):
        return _call(gm, where, target, args, kwargs)


def _call(gm: fx.GraphModule, origin: fx.Node, target, args, kwargs=None) -> fx.Node:
    """A new node computing ``target(*args)`` with its traced value, placed where the graph's
    insertion point is, and sourced (for error messages) to ``origin``."""
    values = [a.meta["val"] for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, fx.Node)]
    with detect_fake_mode(values) or contextlib.nullcontext():
        node = traced_call(gm.graph, target, args, kwargs)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in origin.meta:
            node.meta[key] = origin.meta[key]
    return node
