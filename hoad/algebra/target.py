"""What the algebra needs to know about the machine that will run a program: one frozen value.

The maths of a block is the same on every machine; how a contraction becomes ATen ops is not
(which operand of a matrix product goes left, whether small batched products are a fused
reduction or a bmm, whether a whole einsum is one call of a custom kernel). Those choices belong
to a :class:`Lowering`, decided once per program by the pipeline and carried, inside a
:class:`Target`, through every rule's context into :func:`hoad.algebra.contract`. Nothing reads
module-level flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class Lowering:
    """How contractions become ATen ops. This base lowers for eager execution: each product is
    one ``mm``/``bmm`` in the orientation needing the fewest permutes (each permute is a copy of
    its own there). :mod:`hoad.lowering` holds the lowerings for compiled programs."""

    fused = False  # whether a fusing compiler runs the program (layout copies are then cheap)

    def orientation(self, moves: int, tall: bool, batched: bool, m: int, k: int, n: int, like: torch.Tensor) -> tuple:
        """Sort key among the layouts of one matrix product (the smallest wins): ``moves``
        permutes, ``tall`` when the left operand has more than 4x the rows of the right's columns."""
        return (moves, int(tall))

    def batched_as_reduction(self, m: int, n: int, innermost: bool) -> bool:
        """Whether a batch of [m,k]@[k,n] products is better a broadcast product summed over k."""
        return False

    def dense_batches(self, t: torch.Tensor) -> torch.Tensor:
        """An operand of a batched product, laid out as the product runs it fastest."""
        return t

    def einsum(self, terms: list, out: list, size: dict) -> torch.Tensor | None:
        """A whole contraction as one call (a custom kernel), or None to plan it pairwise."""
        return None


EAGER = Lowering()


@dataclass(frozen=True)
class Target:
    """How a program is laid out, fixed for the whole program.

    ``lowering``: the machine's choices (above). ``lazy``: jets of order >= 2 stay unevaluated
    sums of products while a single consumer can absorb them (tests turn it off to compare).
    ``dense_seeds``: every input is seeded with a dense identity, so no block has a tie (tests
    compare such programs with the compact ones). ``sample_axes``: products keep the sample
    axis of ``batch_dim`` as a batch axis instead of folding it into matrix rows, for a program
    that will itself be differentiated per sample (the inner Laplacian of a biharmonic).
    """

    lowering: Lowering = field(default=EAGER, compare=False)
    lazy: bool = True
    dense_seeds: bool = False
    sample_axes: bool = False


EAGER_TARGET = Target()
