"""Contraction of evaluated blocks: the einsum of their compact data, planned pairwise.

Each operand's labels name its dense axes; ties inside an operand (a diagonal) become one label
on its data. The plan is a pairwise path (exhaustive for a few operands, opt_einsum beyond), and
each pair is one ``mul`` or ``mm``/``bmm``, in the layout its :class:`~hoad.algebra.target.Lowering`
prefers: the machine's choices (orientation, fused reductions, custom kernels) live there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence

import opt_einsum
import torch

from hoad.algebra.block import Block, _first_appearance, _squeeze_axes
from hoad.algebra.target import EAGER, EAGER_TARGET, Lowering, Target
from hoad.errors import internal_check

Label = Hashable


def _arrange(t: torch.Tensor, labels: list, target: list) -> torch.Tensor:
    """Permute ``t`` (axes named by ``labels``) into ``target`` order, size-1 axes where missing."""
    present = [l for l in target if l in labels]
    perm = [labels.index(l) for l in present]
    if perm != list(range(len(perm))):
        t = t.permute(perm)
    shape = [t.shape[present.index(l)] if l in labels else 1 for l in target]
    if list(t.shape) != shape:
        t = t.reshape(shape)
    return t


def _reduce_private(t: torch.Tensor, labels: list, needed: set) -> tuple[torch.Tensor, list]:
    """Sum out the axes whose labels nothing downstream needs."""
    drop = [i for i, l in enumerate(labels) if l not in needed]
    if not drop:
        return t, labels
    full = [i for i in drop if t.shape[i] != 1]
    if full:
        t = t.sum(full, keepdim=True)
    return _squeeze_axes(t, drop), [l for i, l in enumerate(labels) if i not in drop]


def _moves(labels: list, target: list) -> int:
    """1 if arranging ``labels`` into ``target`` order needs a permute, else 0."""
    present = [l for l in target if l in labels]
    return int([labels.index(l) for l in present] != sorted(labels.index(l) for l in present))


def _unbroadcast(t: torch.Tensor, labels: list, other: list, samples: set) -> torch.Tensor:
    """``t`` with size 1 along the labels it shares with the other operand but only broadcasts
    (stride 0), so the product treats them as the other's own labels: a weight expanded over a
    batch makes one matrix product with the batch folded into the columns, not a batched one (the
    inner program of a biharmonic expands its weights over the samples). Sample labels a program
    keeps as batch axes (SAMPLE_LABELS) stay."""
    for i, l in enumerate(labels):
        if l in other and l not in samples and t.shape[i] > 1 and t.stride(i) == 0:
            t = t.narrow(i, 0, 1)
    return t


def _share_samples(x: torch.Tensor, xs: list, y: torch.Tensor, ys: list, keep: set, samples: set):
    """Give each operand the kept sample labels only the other has (broadcast), so they become
    batch labels of the product (see SAMPLE_LABELS)."""
    for l in samples & keep:
        if l in xs and l not in ys and x.shape[xs.index(l)] > 1:
            y, ys = y.unsqueeze(-1).expand(*y.shape, x.shape[xs.index(l)]), ys + [l]
        elif l in ys and l not in xs and y.shape[ys.index(l)] > 1:
            x, xs = x.unsqueeze(-1).expand(*x.shape, y.shape[ys.index(l)]), xs + [l]
    return x, xs, y, ys


def _pair(x: torch.Tensor, xs: list, y: torch.Tensor, ys: list, keep: set, order: list | None = None,
          samples: set = frozenset(), lowering: Lowering = EAGER):
    """Contract two labelled tensors, keeping the labels in ``keep``; emits one mul or (b)mm.

    Among the equivalent layouts (which operand goes left, the order of labels inside each
    group) it picks the one needing the fewest permutes, ending in ``order`` when given.
    """
    x, xs = _reduce_private(x, xs, set(ys) | keep)
    y, ys = _reduce_private(y, ys, set(xs) | keep)
    if lowering.fused:
        x, y = _unbroadcast(x, xs, ys, samples), _unbroadcast(y, ys, xs, samples)
    # A shared label of size 1 in one operand: that operand is constant along it, so drop it there.
    sx = [i for i, l in enumerate(xs) if l in ys and x.shape[i] == 1 and (l not in keep or y.shape[ys.index(l)] != 1)]
    if sx:
        x, xs = _squeeze_axes(x, sx), [l for i, l in enumerate(xs) if i not in sx]
    sy = [i for i, l in enumerate(ys) if l in xs and y.shape[i] == 1]
    if sy:
        y, ys = _squeeze_axes(y, sy), [l for i, l in enumerate(ys) if i not in sy]
    x, xs = _reduce_private(x, xs, set(ys) | keep)
    y, ys = _reduce_private(y, ys, set(xs) | keep)

    contracted = [l for l in xs if l in ys and l not in keep]
    if samples and contracted:
        x, xs, y, ys = _share_samples(x, xs, y, ys, keep, samples)
    if not contracted:
        out = [l for l in (order or []) if l in xs or l in ys] or xs + [l for l in ys if l not in xs]
        return _arrange(x, xs, out) * _arrange(y, ys, out), out

    def sizes(t, ls, names):
        return [t.shape[ls.index(n)] for n in names]

    best = None
    for a, as_, b, bs in ((x, xs, y, ys), (y, ys, x, xs)):
        batch = [l for l in as_ if l in bs and l in keep]
        left = [l for l in as_ if l not in bs]
        right = [l for l in bs if l not in as_]
        m, n = math.prod(sizes(a, as_, left)), math.prod(sizes(b, bs, right))
        for con in (contracted, [l for l in bs if l in contracted]):
            out = batch + left + right
            cost = _moves(as_, batch + left + con) + _moves(bs, batch + con + right)
            cost += int(order is not None and out != [l for l in order if l in out])
            key = lowering.orientation(cost, m > 4 * n, bool(batch), m, math.prod(sizes(a, as_, con)), n, a)
            if best is None or key < best[0]:
                best = (key, a, as_, b, bs, batch, left, con, right)
    _cost, a, as_, b, bs, batch, left, con, right = best

    nb, m, n, k = sizes(a, as_, batch), sizes(a, as_, left), sizes(b, bs, right), sizes(a, as_, con)
    if batch and math.prod(m) == 1 and math.prod(n) == 1:
        # batched inner products (Σ_s (∂u/∂v_s)² of a collapsed operator): a product summed over
        # the contracted labels, not bmm of 1×k by k×1 matrices (and the copies that lays out)
        out = batch + left + right  # left and right: size-1 axes only
        full = out + con
        z = _arrange(a, as_, full) * _arrange(b, bs, full)
        return z.sum(list(range(len(out), len(full)))), out
    if batch and lowering.batched_as_reduction(math.prod(m), math.prod(n), _innermost(con, (a, as_), (b, bs))):
        # many small products, as the lowering prefers: a broadcast product summed over k
        full = batch + left + con + right
        z = _arrange(a, as_, full) * _arrange(b, bs, full)
        return z.sum(list(range(len(batch) + len(left), len(batch) + len(left) + len(con)))), batch + left + right
    lead = [math.prod(nb)] if batch else []
    a2 = _arrange(a, as_, batch + left + con).reshape(lead + [math.prod(m), math.prod(k)])
    b2 = _arrange(b, bs, batch + con + right).reshape(lead + [math.prod(k), math.prod(n)])
    if batch:
        a2, b2 = lowering.dense_batches(a2), lowering.dense_batches(b2)
    z = torch.bmm(a2, b2) if batch else torch.mm(a2, b2)
    return z.reshape(nb + m + n), batch + left + right


def _innermost(labels: list, *operands: tuple[torch.Tensor, list]) -> bool:
    """Whether one of ``labels`` is the stride-1 axis (of size > 1) of one of the operands."""
    return any(t.stride(ls.index(l)) == 1 and t.shape[ls.index(l)] > 1 for t, ls in operands for l in labels)


def _path(operands: list[tuple[tuple, list]], out: list) -> list[tuple[int, int]]:
    """Pairwise contraction order (opt_einsum's list format) for a few operands, by exhaustive
    search: least FLOPs plus intermediate entries, so ties go to the path with the smallest
    intermediates (what bounds memory when per-sample blocks are large)."""

    def step(items):
        if len(items) == 1:
            return 0, 0, []
        best = None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (xs, xl), (ys, yl) = items[i], items[j]
                rest = [items[k] for k in range(len(items)) if k not in (i, j)]
                need = set(out).union(*[set(l) for _s, l in rest])
                sizes: dict = {}
                for shp, ls in ((xs, xl), (ys, yl)):
                    for n, l in zip(shp, ls):
                        sizes[l] = max(sizes.get(l, 1), n)
                flops = math.prod(sizes.values())
                kept = [l for l in sizes if l in need]
                inter = math.prod(sizes[l] for l in kept)
                cost, peak, path = step(rest + [(tuple(sizes[l] for l in kept), kept)])
                cand = (flops + inter + cost, max(inter, peak), [(i, j)] + path)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return best

    return step(list(operands))[2]


@functools.lru_cache(maxsize=4096)
def _path_of(expr: str, shapes: tuple) -> tuple[tuple[int, int], ...]:
    """The pairwise path for an einsum of operands of these shapes, by :func:`_path` for up to 5
    operands and opt_einsum's search beyond, remembered: a build asks for the same contractions
    again and again (an order-5 Taylor jet of 8 elementwise ops: 480 searches, half of its build)."""
    inputs, out = expr.split("->")
    operands = inputs.split(",")
    if 2 < len(operands) <= 5:
        return tuple(_path([(s, list(ls)) for s, ls in zip(shapes, operands)], list(out)))
    if len(operands) > 5:
        # dynamic programming up to 20 operands (a few ms, once per distinct expression): opt_einsum's
        # default search took a 14-operand order-4 jet contraction of the torch-jet paper's MLP at
        # 4.9e10 FLOPs, forming per-sample [768, 768] matrices; the DP path takes 2.5e8
        optimize = "dp" if len(operands) <= 20 else "greedy"
        sizes: dict = {}
        for ls, shape in zip(operands, shapes):
            for l, n in zip(ls, shape):
                sizes[l] = max(sizes.get(l, 1), n)
        return tuple(tuple(step) for step in opt_einsum.contract_path(
            expr, *[tuple(sizes[l] for l in ls) for ls in operands], shapes=True, optimize=optimize)[0])
    return ((0, 1),) if len(operands) == 2 else ()


def _einsum(terms: list[tuple[torch.Tensor, list]], out: list, size: dict, samples: set = frozenset(),
            lowering: Lowering = EAGER) -> torch.Tensor:
    """Contract labelled tensors into ``out`` order along a cheap pairwise path."""
    terms = list(terms)
    whole = lowering.einsum(terms, out, size)
    if whole is not None:
        return whole
    symbols: dict = {}
    for _t, ls in terms:
        for l in ls:
            symbols.setdefault(l, opt_einsum.get_symbol(len(symbols)))
    for l in out:
        symbols.setdefault(l, opt_einsum.get_symbol(len(symbols)))
    expr = ",".join("".join(symbols[l] for l in ls) for _t, ls in terms) + "->" + "".join(symbols[l] for l in out)
    shapes = tuple(tuple(t.shape) for t, _ls in terms)
    try:
        path = _path_of(expr, shapes)
    except TypeError:  # (a symbolic size is no cache key)
        path = _path_of.__wrapped__(expr, shapes)
    for step, pair in enumerate(path):
        if len(pair) == 1:  # (opt_einsum's DP path may reduce an operand alone: its sums come with its pair)
            terms = [terms[k] for k in range(len(terms)) if k != pair[0]] + [terms[pair[0]]]
            continue
        i, j = pair
        (x, xs), (y, ys) = terms[i], terms[j]
        rest = [terms[k] for k in range(len(terms)) if k not in (i, j)]
        needed = set(out).union(*[set(ls) for _t, ls in rest])
        last = step == len(path) - 1
        terms = rest + [_pair(x, xs, y, ys, needed, out if last else None, samples, lowering)]
    (t, ls), = terms
    t, ls = _reduce_private(t, ls, set(out))
    return _arrange(t, ls, out)


def _diagonal(t: torch.Tensor, labels: list) -> tuple[torch.Tensor, list]:
    """Collapse repeated labels of one operand onto a single axis (its diagonal)."""
    while len(set(labels)) < len(labels):
        for i, l in enumerate(labels):
            j = labels.index(l)
            if j != i:
                break
        if t.shape[i] == 1:
            t, labels = _squeeze_axes(t, [i]), labels[:i] + labels[i + 1:]
        elif t.shape[j] == 1:
            t, labels = _squeeze_axes(t, [j]), labels[:j] + labels[j + 1:]
        else:
            t = torch.diagonal(t, 0, j, i)
            labels = [m for k, m in enumerate(labels) if k not in (i, j)] + [l]
    return t, labels


def contract_blocks(operands: Sequence[tuple[Block, Sequence[Label]]], out: Sequence[Label],
                    sizes: dict | None = None, target: Target = EAGER_TARGET,
                    samples: frozenset = frozenset()) -> Block:
    """:func:`hoad.algebra.contract` on evaluated blocks: the einsum of their compact data."""
    size: dict = dict(sizes or {})
    parent: dict = {}

    def find(l):
        while parent[l] != l:
            parent[l] = parent[parent[l]]
            l = parent[l]
        return l

    for blk, labels in operands:
        internal_check(len(labels) == blk.ndim, f"contract: {len(labels)} labels for a block of {blk.ndim} axes")
        owner: dict = {}
        for lab, c, n in zip(labels, blk.dims, blk.shape):
            internal_check(size.setdefault(lab, n) == n, f"contract: label {lab!r} has sizes {size[lab]} and {n}")
            if c is None:
                continue
            parent.setdefault(lab, lab)
            if c in owner:
                a, b = find(owner[c]), find(lab)
                if a != b:
                    parent[b] = a
            else:
                owner[c] = lab
    for lab in out:
        internal_check(lab in size, f"contract: output label {lab!r} has no size")
        if size[lab] != 1:
            parent.setdefault(lab, lab)

    out_roots = [find(l) if size[l] != 1 else None for l in out]
    result_classes = _first_appearance(out_roots)
    terms: list[tuple[torch.Tensor, list]] = []
    unit_data = None
    for blk, labels in operands:
        roots: list = [None] * blk.data.ndim
        for lab, c in zip(labels, blk.dims):
            if c is not None:
                roots[c] = find(lab)
        if blk.unit:
            unit_data = blk.data
            continue
        terms.append(_diagonal(blk.data, roots))

    factor = 1
    for r in {find(l) for l in parent} - set(result_classes):
        if all(t.shape[ls.index(r)] == 1 for t, ls in terms if r in ls):
            factor *= size[r]

    if terms:
        # operands of different floating dtypes (a float32 input's blocks times a float64
        # constant's) meet as torch's elementwise product would: promoted (mm refuses a mix)
        dtype = functools.reduce(torch.promote_types, [t.dtype for t, _ls in terms])
        terms = [(t if t.dtype == dtype else t.to(dtype), ls) for t, ls in terms]
        present = [r for r in result_classes if any(r in ls for _t, ls in terms)]
        roots = {find(l) for l in samples if l in parent} if target.sample_axes else frozenset()
        data = _einsum(terms, present, size, roots, target.lowering)
        if len(present) < len(result_classes):
            data = data.reshape([data.shape[present.index(r)] if r in present else 1 for r in result_classes])
        unit = False
    else:
        internal_check(unit_data is not None, "contract: no operands")
        data = unit_data.new_ones((1,) * len(result_classes))
        unit = factor == 1
    if factor != 1:
        data = data * factor
    index = {r: i for i, r in enumerate(result_classes)}
    return Block(data, [None if r is None else index[r] for r in out_roots], [size[l] for l in out], unit)


def meet(partitions: Sequence[Sequence]) -> list:
    """The coarsest class structure finer than every given one (axes tied in all of them)."""
    index: dict = {}
    return [None if None in key else index.setdefault(key, len(index)) for key in zip(*partitions)]


def add_blocks(blocks: Sequence[Block]) -> Block:
    """Sum of evaluated blocks with the same dense shape (their class structures may differ)."""
    blocks = list(blocks)
    if len(blocks) == 1:
        return blocks[0]
    shape = blocks[0].shape
    internal_check(all(b.shape == shape for b in blocks), "add: blocks have different shapes")
    partition = meet([b.dims for b in blocks])
    refined = [b.refine(partition) for b in blocks]
    total = refined[0].data
    for b in refined[1:]:
        total = total + b.data
    return Block(total, refined[0].dims, shape)
