"""hoad: a higher-order automatic differentiation compiler for PyTorch.

``hoad.compile(f, order=N, wrt=...)`` traces ``f`` to ATen, builds one program computing the
value and every derivative block of orders 1..N between the wrt inputs (canonical blocks only,
by Schwarz symmetry), and runs it.
"""

from hoad.api import compile
from hoad.compiled import Compiled
from hoad.derivatives import Derivatives
from hoad.errors import (
    BatchCouplingError,
    CaptureError,
    CompileError,
    DataDependentControlFlowError,
    DistributedError,
    ExecutionError,
    HoadError,
    HoadInternalError,
    InvalidArgumentError,
    MemoryBudgetError,
    OutputError,
    RandomnessError,
    UnsupportedOperatorError,
)
from hoad.extend import register_elementwise, register_linear, register_rule, unregister_rule
from hoad.jets import taylor
from hoad.lowering.inductor import cache_dir
from hoad.operators import OperatorResult, biharmonic, laplacian
from hoad.options import parameters


def explain(compiled: Compiled, *args, **kwargs):
    """``compiled.explain(*args, **kwargs)``: a table of blocks, costs and the chosen direction."""
    if not callable(getattr(compiled, "explain", None)):
        raise InvalidArgumentError(
            f"hoad.explain takes what hoad.compile or an operator (hoad.laplacian, ...) returned, got "
            f"{type(compiled).__name__}: hoad.explain(hoad.compile(f, order=2), *args)")
    return compiled.explain(*args, **kwargs)


__version__ = "0.1.0"

__all__ = [
    "compile",
    "laplacian",
    "biharmonic",
    "taylor",
    "OperatorResult",
    "explain",
    "parameters",
    "register_elementwise",
    "register_linear",
    "register_rule",
    "unregister_rule",
    "Compiled",
    "Derivatives",
    "HoadError",
    "InvalidArgumentError",
    "CaptureError",
    "DataDependentControlFlowError",
    "RandomnessError",
    "UnsupportedOperatorError",
    "OutputError",
    "BatchCouplingError",
    "ExecutionError",
    "HoadInternalError",
    "CompileError",
    "MemoryBudgetError",
    "DistributedError",
    "cache_dir",
]
