"""What the derivative transform hands on: a :class:`Program` (the derivative graph, and what
each of its outputs holds), and the :class:`OperatorInputs` through which a differential
operator's directions and weights enter it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from hoad.algebra.multiindex import MultiIndex


@dataclass
class Program:
    """A derivative program: ``gm(*leaves) -> (value, *blocks)``, plus what each output holds."""

    gm: fx.GraphModule
    keys: list[MultiIndex]                 # canonical multi-index of each returned block
    zeros: list[MultiIndex]                # canonical multi-indices that are structural zeros
    order: int
    direction: str
    wrt_names: list[str]
    leaf_names: list[str]
    out_shape: tuple[int, ...]
    slot_shapes: list[tuple[int, ...]]
    stored: dict[MultiIndex, int] = field(default_factory=dict)   # compact entries of each block
    batch_dim: int | None = None           # blocks are per sample along this axis (slot_shapes per sample)
    shared: frozenset = frozenset()        # under batch_dim, wrt positions every sample shares (parameters)
    diagonal: bool = False                 # blocks hold pure derivatives only (one axis copy per wrt input)
    stats: dict = field(default_factory=dict)
    # the part computed from free tensors alone (hoad.passes.hoist): its outputs are gm's last inputs
    prefix: fx.GraphModule | None = None
    prefix_reads: list[int] = field(default_factory=list)   # which free tensors the prefix reads
    operator: OperatorInputs | None = None
    # split_blocks: the rank (of its group) that computes each top-order block; this program
    # returns only its own, and the others are neither computed nor zeros
    owners: dict[MultiIndex, int] = field(default_factory=dict)
    rank: int = 0


@dataclass(frozen=True)
class OperatorInputs:
    """A differential operator over the first wrt input (DESIGN §8), as program inputs.

    ``directions``: placeholder index of a tensor V (S, *x) (per sample under batch_dim): the
    first-order seed is V instead of the identity, so slots run over the S directions.
    ``collapse``: the order whose pure derivatives are summed over the directions (2: a
    Laplacian), weighted by the tensor at placeholder ``weights`` (S,) when given.
    """

    directions: int | None = None
    collapse: int | None = None
    weights: int | None = None
