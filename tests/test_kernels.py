"""hoad::mm and hoad::gram, the float64 AVX-512 kernels Inductor programs use for products with
short inner dimensions and for per-sample Gram matrices, and hoad::jet_sqnorm and jet_mm (AVX2 or AVX-512), a
collapsed Laplacian's squared jets at a layer: equal to torch on every tail shape and layout,
differentiable (formulas registered in C++), and used by the programs whose products suit them."""

import os

import pytest
import torch
from helpers import assert_close, compiled, inductor_layout, rand
from torch.func import hessian, jacfwd, jacrev, vmap

import hoad
from hoad.lowering import kernels
from hoad.lowering.inductor import gram
from hoad.passes.cost import node_cost

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no AVX-512 or no C++ compiler here")
needs_jets = pytest.mark.skipif(not kernels.avx2_available(), reason="no AVX2 or no C++ compiler here")
needs_mm = needs_jets  # hoad::mm: its AVX-512 kernel, or its AVX2 one
# programs use hoad::mm (not where MKL runs its own AVX-512 code: kernels.fits)
programs_use_mm = pytest.mark.skipif(not kernels.mm_used(), reason="MKL's AVX-512 products are faster here")


@needs_mm
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 13, 17])
@pytest.mark.parametrize("n", [1, 8, 16, 31, 32, 33, 48, 70])
@pytest.mark.parametrize("k", [1, 5, 64, 256])
def test_equals_torch_mm_on_tail_shapes(m, n, k):
    a, b = rand(m, k, seed=m * 1000 + k), rand(k, n, seed=n * 1000 + k)
    torch.testing.assert_close(torch.ops.hoad.mm(a, b), a @ b, rtol=1e-13, atol=1e-13)


@needs_mm
@pytest.mark.parametrize("m, k, n", [(17, 768, 70), (5, 2048, 33), (64, 768, 768), (3, 1536, 16), (301, 768, 70),
                                     (67, 2048, 40), (17, 512, 512), (301, 64, 256), (15, 512, 512),
                                     (256, 96, 512), (255, 96, 512)])
def test_equals_torch_mm_over_long_inner_dimensions(m, k, n):
    """The wide layers Inductor programs now give it (inner dimensions up to MAX_K_AVX512), tall
    operands in panels of rows (40 rows of 768, 16 of 2048, the last one short), and B with rows
    a power of two apart copied strip by strip (from 256 rows of A)."""
    a, b = rand(m, k, seed=m + k), rand(k, n, seed=n + k)
    torch.testing.assert_close(torch.ops.hoad.mm(a, b), a @ b, rtol=1e-13, atol=1e-13)


@needs_mm
def test_strided_operands_other_dtypes_and_threads():
    a, b = rand(40, 40, seed=1).t(), rand(80, 33, seed=2)[::2]  # transposed and row-strided
    torch.testing.assert_close(torch.ops.hoad.mm(a, b), a @ b, rtol=1e-13, atol=1e-13)
    a32, b32 = a.float(), b.float()
    torch.testing.assert_close(torch.ops.hoad.mm(a32, b32), a32 @ b32)  # not float64: torch.mm
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.ops.hoad.mm(a, rand(3, 4))
    big_a, big_b = rand(512, 64, seed=3), rand(64, 512, seed=4)  # over THREADED_MACS: MKL when threaded
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.testing.assert_close(torch.ops.hoad.mm(big_a, big_b), big_a @ big_b, rtol=1e-13, atol=1e-13)
    finally:
        torch.set_num_threads(threads)


W1, W2, W3 = rand(16, 64, seed=5) / 4, rand(64, 64, seed=6) / 8, rand(64, 1, seed=7) / 8


def mlp(x):
    return (torch.tanh(torch.tanh(x @ W1) @ W2) @ W3).squeeze(-1)


