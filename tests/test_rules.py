"""Every rule-table entry against nested torch.func in float64, at orders 1..4 (5 where cheap).

Below the table's cases, variants of the convolution, pooling and indexed-write rules beyond the
one case per key in op_cases.py: convolution strides, dilation, groups, transposed and 1-d/3-d;
pooling options; every index_put, scatter and scatter_reduce flavour; per-sample and diagonal
programs through a convolution.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, check, rand
from op_cases import CASES
from torch.func import jacfwd, jacrev, vmap

import hoad
from hoad.rules import RULES, VJPS

aten = torch.ops.aten


def test_table_and_cases_cover_each_other():
    from hoad.rules import USER_OPS

    own = set(RULES) - USER_OPS  # (a docs example or another test may have registered rules)
    assert own - set(CASES) == set(), "rules without a test case"
    assert set(CASES) - set(RULES) == set(), "test cases without a rule"


# The reverse sweep forms no order-N remainder at ops with several outputs (passes/differentiate.py):
# correct only while each is linear in its input given its indices. A new multi-output rule must be
# such a gather (then add it here) or the sweep must learn to contract per output first.
MULTI_OUTPUT_GATHERS = {
    aten.sort.default, aten.topk.default, aten.max.dim, aten.min.dim, aten.median.dim, aten.nanmedian.dim,
    aten.mode.default, aten.kthvalue.default, aten.cummax.default, aten.cummin.default,
    aten.max_pool2d_with_indices.default, aten.adaptive_max_pool2d.default, aten.max_pool3d_with_indices.default,
    aten.adaptive_max_pool3d.default,
}


def test_every_multi_output_rule_is_a_reviewed_gather():
    from hoad.rules import USER_OPS

    multi = {op for op in set(RULES) - USER_OPS if len(op._schema.returns) > 1}
    assert multi == MULTI_OUTPUT_GATHERS


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("op", sorted(CASES, key=str), ids=str)
def test_rule(op, mode, monkeypatch):
    case = CASES[op]
    calls = []
    rule = RULES[op]

    def recording(ctx, *args, **kwargs):
        calls.append(ctx.keys)
        return rule(ctx, *args, **kwargs)

    monkeypatch.setitem(RULES, op, recording)
    vjp_calls = []
    vjp = VJPS[op]

    def recording_vjp(v, g, *args, **kwargs):
        vjp_calls.append(1)
        return vjp(v, g, *args, **kwargs)

    monkeypatch.setitem(VJPS, op, recording_vjp)
    options = {"mode": mode, **case.options}
    if case.tol is not None:
        import helpers

        monkeypatch.setattr(helpers, "assert_close", _loose(case.tol))
    check(case.fn, case.args, wrt=case.wrt, order=case.order, reference_fn=case.reference, **options)
    assert calls, f"{op} never reached its rule: the case does not exercise it"
    top = max(len(K) for keys in calls for K in keys)
    if mode == "forward":
        assert top == case.order
    else:  # orders < N forward, the top order from remainders (linear ops have none)
        assert vjp_calls, f"{op} never reached its VJP in the reverse sweep"
        assert top >= case.order - 1


def _loose(tol):
    import torch

    def assert_close(got, ref, what=""):
        assert got.shape == ref.shape, what
        torch.testing.assert_close(got, ref.to(got.dtype), rtol=tol, atol=tol)

    return assert_close


# -------------------------------------------- variants: convolution, pooling, indexed writes
def _idx(*v):
    return torch.tensor(v)


W = rand(3, 2, 3, 3, seed=7)
X = rand(2, 2, 5, 5, seed=8)

VARIANTS = {
    "conv2d_input_only_dilation": (lambda x: F.conv2d(x.sin(), W, dilation=2).tanh().sum((1, 2, 3)),
                                   (rand(2, 2, 5, 5),), (0,)),
    "conv2d_weight_only_stride": (lambda w: F.conv2d(X, w.sin(), stride=(2, 1)).tanh().sum(),
                                  (rand(3, 2, 3, 3),), (0,)),
    "conv2d_groups_bias": (lambda x, w, b: F.conv2d(x.sin(), w, b, groups=2, padding=(1, 0)).sin().sum(),
                           (rand(2, 4, 4, 4), rand(4, 2, 3, 3), rand(4)), (0, 1, 2)),
    "conv1d": (lambda x, w: F.conv1d(x.sin(), w, stride=2, padding=1).sin().sum(),
               (rand(2, 2, 6), rand(3, 2, 3)), (0, 1)),
    "conv3d": (lambda x, w: F.conv3d(x.sin(), w).sin().sum(), (rand(1, 2, 3, 3, 3), rand(2, 2, 2, 2, 2)), (0, 1)),
    "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x.sin(), w, stride=2, output_padding=1).sin().sum(),
                         (rand(2, 2, 3, 3), rand(2, 3, 2, 2)), (0, 1)),
    "conv_transpose2d_groups": (lambda x, w: F.conv_transpose2d(x.sin(), w, groups=2, padding=1).sin().sum(),
                                (rand(2, 4, 3, 3), rand(4, 1, 3, 3)), (0, 1)),
    "conv_same_input_twice": (lambda x: F.conv2d(x.sin(), x[:2, :, :2, :2]).sin().sum(), (rand(2, 2, 3, 3),), (0,)),
    "avg_pool1d": (lambda x: F.avg_pool1d(x.sin(), 3, stride=2, padding=1).tanh().sum(), (rand(2, 3, 7),), (0,)),
    "avg_pool2d_divisor": (lambda x: F.avg_pool2d(x.sin(), 2, ceil_mode=True, divisor_override=3).tanh().sum(),
                           (rand(2, 2, 3, 5),), (0,)),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x.sin(), 3).tanh().sum(), (rand(2, 2, 5),), (0,)),
    "max_pool1d_dilation": (lambda x: F.max_pool1d(x.sin(), 3, stride=2, dilation=2).tanh().sum(),
                            (rand(2, 3, 9),), (0,)),
    "max_pool2d_unbatched_ceil": (lambda x: F.max_pool2d(x.sin(), 2, ceil_mode=True).tanh().sum(),
                                  (rand(2, 3, 5),), (0,)),
    "adaptive_max_pool1d": (lambda x: F.adaptive_max_pool1d(x.sin(), 2).tanh().sum(), (rand(2, 2, 5),), (0,)),
    "unfold_step": (lambda x: x.sin().unfold(0, 2, 2).tanh().prod(-1).sum(), (rand(5, 2),), (0,)),
    "index_put_accumulate": (lambda x, v: x.sin().index_put((_idx(0, 2, 0),), v.exp(), accumulate=True).tanh().sum(0),
                             (rand(4, 3), rand(3, 3)), (0, 1)),
    "index_put_two_indices": (lambda x, v: x.sin().index_put((_idx(0, 2), _idx(1, 1)), v.exp()).tanh().sum(0),
                              (rand(4, 3), rand(2)), (0, 1)),
    "index_put_broadcast_values": (lambda x, v: x.sin().index_put((_idx(3, 1),), v.exp()).tanh().sum(0),
                                   (rand(4, 3), rand(3)), (0, 1)),
    "index_put_slice_first": (lambda x, v: torch.ops.aten.index_put(x.sin(), [None, _idx(0, 2)], v.exp()).tanh().sum(0),
                              (rand(4, 3), rand(2)), (0, 1)),
    "index_add": (lambda x, v: x.sin().index_add(1, _idx(0, 2, 0), v.exp()).tanh().sum(0),
                  (rand(4, 3), rand(4, 3)), (0, 1)),
    "index_copy": (lambda x, v: x.sin().index_copy(0, _idx(3, 1), v.exp()).tanh().sum(0),
                   (rand(4, 3), rand(2, 3)), (0, 1)),
    "max_unpool2d": (lambda x: F.max_unpool2d(*F.max_pool2d(x.sin(), 2, return_indices=True), 2).tanh().sum(),
                     (rand(1, 2, 4, 4),), (0,)),
}
# Duplicate overwriting writes: only the surviving write carries a derivative, in both directions
# (torch's backward credits every duplicate, its forward mode the survivor: the reference detaches
# the losers, which is what the program computes).
_DUP = _idx(0, 2, 0)
_SURVIVOR = torch.zeros(4, 3, dtype=torch.long).index_put((_DUP,), torch.arange(3)[:, None].expand(3, 3).contiguous())
_WON = (_SURVIVOR[_DUP] == torch.arange(3)[:, None])
VARIANTS["index_put_duplicates"] = (
    lambda x, v: x.sin().index_put((_DUP,), v.exp()).tanh().sum(0), (rand(4, 3), rand(3, 3)), (0, 1),
    lambda x, v: x.sin().index_put((_DUP,), torch.where(_WON, v.exp(), v.exp().detach())).tanh().sum(0))
_SIDX = _idx(2, 0, 2, 1, 0, 3).view(2, 3)
_SWON = (torch.full((4, 3), -1).scatter(0, _SIDX, torch.arange(6).view(2, 3)).gather(0, _SIDX)
         == torch.arange(6).view(2, 3))
VARIANTS["scatter_duplicates"] = (
    lambda x, s: x.sin().scatter(0, _SIDX, s.exp()).tanh().sum(0), (rand(4, 3), rand(2, 3)), (0, 1),
    lambda x, s: x.sin().scatter(0, _SIDX, torch.where(_SWON, s.exp(), s.exp().detach())).tanh().sum(0))
for _red in ("sum", "mean", "amax", "amin"):
    for _inc in (True, False):
        VARIANTS[f"scatter_reduce_{_red}_{'self' if _inc else 'noself'}"] = (
            lambda x, s, red=_red, inc=_inc: x.sin().scatter_reduce(0, _idx(2, 0, 2, 1, 0, 2).view(2, 3), s.exp(), red,
                                                                     include_self=inc).tanh().sum(0),
            (rand(4, 3), rand(2, 3)), (0, 1))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant(name, mode):
    fn, args, wrt, *reference = VARIANTS[name]
    check(fn, args, wrt=wrt, order=2 if len(wrt) > 1 else 3, mode=mode,
          reference_fn=reference[0] if reference else None)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_conv_per_sample_and_diagonal(mode):
    x = rand(3, 2, 4, 4)
    f = lambda x: F.conv2d(x.sin(), W, padding=1).tanh().sum((1, 2, 3))  # noqa: E731
    single = lambda xi: f(xi[None])[0]  # noqa: E731
    res = hoad.compile(f, order=3, batch_dim=0, mode=mode)(x)
    assert_close(res[0, 0], vmap(jacfwd(jacrev(single)))(x), "per-sample Hessians")
    assert_close(res[0, 0, 0], vmap(jacfwd(jacfwd(jacrev(single))))(x), "per-sample third order")
    diag = hoad.compile(f, order=2, diagonal=True, mode=mode)(x)
    dense = jacfwd(jacrev(f))(x).reshape(3, x.numel(), x.numel())
    assert_close(diag[0, 0].reshape(3, -1), dense.diagonal(dim1=1, dim2=2), "pure second derivatives")


def test_conv_weight_block_keeps_the_channel_diagonal():
    """∂y/∂w of a convolution ties the output channel to the weight's: stored compactly."""
    x = rand(2, 2, 4, 4)
    cf = hoad.compile(lambda w: F.conv2d(x, w), order=1, mode="forward")
    res = cf(W)
    assert_close(res[0], jacrev(lambda w: F.conv2d(x, w))(W), "d/dw")
    dense = 2 * 3 * 2 * 2 * W.numel()
    assert cf.graph.program.stored[(0,)] * W.shape[0] == dense


def test_embedding_scale_grad_by_freq_is_refused():
    w = rand(4, 3)
    with pytest.raises(hoad.HoadError, match="scale_grad_by_freq"):
        hoad.compile(lambda w: F.embedding(_idx(0, 1, 1), w, scale_grad_by_freq=True).sum(), order=1)(w)
