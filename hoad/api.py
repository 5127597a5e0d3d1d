"""``hoad.compile``: the public entry point."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hoad.compiled import Compiled
from hoad.errors import InvalidArgumentError, OutputError
from hoad.options import Options, check_options, plain_ints, refuse_unknown


def compile(fn: Callable | None = None, /, order: int | None = None, wrt: Any = 0, *, backend: str | None = None,
            mode: str = "auto", batch_dim: int | None = None, diagonal: bool = False,
            chunk_size: int | None = None, memory_budget: float | None = None, split_blocks: Any = None,
            packed: bool | str = "auto", **unknown) -> Compiled | Callable[[Callable], Compiled]:
    """Compile ``fn`` into a callable returning its value and all derivatives up to ``order``.

    ``wrt`` selects the inputs to differentiate: an argnum, an argument name, or a tuple (or list) of them;
    the result is indexed with the same keys (``res[0]``, ``res[0, 1]``, ``res["x", "w"]``). Every
    canonical block of orders 1..order between them is computed in one program (Schwarz symmetry:
    ``res[1, 0]`` is a permuted view of ``res[0, 1]``).

    Used as ``hoad.compile(f, order=2)`` or as a decorator ``@hoad.compile(order=2)``.
    ``backend``: "inductor" (default) compiles the generated program with Inductor (cached on disk,
    see :func:`hoad.cache_dir`); "eager" runs it as an fx GraphModule without compiling.
    ``mode``: "forward" propagates every order forward; "reverse" propagates orders < N forward and
    gets order N from one first-order adjoint sweep (the adjoint form); "forward-over-reverse" (order 2,
    every block) pushes one tangent per wrt entry through the gradient program, as torch.func's
    hessian does; "auto" builds the candidates and keeps the one with the lowest estimated cost
    (FLOPs, bytes and calls of the generated program; the third is built under Inductor for order 2
    with 128 or more wrt entries per sample).
    ``batch_dim=0`` promises that dim 0 of the output and of every wrt input indexes independent
    samples: blocks come back per sample, ``res[0, 0].shape == (B, *out[1:], *x[1:], *x[1:])``
    (``torch.func.vmap(hessian(f_single))(X)``), and an op that mixes samples raises
    :class:`hoad.BatchCouplingError` naming it.
    ``diagonal=True`` computes pure derivatives only: ``res[0, 0][..., i] = ∂²f/∂x_i²`` with shape
    ``f.shape + x.shape`` (each wrt input's axes once per block), at a fraction of the cost;
    the Laplacian is ``res[0, 0].sum()`` over x's axes.
    ``chunk_size=n`` (with ``batch_dim=0``) runs the program over n samples at a time and joins
    the results, like ``torch.func.vmap``'s ``chunk_size``: one program, built for n samples.
    ``memory_budget``: bytes a program may plan to use (default: 80% of the memory free when it
    is built); a program whose estimated peak exceeds it is refused with a
    :class:`hoad.MemoryBudgetError` naming the ways out, before anything is allocated.
    ``split_blocks=True`` (or a process group): under ``torch.distributed``, the top order's
    canonical blocks are dealt to the group's ranks, balanced by size; each rank computes and
    holds its own (``res.owner(key)``), and ``res.gather()`` (called on every rank) brings them all.
    ``packed=True`` computes the unique entries of the symmetric tensor over the wrt inputs' n entries
    (C(n+k-1, k) of nᵏ at order k), never forming a dense block (:mod:`hoad.packed`): ``res.packed(key)``
    returns a block of one input's unique entries, ``res[key]`` gathers any block, dense, when read.
    It pays where nᵏ far outgrows C(n+k-1, k): order 6 at n = 8 took 0.16x the dense program's time,
    order 5 at n = 16 0.43x; order 4 is faster dense. Its map sums jets with alternating signs: in
    float32 the top order loses one to two digits against the dense program (2.8e-5 relative at
    order 6, n = 8); use float64 there. ``packed="auto"`` (the default) chooses per call signature:
    packed where the top order has far more dense entries than unique ones (order 5 from n = 7,
    order 6 from n = 5: :func:`hoad.explanation.packed_pays`) and the wrt inputs are float64
    inputs of a plain function, dense otherwise (:class:`hoad.packed.AutoPacked`);
    ``packed=False`` always builds the dense program.
    """
    options = dict(backend=backend, mode=mode, batch_dim=batch_dim, diagonal=diagonal, chunk_size=chunk_size,
                   memory_budget=memory_budget, split_blocks=split_blocks)
    refuse_unknown("hoad.compile", unknown, ["order", "wrt", *options])
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise OutputError(f"{getattr(fn, '__name__', 'the function')} is a generator or coroutine function: it "
                          "yields or awaits instead of returning; hoad differentiates a function that returns one "
                          "tensor")
    if packed is not False and packed != "auto":
        return _packed(fn, order, wrt, packed, options)
    kind = Compiled if packed is False else _auto_packed()
    if fn is None:
        order, wrt, options["batch_dim"], options["chunk_size"] = plain_ints(order, wrt, batch_dim, chunk_size)
        check_options(order, wrt, **options)  # at decoration time; Compiled checks the direct call
        return lambda f: kind(f, order, wrt, **options)
    if not callable(fn):
        hint = (f" (as a decorator, name the order: @hoad.compile(order={fn}))"
                if isinstance(fn, int) and not isinstance(fn, bool) else "")
        raise InvalidArgumentError(f"hoad.compile expects a function, got {type(fn).__name__}{hint}")
    return kind(fn, order, wrt, **options)


def _auto_packed() -> type:
    from hoad.packed import AutoPacked

    return AutoPacked


def _packed(fn, order, wrt, packed, options: dict):
    """hoad.compile(..., packed=True): the program of unique entries (:class:`hoad.packed.Packed`)."""
    from hoad.packed import Packed

    if packed is not True:
        raise InvalidArgumentError(f"packed must be True, False or \"auto\", got {packed!r}")
    refused = [name for name, default in (("diagonal", False), ("split_blocks", None)) if options[name] != default]
    if refused:
        raise InvalidArgumentError(
            f"packed=True computes the unique entries of every block of one input; it does not combine with "
            f"{' or '.join(f'{n}=' for n in refused)} (diagonal=True already stores one entry per pure derivative)")
    kept = Options(options["batch_dim"], options["backend"], options["mode"], options["chunk_size"],
                   options["memory_budget"])
    if fn is None:
        return lambda f: Packed(f, order, wrt, options=kept)
    return Packed(fn, order, wrt, options=kept)
