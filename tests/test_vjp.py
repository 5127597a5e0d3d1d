"""Every VJP rule against torch.func.vjp, node by node, on the graphs of the rule cases."""

import pytest
import torch
import torch.fx as fx
from helpers import assert_close
from op_cases import CASES
from torch.func import vjp as torch_vjp

from hoad.algebra import Block
from hoad.binding import bind_layout
from hoad.passes.capture import capture
from hoad.passes.samples import keep_samples_apart
from hoad.rules import RULES, VJPS, Jet
from hoad.rules.base import VjpCtx

# ops torch.func cannot differentiate out of place, with an equivalent reference
REFERENCE = {
    # torch has no derivative of remainder(scalar, tensor)
    torch.ops.aten.remainder.Scalar_Tensor: lambda a, b: a - torch.div(a, b, rounding_mode="floor").detach() * b,
    # hoad's single-output linear-algebra ops (custom ops: their autograd formula is not functorch's)
    torch.ops.hoad_linalg.inv.default: torch.linalg.inv,
    torch.ops.hoad_linalg.solve.default: torch.linalg.solve,
    torch.ops.hoad_linalg.logabsdet.default: lambda A: torch.linalg.slogdet(A)[1],
    torch.ops.hoad_linalg.cholesky.default: lambda A, upper=False: torch.linalg.cholesky(A, upper=upper),
    torch.ops.hoad_linalg.eigvalsh.default: lambda A, UPLO="L": torch.linalg.eigh(A, UPLO=UPLO)[0],
    torch.ops.hoad_linalg.eigvecsh.default: lambda A, UPLO="L": torch.linalg.eigh(A, UPLO=UPLO)[1],
    torch.ops.hoad_linalg.svdvals.default: lambda A: torch.linalg.svd(A, full_matrices=False)[1],
    torch.ops.hoad_linalg.svd_u.default: lambda A: torch.linalg.svd(A, full_matrices=False)[0],
    torch.ops.hoad_linalg.svd_vh.default: lambda A: torch.linalg.svd(A, full_matrices=False)[2],
    torch.ops.hoad_linalg.qr_q.default: lambda A: torch.linalg.qr(A)[0],
    torch.ops.hoad_linalg.qr_r.default: lambda A: torch.linalg.qr(A)[1],
    torch.ops.hoad_linalg.lu_packed.default: lambda A: torch.linalg.lu_factor(A)[0],
    torch.ops.hoad_linalg.matrix_exp.default: torch.linalg.matrix_exp,
    torch.ops.hoad_linalg.pinv.default: lambda A, atol=None, rtol=None, hermitian=False: torch.linalg.pinv(
        A, atol=atol, rtol=rtol, hermitian=hermitian),
}


def test_every_rule_has_a_vjp():
    assert set(RULES) == set(VJPS)


def _values(gm: fx.GraphModule, args) -> dict:
    """Every node's concrete value, running the captured graph eagerly."""
    env, it = {}, iter(args)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
        elif node.op == "get_attr":
            env[node] = getattr(gm, node.target)
        elif node.op == "call_function":
            a, k = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            env[node] = node.target(*a, **k)
    return env


@pytest.mark.parametrize("op", sorted(CASES, key=str), ids=str)
def test_vjp_rule(op):
    case = CASES[op]
    layout, tensors = bind_layout(case.fn, case.args, {})
    captured = capture(case.fn, layout, tensors, list(range(len(tensors))))
    gm = captured.gm
    if case.options.get("batch_dim") == 0:
        keep_samples_apart(gm, list(case.wrt))
    env = _values(gm, list(tensors) + captured.free)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]
    assert nodes, f"{op} does not appear in its case"
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for node in nodes:
        out = env[node]
        # jets for the node's tensor arguments; floating ones vary
        jets = {}

        def to_jet(n):
            v = env[n]
            if not isinstance(v, torch.Tensor):
                return v
            jets[n] = Jet(v, varies=v.dtype.is_floating_point)
            return jets[n]

        args, kwargs = fx.node.map_arg((node.args, node.kwargs), to_jet)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        floating = [isinstance(o, torch.Tensor) and o.dtype.is_floating_point for o in outs]
        cots = [torch.randn(o.shape, dtype=o.dtype, generator=gen) if f else None for o, f in zip(outs, floating)]
        g = [Block.dense(c) if c is not None else None for c in cots]
        pairs = VJPS[op](VjpCtx(out), g if isinstance(out, (tuple, list)) else g[0], *args, **kwargs)
        got = {}
        for jet, blk in pairs:
            n = next(k for k, j in jets.items() if j is jet)
            got[n] = got.get(n, 0) + blk.materialize()

        varying = [n for n, j in jets.items() if j.varies]

        def f(*ts):
            sub = dict(zip(varying, ts))
            a, k = fx.node.map_arg((node.args, node.kwargs), lambda n: sub.get(n, env[n]))
            res = REFERENCE.get(op, node.target)(*a, **k)
            res = res if isinstance(res, (tuple, list)) else (res,)
            return tuple(r for r, fl in zip(res, floating) if fl)

        _, vjp_fn = torch_vjp(f, *[env[n] for n in varying])
        expected = vjp_fn(tuple(c for c in cots if c is not None))
        for n, e in zip(varying, expected):
            assert_close(got[n] if n in got else torch.zeros_like(e), e, f"{op} cotangent of {n.name}")
            checked += 1
    assert checked


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_an_empty_result_passes_no_adjoint_back(mode):
    """gather with an empty index of another rank (torch allows it) has an empty result: the
    reverse sweep once scattered its (empty) cotangent into a (5, 0) adjoint of x, and the
    gradient came back with that shape instead of x's (5,)."""
    from helpers import check

    idx = torch.zeros(2, 0, dtype=torch.long)
    w = torch.randn(2, 0, dtype=torch.float64)
    y = torch.randn(3, dtype=torch.float64)

    def f(x, y):  # the empty branch beside a live one, both reading x
        return (w * torch.gather(x, 0, idx).sin()).sum() + (x[:3] * y).tanh().sum()

    x = torch.randn(5, dtype=torch.float64)
    check(f, (x, y), wrt=(0, 1), order=3, mode=mode, backend="eager")
