"""Flat entries: where a value's derivatives are zero because a rule chose a constant there.

relu below 0, clamp outside its bounds, ``where`` picking a constant: hoad's rules give such
entries no derivative at all orders, by selection. An op after them with an infinite derivative
at the constant (``sqrt(relu(x))``, ``acos(clamp(c, -1, 1))``, ``relu(σ - r) ** 2.5``) would
multiply that infinity by the zero blocks, and ``inf · 0`` is NaN where the true derivative is 0
(the function is constant there). So, on a jet's ``flat`` mask: :func:`hoad.rules.combinators.chain`
zeroes its coefficients (every Faà di Bruno term has a factor of the argument's blocks, exactly 0
there); the differentiate pass zeroes a product's blocks (the other factor's value may be the
infinity) and, in the adjoint sweep, the cotangents of flat entries (they meet nothing that varies).

The mask is a value's flat entries as a bool tensor at the value's shape, or None where none are
known. It spreads through ops whose result stays constant where their varying arguments are:
elementwise ops of one argument, sums and products, reductions by sum or mean, views, cat and
indexing. ``x ** 4`` at 0 is not flat (its higher blocks are not zero), so ``sqrt(x ** 4)`` keeps
its honest NaN; nor is a constant a ``where`` picks on an equality (``‖x‖`` at 0), which is a
point, not a region.
"""

from __future__ import annotations

import torch

from hoad.rules.base import Jet

aten = torch.ops.aten

# op -> f(*args, **kwargs) giving the result's flat mask (or None): each op's is registered with its
# rule (hoad.rules.base.RuleTable.register) and merged in by hoad.rules; ops without a rule of their
# own are at the end of this module
FLAT: dict = {}
# products: their blocks multiply one side's blocks by the other's value, which may be infinite
# on the flat entries, so the differentiate pass zeroes their blocks there
PRODUCTS = {aten.mul.Tensor, aten.div.Tensor}
SOURCES = {aten.relu.default, aten.clamp.Tensor, aten.where.self, aten.maximum.default,
           aten.minimum.default}  # ops that can choose a constant; the rest only pass masks on


# a where on an equality picks its constant at points, not on a region: norm's where(total = 0, 0,
# √total) is not constant near 0, and 1/‖x‖ there must stay NaN, not become 0
POINTS = {aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor}


def flat_of(node, args, kwargs, out: torch.Tensor) -> torch.Tensor | None:
    """The flat mask of ``node`` (an FX call whose value is ``out``) from its arguments (jets),
    at ``out``'s shape: a view of it later must find its entries where the value has them."""
    target = node.target
    f = FLAT.get(target)
    if f is None or (target not in SOURCES and not any(_jets_with_masks(args))):
        return None
    if target is aten.where.self and getattr(node.args[0], "target", None) in POINTS:
        m = _selected([(None if _mask(x) is True else x.flat, taken) for x, taken in _branches(*args)])
    else:
        m = f(*args, **kwargs)
    return m if m is None or m.shape == out.shape else m.expand(out.shape)


def _jets_with_masks(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _jets_with_masks(a)
        elif isinstance(a, Jet) and a.flat is not None:
            yield a


def _mask(x):
    """True for a constant (a number, a jet that does not vary), the jet's mask, else None."""
    if not isinstance(x, Jet) or x.constant:
        return True
    return x.flat


def _all(*xs):
    """Flat where every argument is."""
    out = True
    for x in xs:
        m = _mask(x)
        if m is None:
            return None
        if m is not True:
            out = m if out is True else out & m
    return None if out is True else out


def _branches(cond, a, b) -> list[tuple[object, torch.Tensor]]:
    """The arguments of ``where(cond, a, b)`` with the mask of the entries each one supplies."""
    mask = cond.primal if isinstance(cond, Jet) else cond
    return [(a, mask), (b, ~mask)]


def _selected(branches) -> torch.Tensor | None:
    """Flat where the chosen branch is: the union of (taken and flat) over (mask, taken) pairs."""
    out = None
    for m, taken in branches:
        if m is None:
            continue
        part = taken if m is True else taken & m
        out = part if out is None else out | part
    return out


def _chosen(branches) -> torch.Tensor | None:
    return _selected([(_mask(x), taken) for x, taken in branches])


def _either(x, chosen: torch.Tensor) -> torch.Tensor | None:
    """Flat where ``chosen`` (a constant was picked) or where x is."""
    m = _mask(x)
    return chosen if m is None or m is True else chosen | m


def unary(x, *args, **kwargs):
    """An elementwise function of x: constant where x is."""
    return x.flat


def _extremum(greater: bool):
    """maximum/minimum: the larger (smaller) side; a tie takes from both, as the rules do."""
    def f(a, b):
        va = a.primal if isinstance(a, Jet) else a
        vb = b.primal if isinstance(b, Jet) else b
        first = va > vb if greater else va < vb
        second = va < vb if greater else va > vb
        return _selected([(_mask(a), first), (_mask(b), second), (_all(a, b), va == vb)])

    return f


def _product(a, b):
    """Flat where both factors are, or where a varying one is flat at 0: every Leibniz term then
    has a factor of 0, that factor's value or its blocks. (A constant 0 factor is not looked
    for: every product with a weight would carry a mask.)"""
    out = _all(a, b)
    for x in (a, b):
        if isinstance(x, Jet) and x.varies and x.flat is not None:
            zero = x.flat & (x.primal == 0)
            out = zero if out is None else out | zero
    return out


def _reduced(x, dim=None, keepdim=False, *args, **kwargs):
    """A sum or mean: constant where every entry it adds up is."""
    if x.flat is None:
        return None
    m = x.flat
    dims = list(range(x.ndim)) if dim is None or (isinstance(dim, (list, tuple)) and not dim) else dim
    return m.all(dim=dims, keepdim=keepdim) if x.ndim else m



def _same_view(target):
    """An op that moves entries (a view, a copy, an index): the same op on the mask (a reshape
    for a view: the mask may not be laid out as the value is)."""
    def f(x, *args, **kwargs):
        if x.flat is None:
            return None
        args, kwargs = _primals(args), _primals(kwargs)
        return target(x.flat, *args, **kwargs)

    return f


def _primals(a):
    if isinstance(a, Jet):
        return a.primal
    if isinstance(a, (list, tuple)):
        return type(a)(_primals(x) for x in a)
    if isinstance(a, dict):
        return {k: _primals(v) for k, v in a.items()}
    return a


def _cat(tensors, dim=0):
    """Each part's mask in its place; a constant part is flat, one that varies without a mask is not."""
    parts = []
    for t in tensors:
        m = _mask(t)
        value = t.primal if isinstance(t, Jet) else t
        parts.append(torch.full_like(value, m is True, dtype=torch.bool) if m is None or m is True else m)
    return torch.cat(parts, dim)


# the masks of ops without a rule of their own (every other op's is registered with its rule)
for _op in (aten.reshape.default, aten.transpose.int, aten.t.default, aten.squeeze.dim, aten.squeeze.default,
            aten.roll.default):
    FLAT[_op] = _same_view(_op)
FLAT[aten._unsafe_view.default] = _same_view(aten.reshape.default)
FLAT[aten.sum.default] = lambda x, *args, **kwargs: _reduced(x)
FLAT[aten.rsub.Scalar] = lambda *args, **kwargs: _all(*args)
