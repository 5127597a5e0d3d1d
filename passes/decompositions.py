"""The decomposition table capture traces with: core ATen, minus what hoad must keep, plus
composites split into ops with rules (and a few decompositions of hoad's own)."""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
import operator
import weakref

import torch
from torch import fx
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

from hoad.errors import DataDependentControlFlowError, HoadInternalError, InvalidArgumentError
from hoad.passes.clean import traced_call
from hoad.rules import USER_OPS
from hoad.rules.linalg import CAPTURE_DECOMPOSITIONS as _LINALG

aten = torch.ops.aten


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    dims = list(range(x.ndim)) if dim is None or len(dim) == 0 else [d % max(x.ndim, 1) for d in dim]
    n = math.prod(x.shape[d] for d in dims)
    c = 1 if correction is None else correction
    mean = x.sum(dims, keepdim=True) / n
    centred = x - mean
    denom = n - c
    var = (centred * centred).sum(dims, keepdim=keepdim) * (1.0 / denom if denom > 0 else math.nan)
    return var, (mean if keepdim else mean.squeeze(dims))


def _var(x, dim=None, *, correction=None, keepdim=False):
    return _var_mean(x, dim, correction=correction, keepdim=keepdim)[0]


def _std(x, dim=None, *, correction=None, keepdim=False):
    return _std_mean(x, dim, correction=correction, keepdim=keepdim)[0]


def _std_mean(x, dim=None, *, correction=None, keepdim=False):
    """√var with torch's derivative 0 (a subgradient) where the variance is 0 (a constant row):
    the square root of 0 is taken of a 1 and dropped, where √0's inf times the variance's zero
    derivatives gave NaN."""
    var, mean = _var_mean(x, dim, correction=correction, keepdim=keepdim)
    flat = var == 0
    return torch.where(flat, 0.0, torch.where(flat, 1.0, var).sqrt()), mean


# Core ATen turns mv and dot into an elementwise product and a sum; their derivative blocks
# would then be materialised at the product's full size. As matrix products they stay contractions.
def _mv(a, v):
    return (a @ v.unsqueeze(1)).squeeze(1)


def _dot(a, b):
    return (a.unsqueeze(0) @ b.unsqueeze(1)).reshape(())


# (tensor, value) of every .item() (a number) or .tolist() (a list) the trace took of a tensor the
# function closes over: the program keeps it, so each call compares it (hoad.cache, Entry.read_free)
VALUE_READS: list[tuple[torch.Tensor, object]] = []


class FunctionOverrides(TorchFunctionMode):
    """Functions whose ATen kernels a trace cannot follow, replaced while capture traces: the
    kernel runs before any decomposition table is consulted."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist and args and not is_fake(args[0]):
            # a closed-over tensor's values as Python numbers (no ATen op: the decomposition of
            # .item() does not see it), kept by the program like .item()'s
            values = func(*args, **(kwargs or {}))
            VALUE_READS.append((args[0], values))
            return values
        if func is torch.Tensor.__getitem__ and len(args) == 2 and _traced_scalar_indices(args[1]):
            return _indexed_by_scalar_tensors(*args)
        if func in _VALUE_EXITS and args and (func is not torch.Tensor.tolist or is_fake(args[0])):
            from hoad.source import user_frame

            line = user_frame()
            raise DataDependentControlFlowError(
                f"the function reads a tensor's values out of torch ({_VALUE_EXITS[func]})"
                f"{f' at {line}' if line else ''}: what is computed from "
                "them (numpy, Python lists) is invisible to the trace, and the program would keep the values of "
                "one call. Keep the computation in torch ops (torch.sin for np.sin, ...)")
        replacement = _FUNCTIONS.get(func)
        kept = _kept_through_write(func, args)
        before = kept.clone() if kept is not None else None
        out = (replacement or func)(*args, **(kwargs or {}))
        if before is not None:  # the written value, with the derivatives the target had before
            kept.copy_(kept.detach() + torch.where(before.isfinite(), before - before.detach(), 0))
        elif _detached(func):
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)
        if _is_detach(func) and args and _traced_float(args[0]):
            DETACHED_FROM[id(out)] = (weakref.ref(out), args[0])
        return out


def _is_traced_scalar(i) -> bool:
    return isinstance(i, torch.Tensor) and is_fake(i) and i.ndim == 0 and not i.dtype.is_floating_point \
        and i.dtype is not torch.bool


def _traced_scalar_indices(index) -> bool:
    """Whether ``index`` holds traced 0-d integer tensors (``x[x.argmax()]``) and no other tensor:
    Python indexing reads such a tensor as an int (its value, which the trace cannot know)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(_is_traced_scalar(i) for i in items) and not any(
        isinstance(i, torch.Tensor) and not _is_traced_scalar(i) or isinstance(i, list) for i in items)


def _indexed_by_scalar_tensors(x, index):
    """``x[index]`` with its traced 0-d integer tensors as one-entry index tensors (a gather, whose
    derivative follows the value), the size-1 axis they give then dropped: the shape the integers
    would give, found on a meta tensor."""
    from torch.utils._python_dispatch import _disable_current_modes

    items = index if isinstance(index, tuple) else (index,)
    with _disable_current_modes():
        shape = torch.empty(tuple(x.shape), device="meta")[tuple(0 if _is_traced_scalar(i) else i for i in items)].shape
    return x[tuple(i.reshape(1) if _is_traced_scalar(i) else i for i in items)].reshape(shape)


# id of a detached alias of a traced tensor (``.data``, ``.detach()``) -> (a weak reference to the
# alias, the tensor it aliases); cleared around each capture
DETACHED_FROM: dict[int, tuple] = {}


def _is_detach(func) -> bool:
    return getattr(func, "__self__", None) is torch._C.TensorBase.data or func is torch.Tensor.detach


def _traced_float(t) -> bool:
    return isinstance(t, torch.Tensor) and is_fake(t) and t.dtype.is_floating_point


_IN_PLACE_OPERATORS = {f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow",
                                                 "lshift", "rshift", "and", "xor", "or")} | {"__setitem__"}
# in-place ops that change a tensor's shape or strides, not its values
_IN_PLACE_VIEWS = {"t_", "transpose_", "squeeze_", "unsqueeze_", "swapdims_", "swapaxes_", "as_strided_", "resize_",
                   "resize_as_", "requires_grad_", "set_", "share_memory_", "retain_grad"}


