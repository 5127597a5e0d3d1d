"""How a call binds: its tensor leaves and their names, and where the tensors a function reaches
without receiving them come from, so that every call reads them afresh.

**Call binding.** A call's arguments flatten (pytree) into tensor leaves, the program's inputs,
and the static rest, which belongs to the call signature the compiled function caches on
(:func:`bind_layout`, :class:`CallLayout`). A leaf that is itself an argument has a
:class:`Place`: where wrt entries and result keys point.

**Free tensors.**
A function closes over tensors (``W = ...; f = lambda x: x @ W``), reads module globals, or calls
an ``nn.Module`` whose parameters and buffers it never receives as arguments. Tracing sees these
as constants. hoad makes each of them a program input instead and, at every call, reads it again
through its *source*: the chain of lookups (closure cell, global name, module attribute, …) that
reached it from the function. So an in-place update (an optimizer step) and a rebinding
(``W = W - lr * g``) are both seen, as under torch.compile.

A tensor whose source cannot be found (reached through an object hoad does not search) is held
by identity: in-place updates are still seen, a rebinding is not, and hoad warns once.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from hoad.distributed import is_data_parallel
from hoad.errors import CaptureError
from hoad.numbers import TracedFloat, is_number_tensor


@dataclass(frozen=True)
class Positional:
    """The call's positional argument ``index`` (after a module's state, for module methods)."""

    index: int


@dataclass(frozen=True)
class Keyword:
    """The call's keyword argument ``name``."""

    name: str


@dataclass(frozen=True)
class StateEntry:
    """The parameter or buffer ``name`` of a module's state (``named_parameters`` naming)."""

    name: str


Place = Positional | Keyword | StateEntry


@dataclass(frozen=True)
class CallLayout:
    """How one call's arguments flatten: the pytree, which leaves are tensors, the static rest."""

    treedef: pytree.TreeSpec
    tensor_slots: tuple[int, ...]
    static: tuple
    names: tuple[str, ...]           # a readable name per tensor leaf
    places: tuple[Place | None, ...]  # per tensor leaf: the argument it is, if it is one itself (not nested)
    numbers: tuple[int, ...] = ()     # tensor leaves that stand for float arguments (hoad.numbers)

    def leaf(self, place: Place) -> int | None:
        """The tensor-leaf index of an argument, or None if the call has no such tensor leaf."""
        return self.places.index(place) if place in self.places else None

    def flat(self, fn: Callable) -> Callable:
        """``fn`` as a function of this call's tensor leaves alone (the rest is fixed)."""

        def flat_fn(*ts):
            leaves = list(self.static)
            for i, (slot, t) in enumerate(zip(self.tensor_slots, ts)):
                leaves[slot] = TracedFloat(t) if i in self.numbers else t
            args, kwargs = pytree.tree_unflatten(leaves, self.treedef)
            return fn(*args, **kwargs)

        return flat_fn


def bind_layout(fn: Callable, args: tuple, kwargs: dict, state: bool = False,
                names: Sequence[str] | None = None) -> tuple[CallLayout, list[torch.Tensor]]:
    """Flatten a call into tensor leaves and the static rest, with readable leaf names.

    With ``state``, ``args[0]`` is a module's {name: tensor} state: its leaves are named and
    addressed by parameter name, and positions count from ``args[1]``.
    """
    leaves_with_path, treedef = pytree.tree_flatten_with_path((args, kwargs))
    params = list(names) if names is not None else positional_names(fn)
    slots, leaf_names, static, tensors, places, numbers = [], [], [], [], [], []
    for i, (path, leaf) in enumerate(leaves_with_path):
        if isinstance(leaf, torch.Tensor):
            if is_number_tensor(leaf):
                numbers.append(len(tensors))
            slots.append(i)
            if state and path[0].idx == 0 and path[1].idx == 0:
                leaf_names.append(str(path[2].key))
                places.append(StateEntry(str(path[2].key)))
            else:
                if state and path[0].idx == 0:
                    path = (path[0], type(path[1])(path[1].idx - 1)) + tuple(path[2:])
                leaf_names.append(_leaf_name(path, params))
                places.append(_place(path))
            tensors.append(leaf)
            static.append(None)
        else:
            static.append(leaf)
    leaf_names = _unique([_identifier(n) for n in leaf_names])
    return CallLayout(treedef, tuple(slots), tuple(static), tuple(leaf_names), tuple(places), tuple(numbers)), tensors


