"""Diagonal pruning and batch_dim: compact blocks equal dense ones, per-sample blocks equal
vmap(hessian), coupling ops are named, and compact programs do not grow with B²."""

import pytest
import torch
from helpers import assert_close, compiled, inductor_layout, rand
from op_cases import CASES
from torch.func import hessian, jacfwd, jacrev, vmap

import hoad
from hoad.algebra import Target

W1 = rand(4, 8, seed=21) / 2
W2 = rand(8, 8, seed=22) / 3
W3 = rand(8, 1, seed=23) / 3


def point(x):  # one sample: R^4 -> R
    h = torch.tanh(x @ W1)
    h = torch.tanh(h @ W2)
    return (h @ W3).squeeze(-1)


def batched(X):  # (B, 4) -> (B,)
    return point(X)


def vector_point(x):  # R^4 -> R^2 per sample, to check non-scalar per-sample outputs
    return torch.stack([x.sin().sum(), (x[:2] * x[2:]).prod()])


@pytest.fixture(params=["eager", "fused"])
def layouts(request):
    """Run each test on the program laid out for eager and on the one laid out for Inductor
    (run eagerly here: Inductor compiles cost seconds), whose contractions differ."""
    return inductor_layout() if request.param == "fused" else None


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_per_sample_blocks_equal_vmap_of_torch_func(mode, layouts):
    X = rand(5, 4, seed=1)
    res = compiled(batched, order=3, batch_dim=0, mode=mode, target=layouts)(X)
    assert_close(res.value, vmap(point)(X), "value")
    assert_close(res[0], vmap(jacrev(point))(X), "per-sample gradient")
    assert_close(res[0, 0], vmap(hessian(point))(X), "per-sample Hessian")
    assert_close(res[0, 0, 0], vmap(jacfwd(hessian(point)))(X), "per-sample third order")
    assert res[0, 0].shape == (5, 4, 4)


def test_fused_layout_sums_small_per_sample_products():
    """For Inductor, per-sample products of small matrices become a broadcast product and sum
    (one fused reduction) instead of bmm, except where a contracted axis is stored innermost
    (with 12 samples the Jacobians are one wide GEMM, stored hidden unit first)."""
    X = rand(12, 4, seed=1)

    def program(target=None):
        cf = compiled(batched, order=3, batch_dim=0, mode="reverse", target=target)
        res = cf(X)
        assert_close(res[0, 0], vmap(hessian(point))(X), "per-sample Hessian")
        assert_close(res[0, 0, 0], vmap(jacfwd(hessian(point)))(X), "per-sample third order")
        return str(cf.graph)

    eager = program()
    fused = program(inductor_layout())  # run eagerly: the same values from the program laid out for Inductor
    assert fused.count("aten.bmm") < eager.count("aten.bmm")
    assert fused.count("aten.sum.dim_IntList") > eager.count("aten.sum.dim_IntList")


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_per_sample_vector_output_and_two_inputs(mode, layouts):
    X, Y = rand(3, 4, seed=2), rand(3, 4, seed=3)

    def f(X, Y):
        return torch.stack([(X.sin() * Y).sum(1), (X[:, :2] * Y[:, 2:]).prod(1)], 1)

    def single(x, y):
        return torch.stack([(x.sin() * y).sum(), (x[:2] * y[2:]).prod()])

    res = compiled(f, order=2, wrt=(0, 1), batch_dim=0, mode=mode, target=layouts)(X, Y)
    for i in range(2):
        assert_close(res[i], vmap(jacrev(single, argnums=i))(X, Y), f"grad {i}")
        for j in range(2):
            ref = vmap(jacfwd(jacrev(single, argnums=i), argnums=j))(X, Y)
            assert_close(res[i, j], ref, f"block {i},{j}")
    assert res[0, 1].shape == (3, 2, 4, 4)


