"""A third way to an order-2 program: forward mode over the gradient program.

The two directions of :mod:`hoad.passes.differentiate` form a Hessian block as sums of products
over the program's intermediate values: Σ_v Jᵥᵀ (∂²f/∂v²) Jᵥ costs |v|·P² per value v for P
wrt entries. Where P is large and each value small (the per-sample Hessian of a transformer
block w.r.t. its 768-entry input projection: 460 intermediate entries per sample), pushing P
tangents through the gradient program costs P times that program instead, ten times less.

This pass builds that program from hoad's own rules only: the order-1 reverse program (the
gradients), joined with the value into one output ``[f, ∂f/∂w_1, …]`` along a last axis, is
differentiated forward at order 1; the rows of each order-1 block of that output are the
Hessian blocks. Its cost is estimated like the other candidates', and it is chosen only where
it is the cheapest.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hoad.algebra import Target
from hoad.errors import HoadError, InvalidArgumentError, UnsupportedOperatorError, first_line
from hoad.passes.capture import Captured
from hoad.passes.clean import clean
from hoad.passes.decompositions import decomposition_table
from hoad.passes.differentiate import differentiate
from hoad.passes.program import Program
from hoad.passes.prune import prune

log = logging.getLogger(__name__)

NAME = "forward-over-reverse"
# the candidate is built where the wrt inputs have at least this many entries (per sample): below
# it the sums of products are cheap, and the build's extra time would not pay
MIN_ENTRIES = 128


def worth_building(captured: Captured, order: int, diagonal: bool, operator, share, batch_dim, shared) -> bool:
    """Whether a forward-over-reverse candidate may win: order 2, all blocks, many wrt entries."""
    if order != 2 or diagonal or operator is not None or share is not None:
        return False
    leaves = [n.meta["val"] for n in captured.gm.graph.nodes if n.op == "placeholder"]
    sizes = [math.prod(leaves[leaf].shape[1:] if batch_dim is not None and k not in shared else leaves[leaf].shape)
             for k, leaf in enumerate(captured.wrt_leaves)]
    return sum(sizes) >= MIN_ENTRIES


def forward_over_reverse(captured: Captured, where: Callable, batch_dim: int | None, target: Target,
                         shared: frozenset, operator=None, share=None) -> Program:
    """The order-2 program as forward mode over the gradient program. Raises a HoadError where
    hoad's rules cannot differentiate the gradient program (an op whose VJP has no rule of its
    own, as convolution's), or where a structural zero leaves nothing to gain."""
    if operator is not None or share is not None:
        raise InvalidArgumentError(f"mode={NAME!r} builds every block of hoad.compile's order 2; an operator or "
                                   "split_blocks builds its own: use mode='auto', 'forward' or 'reverse'")
    nested = dataclasses.replace(target, sample_axes=batch_dim is not None)
    inner = differentiate(captured, 1, "reverse", where=where, batch_dim=batch_dim, target=nested, shared=shared)
    if inner.zeros:
        raise InvalidArgumentError(f"mode={NAME!r}: the output does not depend on every wrt input "
                                   f"({', '.join(inner.wrt_names[K[0]] for K in inner.zeros)}); use mode='auto'")
    inner.gm = clean(prune(inner.gm), captured.samples(batch_dim))
    joined = _joined_gradients(captured, inner)
    try:
        outer = differentiate(joined, 1, "forward", where=lambda node: "", batch_dim=batch_dim, target=target,
                              shared=shared)
    except UnsupportedOperatorError as e:  # (an op of hoad's own gradient program: the user can do nothing)
        raise UnsupportedOperatorError(
            f"mode={NAME!r} differentiates hoad's gradient program forward, and it holds an op with no forward "
            f"rule ({first_line(e).split(' (node')[0].removeprefix('no derivative rule for ')}): use mode='auto' "
            "or 'reverse'") from e
    if outer.zeros:
        raise InvalidArgumentError(f"mode={NAME!r}: a gradient does not depend on every wrt input; use mode='auto'")
    return _split_rows(captured, inner, outer, batch_dim, shared)


def candidate(*args, **kwargs) -> Program | None:
    """:func:`forward_over_reverse` where it can be built, else None (logged): the other two
    directions remain."""
    try:
        return forward_over_reverse(*args, **kwargs)
    except HoadError as e:
        log.debug("hoad: no %s candidate: %s", NAME, first_line(e))
        return None


def _joined_gradients(captured: Captured, inner: Program) -> Captured:
    """``captured`` with the program ``leaves -> [f, ∂f/∂w_1, …]`` (joined along a last axis)."""
    leaves = [n.meta["val"] for n in inner.gm.graph.nodes if n.op == "placeholder"]

    def joined(*xs):
        value, *grads = inner.gm(*xs)
        lead = tuple(value.shape)
        return torch.cat([value.reshape(lead + (1,))] + [g.reshape(lead + (-1,)) for g in grads], dim=-1)

    gm = make_fx(joined, decomposition_table=decomposition_table(), tracing_mode="fake",
                 _allow_non_fake_inputs=True)(*leaves)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    return dataclasses.replace(captured, gm=gm, out_shape=tuple(out.meta["val"].shape), out_tree=None)


def _split_rows(captured: Captured, inner: Program, outer: Program, batch_dim, shared) -> Program:
    """The program ``leaves -> (f, ∂f/∂w_k…, ∂²f/∂w_k∂w_j for k ≤ j…)`` read off the joined one."""
    n = len(inner.slot_shapes)
    sizes = [math.prod(s) for s in inner.slot_shapes]
    starts = [1 + sum(sizes[:k]) for k in range(n)]
    leaves = [node.meta["val"] for node in outer.gm.graph.nodes if node.op == "placeholder"]
    lead = tuple(captured.out_shape)
    keys2 = [(k, j) for k in range(n) for j in range(k, n)]
    order1 = {K[0]: i for i, K in enumerate(outer.keys)}

    def program(*xs):
        joined, *blocks = outer.gm(*xs)
        r = len(lead)
        value = joined[..., 0]
        grads = [joined[..., starts[k]:starts[k] + sizes[k]].reshape(lead + inner.slot_shapes[k]) for k in range(n)]
        hessians = []
        for k, j in keys2:
            rows = blocks[order1[j]].narrow(r, starts[k], sizes[k])
            hessians.append(rows.reshape(lead + inner.slot_shapes[k] + inner.slot_shapes[j]))
        return (value, *grads, *hessians)

    gm = make_fx(program, decomposition_table=decomposition_table(), tracing_mode="fake",
                 _allow_non_fake_inputs=True)(*leaves)
    keys = [(k,) for k in range(n)] + keys2
    stored = {K: math.prod(lead) * math.prod(sizes[k] for k in K) for K in keys}
    return Program(gm, keys, [], 2, NAME, inner.wrt_names, inner.leaf_names, captured.out_shape,
                   inner.slot_shapes, stored=stored, batch_dim=batch_dim, shared=frozenset(shared))
