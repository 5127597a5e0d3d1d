"""What a capture's decompositions and overrides record while it traces, in one object per
capture: the decomposition table and the torch-function mode are called by ``make_fx`` with no
way to pass it, so the captures under way are a stack (a nested program is captured while the
outer function is traced) and :func:`current` is the innermost.

Before, capture shared four module-level lists and dicts with its decompositions; a nested
capture cleared the outer one's value reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class Tracing:
    """One capture's records."""

    # the storages of the traced inputs (the as_strided decompositions read them: an as_strided
    # of one reads the caller's storage)
    input_storages: set[int] = field(default_factory=set)
    # as_strided calls on (views of) the traced inputs turned into reads of the tensor's own
    # entries: the program then assumes its inputs own their storage
    strided_reads: int = 0
    # (tensor, value) of every .item() (a number) or .tolist() (a list) the trace took of a tensor
    # the function closes over: the program keeps it, so each call compares it (hoad.cache)
    value_reads: list[tuple[torch.Tensor, object]] = field(default_factory=list)


_STACK: list[Tracing] = []
# id of a detached alias of a traced tensor (``.data``, ``.detach()``) -> (a weak reference to the
# alias, the tensor it aliases): one table while any capture is under way, cleared after the outermost
DETACHED_FROM: dict[int, tuple] = {}


@contextlib.contextmanager
def tracing() -> Iterator[Tracing]:
    """A new capture's records, current while it traces."""
    state = Tracing()
    _STACK.append(state)
    try:
        yield state
    finally:
        _STACK.pop()
        if not _STACK:  # (the outermost capture: no trace's aliases are live)
            DETACHED_FROM.clear()


def current() -> Tracing | None:
    """The innermost capture under way, or None."""
    return _STACK[-1] if _STACK else None


def reads_input(x: torch.Tensor) -> bool:
    """Whether ``x`` lies in the storage of one of the innermost capture's inputs."""
    return bool(_STACK) and x.untyped_storage()._cdata in _STACK[-1].input_storages


def strided_read() -> None:
    """Record an as_strided read of an input's storage, for every capture under way (an outer
    program runs the nested one's)."""
    for state in _STACK:
        state.strided_reads += 1


def value_read(t: torch.Tensor, value) -> None:
    """Record a value the trace took out of a tensor, for every capture under way."""
    for state in _STACK:
        state.value_reads.append((t, value))
