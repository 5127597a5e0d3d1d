"""Python values a traced function read, watched at every call.

Tracing bakes the Python values a function reads into its program as constants: a closed-over
``k = 2.0``, a module's ``self.scale``, the ``training`` flag, a numpy array passed to
``torch.from_numpy``, a submodule swapped for another. :func:`find_guards` finds the ones the
reachable code may read (searching from the same roots as :mod:`hoad.binding`'s free tensors),
and each :class:`Guard` says at every call whether one changed, so the function is traced again
rather than run with a stale value.
"""

from __future__ import annotations

import inspect
import logging
import math
import types
import weakref
from dataclasses import dataclass

import torch

from hoad.binding import _STEP, MAX_DEPTH, SCALARS, Source, Step, _children, _hooks, _loads, _reachable
from hoad.distributed import is_data_parallel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Guard:
    """The Python values an object holds (``step`` from it, value), as a function was traced.

    Tracing bakes the Python values a function reads into its program as constants: a closed-over
    ``k = 2.0``, a module's ``self.scale``, the ``training`` flag that picks dropout or batch
    statistics. Each call checks them again (:meth:`changed`); any change traces the function again.
    """

    parent: Source
    values: tuple[tuple[Step, object], ...]

    def now(self, roots: dict) -> tuple | None:
        """The values as they are now (types too: 1 and 1.0 differ), or None if one is gone or
        cannot be a key."""
        try:
            obj = self.parent.resolve(roots)
            values = tuple((type(v), v) for v in (_STEP[step[0]](obj, step[1]) for step, _ in self.values))
            hash(values)
            return values
        except Exception:  # noqa: BLE001 - a property that raises, an unhashable value: no twin
            return None

    def changed(self, roots: dict) -> tuple[Step | None, str] | None:
        """None if every value is as traced, else the step that changed (None: the object
        itself is gone) and a sentence saying how."""
        try:
            obj = self.parent.resolve(roots)
        except Exception:  # noqa: BLE001 - whatever the lookup raises, the value is not as traced
            return None, f"{self.parent.name} is gone"
        for step, was in self.values:
            try:
                now = _STEP[step[0]](obj, step[1])
                same = now is was or bool(_same(now, was))  # (the same object: as _same says, faster)
            except Exception:  # noqa: BLE001
                return step, f"{_step_name(self.parent, step)} is gone or cannot be compared"
            if not same and step[0] == "hooks":
                counts = lambda hooks: sum(map(len, hooks))  # noqa: E731
                return step, (f"the forward hooks of {_step_name(self.parent, step) or 'the module'} changed "
                              f"({counts(was)} -> {counts(now)}, its own and global ones)")
            if not same:
                return step, f"{_step_name(self.parent, step)} changed ({was!r} -> {now!r})"
        return None


def _step_name(parent: Source, step: Step) -> str:
    if step[0] == "default":  # (a position in __defaults__: no name of its own)
        return f"the default value {step[1]} of {parent.name}"
    return Source(parent.root, parent.steps + (step,)).name


def _same(a, b) -> bool:
    """Scalars (and tuples of them) by value, NaN equal to NaN; numpy arrays by shape, dtype and
    values; code (:func:`_is_code`) by identity, a bound method by its function and instance."""
    if type(a) is not type(b):
        return False
    if _is_array(a):
        import numpy

        return a.shape == b.shape and a.dtype == b.dtype and bool(
            numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, types.MethodType):
        return a.__func__ is b.__func__ and a.__self__ is b.__self__
    if _is_code(a):
        return a is b
    if isinstance(a, float):  # -0.0 is not 0.0 (atan2, copysign tell them apart); NaN is NaN
        return (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) or (a != a and b != b)
    return a == b or (a != a and b != b)  # NaN is NaN


