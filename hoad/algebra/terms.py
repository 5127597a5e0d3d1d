"""Unevaluated sums of products, and the public contraction and sum of blocks.

Jets of orders >= 2 produced by the combinators stay :class:`Lazy` (a sum of einsum terms) while
their node has one user: the consumer either absorbs them into a bigger contraction (a
remainder's contraction with the adjoint, where the path can reassociate W2ᵀ·φ''·W1ᵀ⊗W1ᵀ) or
forces them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Hashable, Sequence

import torch

from hoad.algebra.block import Block
from hoad.algebra.einsum import add_blocks, contract_blocks
from hoad.algebra.target import EAGER_TARGET, Target
from hoad.errors import HoadInternalError

Label = Hashable


def contract(operands: Sequence[tuple[Block | Lazy, Sequence[Label]]], out: Sequence[Label],
             sizes: dict | None = None, lazy: bool = False, target: Target = EAGER_TARGET,
             samples: frozenset = frozenset()) -> Block | Lazy:
    """Einsum over blocks: multiply the operands, sum labels absent from ``out``.

    Each operand names its dense axes with labels; equal labels across operands are the same
    index. The result's dense axes are named by ``out`` (a label may repeat: a diagonal). Ties
    inside operands are honoured, so a diagonal times a dense block stays compact. ``sizes`` gives
    the sizes of ``out`` labels that no operand has (broadcast axes). Size-1 axes take no part.

    :class:`Lazy` operands are expanded into their products, so the whole expression is
    contracted along one path (a factor W2ᵀ·D² is then never formed when only its contraction
    with an adjoint is needed). With ``lazy`` (and ``target.lazy``) the result itself stays
    unevaluated. ``target`` says how the products become ops; ``samples`` names sample labels
    (see :class:`~hoad.algebra.target.Target`).
    """
    lazy = lazy and target.lazy
    if lazy or any(isinstance(b, Lazy) for b, _ in operands):
        return _lazy_contract(operands, out, sizes or {}, lazy, target, frozenset(samples))
    return contract_blocks(operands, out, sizes, target, frozenset(samples))


def add(blocks: Sequence[Block | Lazy]) -> Block | Lazy:
    """Sum of blocks with the same dense shape (their class structures may differ); a sum with a
    :class:`Lazy` term stays lazy."""
    blocks = list(blocks)
    if len(blocks) == 1:
        return blocks[0]
    if any(isinstance(b, Lazy) for b in blocks):
        return _bounded(Lazy([t for b in blocks for t in _terms(b)], blocks[0].shape))
    return add_blocks(blocks)


# Caps on an unevaluated block: beyond them it is evaluated where it stands.
MAX_TERMS = 8
MAX_OPERANDS = 7

_FRESH = itertools.count()


class _Fresh:
    """A dense axis a relabelling adds: a new label of the given size, in no operand."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size


class LTerm:
    """One unevaluated product: ``scale · einsum(operands -> out)`` (``sizes`` for ``out`` labels
    no operand has), contracted for ``target`` when evaluated."""

    __slots__ = ("scale", "operands", "out", "sizes", "target", "samples")

    def __init__(self, scale: float, operands: list, out: list, sizes: dict, target: Target = EAGER_TARGET,
                 samples: frozenset = frozenset()):
        self.scale, self.operands, self.out, self.sizes = scale, operands, out, sizes
        self.target, self.samples = target, samples

    def evaluate(self) -> Block:
        return contract_blocks(self.operands, self.out, self.sizes, self.target, self.samples).scale(self.scale)


