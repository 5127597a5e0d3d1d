"""``hoad.compile``: the public entry point."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import itertools
import logging
import numbers
import os
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch._dynamo
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.nn.utils.stateless import _reparametrize_module
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.utils._python_dispatch import _disable_current_modes

from hoad.derivatives import Derivatives, ResultSpec
from hoad.distributed import (LocalCall, Split, check_split, data_parallel_wrappers, has_dtensors, record_nested,
                              synchronized)
from hoad.errors import (CaptureError, ExecutionError, HoadError, InvalidArgumentError, MemoryBudgetError, OutputError,
                         first_line)
from hoad.binding import (CallLayout, Keyword, Positional, StateEntry, bind_layout, find_guards, find_sources,
                          positional_names, untouched, _reachable)
from hoad.algebra import Target
from hoad.rules import EDITS, USER_OPS, has_autograd
from hoad.passes.clean import written_inputs
from hoad.passes.memory import human, samples_that_fit
from hoad.pipeline import (BUILDS, Build, Config, OperatorSpec, Sized, build, count_dependence, name_of,
                           smaller_programs)
from hoad.printing import ProgramView
from hoad.training import Trainable

log = logging.getLogger(__name__)

BACKENDS = ("inductor", "eager")
def default_backend() -> str:
    """The backend when none is given: ``HOAD_DEFAULT_BACKEND`` (read when a function is compiled;
    the test suite sets it to eager, since Inductor compiles cost seconds), else "inductor"."""
    return os.environ.get("HOAD_DEFAULT_BACKEND", "inductor")


# Programs kept per compiled function (one per call signature); the oldest goes first.
MAX_PROGRAMS = 16
MODES = ("auto", "forward", "reverse")


def compile(fn: Callable | None = None, /, order: int | None = None, wrt: Any = 0, *, backend: str | None = None,
            mode: str = "auto", batch_dim: int | None = None, diagonal: bool = False,
            chunk_size: int | None = None, memory_budget: float | None = None, split_blocks: Any = None,
            **unknown) -> Compiled | Callable[[Callable], Compiled]:
    """Compile ``fn`` into a callable returning its value and all derivatives up to ``order``.

    ``wrt`` selects the inputs to differentiate: an argnum, an argument name, or a tuple (or list) of them;
    the result is indexed with the same keys (``res[0]``, ``res[0, 1]``, ``res["x", "w"]``). Every
    canonical block of orders 1..order between them is computed in one program (Schwarz symmetry:
    ``res[1, 0]`` is a permuted view of ``res[0, 1]``).

    Used as ``hoad.compile(f, order=2)`` or as a decorator ``@hoad.compile(order=2)``.
    ``backend``: "inductor" (default) compiles the generated program with Inductor (cached on disk,
    see :func:`hoad.cache_dir`); "eager" runs it as an fx GraphModule without compiling.
    ``mode``: "forward" propagates every order forward; "reverse" propagates orders < N forward and
    gets order N from one first-order adjoint sweep (the adjoint form); "auto" builds both and keeps
    the one with the lower estimated cost (FLOPs, bytes and calls of the generated program).
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
    """
    options = dict(backend=backend, mode=mode, batch_dim=batch_dim, diagonal=diagonal, chunk_size=chunk_size,
                   memory_budget=memory_budget, split_blocks=split_blocks)
    refuse_unknown("hoad.compile", unknown, ["order", "wrt", *options])
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise OutputError(f"{getattr(fn, '__name__', 'the function')} is a generator or coroutine function: it "
                          "yields or awaits instead of returning; hoad differentiates a function that returns one "
                          "tensor")
    if fn is None:
        order, wrt, options["batch_dim"], options["chunk_size"] = _plain_ints(order, wrt, batch_dim, chunk_size)
        _check_options(order, wrt, **options)  # at decoration time; Compiled checks the direct call
        return lambda f: Compiled(f, order, wrt, **options)
    if not callable(fn):
        hint = (f" (as a decorator, name the order: @hoad.compile(order={fn}))"
                if isinstance(fn, int) and not isinstance(fn, bool) else "")
        raise InvalidArgumentError(f"hoad.compile expects a function, got {type(fn).__name__}{hint}")
    return Compiled(fn, order, wrt, **options)


def refuse_unknown(api: str, unknown: dict, known: list[str]) -> None:
    """A keyword ``api`` does not take, named with the closest one it does."""
    if unknown:
        name = next(iter(unknown))
        close = difflib.get_close_matches(name, known, n=1)
        raise InvalidArgumentError(f"{api} has no option {name!r}{f'; did you mean {close[0]!r}?' if close else ''} "
                                   f"(its options: {', '.join(known)})")


def _var_positional(fn) -> str | None:
    """The name of ``fn``'s ``*args`` parameter, if it has one."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), None)


def _tied_names(module: torch.nn.Module) -> dict[str, str]:
    """Each further name of a parameter or buffer held under several names -> the name
    ``named_parameters`` and ``named_buffers`` list it by (the first)."""
    first: dict[int, str] = {}
    tied = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if id(t) in first and first[id(t)] != name:
            tied[name] = first[id(t)]
        first.setdefault(id(t), name)
    return tied


def in_class_body(fn) -> bool:
    """Whether ``fn`` was defined in a class body (a method, whatever its first parameter is
    called): its qualified name is ``Class.name``, not ``name`` or ``outer.<locals>.name``."""
    parts = getattr(fn, "__qualname__", "").split(".")
    return len(parts) >= 2 and parts[-2] != "<locals>"


def _entries(wrt) -> tuple:
    """``wrt`` as a tuple of entries: one entry, or a tuple or list of them."""
    return tuple(wrt) if isinstance(wrt, (tuple, list)) else (wrt,)


MAX_ORDER = 12  # order 1000 ran 10 minutes and was killed at 22.8 GB, in the differentiate stage


def plain_int(value):
    """numpy's integers (``np.int64(2)``, as ``shape`` and ``argmax`` give them) as Python ints;
    anything else as given, for the option checks to judge."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def _plain_ints(order, wrt, batch_dim, chunk_size) -> tuple:
    """The integer options and wrt's argnums through :func:`plain_int`."""
    entries = tuple(plain_int(w) for w in _entries(wrt))
    wrt = entries if isinstance(wrt, (tuple, list)) else entries[0]
    return plain_int(order), wrt, plain_int(batch_dim), plain_int(chunk_size)