def _place(path) -> Place | None:
    if len(path) != 2:
        return None
    return Positional(path[1].idx) if path[0].idx == 0 else Keyword(path[1].key)


def _leaf_name(path, params: list[str]) -> str:
    top, *rest = path
    parts = []
    if top.idx == 0:  # positional arguments
        i = rest[0].idx
        parts.append(params[i] if i < len(params) else f"arg{i}")
    else:
        parts.append(str(rest[0].key))
    for p in rest[1:]:
        parts.append(str(getattr(p, "idx", getattr(p, "key", getattr(p, "name", "")))))
    return "_".join(parts)


def holder_of(path: str, names: Sequence[str]) -> str | None:
    """The argument a name addresses a path inside (``"batch"`` for ``"batch['u']"``, and for
    ``"pair[0]"`` or ``"cfg.scale"``), or None when it names no path inside one of ``names``."""
    held = [n for n in names if isinstance(n, str) and len(path) > len(n) and path.startswith(n)
            and path[len(n)] in "[."]
    return max(held, key=len) if held else None


def at_or_under(key: str, path: str) -> bool:
    """Whether the tensor named ``key`` (its path) is at ``path`` or inside the container there."""
    return key == path or (key.startswith(path) and key[len(path)] in "[.")


def leaf_at(path: str, name: str, container):
    """The value at ``path`` (``name`` followed by keys) inside ``container``: a tensor or any other
    leaf; ``MISSING`` where nothing is there."""
    for keys, leaf in pytree.tree_flatten_with_path(container)[0]:
        if name + pytree.keystr(keys) == path:
            return leaf
    return MISSING


MISSING = object()  # leaf_at's answer for a path that holds nothing


def with_tensor_at(path: str, name: str, container, x: torch.Tensor):
    """``container`` with the tensor at ``path`` (``name`` followed by keys) replaced by ``x``."""
    return pytree.tree_map_with_path(lambda keys, leaf: x if name + pytree.keystr(keys) == path else leaf, container)


def positional_names(fn: Callable) -> list[str]:
    """Names of the parameters that positional arguments bind to, in order."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _identifier(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    if not out or out[0].isdigit():
        out = "t" + out
    return out


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if n in seen:
            seen[n] += 1
            out.append(f"{n}_{seen[n]}")
        else:
            seen[n] = 0
            out.append(n)
    return out


# ---------------------------------------------------------------------------- free tensors
# How far the search follows references from the function (function -> closure object ->
# attribute -> module -> parameter is depth 4), and how many entries of a container it looks at.
MAX_DEPTH = 6
MAX_ITEMS = 64

Step = tuple  # (kind, key)


@dataclass(frozen=True)
class Source:
    """A tensor's place: ``steps`` applied to the root object named ``root``."""

    root: str
    steps: tuple[Step, ...]

    def resolve(self, roots: dict) -> torch.Tensor:
        obj = roots[self.root]
        for step in self.steps:
            obj = _STEP[step[0]](obj, step[1])
        return obj

    @property
    def name(self) -> str:
        """A readable name: the global or closure variable and the attributes after it."""
        parts = [str(key) for kind, key in self.steps if kind in _NAMED]
        return ".".join(parts) or self.root


def _cell(fn, name):
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


_STEP: dict[str, Callable] = {
    "cell": _cell,
    "global": lambda fn, name: fn.__globals__[name],
    "default": lambda fn, i: fn.__defaults__[i],
    "kwdefault": lambda fn, name: fn.__kwdefaults__[name],
    "self": lambda m, _: m.__self__,
    "func": lambda m, _: m.__func__,
    "partial": lambda p, _: p.func,
    "partial_arg": lambda p, i: p.args[i],
    "partial_kw": lambda p, k: p.keywords[k],
    "param": lambda m, name: m._parameters[name],
    "buffer": lambda m, name: m._buffers[name],
    "module": lambda m, name: m._modules[name],
    "attr": getattr,
    "item": lambda c, k: c[k],
    "type": lambda o, _: type(o),
    "modules": lambda m, _: tuple(m._modules.keys()),
    "hooks": lambda m, _: _hooks(m),
    "len": lambda c, _: len(c),
}
_NAMED = {"cell", "global", "param", "buffer", "module", "attr", "item", "kwdefault", "partial_kw"}


