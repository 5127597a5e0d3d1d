"""The compiled callable: a call's key, its program from the cache or a new build, the run."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch._dynamo
import torch.utils._pytree as pytree
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes

from hoad.algebra import Target
from hoad.binding import (
    CallLayout,
    Keyword,
    Positional,
    StateEntry,
    _reachable,
    at_or_under,
    bind_layout,
    holder_of,
    positional_names,
)
from hoad.cache import (
    Entry,
    Family,
    ambient,
    arguments_changed,
    floats_changed,
    is_nested,
    leaf_key,
    note_a_new_object,
    stand_in,
    what_changed,
)
from hoad.chunking import joined, split
from hoad.derivatives import Derivatives, each_output
from hoad.distributed import LocalCall, data_parallel_wrappers, enlist, fully_sharded, gathered, has_dtensors
from hoad.errors import CaptureError, InvalidArgumentError, first_line
from hoad.methods import Rebuilt, bind_per_instance, in_class_body, tied_names, var_positional
from hoad.numbers import Refused, number_tensor, watching
from hoad.options import GRAPH_BREAK, MAX_PROGRAMS, check_options, default_backend, parameters, plain_ints, wrt_entries
from hoad.pipeline import Config, OperatorSpec, Sized, build, name_of
from hoad.printing import ProgramView
from hoad.rules import EDITS
from hoad.tiers import BUILDS

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Call:
    """A call as its program sees it (:meth:`Compiled._key`): the arguments with the float
    arguments traced as inputs (``floats``, leaf positions) as 0-d tensors, the pytree leaves
    (a module's state first), the cache key and the config to build with."""

    args: tuple
    kwargs: dict
    leaves: list
    treedef: pytree.TreeSpec
    extra: tuple
    key: Hashable
    config: Config
    floats: tuple[int, ...] = ()


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
        order, wrt, batch_dim, chunk_size = plain_ints(order, wrt, batch_dim, chunk_size)
        check_options(order, wrt, backend, mode, batch_dim, diagonal, chunk_size, memory_budget, split_blocks)
        if module is None and isinstance(fn, torch.nn.Module):
            module, fn = fn, type(fn).forward
        elif module is None and inspect.ismethod(fn) and isinstance(fn.__self__, torch.nn.Module):
            module, fn = fn.__self__, fn.__func__
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.module = module
        self.order = order
        self.wrt = wrt_entries(wrt)
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
        self._cache: dict[Hashable, Entry] = {}
        self._families: dict[Hashable, Family] = {}
        # programs by key and the Python values they were traced with (Guard), kept when those
        # values change so that changing them back (net.eval(), then net.train()) traces nothing
        self._twins: dict[tuple, Entry] = {}
        self._sample_leaves: dict[Hashable, tuple[list[int], int]] = {}
        # float arguments traced as program inputs, by call structure (hoad.numbers), and those
        # that stay constants, with the reason the trace gave
        self._numbers: dict[pytree.TreeSpec, frozenset[int]] = {}
        self._constants: dict[tuple[pytree.TreeSpec, int], str] = {}
        self._edits = EDITS[0]    # the rule registrations the cached programs were built with
        self._last: Entry | None = None
        self._sharded: list | None = None  # FSDP2 states the function reaches (hoad.distributed.gathered)
        # (args, kwargs) -> the places of a call's other tensors that hold samples, split with the wrt
        # inputs by chunk_size (an operator's points and seeds: hoad.directions.PerPoint)
        self.sample_places: Callable[[tuple, dict], list] | None = None

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
            return each_output(self(*local.args, **local.kwargs), lambda r: r.mapped(local.wrap))
        sharded = self._fully_sharded()
        if sharded is not None and get_proxy_mode() is None:
            # in a process group: FSDP's forward protocol around the call (hoad.distributed), for the
            # sharded modules known, and for any a build finds (a model sharded after the first call)
            with gathered(sharded):
                return self._unsharded_call(args, kwargs)
        return self._unsharded_call(args, kwargs)

    def _fully_sharded(self) -> list | None:
        """The FSDP2 states of the modules the function reaches (found at the first call in a
        process group; a build finds any sharded later), or None outside a process group."""
        if self._sharded is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            self._sharded = fully_sharded(itertools.chain([self.module] if self.module is not None else [],
                                                          _reachable(self._roots())))
        return self._sharded

    def _unsharded_call(self, args: tuple, kwargs: dict) -> Derivatives:
        n = self.config.chunk_size
        if n is not None and get_proxy_mode() is None:
            chunks = split(self, n, args, kwargs)
            if chunks is not None:
                return joined(self, chunks).per_output()
        return self._call(*args, **kwargs).per_output()

    def _call(self, *args, **kwargs) -> Derivatives:
        return self._call_entry(*args, **kwargs)[0]

    def _call_entry(self, *args, **kwargs) -> tuple[Derivatives, Entry]:
        """The call's results and the program that computed them: key -> cache -> build -> run."""
        nested = self._check_call(args, kwargs)
        transformed = torch._C._functorch.peek_interpreter_stack() is not None  # under torch.func.grad, vmap
        if not nested and not transformed:
            hit = self._fast_hit(args, kwargs)
            if hit is not None:
                return hit
        call = self._key(args, kwargs, nested, transformed)
        entry = self._cache.get(call.key)
        tensors = [leaf for leaf in call.leaves if isinstance(leaf, torch.Tensor)]
        free = entry.read_free(tensors) if entry is not None else None
        if free is None:
            with BUILDS:  # (threads that called at once with other values: the first value's program
                # makes the next one trace the float as an input, and the rest find that program)
                call = self._key(args, kwargs, nested, transformed)
                lifted = self._lift_changed_floats(call) if not nested and not transformed else ""
                if lifted:
                    call = self._key(args, kwargs, nested, transformed)  # the changed floats now as inputs
                entry, free, call = self._build_lifting(call, args, kwargs, nested, transformed, lifted)
                tensors = [leaf for leaf in call.leaves if isinstance(leaf, torch.Tensor)]
        if not nested:
            self._last = entry
        return entry.result(tensors, free), entry

    def _check_call(self, args: tuple, kwargs: dict) -> bool:
        """Refuse what no program takes, drop the programs built before a rule was registered or
        removed; whether the call is inside another hoad program's trace."""
        if self._method:
            raise InvalidArgumentError(
                f"{getattr(self.fn, '__name__', 'this function')} takes `self`: decorate a method of a class and "
                "call it on an instance (m.method(x)), or pass a bound method or a module to hoad.compile")
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
        return get_proxy_mode() is not None  # inside another hoad.compile's trace

    def _fast_hit(self, args: tuple, kwargs: dict) -> tuple[Derivatives, Entry] | None:
        """A call of tensors only whose program is cached and current, keyed without a pytree
        (~20 us per call less): keyword tensors are leaves after the positional ones in the
        order given, as pytree flattens them."""
        key = self._tensor_key(args, kwargs)
        if key is None:
            return None
        entry = self._cache.get(key)
        tensors = list(args) + list(kwargs.values()) if kwargs else args
        free = entry.read_free(tensors) if entry is not None else None
        if free is None:
            return None
        self._last = entry
        return entry.result(tensors, free), entry

    def _tensor_key(self, args: tuple, kwargs: dict) -> tuple | None:
        """The key of a call of tensors only, without a pytree; None for any other call."""
        if self.module is not None or not all(type(a) is torch.Tensor for a in args) or \
                not all(type(v) is torch.Tensor for v in kwargs.values()):
            return None
        key = tuple((a.shape, a.dtype, a.device) for a in args) + (ambient(),)
        if kwargs:
            key += tuple((name, v.shape, v.dtype, v.device) for name, v in kwargs.items())
        return key

    def _key(self, args: tuple, kwargs: dict, nested: bool, transformed: bool) -> Call:
        """The call as the program sees it: its leaves (the module's state first; the float
        arguments traced as inputs as 0-d tensors), its cache key and the config to build it with."""
        extra: tuple = ()
        if self.module is not None:
            args = (self._state(),) + args
            extra = tuple(m.training for m in self.module.modules())
            if any(w is parameters for w in self.wrt):  # a parameter frozen or unfrozen changes the blocks
                extra += (self._expanded_wrt(),)
        leaves, treedef = pytree.tree_flatten((args, kwargs))
        floats = tuple(i for i in sorted(self._numbers.get(treedef, ())) if type(leaves[i]) is float)
        if floats:
            device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)), None)
            for i in floats:
                leaves[i] = number_tensor(leaves[i], device)
            args, kwargs = pytree.tree_unflatten(leaves, treedef)
            extra += (("floats as inputs", floats),)
        key = None if nested or transformed else self._tensor_key(args, kwargs)  # (as _fast_hit keys it)
        if key is None:
            key = (treedef, tuple(leaf_key(leaf) for leaf in leaves), extra, ambient())
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
        return Call(args, kwargs, leaves, treedef, extra, key, config, floats)

    def _lift_changed_floats(self, call: Call) -> str:
        """Where this call differs from a cached one only in the values of float arguments not yet
        traced as inputs, those become inputs (the next trace hands the function a
        :class:`~hoad.numbers.TracedFloat` for each), unless a trace refused one before: the
        changes, as ``k=0.7 (was 0.5); compiling program 2 with it as program input, ...``; else ""."""
        changed = floats_changed(list(self._cache), call.key, {i for t, i in self._constants if t == call.treedef})
        if not changed:
            return ""
        self._numbers[call.treedef] = self._numbers.get(call.treedef, frozenset()) | frozenset(changed)
        said = arguments_changed(self, call.key, call.args, call.kwargs, advice=False)
        one = len(changed) == 1
        return (f"{said}; compiling program {len(self._cache) + 1} with {'it' if one else 'them'} as program "
                f"input{'' if one else 's'}, so that other values compile nothing")

    def _build_lifting(self, call: Call, args: tuple, kwargs: dict, nested: bool, transformed: bool,
                       lifted: str = "") -> tuple[Entry, list, Call]:
        """:meth:`_build` for ``call`` (``lifted``: the float arguments just made inputs, as
        changed, and the program it builds). Where floats are traced as inputs and the trace
        refuses one (the function needs its value in Python), they stay constants from then on,
        with the reason kept for the warning, and the call is built with them baked in. Returns
        the program, the free tensors it reads now and the call it was built for."""
        if not call.floats:
            return (*self._build(call, nested), call)
        note = f"hoad: {getattr(self.fn, '__name__', 'function')} called with {lifted}" if lifted else None
        with watching() as refusals:
            try:
                entry, free = self._build(call, nested, note)
                if not refusals:
                    return entry, free, call
                with BUILDS:  # refused, and the refusal caught by the function: the program is void
                    self._forget(entry, why=False)
                    for k in [k for k, e in self._twins.items() if e is entry]:
                        del self._twins[k]
            except (Refused, Exception) as e:  # noqa: BLE001 - any failure: the floats go back to constants
                if not refusals:
                    refusals.append(f"its trace failed with them as inputs ({type(e).__name__}: {first_line(e)})")
        for i in call.floats:
            self._constants[(call.treedef, i)] = refusals[0]
        self._numbers[call.treedef] = self._numbers[call.treedef] - frozenset(call.floats)
        call = self._key(args, kwargs, nested, transformed)
        return (*self._build(call, nested), call)

    def _build(self, call: Call, nested: bool, note: str | None = None) -> tuple[Entry, list]:
        """The program for ``call`` and the free tensors it reads now, under :data:`BUILDS`: one
        another thread built meanwhile, a twin built for these Python values, the program of the
        call's family (every number of samples), or a new build (``note``: what to log for it)."""
        key, args, kwargs, leaves, treedef, extra, config = (call.key, call.args, call.kwargs, call.leaves,
                                                             call.treedef, call.extra, call.config)
        with BUILDS:  # one build at a time (make_fx and Inductor keep process-wide state)
            entry = self._cache.get(key)  # another thread may have built it meanwhile
            tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
            free = entry.read_free(tensors) if entry is not None else None
            if free is not None:
                return entry, free
            if entry is not None:
                twin = self._twins.get((key, entry.values_now()))
                free = twin.read_free(tensors) if twin is not None else None
                if free is not None:  # built before for these Python values (train/eval, say)
                    self._cache[key] = twin
                    return twin, free
                self._forget(entry)
            family = None if nested or config.batch_dim is None else self._family(treedef, leaves, extra)
            entry = family.entry if family is not None and family.entry is not None else None
            if entry is not None:  # one program for every number of samples
                entry.check_samples(family.samples(leaves))
                self._keep(key, entry)
            else:
                if family is not None and family.first is not None and family.tried is None:
                    config = dataclasses.replace(config, sized=family.first)
                entry = self._new_signature(key, args, kwargs, config, nested,
                                            family.tried if family is not None else None, note)
                if not nested and config.batch_dim is not None:
                    self._remember(treedef, leaves, extra, entry, config.sized is not None)
            self._twins[(key, entry.values)] = entry
            while len(self._twins) > MAX_PROGRAMS:
                del self._twins[next(iter(self._twins))]
            free = entry.read_free(tensors)
            if free is None:
                raise InvalidArgumentError(
                    f"{name_of(self.fn)}: {entry.why} between the trace and the check that follows it: "
                    "the program keeps what the trace read, and a value that is not the same at two reads "
                    "in a row (a property computed anew at each read, a counter, another thread's writes) "
                    "cannot be checked at later calls. Keep such a value in a tensor (read afresh at "
                    "every call) or compute it once before the first call")
            return entry, free

    def _new_signature(self, key, args: tuple, kwargs: dict, config: Config, nested: bool,
                       per_count: str | None = None, note: str | None = None) -> Entry:
        """Compile for a signature not seen before, keeping at most MAX_PROGRAMS (least recent out).
        ``per_count``: why this function's program depends on its number of samples, if it does;
        ``note``: what to log instead of the reason found here."""
        name = getattr(self.fn, "__name__", "function")
        if note is not None:
            log.info("%s", note)
        elif config.sized is not None:
            log.info("hoad: %s called with another number of samples; building one program for every number",
                     name)
        elif per_count is not None:
            level = logging.WARNING if self.config.backend == "inductor" else logging.INFO
            log.log(level, "hoad: %s called with another number of samples; compiling program %d for it, since its "
                           "program depends on the number of samples (%s)", name, len(self._cache) + 1, per_count)
        elif not nested and any(not is_nested(k) for k in self._cache):
            level = logging.WARNING if self.config.backend == "inductor" else logging.INFO
            why = what_changed(key, [k for k in self._cache if not is_nested(k)])
            changed = "" if why else arguments_changed(self, key, args, kwargs)
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
                args, kwargs = pytree.tree_map_only(torch.Tensor, stand_in, (args, kwargs))
                entry = self._compile(args, kwargs, config)
            if nested:
                entry.trace = get_proxy_mode()
        else:
            entry = self._compile(args, kwargs, config)
        if not self._cache and not nested:
            note_a_new_object(self, key, entry)
        self._keep(key, entry)
        return entry

    def _forget(self, entry: Entry, why: bool = True) -> None:
        """Drop a program whose free tensors or Python values changed (every key it serves, and
        the sample-count families, which may hold it or a graph traced with the old values);
        ``why``: say so (a program voided for another reason is said where it is voided)."""
        name = getattr(self.fn, "__name__", "the function")
        if why and entry.expected:
            log.info("hoad: %s: %s; tracing it again", name, entry.why)
        elif why:
            log.warning("hoad: %s was traced with Python values it may read, and %s; tracing it again (keep values "
                        "that change between calls in tensors: a tensor is read afresh at every call)", name, entry.why)
        for key in [k for k, e in self._cache.items() if e is entry]:
            del self._cache[key]
        self._families.clear()

    def _keep(self, key, entry: Entry) -> None:
        if len(self._cache) >= MAX_PROGRAMS:
            oldest = next(iter(self._cache))
            dropped = self._cache.pop(oldest)
            if not any(f.entry is dropped for f in self._families.values()):  # (else a size's shortcut)
                log.warning("hoad: %s keeps at most %d programs; dropped the least recently compiled one",
                            getattr(self.fn, "__name__", "function"), MAX_PROGRAMS)
        self._cache[key] = entry

    # ----------------------------------------------------------------- every number of samples
    def _family(self, treedef, leaves: list, extra) -> Family | None:
        """The calls that differ from this one only in the number of samples (dim 0 of every input
        that holds them, all equal: see ``Build.sample_leaves``), or None when this call has none or
        fewer than 2 samples."""
        known = self._sample_leaves.get((treedef, extra))
        if known is None:
            return None
        rows, lead = known
        counts = {leaves[i].shape[0] if isinstance(leaves[i], torch.Tensor) and leaves[i].ndim else None
                  for i in rows[:lead]}
        if len(counts) != 1 or None in counts or next(iter(counts)) < 2:
            return None
        # the other tensors that had a row per sample (labels) count as such where they still do; one
        # whose dim 0 matched the first count by chance keys its own families at other counts
        count = next(iter(counts))
        rows = rows[:lead] + [i for i in rows[lead:] if isinstance(leaves[i], torch.Tensor) and leaves[i].ndim
                              and leaves[i].shape[0] == count]
        fkey = (treedef, tuple((None,) + tuple(leaf.shape[1:]) + (leaf.dtype, leaf.device) if i in rows
                               else leaf_key(leaf) for i, leaf in enumerate(leaves)), extra)
        return self._families.setdefault(fkey, Family(rows))

    def _remember(self, treedef, leaves: list, extra, entry: Entry, tried: bool) -> None:
        """After a build: the leaves that hold the samples in this call structure, and the family's
        program."""
        self._sample_leaves.setdefault((treedef, extra), (list(entry.build.sample_leaves), entry.build.sample_wrt))
        family = self._family(treedef, leaves, extra)
        if family is None:
            return
        if entry.build.stats.get("any_samples"):
            family.entry = entry
            log.info("hoad: %s: one program now serves every number of samples",
                     getattr(self.fn, "__name__", "function"))
        elif tried:  # the structure depends on the number of samples: one program per count
            family.tried = entry.build.stats.get("samples_differ") or "its builds for two counts differ"
            log.log(logging.WARNING if self.config.backend == "inductor" else logging.INFO,
                    "hoad: %s: no one program serves every number of samples, since %s; each count is compiled on "
                    "its own", getattr(self.fn, "__name__", "function"), family.tried)
        elif family.first is None:
            family.first = Sized.of(entry.build)

    def _compile(self, args: tuple, kwargs: dict, config: Config) -> Entry:
        stateful = self.module is not None
        target = self._stateful if stateful else self.fn
        layout, tensors = bind_layout(target, args, kwargs, state=stateful, names=self._positional)
        user_args = args[1:] if stateful else args
        wrt, inside = self._expanded_containers(self._expanded_wrt(), args, kwargs, stateful)
        wrt_leaves = [inside[w] if isinstance(w, str) and w in inside
                      else self._resolve_wrt(w, layout, user_args, kwargs) for w in wrt]
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
        log.info("hoad: compiling %s at order %d for a new signature", getattr(self.fn, "__name__", "function"),
                 self.order)
        roots = self._roots()
        # (ddp_model.module.method(x): DDP's protocol while training; FSDP2 states gathered before the trace)
        wrappers, sharded = data_parallel_wrappers(itertools.chain([self.module] if self.module is not None else [],
                                                                   _reachable(roots)))
        if sharded and get_proxy_mode() is None:
            known = self._sharded or []
            new = [(s, m) for s, m in sharded if all(s is not k for k, _m in known)]
            enlist(new)
            self._sharded = known + new
        b = build(target, layout, tensors, wrt_leaves, config, roots=roots)
        entry = Entry(b, wrt, self._aliases(wrt, layout, wrt_leaves), roots)
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
        state = (dict(self.module.named_parameters()) | dict(self.module.named_buffers())
                 if self.module is not None else {})
        for w in self.wrt:
            if isinstance(w, int) and w >= len(self._positional) and not var_positional:
                raise InvalidArgumentError(
                    f"wrt={w} but {getattr(self.fn, '__name__', 'the function')} takes {len(self._positional)} "
                    f"positional arguments {tuple(self._positional)}")
            if isinstance(w, str) and w not in params and w not in state and not var_keyword and \
                    holder_of(w, list(params)) is None:
                tied = tied_names(self.module).get(w) if self.module is not None else None
                if tied is not None:
                    raise InvalidArgumentError(
                        f"wrt names {w!r}, which is the same parameter as {tied!r} (tied weights): the module lists "
                        f"it once, as {tied!r}; name that, and its derivatives cover every use")
                bound = list(params)[:1] if self.module is not None else []  # (the module itself)
                known = tuple(n for n in params if n not in bound and not n.startswith("hoad_")) + tuple(state)
                nor = " nor a parameter or buffer of the module" if self.module is not None else ""
                raise InvalidArgumentError(f"wrt names {w!r}, which is not an argument of the function{nor}; "
                                           f"valid names are {known}")

    def _expanded_containers(self, wrt: tuple, args: tuple, kwargs: dict, stateful: bool) -> tuple[tuple, dict]:
        """wrt with each entry that names a tuple, list or dict argument, or a path inside one (a
        leaf, ``"batch['u']"``, or a subtree, ``"batch['w']"``), replaced by the tensors there, each
        named by its path (``"batch['u']"``, ``"pair[0]"``), and the tensor-leaf index of each such path."""
        flat = pytree.tree_flatten_with_path((args, kwargs))[0]
        tensor_paths = [path for path, leaf in flat if isinstance(leaf, torch.Tensor)]
        user_args = args[1:] if stateful else args
        out, inside = [], {}
        for w in wrt:
            if isinstance(w, int) and w < len(user_args):
                prefix, value, name = (pytree.SequenceKey(0), pytree.SequenceKey(w + stateful)), user_args[w], \
                    (self._positional[w] if w < len(self._positional) else f"arg{w}")
            elif isinstance(w, str) and w in kwargs:
                prefix, value, name = (pytree.SequenceKey(1), pytree.MappingKey(w)), kwargs[w], w
            elif isinstance(w, str) and w in self._positional and self._positional.index(w) < len(user_args):
                i = self._positional.index(w)
                prefix, value, name = (pytree.SequenceKey(0), pytree.SequenceKey(i + stateful)), user_args[i], w
            elif isinstance(w, str) and (holder := self._container_holding(w, user_args, kwargs, stateful)):
                # a path inside a container argument ("batch['u']", "params['layer1']"): the tensors at or under it
                name, prefix = holder
                keys = [(leaf, name + pytree.keystr(path[2:])) for leaf, path in enumerate(tensor_paths)
                        if path[:2] == prefix]
                under = [(leaf, key) for leaf, key in keys if at_or_under(key, w)]
                held = [leaf for path, leaf in flat if path[:2] == prefix and name + pytree.keystr(path[2:]) == w]
                if not under and held:
                    raise InvalidArgumentError(
                        f"wrt names {w!r}, which holds {held[0]!r} ({type(held[0]).__name__}), not a tensor: pass it "
                        f"as a tensor (torch.tensor({held[0]!r}, dtype=torch.float64)) to differentiate with respect "
                        "to it")
                if not under:
                    raise InvalidArgumentError(
                        f"wrt names {w!r}, which holds no tensor of argument {name!r}; the tensors in it are "
                        f"{[key for _, key in keys] or 'none'}: name one of them, or a container holding some")
                for leaf, key in under:
                    inside[key] = leaf
                    out.append(key)
                continue
            else:
                out.append(w)
                continue
            if isinstance(value, torch.Tensor) or not isinstance(value, (tuple, list, dict)):
                out.append(w)
                continue
            for leaf, path in enumerate(tensor_paths):
                if path[:2] == prefix:
                    key = name + pytree.keystr(path[2:])
                    inside[key] = leaf
                    out.append(key)
            if not any(path[:2] == prefix for path in tensor_paths):
                raise InvalidArgumentError(f"wrt input {w!r} is a {type(value).__name__} holding no tensor; hoad "
                                           "differentiates with respect to tensors")
        return tuple(out), inside

    def _container_holding(self, w: str, args: tuple, kwargs: dict, stateful: bool) -> tuple | None:
        """(its name, its path among the call's leaves) of the container argument (tuple, list, dict)
        that wrt entry ``w`` addresses a path inside, or None (``args`` without the state)."""
        name = holder_of(w, list(self._positional) + list(kwargs))
        if name is None:
            return None
        if name in kwargs:
            prefix, value = (pytree.SequenceKey(1), pytree.MappingKey(name)), kwargs[name]
        elif self._positional.index(name) < len(args):
            i = self._positional.index(name)
            prefix, value = (pytree.SequenceKey(0), pytree.SequenceKey(i + stateful)), args[i]
        else:
            return None
        return (name, prefix) if isinstance(value, (tuple, list, dict)) else None

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
        elif var_positional(self.fn) == w:
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
            if place is None:  # (a tensor inside a container argument: named by its path alone)
                continue
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
