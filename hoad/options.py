"""The options of ``hoad.compile`` and of the operators: their values, their checks, and the
constants they refer to (backends, modes, the largest order, programs kept per function)."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os

from hoad.distributed import check_split
from hoad.errors import InvalidArgumentError

BACKENDS = ("inductor", "eager")


def default_backend() -> str:
    """The backend when none is given: ``HOAD_DEFAULT_BACKEND`` (read when a function is compiled;
    the test suite sets it to eager, since Inductor compiles cost seconds), else "inductor"."""
    return os.environ.get("HOAD_DEFAULT_BACKEND", "inductor")


# Programs kept per compiled function (one per call signature); the oldest goes first.
MAX_PROGRAMS = 16
MODES = ("auto", "forward", "reverse", "forward-over-reverse")


@dataclasses.dataclass(frozen=True)
class Options:
    """The options every program of one operator shares (``hoad.compile``'s after order, wrt and
    diagonal): made once from the user's keywords, then passed whole to every program it builds."""

    batch_dim: int | None = None
    backend: str | None = None
    mode: str = "auto"
    chunk_size: int | None = None
    memory_budget: float | None = None

    def kwargs(self) -> dict:
        """The options as :class:`hoad.compiled.Compiled`'s keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def given(self) -> dict:
        """The options not at their defaults, as the user would write them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    def replace(self, **changes) -> Options:
        return dataclasses.replace(self, **changes)


DEFAULT_OPTIONS = Options()


def refuse_unknown(api: str, unknown: dict, known: list[str]) -> None:
    """A keyword ``api`` does not take, named with the closest one it does."""
    if unknown:
        name = next(iter(unknown))
        close = difflib.get_close_matches(name, known, n=1)
        raise InvalidArgumentError(f"{api} has no option {name!r}{f'; did you mean {close[0]!r}?' if close else ''} "
                                   f"(its options: {', '.join(known)})")


def wrt_entries(wrt) -> tuple:
    """``wrt`` as a tuple of entries: one entry, or a tuple or list of them."""
    return tuple(wrt) if isinstance(wrt, (tuple, list)) else (wrt,)


MAX_ORDER = 12  # order 1000 ran 10 minutes and was killed at 22.8 GB, in the differentiate stage


def plain_int(value):
    """numpy's integers (``np.int64(2)``, as ``shape`` and ``argmax`` give them) as Python ints;
    anything else as given, for the option checks to judge."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def plain_ints(order, wrt, batch_dim, chunk_size) -> tuple:
    """The integer options and wrt's argnums through :func:`plain_int`."""
    entries = tuple(plain_int(w) for w in wrt_entries(wrt))
    wrt = entries if isinstance(wrt, (tuple, list)) else entries[0]
    return plain_int(order), wrt, plain_int(batch_dim), plain_int(chunk_size)


def check_options(order, wrt, backend, mode, batch_dim=None, diagonal=False, chunk_size=None,
                   memory_budget=None, split_blocks=None) -> None:
    backend = default_backend() if backend is None else backend
    if order is None:
        raise InvalidArgumentError("hoad.compile needs order=N (the highest derivative order, N >= 1)")
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise InvalidArgumentError(f"order must be an int >= 1, got {order!r}")
    if order > MAX_ORDER:
        raise InvalidArgumentError(
            f"order={order} is above hoad's limit of {MAX_ORDER}: building the program takes time that grows with the "
            "ways to split the order's slots among the factors of the chain rule (the Bell numbers: 4.2 million at "
            "order 12, 27.6 million at 13). Order 12 of tanh takes about a minute to build on one core and each "
            "order beyond about 6x longer, so a larger order would run for hours and exhaust memory")
    entries = wrt_entries(wrt)
    if not entries:
        raise InvalidArgumentError("wrt must name at least one input")
    for w in entries:
        if w is parameters:
            continue
        if isinstance(w, bool) or not isinstance(w, (int, str)) or (isinstance(w, int) and w < 0):
            raise InvalidArgumentError(f"wrt entries must be argnums (int >= 0), argument or parameter names (str), "
                                       f"or hoad.parameters, got {w!r}")
    if len(set(entries)) != len(entries):
        raise InvalidArgumentError(f"wrt names an input twice: {wrt!r}")
    if backend not in BACKENDS:
        from_env = backend == os.environ.get("HOAD_DEFAULT_BACKEND")
        raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}"
                                   f"{' (the environment variable HOAD_DEFAULT_BACKEND)' if from_env else ''}")
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "forward-over-reverse" and (order != 2 or diagonal):
        raise InvalidArgumentError(
            "mode='forward-over-reverse' builds hoad.compile's order 2 with every block (forward mode over the "
            f"gradient program), not order={order}{', diagonal=True' if diagonal else ''} or an operator's program: "
            "use mode='auto', 'forward' or 'reverse'")
    if batch_dim is not None and (isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim != 0):
        raise InvalidArgumentError(f"batch_dim must be None or 0 (samples along the first dim), got {batch_dim!r}")
    if not isinstance(diagonal, bool):
        raise InvalidArgumentError(f"diagonal must be True or False, got {diagonal!r}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidArgumentError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if batch_dim is None:
            raise InvalidArgumentError("chunk_size splits the samples of batch_dim=0: pass batch_dim=0 too")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not memory_budget > 0):
        raise InvalidArgumentError(f"memory_budget must be a number of bytes > 0 (or None for 80% of free memory), "
                                   f"got {memory_budget!r}")
    check_split(split_blocks)


# what torch.compile(fullgraph=True) says of a hoad call inside it
GRAPH_BREAK = ("hoad: a hoad call (hoad.compile's program, or an operator's) runs a program of hoad's own, which "
               "torch.compile does not trace, so the hint below to remove torch.compiler.disable does not apply. "
               "With fullgraph=True, call hoad outside the compiled region (its results as the compiled function's "
               "inputs); without fullgraph, torch.compile breaks its graph at the hoad call and compiles around it")


class _Parameters:
    """``hoad.parameters``: in ``wrt``, every trainable parameter of the bound module."""

    def __repr__(self) -> str:
        return "hoad.parameters"


parameters = _Parameters()
