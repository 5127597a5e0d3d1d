"""The three combinators that carry the maths of every rule.

- :func:`chain` (Faà di Bruno) for elementwise nonlinear ops, given the scalar derivatives;
- :func:`leibniz` for multilinear ops, given each factor's einsum labels;
- :func:`linear` for ops linear in one argument, given the op on a single block.

Each produces only the multi-indices in ``ctx.keys`` and reads only the arguments' blocks, so the
same rule serves forward propagation and, with the top-order blocks of the arguments left out,
the remainder terms of the adjoint form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from hoad.algebra import Block, Lazy, add, contract, expand_out, reshape_out, sum_out
from hoad.algebra.multiindex import distribution_terms, partition_terms
from hoad.rules.base import Contracted, Ctx, Jet, VjpCtx, adjoint_labels, out_labels

Coefficient = torch.Tensor | float | int | None


@dataclass(frozen=True)
class Scaled:
    """Scalar derivatives φ^(m)(u) = ``coeffs[m-1]`` · ``scale``^m, for φ whose derivatives are
    powers (x^p, 1/x, √x, log x: scale = 1/u). φ^(m) itself overflows (or underflows) where the
    value does not: √(x² + ε) in float32 has φ^(4) ∝ u^-3.5 = 1e42 at ε = 1e-12, and a float16
    1/(1+x²) at x = 5 needs y^5 = 8e-8. :func:`chain` multiplies each first-order factor of a
    term by ``scale`` instead, so no power above half the order is formed (in float64, whose range
    holds such powers, it forms φ^(m), with fewer ops)."""

    coeffs: list
    scale: torch.Tensor

    def plain(self, m: int) -> Coefficient:
        """φ^(m) itself."""
        c = self.coeffs[m - 1]
        return None if c is None else c * self.scale ** m


def chain(ctx: Ctx, u: Jet, coeffs: Sequence[Coefficient] | Scaled, axis: int | None = None,
          keepdim: bool = False) -> dict:
    """Blocks of φ(u) for elementwise φ, from ``coeffs[m-1] = φ^(m)(u)`` (None: a structural zero).

    Faà di Bruno with terms grouped by the multiset partition of the slots: each distinct product
    φ^(m)(u) ⊙ Π D^{K_B}u is contracted once and its slot permutations are added. With
    :class:`Scaled` coefficients, the first-order factors carry the scale (their products then
    stay in range).

    With ``axis``, φ maps each line of u along that axis to one number (a reduction, the axis
    kept with size 1 where ``keepdim``): ``coeffs[m-1]`` is a tensor with the output's axes then
    m axes of the line's length, and each factor's line axis gets the label of one of them.
    """
    o = out_labels(u.ndim if axis is None else ctx.out.ndim)
    lead, r = _lead(ctx, o)
    scale, firsts, powers = None, {}, {}  # (u's first-order blocks times the scale; φ^(m) · scale^rest)
    if isinstance(coeffs, Scaled) and coeffs.scale.dtype == torch.float64:
        # (float64's range holds the powers of the scale a program meets: fewer ops unscaled)
        coeffs = [coeffs.plain(m) for m in range(1, len(coeffs.coeffs) + 1)]
    elif isinstance(coeffs, Scaled):
        scale = off_flat(u, [coeffs.scale])[0]
        coeffs = coeffs.coeffs
    if axis is None:
        coeffs = off_flat(u, coeffs)
    result = {}
    for K in ctx.keys:
        terms = []
        for term in partition_terms(K):
            m = len(term.parts)
            coeff = coeffs[m - 1]
            if coeff is None:
                continue
            subs = term.sub_indices(K)
            factors = [u.blocks.get(sub) for sub in subs]
            if any(f is None for f in factors):
                continue
            if scale is not None:  # the first-order factors scaled, the rest of the power on φ^(m)
                for j, sub in enumerate(subs):
                    if len(sub) == 1:
                        if sub not in firsts:
                            firsts[sub] = scale_out(factors[j], scale, u.shape)
                        factors[j] = firsts[sub]
                rest = sum(len(sub) > 1 for sub in subs)
                if rest and (m, rest) not in powers:
                    powers[m, rest] = coeff * scale ** rest
                coeff = powers[m, rest] if rest else coeff
            lines = [("l", j) for j in range(m)]
            labels = [o] * m if axis is None else [o[:axis] + [line] + o[axis + keepdim:] for line in lines]
            operands = [(f, ul + ctx.slots(K, part)) for f, ul, part in zip(factors, labels, term.parts)]
            scalar = 1.0
            if axis is not None:
                operands.insert(0, (Block.dense(coeff), o + lines))
            elif isinstance(coeff, torch.Tensor):
                operands.insert(0, (_on_output(coeff, u.shape), o))
            else:
                scalar = coeff
            out = lead + ctx.slots(K)
            prod = contract(ctx.weigh(_with_adjoint(ctx, operands, o), out), out, lazy=_lazy(ctx, K), target=ctx.target,
                            samples=ctx.samples(K)).scale(scalar)
            terms += [ctx.permute_slots(prod, r, K, sigma) for sigma in term.copies]
        if terms:
            result[K] = _finish(ctx, add(terms))
    return result


def off_flat(u: Jet, coeffs: Sequence[Coefficient]) -> list:
    """``coeffs`` set to 0 on u's flat entries, where every term's factor of u's blocks is 0: an
    infinite φ^(m) there (sqrt after relu) must give 0, not inf · 0 = NaN (see hoad.rules.flat)."""
    if u.flat is None:
        return list(coeffs)
    return [torch.where(u.flat, 0.0, c) if isinstance(c, torch.Tensor) else c for c in coeffs]


def _lazy(ctx: Ctx, K) -> bool:
    """Jets of order >= 2 stay unevaluated (see :class:`hoad.algebra.Lazy`; the target may turn
    that off); contractions with an adjoint are evaluated, absorbing whatever lazy factors they have."""
    return ctx.adjoint is None and len(K) >= 2


def _lead(ctx: Ctx, o: list) -> tuple[list, int]:
    """Labels of the axes before the slots: the node's own, or the program output's under an adjoint."""
    if ctx.adjoint is None:
        return o, len(o)
    rf = ctx.adjoint.ndim - len(o)
    return adjoint_labels(rf), rf


def _with_adjoint(ctx: Ctx, operands: list, o: list) -> list:
    if ctx.adjoint is None:
        return operands
    rf = ctx.adjoint.ndim - len(o)
    return [(ctx.adjoint, list(o) + adjoint_labels(rf))] + operands


def _finish(ctx: Ctx, blk: Block):
    return blk if ctx.adjoint is None else Contracted(blk)


def leibniz(ctx: Ctx, factors: Sequence[tuple[Jet, Sequence]], out: Sequence, out_shape: Sequence[int]) -> dict:
    """Blocks of a multilinear op: the einsum of ``factors`` (each a jet with the labels of its
    axes) into ``out``. Each slot distribution among the factors is one Leibniz term."""
    out = list(out)
    lead, r = _lead(ctx, out)
    result = {}
    for K in ctx.keys:
        terms = []
        for term in distribution_terms(K, len(factors)):
            blocks = [jet[sub] for (jet, _labels), sub in zip(factors, term.sub_indices(K))]
            if any(b is None for b in blocks):
                continue
            operands = [(b, list(labels) + ctx.slots(K, part))
                        for b, (_jet, labels), part in zip(blocks, factors, term.parts)]
            result_labels = lead + ctx.slots(K)
            prod = contract(ctx.weigh(_with_adjoint(ctx, operands, out), result_labels), result_labels,
                            sizes=dict(zip(out, out_shape)), lazy=_lazy(ctx, K), target=ctx.target,
                            samples=ctx.samples(K))
            terms += [ctx.permute_slots(prod, r, K, sigma) for sigma in term.copies]
        if terms:
            result[K] = _finish(ctx, add(terms))
    return result


def product_rule(ctx: Ctx, factors: Sequence[Jet], product: Callable[[list], Block]) -> dict:
    """Blocks of an op multilinear in ``factors`` that is no einsum (a convolution): Leibniz with
    the op itself as the product. ``product(blocks)`` gets one entry per factor, a :class:`Block`
    (that factor's derivative) or None (its value), and returns a block with the op's output axes
    followed by each given block's slots, in factor order. Ties between slots of different
    factors (diagonal mode), collapsed labels and the adjoint are then applied by one contraction."""
    o = out_labels(ctx.out.ndim)
    lead, r = _lead(ctx, o)
    result = {}
    for K in ctx.keys:
        terms = []
        for term in distribution_terms(K, len(factors)):
            subs = term.sub_indices(K)
            blocks = [jet.blocks.get(sub) if sub else None for jet, sub in zip(factors, subs)]
            if any(sub and b is None for sub, b in zip(subs, blocks)):
                continue
            labels = o + [label for part in term.parts for label in ctx.slots(K, part)]
            out = lead + ctx.slots(K)
            prod = contract(ctx.weigh(_with_adjoint(ctx, [(product(blocks), labels)], o), out), out, target=ctx.target,
                            samples=ctx.samples(K))
            terms += [ctx.permute_slots(prod, r, K, sigma) for sigma in term.copies]
        if terms:
            result[K] = _finish(ctx, add(terms))
    return result


def linear(ctx: Ctx, x: Jet, fn: Callable[[Block], Block]) -> dict:
    """Blocks of an op linear in ``x``: the op applied to each block, slots carried along."""
    return {K: fn(x.blocks[K]) for K in ctx.keys if K in x.blocks}


def broadcast(x: Jet, shape: Sequence[int]) -> Jet:
    """``x`` broadcast to ``shape`` (blocks keep broadcast axes compact)."""
    shape = tuple(shape)
    if x.shape == shape:
        return x
    r = x.ndim
    primal = x.primal.expand(shape)
    return Jet(primal, {K: expand_out(b, r, shape) for K, b in x.blocks.items()})


def _on_output(coeff: torch.Tensor, shape: Sequence[int]) -> Block:
    """A coefficient over the output axes as a block, compact along broadcast axes."""
    if tuple(coeff.shape) == tuple(shape):
        return Block.dense(coeff)
    return expand_out(Block.dense(coeff), coeff.ndim, shape)


def sum_blocks(*parts: dict) -> dict:
    """Blockwise sum of several rule results (structural zeros skipped)."""
    result: dict = {}
    for part in parts:
        for K, b in part.items():
            result.setdefault(K, []).append(b)
    return {K: add(bs) for K, bs in result.items()}


def scaled(ctx: Ctx, x: Jet, coeff: torch.Tensor | float, out_shape: Sequence[int]) -> dict:
    """Blocks of ``coeff * x`` with ``coeff`` constant (broadcasting both to ``out_shape``)."""
    xb = broadcast(x, out_shape)
    if not isinstance(coeff, torch.Tensor):
        return {K: b.scale(coeff) for K, b in xb.blocks.items() if K in ctx.keys}
    c = _on_output(coeff, out_shape)
    o = out_labels(len(out_shape))
    return {K: contract([(c, o), (b, o + ctx.slots(K))], o + ctx.slots(K), lazy=isinstance(b, Lazy), target=ctx.target)
            for K, b in xb.blocks.items() if K in ctx.keys}


# ------------------------------------------------------------------------- adjoint helpers
def scale_out(g: Block, coeff: torch.Tensor | float, shape: Sequence[int]) -> Block:
    """A cotangent (output axes of ``shape`` first) times a coefficient over the output axes."""
    if not isinstance(coeff, torch.Tensor):
        return g.scale(coeff)
    o = out_labels(len(shape))
    rest = [("f", i) for i in range(g.ndim - len(shape))]
    return contract([(_on_output(coeff, shape), o), (g, o + rest)], o + rest)


def unbroadcast(g: Block, r: int, shape: Sequence[int]) -> Block:
    """Sum a cotangent over the axes broadcasting added, back to the input's ``shape``."""
    shape = tuple(shape)
    lead = r - len(shape)
    if lead:
        g = sum_out(g, r, range(lead))
        r -= lead
    grown = [a for a in range(r) if shape[a] == 1 and g.shape[a] != 1]
    if grown:
        g = sum_out(g, r, grown, keepdim=True)
    return g


# ---------------------------------------------------------------------------- 0-d inputs
# An op taking a dim treats a 0-d tensor as a vector of one entry (dim 0 or -1 is its only
# axis): the rule runs on that vector and its blocks are viewed back as 0-d.
def _as_vector(x):
    if isinstance(x, Jet) and x.ndim == 0:
        return Jet(x.primal.reshape(1), {K: reshape_out(b, 0, [1]) for K, b in x.blocks.items()}, x.varies)
    return x


def _vector_out(out, lift: bool):
    if not lift:
        return out
    if isinstance(out, torch.Tensor):
        return out.reshape(1) if out.ndim == 0 else out
    return type(out)(_vector_out(o, lift) for o in out)


def _keeps_axis(args: tuple, kwargs: dict, reduces: bool) -> bool:
    """Whether the op's output keeps the dim it acts along (so the lifted output has one axis)."""
    if not reduces:
        return True
    return bool(kwargs.get("keepdim", args[1] if len(args) > 1 else False))


def on_0d(rule: Callable | None = None, *, reduces: bool = False) -> Callable:
    """A rule of an op with a dim argument, made to accept a 0-d first argument: the op acts on
    a 0-d tensor as on a vector of one entry. ``reduces``: the op drops the dim unless
    ``keepdim`` (its argument after ``dim``) is set."""
    if rule is None:
        return functools.partial(on_0d, reduces=reduces)

    @functools.wraps(rule)
    def wrapped(ctx: Ctx, x, *args, **kwargs):
        if not isinstance(x, Jet) or x.ndim != 0:
            return rule(ctx, x, *args, **kwargs)
        out1 = _vector_out(ctx.out, _keeps_axis(args, kwargs, reduces))
        adjoint = ctx.adjoint
        if adjoint is not None and isinstance(ctx.out, torch.Tensor):
            adjoint = reshape_out(adjoint, ctx.out.ndim, list(out1.shape))
        lifted = replace(ctx, out=out1, adjoint=adjoint)
        result = rule(lifted, _as_vector(x), *(_as_vector(a) for a in args), **kwargs)
        return _restore(result, out1, ctx.out)

    return wrapped


def _restore(result, lifted, out):
    if isinstance(out, torch.Tensor):
        r = lifted.ndim
        return {K: b if isinstance(b, Contracted) else reshape_out(b, r, list(out.shape)) for K, b in result.items()}
    return [_restore(b, l, o) if isinstance(o, torch.Tensor) else b for b, l, o in zip(result, lifted, out)]


def on_0d_vjp(vjp: Callable | None = None, *, reduces: bool = False) -> Callable:
    """The VJP of an op with a dim argument, made to accept a 0-d first argument (see :func:`on_0d`)."""
    if vjp is None:
        return functools.partial(on_0d_vjp, reduces=reduces)

    @functools.wraps(vjp)
    def wrapped(v: VjpCtx, g, x, *args, **kwargs):
        if not isinstance(x, Jet) or x.ndim != 0:
            return vjp(v, g, x, *args, **kwargs)
        x1 = _as_vector(x)
        out1 = _vector_out(v.out, _keeps_axis(args, kwargs, reduces))
        if isinstance(v.out, torch.Tensor):
            g1 = reshape_out(g, v.out.ndim, list(out1.shape))
        else:
            g1 = [None if gi is None else reshape_out(gi, o.ndim, list(o1.shape)) for gi, o, o1 in zip(g, v.out, out1)]
        pairs = vjp(replace(v, out=out1), g1, x1, *(_as_vector(a) for a in args), **kwargs)
        return [(x, reshape_out(c, 1, [])) if jet is x1 else (jet, c) for jet, c in pairs]

    return wrapped