def _check_options(order, wrt, backend, mode, batch_dim=None, diagonal=False, chunk_size=None,
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
    entries = _entries(wrt)
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


class Rebuilt:
    """Copies (``copy.deepcopy``, pickle) are built afresh from the constructor's arguments,
    copied with the object, when first used: a deep copy of a module holding
    ``hoad.laplacian(self.u)`` or ``hoad.compile(self.u)`` differentiates the copy (its programs
    read the original's tensors, and its function was the original's), and nothing local to a
    function is pickled. The build waits for the first use because a deep copy of a module
    reaches this object before the module's copy is complete."""

    def _keep_arguments(self, *args, **kwargs) -> None:
        self.__dict__["_arguments"] = (args, kwargs)

    def __reduce__(self):
        if self.__dict__.get("_slot"):  # an instance's own method (decorated): pickled as None, its
            return _none, ()            # function is reached through a class attribute that is the
        return _blank, (type(self),), {"arguments": self._arguments}  # decorator; bound afresh after

    def __setstate__(self, state: dict) -> None:
        self.__dict__["_pending"] = state["arguments"]

    def __getattr__(self, name: str):
        pending = self.__dict__.pop("_pending", None)
        if pending is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        args, kwargs = pending
        self.__init__(*args, **kwargs)
        return getattr(self, name)


def bind_per_instance(descriptor, instance, name: str, make: Callable, belongs: Callable):
    """What a decorator (``descriptor``) gives ``instance``: ``make()``'s object, kept on the instance
    (a weak table whose values hold their keys never lets one go), or in the descriptor's weak table
    where the instance has no ``__dict__`` (``__slots__``). Made again where the kept one does not
    ``belong`` to the instance (a shallow copy's ``__dict__`` holds the original's). Kept on the
    instance, it pickles as None (``_slot``: see :class:`Rebuilt`) and binds afresh after."""
    own = getattr(instance, "__dict__", None)
    if isinstance(own, dict):
        table, key = own, f"_hoad_{name}_{id(descriptor):x}"
    elif type(instance).__weakrefoffset__:
        table, key = descriptor.__dict__.setdefault("_bound", weakref.WeakKeyDictionary()), instance
    else:
        cls = type(instance).__name__
        raise InvalidArgumentError(
            f"{cls}.{name} is decorated by hoad, but {cls} has __slots__ without '__weakref__', so hoad has "
            f"nowhere to keep the program it builds for each {cls}: add '__weakref__' to {cls}.__slots__")
    bound = table.get(key)
    if bound is None or not belongs(bound):
        bound = make()
        if table is own:
            bound.__dict__["_slot"] = True
        table[key] = bound
    return bound


def _blank(cls):
    return cls.__new__(cls)


def _none():
    return None


class Compiled(Rebuilt):
    """A compiled derivative function. Call it like the original; it returns :class:`Derivatives`.

    Programs are cached per call signature (tensor shapes, dtypes and devices, and the values
    of non-tensor arguments); a new signature traces and compiles again, with a warning, and at
    most ``MAX_PROGRAMS`` (16) programs are kept, least recently compiled out first.

    On an ``nn.Module`` method (as a decorator), on a bound method of a module, or on a module
    itself, the module's parameters and buffers are inputs of the program read at every call,
    never baked-in constants; ``wrt`` may name them (``"fc1.weight"``) or use
    :data:`hoad.parameters` for every trainable one, and result keys use those names.
    """

    def __init__(self, fn: Callable, order: int, wrt: Any = 0, *, backend: str | None = None, mode: str = "auto",
                 batch_dim: int | None = None, diagonal: bool = False, chunk_size: int | None = None,
                 memory_budget: float | None = None, split_blocks: Any = None, module: torch.nn.Module | None = None,
                 operator: OperatorSpec | None = None, roots: dict | None = None, nestable: bool = False,
                 target: Target | None = None):
        self._keep_arguments(fn, order, wrt, backend=backend, mode=mode, batch_dim=batch_dim,
                             diagonal=diagonal, chunk_size=chunk_size, memory_budget=memory_budget,
                             split_blocks=split_blocks, module=module, operator=operator, roots=roots,
                             nestable=nestable, target=target)
        backend = default_backend() if backend is None else backend
        order, wrt, batch_dim, chunk_size = _plain_ints(order, wrt, batch_dim, chunk_size)
        _check_options(order, wrt, backend, mode, batch_dim, diagonal, chunk_size, memory_budget, split_blocks)
        if module is None and isinstance(fn, torch.nn.Module):
            module, fn = fn, type(fn).forward
        elif module is None and inspect.ismethod(fn) and isinstance(fn.__self__, torch.nn.Module):
            module, fn = fn.__self__, fn.__func__
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.module = module
        self.order = order
        self.wrt = _entries(wrt)
        self.config = Config(order=order, backend=backend, mode=mode, batch_dim=batch_dim, diagonal=diagonal,
                             operator=operator, nestable=nestable, target=target, memory_budget=memory_budget,
                             chunk_size=chunk_size, split_blocks=split_blocks or None)
        self._extra_roots = dict(roots or {})
        self._options = dict(backend=backend, mode=mode, batch_dim=batch_dim, diagonal=diagonal,
                             chunk_size=chunk_size, memory_budget=memory_budget, split_blocks=split_blocks)
        names = positional_names(fn)
        self._positional = names[1:] if module is not None else names
        self._method = module is None and bool(names) and names[0] == "self"
        if not (self._method or (module is None and in_class_body(fn))):  # (a method's wrt may name
            self._check_wrt_against_signature()                           # its module's parameters)
        self._cache: dict[Hashable, _Entry] = {}
        self._families: dict[Hashable, _Family] = {}
        # programs by key and the Python values they were traced with (Guard), kept when those
        # values change so that changing them back (net.eval(), then net.train()) traces nothing
        self._twins: dict[tuple, _Entry] = {}
        self._wrt_leaves: dict[Hashable, list[int]] = {}
        self._edits = EDITS[0]    # the rule registrations the cached programs were built with
        self._last: _Entry | None = None

    # ------------------------------------------------------------------------------ binding
    def __get__(self, instance, owner=None):
        """``@hoad.compile`` on a method: each instance gets its own compiled callable."""
        if instance is None:
            return self

        def make():
            if isinstance(instance, torch.nn.Module):
                return Compiled(self.fn, self.order, self.wrt, module=instance, **self._options)
            # a plain object: it is a non-tensor argument of the function
            return Compiled(functools.partial(self.fn, instance), self.order, self.wrt, **self._options)

        return bind_per_instance(self, instance, getattr(self.fn, "__name__", "method"), make,
                                 lambda b: (b.module if b.module is not None else b.fn.args[0]) is instance)

    def _state(self) -> dict[str, torch.Tensor]:
        """The module's parameters and buffers as they are now: the live tensors, so that autograd
        reaches every parameter from the results (training through derivatives)."""
        state = dict(self.module.named_parameters())
        state.update(self.module.named_buffers())
        if any(isinstance(t, torch.nn.parameter.UninitializedTensorMixin) for t in state.values()):
            raise CaptureError("the module has lazy layers (nn.LazyLinear, say) whose parameters are not initialized "
                               "yet; call it once on an example batch before hoad traces it")
        return state

    def _stateful(self, state: dict, *args, **kwargs):
        # tie_weights: a parameter shared by two submodules (a decoder tied to its embedding) is
        # one state entry, named once by named_parameters; the traced value must replace it in
        # every place, or the other uses read the live tensor as a constant (derivatives wrong)
        with _reparametrize_module(self.module, state, tie_weights=True):
            out = self.fn(self.module, *args, **kwargs)
            self._write_back_assigned(state)
            return out

    def _write_back_assigned(self, state: dict) -> None:
        """A buffer the function assigns a new tensor to (``self.ema = 0.9 * self.ema + ...``)
        gets that value written into its state entry, which the program replays at every call
        as it replays in-place updates (torch's module then holds the new value, as after a
        plain call; reparametrization would otherwise drop it)."""
        for name, t in state.items():
            path, _, attr = name.rpartition(".")
            owner = self.module.get_submodule(path)
            now = owner._buffers.get(attr, t)  # (t itself for a parameter)
            if now is t or now is None:
                continue
            if not isinstance(now, torch.Tensor) or now.shape != t.shape or now.dtype != t.dtype:
                raise CaptureError(
                    f"the function assigns to the buffer {name!r} a value of another shape, dtype or type "
                    f"({getattr(now, 'shape', type(now).__name__)}, was {tuple(t.shape)} {t.dtype}); a derivative "
                    "program can replay updates of a buffer only in place: keep its shape and dtype")
            t.copy_(now)

    # ------------------------------------------------------------------------------- calling
    @torch._dynamo.disable(reason=GRAPH_BREAK)  # inside torch.compile: a graph break, hoad runs its own program
    def __call__(self, *args, **kwargs) -> Derivatives:
        if has_dtensors(args, kwargs):  # each rank's program on its local tensors (hoad.distributed)
            local = LocalCall(args, kwargs, self.config.batch_dim, self._positional)
            return self(*local.args, **local.kwargs).mapped(local.wrap)
        n = self.config.chunk_size
        if n is not None and get_proxy_mode() is None:
            chunks = self._chunks(n, args, kwargs)
            if chunks is not None:
                return self._joined(chunks)
        return self._call(*args, **kwargs)

    def _chunks(self, n: int, args: tuple, kwargs: dict) -> list | None:
        """The call split into calls of n samples each (the last padded with copies of its first
        sample, so one program serves every chunk): [(args, kwargs, samples kept)], or None when
        the call has at most n samples."""
        places = []
        for w in self._expanded_wrt():
            if isinstance(w, int) and w < len(args):
                places.append(Positional(w))
            elif isinstance(w, int) and w < len(self._positional) and self._positional[w] in kwargs:
                places.append(Keyword(self._positional[w]))
            elif isinstance(w, str) and w in kwargs:
                places.append(Keyword(w))
            elif isinstance(w, str) and w in self._positional and self._positional.index(w) < len(args):
                places.append(Positional(self._positional.index(w)))
        values = [args[p.index] if isinstance(p, Positional) else kwargs[p.name] for p in places]
        if not values or not all(isinstance(v, torch.Tensor) and v.ndim > 0 for v in values):
            return None  # the unchunked call names what is wrong
        samples = values[0].shape[0]
        if any(v.shape[0] != samples for v in values):
            raise InvalidArgumentError(f"batch_dim=0 with chunk_size: the wrt inputs have different numbers of samples "
                                       f"{[v.shape[0] for v in values]} along dim 0")
        if samples <= n:
            return None
        wrt_ids = {id(v) for v in values}
        others = [(f"argument {i}", a) for i, a in enumerate(args)] + [
            (repr(k), v) for k, v in kwargs.items() if not k.startswith("hoad_")]  # (an operator's own: shared)
        for name, t in others:
            if isinstance(t, torch.Tensor) and id(t) not in wrt_ids and t.ndim > 0 and t.shape[0] == samples:
                # which of them hold samples, chunk_size cannot tell: a shared (B, ...) tensor split
                # would be silently wrong, a per-sample one kept whole fails to broadcast
                raise InvalidArgumentError(
                    f"chunk_size={n} splits the wrt inputs along dim 0, and the tensor {name} (shape "
                    f"{tuple(t.shape)}) also has {samples} rows: hoad cannot tell whether it holds samples. Split the "
                    f"call into chunks yourself, or drop chunk_size")
        chunks = []
        for start in range(0, samples, n):
            kept = min(n, samples - start)
            a, k = list(args), dict(kwargs)
            for place, v in zip(places, values):
                piece = v[start:start + kept]
                if kept < n:
                    piece = torch.cat([piece, piece[:1].expand(n - kept, *piece.shape[1:])])
                if isinstance(place, Positional):
                    a[place.index] = piece
                else:
                    k[place.name] = piece
            chunks.append((tuple(a), k, kept))
        return chunks

    def _joined(self, chunks: list) -> Derivatives:
        """The chunks' results written into the joined ones as each chunk finishes: the call holds
        the joined results and one chunk's program, not every chunk's results besides."""
        total = sum(kept for _a, _k, kept in chunks)
        value = blocks = first = None
        at = 0
        for i, (a, k, kept) in enumerate(chunks):
            r, entry = self._call_entry(*a, **k)
            if i == 0:  # (this call's program: another thread's calls move _last)
                self._check_count_free(entry)
                self._check_joined_size(entry, len(chunks), total)
                first = r
                value = r.value.new_empty((total, *r.value.shape[1:]))
                blocks = {K: b.new_empty((total, *b.shape[1:])) for K, b in r._blocks.items()}
            value[at:at + kept] = r.value[:kept]
            for K, b in r._blocks.items():
                blocks[K][at:at + kept] = b[:kept]
            at += kept
        return Derivatives(value, blocks, first._spec)

    def _check_count_free(self, entry: _Entry) -> None:
        """Chunks change what the function sees as its number of samples: refuse one that computes
        with it (a per-sample loss divided by X.shape[0] was off by the samples over chunk_size)."""
        b = entry.build
        if "count_free" not in b.stats:
            b.stats["count_free"] = count_dependence(b, b.captured.out_shape[0] + 1) is None
        if not b.stats["count_free"]:
            raise InvalidArgumentError(
                f"chunk_size={self.config.chunk_size} runs the function on {self.config.chunk_size} samples at a time, "
                "and the function uses its number of samples as a value (X.shape[0] in a mean, say), so chunks would "
                "change its results. Divide by the total outside the function, pass the count as an argument, or "
                "drop chunk_size")

    def _check_joined_size(self, entry: _Entry, chunks: int, samples: int) -> None:
        """The joined results must fit, whatever the size of one chunk's program."""
        memory = entry.build.stats.get("memory")
        if not memory or memory["budget"] is None:
            return
        plan, budget = memory["plan"], memory["budget"]
        results = plan.results * chunks
        total = results + plan.peak  # (the joined results, and one chunk's program)
        if total > budget:
            n, shared = self.config.chunk_size, entry.build.shared_bytes
            fit = samples_that_fit(samples, plan.results / n, (plan.peak - shared) / n, budget, shared)
            ways = ([f"chunk_size={fit}"] if 1 <= fit < n else []) + smaller_programs(self.config)
            raise MemoryBudgetError(
                f"the joined results of all {chunks} chunks and one chunk's program take {human(total)}, over the "
                f"memory budget of {human(budget)}: chunking bounds the program's working memory, not its results. "
                f"Ways out: {'; '.join(ways + ['fewer samples per call', 'a larger memory_budget'])}")

    def _call(self, *args, **kwargs) -> Derivatives:
        return self._call_entry(*args, **kwargs)[0]

    def _call_entry(self, *args, **kwargs) -> tuple[Derivatives, _Entry]:
        """The call's results and the program that computed them."""
        if self._method:
            raise InvalidArgumentError(
                f"{getattr(self.fn, '__name__', 'this function')} takes `self`: decorate a method of a class and "
                "call it on an instance (m.method(x)), or pass a bound method or a module to hoad.compile")
        nested = get_proxy_mode() is not None  # inside another hoad.compile's trace
        if self._edits != EDITS[0]:  # a rule was registered or removed: every program may change
            with BUILDS:  # (not while another thread builds into these tables)
                if self._cache:
                    log.info("hoad: %s: derivative rules were registered or removed; tracing again",
                             getattr(self.fn, "__name__", "function"))
                self._cache.clear()
                self._twins.clear()
                self._families.clear()
                self._edits = EDITS[0]
        for i, a in enumerate((*args, *kwargs.values())):
            if isinstance(a, torch.Tensor) and (a.is_nested or a.layout is not torch.strided):  # (before the cache)
                name = (self._positional[i] if i < len(self._positional) else f"argument {i}") if i < len(args) \
                    else list(kwargs)[i - len(args)]
                if a.is_nested:
                    raise InvalidArgumentError(f"input {name!r} is a nested tensor; hoad traces dense tensors: pad it "
                                               "(torch.nested.to_padded_tensor) or call once per component")
                raise InvalidArgumentError(f"input {name!r} is a {str(a.layout).removeprefix('torch.')} tensor; hoad "
                                           "traces dense (strided) tensors: pass t.to_dense()")
        transformed = torch._C._functorch.peek_interpreter_stack() is not None  # under torch.func.grad, vmap
        if (not nested and not transformed and self.module is None and all(type(a) is torch.Tensor for a in args)
                and all(type(v) is torch.Tensor for v in kwargs.values())):
            # fast path: tensors only, no pytree needed (~20 us per call less); keyword ones are
            # leaves after the positional ones in the order given, as pytree flattens them
            key = tuple((a.shape, a.dtype, a.device) for a in args) + (_ambient(),)
            if kwargs:
                key += tuple((name, v.shape, v.dtype, v.device) for name, v in kwargs.items())
            entry = self._cache.get(key)
            if entry is not None:
                free = entry.read_free()
                if free is not None:
                    self._last = entry
                    return entry.result(list(args) + list(kwargs.values()) if kwargs else args, free), entry
        else:
            key = None
        extra: tuple = ()
        if self.module is not None:
            args = (self._state(),) + args
            extra = tuple(m.training for m in self.module.modules())
            if any(w is parameters for w in self.wrt):  # a parameter frozen or unfrozen changes the blocks
                extra += (self._expanded_wrt(),)
        leaves, treedef = pytree.tree_flatten((args, kwargs))
        key = key or (treedef, tuple(_leaf_key(leaf) for leaf in leaves), extra, _ambient())
        config = self.config
        if transformed and not nested and config.backend != "eager":
            # compiled kernels take plain tensors and hoad's kernels have no functorch rules: the
            # transform runs an eager twin of the program
            config = dataclasses.replace(config, backend="eager")
            key = ("transformed", key)
        if nested and (config.backend, config.nestable) != ("eager", True):
            # the outer program differentiates this program's ops: an eager twin made for it
            config = dataclasses.replace(config, backend="eager", nestable=True)
            key = ("nested", key)
        entry = self._cache.get(key)
        free = entry.read_free() if entry is not None else None
        if free is None:
            with BUILDS:  # one build at a time (make_fx and Inductor keep process-wide state)
                entry = self._cache.get(key)  # another thread may have built it meanwhile
                free = entry.read_free() if entry is not None else None
                if free is None and entry is not None:
                    twin = self._twins.get((key, entry.values_now()))
                    free = twin.read_free() if twin is not None else None
                    if free is not None:  # built before for these Python values (train/eval, say)
                        entry = self._cache[key] = twin
                    else:
                        self._forget(entry)
                if free is None:
                    family = None if nested or config.batch_dim is None else self._family(treedef, leaves, extra)
                    entry = family.entry if family is not None and family.entry is not None else None
                    if entry is not None:  # one program for every number of samples
                        entry.check_samples(family.samples(leaves))
                        self._keep(key, entry)
                    else:
                        if family is not None and family.first is not None and family.tried is None:
                            config = dataclasses.replace(config, sized=family.first)
                        entry = self._new_signature(key, args, kwargs, config, nested,
                                                    family.tried if family is not None else None)
                        if not nested and config.batch_dim is not None:
                            self._remember(treedef, leaves, extra, entry, config.sized is not None)
                    self._twins[(key, entry.values)] = entry
                    while len(self._twins) > MAX_PROGRAMS:
                        del self._twins[next(iter(self._twins))]
                    free = entry.read_free()
                    if free is None:
                        raise InvalidArgumentError(
                            f"{name_of(self.fn)}: {entry.why} between the trace and the check that follows it: "
                            "the program keeps what the trace read, and a value that is not the same at two reads "
                            "in a row (a property computed anew at each read, a counter, another thread's writes) "
                            "cannot be checked at later calls. Keep such a value in a tensor (read afresh at "
                            "every call) or compute it once before the first call")
        if not nested:
            self._last = entry
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        return entry.result(tensors, free), entry

    def _new_signature(self, key, args: tuple, kwargs: dict, config: Config, nested: bool,
                       per_count: str | None = None) -> _Entry:
        """Compile for a signature not seen before, keeping at most MAX_PROGRAMS (least recent out).
        ``per_count``: why this function's program depends on its number of samples, if it does."""
        name = getattr(self.fn, "__name__", "function")
        if config.sized is not None:
            log.info("hoad: %s called with another number of samples; building one program for every number",
                     name)
        elif per_count is not None:
            level = logging.WARNING if self.config.backend == "inductor" else logging.INFO
            log.log(level, "hoad: %s called with another number of samples; compiling program %d for it, since its "
                           "program depends on the number of samples (%s)", name, len(self._cache) + 1, per_count)
        elif not nested and any(not _is_nested(k) for k in self._cache):
            level = logging.WARNING if self.config.backend == "inductor" else logging.INFO
            why = _what_changed(key, [k for k in self._cache if not _is_nested(k)])
            changed = "" if why else self._arguments_changed(key, args, kwargs)
            if why:
                log.log(level, "hoad: %s called after %s; compiling program %d for it (kept: changing it back "
                               "compiles nothing).", name, why, len(self._cache) + 1)
            elif changed:
                log.log(level, "hoad: %s called with %s; compiling program %d for it (kept: a call like an earlier "
                               "one compiles nothing).", name, changed, len(self._cache) + 1)
            else:
                shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                                   for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
                log.log(level, "hoad: %s called with a new signature (tensors %s); compiling program %d for it. "
                               "Each distinct shape, dtype or Python-scalar value is its own program (under "
                               "batch_dim=0, a second number of samples tries one program for every number).",
                        name, shapes, len(self._cache) + 1)
        if nested or torch._C._functorch.peek_interpreter_stack() is not None:
            # built outside the outer trace (and its tracing context: torch.export's would lend the
            # build its symbolic sizes) or the torch.func transform (inside one the trace saw its
            # wrappers, and every derivative through the program came out 0), on concrete
            # stand-ins of the values; the calls then run inside, like any other
            with contextlib.ExitStack() as outside:
                outside.enter_context(temporarily_clear_interpreter_stack())
                if nested:
                    outside.enter_context(_disable_current_modes())
                    outside.enter_context(torch._guards.tracing(None))
                args, kwargs = pytree.tree_map_only(torch.Tensor, _stand_in, (args, kwargs))
                entry = self._compile(args, kwargs, config)
            if nested:
                entry.trace = get_proxy_mode()
        else:
            entry = self._compile(args, kwargs, config)
        self._keep(key, entry)
        return entry

    def _arguments_changed(self, key, args: tuple, kwargs: dict) -> str:
        """The arguments that set this call apart from the cached call nearest to it (the fewest
        leaves differing, in the same structure), as ``k=0.7 (was 0.5)``, or "" where none is near."""
        if not (isinstance(key, tuple) and len(key) == 4 and isinstance(key[0], pytree.TreeSpec)):
            return ""
        full = [k for k in self._cache if isinstance(k, tuple) and len(k) == 4 and isinstance(k[0], pytree.TreeSpec)
                and k[2:] == key[2:]]
        alike = [k for k in full if k[0] == key[0] and len(k[1]) == len(key[1])]
        if not alike:  # the arguments are arranged otherwise: both calls, as written
            return (f"({self._written(key)}), where it was called with ({self._written(full[-1])})"
                    if full else "")
        differing = lambda k: [i for i, (a, b) in enumerate(zip(k[1], key[1])) if not _same_key(a, b)]  # noqa: E731
        nearest = min(alike, key=lambda k: len(differing(k)))
        paths = [path for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]]
        state = self.module is not None  # (args[0] is then the module's state)
        changes = [f"{self._leaf_name(paths[i], state)}={_shown_leaf(key[1][i])} (was {_shown_leaf(nearest[1][i])})"
                   for i in differing(nearest)]
        if not changes:
            return ""
        scalars = [i for i in differing(nearest) if key[1][i][0] == "S"]
        advice = (" (a Python number is part of the program it is traced into: pass one that changes between calls "
                  "as a tensor, read afresh at every call, to keep one program)") if scalars else ""
        return ", ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "") + advice

    def _written(self, key) -> str:
        """The call a cache key stands for: ``x=tensor (3,) float64, k=0.5; by keyword scale=2.0``."""
        args, kwargs = pytree.tree_unflatten(list(key[1]), key[0])
        state = self.module is not None
        shown = lambda v: _shown_leaf(v) if isinstance(v, tuple) and v and v[0] in ("T", "S") else "…"  # noqa: E731
        parts = [f"{self._leaf_name((pytree.SequenceKey(0), pytree.SequenceKey(i)), state)}={shown(a)}"
                 for i, a in enumerate(args) if i >= state]
        keywords = ", ".join(f"{name}={shown(v)}" for name, v in kwargs.items())
        return ", ".join(parts) + (f"; by keyword {keywords}" if keywords else "")

    def _leaf_name(self, path: tuple, state: bool) -> str:
        """A leaf of (args, kwargs) as the user wrote it: ``k``, ``x``, ``batch['u']``."""
        where, rest = path[0].idx, path[2:]
        if where == 1:  # a keyword
            return f"{path[1].key}{pytree.keystr(rest)}"
        i = path[1].idx - state
        if i < 0:
            return f"the module state{pytree.keystr(rest)}"
        name = self._positional[i] if i < len(self._positional) else f"argument {i}"
        return f"{name}{pytree.keystr(rest)}"

    def _forget(self, entry: _Entry) -> None:
        """Drop a program whose free tensors or Python values changed (every key it serves, and
        the sample-count families, which may hold it or a graph traced with the old values)."""
        name = getattr(self.fn, "__name__", "the function")
        if entry.expected:
            log.info("hoad: %s: %s; tracing it again", name, entry.why)
        else:
            log.warning("hoad: %s was traced with Python values it may read, and %s; tracing it again (keep values "
                        "that change between calls in tensors: a tensor is read afresh at every call)", name, entry.why)
        for key in [k for k, e in self._cache.items() if e is entry]:
            del self._cache[key]
        self._families.clear()

    def _keep(self, key, entry: _Entry) -> None:
        if len(self._cache) >= MAX_PROGRAMS:
            oldest = next(iter(self._cache))
            dropped = self._cache.pop(oldest)
            if not any(f.entry is dropped for f in self._families.values()):  # (else a size's shortcut)
                log.warning("hoad: %s keeps at most %d programs; dropped the least recently compiled one",
                            getattr(self.fn, "__name__", "function"), MAX_PROGRAMS)
        self._cache[key] = entry

    # ----------------------------------------------------------------- every number of samples
    def _family(self, treedef, leaves: list, extra) -> _Family | None:
        """The calls that differ from this one only in the number of samples (dim 0 of every wrt
        input, all equal), or None when this call has none or fewer than 2 samples."""
        wrt = self._wrt_leaves.get((treedef, extra))
        if wrt is None:
            return None
        counts = {leaves[i].shape[0] if isinstance(leaves[i], torch.Tensor) and leaves[i].ndim else None for i in wrt}
        if len(counts) != 1 or None in counts or next(iter(counts)) < 2:
            return None
        fkey = (treedef, tuple((None,) + tuple(leaf.shape[1:]) + (leaf.dtype, leaf.device) if i in wrt
                               else _leaf_key(leaf) for i, leaf in enumerate(leaves)), extra)
        return self._families.setdefault(fkey, _Family(wrt))

    def _remember(self, treedef, leaves: list, extra, entry: _Entry, tried: bool) -> None:
        """After a build: the wrt leaves of this call structure, and the family's program."""
        self._wrt_leaves.setdefault((treedef, extra), list(entry.build.wrt_leaves))
        family = self._family(treedef, leaves, extra)
        if family is None:
            return
        if entry.build.stats.get("any_samples"):
            family.entry = entry
            log.info("hoad: %s: one program now serves every number of samples", getattr(self.fn, "__name__", "function"))
        elif tried:  # the structure depends on the number of samples: one program per count
            family.tried = entry.build.stats.get("samples_differ") or "its builds for two counts differ"
            log.log(logging.WARNING if self.config.backend == "inductor" else logging.INFO,
                    "hoad: %s: no one program serves every number of samples, since %s; each count is compiled on "
                    "its own", getattr(self.fn, "__name__", "function"), family.tried)
        elif family.first is None:
            family.first = Sized.of(entry.build)

    def _compile(self, args: tuple, kwargs: dict, config: Config) -> _Entry:
        stateful = self.module is not None
        target = self._stateful if stateful else self.fn
        layout, tensors = bind_layout(target, args, kwargs, state=stateful, names=self._positional)
        user_args = args[1:] if stateful else args
        wrt = self._expanded_wrt()
        wrt_leaves = [self._resolve_wrt(w, layout, user_args, kwargs) for w in wrt]
        if len(set(wrt_leaves)) != len(wrt_leaves):
            raise InvalidArgumentError(f"wrt={self.wrt!r} names the same input twice (e.g. by position and by name)")
        for name, t in zip(layout.names, tensors):
            if t.layout != torch.strided:  # sparse or nested: make_fx traces dense tensors only
                raise InvalidArgumentError(
                    f"input {name!r} is a {str(t.layout).removeprefix('torch.')} tensor; hoad traces dense (strided) "
                    "tensors: pass t.to_dense()")
        for w, leaf in zip(wrt, wrt_leaves):
            t = tensors[leaf]
            if not t.dtype.is_floating_point:
                raise InvalidArgumentError(
                    f"wrt input {w!r} has dtype {t.dtype}; derivatives need a floating-point tensor "
                    "(convert it with .double() or .float())")
        log.info("hoad: compiling %s at order %d for a new signature", getattr(self.fn, "__name__", "function"), self.order)
        roots = self._roots()
        # (ddp_model.module.method(x): DDP's protocol while training; an FSDP2 module is refused)
        wrappers = data_parallel_wrappers(itertools.chain([self.module] if self.module is not None else [],
                                                          _reachable(roots)))
        b = build(target, layout, tensors, wrt_leaves, config, roots=roots)
        entry = _Entry(b, wrt, self._aliases(wrt, layout, wrt_leaves), roots)
        entry.ddp += [(w, False) for w in wrappers if all(d is not w for d, _always in entry.ddp)]
        return entry

    def _roots(self) -> dict:
        """Where the tensors the function reaches without receiving them are looked up."""
        roots = {"fn": self.fn}
        if self.module is not None:
            roots["module"] = self.module
        roots.update(self._extra_roots)
        return roots

    # ----------------------------------------------------------------------------------- wrt
    def _expanded_wrt(self) -> tuple:
        """wrt with :data:`hoad.parameters` replaced by every trainable parameter's name."""
        out: list = []
        for w in self.wrt:
            if w is parameters:
                if self.module is None:
                    raise InvalidArgumentError("wrt=hoad.parameters needs a module: decorate a module method, or pass "
                                               "a module or a bound method of one to hoad.compile")
                out += [n for n, p in self.module.named_parameters() if p.requires_grad]
            else:
                out.append(w)
        twice = sorted({w for w in out if out.count(w) > 1}, key=out.index)
        if twice:
            raise InvalidArgumentError(f"wrt names {', '.join(map(repr, twice))} twice: hoad.parameters includes every "
                                       "trainable parameter; name it once")
        if not out:
            raise InvalidArgumentError(
                f"wrt=hoad.parameters, but {type(self.module).__name__} has no parameter that requires grad (none, or "
                "all frozen): unfreeze some (p.requires_grad_(True)), or name the inputs to differentiate in wrt")
        return tuple(out)

    def _check_wrt_against_signature(self) -> None:
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            return
        var_positional = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())
        var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        state = dict(self.module.named_parameters()) | dict(self.module.named_buffers()) if self.module is not None else {}
        for w in self.wrt:
            if isinstance(w, int) and w >= len(self._positional) and not var_positional:
                raise InvalidArgumentError(
                    f"wrt={w} but {getattr(self.fn, '__name__', 'the function')} takes {len(self._positional)} "
                    f"positional arguments {tuple(self._positional)}")
            if isinstance(w, str) and w not in params and w not in state and not var_keyword:
                tied = _tied_names(self.module).get(w) if self.module is not None else None
                if tied is not None:
                    raise InvalidArgumentError(
                        f"wrt names {w!r}, which is the same parameter as {tied!r} (tied weights): the module lists "
                        f"it once, as {tied!r}; name that, and its derivatives cover every use")
                bound = list(params)[:1] if self.module is not None else []  # (the module itself)
                known = tuple(n for n in params if n not in bound) + tuple(state)
                raise InvalidArgumentError(f"wrt names {w!r}, which is not an argument of the function"
                                           f"{' nor a parameter or buffer of the module' if self.module is not None else ''}; "
                                           f"valid names are {known}")

    def _resolve_wrt(self, w, layout: CallLayout, args: tuple, kwargs: dict) -> int:
        """The tensor-leaf index of wrt entry ``w`` in this call (``args`` without the state)."""
        if isinstance(w, int):
            if w < len(args):
                place, value = Positional(w), args[w]
            elif w < len(self._positional) and self._positional[w] in kwargs:
                place, value = Keyword(self._positional[w]), kwargs[self._positional[w]]
            else:
                raise InvalidArgumentError(f"wrt={w} but the call passes only {len(args)} positional arguments")
        elif w in kwargs:
            place, value = Keyword(w), kwargs[w]
        elif w in self._positional and self._positional.index(w) < len(args):
            place, value = Positional(self._positional.index(w)), args[self._positional.index(w)]
        elif layout.leaf(StateEntry(w)) is not None:
            return layout.leaf(StateEntry(w))
        elif _var_positional(self.fn) == w:
            raise InvalidArgumentError(f"wrt names {w!r}, the function's *{w}: its entries have no names of their "
                                       f"own; name them by position (wrt=0, wrt=(0, 1), ...)")
        else:
            raise InvalidArgumentError(f"wrt names {w!r}, but the call does not pass it; pass it explicitly")
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(f"wrt input {w!r} is a {type(value).__name__}; hoad differentiates with "
                                       "respect to tensors only (pass a torch.Tensor)")
        leaf = layout.leaf(place)
        if leaf is None:
            raise InvalidArgumentError(f"wrt input {w!r} must be a tensor argument itself, not inside a container")
        return leaf

    def _aliases(self, wrt: tuple, layout: CallLayout, wrt_leaves: list[int]) -> dict:
        """Every way a user may name a wrt entry in a result key: as given, by argnum, by name."""
        aliases: dict = {}
        for pos, (w, leaf) in enumerate(zip(wrt, wrt_leaves)):
            aliases[w] = pos
            place = layout.places[leaf]
            if isinstance(place, Positional):
                aliases.setdefault(place.index, pos)
                if place.index < len(self._positional):
                    aliases.setdefault(self._positional[place.index], pos)
            else:
                aliases.setdefault(place.name, pos)
                if place.name in self._positional:
                    aliases.setdefault(self._positional.index(place.name), pos)
        return aliases

    # ------------------------------------------------------------------------------ inspect
    @property
    def graph(self) -> ProgramView:
        """The derivative program of the most recent call signature (print it to read it)."""
        if self._last is None:
            raise InvalidArgumentError("call the compiled function once before asking for its graph "
                                       "(the program depends on the shapes of the arguments)")
        return ProgramView(self._last.build.program, self._last.build.stats)

    def explain(self, *args, **kwargs):
        """Blocks (dense vs stored entries), both directions' estimated cost and the chosen one,
        and per-stage node counts, for the program of these arguments (or the last call)."""
        from hoad.explanation import Explanation

        if args or kwargs:
            self(*args, **kwargs)
        if self._last is None:
            raise InvalidArgumentError("pass the arguments to explain (or call the compiled function first)")
        return Explanation(self._last.build)

    def __repr__(self) -> str:
        return f"<hoad.compile({getattr(self.fn, '__name__', self.fn)!s}, order={self.order}, wrt={self.wrt!r})>"