def find_sources(roots: dict, tensors: Sequence[torch.Tensor]) -> list[Source | None]:
    """The source of each tensor (by identity) reachable from ``roots``, None where not found.

    Breadth-first, so the shortest chain wins (a parameter is found through its module, not
    through some other object that also holds the module).
    """
    return [paths[0] if paths else None for paths in _search(roots, tensors, every=False)]


def every_source(roots: dict, tensors: Sequence[torch.Tensor]) -> list[tuple[Source, ...]]:
    """Each tensor's sources, shortest first: every chain that reaches it (up to MAX_PATHS). A
    tensor held in two places (a module's parameter that a list, a closure or an operator holds
    too) is the same object only while both hold it: a call checks that they still do."""
    return _search(roots, tensors, every=True)


def aliases_of(free: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], wrt_leaves: Sequence[int]
               ) -> tuple[tuple[int, int], ...]:
    """The (free tensor, wrt placeholder) pairs of one tensor object: a free tensor that is one of
    the inputs differentiated (``wrt_leaves``: those a free tensor may be read as)."""
    if not wrt_leaves or not free:  # (a plain function's: every call, nothing to compare)
        return ()
    wrt = {id(tensors[j]): j for j in wrt_leaves}
    return tuple((i, wrt[id(t)]) for i, t in enumerate(free) if id(t) in wrt)


MAX_PATHS = 4  # of one tensor's sources that every_source keeps


def _search(roots: dict, tensors: Sequence[torch.Tensor], every: bool) -> list[tuple[Source, ...]]:
    wanted = {id(t): i for i, t in enumerate(tensors)}
    found: list[list[Source]] = [[] for _ in tensors]
    left = len(wanted)
    seen: set[int] = set()
    frontier = [(name, obj, ()) for name, obj in roots.items()]
    for _depth in range(MAX_DEPTH + 1):
        following = []
        for root, obj, steps in frontier:
            if isinstance(obj, torch.Tensor):  # (a tensor ends a chain: each chain to it counts)
                i = wanted.get(id(obj))
                if i is None and torch._is_functional_tensor(obj):
                    # a value of a trace in progress (a loss hoad.compile traces calls this
                    # function): the tensor the trace's functionalization wraps is the one seen
                    i = wanted.get(id(torch._from_functional_tensor(obj)))
                if i is not None and len(found[i]) < (MAX_PATHS if every else 1):
                    left -= not found[i]
                    found[i].append(Source(root, steps))
                continue
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            following += [(root, child, steps + (step,)) for step, child in _children(obj)]
        if (not left and not every) or not following:
            break
        frontier = following
    return [tuple(paths) for paths in found]


# -------------------------------------------- what the guards (hoad.guards) read from here
SCALARS = (bool, int, float, complex, str, type(None))


def _hooks(m: torch.nn.Module) -> tuple:
    """The forward hooks that run when ``m`` is called: its own and the global ones (a hook added
    or removed after a trace changes what the function computes)."""
    from torch.nn.modules import module as torch_module

    tables = (m._forward_pre_hooks, m._forward_hooks, torch_module._global_forward_pre_hooks,
              torch_module._global_forward_hooks)
    return tuple(tuple(t.values()) for t in tables)


@functools.lru_cache(maxsize=4096)
def _loads(code: types.CodeType) -> tuple[frozenset, frozenset]:
    """(attribute names, global names) the code and the code nested in it load."""
    attrs, globals_ = set(), set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"):
            attrs.add(ins.argval)
        elif ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            globals_.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            a, g = _loads(const)
            attrs |= a
            globals_ |= g
    return frozenset(attrs), frozenset(globals_)