class Lazy:
    """A block held as a sum of unevaluated products, evaluated only when its data is needed.

    Jets of orders >= 2 produced by the combinators stay lazy while their node has one user:
    the consumer either absorbs them into a bigger contraction (a remainder's contraction with
    the adjoint, where the path finder can reassociate W2ᵀ·φ''·W1ᵀ⊗W1ᵀ) or forces them.
    """

    __slots__ = ("terms", "shape", "_value")

    def __init__(self, terms: list[LTerm], shape: Sequence[int]):
        self.terms = terms
        self.shape = tuple(shape)
        self._value: Block | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def force(self) -> Block:
        if self._value is None:
            self._value = add_blocks([t.evaluate() for t in self.terms])
        return self._value

    # what needs data forces; relabellings stay lazy
    data = property(lambda self: self.force().data)
    dims = property(lambda self: self.force().dims)
    unit = property(lambda self: False)
    numel = property(lambda self: self.force().numel)

    def materialize(self, groups: Sequence[Sequence[int]] = ()) -> torch.Tensor:
        return self.force().materialize(groups)

    def refine(self, partition):
        return self.force().refine(partition)

    def untie(self, axes):
        return self.force().untie(axes)

    @property
    def dtype(self) -> torch.dtype:
        dtypes = [force(b).data.dtype for t in self.terms for b, _ls in t.operands]
        return functools.reduce(torch.promote_types, dtypes)

    def to(self, dtype: torch.dtype):
        return self if self.dtype == dtype else self.force().to(dtype)

    def scale(self, c: float) -> Lazy:
        if c == 1:
            return self
        return Lazy([LTerm(t.scale * c, t.operands, t.out, t.sizes, t.target, t.samples) for t in self.terms],
                    self.shape)

    def neg(self) -> Lazy:
        return self.scale(-1.0)

    def permute(self, perm: Sequence[int]) -> Lazy:
        return self.relabel(list(perm))

    def relabel(self, axes: Sequence) -> Lazy:
        """New dense axes from old ones: entry ``a`` (an int) reuses old axis a, a :class:`_Fresh`
        is a new broadcast axis; old axes missing from ``axes`` are summed."""
        kept = {a for a in axes if isinstance(a, int)}
        terms = []
        for t in self.terms:
            out, sizes, scale = [], dict(t.sizes), t.scale
            for a in axes:
                if isinstance(a, _Fresh):
                    label = ("fresh", next(_FRESH))
                    sizes[label] = a.size
                    out.append(label)
                elif a is not None:
                    out.append(t.out[a])
            in_operands = {l for _b, ls in t.operands for l in ls}
            for a in range(self.ndim):  # summing a broadcast axis multiplies by its size
                label = t.out[a]
                if a not in kept and label not in out and label not in in_operands:
                    scale *= sizes.get(label, 1)
            terms.append(LTerm(scale, t.operands, out, sizes, t.target, t.samples))
        shape = [a.size if isinstance(a, _Fresh) else self.shape[a] for a in axes if a is not None]
        return Lazy(terms, shape)


def force(b: Block | Lazy) -> Block:
    return b.force() if isinstance(b, Lazy) else b


def _terms(b: Block | Lazy) -> list[LTerm]:
    if isinstance(b, Lazy):
        return b.terms
    labels = [("b", a) for a in range(b.ndim)]
    return [LTerm(1.0, [(b, labels)], labels, {})]


def _bounded(z: Lazy) -> Block | Lazy:
    """``z``, or its value once it has outgrown the caps."""
    if len(z.terms) > MAX_TERMS or any(len(t.operands) > MAX_OPERANDS for t in z.terms):
        return z.force()
    return z


def _lazy_contract(operands, out, sizes: dict, lazy: bool, target: Target, samples: frozenset) -> Block | Lazy:
    """contract() with lazy operands: distribute over their sums, splice their products in."""
    choices = []
    for b, labels in operands:
        tag = next(_FRESH)
        choices.append([_splice(t, list(labels), tag) for t in _terms(b)])
    size = dict(sizes)
    for b, labels in operands:
        size.update(zip(labels, b.shape))
    terms = []
    for combo in itertools.product(*choices):
        scale, ops, extra = 1.0, [], dict(sizes)
        for s_, o_, e_ in combo:
            scale *= s_
            ops += o_
            extra.update(e_)
        terms.append(LTerm(scale, ops, list(out), extra, target, samples))
    z = Lazy(terms, [size[l] for l in out])
    return _bounded(z) if lazy else z.force()


def _splice(t: LTerm, labels: list, tag: int) -> tuple[float, list, dict]:
    """Term ``t`` with its output axes renamed to ``labels`` and its inner labels made unique."""
    rename: dict = {}
    ties = []
    for a, (inner, outer) in enumerate(zip(t.out, labels)):
        if inner in rename and rename[inner] != outer:
            ties.append((rename[inner], outer, a))
        rename.setdefault(inner, outer)
    ops = []
    for blk, ls in t.operands:
        ops.append((blk, [rename.get(l, ("lz", tag, l)) for l in ls]))
    for first, other, a in ties:  # one inner label on two outer axes: those axes are equal
        like = force(t.operands[0][0]).data
        n = _size_of(t, a)
        ops.append((Block(like.new_ones((1,)), (0, 0), (n, n), unit=True), [first, other]))
    extra = {rename[l]: n for l, n in t.sizes.items() if l in rename}
    return t.scale, ops, extra


def _size_of(t: LTerm, a: int) -> int:
    label = t.out[a]
    if label in t.sizes:
        return t.sizes[label]
    for blk, ls in t.operands:
        if label in ls:
            return blk.shape[ls.index(label)]
    raise HoadInternalError(f"lazy term has no size for label {label!r}")

