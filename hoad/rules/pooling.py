"""Pooling and sliding windows: ops linear in their input, acting on its last few (spatial) axes.

Average pooling runs the op itself on each block, with the leading axes and the slots folded
into one batch axis; max pooling is a gather at the indices the primal op returns (the derivative
follows the winning entry, as torch's backward does); ``unfold`` is a gather along one axis.
Leading axes (batch, channels) are acted on independently, so they keep their ties.
"""

from __future__ import annotations

import math

import torch

from hoad.algebra import Block, along, map_out
from hoad.rules.base import Ctx, Jet, RuleTable
from hoad.rules.combinators import linear

aten = torch.ops.aten
OPS = RuleTable("linear")


def _spatially(r: int, k: int, op):
    """``op`` (a map of (N, C, *spatial) images, every (n, c) alike) on block data (lead...,
    *spatial, *rest): the first lead axis is N, the other lead axes and the rest fold into C, then
    unfold around the op's spatial output. A sample axis (the first) stays apart from the others,
    so a program built over this one (a biharmonic's outer Laplacian) keeps samples apart."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        rest, lead = list(t.shape[r:]), list(t.shape[:r - k])
        u = t.movedim(list(range(r, t.ndim)), list(range(len(lead), len(lead) + len(rest))))
        # (contiguous: a channels_last-like stack is laid out by the real kernel and its fake
        # differently, and a later view of the result then fails)
        y = op(u.reshape([lead[0] if lead else 1, -1] + list(t.shape[r - k:r])).contiguous())
        y = y.reshape(lead + rest + list(y.shape[2:]))
        return y.movedim(list(range(len(lead), len(lead) + len(rest))), list(range(y.ndim - len(rest), y.ndim)))

    return fn


def _pooled(ctx: Ctx, x: Jet, k: int, op) -> dict:
    r = x.ndim
    return linear(ctx, x, lambda b: map_out(b, r, _spatially(r, k, op), tuple(ctx.out.shape),
                                            along(r, range(r - k, r))))


def _avg_args(kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    """avg_pool's arguments, positional. Without padding, count_include_pad changes nothing and is
    set False: Inductor (torch 2.13) miscompiles avg_pool{2,3}d_backward with ceil_mode,
    count_include_pad and zero padding."""
    pads = [padding] if isinstance(padding, int) else list(padding)
    if all(p == 0 for p in pads):
        count_include_pad = False
    return kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override


def avg_pool2d_rule(ctx: Ctx, x: Jet, *args, **kwargs):
    """The same average pooling of each block, slots folded into the batch."""
    args = _avg_args(*args, **kwargs)
    return _pooled(ctx, x, 2, lambda u: aten.avg_pool2d.default(u, *args))


def avg_pool2d_vjp(v, g: Block, x: Jet, *args, **kwargs):
    args = _avg_args(*args, **kwargs)
    return _unpooled(v, g, x, 2, lambda u, like: aten.avg_pool2d_backward.default(u, like, *args))


OPS.register(aten.avg_pool2d.default, rule=avg_pool2d_rule, vjp=avg_pool2d_vjp)


def avg_pool3d_rule(ctx: Ctx, x: Jet, *args, **kwargs):
    args = _avg_args(*args, **kwargs)
    return _pooled(ctx, x, 3, lambda u: aten.avg_pool3d.default(u, *args))


def avg_pool3d_vjp(v, g: Block, x: Jet, *args, **kwargs):
    args = _avg_args(*args, **kwargs)
    return _unpooled(v, g, x, 3, lambda u, like: aten.avg_pool3d_backward.default(u, like, *args))


OPS.register(aten.avg_pool3d.default, rule=avg_pool3d_rule, vjp=avg_pool3d_vjp)


def adaptive_avg_pool2d_rule(ctx: Ctx, x: Jet, output_size):
    return _pooled(ctx, x, 2, lambda u: aten._adaptive_avg_pool2d.default(u, output_size))


def adaptive_avg_pool2d_vjp(v, g: Block, x: Jet, output_size):
    return _unpooled(v, g, x, 2, aten._adaptive_avg_pool2d_backward.default)


OPS.register(aten._adaptive_avg_pool2d.default, rule=adaptive_avg_pool2d_rule, vjp=adaptive_avg_pool2d_vjp)


def adaptive_avg_pool3d_rule(ctx: Ctx, x: Jet, output_size):
    return _pooled(ctx, x, 3, lambda u: aten._adaptive_avg_pool3d.default(u, output_size))


def adaptive_avg_pool3d_vjp(v, g: Block, x: Jet, output_size):
    return _unpooled(v, g, x, 3, aten._adaptive_avg_pool3d_backward.default)


OPS.register(aten._adaptive_avg_pool3d.default, rule=adaptive_avg_pool3d_rule, vjp=adaptive_avg_pool3d_vjp)


def _resize(op, backward, k: int):
    """Rule and VJP of a resizing op (bilinear, bicubic, trilinear, antialiased): linear in the
    image, so each block is resized alike; the transpose is the op's backward."""

    def rule(ctx: Ctx, x: Jet, output_size, align_corners: bool, *scales):
        return _pooled(ctx, x, k, lambda u: op(u, output_size, align_corners, *scales))

    def vjp(v, g: Block, x: Jet, output_size, align_corners: bool, *scales):
        def transpose(u, like):
            return backward(u, output_size, list(like.shape), align_corners, *scales)

        return _unpooled(v, g, x, k, transpose)

    name = op.__name__.split(".")[0].lstrip("_")
    rule.__name__, vjp.__name__ = f"{name}_rule", f"{name}_vjp"
    return rule, vjp