@contextlib.contextmanager
def untouched(roots: dict):
    """Tensors reachable from ``roots`` as they were, after the block (a trace) ran; yields the
    list of :class:`Rebinding` s the block made, filled when it ends.

    Tracing runs the function's Python: an in-place update of a tensor it reaches (batch norm's
    ``num_batches_tracked.add_(1)`` in training mode) runs for real on that tensor, while the
    program replays the same write at every call: one update too many. Small tensors that are not
    parameters are copied first and written back if the trace changed them; a parameter or a large
    tensor changed by the trace is refused.

    A tensor the trace stores on an object (``self.ema = ...``, a hook's ``features[name] = out``,
    spectral norm's ``self._u = normalize(..., out=self._u)``, a memo a class or a user's module
    keeps, :func:`_shared_memos`) is one of the trace's stand-ins: the object gets its old value
    back, and the caller decides what the store means. A ``functools.lru_cache`` the trace filled
    is emptied (its entries cannot be put back one by one)."""
    tensors: dict[int, torch.Tensor] = {}
    for obj in _reachable(roots):
        if isinstance(obj, torch.nn.parameter.UninitializedTensorMixin):
            raise CaptureError("the function uses a lazy module (nn.LazyLinear, say) whose parameters are not "
                               "initialized yet; call it once on an example batch before hoad traces it")
        if isinstance(obj, torch.Tensor) and not obj.is_inference():
            tensors.setdefault(id(obj), obj)
    reached = list(_reachable(roots, into_hoad=False))
    reached += [held for obj in reached for held in _shared_memos(obj)]  # (a class's or a module's memo)
    tables = {id(table): (obj, table) for obj in reached for table in _tables(obj)}
    holders = [(obj, table, table.copy()) for obj, table in tables.values()]
    caches = {id(c): (c, c.cache_info().misses) for c in reached if isinstance(c, functools._lru_cache_wrapper)}
    before = [(t, t._version, t.detach().clone() if _copied(t) else None) for t in tensors.values()]
    rebound: list[Rebinding] = []
    try:
        yield rebound
    finally:
        lost = []
        for t, version, copy in before:
            if t._version != version:
                if copy is None:
                    lost.append(t)
                else:
                    with torch.no_grad():
                        t.copy_(copy)
        for obj, table, old in holders:
            rebound += _restore_stores(obj, table, old)
        for cache, misses in caches.values():
            # a functools.lru_cache (or cache) the trace filled holds the trace's stand-ins, which the
            # user's own calls would get back afterwards: emptied (a pure cache computes them again)
            if cache.cache_info().misses != misses:
                cache.cache_clear()
                rebound.append(Rebinding(f"the lru_cache of {getattr(cache, '__qualname__', 'a function')}", None,
                                         False, cache=True))
    if lost:
        t = lost[0]
        raise CaptureError(
            f"tracing the function wrote into a {'parameter' if isinstance(t, torch.nn.Parameter) else 'tensor'} "
            f"{tuple(t.shape)} it reaches; a derivative program replays such writes at every call, and hoad can undo "
            "the trace's own write only for small buffers. Move the update out of the function")


def _shared_memos(obj) -> list:
    """What code may fill beside ``obj`` and keep between calls: for an instance of a user-defined
    class, what its classes keep for all their instances (a functools.lru_cache on a method, a dict
    or list class attribute, ``_cache = {}``); for a user's module, its own (a ``_CACHE = {}`` its
    functions fill)."""
    memo = (functools._lru_cache_wrapper, dict, list)
    if isinstance(obj, types.ModuleType):
        return [v for k, v in vars(obj).items() if isinstance(v, memo) and not k.startswith("__")] \
            if _user_module(obj) else []
    if isinstance(obj, (type, types.FunctionType, types.MethodType)) or not _user_class(type(obj)):
        return []
    return [v for c in type(obj).__mro__ if c is not object and _user_class(c) for v in vars(c).values()
            if isinstance(v, memo)]


@dataclass(frozen=True)
class Rebinding:
    """A tensor the trace stored on an object: ``where`` names it, ``old`` is the value it had
    (None where the entry is new), ``buffer`` says whether it is a module's buffer."""

    where: str
    old: object
    buffer: bool
    cache: bool = False  # a functools.lru_cache the trace filled, emptied


def _tables(obj) -> list:
    """The dicts and lists through which code stores values on ``obj``: a module's attributes and
    its parameter and buffer tables, an object's ``__dict__``, or the container itself."""
    if isinstance(obj, torch.nn.Module):  # (a ScriptModule's tables are wrappers: not followed)
        return [t for t in (obj.__dict__, obj._parameters, obj._buffers) if isinstance(t, dict)]
    if isinstance(obj, (dict, list)):
        return [obj]
    if isinstance(obj, (types.FunctionType, types.MethodType, types.ModuleType, type, functools.partial)):
        return []
    try:
        attrs = getattr(obj, "__dict__", None)
    except Exception:  # noqa: BLE001 - a __dict__ property that raises: nothing stored there
        return []
    return [attrs] if isinstance(attrs, dict) else []