def _in_place(func) -> bool:
    """A write of values into a tensor (``y.mul_(3)``, ``y[0] = 5``, ``y += 1``)."""
    name = getattr(func, "__name__", "")
    return ((name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_OPERATORS) \
        and name not in _IN_PLACE_VIEWS


def _kept_through_write(func, args) -> torch.Tensor | None:
    """The traced tensor an in-place write changes without autograd seeing it, if any: a write run
    under ``torch.no_grad()`` (its target), or into a ``.data`` or ``.detach()`` alias (the tensor
    aliased). Autograd keeps that tensor's derivatives and reads its new values (y.mul_(3) under
    no_grad after y = 2x: dy/dx stays 2, where hoad gave 6 under no_grad and 0 through .data)."""
    if not (_in_place(func) and args and _traced_float(args[0])):
        return None
    alias, aliased = DETACHED_FROM.get(id(args[0]), (None, None))
    if alias is not None and alias() is args[0]:
        return aliased
    return None if torch.is_grad_enabled() else args[0]


def _detached(func) -> bool:
    """Whether autograd would see ``func``'s result as a constant: ``.data``, or any op but an
    in-place write run under ``torch.no_grad()`` / ``set_grad_enabled(False)`` inside the
    function (capture itself runs with grad enabled). The write keeps its target's derivatives,
    as autograd does (embedding's max_norm renorm)."""
    if getattr(func, "__self__", None) is torch._C.TensorBase.data:
        return True
    return not torch.is_grad_enabled() and not _in_place(func)


# ways out of torch for a tensor's values: a traced (fake) tensor's .numpy() is uninitialised
# memory, which the program kept as a constant, and a closed-over tensor's would be kept stale
# (.tolist() of a closed-over tensor stays allowed, its values recorded: torch's own code reads
# index lists that way)
_VALUE_EXITS = {torch.Tensor.numpy: ".numpy()", torch.Tensor.__array__: "np.asarray() or a numpy function",
                torch.Tensor.tolist: ".tolist()"}


def _one_hot(index, num_classes=-1):
    """one_hot as a scatter of ones, whose kernel checks every class value (eager's and Inductor's
    bounds checks). torch's kernel checks them with asserts a trace drops (a class out of range
    gave a row of zeros), or, for a closed-over index, by reading its minimum into Python (a
    false data-dependence error)."""
    if num_classes == -1:
        raise DataDependentControlFlowError(
            "F.one_hot without num_classes takes the number of classes from the largest index value, a shape that "
            "depends on tensor values; pass num_classes")
    out = torch.zeros(*index.shape, num_classes, dtype=torch.int64, device=index.device)
    return out.scatter(-1, index.unsqueeze(-1), 1)


def _clamp(x, min=None, max=None):
    """clamp as wheres that take the bound outside [min, max] (NaN stays NaN; at a bound x itself,
    derivative 1, as torch's): a where's branch not taken is guarded (:func:`safe_branches`), so
    clamp(√Σd², min=ε) at a zero distance is flat, where the clamp's derivative 0 times √'s
    infinite one was NaN in every entry of the gradient."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    if any(b is not None and b != b for b in (min, max)):  # a NaN bound: NaN everywhere
        return torch.full_like(x, math.nan)
    if min is not None and max is not None and min > max:  # torch takes max everywhere (NaN stays)
        return torch.where(x.isnan(), x.detach(), max)
    outside = x.detach()  # (NaN stays NaN, a constant: torch's derivative there is 0)
    inside = None
    if max is not None:
        outside, inside = torch.where(x > max, max, outside), x <= max
    if min is not None:
        outside, inside = torch.where(x < min, min, outside), x >= min if inside is None else inside & (x >= min)
    return torch.where(inside, x, outside)


def _gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    """torch's Gaussian negative log-likelihood without its Python check that var >= 0 (an `if` on
    tensor values, refused as control flow). var is clamped at eps as torch does, in place under
    no_grad: the clamp has the derivative 1 (a value with the clamp's result and var's derivatives)."""
    if isinstance(var, float):
        var = var * torch.ones_like(input)
    elif var.shape != input.shape and input.shape[:-1] == var.shape:
        var = var.unsqueeze(-1)
    var = var + (var.clamp(min=eps) - var).detach()
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


_FUNCTIONS = {torch.nn.functional.one_hot: _one_hot, torch.nn.functional.gaussian_nll_loss: _gaussian_nll_loss}


# Smooth functions that core ATen writes with kinks cancelling in value only (abs, min, |d|²):
# hoad differentiates the pieces, so each is written here with branches that are the function
# itself, every derivative exact at the seam. The branch not taken reads a safe value (0, 1), so
# its inf or NaN never reaches a gradient in reverse mode either.

def _log_sigmoid_forward(x):
    """log σ(x) as x - log1p(eˣ) below 0 and -log1p(e⁻ˣ) above (neither exp overflows); core's
    min(0, x) - log1p(e^-|x|) had Hessian 0 at x = 0, not -1/4."""
    below = x < 0
    lo, hi = torch.where(below, x, 0.0), torch.where(below, 0.0, x)
    out = torch.where(below, lo - torch.log1p(torch.exp(lo)), -torch.log1p(torch.exp(-hi)))
    return out, x.new_zeros((0,))


def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    """s·x above 0, s·α(e^(x·i) - 1) below, and at 0 what torch differentiates there: the
    negative branch's slope s·α·i and the positive branch's zero curvature (core's where took the
    negative branch at every order: ELU's Hessian was 1 at 0, torch's 0)."""
    below = x < 0
    negative = (torch.exp(torch.where(below, x, 0.0) * input_scale) - 1) * (alpha * scale)
    at_zero = x * (alpha * scale * input_scale)
    return torch.where(x > 0, x * scale, torch.where(below, negative, at_zero))


def _reduce_loss(loss, reduction: int):
    return loss.mean() if reduction == 1 else loss.sum() if reduction == 2 else loss


def _smooth_l1_loss(x, target, reduction=1, beta=1.0):
    """d²/(2β) inside |d| < β with d² = d·d (core's |d|² had Hessian 0 at d = 0, not 1/β)."""
    d = x - target
    z = d.abs()
    loss = z if beta == 0 else torch.where(z < beta, 0.5 * d * d / beta, z - 0.5 * beta)
    return _reduce_loss(loss, reduction)


def _huber_loss(x, target, reduction=1, delta=1.0):
    """d²/2 inside |d| <= δ with d² = d·d (core's |d|·|d| had Hessian 0 at d = 0, not 1). At
    |d| = δ itself the quadratic piece, whose curvature 1 torch's backward gives there (smooth L1
    takes the linear one: its backward tests |d| < β)."""
    d = x - target
    z = d.abs()
    return _reduce_loss(torch.where(z <= delta, 0.5 * d * d, delta * (z - 0.5 * delta)), reduction)


def _clamped_log(p, complement: bool = False):
    """max(log p, -100) (max(log1p(-p), -100) for the complement), torch's clamps in binary
    cross-entropy, with the log read at a safe value where its argument is 0: the clamped value
    has derivative 0 there (log's inf times it was NaN, in both modes)."""
    taken = p < 1 if complement else p > 0
    safe = torch.where(taken, p, 0.0 if complement else 1.0)
    log = torch.log1p(-safe) if complement else torch.log(safe)
    return torch.where(taken, log.clamp_min(-100.0), -100.0)


def _binary_cross_entropy(p, target, weight=None, reduction=1):
    """-(t log p + (1 - t) log(1 - p)), each log clamped at -100 as torch does. At p = 0 or 1 the
    clamped log contributes no derivative and the other term its own (torch's backward divides by
    max(p(1 - p), 1e-12) instead)."""
    loss = -(target * _clamped_log(p) + (1 - target) * _clamped_log(p, complement=True))
    return _reduce_loss(loss if weight is None else loss * weight, reduction)


def _x_log(log):
    def x_log(a, b):
        """x·log(y) (or log1p(y)), 0 where x = 0. Core wrote where(x = 0, 0, x·log y), whose
        derivative in x is 0 at x = 0 (torch: log y), and NaN in reverse mode at y = 0 (0·log 0).
        Here y is replaced by a safe value only where x = 0 and log y is not finite (torch: 0)."""
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return NotImplemented
        dtype = torch.result_type(a, b)  # (Poisson counts: xlogy(k int64, λ float64))
        if not dtype.is_floating_point:
            return NotImplemented
        a, b = a.to(dtype), b.to(dtype)
        finite = torch.isfinite(log(b))
        safe = 1.0 if log is torch.log else 0.0
        out = a * log(torch.where((a == 0) & ~finite, safe, b))
        return torch.where(torch.isnan(b), float("nan"), out)

    return x_log


def _safe_softmax(x, dim, dtype=None):
    """Softmax that is 0 on rows where every entry is -inf (attention rows that see no key).

    Core ATen's decomposition computes the softmax of such a row (NaN) and then replaces it with
    zeros: the value is right but NaN flows through every derivative of that row. Here the row is
    made finite before the softmax, so no NaN is ever computed.
    """
    if dtype is not None:
        x = x.to(dtype)
    masked = (x == -math.inf).all(dim, keepdim=True)
    finite = torch.where(masked, torch.zeros((), dtype=x.dtype, device=x.device), x)
    return torch.where(masked, torch.zeros((), dtype=x.dtype, device=x.device), torch.softmax(finite, dim))


def _contiguous_strides(size) -> list[int]:
    strides, step = [], 1
    for n in reversed(list(size)):
        strides.append(step)
        step *= max(int(n), 1)
    return strides[::-1]


# how many as_strided calls on (views of) the traced inputs capture has turned into reads of the
# tensor's own entries: the program then assumes its inputs own their storage
STRIDED_READS = [0]
# the storages of the traced inputs, one set per capture under way (capture pushes and pops it)
INPUT_STORAGES: list[set[int]] = []


def _reads_input(x) -> bool:
    return bool(INPUT_STORAGES) and x.untyped_storage()._cdata in INPUT_STORAGES[-1]


def _own_positions(x, size, stride, storage_offset):
    """The positions in x's own entries that a strided view of x's storage reads, or None where it
    reads outside them (or x is not contiguous, its storage order unlike its entries')."""
    if not x.is_contiguous():
        return None
    size, stride = [int(n) for n in size], [int(s) for s in stride]
    start = (x.storage_offset() if storage_offset is None else int(storage_offset)) - x.storage_offset()
    if any(s < 0 for s in stride):
        return None
    last = start + sum((n - 1) * s for n, s in zip(size, stride))
    if math.prod(size) and (start < 0 or last >= x.numel()):
        return None
    return size, stride, start


def _copy(x, src, non_blocking=False):
    """The functional ``copy`` (functionalization's form of ``copy_`` into a fresh buffer: circular
    padding's) as src broadcast to x's shape in x's dtype: torch's autograd has no formula for
    ``copy``, so training through a program holding it failed ("derivative for aten::copy is not
    implemented")."""
    return src.to(device=x.device, dtype=x.dtype).expand(x.shape).clone()


def _flat_strided_index(size, stride, offset: int, device):
    """The flat positions a strided view reads: offset + Σ i_k·stride_k."""
    index = torch.full(size, offset, dtype=torch.long, device=device)
    for k, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[k] = n
        index = index + torch.arange(n, device=device).reshape(shape) * s
    return index


def _as_strided(x, size, stride, storage_offset=None):
    """as_strided of a contiguous tensor (decompositions such as group_norm's emit it on their
    intermediates) as what it reads: a view when the strides are those of ``size`` laid out
    densely, else the entries at offset + Σ i_k·stride_k of the flat tensor, a gather with a
    constant index. A view that reads outside x's own entries, or of a non-contiguous x, reads
    storage, not entries: left to the rule table (unsupported)."""
    positions = _own_positions(x, size, stride, storage_offset)
    if positions is None:
        return NotImplemented
    if _reads_input(x):
        STRIDED_READS[0] += 1  # capture records that the program assumes its inputs own their storage
    size, stride, offset = positions
    if offset == 0 and math.prod(size) == x.numel() and stride == _contiguous_strides(size):
        return x.view(size)
    return x.reshape(-1)[_flat_strided_index(size, stride, offset, x.device)]


# ---------------------------------------------------------------------------------------------
# Issue 17: ops written as ops with rules. Each keeps what the op computes, exactly; where its
# derivative at a kink follows a convention (a norm at zero, ties of a maximum), it is torch's.

# ops traced as themselves inside their own decomposition (see _op_itself)
_AS_ITSELF: set = set()


def _op_itself(op, *args):
    """``op`` called inside its own decomposition, traced as one node: for the outputs that carry
    no derivative (frexp's exponent, embedding_bag's bookkeeping), on values that carry none."""
    _AS_ITSELF.add(op)
    try:
        return op(*args)
    finally:
        _AS_ITSELF.discard(op)


def _frexp(x):
    """(mantissa, exponent) with mantissa = x·2^-e, e piecewise constant. The scale is two powers
    of two, each finite (2^-e alone overflows for subnormal x), so the value is exact."""
    if aten.frexp.Tensor in _AS_ITSELF:
        return NotImplemented
    _mantissa, e = _op_itself(aten.frexp.Tensor, x.detach())
    half = torch.div(e, -2, rounding_mode="floor")
    return x * torch.exp2(half.to(x.dtype)) * torch.exp2((-e - half).to(x.dtype)), e


def _norm(d, p: float, dim: int | list[int], keepdim: bool = False):
    """The p-norm of ``d`` along ``dim`` (vector norms, the distance ops), with torch's
    derivative 0 (a subgradient) where every entry is zero, and for p != 2 at each zero entry too
    (|d|^p is singular there for p < 1, torch's backward then gives 0): the singular branches are
    computed of ones and dropped by a where(), so no inf or NaN reaches a derivative. (Core
    ATen's pow(Σ x², 0.5) had derivative 0 · inf = NaN at a zero vector: ‖x − y‖ where x = y.)"""
    if p == 0:
        return (d != 0).sum(dim, keepdim=keepdim, dtype=d.dtype)
    if math.isinf(p):
        return d.abs().amax(dim, keepdim) if p > 0 else d.abs().amin(dim, keepdim)
    one = torch.ones((), dtype=d.dtype, device=d.device)
    zero = torch.zeros((), dtype=d.dtype, device=d.device)
    if p == 2:
        total = (d * d).sum(dim, keepdim=True)
    else:
        entry = d == 0
        total = torch.where(entry, zero, torch.where(entry, one, d).abs() ** p).sum(dim, keepdim=True)
    empty = total == 0
    n = torch.where(empty, one, total) ** (1 / p)
    n = torch.where(empty, zero, n)
    return n if keepdim else n.squeeze(dim)


# a 2-norm squared (an RBF kernel's cdist(x, y) ** 2, ‖x‖² written as torch.norm(x) ** 2) is the
# sum of squares, smooth where the norm is not: its Hessian at a zero difference is 2I, while the
# chain rule through the norm's subgradient 0 gave 0. After capture, the square of what _norm
# returns (through squeezes and views) is rewritten to the sum of squares it took the root of.
_LAYOUT_OPS = (aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, aten.view.default, aten.reshape.default,
               aten.unsqueeze.default)


def squares_of_norms(gm) -> None:
    """Rewrite, in place, ``norm ** 2`` (and ``norm * norm``) of :func:`_norm`'s p = 2 pattern
    ``where(total = 0, 0, where(total = 0, 1, total) ** 0.5)`` to ``total``."""
    for node in list(gm.graph.nodes):
        total = _root_of_norm(node)
        if total is None:
            continue
        chain, frontier = [], [(node, [])]
        while frontier:
            value, path = frontier.pop()
            for user in list(value.users):
                if user.target in _LAYOUT_OPS and user.args[0] is value:
                    frontier.append((user, path + [user]))
                elif (user.target is aten.pow.Tensor_Scalar and user.args[0] is value and user.args[1] == 2) or (
                        user.target is aten.mul.Tensor and user.args[0] is value and user.args[1] is value):
                    chain.append((user, path))
        for square, path in chain:
            with gm.graph.inserting_before(square):
                out = total
                for step in path:
                    out = gm.graph.node_copy(step, lambda a, step=step, out=out: out if a is step.args[0] else a)
            square.replace_all_uses_with(out)
    gm.graph.eliminate_dead_code()
    gm.recompile()


# where(c, a, b) whose untaken entries compute an infinity (where(eye, 0, 1 / r) with r_ii = 0, a
# masked Coulomb sum; where(x > 0, log x, 0)): the values are right and forward mode selects, but
# the adjoint form's first sweep multiplies the untaken entries' zero cotangent by that infinity
# (NaN, as torch's own backward). The singular ops of a branch read a safe value on the entries
# the where does not take, as the double-where idiom writes by hand: the same function, exactly.
_SAFE = {aten.reciprocal.default: 1.0, aten.log.default: 1.0, aten.log2.default: 1.0, aten.log10.default: 1.0,
         aten.log1p.default: 0.0, aten.sqrt.default: 1.0, aten.rsqrt.default: 1.0, aten.acos.default: 0.0,
         aten.asin.default: 0.0, aten.atanh.default: 0.0, aten.acosh.default: 2.0, aten.erfinv.default: 0.0,
         aten.lgamma.default: 1.0, aten.digamma.default: 1.0, aten.div.Tensor: 1.0, aten.pow.Tensor_Scalar: 1.0,
         aten.pow.Tensor_Tensor: 1.0}
# (a where inside a branch is pointwise too: xlogy's decomposition guards its NaN with one)
_POINTWISE = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
              aten.add.Scalar, aten.mul.Scalar, aten.rsub.Scalar, aten.pow.Tensor_Scalar, aten.where.self)