def find_guards(roots: dict) -> list[Guard]:
    """The Python scalars (bool, int, float, str, None) the search for free tensors reaches from
    ``roots`` and the reachable code may read, grouped by the object that holds it: an attribute
    only where some reachable function, module ``forward`` or method they call loads that name,
    a global only where its function loads it as a global (not ``W.t()``'s ``t``). A counter the
    code never names (``self.iter`` of the object whose method is compiled) is not watched.
    hoad's own objects (a nested operator) are not entered: their settings do not change."""
    attrs = _attributes_read(list(_reachable(roots)))
    held: list[tuple[Source, object, list]] = []
    seen: set[int] = set()
    frontier = [(name, obj, ()) for name, obj in roots.items()]
    for _depth in range(MAX_DEPTH + 1):
        following = []
        for root, obj, steps in frontier:
            if id(obj) in seen or isinstance(obj, torch.Tensor) or type(obj).__module__.startswith("hoad."):
                continue
            seen.add(id(obj))
            if is_data_parallel(obj):  # (its flags are DDP's bookkeeping: only the module it wraps is watched)
                following += [(root, child, steps + (step,)) for step, child in _children(obj)]
                continue
            values = []
            children = list(_children(obj))
            for step, child in children:
                if step[0] == "attr" and step[1] not in attrs:
                    continue  # never loaded by the code: a trainer's optimizer, logger, counters
                if _is_scalar(child):
                    values.append((step, child))
                    continue
                if _is_array(child):  # torch.from_numpy(charges) bakes its values in: compared by value
                    values.append((step, child.copy()))
                    continue
                if _is_array(child, any_size=True):
                    log.warning("hoad: the function may read the numpy array %s (%d entries) and bake its values into "
                                "the program; arrays this large are not compared at each call, so changes to it are "
                                "not seen: pass it as a tensor (torch.from_numpy shares its memory)",
                                Source(root, steps + (step,)).name, child.size)
                if _is_code(child):  # a submodule, a function: swapped for another, the code differs
                    values.append((step, child))
                following.append((root, child, steps + (step,)))
            if isinstance(obj, torch.nn.Module):  # layers appended or removed; forward patched
                values += [(("modules", None), tuple(obj._modules.keys())), (("attr", "forward"), obj.forward),
                           (("hooks", None), _hooks(obj))]
            elif isinstance(obj, (list, tuple, dict)) and any(
                    isinstance(c, torch.Tensor) or _is_code(c) for _, c in children):
                # layers or weights appended: the code loops over more (a list of numbers the
                # function appends to, a log, is not watched)
                values.append((("len", None), len(obj)))
            forward = getattr(type(obj), "forward", None) if isinstance(obj, torch.nn.Module) else None
            if isinstance(forward, types.FunctionType) and not (forward.__module__ or "").startswith("torch."):
                # the globals a user module's forward reads (ALPHA in torch.sin(ALPHA * x))
                following.append((root, forward, steps + (("type", None), ("attr", "forward"))))
            held.append((Source(root, steps), obj, values))
        if not following:
            break
        frontier = following
    guards = []
    for source, obj, values in held:
        # (attributes no code loads were left out above)
        kept = [(step, v) for step, v in values if step[0] != "global" or step[1] in _loads(obj.__code__)[1]]
        if not isinstance(obj, (types.FunctionType, types.MethodType, list, tuple, dict)):
            # names the code reads that the instance does not hold: class attributes (a default an
            # instance may override later) and a config module's values
            own = getattr(obj, "__dict__", {})
            names = sorted(n for n in dir(type(obj)) if not n.startswith("__")) if isinstance(attrs, _EveryName) \
                else sorted(attrs)
            for name in names:
                if name in own and not isinstance(obj, types.ModuleType):
                    continue
                try:
                    v = inspect.getattr_static(obj, name)
                except AttributeError:
                    continue
                if not _is_scalar(v) or any(step == ("attr", name) for step, _ in kept):
                    continue
                if _serves_attributes(type(obj)):
                    # the class default is not what the code reads: the instance serves the name
                    # itself (OpInfo's dtypesIfCUDA, None on the class, comes from a dict), so the
                    # guard holds the value a read returns, as its check reads it
                    try:
                        v = getattr(obj, name)
                    except Exception:  # noqa: BLE001 - a read that raises: nothing to watch
                        continue
                    if not _is_scalar(v):
                        continue
                kept.append((("attr", name), v))
        if kept:
            guards.append(Guard(source, tuple(kept)))
    return guards