def _restore_stores(obj, table, old: dict | list) -> list[Rebinding]:
    """Put back the entries of ``table`` the trace set to values holding tensors; one
    :class:`Rebinding` each."""
    holds = lambda v: any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v))  # noqa: E731
    owner = type(obj).__name__
    if isinstance(table, list):
        if len(table) == len(old) and all(a is b for a, b in zip(table, old)):
            return []
        added = [v for v in table if not any(v is o for o in old)]
        if not any(holds(v) for v in added):
            return []
        table[:] = old
        return [Rebinding(f"a list of {owner}" if obj is not table else "a list", None, False)]
    changed = [k for k, v in table.items() if (k not in old or old[k] is not v) and holds(v)]
    for k in changed:
        if k in old:
            table[k] = old[k]
        else:
            del table[k]
    if isinstance(obj, torch.nn.Module) and table is obj._parameters:
        return []  # (reparametrization's own leftovers: a submodule called twice kept the traced values)
    if isinstance(obj, torch.nn.RNNBase):  # (torch's list of the RNN's own parameters, rebuilt from them)
        changed = [k for k in changed if k != "_flat_weights"]
    buffer = isinstance(obj, torch.nn.Module) and table is obj._buffers
    name = (lambda k: f"{owner}.{k}") if obj is not table else (lambda k: f"a dict's entry {k!r}")
    return [Rebinding(name(k), old.get(k), buffer) for k in changed]


def _copied(t: torch.Tensor) -> bool:
    return not isinstance(t, torch.nn.Parameter) and t.numel() <= 1 << 20


def _reachable(roots: dict, into_hoad: bool = True) -> Iterator[object]:
    """Every object the search for free tensors reaches from ``roots``, each once (hoad's own
    objects, a nested program, and what they hold only where ``into_hoad``)."""
    seen: set[int] = set()
    frontier = list(roots.values())
    for _depth in range(MAX_DEPTH + 1):
        following = []
        for obj in frontier:
            if id(obj) in seen or isinstance(obj, SCALARS):
                continue
            seen.add(id(obj))
            if not into_hoad and type(obj).__module__.startswith("hoad."):
                continue
            yield obj
            if not isinstance(obj, torch.Tensor):
                following += [child for _, child in _children(obj)]
        if not following:
            break
        frontier = following


def _children(obj) -> Iterator[tuple[Step, object]]:
    """The references the search follows out of ``obj``, each with the step that reads it."""
    if isinstance(obj, type) and _user_class(obj):
        # a class the code names (C.T, C.k): its own attributes, not its methods and descriptors
        for name, value in list(vars(obj).items())[:MAX_ITEMS]:
            if not name.startswith("__") and not callable(value) and not hasattr(value, "__get__"):
                yield ("attr", name), value
        return
    if isinstance(obj, types.ModuleType) and _user_module(obj):
        # a config module's tensors (cfg.W, rebound by cfg.W = ...); its other names are code
        for name, value in list(vars(obj).items()):
            if isinstance(value, torch.Tensor) and not name.startswith("__"):
                yield ("attr", name), value
        return
    if isinstance(obj, (types.ModuleType, type, str, bytes, int, float, complex, bool)) or obj is None:
        return
    if is_data_parallel(obj):
        # DDP's own state is bookkeeping (its reducer, no_sync's flag), not what the function
        # computes: hoad traces the module it wraps and runs DDP's protocol itself (hoad.distributed)
        yield ("module", "module"), obj.module
        return
    if getattr(obj, "_hoad_quiet", False) or (type(obj).__module__.startswith("torch.distributed.fsdp")
                                              and not isinstance(obj, torch.nn.Module)):
        # FSDP2's state and the hooks it hangs on a sharded module are bookkeeping, like DDP's: hoad
        # reads the gathered parameters from the module and runs FSDP's protocol itself
        return
    if isinstance(obj, torch.nn.Module):
        for kind, table in (("param", obj._parameters), ("buffer", obj._buffers), ("module", obj._modules)):
            for name, value in table.items():
                if value is not None:
                    yield (kind, name), value
        yield from _attributes(obj, skip=("_parameters", "_buffers", "_modules"))
        forward = getattr(type(obj), "forward", None)
        if isinstance(forward, types.FunctionType):
            yield from _function_refs(forward, through=None)
        return
    if isinstance(obj, types.MethodType):
        yield ("self", None), obj.__self__
        yield ("func", None), obj.__func__
        return
    if isinstance(obj, functools.partial):
        yield ("partial", None), obj.func
        yield from ((("partial_arg", i), a) for i, a in enumerate(obj.args[:MAX_ITEMS]))
        yield from ((("partial_kw", k), v) for k, v in list(obj.keywords.items())[:MAX_ITEMS])
        return
    if isinstance(obj, types.FunctionType):
        yield from _function_refs(obj, through="self")
        return
    if isinstance(obj, (list, tuple)):
        yield from ((("item", i), v) for i, v in enumerate(obj[:MAX_ITEMS]))
        return
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:MAX_ITEMS]:
            if isinstance(k, (str, int)):
                yield ("item", k), v
        return
    yield from _attributes(obj)


