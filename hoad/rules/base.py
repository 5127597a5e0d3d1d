"""What a rule sees: jets of its arguments and a context naming the blocks to produce.

A rule is a pure function ``rule(ctx, *args, **kwargs) -> {multi-index: Block}`` over the op's
own arguments, with every tensor argument replaced by a :class:`Jet`. It is written in plain
torch, so it runs eagerly in a test and emits ATen nodes when the derivative program is traced.
A multi-index missing from the returned dict is a structural zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hoad.algebra import EAGER_TARGET, Block, Target
from hoad.algebra.multiindex import MultiIndex, closure
from hoad.errors import HoadInternalError


class Jet:
    """A primal value with its derivative blocks (absent multi-index = structural zero)."""

    __slots__ = ("primal", "blocks", "varies", "flat")

    def __init__(self, primal: Any, blocks: dict[MultiIndex, Block] | None = None, varies: bool | None = None,
                 flat: torch.Tensor | None = None):
        self.primal = primal
        self.blocks = blocks if blocks is not None else {}
        # Whether the value depends on a wrt input: known statically, even when no blocks are
        # carried (the first-order reverse sweep propagates no forward blocks at all).
        self.varies = bool(self.blocks) if varies is None else varies
        # Entries where a rule chose a constant, so every block is 0 there (hoad.rules.flat).
        self.flat = flat

    def __getitem__(self, K: MultiIndex) -> Block | None:
        if not K:
            return Block.dense(self.primal)
        return self.blocks.get(K)

    @property
    def constant(self) -> bool:
        return not self.varies

    @property
    def ndim(self) -> int:
        return self.primal.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.primal.shape)

    def __repr__(self) -> str:
        return f"Jet({tuple(self.primal.shape)}, blocks={sorted(self.blocks)})"


@dataclass(frozen=True)
class Ctx:
    """What a rule is asked for: the multi-indices ``keys`` of the node whose value is ``out``.

    ``adjoint`` is set in the remainder phase of the adjoint form: the first-order adjoint ḡ of
    this node (dense axes: the node's axes, then the program output's axes). The combinators then
    contract each product term with ḡ as they form it and return :class:`Contracted` blocks, so
    the remainder R^K is never materialised at the node's size.
    """

    keys: tuple[MultiIndex, ...]
    slot_shapes: tuple[tuple[int, ...], ...]
    out: Any
    adjoint: Block | None = None
    # Pure derivatives only (∂²/∂x_i², not ∂²/∂x_i∂x_j): slots of the same wrt input share their
    # einsum labels, so every block is computed on its diagonal and nowhere else.
    diagonal: bool = False
    collapse: Collapse | None = None
    # how products become ops on the machine that runs the program (hoad.algebra.target)
    target: Target = EAGER_TARGET
    batched: bool = False           # slot axis 0 of every input is the sample axis (batch_dim)
    shared: frozenset = frozenset()  # ... but of these wrt positions, which every sample shares

    @property
    def max_order(self) -> int:
        return max((len(K) for K in self.keys), default=0)

    def inner(self, out: Any) -> Ctx:
        """Context for an intermediate value of a composite rule: every lower block is needed."""
        return replace(self, keys=tuple(closure(self.keys)), out=out, adjoint=None)

    def slots(self, K: MultiIndex, positions: Sequence[int] | None = None) -> list:
        """Einsum labels of the slot axes of ``K`` at ``positions`` (all slots by default).

        Under a :class:`Collapse`, a block of the top order has no axes for the collapsed labels
        (they are summed away), so neither its own labels nor a result of that order list them.
        """
        if positions is None:
            positions = range(len(K))
        collapsed = self.collapse.labels if self.collapse is not None and len(positions) == self.collapse.order else ()
        labels = []
        for p in positions:
            for a in range(len(self.slot_shapes[K[p]])):
                label = ("s", K[p], a) if self.diagonal else ("s", p, a)
                if (K[p], a) not in collapsed:
                    labels.append(label)
        return labels

    def samples(self, K: MultiIndex) -> frozenset:
        """The sample labels among ``K``'s slots, when the target keeps sample axes apart."""
        if not (self.batched and self.target.sample_axes):
            return frozenset()
        return frozenset(("s", K[p] if self.diagonal else p, 0) for p in range(len(K)) if K[p] not in self.shared)

    def slot_ranks(self, K: MultiIndex) -> list[int]:
        """Axes of each slot group of ``K``'s block (collapsed axes excluded at the top order)."""
        collapsed = self.collapse.labels if self.collapse is not None and len(K) == self.collapse.order else ()
        return [sum(1 for a in range(len(self.slot_shapes[k])) if (k, a) not in collapsed) for k in K]

    def slot_shape(self, K: MultiIndex) -> tuple[int, ...]:
        collapsed = self.collapse.labels if self.collapse is not None and len(K) == self.collapse.order else ()
        return tuple(n for k in K for a, n in enumerate(self.slot_shapes[k]) if (k, a) not in collapsed)

    def weigh(self, operands: list, out: Sequence) -> list:
        """``operands`` with the collapse's weights on every collapsed label they sum away."""
        if self.collapse is None or not self.collapse.weights:
            return operands
        present = {label for _b, labels in operands for label in labels}
        extra = [(w, [("s", k, a)]) for (k, a), w in self.collapse.weights.items()
                 if ("s", k, a) in present and ("s", k, a) not in out]
        return list(operands) + extra

    def permute_slots(self, blk: Block, r: int, K: MultiIndex, sigma: Sequence[int]) -> Block:
        """Reorder the slot groups of a block: slot ``p`` of the result is slot ``sigma[p]``."""
        if list(sigma) == list(range(len(K))):
            return blk
        ranks = self.slot_ranks(K)
        offsets, at = [], r
        for n in ranks:
            offsets.append(at)
            at += n
        perm = list(range(r))
        for p in range(len(K)):
            q = sigma[p]
            perm += range(offsets[q], offsets[q] + ranks[q])
        return blk.permute(perm)


