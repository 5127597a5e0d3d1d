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

# the methods of a lowering that choose by sizes (a ``Lowering``'s, and ``product``/``jets_suit``
# of the Inductor one); ``einsum`` chooses too, and acts
CHOICES = ("orientation", "batched_as_reduction", "product", "jets_suit")


class Recorded:
    """A lowering whose choices by size are written down in the order they are made (``made``).

    Given an earlier build's ``made`` (``replay``), it makes the same choices again in the same
    order, so that a program built for another number of samples differs from the earlier one in
    its sizes alone and one program serves both (:mod:`hoad.passes.dynamic`), with the layouts
    chosen for the earlier sizes. Every choice is between correct layouts: one read back where
    the two programs part ways costs speed, never a value. A choice whose method differs from
    the one recorded at its place is made afresh.
    """

    def __init__(self, inner: Lowering, replay: tuple = ()):
        self.inner, self.replay, self.made = inner, replay, []

    def __getattr__(self, name: str):
        inner = getattr(self.inner, name)  # (AttributeError where the lowering has no such method)
        if name not in CHOICES:
            return inner
        return lambda *args: self._choose(name, lambda: inner(*args))

    def einsum(self, terms: list, out: list, size: dict) -> torch.Tensor | None:
        """The inner lowering's one call for the whole contraction, unless the record says it
        declined here (where it did not, it is asked: the call is its to write)."""
        if self._recorded("einsum") is False:
            whole = None
        else:
            whole = self.inner.einsum(terms, out, size)
        self.made.append(("einsum", whole is not None))
        return whole

    def _choose(self, name: str, choose):
        value = self._recorded(name)
        if value is None:
            value = choose()
        self.made.append((name, value))
        return value

    def _recorded(self, name: str):
        """The choice recorded at this place, or None where it was another method's (or none)."""
        i = len(self.made)
        return self.replay[i][1] if i < len(self.replay) and self.replay[i][0] == name else None


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
