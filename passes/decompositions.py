"""The decomposition table capture traces with: core ATen, minus what hoad must keep, plus
composites split into ops with rules (and a few decompositions of hoad's own)."""

from __future__ import annotations

import functools
import math

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

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
    return _var(x, dim, correction=correction, keepdim=keepdim).sqrt()


# Core ATen turns mv and dot into an elementwise product and a sum; their derivative blocks
# would then be materialised at the product's full size. As matrix products they stay contractions.
def _mv(a, v):
    return (a @ v.unsqueeze(1)).squeeze(1)


def _dot(a, b):
    return (a.unsqueeze(0) @ b.unsqueeze(1)).reshape(())


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


# how many as_strided calls capture has turned into reads of the tensor's own entries
STRIDED_READS = [0]


def _as_strided(x, size, stride, storage_offset=None):
    """as_strided of a contiguous tensor (decompositions such as group_norm's emit it) as what it
    reads: a view when the strides are those of ``size`` laid out densely, else the entries at
    offset + Σ i_k·stride_k of the flat tensor, a gather with a constant index. A strided view of a
    non-contiguous tensor reads its storage, not its entries: left to the rule table (unsupported)."""
    if not x.is_contiguous():
        return NotImplemented
    STRIDED_READS[0] += 1  # the program now assumes its inputs own their storage (capture records it)
    offset = int(storage_offset or 0)
    size, stride = [int(n) for n in size], [int(s) for s in stride]
    if offset == 0 and math.prod(size) == x.numel() and stride == _contiguous_strides(size):
        return x.view(size)
    index = torch.full(size, offset, dtype=torch.long, device=x.device)
    for k, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[k] = n
        index = index + torch.arange(n, device=x.device).reshape(shape) * s
    return x.reshape(-1)[index]


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
    table.update(get_decompositions([
        aten._softmax, aten._log_softmax, aten.native_layer_norm, aten.gelu, aten.silu, aten.addmm,
        aten.logsumexp, aten.softplus, aten.mish, aten.hardtanh, aten.leaky_relu, aten.elu,
        aten.baddbmm, aten.linalg_vector_norm, aten.native_group_norm, aten.native_batch_norm,
        aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
        aten._native_batch_norm_legit_functional,
    ]))
    table.update(_LINALG)  # factorizing ops -> single-output ops with rules (hoad/rules/linalg.py)
    table[aten._safe_softmax.default] = _safe_softmax
    table[aten.as_strided.default] = _as_strided
    table[aten.mv.default] = _mv
    table[aten.dot.default] = _dot
    table[aten.vdot.default] = _dot
    table[aten.var_mean.correction] = _var_mean
    table[aten.var.correction] = _var
    table[aten.std.correction] = _std
    return table
