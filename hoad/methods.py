"""Compiled callables on methods: each instance of a class gets its own (bound per instance,
rebuilt on unpickling), with what a module's binding needs (tied parameters, class bodies)."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable

import torch

from hoad.errors import InvalidArgumentError


def var_positional(fn) -> str | None:
    """The name of ``fn``'s ``*args`` parameter, if it has one."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), None)


def tied_names(module: torch.nn.Module) -> dict[str, str]:
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


def unbound_method(fn) -> bool:
    """Whether ``fn`` is a function of a class body not bound to an instance (``Net.u``, or a
    decorator's argument in the body); a bound method (``net.u``) is not."""
    return in_class_body(fn) and not inspect.ismethod(fn)


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
