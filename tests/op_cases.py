"""One case per rule-table key: a small function whose captured graph applies that op to a
differentiated value, with inputs, wrt and the highest order to check.

Each function puts the op in a nonlinear context, so high-order blocks are not trivially zero,
and several have non-scalar outputs or two wrt inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from helpers import rand

aten = torch.ops.aten


@dataclass
class Case:
    fn: Callable
    args: tuple
    wrt: tuple = (0,)
    order: int = 4
    tol: float | None = None          # looser tolerance (float32 casts)
    ops: tuple = field(default=())    # extra ops that must appear
    # the same function in plain ops, for torch.func where it has no derivative of the op itself
    reference: Callable | None = None


def _idx(*v):
    return torch.tensor(v)


W6 = rand(6, seed=1)
W23 = rand(2, 3, seed=2)
W43 = rand(4, 3, seed=3)
W26 = rand(2, 6, seed=4)

CASES: dict = {
    # ------------------------------------------------------------------------------ linear
    aten.view.default: Case(lambda x: (x.sin().view(6) * W6).sin(), (rand(2, 3),)),
    aten.squeeze.dims: Case(lambda x: x.sin()[None].squeeze(0).cos(), (rand(2, 3),)),
    aten.unsqueeze.default: Case(lambda x: (x.sin().unsqueeze(1) * x.cos().unsqueeze(0)).sum(), (rand(3),)),
    aten.clone.default: Case(lambda x: x.sin().t().contiguous().cos().sum(0), (rand(2, 3),)),
    aten.alias.default: Case(lambda x: aten.alias.default(x.sin()).cos().sum(), (rand(2, 3),)),
    aten._to_copy.default: Case(lambda x: (x.sin().float() * 2).double().cos().sum(), (rand(2, 3),), tol=1e-5),
    aten.permute.default: Case(lambda x: (x.sin().permute(1, 0) * W23.t()).tanh(), (rand(2, 3),)),
    aten.expand.default: Case(lambda x: (x[:, None, :].expand(2, 4, 3).sin() * W43).sum(), (rand(2, 3),)),
    aten.slice.Tensor: Case(lambda x: x[:, ::2].sin() * x[:, 1:].cos()[:, :2], (rand(2, 3),)),
    aten.select.int: Case(lambda x: x[1].sin() * x[0].cos(), (rand(2, 3),)),
    aten.index_select.default: Case(lambda x: x.index_select(1, _idx(2, 0, 2)).sin().sum(0), (rand(2, 3),)),
    aten.index.Tensor: Case(lambda x: x[_idx(1, 0, 1)].sin().sum(), (rand(2, 3),)),
    aten.gather.default: Case(lambda x: x.gather(1, _idx(2, 0, 0, 1).view(2, 2)).sin().prod(), (rand(2, 3),)),
    aten.flip.default: Case(lambda x: (x.flip(1).sin() * x).sum(1), (rand(2, 3),)),
    aten.constant_pad_nd.default: Case(lambda x: (F.pad(x, (1, 2)).cos() * W26).sum(), (rand(2, 3),)),
    aten.cumsum.default: Case(lambda x: x.cumsum(1).sin().sum(), (rand(2, 3),)),
    aten.diagonal.default: Case(lambda x: x[:, :2].sin().diagonal().exp().sum(), (rand(2, 3),)),
    aten.sum.dim_IntList: Case(lambda x: x.sin().sum(1).exp(), (rand(2, 3),)),
    aten.mean.dim: Case(lambda x: x.sin().mean(0, keepdim=True).exp(), (rand(2, 3),)),
    aten.mean.default: Case(lambda x: (x.sin() ** 2).mean(), (rand(2, 3),)),
    aten.neg.default: Case(lambda x: (-x.sin()).exp().sum(), (rand(2, 3),)),
    aten.add.Tensor: Case(lambda x, y: (x.sin() + 2 * y.cos()).exp(), (rand(2, 3), rand(3)), wrt=(0, 1), order=3),
    aten.sub.Tensor: Case(lambda x, y: (x.sin() - y.cos()).exp().sum(), (rand(2, 3), rand(2, 1)), wrt=(0, 1), order=3),
    aten.add.Scalar: Case(lambda x: aten.add.Scalar(x.sin(), 1.5).log().sum(), (rand(2, 3),)),
    aten.sub.Scalar: Case(lambda x: aten.sub.Scalar(x.sin(), 1.5).exp().sum(), (rand(2, 3),)),
    aten.where.self: Case(lambda x: torch.where(x > 0, x.sin(), x.exp()).prod(), (rand(2, 3),)),
    aten.copy.default: Case(lambda x: _copy_into(x), (rand(2, 3),)),
    aten.cat.default: Case(lambda x, y: torch.cat([x.sin(), y, x * y], 0).tanh().sum(0), (rand(2, 3), rand(2, 3)), wrt=(0, 1), order=3),
    aten.split_with_sizes.default: Case(lambda x: (lambda a, b: a.sin().sum() * b.cos().sum())(*torch.split(x, [1, 2], 1)), (rand(2, 3),)),
    aten.repeat.default: Case(lambda x: x.repeat(2, 1).sin().cumsum(0).sum(1), (rand(2, 3),)),
    aten.fmod.Tensor: Case(lambda x, y: torch.fmod(x * 3, y.exp()).sin().sum(0), (rand(2, 3), rand(3)), wrt=(0, 1), order=3),
    aten.fmod.Scalar: Case(lambda x: torch.fmod(x.sin() * 3, 0.7).exp().sum(), (rand(2, 3),)),
    aten.remainder.Tensor: Case(lambda x, y: torch.remainder(x * 3, y.exp()).sin(), (rand(2, 3), rand(3)), wrt=(0, 1), order=3),
    aten.remainder.Scalar: Case(lambda x: torch.remainder(x.sin() * 3, 0.7).exp().sum(), (rand(2, 3),)),
    # torch has no derivative of remainder(scalar, tensor): the reference writes out a - floor(a/b)·b
    aten.remainder.Scalar_Tensor: Case(lambda x: (2.5 % x.exp()).sin().sum(), (rand(2, 3),),
                                       reference=lambda x: (2.5 - (2.5 / x.exp()).floor().detach() * x.exp()).sin().sum()),
    aten.clamp.Tensor: Case(lambda x, y: torch.clamp(x.sin(), y[:1] - 0.5, y[1:] + 0.5).exp().sum(), (rand(2, 3), rand(2, 3)),
                            wrt=(0, 1), order=3),
    aten.slice_scatter.default: Case(lambda x, y: aten.slice_scatter(x.sin(), y.exp(), 1, 0, 3, 2).tanh().sum(0),
                                     (rand(2, 3), rand(2, 2)), wrt=(0, 1), order=3),
    aten.diagonal_scatter.default: Case(lambda x, y: aten.diagonal_scatter(x.sin(), y.exp(), 1).tanh().sum(0),
                                        (rand(2, 3), rand(2)), wrt=(0, 1), order=3),
    aten.sort.default: Case(lambda x: x.sort(1).values.sin() * W23, (rand(2, 3),)),
    aten.topk.default: Case(lambda x: x.sin().topk(2).values.exp().sum(), (rand(2, 3),)),
    # ------------------------------------------------------------------------ multilinear
    aten.mul.Tensor: Case(lambda x, y: x * y * x.sin(), (rand(2, 3), rand(3)), wrt=(0, 1)),
    aten.mul.Scalar: Case(lambda x: aten.mul.Scalar(x.sin(), 3.0).exp().sum(), (rand(2, 3),)),
    aten.div.Tensor: Case(lambda x, y: (x.sin() / (y * y + 1)).sum(0), (rand(2, 3), rand(3)), wrt=(0, 1)),
    aten.div.Scalar: Case(lambda x: aten.div.Scalar(x.sin(), 3.0).exp().sum(), (rand(2, 3),)),
    aten.mm.default: Case(lambda x, w: (x @ w).tanh() @ w.t(), (rand(2, 3), rand(3, 3)), wrt=(0, 1), order=3),
    aten.bmm.default: Case(lambda a, b: torch.bmm(a.sin(), b).sum((0, 2)), (rand(2, 2, 3), rand(2, 3, 2)), wrt=(0, 1)),
    aten.maximum.default: Case(lambda x, y: torch.maximum(x.sin(), y).exp(), (rand(2, 3), rand(3)), wrt=(0, 1), order=3),
    aten.minimum.default: Case(lambda x, y: torch.minimum(x.sin(), y).exp().sum(), (rand(2, 3), rand(3)), wrt=(0, 1), order=3),
    # ------------------------------------------------------------------------ elementwise
    aten.exp.default: Case(lambda x: x.exp() * x, (rand(2, 3),), order=5),
    aten.expm1.default: Case(lambda x: x.expm1().sum(), (rand(2, 3),), order=5),
    aten.log.default: Case(lambda x: x.log().sum(), (rand(2, 3, positive=True),), order=5),
    aten.log1p.default: Case(lambda x: x.log1p(), (rand(2, 3, positive=True),), order=5),
    aten.sin.default: Case(lambda x: x.sin().prod(), (rand(2, 3),), order=5),
    aten.cos.default: Case(lambda x: x.cos().sum(), (rand(2, 3),), order=5),
    aten.sinh.default: Case(lambda x: x.sinh().sum(), (rand(2, 3),), order=5),
    aten.cosh.default: Case(lambda x: x.cosh().sum(), (rand(2, 3),), order=5),
    aten.tanh.default: Case(lambda x: x.tanh().sum(), (rand(2, 3),), order=5),
    aten.sigmoid.default: Case(lambda x: x.sigmoid().sum(), (rand(2, 3),), order=5),
    aten.tan.default: Case(lambda x: (x * 0.5).tan().sum(), (rand(2, 3),), order=5),
    aten.special_entr.default: Case(lambda x: torch.special.entr(x).sum(), (rand(2, 3, positive=True),), order=5),
    aten.atan.default: Case(lambda x: x.atan().sum(), (rand(2, 3),), order=5),
    aten.erf.default: Case(lambda x: x.erf().sum(), (rand(2, 3),), order=5),
    aten.sqrt.default: Case(lambda x: x.sqrt().sum(), (rand(2, 3, positive=True),), order=5),
    aten.rsqrt.default: Case(lambda x: x.rsqrt().sum(), (rand(2, 3, positive=True),), order=5),
    aten.reciprocal.default: Case(lambda x: x.reciprocal().sum(), (rand(2, 3, positive=True),), order=5),
    aten.pow.Tensor_Scalar: Case(lambda x: (x**3).sum() + (x.abs() ** 2.5).sum(), (rand(2, 3),), order=5),
    aten.pow.Tensor_Tensor: Case(lambda x, y: (x**y).sum(), (rand(2, 3, positive=True), rand(3)), wrt=(0, 1)),
    aten.pow.Scalar: Case(lambda x: (2.0**x).sum(), (rand(2, 3),), order=5),
    aten.abs.default: Case(lambda x: (x.abs() * x.sin()).sum(), (rand(2, 3),)),
    aten.relu.default: Case(lambda x: (F.relu(x) * x.exp()).sum(), (rand(2, 3),)),
    aten.clamp.default: Case(lambda x: (x.clamp(-0.5, 0.5) * x.exp()).sum(), (rand(2, 3),)),
    # -------------------------------------------------------------------------- reduction
    aten.prod.default: Case(lambda x: x.prod(), (rand(2, 3),), order=5),
    aten.prod.dim_int: Case(lambda x: x.prod(1).sin(), (rand(2, 3),)),
    aten.amax.default: Case(lambda x: x.sin().amax(1).exp().sum(), (rand(2, 3),)),
    aten.amin.default: Case(lambda x: aten.amin.default(x.sin(), [1]).exp().sum(), (rand(2, 3),)),
    aten.max.default: Case(lambda x: x.sin().max().exp(), (rand(2, 3),)),
    aten.min.default: Case(lambda x: aten.min.default(x.sin()).exp(), (rand(2, 3),)),
    aten.max.dim: Case(lambda x: x.sin().max(1).values.exp(), (rand(2, 3),)),
    aten.min.dim: Case(lambda x: x.sin().min(0).values.exp().sum(), (rand(2, 3),)),
}


def _copy_into(x):
    z = torch.zeros(2, 3, dtype=x.dtype)
    z[0] = x[1].sin()
    return (z * x).exp().sum()
