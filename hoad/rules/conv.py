"""Convolution: bilinear in (input, weight), plus a linear bias.

Each Leibniz term runs the op itself on derivative blocks (:func:`product_rule`): an input block's
slot axes fold into the batch axis, a weight block's into the output channels, so one
``aten.convolution`` computes a whole term, and the batch and output-channel axes keep their ties
(a per-sample block stays per sample; ∂y/∂w stays diagonal along the output channel). The VJP is
``aten.convolution_backward`` with the program output's axes folded the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hoad.algebra import Block, expand_out, force, reshape_out, sum_out
from hoad.algebra.block import _canonical
from hoad.rules.base import Ctx, Jet, RuleTable
from hoad.rules.combinators import product_rule, sum_blocks

aten = torch.ops.aten
OPS = RuleTable("multilinear")


def lay_out(blk, r: int, keep: Sequence[int] = ()) -> tuple[torch.Tensor, list]:
    """A block's data with its ``r`` output axes first, at full size, then one axis per other class.

    Output axes in ``keep`` keep their ties to slots; every other output axis is written out.
    Returns the data and, per slot axis, where its index lives: ``("o", a)`` (output axis a),
    ``("s", i)`` (the i-th trailing axis) or None (a size-1 axis).
    """
    blk = force(blk)
    keep = [a for a in keep if blk.dims[a] is not None
            and not any(blk.dims[b] == blk.dims[a] for b in range(r) if b != a)]
    blk = blk.untie([a for a in range(r) if a not in keep])
    sizes = list(blk.data.shape)
    for a in range(r):
        if blk.dims[a] is not None:
            sizes[blk.dims[a]] = blk.shape[a]
    data = blk.data.expand(sizes) if sizes != list(blk.data.shape) else blk.data
    out_classes = [blk.dims[a] for a in range(r)]
    rest = [c for c in range(data.ndim) if c not in out_classes]
    perm = [c for c in out_classes if c is not None] + rest
    data = data.permute(perm) if perm != list(range(len(perm))) else data
    data = data.reshape(list(blk.shape[:r]) + [sizes[c] for c in rest])
    where = {c: ("o", a) for a, c in enumerate(out_classes) if c is not None}
    where.update({c: ("s", i) for i, c in enumerate(rest)})
    return data, [None if d is None else where[d] for d in blk.dims[r:]]


def _params(stride, padding, dilation, transposed, output_padding, groups) -> tuple:
    return (list(stride), list(padding), list(dilation), bool(transposed), list(output_padding), int(groups))


def _conv(x: torch.Tensor, w: torch.Tensor, params: tuple) -> torch.Tensor:
    return aten.convolution.default(x, w, None, *params)


def _conv_term(x: torch.Tensor, rx: list, w: torch.Tensor, rw: list, params: tuple) -> torch.Tensor:
    """The convolution of ``x`` (N, C, *sp, *rx) with ``w`` (weight axes, *rw), as data
    (N, O, *sp', *rx, *rw): ``rx`` folds into the batch, ``rw`` into the output channels."""
    kx, kw = len(rx), len(rw)
    nx, nw = math.prod(rx), math.prod(rw)
    n = x.shape[0]
    xr, wr = x.ndim - kx, w.ndim - kw
    xf = x.movedim(list(range(xr, x.ndim)), list(range(kx))).reshape([nx * n] + list(x.shape[1:xr]))
    # rw goes right after the weight's output-channel axis (0; 1 when transposed), so output
    # channel o of the folded op is (o, rw) in order, groups included
    at = 2 if params[3] else 1
    wf = w.movedim(list(range(wr, w.ndim)), list(range(at, at + kw)))
    wf = wf.reshape(list(w.shape[:at - 1]) + [w.shape[at - 1] * nw] + list(w.shape[at:wr]))
    y = _conv(xf, wf, params)                                   # (nx*N, O*nw, *sp')
    y = y.reshape(list(rx) + [n, y.shape[1] // nw] + list(rw) + list(y.shape[2:]))
    # (*rx, N, O, *rw, *sp') -> (N, O, *sp', *rx, *rw)
    order = [kx, kx + 1] + list(range(kx + 2 + kw, y.ndim)) + list(range(kx)) + list(range(kx + 2, kx + 2 + kw))
    return y.permute(order)


def _relabel(data: torch.Tensor, shape: Sequence[int], groups: Sequence[tuple]) -> Block:
    """A block over ``data``: leading axes ``shape``, then each group's trailing axes. A group is
    (slot references from :func:`lay_out`, {its kept output axis: the axis of ``shape`` it became},
    its dense slot shape, its number of trailing axes)."""
    r = len(shape)
    dims, slots, offset = list(range(r)), [], r
    for refs, kept, slot_shape, n_rest in groups:
        for ref in refs:
            if ref is None:
                dims.append(None)
            else:
                dims.append(kept[ref[1]] if ref[0] == "o" else offset + ref[1])
        offset += n_rest
        slots += list(slot_shape)
    return _canonical(data, dims, list(shape) + slots)


def _weight_keep(params: tuple) -> tuple[int, ...]:
    """Weight axes along which the op acts independently (the output channel): kept tied."""
    transposed, groups = params[3], params[5]
    if not transposed:
        return (0,)
    return (1,) if groups == 1 else ()


def _product(params: tuple, x: Jet, w: Jet, out_shape: tuple):
    """The op on one block per factor (None: the factor's value), for :func:`product_rule`."""
    keep_w = _weight_keep(params)

    def product(blocks: list) -> Block:
        bx, bw = blocks
        xd, refs_x = (x.primal, []) if bx is None else lay_out(bx, x.ndim, keep=(0,))
        wd, refs_w = (w.primal, []) if bw is None else lay_out(bw, w.ndim, keep=keep_w)
        rx, rw = list(xd.shape[x.ndim:]), list(wd.shape[w.ndim:])
        data = _conv_term(xd, rx, wd, rw, params)
        groups = []
        if bx is not None:
            groups.append((refs_x, {0: 0}, bx.shape[x.ndim:], len(rx)))
        if bw is not None:
            groups.append((refs_w, {a: 1 for a in keep_w}, bw.shape[w.ndim:], len(rw)))
        return _relabel(data, out_shape, groups)

    return product


def _bias_blocks(ctx: Ctx, bias: Jet) -> dict:
    """The bias is added along the channel axis: blocks (O, slots) viewed as (1, O, 1, …) and broadcast."""
    shape = tuple(ctx.out.shape)
    view = [1, shape[1]] + [1] * (len(shape) - 2)
    return {K: expand_out(reshape_out(b, 1, view), len(view), shape) for K, b in bias.blocks.items() if K in ctx.keys}


def _jet(t) -> Jet:
    return t if isinstance(t, Jet) else Jet(t)


def _folded(t: torch.Tensor, r: int, rest: list, at: int) -> torch.Tensor:
    """``t`` (r axes, then ``rest``) with the ``rest`` axes merged into axis ``at`` (in front of it)."""
    k = len(rest)
    t = t.movedim(list(range(r, t.ndim)), list(range(at, at + k)))
    return t.reshape(list(t.shape[:at]) + [-1] + list(t.shape[at + k + 1:]))


def convolution_rule(ctx: Ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """Leibniz over (input, weight), each term one convolution of folded blocks; plus the bias."""
    params = _params(stride, padding, dilation, transposed, output_padding, groups)
    x, w = _jet(x), _jet(w)
    parts = [product_rule(ctx, [x, w], _product(params, x, w, tuple(ctx.out.shape)))]
    if isinstance(bias, Jet) and bias.blocks and ctx.adjoint is None:
        parts.append(_bias_blocks(ctx, bias))
    return sum_blocks(*parts)


def convolution_vjp(v, g: Block, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """convolution_backward on the cotangent with the program output's axes folded: into the
    batch for the input's cotangent, into the output channels for the weight's."""
    params = _params(stride, padding, dilation, transposed, output_padding, groups)
    r = v.out.ndim
    f_shape = g.shape[r:]
    xv, wv = (a.primal if isinstance(a, Jet) else a for a in (x, w))
    pairs = []
    if isinstance(x, Jet) and x.varies:
        t, refs = lay_out(g, r, keep=(0,))
        rest = list(t.shape[r:])
        gx = _folded(t, r, rest, 0)                               # (F*N, O, *sp')
        shape = [gx.shape[0]] + list(xv.shape[1:])
        gi = aten.convolution_backward.default(gx, xv.new_zeros(()).expand(shape), wv, None, *params,
                                               [True, False, False])[0]
        gi = gi.reshape(rest + list(xv.shape)).movedim(list(range(len(rest))),
                                                       list(range(xv.ndim, xv.ndim + len(rest))))
        pairs.append((x, _relabel(gi, xv.shape, [(refs, {0: 0}, f_shape, len(rest))])))
    if isinstance(w, Jet) and w.varies:
        keep_w = _weight_keep(params)
        t, refs = lay_out(g, r, keep=(1,) if keep_w else ())
        rest = list(t.shape[r:])
        nf = math.prod(rest)
        # F goes after each output channel: (N, O*F, *sp'), a weight of nf times the channels
        gw = t.movedim(list(range(r, t.ndim)), list(range(2, 2 + len(rest))))
        gw = gw.reshape([t.shape[0], -1] + list(t.shape[2:r]))
        at = 1 if params[3] else 0
        wshape = list(wv.shape)
        wshape[at] *= nf
        gk = aten.convolution_backward.default(gw, xv, wv.new_zeros(()).expand(wshape), None, *params,
                                               [False, True, False])[1]
        gk = gk.reshape(list(wv.shape[:at + 1]) + rest + list(wv.shape[at + 1:]))
        gk = gk.movedim(list(range(at + 1, at + 1 + len(rest))), list(range(wv.ndim, wv.ndim + len(rest))))
        pairs.append((w, _relabel(gk, wv.shape, [(refs, {1: keep_w[0]} if keep_w else {}, f_shape, len(rest))])))
    if isinstance(bias, Jet) and bias.varies:
        pairs.append((bias, sum_out(g, r, [a for a in range(r) if a != 1])))
    return pairs


OPS.register(aten.convolution.default, rule=convolution_rule, vjp=convolution_vjp)

