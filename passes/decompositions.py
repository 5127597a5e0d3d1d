"""The decomposition table capture traces with: core ATen, minus what hoad must keep, plus
composites split into ops with rules (and a few decompositions of hoad's own)."""

from __future__ import annotations

import functools
import math
import weakref

import torch
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

from hoad.errors import DataDependentControlFlowError, HoadInternalError, InvalidArgumentError
from hoad.passes.indexing import (
    _AS_ITSELF,
    _as_strided,
    _as_strided_scatter,
    _copy,
    _embedding_bag,
    _grid_sampler,
    _index_put,
    _index_reduce,
    _masked_scatter,
    _op_itself,
    _put,
    _scatter_reduce,
    _segment_reduce,
)
from hoad.passes.linalg_routes import CAPTURE_DECOMPOSITIONS as _LINALG
from hoad.passes.tracing import DETACHED_FROM, value_read
from hoad.rules import USER_OPS

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


class FunctionOverrides(TorchFunctionMode):
    """Functions whose ATen kernels a trace cannot follow, replaced while capture traces: the
    kernel runs before any decomposition table is consulted."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist and args and not is_fake(args[0]):
            # a closed-over tensor's values as Python numbers (no ATen op: the decomposition of
            # .item() does not see it), kept by the program like .item()'s
            values = func(*args, **(kwargs or {}))
            value_read(args[0], values)
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


# ---------------------------------------------------------------------------------------------
# Issue 17: ops written as ops with rules. Each keeps what the op computes, exactly; where its
# derivative at a kink follows a convention (a norm at zero, ties of a maximum), it is torch's.


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




def _rrelu(x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    """Evaluation: leaky_relu with the mean slope. Training draws each negative entry's slope
    (aten.uniform): capture then refuses the function as random."""
    if not training:
        return torch.where(x > 0, x, x * ((lower + upper) / 2)), noise.clone()
    slope = aten.uniform.default(torch.empty_like(x), lower, upper)
    negative = x <= 0
    return torch.where(negative, x * slope, x), torch.where(negative, slope, torch.ones_like(slope))


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
