"""Python floats as program inputs: a float argument that changes between calls is traced as a
0-d tensor input instead of a constant, so one program serves every value.

A float argument is baked into the first program, as any Python value is: constants fold, and
``x ** 2.0`` keeps its exact structural zeros. When a later call passes another value of that
argument, and nothing else differs, the next trace hands the function a :class:`TracedFloat` in
its place: it computes as the float would, in tensor ops on the program's input. Anything that
needs the value itself in Python (a comparison, ``float()``, ``int()``, ``math.exp``, a hash,
formatting, an op that takes only a Python number) is refused: the trace stops, and the argument
stays part of the program with the reason said (:class:`Refused` is a BaseException, so a user's
``except Exception`` cannot hide it; a refusal caught anyway is still recorded and voids the
trace). A program that branched on the value would be silently wrong at other values; one that
never touched the value outside tensor ops is right at every value.

``isinstance(t, float)`` holds (numbers.Number and numbers.Real too), so code that checks the
type before it computes takes the float's path; code that asks ``type(t) is float`` does not,
and is not followed.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import threading
import traceback
from collections.abc import Iterator

import torch


class Refused(BaseException):
    """A traced float was asked for its Python value (see the module docstring)."""


_STATE = threading.local()  # .refusals: the list the trace in progress on this thread records into


@contextlib.contextmanager
def watching() -> Iterator[list[str]]:
    """Record the refusals of the traces this thread runs in the block (each a short reason)."""
    previous = getattr(_STATE, "refusals", None)
    _STATE.refusals = refusals = []
    try:
        yield refusals
    finally:
        _STATE.refusals = previous


_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _user_line() -> str:
    """`` at file:line (`code`)`` of the innermost frame outside hoad and torch, or ""."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = os.path.abspath(frame.filename)
        if path.startswith((_HERE, _TORCH)) or "/passes/" in path.replace(os.sep, "/"):
            continue
        code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        return f" at {os.path.basename(frame.filename)}:{frame.lineno}" + (f" (`{code}`)" if code else "")
    return ""


def _refuse(what: str):
    reason = f"{what}{_user_line()}"
    refusals = getattr(_STATE, "refusals", None)
    if refusals is not None:
        refusals.append(reason)
    raise Refused(reason)


def _is_number(x) -> bool:
    return type(x) in (int, float, bool)


def _beside(tensors: list) -> torch.dtype:
    """The dtype a Python float takes among these tensors: the first floating or complex one's,
    the default dtype beside integer tensors alone, float64 (its own precision) beside none."""
    like = next((x.dtype for x in tensors if x.dtype.is_floating_point or x.dtype.is_complex), None)
    return like if like is not None else torch.get_default_dtype() if tensors else torch.float64


class TracedFloat:
    """A float argument during a trace: arithmetic on it is arithmetic on the program input
    ``tensor`` (0-d, float64), with the dtypes a Python float gives; its value is refused."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    # isinstance(t, float) and numbers.Real: the float's path through code that checks the type
    @property
    def __class__(self):
        return float

    def __repr__(self) -> str:
        return "<a float argument, traced as a program input>"

    # ------------------------------------------------------------------ arithmetic
    def _with(self, other, op, reflected: bool = False):
        if isinstance(other, torch.Tensor):
            t = self.tensor.to(_beside([other]))
            return op(other, t) if reflected else op(t, other)
        if type(other) is TracedFloat:
            other = other.tensor
        elif not _is_number(other):
            return NotImplemented
        return TracedFloat(op(other, self.tensor) if reflected else op(self.tensor, other))

    def __add__(self, other):
        return self._with(other, torch.add)

    def __radd__(self, other):
        return self._with(other, torch.add, reflected=True)

    def __sub__(self, other):
        return self._with(other, torch.sub)

    def __rsub__(self, other):
        return self._with(other, torch.sub, reflected=True)

    def __mul__(self, other):
        return self._with(other, torch.mul)

    def __rmul__(self, other):
        return self._with(other, torch.mul, reflected=True)

    def __truediv__(self, other):
        return self._with(other, torch.div)

    def __rtruediv__(self, other):
        return self._with(other, torch.div, reflected=True)

    def __pow__(self, other):
        return self._with(other, torch.pow)

    def __rpow__(self, other):
        return self._with(other, torch.pow, reflected=True)

    def __neg__(self):
        return TracedFloat(-self.tensor)

    def __pos__(self):
        return self

    def __abs__(self):
        return TracedFloat(self.tensor.abs())

    # ------------------------------------------------------------------ torch functions
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """A torch function given a traced float (torch.exp(t), x.pow(t), clamp(x, max=t)): called
        with the program input in the dtype a float takes beside its tensors (:func:`_beside`). One
        that needs a Python number reads the input's value, which the trace refuses as
        data-dependent."""
        kwargs = kwargs or {}
        like = _beside([x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)])
        swap = lambda x: x.tensor.to(like) if type(x) is TracedFloat else x  # noqa: E731
        args, kwargs = torch.utils._pytree.tree_map(swap, (args, kwargs))
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ the value: refused
    def __bool__(self):
        _refuse("tests its truth (`if t:`)")

    def __float__(self):
        _refuse("reads its value (float(), math.*, or a function that takes only Python numbers)")

    def __int__(self):
        _refuse("converts it to an int")

    def __index__(self):
        _refuse("uses it as an index or a size")

    def __complex__(self):
        _refuse("converts it to a complex")

    def __round__(self, ndigits=None):
        _refuse("rounds it")

    def __trunc__(self):
        _refuse("truncates it")

    def __floor__(self):
        _refuse("floors it")

    def __ceil__(self):
        _refuse("ceils it")

    def __floordiv__(self, other):
        _refuse("divides it with //")

    __rfloordiv__ = __floordiv__

    def __mod__(self, other):
        _refuse("takes it modulo (%)")

    __rmod__ = __mod__

    def __divmod__(self, other):
        _refuse("takes divmod of it")

    __rdivmod__ = __divmod__

    def __hash__(self):
        _refuse("hashes it (a dict key, a set, a cache)")

    def __eq__(self, other):
        _refuse("compares it (==)")

    def __ne__(self, other):
        _refuse("compares it (!=)")

    def __lt__(self, other):
        _refuse("compares it (<)")

    def __le__(self, other):
        _refuse("compares it (<=)")

    def __gt__(self, other):
        _refuse("compares it (>)")

    def __ge__(self, other):
        _refuse("compares it (>=)")

    def __str__(self):
        _refuse("formats it as text")

    def __format__(self, spec):
        _refuse("formats it as text")

    def __reduce_ex__(self, protocol):
        _refuse("pickles or copies it")


def number_tensor(value: float, device: torch.device | None = None) -> torch.Tensor:
    """The program input a float argument becomes at a call: 0-d float64 (a Python float's precision)."""
    t = torch.tensor(value, dtype=torch.float64, device=device)
    t._hoad_number = True  # (bind_layout: this leaf is a float, handed to the function as a TracedFloat)
    return t


def is_number_tensor(t) -> bool:
    return getattr(t, "_hoad_number", False)