class _Family:
    """Calls of one function that differ only in their number of samples (under batch_dim)."""

    def __init__(self, wrt: list[int]):
        self.wrt = wrt
        self.first: Sized | None = None   # the first build's program
        self.tried: str | None = None     # how a second build showed the structure depends on the count
        self.entry: _Entry | None = None  # the program for every number of samples

    def samples(self, leaves: list) -> int:
        return leaves[self.wrt[0]].shape[0]


class _Entry:
    """One compiled signature: the program, the free tensors it reads, how to wrap its outputs."""

    def __init__(self, b: Build, wrt: tuple, aliases: dict, roots: dict):
        self.build = b
        self.program = p = b.program
        self.run = b.run
        self.spec = ResultSpec(p.keys, p.zeros, wrt, aliases, p.slot_shapes, p.order, p.diagonal,
                               Split(b.config.split_blocks, p.owners, p.rank) if p.owners else None)
        # an Inductor program records no autograd graph: calls that need one go through Trainable
        self.n_user = b.n_user
        self.written = written_inputs(b.captured.gm)  # inputs the program writes into (in place)
        # user ops: results through one autograd cannot see through do not train (hoad.extend._give_autograd)
        self.user_ops = list(dict.fromkeys(n.target for n in b.captured.gm.graph.nodes if n.target in USER_OPS))
        # (its hoisted part folded back in: under autograd it runs at every call anyway)
        self.trainable = Trainable(p.gm, f"the order-{p.order} {p.direction} program", p.prefix, p.prefix_reads,
                                   self.n_user, b.samples) if b.config.backend == "inductor" else None
        free = b.captured.free
        self.roots = roots
        self.guards = find_guards(roots)
        self.values = self.values_now()
        # why read_free last found the program stale, and whether that is a routine change (a
        # tensor's new shape, a train/eval switch) rather than a Python value worth a warning
        self.why, self.expected = "", True
        self.trace = None  # the trace a nested program was built in (its held values are that trace's)
        # DistributedDataParallel modules whose forward protocol runs around every call (hoad.distributed):
        # those the function calls, always; the wrapper of a decorated method's module, while gradients are on
        self.ddp = [(d, True) for d in b.captured.ddp]
        self.sources = list(b.sources)
        self.metas = [_meta(t) for t in free]
        # numbers the program keeps from .item() of free tensors (narrow's start): where they are
        # read from now, and the number (the program is built again when it changes)
        reads = b.captured.values
        self.value_reads = [(src, t if src is None else None, v)
                            for src, (t, v) in zip(find_sources(roots, [t for t, _ in reads]), reads)]
        # tensors whose source was not found are held by identity (in-place updates still seen)
        self.held = [t if s is None else None for t, s in zip(free, self.sources)]
        lost = [f"{tuple(t.shape)} {t.dtype}" for t, s in zip(free, self.sources) if s is None]
        if lost:
            log.warning("hoad: %s reads tensors (%s) reached through objects hoad does not follow; each call reads "
                        "the same tensor objects, so in-place updates are seen but rebinding them to new tensors "
                        "is not. Pass them as arguments to be safe.", name_of(b.fn),
                        ", ".join(lost))

    def check_samples(self, count: int) -> None:
        """A program for every number of samples: refuse a count whose estimated peak (the plan
        scaled from the count it was built for) exceeds the budget."""
        memory = self.build.stats.get("memory")
        if not memory or memory["budget"] is None:
            return
        built, plan = self.build.captured.out_shape[0], memory["plan"]
        shared = self.build.shared_bytes
        peak = shared + (plan.peak - shared) * count / built
        if peak > memory["budget"]:
            fit = max(1, samples_that_fit(count, plan.results / built, (plan.peak - shared) / built, memory["budget"],
                                          shared))
            raise MemoryBudgetError(
                f"{count} samples need an estimated peak of {human(peak)}, over the memory budget of "
                f"{human(memory['budget'])}. Ways out: "
                + "; ".join([f"chunk_size={fit} to run {fit} samples at a time"] + smaller_programs(self.build.config)))

    def values_now(self) -> tuple | None:
        """The Python values :attr:`guards` watch, as they are now (None if one is gone)."""
        return tuple(guard.now(self.roots) for guard in self.guards)

    def read_free(self) -> list[torch.Tensor] | None:
        """The free tensors as they are now, or None if one changed shape, dtype or device (or
        its source is gone), or a Python value the function reaches changed (:class:`Guard`):
        then the program must be traced again, and ``why`` says why."""
        for guard in self.guards:
            changed = guard.changed(self.roots)
            if changed is not None:
                step, self.why = changed
                self.expected = step == ("attr", "training")
                return None
        for src, held, value in self.value_reads:
            try:
                t = held if src is None else src.resolve(self.roots)
                same = isinstance(t, torch.Tensor) and (
                    t.tolist() == value if isinstance(value, list) else t.numel() == 1 and t.item() == value)
            except (AttributeError, KeyError, IndexError, ValueError, TypeError):
                same = False
            if not same:
                self.why = "a tensor whose values it reads (.item(), float(), int(), .tolist()) changed"
                self.expected = False
                return None
        if not self.metas:
            return []
        out = []
        for src, meta, held in zip(self.sources, self.metas, self.held):
            if isinstance(held, FakeTensor) and get_proxy_mode() is not self.trace:
                # a value of the trace that built this program (an operator called inside a
                # traced loss, reading it through an object hoad does not follow): it belongs to
                # that trace alone, so a call in another trace builds again
                self.why, self.expected = "it held a value of an earlier trace", True
                return None
            if held is not None:
                t = held
            else:
                try:
                    t = src.resolve(self.roots)
                except (AttributeError, KeyError, IndexError, ValueError, TypeError):
                    t = None
            if not isinstance(t, torch.Tensor) or _meta(t) != meta:
                self.why = "a tensor it reads changed its shape, dtype, device or layout (or is gone)"
                self.expected = True
                return None
            out.append(t)
        return out

    def result(self, tensors, free) -> Derivatives:
        if self.written and get_proxy_mode() is None:
            _check_written_aliases(list(tensors) + list(free or ()), self.written,
                                   list(self.build.layout.names) + [f"c{i}" for i in range(len(free or ()))])
        if not all(t.is_contiguous() for t in tensors):
            # the program was traced on dense copies of the call's tensors (free ones keep their
            # strides: read_free), and it relies on them: a reshape traced as a view, an Inductor
            # program's stride assertions. A transposed, step-sliced, expanded or channels_last
            # argument is copied dense first (it was torch's "view size is not compatible" under eager)
            tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        tensors = list(tensors) + list(free) if free else tensors
        if self.build.captured.strided:
            _check_own_storage(tensors, list(self.build.layout.names) + [f"c{i}" for i in range(len(free or ()))])
        try:
            if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
                # the trace recorded autocast's casts (its signature says so): the program runs as recorded
                with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
                    outs = self._synchronized(tensors)
            else:
                outs = self._synchronized(tensors)
        except HoadError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure leaves hoad as a HoadError
            own = self._own_failure(tensors)
            if own is not None:
                raise ExecutionError(
                    f"{name_of(self.build.fn)} itself fails on these inputs ({type(own).__name__}: {first_line(own)}), "
                    f"so its derivative program does too ({type(e).__name__}: {first_line(e)}). Fix the inputs (an "
                    "index out of range, say) or the function; the program needs nothing else") from e
            raise ExecutionError(
                f"the derivative program of {name_of(self.build.fn)} failed while running ({type(e).__name__}: {e}), "
                "although the function itself runs on these inputs: this is a bug in hoad, please report it with "
                "the function") from e
        return self.spec.result(outs)

    def _synchronized(self, tensors) -> tuple:
        """The program's outputs, run inside the forward protocol of the DDP modules it reads
        (inside another trace, the outer program takes them over)."""
        if not self.ddp:
            return self._run(tensors)
        if get_proxy_mode() is not None:
            record_nested([d for d, _always in self.ddp])
            return self._run(tensors)
        active = [d for d, always in self.ddp if always or torch.is_grad_enabled()]
        return synchronized(active, lambda: self._run(tensors))

    def _own_failure(self, tensors) -> Exception | None:
        """What the traced function raises on these inputs (run eagerly, without gradients, its
        small buffers restored), or None when it runs: tells a failure of the user's own code
        from one of hoad's program."""
        if get_proxy_mode() is not None:
            return None
        try:
            with torch.no_grad(), untouched(self.roots):
                self.build.layout.flat(self.build.fn)(*tensors[:self.n_user])
        except HoadError:
            return None
        except Exception as e:  # noqa: BLE001 - the user's own error, reported with hoad's
            return e
        return None

    def _run(self, tensors) -> tuple:
        if get_proxy_mode() is not None:  # called inside another trace: its ops join that program
            return self._traced(tensors)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        blind = [op for op in self.user_ops if not has_autograd(op)] if training else []
        if blind:
            raise InvalidArgumentError(
                f"a tensor the results depend on requires grad, but {blind[0]} has no autograd formula hoad can "
                "give it (hoad.register_rule gives none), and hoad's program runs it: gradients through the results "
                "would be wrong. Register one with torch.library.register_autograd, or call under torch.no_grad() "
                "when no gradient is wanted")
        if self.trainable is not None and training:
            return self.trainable(*tensors)
        return self.run(*tensors)

    def _traced(self, tensors) -> tuple:
        """The eager program on traced values, its prefix recomputed (cached prefix values would
        be constants of the outer program, stale once the weights change)."""
        b = self.build
        if b.prefix is None:
            return b.main(*tensors)
        return b.main(*tensors, *b.prefix.run(*[tensors[b.prefix.first_free + i] for i in b.prefix.reads]))


