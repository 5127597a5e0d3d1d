"""Every pass preserves the program's outputs; prune and clean remove what they promise."""

import pytest
import torch
import torch.fx as fx
from helpers import assert_close, compiled, rand
from op_cases import CASES
from torch.fx.experimental.proxy_tensor import make_fx

import hoad
from hoad.algebra import Target
from hoad.binding import bind_layout
from hoad.passes.capture import capture
from hoad.passes.clean import clean
from hoad.passes.differentiate import differentiate
from hoad.passes.hoist import Prefix, hoist
from hoad.passes.prune import prune

aten = torch.ops.aten


def traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def calls(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_prune_removes_trivial_arithmetic():
    def f(x):
        a = x * 1.0 + 0.0
        b = -(-a)  # noqa: B002 (a double negation for prune to remove)
        c = (b * 2.0) * 3.0
        return c, torch.neg(x) * 4.0

    x = rand(3)
    gm = prune(traced(f, x))
    assert calls(gm).count(aten.mul.Tensor) == 2 and aten.neg.default not in calls(gm)
    out = gm(x)
    torch.testing.assert_close(out[0], x * 6.0)
    torch.testing.assert_close(out[1], x * -4.0)


def test_prune_keeps_a_multiplication_by_one_that_lays_out_its_operand():
    """x * 1 of an expanded, transposed x is a dense copy: the view after it was traced on that
    copy and cannot be taken on the expand (a factor V.T.expand(B, D, S) * 1.0 in a one-program
    training step failed with "view size is not compatible")."""
    def f(v):
        return (v.t().expand(4, 3, 2) * 1.0).permute(0, 2, 1).view(8, 3).sin()

    v = rand(2, 3)
    gm = prune(traced(f, v))
    assert aten.mul.Tensor in calls(gm)
    torch.testing.assert_close(gm(v), f(v))
    negated = prune(traced(lambda v: (-(-v.t().expand(4, 3, 2))).permute(0, 2, 1).view(8, 3), v))  # noqa: B002
    assert aten.neg.default in calls(negated)
    torch.testing.assert_close(negated(v), v.t().expand(4, 3, 2).permute(0, 2, 1).reshape(8, 3))

    def g(x):  # the same inside hoad.compile: "a bug in hoad" from its own program, on a closed-over v or on x
        return (x * (v.t().expand(4, 3, 2) * 1.0).permute(0, 2, 1).reshape(8, 3)).sin().sum() + f(x[:2]).sum()

    x = rand(8, 3, seed=1)
    assert_close(hoad.compile(g, order=2)(x)[0, 0], torch.func.hessian(g)(x), "Hessian")


def test_clean_folds_layout_and_merges_duplicates():
    def f(x):
        a = x.view(2, 3).view(6).permute(0)
        return a.sin() + x.sin()

    x = rand(6)
    gm = clean(traced(f, x))
    assert calls(gm).count(aten.sin.default) == 1
    assert aten.permute.default not in calls(gm)
    torch.testing.assert_close(gm(x), 2 * x.sin())


@pytest.mark.parametrize("op", sorted(CASES, key=str)[::5], ids=str)
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_passes_preserve_outputs(op, direction):
    case = CASES[op]
    layout, tensors = bind_layout(case.fn, case.args, {})
    captured = capture(case.fn, layout, tensors, list(case.wrt))
    program = differentiate(captured, 2, direction)
    tensors = list(tensors) + captured.free
    raw = program.gm(*tensors)
    for name, p in (("prune", prune), ("clean", clean)):
        gm = p(program.gm)
        for a, b in zip(raw, gm(*tensors)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_fold_constants_precomputes_what_depends_on_no_input():
    W = rand(3, 3, seed=9)

    def f(x):
        return x @ (W @ W.t()).exp() + torch.eye(3, dtype=torch.float64).sum()

    x = rand(2, 3)
    gm = make_fx(f, tracing_mode="fake", _allow_non_fake_inputs=True)(x)
    before = calls(gm)
    folded = clean(gm)
    assert aten.exp.default in before and aten.exp.default not in calls(folded)
    assert calls(folded).count(aten.mm.default) == 1
    torch.testing.assert_close(folded(x), f(x))


@pytest.mark.parametrize("op", sorted(CASES, key=str)[1::4], ids=str)
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_lazy_jets_equal_evaluated_jets(op, mode):
    """Programs whose order >= 2 jets stay unevaluated until absorbed give the same blocks as
    programs that evaluate every jet where it is made."""
    case = CASES[op]
    if case.tol is not None:
        pytest.skip("float32 casts round differently along different contraction paths")
    order = min(case.order, 3)
    lazy = hoad.compile(case.fn, order=order, wrt=case.wrt, mode=mode)(*case.args)
    evaluated = compiled(case.fn, order=order, wrt=case.wrt, mode=mode, target=Target(lazy=False))(*case.args)
    for key in lazy:
        torch.testing.assert_close(lazy[key], evaluated[key], rtol=1e-10, atol=1e-10)


def test_lazy_jets_reassociate_the_second_order_chain():
    """Order 3 of a two-layer MLP in reverse mode never forms W2ᵀ·D²(tanh1) (64 x 16 x 16 per
    point): the remainder of the second layer contracts the adjoint through W2 first."""
    W1, W2, W3 = rand(16, 64, seed=1) / 4, rand(64, 64, seed=2) / 8, rand(64, 1, seed=3) / 8

    def f(x):
        return (torch.tanh(torch.tanh(x @ W1) @ W2) @ W3).squeeze(-1)

    cf = hoad.compile(f, order=3, mode="reverse")
    cf(rand(16))
    mms = [n for n in cf.graph.module.graph.nodes if n.target == aten.mm.default]
    flops = sum(2 * n.args[0].meta["val"].numel() * n.args[1].meta["val"].shape[-1] for n in mms)
    shapes = [(tuple(n.args[0].meta["val"].shape), tuple(n.args[1].meta["val"].shape)) for n in mms]
    assert ((64, 64), (64, 256)) not in shapes and ((256, 64), (64, 64)) not in shapes, "W2ᵀ·D² was formed"
    assert flops < 2.5e6  # 3.9e6 when the chain is evaluated layer by layer


def test_a_node_limit_stops_the_transform_and_leaves_its_graph_as_it_was():
    """differentiate(node_limit=...) counts the nodes before each primal node and, through the
    graph's create_node, inside its rule; past the bound it raises Overgrown, and a transform that
    stays under it returns the same program, whose graph creates nodes as any other."""
    from hoad.passes.differentiate import Overgrown

    W = rand(3, 3, seed=9)

    def f(x):
        return ((x * x) @ W).sin().sum()

    x = rand(2, 3)
    layout, tensors = bind_layout(f, (x,), {})
    captured = capture(f, layout, tensors, [0])
    free = differentiate(captured, 3, "forward")
    counts = free.stats["traced"]
    assert len(counts) >= 3 and counts == tuple(sorted(counts)) and counts[-1] == len(free.gm.graph.nodes)
    bounded = differentiate(captured, 3, "forward", node_limit=counts)
    assert bounded.stats["traced"] == counts and "create_node" not in vars(bounded.gm.graph)
    assert str(bounded.gm.code) == str(free.gm.code)
    grows = max(range(1, len(counts)), key=lambda i: counts[i] - counts[i - 1])  # the costliest rule
    with pytest.raises(Overgrown) as stopped:  # stopped inside that rule, not at the next node
        differentiate(captured, 3, "forward", node_limit=counts[:grows] + (counts[grows - 1] + 1,))
    assert stopped.value.nodes == counts[grows - 1] + 2 < counts[grows]
    with pytest.raises(Overgrown):
        differentiate(captured, 3, "forward", node_limit=counts[:-1] + (counts[-1] - 1,))


def test_hoist_splits_off_what_only_free_tensors_determine():
    W = rand(3, 3, seed=9)

    def f(x):
        return (x @ (W @ W.t()).exp()).sin().sum()

    x = rand(2, 3)
    layout, tensors = bind_layout(f, (x,), {})
    captured = capture(f, layout, tensors, [0])
    assert [t is W for t in captured.free] == [True]
    program = differentiate(captured, 2, "forward")
    inputs = [x, W]
    expected = program.gm(*inputs)
    prefix, main, reads = hoist(program.gm, 1)
    assert reads == [0] and aten.exp.default in calls(prefix) and aten.exp.default not in calls(main)
    for a, b in zip(expected, main(*inputs, *prefix(W))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_hoist_keeps_in_the_main_program_whatever_reads_a_value_left_there(monkeypatch):
    """A value too large to keep between calls stays in the main program, and so does every value
    computed from it, however far down the chain (the biharmonic of a 768-wide network failed to
    build: 'the hoist stage failed: KeyError: slice_1')."""
    import hoad.passes.hoist as hoisting

    def f(x, W):
        big = W @ W.t()                 # too large to keep (the limit lowered below), read by the main program
        near = big * 2                  # reads it
        far = (near + 1).exp().sum(0)   # reads what reads it, and is small
        small = W.sum(0).sin()          # hoisted still
        return (x @ big).sum() + x @ far + x @ small

    x, W = rand(2, 6, seed=1), rand(6, 6, seed=2)
    gm = traced(f, x, W)
    expected = gm(x, W)
    monkeypatch.setattr(hoisting, "HOIST_LIMIT_BYTES", 100)  # (a 6 x 6 matrix takes 288 bytes)
    prefix, main, reads = hoist(gm, 1)
    assert reads == [0] and aten.sin.default in calls(prefix) and aten.exp.default in calls(main)
    torch.testing.assert_close(main(x, W, *prefix(W)), expected, rtol=1e-12, atol=1e-12)


def test_a_prefix_runs_again_only_when_its_tensors_change():
    runs = []
    W = rand(3, seed=1)
    prefix = Prefix(lambda w: (runs.append(1), (w * 2,))[1], reads=[0], first_free=1)
    first = prefix([W])
    assert prefix([W])[0] is first[0] and len(runs) == 1
    W.add_(1.0)  # in place: a new version
    torch.testing.assert_close(prefix([W])[0], 2 * W)
    assert len(runs) == 2
    prefix([W.clone()])  # another object with the same values
    assert len(runs) == 3
    P = W.clone().requires_grad_(True)
    prefix([P])
    prefix([P])  # autograd must see every call: never reused
    assert len(runs) == 5
    with torch.no_grad():
        prefix([P])
        prefix([P])
    assert len(runs) == 6


def test_sink_permutes_computes_a_jet_in_the_order_its_matrix_reads():
    """view(permute(e)) of an elementwise e stored in another order than its logical one (as
    eager lays out s[p,j] * w[d,j] viewed [p,j,d]) becomes e computed in its stored order and
    read as permute(view(e')): no view of a permute left, the same values."""
    from hoad.lowering.inductor import InductorLowering
    from hoad.passes.lower import sink_permutes

    def f(s, w):
        e = s[:, :, None] * w.t()[None]                      # [p, j, d], stored [p, d, j]
        return aten.view(e.permute(1, 0, 2), [3, 8]).sin()   # the matrix [j, (p d)]

    s, w = rand(4, 3), rand(2, 3)
    gm = traced(f, s, w)
    expected = gm(s, w)
    gm = sink_permutes(gm, InductorLowering())
    views = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert all(v.args[0].target is not aten.permute.default for v in views)
    mul, = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    assert mul.meta["val"].is_contiguous() and tuple(mul.meta["val"].shape) == (4, 2, 3)
    torch.testing.assert_close(gm(s, w), expected, rtol=0, atol=0)
    assert sink_permutes(traced(f, s, w), Target().lowering).graph.find_nodes(
        op="call_function", target=aten.permute.default), "the eager lowering keeps the program as traced"


def test_orient_products_makes_tall_products_wide():
    from hoad.passes.lower import orient_products

    a, b, c = rand(2048, 16), rand(16, 16), rand(16, 2)
    gm = orient_products(traced(lambda a, b, c: (a @ b, a @ c), a, b, c))
    shapes = [tuple(n.args[0].meta["val"].shape) for n in gm.graph.nodes if n.target is aten.mm.default]
    assert shapes == [(16, 16), (2048, 16)], "the tall [2048,16]@[16,16] turned wide (bᵀ @ aᵀ); the small one kept"
    for got, want in zip(gm(a, b, c), (a @ b, a @ c)):
        torch.testing.assert_close(got, want)


def test_fold_broadcasts_multiplies_by_the_weight_itself():
    """bmm of a weight expanded over the batch (a nested operator's jets times a layer) becomes a
    matmul by the weight, the broadcast's select reads the weight, and the values stay."""
    from hoad.passes.clean import fold_broadcasts

    def f(W, J, K):
        left = torch.bmm(W.unsqueeze(-1).expand(3, 4, 5).permute(2, 1, 0), J)   # [5, 4, 3] @ [5, 3, 2]
        right = torch.bmm(K, W.expand(5, 3, 4))                                 # [5, 2, 3] @ [5, 3, 4]
        return left.sum() + right.sum()

    W, J, K = rand(3, 4), rand(5, 3, 2), rand(5, 2, 3)
    gm = fold_broadcasts(traced(f, W, J, K), wrt_leaves=[0])
    assert aten.bmm.default not in calls(gm) and aten.expand.default not in calls(gm)
    assert calls(gm).count(aten.matmul.default) == 2
    torch.testing.assert_close(gm(W, J, K), f(W, J, K))
    # a broadcast constant (nothing differentiates W) keeps its batched product
    assert calls(fold_broadcasts(traced(f, W, J, K), wrt_leaves=[1, 2])).count(aten.bmm.default) == 2


def test_fold_broadcast_selects_only_folds_broadcast_axes():
    from hoad.passes.clean import fold_broadcast_selects

    def f(W):
        wide = W.unsqueeze(-1).expand(3, 4, 5).permute(2, 1, 0)   # [5, 4, 3], axis 0 broadcast
        ones = W.unsqueeze(0).expand(6, 3, 4)                      # axis 0 added by the expand
        return wide[2], ones[4], wide.select(1, 1)                 # the last selects a real axis

    W = rand(3, 4)
    gm = traced(f, W)
    assert fold_broadcast_selects(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    selects = [n for n in gm.graph.nodes if n.target is aten.select.int]
    assert len(selects) == 1 and selects[0].args[1] == 1
    for got, want in zip(gm(W), f(W)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_products_of_broadcast_weights_match_torch_func(mode):
    from helpers import check

    def f(W, J):
        n = J.shape[0]
        a = torch.bmm(W.tanh().unsqueeze(0).expand(n, 3, 3), J)           # the weight on the left
        return torch.bmm(J.transpose(1, 2), W.sin().expand(n, 3, 3)).sum((1, 2)) + a.cos().sum((1, 2))

    W, J = rand(3, 3, seed=1), rand(4, 3, 2, seed=2)
    check(lambda W, J: f(W, J).sum(), (W, J), wrt=(0, 1), order=3, mode=mode)
    check(lambda J, W: f(W, J), (J, W), wrt=(0,), order=3, mode=mode, batch_dim=0)


@pytest.mark.parametrize("shapes", [
    ((5, 3, 8), (5, 6, 4), (1, 0, 2), (3, 2, 5, 4)),     # attention's heads: [L, B·h, d] -> [B, h, L, d]
    ((5, 3, 8), (5, 6, 4), (1, 0, 2), (6, 5, 4)),        # the merge kept: left alone
    ((2, 3, 4), (6, 4), (1, 0), (4, 2, 3)),
    ((2, 6), (2, 2, 3), (0, 2, 1), (2, 3, 2)),
    ((5, 3, 8), (5, 6, 4), (1, 0, 2), None),             # the merge moved past the permute
    ((5, 3, 8), (5, 6, 4), (1, 2, 0), None),
])
def test_sample_pass_rewrites_view_permute_view_exactly(shapes):
    """A merging view moved past a permute (split, permute, merge): where a view splits the merge
    again, none is left; the values are the same either way."""
    from hoad.passes.samples import keep_samples_apart

    s0, s1, perm, s3 = shapes

    def f(x):
        y = x.view(s1).permute(perm)
        return (y if s3 is None else y.reshape(s3)).sin()

    x = rand(*s0)
    gm = traced(f, x)
    keep_samples_apart(gm, [0])
    torch.testing.assert_close(gm(x), f(x))
    if s3 == (3, 2, 5, 4):  # the heads' merge is gone
        assert not [n for n in gm.graph.nodes if tuple(getattr(n.meta.get("val"), "shape", ())) == s1]