@programs_use_mm
def test_inductor_layout_programs_use_it_and_stay_exact():
    """The program laid out for Inductor, run eagerly: its [16,64]@[64,256] products are hoad::mm
    (AVX-512; with AVX2, the products of 8 or more columns in whichever orientation whose
    operands need no copy larger than a weight's)."""
    x = rand(16, seed=8)
    cf = compiled(mlp, order=3, mode="reverse", target=inductor_layout())
    res = cf(x)
    assert "hoad.mm(" in str(cf.graph)
    left = [n for n in cf._last.program.gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    if kernels.available():
        assert not left  # the vector-matrix products ([1,64]@[64,64]) are fused reductions
    for n in left:  # AVX2: MKL keeps one-row, narrow, and transposed-activation products (no copy first)
        a, b = (x.meta["val"] for x in n.args)
        assert a.shape[0] == 1 or b.shape[1] < kernels.MIN_COLUMNS_AVX2 or any(
            not t.is_contiguous() and t.numel() > kernels.MAX_COPIED for t in (a, b)), (a.shape, b.shape)
    assert_close(res[0, 0], hessian(mlp)(x), "Hessian")
    assert_close(res[0, 0, 0], jacfwd(jacfwd(jacrev(mlp)))(x), "third order")
    # the cost model counts its FLOPs as a matrix product's (it chooses between directions)
    products = [n for n in cf._last.program.gm.graph.nodes if n.target is torch.ops.hoad.mm.default]
    for n in products:
        (m, k), (_k, cols) = (a.meta["val"].shape for a in n.args)
        assert node_cost(n)[0] == 2 * m * k * cols


@pytest.mark.skipif(not kernels.avx2_available() or kernels.available(),
                    reason="the AVX2 kernel's choice (the AVX-512 one copies transposed operands)")
def test_products_the_kernel_takes_transposed():
    """a @ eᵀ with e a [256,64] activation: the kernel would copy eᵀ dense first, so the product runs
    as (e @ aᵀ)ᵀ, its result column-major; a view of that result which no longer is one becomes a
    reshape, and the lowered program computes what the traced one did. A large result stays MKL's
    (its consumers would read it across rows)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hoad.lowering.inductor import TRANSPOSED_RESULT, InductorLowering
    from hoad.passes.lower import lower_products

    def f(a, e):
        p = a @ e.t()
        return p.view(-1) * 2, p + 1

    a, e = rand(16, 64, seed=1), rand(256, 64, seed=2)
    gm = lower_products(make_fx(f, tracing_mode="fake")(a, e), InductorLowering(avx2=True))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.hoad.mm.default in targets and torch.ops.aten.mm.default not in targets, gm.graph
    assert torch.ops.aten.reshape.default in targets, gm.graph
    (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.hoad.mm.default]
    assert [tuple(x.meta["val"].shape) for x in mm.args] == [(256, 64), (64, 16)]
    for got, want in zip(gm(a, e), f(a, e)):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    big = rand(TRANSPOSED_RESULT // 16 + 64, 64, seed=3)
    gm = lower_products(make_fx(f, tracing_mode="fake")(a, big), InductorLowering(avx2=True))
    assert torch.ops.hoad.mm.default not in [n.target for n in gm.graph.nodes]


@pytest.mark.skipif(not kernels.available(), reason="hoad::mm's AVX-512 kernel")
def test_jets_stored_column_major_stay_so_through_a_product():
    """a @ w where a, the larger operand, is stored column-major (jets kept feature by feature, as
    the packed program keeps its lattice directions' jets) runs as (wᵀ @ aᵀ)ᵀ whatever the
    result's size: the result is stored column-major too, like the jets beside it. A row-major a
    of the same size keeps the straight product."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hoad.lowering.inductor import TRANSPOSED_RESULT, InductorLowering
    from hoad.passes.lower import lower_products

    def f(x, w):
        return torch.tanh(x).t() @ w  # (S, 64) @ (64, 64), the jets (64, S) row-major

    def g(x, w):
        return torch.tanh(x) @ w

    x, w = rand(64, 792, seed=4), rand(64, 64, seed=5)
    assert 792 * 64 > TRANSPOSED_RESULT
    for fn, arg, transposed in ((f, x, True), (g, x.t().contiguous(), False)):
        gm = lower_products(make_fx(fn, tracing_mode="fake")(arg, w), InductorLowering(kernels=True))
        (mm,) = [n for n in gm.graph.nodes if n.target is torch.ops.hoad.mm.default]
        shapes = [tuple(a.meta["val"].shape) for a in mm.args]
        assert shapes == ([(64, 64), (64, 792)] if transposed else [(792, 64), (64, 64)]), (fn.__name__, shapes)
        out = gm(arg, w)
        assert out.t().is_contiguous() == transposed
        torch.testing.assert_close(out, fn(arg, w), rtol=1e-13, atol=1e-13)


@pytest.mark.skipif(not kernels.avx2_available() or kernels.available(), reason="the AVX2 kernel's choice")
def test_wide_products_stay_mkl_on_avx2():
    """MKL runs large products with many columns faster than the AVX2 kernel (B read in strips a
    row apart); small ones and ones of up to 256 columns stay the kernel's."""
    assert not kernels.suits_avx2(rand(64, 64), rand(64, 4096))
    assert not kernels.suits_avx2(rand(256, 64), rand(64, 512))
    assert kernels.suits_avx2(rand(16, 64), rand(64, 1024))
    assert kernels.suits_avx2(rand(256, 128), rand(128, 256))
    assert kernels.suits_avx2(rand(4096, 64), rand(64, 64))


def test_eager_layout_programs_keep_aten_mm():
    cf = hoad.compile(mlp, order=3, mode="reverse")
    cf(rand(16, seed=8))
    assert "hoad.mm(" not in str(cf.graph)


def test_off_switch(monkeypatch):
    monkeypatch.setattr(kernels, "_state", None)
    monkeypatch.setenv("HOAD_DGEMM", "0")
    assert not kernels.available() and not kernels.avx2_available()


@programs_use_mm
def test_compiled_program_with_it_matches_torch_func():
    """One Inductor compile (seconds): hoad::mm as an extern call inside the compiled program."""
    x = rand(16, seed=9)
    cf = hoad.compile(mlp, order=3, mode="reverse", backend="inductor")
    res = cf(x)
    assert "hoad.mm(" in str(cf.graph)
    assert_close(res[0, 0], hessian(mlp)(x), "Hessian")
    assert_close(res[0, 0, 0], jacfwd(jacfwd(jacrev(mlp)))(x), "third order")


@needs_kernel
def test_compiled_per_sample_program_with_gram_matches_torch_func():
    """One Inductor compile: hoad::gram's declared output (shape, dense strides) is what it returns."""
    X = rand(40, 16, seed=15)
    cf = hoad.compile(sample_mlp, order=2, batch_dim=0, backend="inductor")
    res = cf(X)
    assert "hoad.gram(" in str(cf.graph)
    assert_close(res[0, 0], vmap(hessian(sample_mlp))(X), "per-sample Hessian")


def test_unwritable_cache_means_aten_mm(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise PermissionError("read-only cache directory")

    monkeypatch.setattr(kernels, "_state", None)
    monkeypatch.setenv("HOAD_CACHE_DIR", str(tmp_path / "never-built"))
    monkeypatch.setattr(kernels.os, "makedirs", refuse)
    assert not kernels.available() and not kernels.avx2_available()


def gram_reference(J, w):
    return torch.einsum("bki,bk,bkj->bij", J, w, J)


def gram_layouts(B, K, N, seed):
    """J [B,K,N] stored four ways: dense, contracted axis innermost, sample axis between the others
    (one wide GEMM's result), and strided with gaps."""
    yield "dense", rand(B, K, N, seed=seed)
    yield "k innermost", rand(B, N, K, seed=seed).transpose(1, 2)
    yield "wide", rand(K, B, N, seed=seed).permute(1, 0, 2)
    yield "gaps", rand(B, 2 * K, N + 3, seed=seed)[:, ::2, 1:N + 1]


@needs_kernel
@pytest.mark.parametrize("N", [1, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("B,K", [(1, 1), (3, 2), (5, 64)])
def test_gram_equals_einsum_on_every_layout(B, K, N):
    w = rand(B, K, seed=N)
    for name, J in gram_layouts(B, K, N, seed=B * 100 + K):
        G = torch.ops.hoad.gram(J, w)
        torch.testing.assert_close(G, gram_reference(J, w), rtol=1e-12, atol=1e-12, msg=name)
        assert torch.equal(G, G.transpose(1, 2)), f"{name}: not exactly symmetric"
        assert G.is_contiguous()


@needs_mm
def test_mm_gradients():
    """Its autograd formula (C++, aten ops: differentiable again)."""
    a, b = rand(5, 4, seed=1).requires_grad_(True), rand(4, 33, seed=2).requires_grad_(True)
    torch.autograd.gradcheck(torch.ops.hoad.mm, [a, b])
    torch.autograd.gradgradcheck(torch.ops.hoad.mm, [a, b])


@needs_kernel
def test_mm_backward_runs_its_products_in_the_kernel():
    """Where the backward's products are shapes the AVX-512 kernel takes, they run as hoad::mm
    (MKL runs AVX2 code on AMD's CPUs, 3x slower at a PINN's sizes), first and second order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    a, b = rand(40, 32, seed=1).requires_grad_(True), rand(32, 32, seed=2).requires_grad_(True)
    g = rand(40, 32, seed=3)
    c = torch.ops.hoad.mm(a, b)
    with Ops() as ops:
        da, db = torch.autograd.grad(c, (a, b), g, create_graph=True)
    assert ops.seen.count("hoad.mm") == 2 and "aten.mm" not in ops.seen, ops.seen
    torch.testing.assert_close(da, g @ b.T, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(db, a.T @ g, rtol=1e-13, atol=1e-13)
    torch.autograd.gradcheck(torch.ops.hoad.mm, [a, b])
    torch.autograd.gradgradcheck(torch.ops.hoad.mm, [a, b])


@needs_kernel
def test_gram_gradients():
    J, w = rand(3, 4, 9, seed=3).requires_grad_(True), rand(3, 4, seed=4).requires_grad_(True)
    torch.autograd.gradcheck(torch.ops.hoad.gram, [J, w])
    torch.autograd.gradgradcheck(torch.ops.hoad.gram, [J, w])


@needs_kernel
def test_gram_broadcast_weights_other_dtypes_and_bad_shapes():
    J = rand(4, 6, 16, seed=1)
    w = rand(1, 6, seed=2).expand(4, 6)  # stride 0 over samples
    torch.testing.assert_close(torch.ops.hoad.gram(J, w), gram_reference(J, w), rtol=1e-12, atol=1e-12)
    big, weights = rand(70, 24, 16, seed=6), rand(70, 24, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # samples split between threads
        torch.testing.assert_close(torch.ops.hoad.gram(big, weights), gram_reference(big, weights),
                                   rtol=1e-12, atol=1e-12)
    finally:
        torch.set_num_threads(threads)
    J32, w32 = J.float(), w.float()
    torch.testing.assert_close(torch.ops.hoad.gram(J32, w32), gram_reference(J32, w32))  # not float64: bmm
    assert torch.ops.hoad.gram(rand(3, 0, 9, seed=3), rand(3, 0, seed=4)).abs().sum() == 0  # no terms: zeros
    with pytest.raises(RuntimeError, match="J \\[B,K,N\\] and w \\[B,K\\] expected"):
        torch.ops.hoad.gram(J, rand(4, 5, seed=5))


V1, V2, V3 = rand(16, 32, seed=11) / 4, rand(32, 32, seed=12) / 6, rand(32, 1, seed=13) / 6


def sample_mlp(x):  # one sample R^16 -> R; the per-sample products are 16x16 over 32 hidden units
    return (torch.tanh(torch.tanh(x @ V1) @ V2) @ V3).squeeze(-1)


@needs_kernel
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_per_sample_programs_use_gram_and_stay_exact(mode):
    """The per-sample program laid out for Inductor, run eagerly: the second-order terms of both
    tanh layers are hoad::gram calls, the layer products (primal ones too) hoad::mm."""
    X = rand(40, 16, seed=14)
    cf = compiled(sample_mlp, order=3, batch_dim=0, mode=mode, target=inductor_layout())
    res = cf(X)
    assert_close(res[0, 0], vmap(hessian(sample_mlp))(X), "per-sample Hessian")
    assert_close(res[0, 0, 0], vmap(jacfwd(hessian(sample_mlp)))(X), "per-sample third order")
    nodes = cf._last.program.gm.graph.nodes
    grams = [n for n in nodes if n.target is torch.ops.hoad.gram.default]
    assert grams, "no hoad::gram in the per-sample program"
    for n in grams:
        B, K, N = n.args[0].meta["val"].shape
        assert node_cost(n)[0] == 2 * B * K * N * N
    products = [n for n in nodes if n.target is torch.ops.hoad.mm.default]
    if kernels.mm_used():
        assert any(n.args[0].op == "placeholder" for n in products), "the primal x @ V1 is not hoad::mm"
    else:
        assert not products


@needs_kernel
def test_gram_only_for_per_sample_jacobians():
    """The pattern: the same per-sample J twice and weights over its batch and contracted labels."""
    J, w, size = rand(5, 12, 16, seed=1), rand(5, 12, seed=2), {"b": 5, "k": 12, "i": 16, "j": 16}
    G = gram([(w, ["b", "k"]), (J, ["b", "k", "i"]), (J, ["b", "k", "j"])], ["b", "i", "j"], size)
    torch.testing.assert_close(G, gram_reference(J, w), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gram([(J, ["b", "k", "i"]), (J, ["b", "k", "j"])], ["b", "j", "i"], size),
                               gram_reference(J, torch.ones(5, 12, dtype=J.dtype)), rtol=1e-12, atol=1e-12)
    other = J.clone()
    assert gram([(J, ["b", "k", "i"]), (other, ["b", "k", "j"])], ["b", "i", "j"], size) is None
    shared = rand(1, 12, 16, seed=3)  # the same for every sample: a matrix product does better
    assert gram([(w, ["b", "k"]), (shared, ["b", "k", "i"]), (shared, ["b", "k", "j"])], ["b", "i", "j"],
                size) is None
    free_weight = rand(5, 16, seed=4)  # a weight over a free label is not a Gram weight
    assert gram([(free_weight, ["b", "i"]), (J, ["b", "k", "i"]), (J, ["b", "k", "j"])], ["b", "i", "j"],
                size) is None
    unlabelled = rand(5, 12, 1, 16, seed=6)  # a size-1 axis without a label (None) is not the pattern
    assert gram([(unlabelled, ["b", "k", None, "i"]), (unlabelled, ["b", "k", None, "j"])], ["b", "i", "j"],
                size) is None
    small = rand(5, 12, 4, seed=5)  # 4x4 Gram matrices: the fused reduction does better
    assert gram([(small, ["b", "k", "i"]), (small, ["b", "k", "j"])], ["b", "i", "j"],
                {**size, "i": 4, "j": 4}) is None


@pytest.mark.slow
def test_the_library_builds_from_its_source(tmp_path):
    """kernels.cpp compiles and loads through torch.utils.cpp_extension on any x86-64 Linux with a
    compiler (running hoad::mm needs AVX-512, the jet ops AVX2; loading needs neither). In a fresh
    process: this one may have loaded the library already, and a namespace loads once."""
    import os
    import platform
    import shutil
    import subprocess
    import sys

    if platform.machine() != "x86_64" or shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("needs x86-64, a C++ compiler and ninja")
    check = ("import torch; from hoad.lowering import kernels; assert kernels.build(); "
             "assert all(hasattr(torch.ops.hoad, op) for op in ('mm', 'gram', 'jet_sqnorm', 'jet_mm', 'jets_grad'))")
    done = subprocess.run([sys.executable, "-c", check], env={**os.environ, "HOAD_CACHE_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(p.suffix == ".so" for p in tmp_path.rglob("*"))


# ------------------------------------------------------------------------------- hoad::jet_sqnorm
def jets_reference(J, c, W):
    """X[p,s] = (J[p,s] ⊙ c[p]) @ W, J shared by every point when it is 2-D."""
    return torch.einsum("sk,pk,km->psm" if J.dim() == 2 else "psk,pk,km->psm", J, c, W)


def jet_sqnorm_reference(J, c, W, u=None):
    """q[p,m] = Σ_s u[s,m] X[p,s,m]²."""
    X = jets_reference(J, c, W)
    return (X * X if u is None else X * X * u).sum(1)


@needs_jets
@pytest.mark.parametrize("P,S,K,M", [(256, 16, 64, 64), (7, 5, 13, 11), (9, 1, 3, 20), (5, 7, 64, 3), (3, 6, 1, 8),
                                     (2, 25, 130, 17)])
@pytest.mark.parametrize("shared", [True, False])
def test_jet_sqnorm_equals_its_definition(P, S, K, M, shared):
    """Rows past the last six-row panel, columns past the last strip of 8, a J per point or shared."""
    J = rand(S, K, seed=P + K) if shared else rand(P, S, K, seed=P + K)
    c, W = rand(P, K, seed=S), rand(K, M, seed=M)
    for u in (None, rand(S, M, seed=3), rand(S, 1, seed=4), torch.tensor(0.5, dtype=torch.float64)):
        args = (J, c, W) if u is None else (J, c, W, u)
        torch.testing.assert_close(torch.ops.hoad.jet_sqnorm(*args), jet_sqnorm_reference(*args),
                                   rtol=1e-12, atol=1e-12)


@needs_jets
def test_jet_sqnorm_strided_operands_empty_sizes_and_other_dtypes():
    J, c, W = rand(64, 16, seed=1).t(), rand(256, 128, seed=2)[:, ::2], rand(64, 64, seed=3).t()
    torch.testing.assert_close(torch.ops.hoad.jet_sqnorm(J, c, W), jet_sqnorm_reference(J, c, W),
                               rtol=1e-12, atol=1e-12)
    for P, K in ((0, 4), (3, 0)):
        J, c, W = rand(2, K, seed=5), rand(P, K, seed=6), rand(K, 4, seed=7)
        torch.testing.assert_close(torch.ops.hoad.jet_sqnorm(J, c, W), torch.zeros(P, 4, dtype=torch.float64))
    J, c, W = (t.float() for t in (rand(3, 5, seed=8), rand(4, 5, seed=9), rand(5, 6, seed=10)))
    torch.testing.assert_close(torch.ops.hoad.jet_sqnorm(J, c, W), jet_sqnorm_reference(J, c, W))
    with pytest.raises(RuntimeError, match="jet_sqnorm"):
        torch.ops.hoad.jet_sqnorm(rand(3, 5, seed=1), rand(4, 6, seed=2), rand(5, 6, seed=3))


@needs_jets
@pytest.mark.parametrize("shared", [True, False])
def test_jet_sqnorm_gradients(shared):
    """Its autograd formula (aten ops, so differentiable again): first and second derivatives."""
    J = rand(3, 5, seed=1) if shared else rand(4, 3, 5, seed=1)
    inputs = [t.requires_grad_(True) for t in (J, rand(4, 5, seed=2), rand(5, 6, seed=3), rand(3, 6, seed=4))]
    torch.autograd.gradcheck(torch.ops.hoad.jet_sqnorm, inputs)
    torch.autograd.gradgradcheck(torch.ops.hoad.jet_sqnorm, inputs)
    torch.autograd.gradcheck(torch.ops.hoad.jet_sqnorm, inputs[:3])
    torch.autograd.gradcheck(torch.ops.hoad.jet_sqnorm, inputs[:3] + [rand(3, 1, seed=5).requires_grad_(True)])


@needs_jets
def test_autograd_formulas_are_cpp_and_record_only_what_needs_a_gradient():
    """The formulas are registered in C++ (a Python autograd kernel is entered on every call,
    ~7 us each, in compiled programs too); a call no input of which needs a gradient, or under
    no_grad, records no node."""
    for op in ("mm", "gram", "jet_sqnorm", "jet_mm"):  # (jets_grad is their backward: none of its own)
        autograd = [line for line in torch._C._dispatch_dump(f"hoad::{op}").splitlines() if line.startswith("Autograd")]
        assert autograd and "kernels.cpp" in autograd[0], autograd
    J, c, W = rand(3, 5, seed=1), rand(4, 5, seed=2), rand(5, 6, seed=3)
    assert torch.ops.hoad.jet_sqnorm(J, c, W).grad_fn is None
    assert all(t.grad_fn is None for t in torch.ops.hoad.jet_mm(J, c, W))
    W.requires_grad_(True)
    assert torch.ops.hoad.jet_sqnorm(J, c, W).grad_fn is not None
    assert all(t.grad_fn is not None for t in torch.ops.hoad.jet_mm(J, c, W))
    with torch.no_grad():
        assert torch.ops.hoad.jet_sqnorm(J, c, W).grad_fn is None
    # each operator reaches its own kernel below autograd (here the fake ones: no AVX-512 needed)
    from torch._subclasses.fake_tensor import FakeTensorMode

    for grad in (False, True):
        with FakeTensorMode():
            a, b = torch.empty(5, 4, dtype=torch.float64), torch.empty(4, 33, dtype=torch.float64)
            Jb, w = torch.empty(3, 4, 9, dtype=torch.float64), torch.empty(3, 4, dtype=torch.float64)
            if grad:
                a.requires_grad_(True), Jb.requires_grad_(True)
            for _ in range(2):
                assert torch.ops.hoad.mm(a, b).shape == (5, 33)
                assert torch.ops.hoad.gram(Jb, w).shape == (3, 9, 9)
                Jf, cf, Wf = (torch.empty(*t.shape, dtype=torch.float64) for t in (J, c, W))
                assert torch.ops.hoad.jet_sqnorm(Jf, cf, Wf).shape == (4, 6)
                assert [t.shape for t in torch.ops.hoad.jet_mm(Jf, cf, Wf)] == [(4, 3, 6), (4, 6)]


def tanh_net(sizes: tuple[int, ...], seed: int, trainable: bool = False):
    """A tanh MLP u: (..., sizes[0]) -> (...), and its weights (requiring grad if ``trainable``)."""
    Ws = [(rand(a, b, seed=seed + i) / a ** 0.5).requires_grad_(trainable)
          for i, (a, b) in enumerate(zip(sizes, sizes[1:]))]
    bs = [rand(b, seed=seed + 50 + i) / 10 for i, b in enumerate(sizes[1:])]

    def u(x):
        for W, b in zip(Ws[:-1], bs[:-1]):
            x = torch.tanh(x @ W + b)
        return (x @ Ws[-1] + bs[-1]).squeeze(-1)

    return u, Ws


def assert_laplacian_loss_gradients(got, u, Ws, X) -> None:
    """``got``, the gradients of Σ (Δu)² over the points X with respect to Ws, against nested Hessians."""
    H = vmap(hessian(u))(X)
    ref = torch.autograd.grad((H.diagonal(dim1=1, dim2=2).sum(-1) ** 2).sum(), Ws)
    for g, r in zip(got, ref):
        assert_close(g, r, "dL/dW")


@pytest.fixture
def inductor_layout_run_eagerly(monkeypatch):
    """Operators built for Inductor (its layouts, hoad's kernels) but run eagerly: no compile."""
    from hoad import pipeline
    from hoad.lowering.inductor import this_machine

    monkeypatch.setattr(pipeline, "EAGER", this_machine())  # (tests using it need the jet kernels)


def operator_case(kind: str, D: int):
    """(keyword arguments of hoad.laplacian, the contraction of per-point Hessians H [P,D,D])."""
    if kind == "weighted":
        B = rand(D, D, seed=40)
        C = B + B.T  # indefinite
        return {"weights": C}, lambda H: (H * C).sum((1, 2))
    if kind == "stochastic":
        V = rand(3, D, seed=41)
        return {"directions": V}, lambda H: torch.einsum("sd,pde,se->p", V, H, V) / 3
    return {}, lambda H: H.diagonal(dim1=1, dim2=2).sum(-1)


@needs_jets
@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("kind", ["plain", "weighted", "stochastic"])
@pytest.mark.parametrize("sizes", [(3, 8, 7, 1), (4, 6, 5, 7, 1)])
def test_laplacians_square_their_jets_in_the_kernel(sizes, kind, mode, inductor_layout_run_eagerly):
    """Each hidden layer's squared jets are one kernel call: hoad::jet_sqnorm where nothing else
    reads the jets (the last hidden layer of the adjoint program), hoad::jet_mm where they are
    carried on (to the next layer, or to the output in the forward program); the first layer's
    jets are shared by every point, later ones per point."""
    u, _ = tanh_net(sizes, seed=10 * len(sizes))
    X = rand(9, sizes[0], seed=1)
    kwargs, contract = operator_case(kind, sizes[0])
    op = hoad.laplacian(u, batch_dim=0, backend="eager", mode=mode, **kwargs)
    res = op(X)
    program = str(op.graph)
    calls = program.count("hoad.jet_sqnorm(") + program.count("hoad.jet_mm(")
    # every hidden layer after the first; weighted ones whose squares meet a per-point factor
    # before the weights (the forward program's) keep their contraction
    assert calls == len(sizes) - 3 if kind == "plain" else calls >= 1, program
    assert ("hoad.jet_sqnorm(" in program) == (mode == "reverse")
    assert_close(res.laplacian, contract(vmap(hessian(u))(X)), f"{kind} laplacian")
    # the cost model (which direction a program runs in) counts them as the products they are
    for n in op.compiled._last.program.gm.graph.nodes:
        if n.target in (torch.ops.hoad.jet_sqnorm.default, torch.ops.hoad.jet_mm.default):
            j, c, w = (a.meta["val"] for a in n.args[:3])
            assert node_cost(n)[0] == 2 * c.shape[0] * j.shape[-2] * w.shape[0] * w.shape[1]
    assert_close(res.value, u(X), "value")


@needs_jets
@pytest.mark.inductor
# (12 units under -m slow: 13-15 s each of the default suite's 10 minutes; 20 units, the jet kernel,
# stays; the 12-unit forward case is the Gram route)
@pytest.mark.parametrize("mode, width", [pytest.param("forward", 12, marks=pytest.mark.slow),
                                         pytest.param("reverse", 12, marks=pytest.mark.slow), ("forward", 20)])
def test_biharmonics_square_their_direction_pairs_without_storing_them(mode, width):
    """The biharmonic (an Inductor Laplacian of an eager Laplacian program): its fourth-order term
    squares jets that carry a pair of directions, the outer ones through the first layer's shared
    jets and the inner ones per point. With 12 first-layer units (K (T + M) = 180 < T S M = 250)
    the squares' sum comes from the factors' Gram matrices; with 20 (300 > 250) each pair (point,
    inner direction) is a point of the jet kernel. The jets' other reader contracts them over the
    outer directions: two small products, so the jets are never stored. Exact against nested
    Hessians, and so are the gradients of a loss on it (training through the fused program)."""
    u, Ws = tanh_net((5, width, 10, 1), seed=21)
    X = rand(6, 5, seed=2)
    op = hoad.biharmonic(u, batch_dim=0, backend="inductor", mode=mode)
    res = op(X)
    program = str(op.outer.compiled.graph)
    assert "hoad.jet_mm(" not in program
    assert ("hoad.jet_sqnorm(" in program) == (width == 20)
    lap = lambda f: lambda x: hessian(f)(x).diagonal().sum()  # noqa: E731
    assert_close(res.biharmonic, vmap(lap(lap(u)))(X), "biharmonic")
    # another number of points: the program built dynamic in it, fused again (at 20 units, where the
    # kernel is chosen; at 12 a second cold compile for no other kernel)
    if mode == "forward" and width == 20:
        X2 = rand(11, 5, seed=4)
        assert_close(op(X2).biharmonic, vmap(lap(lap(u)))(X2), "biharmonic, 11 points")
        assert "hoad.jet_sqnorm(" in str(op.outer.compiled.graph)
    if mode == "reverse":  # training through it: AOTAutograd's backward of the fused program
        for W in Ws:
            W.requires_grad_(True)
        got = torch.autograd.grad((op(X).biharmonic ** 2).sum(), Ws)
        ref = torch.autograd.grad((vmap(lap(lap(u)))(X) ** 2).sum(), Ws)
        for g, r in zip(got, ref):
            assert_close(g, r, "dL/dW")


@needs_jets
@pytest.mark.parametrize("reader", ["contraction", "other", "both"])
@pytest.mark.parametrize("inner", [1, 2])
@pytest.mark.parametrize("tall", [False, True])
@pytest.mark.parametrize("K", [6, 40])
def test_pair_squares_fuse_for_any_jets(reader, inner, tall, K):
    """The pass on a program of that form with jets that are not symmetric in their pair of
    directions (S1 != S2, random factors; a biharmonic's are, which hides a transposed pair): the
    shared factor over either pair axis, the product either way round. The jets' other readers:
    a contraction over the shared factor's axis (X·F + F·X summed, F constant in the other axis)
    is computed from the factors by two small products, and X is never stored: its squares come
    from the kernel, or, with few units K, from the factors' Gram matrices; any other reader
    (here one weighted along both axes) reads X stored by jet_mm."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hoad.lowering.inductor import this_machine
    from hoad.passes.lower import fuse_jet_squares

    P, S1, S2, M = 3, 4, 5, 7
    shared, point = ((K, 1, S1, 1), (K, P, 1, S2)) if inner == 2 else ((K, 1, 1, S2), (K, P, S1, 1))
    s_axis = 2 if inner == 2 else 3  # the shared factor's axis of X [P, M, S1, S2]
    F_shape = (P, M, S1, 1) if inner == 2 else (P, M, 1, S2)

    def f(W, Jt, ct, F, B):
        y = Jt.permute(1, 0, 2, 3) * ct.permute(1, 0, 2, 3)  # [P,K,S1,S2], stored K-major
        if tall:
            flat = y.permute(0, 2, 3, 1).reshape(P * S1 * S2, K)
            X = (flat @ W).view(P, S1, S2, M).permute(0, 3, 1, 2)
        else:
            X = (W.t() @ y.permute(1, 0, 2, 3).view(K, P * S1 * S2)).view(M, P, S1, S2).permute(1, 0, 2, 3)
        outs = [(X * X).sum([2, 3])]
        if reader in ("contraction", "both"):
            outs.append((X * F + F * X).sum(s_axis, keepdim=True))
        if reader in ("other", "both"):
            outs.append((X * B).sum(1))
        return outs

    args = (rand(K, M, seed=1), rand(*shared, seed=2), rand(*point, seed=3), rand(*F_shape, seed=4),
            rand(P, M, S1, S2, seed=5))
    gm = make_fx(f, tracing_mode="fake")(*args)
    gm = fuse_jet_squares(gm, this_machine())
    kernels = [n.target for n in gm.graph.nodes if "hoad" in str(n.target)]
    if reader != "contraction":
        assert kernels == [torch.ops.hoad.jet_mm.default]
    elif K == 40:  # K (T + M) > T S M: the jets' products are fewer
        assert kernels == [torch.ops.hoad.jet_sqnorm.default]
    else:
        assert kernels == [] and torch.ops.aten.bmm.default in [n.target for n in gm.graph.nodes]
    for got, want in zip(gm(*args), f(*args)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@needs_jets
def test_training_through_the_kernel(inductor_layout_run_eagerly):
    """A PINN-style loss on the Laplacian, differentiated through hoad::jet_sqnorm's formula."""
    u, Ws = tanh_net((3, 8, 7, 1), seed=60, trainable=True)
    X = rand(6, 3, seed=2)
    op = hoad.laplacian(u, batch_dim=0, backend="eager")
    loss = (op(X).laplacian ** 2).sum()
    assert "hoad.jet_sqnorm(" in str(op.graph)
    assert_laplacian_loss_gradients(torch.autograd.grad(loss, Ws), u, Ws, X)


@needs_jets
def test_compiled_laplacian_with_the_kernel_matches_torch_func():
    """Inductor compiles: hoad::jet_sqnorm as an extern call of the compiled program, at one number
    of points and then at any (the second count builds the program dynamic in it)."""
    u, _ = tanh_net((3, 8, 7, 1), seed=70)
    op = hoad.laplacian(u, batch_dim=0, backend="inductor")
    for n in (9, 5, 40):
        X = rand(n, 3, seed=n)
        res = op(X)
        assert "hoad.jet_sqnorm(" in str(op.graph)
        assert_close(res.laplacian, vmap(hessian(u))(X).diagonal(dim1=1, dim2=2).sum(-1), f"laplacian, {n} points")


@needs_jets
@pytest.mark.parametrize("P,S,K,M", [(7, 5, 13, 11), (9, 1, 3, 20), (4, 16, 64, 64), (2, 25, 130, 17),
                                     (64, 50, 20, 200), (64, 50, 20, 203)])
@pytest.mark.parametrize("shared", [True, False])
def test_jet_mm_stores_the_jets_it_squares(P, S, K, M, shared):
    """hoad::jet_mm: the jets X [P,S,M] (last strip's columns stored masked; past the caches when
    X is over 4 MB) and jet_sqnorm's q."""
    J = rand(S, K, seed=P + K) if shared else rand(P, S, K, seed=P + K)
    c, W, u = rand(P, K, seed=S), rand(K, M, seed=M), rand(S, M, seed=3)
    X, q = torch.ops.hoad.jet_mm(J, c, W, u)
    torch.testing.assert_close(X, jets_reference(J, c, W), rtol=1e-12, atol=1e-12)
    assert X.is_contiguous()
    torch.testing.assert_close(q, jet_sqnorm_reference(J, c, W, u), rtol=1e-12, atol=1e-12)


@needs_jets
def test_jet_mm_gradients():
    inputs = [t.requires_grad_(True) for t in (rand(4, 3, 5, seed=1), rand(4, 5, seed=2), rand(5, 6, seed=3),
                                               rand(3, 6, seed=4))]
    both = lambda *a: torch.ops.hoad.jet_mm(*a)  # noqa: E731
    torch.autograd.gradcheck(both, inputs)
    torch.autograd.gradgradcheck(both, inputs)
    torch.autograd.gradcheck(lambda *a: torch.ops.hoad.jet_mm(*a)[0].sin().sum(), inputs[:3])  # X alone
    torch.autograd.gradcheck(lambda *a: torch.ops.hoad.jet_mm(*a)[1], inputs[:3])  # q alone


def jets_grad_reference(J, c, W, u, gX, gq):
    """The gradients (dJ, dc, dW, du) of Σ gX·X + Σ gq·q at X = (J ⊙ c) W, q = Σ_s u X², by autograd
    through the einsum definition (du: [0] without u)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (J, c, W) + (() if u is None else (u,))]
    X = jets_reference(*leaves[:3])
    total = 0
    if gX is not None:
        total = total + (gX * X).sum()
    if gq is not None:
        total = total + (gq * (X * X if u is None else X * X * leaves[3]).sum(1)).sum()
    if not torch.is_tensor(total):
        return [torch.zeros_like(t) for t in leaves] + ([] if u is not None else [torch.zeros(0, dtype=torch.float64)])
    got = torch.autograd.grad(total, leaves, allow_unused=True)
    got = [torch.zeros_like(t) if g is None else g for g, t in zip(got, leaves)]
    return got + ([] if u is not None else [torch.zeros(0, dtype=torch.float64)])


@needs_jets
@pytest.mark.parametrize("P,S,K,M", [(7, 5, 13, 11), (1, 1, 1, 1), (40, 16, 64, 64), (300, 2, 32, 32),
                                     (33, 50, 20, 17)])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_jets_grad_equals_autograd_of_the_definition(P, S, K, M, shared, threads):
    """hoad::jets_grad, the gradients of jet_sqnorm and jet_mm in one call: rows in several chunks
    (40x16 and 300x2 rows: more than 512) split between threads, the stored jets or none, every
    weight shape, gradients of the jets, of their squares, of both or of neither."""
    J = rand(S, K, seed=P + K) if shared else rand(P, S, K, seed=P + K)
    c, W = rand(P, K, seed=S), rand(K, M, seed=M)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for u in (None, rand(S, M, seed=3), rand(M, seed=4), rand(S, 1, seed=5)):
            for gX, gq in ((None, rand(P, M, seed=6)), (rand(P, S, M, seed=7), None),
                           (rand(P, S, M, seed=7), rand(P, M, seed=6)), (None, None)):
                for X in (None, jets_reference(J, c, W)):
                    got = torch.ops.hoad.jets_grad(J, c, W, u, X, gX, gq)
                    for g, r, name in zip(got, jets_grad_reference(J, c, W, u, gX, gq), ("dJ", "dc", "dW", "du")):
                        torch.testing.assert_close(g, r, rtol=1e-11, atol=1e-11, msg=lambda m: f"{name}: {m}")
    finally:
        torch.set_num_threads(before)


@needs_jets
def test_a_training_backward_through_the_jets_on_two_threads():
    """A training step's backward (W a parameter) through hoad::jet_sqnorm and hoad::jet_mm with
    the rows split between threads (600 rows: two chunks). The worker thread ran its chunk's
    products under autograd's defaults and failed ("mm(): functions with out=... arguments don't
    support automatic differentiation"): a PINN's first steps through hoad.laplacian, with the
    default thread count."""
    J, c = rand(300, 2, 32, seed=1), rand(300, 32, seed=2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for shared in (False, True):
            Jp = (J[0] if shared else J).clone().requires_grad_()
            W = rand(32, 32, seed=3).requires_grad_()
            for q in (lambda: torch.ops.hoad.jet_sqnorm(Jp, c, W), lambda: torch.ops.hoad.jet_mm(Jp, c, W)[1]):
                W.grad = Jp.grad = None
                q().sum().backward()
                want = torch.autograd.grad(jets_reference(Jp, c, W).pow(2).sum(1).sum(), (W, Jp))
                assert_close(W.grad, want[0], "dW")
                assert_close(Jp.grad, want[1], "dJ")
    finally:
        torch.set_num_threads(before)


@needs_jets
def test_jets_grad_strided_broadcast_empty_and_float32_operands():
    """Operands in any layout (transposed, sliced, an expanded gradient), empty sizes (the aten
    formula, whose reshape once failed on an empty K or M), float32 (the aten formula) and a
    0-d weight."""

    def check(J, c, W, u, X, gX, gq, tol=1e-11):
        got = torch.ops.hoad.jets_grad(J, c, W, u, X, gX, gq)
        double = [None if t is None else t.double() for t in (J, c, W, u, gX, gq)]
        for g, r in zip(got, jets_grad_reference(*double)):
            assert g.shape == r.shape
            torch.testing.assert_close(g.double(), r, rtol=tol, atol=tol)

    for P, S, K, M in [(0, 3, 4, 5), (3, 0, 4, 5), (3, 2, 0, 5), (3, 2, 4, 0)]:
        for J in (rand(S, K, seed=1), rand(P, S, K, seed=1)):
            check(J, rand(P, K, seed=2), rand(K, M, seed=3), rand(S, M, seed=4), None, rand(P, S, M, seed=5),
                  rand(P, M, seed=6))
    P, S, K, M = 37, 5, 20, 24
    J, c, W = rand(K, S, seed=1).t(), rand(P, 2 * K, seed=2)[:, ::2], rand(M, K, seed=3).t()
    u, gX, gq = rand(M, S, seed=4).t(), rand(P, M, S, seed=5).transpose(1, 2), rand(M, P, seed=6).t()
    check(J, c, W, u, jets_reference(J, c, W).transpose(1, 2).contiguous().transpose(1, 2), gX, gq)
    check(J, c, W, u, None, rand(1, 1, M, seed=7).expand(P, S, M), gq)
    check(rand(P, K, S, seed=8).transpose(1, 2), c, W, u, None, gX, gq)
    check(J, c, W, torch.tensor(0.7, dtype=torch.float64), None, gX, gq)
    check(*(t.float() for t in (J, c, W, u)), None, gX.float(), gq.float(), tol=1e-3)


@needs_jets
def test_a_compiled_training_step_backs_through_jets_grad():
    """Training under Inductor: AOTAutograd traces the jet kernels' backward as hoad::jets_grad (one
    call per layer), not the aten formula; the gradients match torch.func's."""
    u, Ws = tanh_net((3, 8, 7, 1), seed=90, trainable=True)
    X = rand(11, 3, seed=3)
    op = hoad.laplacian(u, batch_dim=0, backend="inductor")
    loss = (op(X).laplacian ** 2).sum()
    assert "hoad.jet_sqnorm(" in str(op.graph) or "hoad.jet_mm(" in str(op.graph)
    with torch.profiler.profile() as prof:
        got = torch.autograd.grad(loss, Ws)
    assert any(e.name == "hoad::jets_grad" for e in prof.events())
    assert_laplacian_loss_gradients(got, u, Ws, X)


@needs_jets
def test_jet_kernels_only_for_float64_programs_laid_out_for_inductor(inductor_layout_run_eagerly, monkeypatch):
    u, Ws = tanh_net((3, 8, 7, 1), seed=80)
    X = rand(9, 3, seed=4)
    expected = vmap(hessian(u))(X).diagonal(dim1=1, dim2=2).sum(-1)
    single = [W.float() for W in Ws]

    def u32(x):
        for W in single[:-1]:
            x = torch.tanh(x @ W)
        return (x @ single[-1]).squeeze(-1)

    op = hoad.laplacian(u32, batch_dim=0, backend="eager")
    res = op(X.float())
    assert "hoad.jet_" not in str(op.graph)
    ref32 = vmap(hessian(u32))(X.float()).diagonal(dim1=1, dim2=2).sum(-1)
    torch.testing.assert_close(res.laplacian, ref32, rtol=1e-4, atol=1e-4)
    from hoad import pipeline
    from hoad.algebra.target import EAGER

    monkeypatch.setattr(pipeline, "EAGER", EAGER)  # the eager layout again
    op = hoad.laplacian(u, batch_dim=0, backend="eager")
    assert_close(op(X).laplacian, expected, "laplacian")
    assert "hoad.jet_" not in str(op.graph)



def test_where_mkl_runs_avx512_products_stay_mkl_and_wide_layers_skip_the_jet_kernels(monkeypatch):
    """On an Intel CPU with AVX-512, MKL's products beat hoad::mm on every shape measured, and its
    product through a layer of more than 256 inputs beats the jet kernels (768: 40.8 vs 61.5 ms)."""
    from hoad.lowering.inductor import InductorLowering

    like = rand(2, 2, seed=1)
    lowering = InductorLowering(kernels=True, avx2=True)
    monkeypatch.setattr(kernels, "_state", True)
    monkeypatch.setattr(kernels, "_avx512", lambda: True)
    monkeypatch.setattr(kernels, "_mkl_avx512", True)
    assert not kernels.fits(like, 256, 64, 64) and not kernels.mm_used()
    assert lowering.jets_suit(256) and not lowering.jets_suit(384)
    monkeypatch.setattr(kernels, "_mkl_avx512", False)  # AMD: MKL takes its AVX2 code
    assert kernels.fits(like, 256, 64, 64) and kernels.mm_used()
    # the torch-jet paper's layers, not a B past the caches nor an inner dimension past 2048
    assert kernels.fits(like, 384, 768, 768) and kernels.fits(like, 4096, 2048, 32)
    assert not kernels.fits(like, 128, 2048, 2048) and not kernels.fits(like, 64, 4096, 32)
    assert lowering.jets_suit(768)
    assert not InductorLowering(kernels=True, avx2=False).jets_suit(64)


@needs_jets
@pytest.mark.slow  # (21 s: the kernels built a second time for AVX2; the default ISA's are tested above)
def test_jet_kernels_avx2_strips_where_avx512_ones_run_by_default():
    """On Intel CPUs with AVX-512 the jet kernels run 16-column strips; HOAD_JETS_AVX2=1 (read once
    per process) keeps the 8-column AVX2 ones, which AMD's CPUs run: those equal the definition
    too, tail strips, streamed jets and shared J included."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch
        from hoad.lowering import kernels
        assert kernels.avx2_available()
        g = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
        for P, S, K, M, shared in ((7, 5, 13, 11, False), (9, 1, 3, 20, True), (64, 50, 20, 203, False)):
            J = r(S, K) if shared else r(P, S, K)
            c, W, u = r(P, K), r(K, M), r(S, M)
            X = torch.einsum("sk,pk,km->psm" if shared else "psk,pk,km->psm", J, c, W)
            q = (X * X * u).sum(1)
            Xk, qk = torch.ops.hoad.jet_mm(J, c, W, u)
            torch.testing.assert_close(Xk, X, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(qk, q, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(torch.ops.hoad.jet_sqnorm(J, c, W), (X * X).sum(1), rtol=1e-12, atol=1e-12)
        print("ok")
    """)
    env = {**os.environ, "HOAD_JETS_AVX2": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's hoad
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
