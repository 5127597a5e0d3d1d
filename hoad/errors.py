"""Errors raised by hoad.

Every failure a user can cause surfaces as a subclass of :class:`HoadError` whose message names
the cause and the fix. Internal invariants that fail raise :class:`HoadInternalError`, which asks
for a bug report instead of leaking a bare ``AssertionError``.
"""

from __future__ import annotations


class HoadError(Exception):
    """Base class of every error hoad raises."""


class InvalidArgumentError(HoadError, ValueError):
    """A bad argument to ``hoad.compile`` or to a compiled callable (order, wrt, dtype, ...)."""


class CaptureError(HoadError):
    """The function could not be traced to an ATen graph."""


class DataDependentControlFlowError(CaptureError):
    """Python control flow depends on tensor values, so one graph cannot represent the function."""


class RandomnessError(CaptureError):
    """The function draws random numbers (e.g. dropout in training mode)."""


class UnsupportedOperatorError(HoadError):
    """An ATen operator on a differentiated path has no derivative rule."""


class OutputError(HoadError):
    """The function's output is not a single floating-point tensor."""


class BatchCouplingError(HoadError):
    """``batch_dim`` promised independent samples, but an operator mixes them."""


class MemoryBudgetError(HoadError, MemoryError):
    """A derivative program would need more memory than its budget (``memory_budget=``): refused
    when it is built, before anything is allocated."""


class DistributedError(HoadError):
    """A program under ``torch.distributed`` (DDP, DTensor inputs, a process group) is used in a
    way the distributed contract cannot serve: the message names the setting that can."""


class CompileError(HoadError):
    """Inductor could not compile a derivative program."""


class ExecutionError(HoadError, RuntimeError):
    """A compiled derivative program failed while running (e.g. an index out of range for these
    input values)."""


class HoadInternalError(HoadError, RuntimeError):
    """An invariant of hoad itself failed: please report it with the function that triggered it."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """An exception's first line, at most ``limit`` characters (a compiled kernel's error is its
    message, without the source around it)."""
    text = str(e).strip().splitlines()
    return text[0][:limit] if text else ""


def internal_check(condition: bool, message: str) -> None:
    """Raise :class:`HoadInternalError` when an internal invariant does not hold."""
    if not condition:
        raise HoadInternalError(f"{message} (this is a bug in hoad; please report it)")
