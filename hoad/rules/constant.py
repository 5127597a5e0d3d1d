"""Ops whose outputs carry no derivative, and ops hoad refuses because they draw random numbers.

Any op whose output is not floating point (comparisons, argmax, integer casts) is constant
without being listed; the ops here return floats that are piecewise constant.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

PIECEWISE_CONSTANT = frozenset({
    aten.sign.default, aten.floor.default, aten.ceil.default, aten.round.default, aten.round.decimals,
    aten.trunc.default,
    aten.angle.default,  # of a real tensor: 0 or pi (complex values are refused before any rule)
    aten.detach.default, aten.div.Tensor_mode,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
    aten.scalar_tensor.default,
})

RANDOM = frozenset({
    aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli.Tensor, aten.bernoulli_.float, aten.bernoulli_.Tensor,
    aten.native_dropout.default, aten.rand.default, aten.randn.default, aten.rand_like.default,
    aten.randn_like.default, aten.randint.default, aten.randint.low, aten.randint_like.default,
    aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, aten.normal_.default,
    aten.uniform.default, aten.uniform_.default, aten.randperm.default, aten.multinomial.default,
    aten.exponential.default, aten.exponential_.default,
})


def is_random(target) -> bool:
    """Whether an op draws random numbers: hoad's list, or ATen's seeded tag (the overloads that
    take an explicit torch.Generator, aten.randn.generator, are only tagged)."""
    return target in RANDOM or torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())