def safe_branches(gm) -> None:
    """Rewrite, in place, each singular op in a branch of a ``where`` (a region of pointwise ops
    of the where's shape that only the where reads) to read ``where(taken, u, safe)``."""
    from hoad.rules import elementwise

    pointwise = set(_POINTWISE) | set(elementwise.RULES)
    changed = False
    # the branches taken under the same condition, of wheres of one shape, share a region: a
    # distance read by two masked pair terms (Coulomb and Lennard-Jones over r = √Σd²) is the
    # region of both, and its √ at r = 0 is guarded too (it was NaN in reverse mode)
    groups: dict[tuple, list] = {}
    for node in list(gm.graph.nodes):
        if node.target is aten.where.self:
            cond, *branches = node.args
            for k, branch in enumerate(branches):
                groups.setdefault((cond, k, _shape(node)), []).append((node, branch))
    for (cond, k, _), members in groups.items():
        wheres = [w for w, _b in members]
        region = _branch_region([b for _w, b in members], wheres, pointwise, k)
        position = {n: j for j, n in enumerate(gm.graph.nodes)}
        region.sort(key=position.get)
        first = min(wheres, key=position.get)
        at = 0
        while at < len(region):  # (the live region: a guarded copy replaces its original in place)
            op = region[at]
            at += 1
            for i in _singular_inputs(op):
                u = op.args[i]
                if _already_safe(u, cond, k) or not _fits(cond, u):
                    continue
                tail = _tail(op, region)
                if _reads(cond, op) or any(not all(u in region or _as_branch(u, n, wheres, k) for u in n.users)
                                           for n in tail):
                    _guard_a_copy(gm.graph, op, i, tail, region, wheres, first, cond, k)
                else:
                    op.update_arg(i, _where_safe(gm.graph, op, cond, k, u, _SAFE[op.target]))
                changed = True
    if changed:
        _stable_sort(gm.graph)
        gm.graph.lint()
        gm.recompile()