RESIZES = {
    aten.upsample_bilinear2d.default: (aten.upsample_bilinear2d_backward.default, 2),
    aten.upsample_bicubic2d.default: (aten.upsample_bicubic2d_backward.default, 2),
    aten._upsample_bilinear2d_aa.default: (aten._upsample_bilinear2d_aa_backward.default, 2),
    aten.upsample_trilinear3d.default: (aten.upsample_trilinear3d_backward.default, 3),
}
for _op, (_backward, _k) in RESIZES.items():
    _rule, _vjp = _resize(_op, _backward, _k)
    OPS.register(_op, rule=_rule, vjp=_vjp)


def _flat_index(indices: torch.Tensor, r: int, k: int, rest: list) -> torch.Tensor:
    """Indices into the flattened spatial axes, over (lead..., positions, *rest)."""
    idx = indices.reshape(list(indices.shape[:r - k]) + [-1])
    return idx.reshape(list(idx.shape) + [1] * len(rest)).expand(list(idx.shape) + rest)


def _gather(indices: torch.Tensor, k: int, pooled) -> callable:
    """Data (lead..., *spatial, *rest) -> (lead..., *pooled spatial, *rest): entries at the indices."""
    r = indices.ndim

    def fn(t: torch.Tensor) -> torch.Tensor:
        rest = list(t.shape[r:])
        flat = t.reshape(list(t.shape[:r - k]) + [-1] + rest)
        return flat.gather(r - k, _flat_index(indices, r, k, rest)).reshape(list(pooled) + rest)

    return fn


def _scatter(indices: torch.Tensor, k: int, shape) -> callable:
    """The transpose of :func:`_gather`: (lead..., *pooled, *rest) scatter-added to ``shape``."""
    r, n = indices.ndim, math.prod(shape[indices.ndim - k:])

    def fn(t: torch.Tensor) -> torch.Tensor:
        rest, lead = list(t.shape[r:]), list(t.shape[:r - k])
        flat = t.reshape(lead + [-1] + rest)
        out = t.new_zeros(lead + [n] + rest).scatter_add(r - k, _flat_index(indices, r, k, rest), flat)
        return out.reshape(list(shape) + rest)

    return fn


def _gathered(ctx: Ctx, x: Jet, k: int) -> list:
    """(values, indices) of a max pooling: the values' blocks gather x's at the indices."""
    values, indices = ctx.out
    r, new = x.ndim, tuple(values.shape)
    return [linear(ctx, x, lambda b: map_out(b, r, _gather(indices, k, new), new, along(r, range(r - k, r)))), {}]