_LIBRARIES = ("builtins", "torch", "hoad", "numpy", "typing", "enum", "abc", "collections", "functools")


def _user_class(cls: type) -> bool:
    return (cls.__module__ or "builtins").split(".")[0] not in _LIBRARIES


def _user_module(module: types.ModuleType) -> bool:
    """A module of the user's (a config file), not a library's or the standard library's."""
    path = getattr(module, "__file__", None) or ""
    return module.__name__.split(".")[0] not in _LIBRARIES and bool(path) and "site-packages" not in path \
        and not path.startswith(sys.prefix) and not path.startswith(getattr(sys, "base_prefix", sys.prefix))


def _attributes(obj, skip: tuple = ()) -> Iterator[tuple[Step, object]]:
    try:
        attrs = getattr(obj, "__dict__", None)
    except Exception:  # noqa: BLE001 - a __dict__ property that raises: nothing to follow
        return
    attrs = dict(attrs) if isinstance(attrs, dict) else {}
    for name in _slots(type(obj)):  # (a class with __slots__ keeps these outside __dict__)
        try:
            attrs.setdefault(name, object.__getattribute__(obj, name))
        except AttributeError:  # (a slot never set)
            continue
    for name, value in list(attrs.items())[:MAX_ITEMS]:
        # (not hoad's own programs a decorated method keeps on its instance)
        if isinstance(name, str) and name not in skip and not name.startswith(("__", "_hoad_")):
            yield ("attr", name), value


def _slots(cls: type) -> list[str]:
    """The attribute names the ``__slots__`` of ``cls`` and its bases declare (a private ``__w`` of
    class C is ``_C__w``)."""
    names = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        for n in [slots] if isinstance(slots, str) else [n for n in slots if isinstance(n, str)]:
            if n in ("__dict__", "__weakref__"):
                continue
            private = n.startswith("__") and not n.endswith("__") and c.__name__.lstrip("_")
            names.append(f"_{c.__name__.lstrip('_')}{n}" if private else n)
    return names


def _function_refs(fn: types.FunctionType, through: str | None) -> Iterator[tuple[Step, object]]:
    """A function's closure cells, the globals its code names, and its defaults. ``through`` is
    None for a module's ``forward`` reached through its class: those steps would start from the
    module, not from the function, so only the function's globals are followed, by a fresh root."""
    if through is None:
        return
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield ("cell", name), cell.cell_contents
        except ValueError:  # an empty cell
            continue
    for name in sorted(_loads(code)[1]):  # (not co_names: it holds attribute names too, and a global
        if name in fn.__globals__:          # A found first for params.A hid the attribute's rebinding)
            yield ("global", name), fn.__globals__[name]
    yield from ((("default", i), v) for i, v in enumerate(fn.__defaults__ or ()))
    yield from ((("kwdefault", k), v) for k, v in (fn.__kwdefaults__ or {}).items())


def roots_of(fn: Callable, module: torch.nn.Module | None = None) -> dict:
    """The objects a compiled function's sources start from: the function, and its module."""
    roots = {"fn": fn}
    if module is not None:
        roots["module"] = module
    if inspect.ismethod(fn):
        roots["fn"] = fn
    return roots