def _guard_a_copy(graph, op, i: int, tail: list, region: list, wheres: list, first, cond, k: int) -> None:
    """The wheres read a copy of ``op`` and of the region after it (``tail``), ``op`` reading a
    guarded argument, where the condition is computed from ``op`` or its value is read by one
    (nan_to_num(1 / r) masks 1 / r by its own isinf): the originals keep their entries for the
    conditions (booleans, not differentiated). The region is updated to the copies."""
    copies: dict = {}
    with graph.inserting_before(first):
        for node in tail:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: copies.get(a, a))
            if node is op:
                args = list(args)
                args[i] = _where_safe(graph, None, cond, k, op.args[i], _SAFE[op.target])
            copies[node] = traced_call(graph, node.target, tuple(args), dict(kwargs))
    for w in wheres:
        w.args = fx.node.map_arg(w.args, lambda a: copies.get(a, a))
    region[:] = [copies.get(n, n) for n in region]


def _tail(op, region: list) -> list:
    """``op`` and the nodes of ``region`` that read it, directly or not, in ``region``'s order."""
    reached = {op}
    for n in region:
        if any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    return [n for n in region if n in reached]


def _reads(node, op) -> bool:
    """``node`` is computed from ``op``."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is op:
            return True
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return False


def _stable_sort(graph) -> None:
    """Reorder ``graph``'s nodes, in place, so each follows its inputs, keeping the order
    otherwise (guarded copies were inserted before the first where that reads them)."""
    nodes = list(graph.nodes)
    index = {n: j for j, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [index[n] for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        order.append(n)
        for user in n.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, index[user])
    if len(order) != len(nodes):
        raise HoadInternalError("safe_branches made a cycle in the captured graph")
    for before, n in zip(order, order[1:]):
        before.append(n)


def _where_safe(graph, op, cond, k: int, u, value: float):
    """``where(taken, u, value)`` before ``op`` (where the graph inserts, for None), with the
    values (meta) later passes read: taken is ``cond`` for the where's first branch, ``¬cond``
    for its second."""
    val = u.meta["val"]
    with graph.inserting_before(op) if op is not None else contextlib.nullcontext():
        taken = cond if k == 0 else traced_call(graph, aten.logical_not.default, (cond,))
        scalar = traced_call(graph, aten.scalar_tensor.default, (value,), {"dtype": val.dtype, "device": val.device})
        return traced_call(graph, aten.where.self, (taken, u, scalar))


def _branch_region(branches: list, wheres: list, pointwise, k: int) -> list:
    """The pointwise nodes of the ``wheres``' shape that compute ``branches`` (the wheres' branch k)
    and that nothing but the region and the wheres' branch k reads (a value read elsewhere must keep
    its entries: where(x > 1, √x, 2√x) reads √x as both branches, and the second's region took √x,
    so the first branch read its guarded 1)."""
    shape = _shape(wheres[0])
    region, todo = [], [b for b in branches if hasattr(b, "op") and b.op == "call_function"]
    while todo:
        node = todo.pop()
        if node in region or node.target not in pointwise or _shape(node) != shape or shape is None:
            continue
        region.append(node)
        todo += [a for a in node.all_input_nodes if a.op == "call_function"]
    inside = set(region)
    while True:  # drop nodes read from outside, and what only they led to
        outside = [n for n in region if not all(u in inside or _as_branch(u, n, wheres, k) or _condition_of(u)
                                                for u in n.users)]
        if not outside:
            return region
        for n in outside:
            region.remove(n)
            inside.discard(n)


def _as_branch(user, node, wheres: list, k: int) -> bool:
    """``user`` is one of ``wheres`` and reads ``node`` as its branch k only."""
    if user not in wheres:
        return False
    cond, *branches = user.args
    return branches[k] is node and cond is not node and branches[1 - k] is not node


def _condition_of(user, depth: int = 8) -> bool:
    """``user`` is boolean (``isinf(1 / r)``), or only leads to booleans (``|1 / r| ≠ ∞``): a
    condition, which a guarded copy of the branch leaves its entries (:func:`_guard_a_copy`). So
    is a detach (clamp's value outside its bounds, :func:`_clamp`): a constant, not differentiated."""
    if user.target is aten.detach.default:
        return True
    val = user.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype is torch.bool:
        return True
    return depth > 0 and bool(user.users) and all(_condition_of(u, depth - 1) for u in user.users)


def _singular_inputs(op) -> list[int]:
    """Positions of ``op``'s arguments at which it can be infinite (its singular points)."""
    if op.target not in _SAFE:
        return []
    if op.target is aten.div.Tensor:
        return [1] if hasattr(op.args[1], "op") else []
    if op.target is aten.pow.Tensor_Scalar:
        p = op.args[1]
        return [0] if isinstance(p, (int, float)) and (p < 0 or p != int(p)) else []
    return [0]


def _already_safe(u, cond, k: int) -> bool:
    """u is where(cond, x, …) for the first branch, where(cond, …, x) or where(¬cond, x, …) for the second."""
    if getattr(u, "target", None) is not aten.where.self:
        return False
    c = u.args[0]
    if k == 0:
        return c is cond
    return c is cond or (getattr(c, "target", None) is aten.logical_not.default and c.args[0] is cond)


def _fits(cond, u) -> bool:
    """where(cond, u, safe) has u's shape."""
    a, b = _shape(cond), _shape(u)
    if a is None or b is None:
        return False
    try:
        return tuple(torch.broadcast_shapes(a, b)) == tuple(b)
    except RuntimeError:
        return False


def _shape(node):
    val = getattr(node, "meta", {}).get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _root_of_norm(node):
    """``total`` where ``node`` is ``where(total == 0, 0, where(total == 0, 1, total) ** 0.5)``."""
    if not (getattr(node, "target", None) is aten.where.self and len(node.args) == 3):
        return None
    empty, _zero, root = node.args
    if not (getattr(root, "target", None) is aten.pow.Tensor_Scalar and root.args[1] == 0.5):
        return None
    inner = root.args[0]
    if not (getattr(inner, "target", None) is aten.where.self and inner.args[0] is empty):
        return None
    total = inner.args[2]
    if not (getattr(empty, "target", None) is aten.eq.Scalar and empty.args[0] is total and empty.args[1] == 0):
        return None
    return total


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if x.is_complex():  # refused later by name; the core decomposition keeps the op's meaning
        return NotImplemented
    if dtype is not None:
        x = x.to(dtype)
    if x.ndim == 0:
        x, dim, squeeze = x.reshape(1), [0], True
    else:
        dims = [dim] if isinstance(dim, int) else list(dim) if dim is not None else []
        dim, squeeze = [d % x.ndim for d in dims] or list(range(x.ndim)), False
    n = _norm(x, float(ord), dim, keepdim)
    return n.reshape(()) if squeeze else n


# Piecewise-linear activations with torch's derivative at their kinks: 0 there (its backward
# tests min < x < max strictly), where clamp's decomposition gave 1 (relu6 at 0 and 6, hardtanh
# at ±1) and hardsigmoid's and hardswish's the inner piece's slope. Each end is a constant branch.
def _hardtanh(x, min_val=-1.0, max_val=1.0):
    lo, hi = (torch.full((), v, dtype=x.dtype, device=x.device) for v in (min_val, max_val))
    return torch.where(x <= min_val, lo, torch.where(x >= max_val, hi, x))


def _hardsigmoid(x):
    zero, one = torch.zeros((), dtype=x.dtype, device=x.device), torch.ones((), dtype=x.dtype, device=x.device)
    return torch.where(x <= -3, zero, torch.where(x >= 3, one, x / 6 + 0.5))


def _hardswish(x):
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(x <= -3, zero, torch.where(x >= 3, x, x * (x + 3) / 6))


def _dist(x, y, p=2):
    d = (x - y).reshape(-1)
    return _norm(d, float(p), 0)


def _cdist(x1, x2, p: float, compute_mode=None):
    """Distances between the rows of x1 and x2 by differences (torch's own path for small inputs
    and for every p but 2): exact at coincident rows."""
    return _norm(x1.unsqueeze(-2) - x2.unsqueeze(-3), float(p), -1)


def _pdist(x, p: float = 2.0):
    n = x.shape[0]
    i, j = torch.triu_indices(n, n, 1, device=x.device)
    return _norm(x[i] - x[j], float(p), -1)


def _addbmm(x, b1, b2, *, beta=1, alpha=1):
    """beta·x + alpha·Σ_b b1[b] @ b2[b], the batch folded into the contraction: one mm."""
    out = b1.permute(1, 0, 2).reshape(b1.shape[1], -1) @ b2.reshape(-1, b2.shape[2])
    if alpha != 1:
        out = out * alpha
    if beta == 0:  # x is ignored, NaN included
        return out
    return out + (x if beta == 1 else x * beta)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """Each input unsqueezed at its expand dims, multiplied, summed over sumdim (F.bilinear's
    x1ᵀ A x2): one einsum, which capture splits into two-operand contractions. A dim no input
    has (expanded in all three) is left to the table."""
    rank = i1.ndim + len(expand1)
    terms = ["".join(_LETTERS[d] for d in range(rank) if d not in expand) for expand in (expand1, expand2, expand3)]
    if set("".join(terms)) != set(_LETTERS[:rank]):
        return NotImplemented
    result = "".join(_LETTERS[d] for d in range(rank) if d not in sumdim)
    return torch.einsum(f"{','.join(terms)}->{result}", i1, i2, i3)


def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    """x with the entries a strided view reads replaced by src: an index_put into the flat x.
    Overlapping views (an entry written twice) and non-contiguous x are left unsupported."""
    positions = _own_positions(x, size, stride, storage_offset)
    if positions is None or not _disjoint(*positions[:2]):
        return NotImplemented
    if _reads_input(x):
        STRIDED_READS[0] += 1
    size, stride, offset = positions
    index = _flat_strided_index(size, stride, offset, x.device)
    return x.reshape(-1).index_put((index.reshape(-1),), src.reshape(-1)).view(x.shape)


def _disjoint(size, stride) -> bool:
    """Whether a strided view reads every entry once (checked on the strides, no tensor values)."""
    offsets = {0}
    for n, s in zip(size, stride):
        offsets = {o + i * s for o in offsets for i in range(n)}
    return len(offsets) == math.prod(size)


def _put(x, index, source, accumulate=False):
    """put writes into the flattened x: an index_put of the flat tensor."""
    flat = x.reshape(-1).index_put((index.reshape(-1),), source.reshape(-1), accumulate)
    return flat.view(x.shape)


def _masked_gather(values, mask, dim: int):
    """values' entries along ``dim`` taken in order by the True entries of ``mask`` (which spans
    the dims from ``dim`` on): the k-th True entry reads entry k. False entries read a valid entry
    that a where() then drops. Shape: values' with ``dim`` replaced by mask's dims."""
    n = values.shape[dim]
    pos = mask.reshape(-1).to(torch.long).cumsum(0) - 1
    pos = pos.clamp(0, max(n - 1, 0))
    taken = values.index_select(dim, pos)
    return taken.reshape(list(values.shape[:dim]) + list(mask.shape) + list(values.shape[dim + 1:]))


def _masked_scatter(x, mask, source):
    """x with its masked entries replaced, in order, by source's first entries."""
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    m, xb = mask.expand(shape), x.expand(shape)
    if source.numel() == 0:
        return xb.clone()
    return torch.where(m, _masked_gather(source.reshape(-1), m, 0), xb)


def _index_put(x, indices, values, accumulate=False):
    """index_put with one boolean mask (its number of writes depends on the mask's values): each
    True entry reads the next row of values, or the one broadcast row. Other indices: the rule."""
    masks = [k for k, i in enumerate(indices) if i is not None]
    if len(masks) != 1 or indices[masks[0]].dtype != torch.bool:
        return NotImplemented
    if not 0 < indices[masks[0]].ndim <= x.ndim - masks[0]:
        return NotImplemented
    p, mask = masks[0], indices[masks[0]]
    k = mask.ndim
    rest = list(x.shape[p + k:])
    count = values.shape[values.ndim - len(rest) - 1] if values.ndim > len(rest) else 1
    rows = values.expand(list(x.shape[:p]) + [count] + rest)
    taken = _masked_gather(rows, mask, p)
    m = mask.reshape([1] * p + list(mask.shape) + [1] * len(rest))
    if accumulate:
        return x + torch.where(m, taken, torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.where(m, taken.to(x.dtype), x)


def _scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    """scatter_reduce with "prod", without division (exact where src has zeros): each output
    entry multiplies the src entries aimed at it, all others replaced by 1, along a new axis.
    Other reductions: the rule (hoad/rules/indexing.py)."""
    if reduce != "prod":
        return NotImplemented
    if x.ndim == 0:
        return _scatter_reduce(x.reshape(1), 0, index.reshape(1), src.reshape(1), reduce,
                               include_self=include_self).reshape(())
    d = dim % x.ndim
    m = x.shape[d]
    s = src[tuple(slice(0, n) for n in index.shape)]
    hit = index.movedim(d, -1).unsqueeze(-2) == torch.arange(m, device=x.device).unsqueeze(-1)   # (..., m, n)
    one = torch.ones((), dtype=x.dtype, device=x.device)
    prod = torch.where(hit, s.movedim(d, -1).unsqueeze(-2), one).prod(-1).movedim(-1, d)
    touched = hit.any(-1).movedim(-1, d)
    spec = []
    for a in reversed(range(x.ndim)):
        spec += [0, 0 if a == d else x.shape[a] - index.shape[a]]
    if any(spec):
        prod = aten.constant_pad_nd(prod, spec, 1.0)
        touched = aten.constant_pad_nd(touched.to(torch.uint8), spec, 0).to(torch.bool)
    if include_self:
        return x * prod
    return torch.where(touched, prod, x)


def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """index_reduce is scatter_reduce with the index repeated along every other dim."""
    if x.ndim == 0:
        return torch.scatter_reduce(x.reshape(1), 0, index.reshape(1), source.reshape(1), reduce,
                                    include_self=include_self).reshape(())
    d = dim % x.ndim
    shape = [1] * source.ndim
    shape[d] = -1
    index = index.reshape(shape).expand(source.shape)
    return torch.scatter_reduce(x, d, index, source, reduce, include_self=include_self)


_SEGMENT_REDUCE = {"sum": "sum", "mean": "sum", "max": "amax", "min": "amin", "prod": "prod"}
_SEGMENT_EMPTY = {"sum": 0.0, "mean": 0.0, "max": -math.inf, "min": math.inf, "prod": 1.0}


def _segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """Segments along ``axis`` reduced by a scatter_reduce to segment ids found from the lengths
    (or offsets); entries outside every segment go to one extra id, dropped. ``initial`` joins
    every segment (and fills the empty ones); a mean divides by the segment's own count."""
    if indices is not None or reduce not in _SEGMENT_REDUCE:
        return NotImplemented
    a = axis % data.ndim
    if offsets is None:
        ends = lengths.cumsum(-1)
        offsets = torch.cat([torch.zeros_like(ends[..., :1]), ends], -1)
    S, n = offsets.shape[-1] - 1, data.shape[a]
    at = torch.arange(n, device=data.device)
    ids = (offsets[..., :-1].unsqueeze(-1) <= at).sum(-2) - 1                   # (..., n)
    inside = (at >= offsets[..., :1]) & (at < offsets[..., -1:])
    ids = torch.where(inside, ids, S)
    ids = ids.reshape(list(ids.shape) + [1] * (data.ndim - a - 1)).expand(data.shape)
    shape = list(data.shape)
    shape[a] = S + 1
    fill = _SEGMENT_EMPTY[reduce] if initial is None else float(initial)
    start = torch.full(shape, fill, dtype=data.dtype, device=data.device)
    out = torch.scatter_reduce(start, a, ids, data, _SEGMENT_REDUCE[reduce], include_self=initial is not None)
    if reduce == "mean":
        count = torch.zeros(shape, dtype=data.dtype, device=data.device).scatter_add(a, ids, torch.ones_like(data))
        if initial is not None:
            count = count.clamp(min=1)
        out = out / count
    return out.narrow(a, 0, S)


_BAG_SUM, _BAG_MEAN, _BAG_MAX = 0, 1, 2


def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1, *, op):
    """Bags of embedding rows summed, averaged or maxed: rows gathered (an embedding) and reduced
    per bag by an index_add or a scatter_reduce; padding rows take no part. The bookkeeping
    outputs (offset2bag, bag sizes, max indices) carry no derivative: the op itself computes them."""
    if op in _AS_ITSELF or indices.ndim != 1:
        return NotImplemented
    n, B = indices.shape[0], offsets.shape[0] - (1 if include_last_offset else 0)
    at = torch.arange(n, device=weight.device)
    ids = (offsets[:B].unsqueeze(-1) <= at).sum(0) - 1
    end = offsets[B] if include_last_offset else n
    used = (at >= offsets[0]) & (at < end)
    if padding_idx >= 0:
        used = used & (indices != padding_idx)
    ids = torch.where(used, ids, B)
    rows = aten.embedding.default(weight, indices, -1, scale_grad_by_freq)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(1)
    D = weight.shape[1]
    if mode == _BAG_MAX:
        start = torch.zeros(B + 1, D, dtype=weight.dtype, device=weight.device)
        out = start.scatter_reduce(0, ids.unsqueeze(1).expand(n, D), rows, "amax", include_self=False)
    else:
        out = torch.zeros(B + 1, D, dtype=rows.dtype, device=weight.device).index_add(0, ids, rows)
        if mode == _BAG_MEAN:
            count = torch.zeros(B + 1, dtype=weight.dtype, device=weight.device).index_add(
                0, ids, torch.ones(n, dtype=weight.dtype, device=weight.device))
            out = out / count.clamp(min=1).unsqueeze(1)
    psw = None if per_sample_weights is None else per_sample_weights.detach()
    _out, offset2bag, bag_size, max_indices = _op_itself(
        op, weight.detach(), indices, offsets, scale_grad_by_freq, mode, sparse, psw, include_last_offset, padding_idx)
    return out[:B], offset2bag, bag_size, max_indices


def _rrelu(x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    """Evaluation: leaky_relu with the mean slope. Training draws each negative entry's slope
    (aten.uniform): capture then refuses the function as random."""
    if not training:
        return torch.where(x > 0, x, x * ((lower + upper) / 2)), noise.clone()
    slope = aten.uniform.default(torch.empty_like(x), lower, upper)
    negative = x <= 0
    return torch.where(negative, x * slope, x), torch.where(negative, slope, torch.ones_like(slope))


def _grid_unnormalize(coords, size: int, align_corners: bool):
    mul = (size * 0.5 - 0.5) if align_corners else (size * 0.5)
    return coords * mul + (size * 0.5 - 0.5)


def _grid_reflect(coords, twice_low: int, twice_high: int):
    """Coordinates reflected until they fall in [low, high] (the bounds given doubled)."""
    if twice_low == twice_high:
        return torch.zeros_like(coords)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    dist = (coords - low).abs()
    extra = torch.fmod(dist, span)
    flips = (dist / span).floor().to(torch.int64)
    return torch.where(flips % 2 == 0, extra + low, span + low - extra)


def _grid_source(coords, size: int, padding_mode: int, align_corners: bool):
    c = _grid_unnormalize(coords, size, align_corners)
    if padding_mode == 1:  # border
        return c.clamp(0, size - 1)
    if padding_mode == 2:  # reflection
        c = _grid_reflect(c, 0, 2 * (size - 1)) if align_corners else _grid_reflect(c, -1, 2 * size - 1)
        return c.clamp(0, size - 1)
    return c


def _grid_sampler(a, grid, interpolation_mode: int = 0, padding_mode: int = 0, align_corners: bool = False):
    """Bilinear or trilinear (or nearest) sampling of a (N, C, *spatial) at grid (N, *out, k)
    points, k = 2 or 3: 2ᵏ gathers from the flattened image, each sample's from its own, weighted
    by products of the fractional parts (constant in a, polynomial in the grid between the
    integer crossings). Corners outside the image contribute nothing (a where, so no inf or NaN
    of a reaches through a zero weight). torch's 2-D decomposition indexes a by
    ``arange(N)`` instead, which ties the samples together (a false BatchCouplingError); its
    bicubic mode is kept."""
    k = grid.shape[-1]
    if interpolation_mode not in (0, 1):
        if k == 2:
            from torch._decomp.decompositions import _grid_sampler_2d as grid_sampler_2d

            return grid_sampler_2d(a, grid, interpolation_mode, padding_mode, align_corners, _expand_grid=False)
        return NotImplemented
    N, C = a.shape[:2]
    sizes = list(a.shape[2:])
    out = [N, C] + list(grid.shape[1:-1])
    flat = a.reshape(N, C, -1)
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    # grid[..., 0] indexes the last axis of a, grid[..., 1] the one before: per axis of a, in order
    src = [_grid_source(grid[..., k - 1 - j], sizes[j], padding_mode, align_corners) for j in range(k)]
    strides = [math.prod(sizes[j + 1:]) for j in range(k)]

    def axis(c, j):
        """Whether integer coordinate c is inside axis j, and its offset in the flat image."""
        return (c >= 0) & (c < sizes[j]), c.clamp(0, sizes[j] - 1).to(torch.int64) * strides[j]

    def picked(per_axis):
        """a at one corner, given (inside, offset) per axis, and whether the corner is inside."""
        index = sum(i for _inside, i in per_axis)
        inside = functools.reduce(operator.and_, [inside for inside, _i in per_axis])
        index = index.reshape(N, 1, -1).expand(N, C, index[0].numel())
        return flat.gather(2, index).reshape(out), inside.unsqueeze(1)

    if interpolation_mode == 1:  # nearest
        values, inside = picked([axis(c.round(), j) for j, c in enumerate(src)])
        return torch.where(inside, values, zero)
    lo = [c.floor() for c in src]
    ends = [(axis(l, j), axis(l + 1, j)) for j, l in enumerate(lo)]
    weights = [((l + 1 - c), (c - l)) for c, l in zip(src, lo)]
    total = None
    for bits in range(2 ** k):
        up = [(bits >> (k - 1 - j)) & 1 for j in range(k)]
        values, inside = picked([ends[j][u] for j, u in enumerate(up)])
        w = functools.reduce(operator.mul, [weights[j][u] for j, u in enumerate(up)])
        term = torch.where(inside, values * w.unsqueeze(1), zero)
        total = term if total is None else total + term
    return total


def _coverage_decompositions() -> dict:
    """Issue 17's decompositions: torch's own where they are exact and small, else those above."""
    table = dict(get_decompositions([
        aten.view_copy, aten.permute_copy, aten.narrow_copy, aten.unbind_copy, aten.as_strided_copy,
        aten.addmv, aten.ldexp,
    ]))
    table.update({
        aten.frexp.Tensor: _frexp,
        aten.dist.default: _dist,
        aten._cdist_forward.default: _cdist,
        aten._pdist_forward.default: _pdist,
        aten.addbmm.default: _addbmm,
        aten._trilinear.default: _trilinear,
        aten.as_strided_scatter.default: _as_strided_scatter,
        aten.put.default: _put,
        aten.masked_scatter.default: _masked_scatter,
        aten.index_put.default: _index_put,
        aten.scatter_reduce.two: _scatter_reduce,
        aten.index_reduce.default: _index_reduce,
        aten.segment_reduce.default: _segment_reduce,
        aten._embedding_bag.default: functools.partial(_embedding_bag, op=aten._embedding_bag.default),
        aten._embedding_bag_forward_only.default: functools.partial(_embedding_bag,
                                                                    op=aten._embedding_bag_forward_only.default),
        aten.rrelu_with_noise_functional.default: _rrelu,
        aten.grid_sampler_2d.default: _grid_sampler,
        aten.grid_sampler_3d.default: _grid_sampler,
    })
    return table


def decomposition_table() -> dict:
    """The table capture traces with: :func:`_table`, without the ops that have a rule
    registered from outside (hoad.extend): such a rule wants the op itself."""
    table = _table()
    return {op: fn for op, fn in table.items() if op not in USER_OPS} if USER_OPS else table


@functools.lru_cache(maxsize=None)
def _table() -> dict:
    """Core ATen decompositions, keeping ``detach`` (a stop-gradient) and splitting composites
    (softmax, layer_norm, gelu, silu, addmm, variance) into ops with rules."""
    table = dict(core_aten_decompositions())
    table.pop(aten.detach.default, None)
    # ops torch differentiates by their own formula, which the decomposition's where() branches
    # do not reproduce at the domain edge (entr at 0, log_ndtr deep in the left tail)
    table.pop(aten.special_entr.default, None)
    table.pop(aten.special_log_ndtr.default, None)  # (its where() leaves log1p(-1) in the branch not taken)
    table.pop(aten.sinc.default, None)  # (its where() gave every derivative 0 at 0, sinc''(0) = -π²/3)
    table.update(get_decompositions([
        aten._softmax, aten._log_softmax, aten.native_layer_norm, aten.gelu, aten.silu, aten.addmm,
        aten.logsumexp, aten.softplus, aten.mish, aten.hardtanh, aten.leaky_relu, aten.elu,
        aten.baddbmm, aten.linalg_vector_norm, aten.native_group_norm, aten.native_batch_norm,
        aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
        aten._native_batch_norm_legit_functional,
    ]))
    table.update(_coverage_decompositions())
    table.update(_LINALG)  # factorizing ops -> single-output ops with rules (hoad/rules/linalg.py)
    table[aten._safe_softmax.default] = _safe_softmax
    table[aten.as_strided.default] = _as_strided
    table[aten.copy.default] = _copy
    table[aten.mv.default] = _mv
    table[aten.linalg_vector_norm.default] = _vector_norm
    table[aten.hardtanh.default] = _hardtanh
    table[aten.hardsigmoid.default] = _hardsigmoid
    table[aten.hardswish.default] = _hardswish
    table[aten.dot.default] = _dot
    table[aten.log_sigmoid_forward.default] = _log_sigmoid_forward
    table[aten.elu.default] = _elu
    table[aten.celu.default] = lambda x, alpha=1.0: _elu(x, alpha, 1.0, 1.0 / alpha)
    table[aten.smooth_l1_loss.default] = _smooth_l1_loss
    table[aten.huber_loss.default] = _huber_loss
    table[aten.binary_cross_entropy.default] = _binary_cross_entropy
    table[aten.clamp.default] = _clamp
    table[aten.xlogy.Tensor] = _x_log(torch.log)
    table[aten.special_xlog1py.default] = _x_log(torch.log1p)
    # with y a number: x · log 2 at x = 0 has derivative log 2, not core's where(x = 0, 0, …)'s 0
    table[aten.xlogy.Scalar_Other] = lambda a, b: _x_log(torch.log)(a, torch.full_like(a, b))
    table[aten.special_xlog1py.other_scalar] = lambda a, b: _x_log(torch.log1p)(a, torch.full_like(a, b))
    table[aten.vdot.default] = _dot
    table[aten.var_mean.correction] = _var_mean
    table[aten.var.correction] = _var
    table[aten.std.correction] = _std
    table[aten.std_mean.correction] = _std_mean
    for packet, accepts in _NO_MIXED_DTYPES.items():
        if accepts not in ("floats", "norm", "indices"):
            raise HoadInternalError(f"_NO_MIXED_DTYPES: {packet} accepts {accepts!r}")
        for name in packet.overloads():
            op = getattr(packet, name)
            table[op] = _refuse_mixed_dtypes(op, table.get(op), accepts)
    return table


# ops whose kernels refuse tensors of different floating dtypes (eager raises), where a
# decomposition (addmm's, the norms') promoted them silently and a fake trace (mm, conv) passed
# them on to fail in the program (conv as an internal error), each with what else torch accepts:
# "floats" only (no integer operands), "norm" (float32 parameters for a half or bfloat16 input:
# the norms' mixed precision), "indices" (integer and bool operands are indices or masks, free)
_NO_MIXED_DTYPES = {
    aten.mm: "floats", aten.bmm: "floats", aten.addmm: "floats", aten.baddbmm: "floats", aten.addbmm: "floats",
    aten.mv: "floats", aten.addmv: "floats", aten.dot: "floats", aten.vdot: "floats", aten.convolution: "floats",
    aten.native_layer_norm: "norm", aten.native_group_norm: "norm", aten.native_batch_norm: "norm",
    aten._native_batch_norm_legit: "norm", aten._native_batch_norm_legit_no_training: "norm",
    aten._native_batch_norm_legit_functional: "norm",
    # (a decomposition computed these in one of the two dtypes: cholesky_solve(b float64, L float32)
    # gave float32 derivatives of a float64 input)
    aten.cholesky_solve: "floats", aten.lerp: "floats", aten.linalg_cross: "floats", aten._cdist_forward: "floats",
    aten.linalg_solve: "floats", aten._linalg_solve_ex: "floats",
    aten.masked_scatter: "indices", aten.nll_loss_forward: "indices", aten.nll_loss2d_forward: "indices",
    aten.binary_cross_entropy: "floats",
}


def _refuse_mixed_dtypes(op, decomposition, accepts: str):
    def checked(*args, **kwargs):
        dtypes = list(dict.fromkeys(t.dtype for t in torch.utils._pytree.tree_leaves((args, kwargs))
                                    if isinstance(t, torch.Tensor) and t.ndim))  # (lerp's 0-d weight is free)
        if accepts == "indices":
            dtypes = [d for d in dtypes if d.is_floating_point]
        exact = [str(d).removeprefix("torch.") for d in dtypes if not d.is_floating_point]
        # (an integer matrix times a float vector, typed as an integer, failed later; the norms
        # take floats only; an integer product of integers is torch's too)
        if exact and (accepts == "norm" or len(exact) < len(dtypes)):
            names = " and ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise InvalidArgumentError(
                f"{op.name()} gets tensors of dtypes {names}: torch refuses {exact[0]} tensors there (the function "
                "itself fails when run). Cast them to the floating dtype first (A.to(x.dtype))")
        mixed_precision = (accepts == "norm" and bool(dtypes) and dtypes[0] in (torch.float16, torch.bfloat16)
                           and set(dtypes[1:]) <= {torch.float32})
        if len(dtypes) > 1 and not mixed_precision:
            names = " and ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise InvalidArgumentError(
                f"{op.name()} gets tensors of dtypes {names}: torch refuses mixed dtypes there (the function itself "
                "fails when run). Cast them to one dtype first: the module to the input's (module.to(x.dtype)) or the "
                "input to the weights'")
        return NotImplemented if decomposition is None else decomposition(*args, **kwargs)

    return checked