def max_pool2d_rule(ctx: Ctx, x: Jet, *args, **kwargs):
    """The entries of x at the returned indices: a gather of each block."""
    return _gathered(ctx, x, 2)


def max_pool2d_vjp(v, g, x: Jet, *args, **kwargs):
    return _scattered(v, g, x, 2)


OPS.register(aten.max_pool2d_with_indices.default, aten.adaptive_max_pool2d.default, rule=max_pool2d_rule,
             vjp=max_pool2d_vjp)


def max_pool3d_rule(ctx: Ctx, x: Jet, *args, **kwargs):
    return _gathered(ctx, x, 3)


def max_pool3d_vjp(v, g, x: Jet, *args, **kwargs):
    return _scattered(v, g, x, 3)


OPS.register(aten.max_pool3d_with_indices.default, aten.adaptive_max_pool3d.default, rule=max_pool3d_rule,
             vjp=max_pool3d_vjp)


def max_pool2d_backward_rule(ctx: Ctx, grad: Jet, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Linear in the incoming gradient (x only gives the shape): a scatter-add to the indices."""
    return _unpooled_grad(ctx, grad, indices, 2)


def max_pool2d_backward_vjp(v, g: Block, grad: Jet, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _regathered(g, grad, indices, 2)


OPS.register(aten.max_pool2d_with_indices_backward.default, rule=max_pool2d_backward_rule,
             vjp=max_pool2d_backward_vjp)


def max_pool3d_backward_rule(ctx: Ctx, grad: Jet, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _unpooled_grad(ctx, grad, indices, 3)


def max_pool3d_backward_vjp(v, g: Block, grad: Jet, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _regathered(g, grad, indices, 3)


OPS.register(aten.max_pool3d_with_indices_backward.default, rule=max_pool3d_backward_rule,
             vjp=max_pool3d_backward_vjp)


def _unpooled_grad(ctx: Ctx, grad: Jet, indices, k: int) -> dict:
    if not isinstance(grad, Jet):
        return {}
    idx, r, new = indices.primal, grad.ndim, tuple(ctx.out.shape)
    return linear(ctx, grad, lambda b: map_out(b, r, _scatter(idx, k, new), new, along(r, range(r - k, r))))


def _windows(n: int, size: int, step: int, like: torch.Tensor) -> torch.Tensor:
    """Flat indices of ``unfold``'s windows: window w reads w·step + (0..size-1)."""
    count = (n - size) // step + 1
    start = torch.arange(count, device=like.device) * step
    return (start.unsqueeze(1) + torch.arange(size, device=like.device)).reshape(-1)


def unfold_rule(ctx: Ctx, x: Jet, dimension: int, size: int, step: int):
    """Sliding windows along one axis (a view): each block's windows, the window axis last."""
    r, new = x.ndim, tuple(ctx.out.shape)
    d = dimension % r if r else 0
    if r == 0:
        return linear(ctx, x, lambda b: map_out(b, 0, lambda t: t.unsqueeze(0), new))
    return linear(ctx, x, lambda b: map_out(b, r, lambda t: t.unfold(d, size, step).movedim(-1, r), new, along(r, [d])))


def unfold_vjp(v, g: Block, x: Jet, dimension: int, size: int, step: int):
    """Windows added back where they were read: an index_add along the unfolded axis."""
    r = x.ndim
    if r == 0:
        return [(x, map_out(g, 1, lambda t: t.squeeze(0), ()))]
    d = dimension % r
    idx = _windows(x.shape[d], size, step, x.primal)

    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.movedim(r, d + 1)
        t = t.reshape(list(t.shape[:d]) + [-1] + list(t.shape[d + 2:]))
        return t.new_zeros(list(x.shape) + list(t.shape[r:])).index_add(d, idx, t)

    return [(x, map_out(g, r + 1, fn, x.shape, along(r, [d])))]


OPS.register(aten.unfold.default, rule=unfold_rule, vjp=unfold_vjp)


# ------------------------------------------------------------------------- the VJPs' helpers
def _like(u: torch.Tensor, x, k: int) -> torch.Tensor:
    """A stand-in for the pooled input of a backward op: x's spatial shape over u's (N, C)."""
    return u.new_zeros(()).expand(list(u.shape[:2]) + list(x.shape[-k:]))


def _unpooled(v, g: Block, x: Jet, k: int, backward) -> list:
    """The transpose of a pooling: ``backward(grad, like)`` maps (N, C, *spatial') to (N, C, *spatial)."""
    r = x.ndim
    op = _spatially(r, k, lambda u: backward(u, _like(u, x, k)))
    return [(x, map_out(g, r, op, x.shape, along(r, range(r - k, r))))]


def _scattered(v, g, x: Jet, k: int) -> list:
    """Transpose of the max-pooling gather: scatter-add the values' cotangent to the indices."""
    if g[0] is None:
        return []
    r = x.ndim
    return [(x, map_out(g[0], r, _scatter(v.out[1], k, x.shape), x.shape, along(r, range(r - k, r))))]


# The backward ops of average pooling and resizing are what hoad's own VJPs above emit, so a
# program built over a hoad program meets them (a biharmonic's outer Laplacian, a nested
# compile). Each is linear in the incoming gradient, its other arguments give sizes, and its
# transpose is the forward op.
def _backward_of(k: int, apply, transpose):
    """Rule and VJP of such a backward op: ``apply(u, grad_shape, *args)`` and
    ``transpose(u, grad_shape, *args)`` map (N, C, *spatial) images, ``grad_shape`` the gradient's."""

    def rule(ctx: Ctx, grad, *args):
        if not isinstance(grad, Jet):
            return {}
        return _pooled(ctx, grad, k, lambda u: apply(u, tuple(grad.shape), *args))

    def vjp(v, g: Block, grad, *args):
        if not isinstance(grad, Jet) or not grad.varies:
            return []
        r = v.out.ndim
        op = _spatially(r, k, lambda u: transpose(u, tuple(grad.shape), *args))
        return [(grad, map_out(g, r, op, grad.shape, along(r, range(r - k, r))))]

    return rule, vjp


def _register_backward(backward, k: int, apply, transpose) -> None:
    rule, vjp = _backward_of(k, apply, transpose)
    name = backward.__name__.split(".")[0].lstrip("_")
    rule.__name__, vjp.__name__ = f"{name}_rule", f"{name}_vjp"
    OPS.register(backward, rule=rule, vjp=vjp)


for _k, _pool, _backward in ((2, aten.avg_pool2d.default, aten.avg_pool2d_backward.default),
                             (3, aten.avg_pool3d.default, aten.avg_pool3d_backward.default)):
    _register_backward(_backward, _k,
                       lambda u, shape, x, *args, b=_backward, k=_k: b(u, _like(u, x, k), *args),
                       lambda u, shape, x, *args, f=_pool: f(u, *args))
for _k, _pool, _backward in ((2, aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default),
                             (3, aten._adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d_backward.default)):
    _register_backward(_backward, _k, lambda u, shape, x, b=_backward, k=_k: b(u, _like(u, x, k)),
                       lambda u, shape, x, f=_pool, k=_k: f(u, list(shape[-k:])))
for _op, (_backward, _k) in RESIZES.items():
    _register_backward(
        _backward, _k,
        lambda u, shape, output_size, input_size, align_corners, *scales, b=_backward, k=_k: b(
            u, output_size, list(u.shape[:2]) + list(input_size[-k:]), align_corners, *scales),
        lambda u, shape, output_size, input_size, align_corners, *scales, f=_op: f(u, output_size, align_corners,
                                                                                  *scales))


def _regathered(g: Block, grad: Jet, indices, k: int) -> list:
    if not isinstance(grad, Jet) or not grad.varies:
        return []
    idx, r = indices.primal, grad.ndim
    return [(grad, map_out(g, r, _gather(idx, k, grad.shape), grad.shape, along(r, range(r - k, r))))]


