"""The derivative algebra: compact blocks, their contractions and linear maps, multi-indices.

Plain torch on block data, so it runs eagerly in tests and emits ATen nodes when traced. It knows
nothing about the machine beyond the :class:`Target` it is handed.

- :mod:`~hoad.algebra.block`: the compact :class:`Block` and its relabellings;
- :mod:`~hoad.algebra.einsum`: contraction of evaluated blocks, planned pairwise;
- :mod:`~hoad.algebra.terms`: unevaluated sums of products (:class:`Lazy`), ``contract``, ``add``;
- :mod:`~hoad.algebra.maps`: linear maps of a block's output part (views, sums, broadcasts, …);
- :mod:`~hoad.algebra.multiindex`: canonical multi-indices and the chain/product rule terms;
- :mod:`~hoad.algebra.target`: what the algebra is told about the machine (:class:`Target`).
"""

from hoad.algebra.block import Block
from hoad.algebra.maps import (
    along,
    expand_out,
    map_out,
    permute_out,
    reshape_out,
    select_out,
    squeeze_out,
    sum_out,
    unsqueeze_out,
)
from hoad.algebra.target import EAGER, EAGER_TARGET, Lowering, Target
from hoad.algebra.terms import Lazy, add, contract, force

__all__ = [
    "Block", "Lazy", "contract", "add", "force", "along", "expand_out", "map_out", "permute_out", "reshape_out",
    "select_out", "squeeze_out", "sum_out", "unsqueeze_out", "Target", "Lowering", "EAGER", "EAGER_TARGET",
]