def test_batch_of_one_sample():
    X = rand(1, 4, seed=4)
    res = hoad.compile(batched, order=2, batch_dim=0)(X)
    assert_close(res[0, 0], vmap(hessian(point))(X), "B=1")


@pytest.mark.parametrize("op", sorted(CASES, key=str)[::3], ids=str)
def test_compact_blocks_equal_dense_blocks(op):
    """The same programs built from dense identity seeds (no ties anywhere) give equal blocks."""
    case = CASES[op]
    if case.tol is not None:
        pytest.skip("float32 casts round differently in dense and compact programs")
    order = min(case.order, 3)
    compact = hoad.compile(case.fn, order=order, wrt=case.wrt)(*case.args)
    dense = compiled(case.fn, order=order, wrt=case.wrt, target=Target(dense_seeds=True))(*case.args)
    for key in compact:
        torch.testing.assert_close(compact[key], dense[key], rtol=1e-9, atol=1e-9)


def test_attention_across_the_batch_is_a_coupling_error():
    def attend(X):  # every sample attends to every other sample
        scores = torch.softmax(X @ X.t(), dim=-1)
        return (scores @ X).sum(1)

    with pytest.raises(hoad.BatchCouplingError) as e:
        hoad.compile(attend, order=2, batch_dim=0)(rand(4, 3))
    msg = str(e.value)
    assert "aten.mm" in msg and "test_batch.py" in msg and "batch_dim" in msg


def test_a_python_loop_over_the_samples_is_named_with_its_line_and_the_way_out():
    """unbind's slices come from a decomposition (no eager op to stop at): the error named no line.
    It names the line around them now, and torch.vmap, which hoad keeps per sample."""
    def looped(X):
        return torch.stack([x.sin().sum() for x in X.unbind(0)])

    X = rand(3, 2)
    with pytest.raises(hoad.BatchCouplingError) as e:
        hoad.compile(looped, order=2, batch_dim=0, backend="eager")(X)
    assert "near " in str(e.value) and "test_batch.py" in str(e.value) and "torch.vmap" in str(e.value)
    mapped = lambda X: torch.vmap(lambda x: x.sin().sum())(X)  # noqa: E731
    assert_close(hoad.compile(mapped, order=2, batch_dim=0, backend="eager")(X)[0, 0],
                 vmap(hessian(lambda x: x.sin().sum()))(X), "the vmapped function")