@dataclass(frozen=True)
class Collapse:
    """A differential operator's contraction pushed into the propagation (DESIGN §8).

    The blocks of ``order`` (the top) are summed over the slot axes named in ``labels`` — pairs
    ``(wrt position, slot axis)``, in diagonal mode the direction axis shared by every slot of
    that input — each term weighted by ``weights[label]`` (a block over that axis; absent: 1).
    A Laplacian is the collapse of the order-2 pure derivatives over the direction axis: only
    Σ_i ∂²u/∂x_i² is propagated at order 2, never the D separate entries.
    """

    order: int
    labels: frozenset
    weights: dict = field(default_factory=dict, compare=False, hash=False)


def out_labels(r: int) -> list:
    return [("o", i) for i in range(r)]


def adjoint_labels(r: int) -> list:
    """Labels of the program output's axes carried by an adjoint."""
    return [("f", i) for i in range(r)]


class Contracted:
    """A remainder block already contracted with the node's adjoint: dense axes are the program
    output's axes followed by the slots, ready to add into the output's top-order block."""

    __slots__ = ("block",)

    def __init__(self, block: Block):
        self.block = block


@dataclass(frozen=True)
class NodeInfo:
    """What a node of a derivative program is, at ``node.meta["hoad"]``: the block it holds (its
    name and multi-index, when it holds one), the primal node it was made for ("output" for the
    program's results) and the rule that made it (None: the primal op itself)."""

    block: str | None = None
    key: MultiIndex | None = None
    primal: str | None = None
    rule: str | None = None

    def describe(self) -> str:
        parts = [self.block] if self.block else []
        if self.primal and self.primal != "output":
            parts.append(f"from {self.primal}" + (f" by {self.rule}" if self.rule else " (primal)"))
        return "; ".join(parts)


@dataclass(frozen=True)
class VjpCtx:
    """What a VJP rule sees besides its arguments: the node's primal output, and the target."""

    out: Any
    target: Target = EAGER_TARGET


# A VJP rule: vjp(vctx, g, *args, **kwargs) -> [(argument jet, cotangent block), ...].
# ``g`` has the node's output axes first, then the program output's axes; each returned
# cotangent has the argument's axes first, then the same program-output axes.


Rule = Callable[..., Any]


class RuleTable:
    """One op family's registrations, keyed by ATen overload: each op's rule, its VJP and its flat
    mask (:mod:`hoad.rules.flat`), declared together in one :meth:`register` call beside the rule.
    :mod:`hoad.rules` merges the families into the tables the rest of hoad reads (``RULES``,
    ``VJPS``, ``FAMILIES``, ``FLAT``). Registering an op twice is an error."""

    def __init__(self, family: str):
        self.family = family
        self.rules: dict = {}
        self.vjps: dict = {}
        self.flats: dict = {}  # op -> f(*args, **kwargs) giving the result's flat mask (or None)

    def register(self, *ops: torch._ops.OpOverload, rule: Rule, vjp: Rule, flat: Callable | None = None) -> None:
        for op in ops:
            if op in self.rules:
                raise HoadInternalError(f"two {self.family} rules for {op}")
            self.rules[op], self.vjps[op] = rule, vjp
            if flat is not None:
                self.flats[op] = flat


def merge_tables(tables: Sequence[RuleTable], part: str, merged: dict | None = None) -> dict:
    """The families' ``part`` ("rules", "vjps" or "flats") in one dict (``merged``, when given);
    an op in two families is an error."""
    merged = {} if merged is None else merged
    for table in tables:
        for op, fn in getattr(table, part).items():
            if op in merged:
                raise HoadInternalError(f"{op} has {part} in two families ({table.family} and another)")
            merged[op] = fn
    return merged
