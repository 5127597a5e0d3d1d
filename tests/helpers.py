"""Reference derivatives from nested torch.func, and the comparison every correctness test uses."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacfwd, jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import hoad
from hoad.algebra import Target
from hoad.compiled import Compiled
from hoad.lowering.inductor import this_machine

DT = torch.float64


def inductor_layout() -> Target:
    """The target of Inductor programs (its contractions, fused reductions and kernels differ),
    for programs run eagerly here: Inductor compiles cost seconds."""
    return Target(this_machine())


def compiled(f, order, wrt=0, target: Target | None = None, **options):
    """``hoad.compile`` with an explicit target (the layout switches tests compare)."""
    return Compiled(f, order, wrt, target=target, **options)


def reference(f, args, wrt, order):
    """{canonical multi-index (over wrt positions): block} for orders 1..order.

    ``jacrev`` innermost, then ``jacfwd`` per further order: block[k1, …, kn] is
    jacfwd(…jacfwd(jacrev(f, k1), k2)…, kn), the layout hoad promises.
    """
    argnums = tuple(wrt)
    g = jacrev(f, argnums=argnums)
    levels = {1: g(*args)}
    for n in range(2, order + 1):
        g = jacfwd(g, argnums=argnums)
        levels[n] = g(*args)
    out = {}
    for n in range(1, order + 1):
        for K in itertools.combinations_with_replacement(range(len(argnums)), n):
            t = levels[n]
            for k in K:
                t = t[k]
            out[K] = t
    return out


def assert_close(got, ref, what=""):
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(got, ref.to(got.dtype), rtol=1e-9, atol=1e-9 * scale, msg=lambda m: f"{what}: {m}")


def check(f, args, wrt=(0,), order=3, reference_fn=None, **options):
    """Compile ``f`` with hoad and compare every canonical block (and permuted keys) to torch.func
    (of ``reference_fn``, the same function in plain ops, when given); under ``batch_dim=0`` to
    torch.func of one sample, for every sample."""
    wrt = tuple(wrt)
    cf = hoad.compile(f, order=order, wrt=wrt, **options)
    res = cf(*args)
    assert_close(res.value, f(*args), "value")
    batched = options.get("batch_dim") == 0
    ref = (per_sample_reference if batched else reference)(reference_fn or f, args, wrt, order)
    for K, expected in ref.items():
        key = tuple(wrt[k] for k in K)
        assert_close(res[key], expected, f"block {key}")
        if len(set(K)) > 1:  # a non-canonical ordering is a permuted view of the same block
            rkey = key[::-1]
            rref = reference_block(ref, K[::-1], args, wrt, batched)
            assert_close(res[rkey], rref, f"block {rkey}")
    return res, cf


def per_sample_reference(f, args, wrt, order):
    """:func:`reference` of one sample (dim 0 of each wrt input), for every sample."""
    def single(*a):
        return f(*[x.unsqueeze(0) if i in wrt else x for i, x in enumerate(a)]).squeeze(0)

    in_dims = tuple(0 if i in wrt else None for i in range(len(args)))
    return vmap(lambda *a: reference(single, a, wrt, order), in_dims=in_dims)(*args)


def reference_block(ref, positions, args, wrt, batched=False):
    """A non-canonical block from the canonical reference by permuting slot groups."""
    K = tuple(sorted(positions))
    t = ref[K]
    ranks = [args[wrt[k]].ndim - batched for k in K]
    r = t.ndim - sum(ranks)
    offsets = [r + sum(ranks[:i]) for i in range(len(K))]
    used, perm = [False] * len(K), list(range(r))
    for p in positions:
        i = next(i for i in range(len(K)) if K[i] == p and not used[i])
        used[i] = True
        perm += range(offsets[i], offsets[i] + ranks[i])
    return t.permute(perm)


def rand(*shape, positive=False, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else hash(shape) % 1000)
    t = torch.randn(*shape, dtype=DT, generator=g)
    return t.abs() + 0.5 if positive else t


def shared_parameter_reference(model, names: list[str], args: tuple, order: int, sample_wrt: tuple[int, ...] = ()):
    """{wrt positions: block} of one sample, vmapped over the samples with the parameters unmapped.
    The wrt list is the sample inputs at ``sample_wrt`` (positions in ``args``), then ``names``."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    n = len(args)

    def one(*a):
        inputs, ps = a[:n], dict(zip(names, a[n:]))
        return functional_call(model, {**params, **ps}, tuple(x[None] for x in inputs))[0]

    wrt = tuple(sample_wrt) + tuple(range(n, n + len(names)))
    blocks = lambda *a: reference(one, a, wrt, order)  # noqa: E731

    in_dims = (0,) * n + (None,) * len(names)
    with sdpa_kernel(SDPBackend.MATH):  # (torch's fused attention kernels have no forward-mode rule)
        return vmap(blocks, in_dims=in_dims)(*args, *[params[k] for k in names])


# --------------------------------------------------- model zoo (test_capture, test_jets)
def _gru():
    cell = nn.GRUCell(3, 4).double()
    return lambda x: cell(x).sin().sum()


def _lstm():
    lstm = nn.LSTM(3, 4, num_layers=2).double()
    return lambda x: lstm(x[None])[0].sin().sum()


def _rnn():
    rnn = nn.RNN(3, 4, nonlinearity="tanh").double()
    return lambda x: rnn(x[None])[0].sin().sum()


def _mlp():
    net = nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 2), nn.SiLU()).double()
    return lambda x: net(x).sum()


def _norms():  # group_norm's decomposition emits as_strided (of a contiguous value: a view)
    ln, gn = nn.LayerNorm(3).double(), nn.GroupNorm(1, 3).double()
    rms = nn.RMSNorm(3).double()
    bn = nn.BatchNorm1d(3).double().eval()
    return lambda x: (ln(x).sin() + gn(x).cos() + rms(x) * bn(x)).sum() + F.cosine_similarity(x, x.flip(0)).sum()


ZOO = {"mlp": _mlp, "gru-cell": _gru, "lstm": _lstm, "rnn": _rnn, "norms": _norms}
