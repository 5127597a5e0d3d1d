"""Adding derivative rules from outside hoad: a custom op (``torch.library``) or an ATen overload
hoad does not cover, or a rule to override.

Three ways to give a rule, from the least to the most work:

- :func:`register_elementwise`: an elementwise op ``y = φ(x, *args)`` as its scalar derivatives
  ``[φ'(x), …, φ^(n)(x)]`` (given x and y); Faà di Bruno does every order and mixed block.
- :func:`register_linear`: an op linear in its first argument that treats leading dims as a
  batch (like most torch ops on their trailing dims), with its transpose for the reverse sweep.
- :func:`register_rule`: a forward rule and a VJP over hoad's blocks (``hoad.rules.base``), as
  hoad's own rules are written.

A registration applies to every compiled function: programs built before it are built again at
their next call. The op stays out of the decompositions capture applies, so it reaches its rule.
An op autograd cannot see through gets the first two's first derivative (or transpose) as its
autograd formula, so results train through it (:func:`_give_autograd`).
:func:`unregister_rule` restores what was there before.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hoad.algebra import Block, Lazy, along, map_out
from hoad.errors import InvalidArgumentError, UnsupportedOperatorError
from hoad.rules import AUTOGRAD_GIVEN, EDITS, FAMILIES, RULES, USER_OPS, VJPS, has_autograd
from hoad.rules.base import Jet
from hoad.rules.combinators import linear
from hoad.rules.elementwise import elementwise_pair

_saved: dict = {}  # op -> (rule, vjp, family) before the first user registration, or None


def _give_autograd(op, how: str, cotangent: Callable) -> None:
    """Results are differentiable (training through them), and hoad's programs run the op itself:
    where autograd cannot see through it (a kernel of the user's own, or CompositeExplicitAutograd,
    whose ops Inductor's autograd does not trace), a W.grad through it was None or silently wrong.
    Such an op gets the formula of the registered derivatives: ``cotangent(g, x, y, args, kwargs)``
    for its first argument (hoad's registrations differentiate that one only)."""
    _take_autograd(op)  # (an earlier registration's formula: replaced)
    if has_autograd(op):
        return
    is_tensor = [a.type.isSubtypeOf(torch._C.TensorType.get()) for a in op._schema.arguments]
    positional = [a.name for a in op._schema.arguments if not a.kwarg_only]
    if any(t and a.kwarg_only for t, a in zip(is_tensor, op._schema.arguments)):
        return  # (torch gives no formula to such an op: training through it is refused, hoad.api)

    def setup_context(ctx, inputs, output, keyword_only_inputs=None):
        ctx.save_for_backward(inputs[0], output)
        ctx.rest, ctx.keywords = inputs[1:], dict(keyword_only_inputs or {})

    def backward(ctx, g):
        x, y = ctx.saved_tensors
        late = [name for i, name in enumerate(positional) if i and is_tensor[i] and ctx.needs_input_grad[i]]
        if late:
            raise InvalidArgumentError(
                f"{op} is registered by hoad.{how}, which gives it the autograd formula of its first argument only "
                f"(it has none of its own), but {late[0]} needs a gradient too: register the op's autograd with "
                "torch.library.register_autograd")
        return (cotangent(g, x, y, ctx.rest, ctx.keywords),) + (None,) * (len(positional) - 1)

    lib = torch.library.Library(op.namespace, "FRAGMENT")
    try:
        torch.library.register_autograd(op, backward, setup_context=setup_context, lib=lib)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):  # (a schema torch gives none to)
        lib._destroy()
        return
    AUTOGRAD_GIVEN[op] = lib


def _take_autograd(op) -> None:
    """Remove the autograd formula hoad gave ``op``, if any."""
    lib = AUTOGRAD_GIVEN.pop(op, None)
    if lib is None:
        return
    opdef = torch._library.custom_ops._maybe_get_opdef(op)
    if opdef is not None:  # (a custom_op keeps its formula on its definition, not in the library)
        opdef._backward_fn = opdef._setup_context_fn = None
    lib._destroy()


def _check_op(op) -> None:
    if not isinstance(op, torch._ops.OpOverload):
        raise InvalidArgumentError(
            f"rules are registered per ATen overload, e.g. torch.ops.mylib.op.default or torch.ops.aten.sin.default, "
            f"got {op!r}" + (" (an overload packet: pick an overload such as .default)"
                             if isinstance(op, torch._ops.OpOverloadPacket) else ""))


def _check_first_is_tensor(op, how: str) -> None:
    """register_elementwise and register_linear differentiate the op's first argument."""
    args = op._schema.arguments
    if not args or not args[0].type.isSubtypeOf(torch._C.TensorType.get()):
        first = f"its first argument {args[0].name} is a {args[0].type}" if args else "it takes no arguments"
        raise InvalidArgumentError(f"hoad.{how} differentiates an op's first argument, but {first} ({op._schema}): "
                                   "register the op with hoad.register_rule, or put the tensor argument first")


def register_rule(op, rule: Callable, vjp: Callable, *, override: bool = False) -> None:
    """Register ``rule(ctx, *args, **kwargs) -> {multi-index: Block}`` and
    ``vjp(vctx, g, *args, **kwargs) -> [(argument jet, cotangent block), ...]`` for ``op``.

    ``override=True`` replaces a rule hoad (or an earlier registration) has; without it, an op
    that already has one is refused."""
    _check_op(op)
    if not callable(rule) or not callable(vjp):
        raise InvalidArgumentError("register_rule needs a forward rule and a VJP (both callables)")
    if not isinstance(override, bool):
        raise InvalidArgumentError(f"override must be True or False, got {override!r}")
    if len(op._schema.returns) != 1:
        raise InvalidArgumentError(
            f"{op} returns {len(op._schema.returns)} values; rules can be registered for single-output ops only "
            "(hoad's reverse mode treats its own multi-output ops as gathers). Wrap the output you differentiate "
            "in a single-output custom op")
    if op in RULES and not override:
        raise InvalidArgumentError(f"{op} already has a rule ({FAMILIES.get(op)}): pass override=True to replace it")
    if op not in _saved:
        _saved[op] = (RULES[op], VJPS[op], FAMILIES[op]) if op in RULES else None
    _take_autograd(op)  # (the formula of a registration this one replaces)
    RULES[op], VJPS[op], FAMILIES[op] = _checked_rule(op, rule), _checked_vjp(op, vjp), "user"
    USER_OPS.add(op)
    EDITS[0] += 1


def _checked(fn: Callable, default_name: str, complaint: Callable) -> Callable:
    """``fn`` with its result checked: ``complaint(result, args)`` is None, or what is wrong with it."""
    def checked(*args, **kwargs):
        out = fn(*args, **kwargs)
        wrong = complaint(out, (args, kwargs))
        if wrong is not None:
            raise InvalidArgumentError(wrong)
        return out

    checked.__name__ = getattr(fn, "__name__", default_name)
    return checked


def _checked_rule(op, rule: Callable) -> Callable:
    """A user's forward rule, its result checked: {multi-index: block} (a key of another kind
    was skipped, its derivatives silently 0)."""
    def complaint(blocks, _args):
        if isinstance(blocks, dict) and all(_is_multi_index(K) for K in blocks):
            return None
        return (f"the forward rule registered for {op} returned {_described(blocks)}"
                f"{' with keys ' + repr(list(blocks)[:4]) if isinstance(blocks, dict) else ''}; it must return "
                "{multi-index: Block} for the multi-indices in ctx.keys (tuples of wrt positions, e.g. (0,), (0, 0))")

    return _checked(rule, "user_rule", complaint)


def _is_multi_index(K) -> bool:
    return isinstance(K, tuple) and all(isinstance(k, int) and not isinstance(k, bool) for k in K)


def _checked_vjp(op, vjp: Callable) -> Callable:
    """A user's VJP, its result checked: a list of (argument jet, cotangent block) pairs."""
    def complaint(pairs, args):
        (v, g, *inputs), kwargs = args
        jets = [a for a in torch.utils._pytree.tree_leaves((inputs, kwargs)) if isinstance(a, Jet)]
        if not (isinstance(pairs, (list, tuple)) and all(isinstance(p, tuple) and len(p) == 2 for p in pairs)):
            what = (f"a {type(pairs).__name__} whose entries are not all (argument jet, cotangent block) pairs"
                    if isinstance(pairs, (list, tuple)) else _described(pairs))
            return (f"the VJP registered for {op} returned {what}; it must return a list of (argument jet, "
                    "cotangent block) pairs, [] where no argument varies")
        for jet, cotangent in pairs:
            if not any(jet is j for j in jets):
                return (f"the VJP registered for {op} paired a cotangent with {_described(jet)}, not one of the "
                        "op's arguments as the VJP got them (the jet itself, x, not x.primal)")
            expected = tuple(jet.shape) + tuple(g.shape[v.out.ndim:])
            if not isinstance(cotangent, (Block, Lazy)) or tuple(cotangent.shape) != expected:
                got = f"a Block of shape {tuple(cotangent.shape)}" if isinstance(cotangent, (Block, Lazy)) else \
                    _described(cotangent)
                return (f"the VJP registered for {op} returned {got} as a cotangent; it must be a Block of shape "
                        f"{expected}: the argument's axes, then g's axes after the op's output axes")
        return None

    return _checked(vjp, "user_vjp", complaint)


def unregister_rule(op) -> None:
    """Undo every registration of ``op``: hoad's own rule comes back, or none."""
    _check_op(op)
    if op not in _saved:
        raise InvalidArgumentError(f"{op} has no registered rule to remove")
    before = _saved.pop(op)
    _take_autograd(op)
    USER_OPS.discard(op)
    EDITS[0] += 1
    if before is None:
        for table in (RULES, VJPS, FAMILIES):
            table.pop(op, None)
    else:
        RULES[op], VJPS[op], FAMILIES[op] = before


def register_elementwise(op, derivatives: Callable | None = None, *, override: bool = False):
    """An elementwise op by its scalar derivatives: ``derivatives(n, x, y, *args, **kwargs)``
    returns ``[φ'(x), …, φ^(n)(x)]`` (tensors shaped like x, Python numbers, or None for a
    structural zero), where ``x`` is the differentiated input (the op's first argument) and ``y``
    the op's output. Usable as a decorator: ``@hoad.register_elementwise(torch.ops.mylib.f.default)``."""
    def register(fn: Callable) -> Callable:
        if not callable(fn):
            raise InvalidArgumentError(f"register_elementwise needs a function of (n, x, y, *args) giving the "
                                       f"derivatives of {op}, got {_described(fn)}")

        def checked(n, x, y, *args, **kwargs):
            args, kwargs = _constants(op, "register_elementwise", args, kwargs)
            got = _functional(lambda x, y: fn(n, x, y, *args, **kwargs))(x, y)
            if not isinstance(got, (list, tuple)):  # (a tensor iterates over its entries: one per derivative)
                raise InvalidArgumentError(
                    f"the derivatives registered for {op} returned {_described(got)}; return a list "
                    "[φ', …, φ^(n)] (tensors shaped like x, Python numbers, or None for a structural zero)")
            got = list(got)
            if len(got) < n:
                raise InvalidArgumentError(
                    f"the derivatives registered for {op} returned {len(got)} entries where order {n} needs {n} "
                    "(return [φ', …, φ^(n)], None for a structural zero)")
            return [_derivative(op, k + 1, d, x) for k, d in enumerate(got[:n])]

        checked.__name__ = getattr(fn, "__name__", "user")
        rule, vjp = elementwise_pair(checked)
        register_rule(op, rule, vjp, override=override)

        def cotangent(g, x, y, args, kwargs):
            (d,) = checked(1, x, y, *args, **kwargs)
            return torch.zeros_like(x) if d is None else g * d

        _give_autograd(op, "register_elementwise", cotangent)
        return fn

    _check_op(op)
    _check_first_is_tensor(op, "register_elementwise")
    return register if derivatives is None else register(derivatives)


def register_linear(op, transpose: Callable, *, acts_on: int | None = None, override: bool = False) -> None:
    """An op linear in its first argument, ``y = op(x, *args)``, that treats dims before x's own
    as a batch (``op(x_batch, *args)[i] == op(x_batch[i], *args)``); ``transpose(g, x_shape,
    *args)`` is its adjoint with the same batch convention: a cotangent ``g`` shaped like
    ``(*batch, *y.shape)`` goes back to ``(*batch, *x.shape)``.

    ``acts_on=k``: the op acts on the last k dims of x only, and x's dims before them pass
    through to y's leading dims (a stencil along the last dim: ``acts_on=1``). Those dims then
    keep their ties, so samples stay apart under ``batch_dim=0``; by default every dim of x is
    acted on."""
    _check_op(op)
    _check_first_is_tensor(op, "register_linear")
    if not callable(transpose):
        raise InvalidArgumentError("register_linear needs the op's transpose (a callable)")
    if acts_on is not None and (isinstance(acts_on, bool) or not isinstance(acts_on, int) or acts_on < 0):
        raise InvalidArgumentError(f"acts_on must be a number of trailing dims (an int >= 0), got {acts_on!r}")

    def passing(r: int) -> dict | None:  # the leading axes of an r-axis value the op leaves alone
        return None if acts_on is None else along(r, range(max(r - acts_on, 0), r))

    def rule(ctx, x, *args, **kwargs):
        args, kwargs = _constants(op, "register_linear", args, kwargs)
        r, new = x.ndim, tuple(ctx.out.shape)
        keep = passing(r)
        if keep and new[:len(keep)] != x.shape[:len(keep)]:
            raise InvalidArgumentError(
                f"{op} is registered with acts_on={acts_on}, but its output {new} does not keep the leading dims "
                f"{x.shape[:len(keep)]} of its input {x.shape}")
        return linear(ctx, x, lambda b: map_out(b, r, _batched(lambda t: op(t, *args, **kwargs), r, new), new, keep))

    def vjp(vctx, g, x, *args, **kwargs):
        args, kwargs = _constants(op, "register_linear", args, kwargs)
        shape = tuple(x.shape)

        def back(t):
            out = _functional(lambda t: transpose(t, shape, *args, **kwargs))(t)
            want = (t.shape[0], *shape)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
                raise InvalidArgumentError(
                    f"the transpose registered for {op} returned {_described(out)} for a cotangent of shape "
                    f"{tuple(t.shape)}; it must return (*batch, *x.shape) = {want}")
            return out

        r = len(vctx.out.shape)
        return [(x, map_out(g, r, _batched(back, r, shape), shape, passing(len(shape))))]  # (y's leading axes)

    rule.__name__ = vjp.__name__ = f"user_linear_{op}"
    register_rule(op, rule, vjp, override=override)
    _give_autograd(op, "register_linear", lambda g, x, y, args, kwargs: transpose(g, tuple(x.shape), *args, **kwargs))


def _constants(op, how: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The op's arguments after the first as the tensors they hold: a registration by
    ``register_elementwise`` or ``register_linear`` differentiates the first argument only, so an
    argument that depends on a differentiated input is refused (its derivatives would be lost)."""
    def value(a):
        if not isinstance(a, Jet):
            return a
        if a.varies:
            raise UnsupportedOperatorError(
                f"{op} is registered by {how}, which differentiates its first argument only, but another tensor "
                "argument depends on the inputs being differentiated too, and its derivatives would be lost. Register "
                "the op with hoad.register_rule (a rule over every argument's blocks), or make that argument a "
                "constant")
        return a.primal

    return tuple(value(a) for a in args), {k: value(v) for k, v in kwargs.items()}


def _derivative(op, k: int, d, x: torch.Tensor):
    """The k-th derivative a user's function gave, checked: None, a number, or a tensor shaped
    like x (cast to x's dtype)."""
    if d is None or (isinstance(d, (int, float)) and not isinstance(d, bool)):
        return d
    if isinstance(d, torch.Tensor) and (d.ndim == 0 or tuple(d.shape) == tuple(x.shape)):
        return d.to(x.dtype)
    raise InvalidArgumentError(
        f"the derivatives registered for {op} gave {_described(d)} as derivative {k}; each must be None, a Python "
        f"number, or a tensor shaped like the op's first argument {tuple(x.shape)}")


def _described(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return "None" if v is None else f"a {type(v).__name__}"


def _functional(fn: Callable) -> Callable:
    """``fn`` with its in-place writes (``out[..., 2:] += g`` into a fresh buffer) traced as
    out-of-place ops: hoad's passes merge equal nodes and reorder them, which a write into a
    buffer two calls share would not survive."""
    return torch.func.functionalize(fn, remove="mutations")


def _batched(fn: Callable, r: int, new: tuple) -> Callable:
    """``fn`` on data laid out as (r op axes, *rest) -> (new axes, *rest), calling it with the
    rest flattened into one leading batch dim, contiguous (a user's fake kernel, ``empty_like(x)``,
    gives a permuted input's strides where the real kernel's output is contiguous: Inductor's
    programs then failed on a stride check)."""
    def apply(t: torch.Tensor) -> torch.Tensor:
        rest = tuple(t.shape[r:])
        batch = math.prod(rest)
        moved = t.movedim(tuple(range(r)), tuple(range(t.ndim - r, t.ndim))).reshape(batch, *t.shape[:r]).contiguous()
        out = fn(moved).reshape(*rest, *new)
        return out.movedim(tuple(range(len(rest), out.ndim)), tuple(range(len(new))))

    return apply