def test_batchnorm_in_training_mode_is_a_coupling_error():
    """The error names the user's line and the module it called into: the op that mixes the
    samples (a sum of batch norm's decomposition) is located by running the same decompositions."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Tanh()).double().train()

    def f(X):
        return net(X).sum(1)

    with pytest.raises(hoad.BatchCouplingError) as e:
        hoad.compile(f, order=2, batch_dim=0)(rand(4, 3))
    assert "test_batch.py" in str(e.value) and "return net(X).sum(1) (in BatchNorm1d)" in str(e.value)


def test_batchnorm_in_eval_mode_is_per_sample():
    bn = torch.nn.BatchNorm1d(3, dtype=torch.float64).eval()
    bn.running_mean.copy_(rand(3, seed=8))
    bn.running_var.copy_(rand(3, seed=9, positive=True))

    def f(X):
        return bn(X).tanh().sum(1)

    X = rand(4, 3)
    res = hoad.compile(f, order=2, batch_dim=0)(X)
    assert_close(res[0, 0], vmap(hessian(lambda x: f(x[None])[0]))(X), "eval batchnorm")


def test_batch_dim_argument_checks():
    with pytest.raises(hoad.InvalidArgumentError, match="batch_dim"):
        hoad.compile(batched, order=2, batch_dim=1)
    with pytest.raises(hoad.InvalidArgumentError, match="scalar"):
        hoad.compile(lambda X: batched(X).sum(), order=2, batch_dim=0)(rand(3, 4))
    with pytest.raises(hoad.InvalidArgumentError, match="samples"):
        hoad.compile(lambda X, w: (X @ w).sum(1), order=2, wrt=(0, 1), batch_dim=0)(rand(3, 4), rand(4, 2))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_compact_order_three_program_does_not_grow_with_b_squared(mode):
    """Every tensor in the per-sample order-3 program is O(B): no B x B intermediate."""
    sizes = {}
    for B in (5, 19):  # sizes that no other axis has
        cf = hoad.compile(batched, order=3, batch_dim=0, mode=mode)
        cf(rand(B, 4))
        gm = cf.graph.module
        largest = max(n.meta["val"].numel() for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))
        sizes[B] = largest
        assert not any(
            isinstance(n.meta.get("val"), torch.Tensor) and list(n.meta["val"].shape).count(B) >= 2
            for n in gm.graph.nodes
        ), "a tensor with two sample axes: the sample diagonal was densified"
    assert sizes[19] <= 19 / 5 * sizes[5] * 1.01  # linear in B


def test_elementwise_over_a_million_entries_is_elementwise():
    x = torch.randn(10**6, dtype=torch.float64)
    cf = hoad.compile(torch.sin, order=3, batch_dim=0)
    res = cf(x)
    assert_close(res[0], x.cos(), "sin'")
    assert_close(res[0, 0], -x.sin(), "sin''")
    assert_close(res[0, 0, 0], -x.cos(), "sin'''")
    assert max(n.meta["val"].numel() for n in cf.graph.module.graph.nodes
               if isinstance(n.meta.get("val"), torch.Tensor)) == 10**6


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("equation", ["bnd,de->bne", "...d,de->...e"])
def test_einsum_over_sets_of_points_is_per_sample(equation, mode):
    """torch's einsum views [B, N, d] as [1, B·N, d] for one bmm; hoad's sample pass keeps B apart
    (it was a false BatchCouplingError)."""
    from helpers import check

    W = rand(3, 5, seed=30)
    check(lambda X: torch.einsum(equation, X, W).tanh().sum((1, 2)), (rand(3, 4, 3, seed=31),), order=3,
          batch_dim=0, mode=mode)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("how", ["repeat", "tile", "repeat-lead"])
def test_repeating_within_samples_is_per_sample(how, mode):
    """x.repeat(1, k) repeats each sample's features: a false BatchCouplingError before (repeat's
    rule kept no axis apart)."""
    from helpers import check

    fn = {"repeat": lambda x: x.repeat(1, 2, 1), "tile": lambda x: x.tile((2, 1)),
          "repeat-lead": lambda x: x.repeat(1, 1, 3, 2).squeeze(0)}[how]
    check(lambda x: (fn(x).sin() * fn(x.cos())).sum((1, 2)), (rand(3, 2, 4, seed=32),), order=3, batch_dim=0,
          mode=mode)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_a_matmul_by_a_vector_over_sets_is_per_sample(mode):
    """torch's X @ w for a 1-D w squeezes its [B·N, 1] product before the view back to [B, N]
    (it was a false BatchCouplingError)."""
    from helpers import check

    w = rand(4, seed=32)
    check(lambda X: torch.tanh(X @ w).sum(-1), (rand(3, 5, 4, seed=33),), order=3, batch_dim=0, mode=mode)


def _math_attention(f):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def reference(*args):  # torch.func differentiates the math kernel of attention to any order
        with sdpa_kernel(SDPBackend.MATH):
            return f(*args)

    return reference


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("weights", [False, True])
def test_multi_head_attention_within_each_sample_is_per_sample(weights, mode):
    """nn.MultiheadAttention views [L, B, E] as [L, B·heads, d] and joins the heads back before
    its output projection; with its attention weights (the default) it runs bmm and softmax on
    [B·heads, L, L]. The sample pass keeps B apart (both were false BatchCouplingErrors)."""
    from helpers import check

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(6, 2, batch_first=True, dtype=torch.float64).eval()

    def f(X):
        out, attention = mha(X, X, X, need_weights=weights)
        return out.tanh().sum((1, 2)) + (attention.sin().sum((1, 2)) if weights else 0)

    check(f, (rand(3, 4, 6, seed=34),), order=2, batch_dim=0, mode=mode, reference_fn=_math_attention(f))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("kind", ["fixed memory", "kdim vdim", "zero attention", "memory wrt"])
def test_cross_attention_is_per_sample(kind, mode):
    """Keys and values that do not vary (a fixed memory, kdim/vdim) are viewed [S, B·heads, d]
    and transposed for attention's bmm; add_zero_attn joins a zero key to [B·heads, S, d]. The
    sample pass keeps B apart in both (they were false BatchCouplingErrors)."""
    from helpers import check

    torch.manual_seed(3)
    dims = {"kdim": 5, "vdim": 4} if kind == "kdim vdim" else {}
    mha = torch.nn.MultiheadAttention(6, 2, batch_first=True, add_zero_attn=kind == "zero attention",
                                      dtype=torch.float64, **dims).eval()
    k, v = rand(1, 5, dims.get("kdim", 6), seed=43), rand(1, 5, dims.get("vdim", 6), seed=44)
    X = rand(3, 4, 6, seed=45)
    if kind == "memory wrt":
        def f(X, M):
            return mha(X, M, M)[0].tanh().sum((1, 2))

        check(f, (X, rand(3, 5, 6, seed=46)), wrt=(0, 1), order=2, batch_dim=0, mode=mode,
              reference_fn=_math_attention(f))
        return

    def f(X):
        if kind == "zero attention":
            return mha(X, X, X)[0].tanh().sum((1, 2))
        B = X.shape[0]
        return mha(X, k.expand(B, -1, -1), v.expand(B, -1, -1))[0].tanh().sum((1, 2))

    check(f, (X,), order=2, batch_dim=0, mode=mode, reference_fn=_math_attention(f))


def test_a_transformer_encoder_layer_is_per_sample():
    from helpers import check

    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(6, 2, dim_feedforward=8, dropout=0.0, batch_first=True,
                                             dtype=torch.float64).eval()

    def f(X):
        return layer(X).sin().sum((1, 2))

    check(f, (rand(2, 3, 6, seed=35),), order=2, batch_dim=0, reference_fn=_math_attention(f))


@pytest.mark.parametrize("kind", ["1d", "2d affine", "1d eval running stats"])
def test_instance_norm_is_per_sample(kind):
    """Instance norm views [B, C, ...] as [1, B·C, ...] for a batch norm of one batch entry (its
    weight and running statistics repeated per sample); the sample pass keeps B apart (it was a
    false BatchCouplingError)."""
    from helpers import check

    torch.manual_seed(2)
    if kind == "1d":
        norm, X = torch.nn.InstanceNorm1d(3, dtype=torch.float64), rand(2, 3, 5, seed=36)
    elif kind == "2d affine":
        norm, X = torch.nn.InstanceNorm2d(3, affine=True, dtype=torch.float64), rand(2, 3, 2, 3, seed=37)
        with torch.no_grad():
            norm.weight.copy_(rand(3, seed=38))
            norm.bias.copy_(rand(3, seed=39))
    else:
        norm = torch.nn.InstanceNorm1d(3, affine=True, track_running_stats=True, dtype=torch.float64).eval()
        norm.running_mean.copy_(rand(3, seed=40))
        norm.running_var.copy_(rand(3, seed=41, positive=True))
        X = rand(2, 3, 5, seed=42)

    def f(X):
        return norm(X).tanh().flatten(1).sum(1)

    def plain(X):  # the same maths in plain ops: torch.func's derivatives of norms' statistics are
        dims = tuple(range(2, X.ndim))  # wrong from order 3 (torch 2.13)
        shape = (-1,) + (1,) * len(dims)
        if norm.track_running_stats and not norm.training:
            mean, var = norm.running_mean.view(shape), norm.running_var.view(shape)
        else:
            mean = X.mean(dims, keepdim=True)
            var = ((X - mean) ** 2).mean(dims, keepdim=True)
        y = (X - mean) / torch.sqrt(var + norm.eps)
        if norm.affine:
            y = y * norm.weight.view(shape) + norm.bias.view(shape)
        return y.tanh().flatten(1).sum(1)

    check(f, (X,), order=2 if kind == "2d affine" else 3, batch_dim=0, reference_fn=plain)


def test_a_reduction_across_merged_samples_is_still_a_coupling_error():
    def f(X):  # [B, C, L] viewed [1, B·C, L] and summed over B·C: samples mix
        return X.view(1, -1, X.shape[-1]).sin().sum(1).expand(X.shape[0], -1).sum(1)

    with pytest.raises(hoad.BatchCouplingError):
        hoad.compile(f, order=2, batch_dim=0)(rand(2, 3, 4))


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_recurrent_layers_are_per_sample(cell):
    """torch's GRU and LSTM join their steps' [B, h] outputs into [T·B, h] viewed as [T, B, h]; the
    sample pass stacks them instead (it was a false BatchCouplingError)."""
    torch.manual_seed(3)
    rnn = getattr(torch.nn, cell)(3, 4, batch_first=True, dtype=torch.float64).eval()

    def f(X):
        return rnn(X)[0].sin().sum((1, 2))

    X = rand(2, 3, 3, seed=43)
    res = hoad.compile(f, order=2, batch_dim=0)(X)
    one = lambda x: f(x.unsqueeze(0)).squeeze(0)  # noqa: E731  (vmap cannot run torch's LSTM cell:
    for b, x in enumerate(X):                      # the reference is a loop over the samples)
        assert_close(res[0][b], jacrev(one)(x), "gradient")
        assert_close(res[0, 0][b], jacfwd(jacrev(one))(x), "Hessian")


MATRIX_FUNCTIONS = {
    "eigvalsh": lambda M: torch.linalg.eigvalsh(M + M.mT).pow(3).sum(-1),
    "eigh vectors": lambda M: (torch.linalg.eigh(M + M.mT)[1] ** 4 * torch.arange(4.0, dtype=M.dtype)).sum((-1, -2)),
    "svdvals": lambda M: torch.linalg.svdvals(M).log().sum(-1),
    "svd U": lambda M: torch.linalg.svd(M)[0].abs().sum((-1, -2)),
    "nuclear norm": lambda M: torch.linalg.matrix_norm(M, "nuc"),
    "qr": lambda M: torch.linalg.qr(M)[1].diagonal(dim1=-2, dim2=-1).abs().log().sum(-1),
    "lu_factor": lambda M: torch.linalg.lu_factor(M)[0].diagonal(dim1=-2, dim2=-1).abs().log().sum(-1),
    "pinv": lambda M: torch.linalg.pinv(M).sin().sum((-1, -2)),
    "matrix_exp": lambda M: torch.linalg.matrix_exp(0.1 * M.sin()).sum((-1, -2)),
}


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("name", list(MATRIX_FUNCTIONS))
def test_factorizations_of_one_matrix_per_sample_are_per_sample(name, mode):
    """torch.linalg acts on each matrix of a batch alone: under batch_dim=0 the factorizations'
    rules and VJPs kept no tie to the sample axis (a BatchCouplingError told to drop batch_dim)."""
    f = MATRIX_FUNCTIONS[name]
    X = rand(3, 4, 4, seed=91) + 3 * torch.eye(4, dtype=torch.float64)
    res = hoad.compile(f, order=2, batch_dim=0, backend="eager", mode=mode)(X)
    assert_close(res[0], vmap(jacrev(f))(X), f"{name} gradient")
    assert_close(res[0, 0], torch.stack([jacrev(jacrev(f))(x) for x in X]), f"{name} Hessian")


_DST = torch.tensor([0, 2, 2, 4, 1, 0, 3])
_SRC = torch.tensor([1, 0, 3, 2, 4, 4, 0])
SCATTERS = {  # GNN messages x[:, src] -> nodes dst, per sample: (B, N, F)
    "index_add": lambda x: torch.zeros_like(x).index_add(1, _DST, x[:, _SRC].sin()),
    "scatter_add": lambda x: torch.zeros_like(x).scatter_add(1, _DST[None, :, None].expand(x.shape[0], -1, 2),
                                                             x[:, _SRC].sin()),
    "scatter_reduce amax": lambda x: torch.zeros_like(x).scatter_reduce(
        1, _DST[None, :, None].expand(x.shape[0], -1, 2), x[:, _SRC].sin(), "amax", include_self=False),
    "scatter_reduce mean": lambda x: x.scatter_reduce(1, _DST[None, :, None].expand(x.shape[0], -1, 2),
                                                      x[:, _SRC].sin(), "mean"),
    "index_put accumulate": lambda x: torch.ops.aten.index_put(x, [None, _DST], x[:, _SRC].sin(), True),
}


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("name", list(SCATTERS))
def test_scatters_along_a_feature_axis_are_per_sample(name, mode):
    """Scatters along dim 1 of (B, N, F) act on each sample alone; their rules untied the sample
    axis (a BatchCouplingError for batched GNN message passing)."""
    f = lambda x: SCATTERS[name](x).pow(2).sum((1, 2))  # noqa: E731
    X = rand(3, 5, 2, seed=94)
    res = hoad.compile(f, order=2, batch_dim=0, backend="eager", mode=mode)(X)
    one = lambda x: f(x[None])[0]  # noqa: E731
    assert_close(res[0], torch.stack([jacrev(one)(x) for x in X]), f"{name} gradient")
    assert_close(res[0, 0], torch.stack([jacrev(jacrev(one))(x) for x in X]), f"{name} Hessian")


_PER = torch.tensor([[0, 1, 1, 4], [2, 2, 3, 0], [4, 0, 0, 1]])  # (B, k): one index list per sample
_PER_DISTINCT = torch.tensor([[1, 3, 4], [2, 3, 0], [0, 4, 1]])


def _rows(x):
    return torch.arange(x.shape[0])[:, None]


INDEXED_BY_SAMPLE = {  # x[arange(B)[:, None], idx]: each sample indexes its own row
    "read shared": lambda x: x[_rows(x), _SRC],
    "read per sample": lambda x: x[_rows(x), _PER[:x.shape[0]]],
    "accumulate shared": lambda x: torch.zeros_like(x).index_put((_rows(x), _DST), x[:, _SRC].sin(), accumulate=True),
    "accumulate per sample": lambda x: x.index_put((_rows(x), _PER[:x.shape[0]]), x[:, :4].sin(), accumulate=True),
    # (distinct positions: where two writes meet, torch's backward gives both the derivative)
    "write per sample": lambda x: x.index_put((_rows(x), _PER_DISTINCT[:x.shape[0]]), x[:, 2:].sin()),
}


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("name", list(INDEXED_BY_SAMPLE))
def test_indexing_each_samples_own_row_is_per_sample(name, mode):
    """An arange over the samples as the first index was an advanced index over dim 0 (a
    BatchCouplingError); the sample pass makes it x[:, idx], or a gather or scatter along dim 1."""
    f = lambda x: INDEXED_BY_SAMPLE[name](x).tanh().pow(2).sum((1, 2))  # noqa: E731
    X = rand(3, 5, 2, seed=95)
    res = hoad.compile(f, order=2, batch_dim=0, backend="eager", mode=mode)(X)
    one = lambda i: (lambda x: f(torch.cat([X[:i], x[None], X[i + 1:]]))[i])  # noqa: E731
    assert_close(res[0], torch.stack([jacrev(one(i))(X[i]) for i in range(3)]), f"{name} gradient")
    assert_close(res[0, 0], torch.stack([jacrev(jacrev(one(i)))(X[i]) for i in range(3)]), f"{name} Hessian")
