"""Nested derivative transforms, the reference answer, and the comparison every contender passes.

An answer is a dict from canonical multi-index (a sorted tuple of positions in ``wrt``) to a
block in torch.func's dense layout: ``jacfwd(...jacfwd(jacrev(f, argnums=i), argnums=j)...)``.
The same nesting, written once in :func:`answer_fn`, serves torch.func (the reference and the
eager peer, in float64), ``torch.compile`` of it, and JAX.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.func

from benchmarks.workloads import Problem

MultiIndex = tuple[int, ...]
TOLERANCE = 1e-8  # max |got - ref| / max(1, max |ref|), float64
FLOAT32_TOLERANCE = 1e-4  # the same for a contender computing in float32 (``--dtype float32``)


def tolerance(dtype: torch.dtype) -> float:
    """The largest scaled difference from the float64 reference accepted of an answer in ``dtype``."""
    return TOLERANCE if dtype == torch.float64 else FLOAT32_TOLERANCE


@dataclass(frozen=True)
class Transforms:
    """One library's derivative transforms, so the nesting below is written once."""

    jacrev: Callable
    jacfwd: Callable
    vmap: Callable
    trace: Callable  # trace over the last two axes


TORCH = Transforms(torch.func.jacrev, torch.func.jacfwd, torch.func.vmap,
                   lambda h: torch.diagonal(h, dim1=-2, dim2=-1).sum(-1))


def jax_transforms() -> Transforms:
    import jax
    import jax.numpy as jnp

    return Transforms(jax.jacrev, jax.jacfwd, jax.vmap, lambda h: jnp.trace(h, axis1=-2, axis2=-1))


def canonical(count: int, order: int) -> list[MultiIndex]:
    """The canonical multi-indices of one order over ``count`` wrt entries (Schwarz symmetry)."""
    return list(itertools.combinations_with_replacement(range(count), order))


def answer_fn(p: Problem, fn: Callable | None = None, lib: Transforms = TORCH, order: int | None = None
              ) -> Callable[..., dict[MultiIndex, object]]:
    """``args -> answer`` by nesting ``lib``'s transforms: jacrev once, then jacfwd ``order - 1``
    times (order 2 is torch.func.hessian); ``vmap`` over samples for per-sample problems."""
    fn = p.fn if fn is None else fn
    order = p.order if order is None else order
    count = len(p.wrt)
    argnums = p.wrt if count > 1 else p.wrt[0]
    derivative = lib.jacrev(fn, argnums=argnums)
    for _ in range(order - 1):
        derivative = lib.jacfwd(derivative, argnums=argnums)
    if p.per_sample:
        derivative = lib.vmap(derivative)

    def answer(*args):
        blocks = nested_blocks(derivative(*args), count, order)
        if p.laplacian:
            blocks = {K: lib.trace(b) for K, b in blocks.items()}
        return blocks

    return answer


def nested_blocks(out, count: int, order: int) -> dict[MultiIndex, object]:
    """The canonical blocks of a nested transform's output: with several argnums it is a tuple
    of tuples (``out[i][j]`` is the (i, j) block), with one argnum the block itself."""
    if count == 1:
        return {(0,) * order: out}
    blocks = {}
    for K in canonical(count, order):
        block = out
        for i in K:
            block = block[i]
        blocks[K] = block
    return blocks


def reference(p: Problem) -> dict[MultiIndex, torch.Tensor]:
    """Every canonical block of orders 1..order (only the top order for a Laplacian), by
    nested torch.func in float64."""
    orders = [p.order] if p.laplacian else range(1, p.order + 1)
    ref: dict[MultiIndex, torch.Tensor] = {}
    for k in orders:
        ref.update(answer_fn(p, order=k)(*p.args))
    return ref


@dataclass
class Check:
    """The outcome of comparing a contender's blocks with the float64 reference."""

    ok: bool
    error: float  # the largest scaled difference over the blocks compared
    note: str = ""


def compare(got: dict[MultiIndex, torch.Tensor], ref: dict[MultiIndex, torch.Tensor]) -> Check:
    """Compare every block of ``got`` with the reference (each must be there, same shape). The
    tolerance is that of the least precise block's dtype (:func:`tolerance`); blocks may be on any
    device (a worker's answer comes back on the CPU)."""
    if not got:
        return Check(False, float("nan"), "no blocks")
    worst, limit = 0.0, TOLERANCE
    for K, block in got.items():
        if K not in ref:
            return Check(False, float("nan"), f"unexpected block {K}")
        r = ref[K]
        block = torch.as_tensor(block)
        limit = max(limit, tolerance(block.dtype))
        if tuple(block.shape) != tuple(r.shape):
            return Check(False, float("nan"), f"block {K} has shape {tuple(block.shape)}, expected {tuple(r.shape)}")
        if not torch.isfinite(block).all():
            return Check(False, float("nan"), f"block {K} is not finite")
        scale = max(1.0, r.abs().max().item()) if r.numel() else 1.0
        err = (block.to(device=r.device, dtype=r.dtype) - r).abs().max().item() / scale if r.numel() else 0.0
        worst = max(worst, err)
    if worst > limit:
        return Check(False, worst, f"max scaled error {worst:.1e}")
    return Check(True, worst)


def reference_of(w, p, dtype: torch.dtype) -> dict:
    """The float64 reference (nested torch.func) of ``w``'s problem ``p``: of a float64 twin of the
    problem, on the same device, when the contenders compute in another dtype."""
    if dtype != torch.float64:
        p = w.make(torch.float64)
    return reference(p) if isinstance(p, Problem) else p.reference()