def _serves_attributes(cls: type) -> bool:
    """Whether instances of ``cls`` compute what every attribute read returns (their class
    defines ``__getattribute__``), so a class attribute found statically may not be the value the
    code reads (``__getattr__`` runs only for names not found, so a class attribute wins over it)."""
    return cls.__getattribute__ is not object.__getattribute__


def _is_code(v) -> bool:
    """A value whose identity decides what the traced code does: a module, a function, any
    callable object (not a tensor or a class): compared by identity (bound methods by function
    and instance)."""
    if isinstance(v, (torch.Tensor, type, weakref.ref)) or not callable(v):  # (a weakref: a cache)
        return False
    try:
        hash(v)
        return True
    except TypeError:
        return False


def _is_scalar(v) -> bool:
    """A value a guard can watch: a Python or numpy scalar that hashes and compares with itself
    to a plain bool (a subclass whose ``__eq__`` raises or returns an array is not watched)."""
    if not (isinstance(v, SCALARS) or (type(v).__module__ == "numpy" and getattr(v, "shape", None) == ())):
        return False
    try:
        hash(v)
        return bool(_same(v, v)) is True   # numpy's np.bool_ too; an array's truth value raises
    except Exception:  # noqa: BLE001 - any failure: not a value to watch
        return False


def _is_array(v, any_size: bool = False) -> bool:
    """A numpy array a guard can watch by value (copied when traced): numbers, up to 2^16 entries
    (any number where ``any_size``)."""
    return type(v).__name__ == "ndarray" and type(v).__module__ == "numpy" and v.dtype.kind in "biufc" \
        and (any_size or v.size <= 1 << 16)


def _attributes_read(objects: list) -> set[str]:
    """The attribute names loaded by the code of ``objects``: functions, modules' ``forward``, and
    the methods (and properties) of any object's class that code names, to a fixed point."""
    codes = [o.__code__ for o in objects if isinstance(o, types.FunctionType)]
    codes += [f.__code__ for o in objects if isinstance(o, torch.nn.Module)
              for f in [getattr(type(o), "forward", None)] if isinstance(f, types.FunctionType)]
    # a callable object of the user's (not a module): what its __call__ reads
    codes += [f.__code__ for o in objects if not isinstance(o, (torch.nn.Module, types.FunctionType, type))
              for f in [getattr(type(o), "__call__", None)]  # noqa: B004 (its code, not whether it is callable)
              if isinstance(f, types.FunctionType)]
    names: set[str] = set()
    done: set = set()
    classes = {type(o) for o in objects if not isinstance(o, (types.FunctionType, types.MethodType))}
    while codes:
        code = codes.pop()
        if code in done:
            continue
        done.add(code)
        new = _loads(code)[0] - names
        names |= new
        for cls in classes:
            for name in new:
                try:
                    member = inspect.getattr_static(cls, name)
                except AttributeError:
                    continue
                member = member.fget if isinstance(member, property) else member
                member = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                if isinstance(member, types.FunctionType):
                    codes.append(member.__code__)
    if any("getattr" in _loads(code)[1] for code in done):
        return _EveryName(names)  # getattr(self, name) reads names the bytecode does not hold
    return names


class _EveryName(frozenset):
    """The attribute names read by code that calls ``getattr``: any name may be, so every scalar
    attribute is watched (a changed counter then traces again, where a stale value was silent)."""

    def __contains__(self, name) -> bool:
        return True