def _check_written_aliases(tensors, written: set, names) -> None:
    """The program traced each input on storage of its own: a function that writes into one
    input, called with another input sharing its memory (f(x, x) with y.mul_(2)), reads the
    other as it was, where torch reads the write. Refused rather than answered wrongly."""
    def span(t):  # (storage, first byte, byte past the last) of a tensor's entries
        if not isinstance(t, torch.Tensor) or not t.numel():
            return None
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
        lo = t.storage_offset() * t.element_size()
        return t.untyped_storage().data_ptr(), lo, lo + (last + 1) * t.element_size()

    spans = [span(t) for t in tensors]
    for i in written:
        for j, other in enumerate(spans):
            if j != i and other is not None and spans[i] is not None and other[0] == spans[i][0] \
                    and other[1] < spans[i][2] and spans[i][1] < other[2]:
                raise InvalidArgumentError(
                    f"the function writes into input {names[i]!r} in place, and input {names[j]!r} shares its memory "
                    "(the same tensor, or a view of it); hoad's program reads each input as a tensor of its own, so "
                    f"{names[j]!r} would not see the write. Pass a copy (x.clone()) for one of them")


def _check_own_storage(tensors, names) -> None:
    """A function that calls as_strided reads storage: its program assumes every input is a
    contiguous tensor owning its storage (as traced). A view into a larger storage would be read
    differently by torch, so it is refused rather than answered wrongly."""
    for t, name in zip(tensors, names):
        if get_proxy_mode() is None and isinstance(t, torch.Tensor) and (
                t.storage_offset() != 0 or not t.is_contiguous()
                or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            raise InvalidArgumentError(
                f"the function calls as_strided, which reads a tensor's storage, and input {name!r} is a view into a "
                f"larger storage (offset {t.storage_offset()}, strides {tuple(t.stride())}); hoad's program reads its "
                "inputs as tensors of their own. Pass a copy (x.clone() or x.contiguous()), or avoid as_strided")


def _is_nested(key) -> bool:
    return isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and key[0] == "nested"


def _meta(t: torch.Tensor) -> tuple:
    """What a program assumes of a free tensor, its layout too: traced views and strided reads of
    it rely on it (and an Inductor program asserts its strides)."""
    return t.shape, t.dtype, t.device, t.stride(), t.storage_offset()


def _what_changed(key, keys: list) -> str:
    """What sets ``key`` apart from the nearest cached key with the same arguments (a module's
    train/eval switch, its trainable parameters, the default dtype or autocast), or "" where no
    cached key has them."""
    def full(k) -> bool:  # (treedef, leaves, extra, ambient); a call of plain tensors keys by them alone
        return isinstance(k, tuple) and len(k) == 4 and isinstance(k[0], pytree.TreeSpec)

    if not full(key):
        return ""
    alike = [k for k in keys if full(k) and _same_key(k[:2], key[:2])]
    n = sum(isinstance(v, bool) for v in key[2])  # (the training flags, then wrt's names)
    if any(k[3] == key[3] and k[2][:n] == key[2][:n] for k in alike) and len(key[2]) > n:
        return "a change of which parameters require grad (wrt=hoad.parameters)"
    if any(k[3] == key[3] and k[2] != key[2] for k in alike):
        return "a switch of the module between train() and eval()"
    return "a change of the default dtype or of autocast" if any(k[3] != key[3] for k in alike) else ""


def _shown_leaf(leaf_key) -> str:
    """A leaf's key (:func:`_leaf_key`) as a user reads it: ``0.5``, ``tensor (3, 4) float32``."""
    if leaf_key[0] == "T":
        _, shape, dtype, device = leaf_key
        return f"tensor {tuple(shape)} {str(dtype).removeprefix('torch.')}" + (f" on {device}" if device.type != "cpu" else "")
    return repr(leaf_key[2]) if leaf_key[2] != "nan" else "nan"


def _same_key(a, b) -> bool:
    """Equal keys; False where comparing them raises (a frozen dataclass of tensors, say)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - what a user's __eq__ raises: not the same
        return False


def _ambient() -> tuple:
    """Process-wide settings that change what a traced function computes, so part of a call's
    signature: the default dtype (``torch.zeros(3)``) and autocast (which the trace bakes in)."""
    return (torch.get_default_dtype(), torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"))


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A concrete tensor like a traced one (a program is traced in fake mode: values never matter)."""
    return torch.zeros(tuple(t.shape), dtype=t.dtype, device=t.device)


def _leaf_key(leaf) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return ("T", tuple(leaf.shape), leaf.dtype, leaf.device)
    try:
        hash(leaf)
    except TypeError:
        raise InvalidArgumentError(
            f"a non-tensor argument of type {type(leaf).__name__} is not hashable; hoad caches programs by "
            "the values of non-tensor arguments, so pass it as a tensor or as a hashable value") from None
    if isinstance(leaf, float) and leaf != leaf:  # (NaN equals no NaN: each call built a new program)
        return ("S", float, "nan")
    return ("S", type(leaf), leaf)
