"""hoad::mm, the float64 AVX-512 matrix product Inductor programs use for short inner dimensions:
equal to torch.mm on every tail shape, and used by the programs whose products suit it."""

import pytest
import torch
from torch.func import hessian, jacfwd, jacrev

import hoad
import hoad.pipeline
from hoad import kernels
from hoad.passes.cost import node_cost
from helpers import assert_close, rand

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no AVX-512 or no C++ compiler here")


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17])
@pytest.mark.parametrize("n", [1, 8, 31, 32, 33, 70])
@pytest.mark.parametrize("k", [1, 5, 64, 256])
def test_equals_torch_mm_on_tail_shapes(m, n, k):
    a, b = rand(m, k, seed=m * 1000 + k), rand(k, n, seed=n * 1000 + k)
    torch.testing.assert_close(torch.ops.hoad.mm(a, b), a @ b, rtol=1e-13, atol=1e-13)


@needs_kernel
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


@needs_kernel
def test_inductor_layout_programs_use_it_and_stay_exact(monkeypatch):
    """The program laid out for Inductor, run eagerly: its [16,64]@[64,256] products are hoad::mm."""
    differentiate = hoad.pipeline.differentiate
    monkeypatch.setattr(hoad.pipeline, "differentiate", lambda *a, **k: differentiate(*a, **{**k, "fused": True}))
    x = rand(16, seed=8)
    cf = hoad.compile(mlp, order=3, mode="reverse")
    res = cf(x)
    assert "hoad.mm(" in str(cf.graph)
    assert_close(res[0, 0], hessian(mlp)(x), "Hessian")
    assert_close(res[0, 0, 0], jacfwd(jacfwd(jacrev(mlp)))(x), "third order")
    # the cost model counts its FLOPs as a matrix product's (it chooses between directions)
    products = [n for n in cf._last.program.gm.graph.nodes if n.target is torch.ops.hoad.mm.default]
    for n in products:
        (m, k), (_k, cols) = (a.meta["val"].shape for a in n.args)
        assert node_cost(n)[0] == 2 * m * k * cols


def test_eager_layout_programs_keep_aten_mm():
    cf = hoad.compile(mlp, order=3, mode="reverse")
    cf(rand(16, seed=8))
    assert "hoad.mm(" not in str(cf.graph)


def test_off_switch(monkeypatch):
    monkeypatch.setattr(kernels, "_state", None)
    monkeypatch.setenv("HOAD_DGEMM", "0")
    assert not kernels.available()


@needs_kernel
def test_compiled_program_with_it_matches_torch_func():
    """One Inductor compile (seconds): hoad::mm as an extern call inside the compiled program."""
    x = rand(16, seed=9)
    cf = hoad.compile(mlp, order=3, mode="reverse", backend="inductor")
    res = cf(x)
    assert "hoad.mm(" in str(cf.graph)
    assert_close(res[0, 0], hessian(mlp)(x), "Hessian")
    assert_close(res[0, 0, 0], jacfwd(jacfwd(jacrev(mlp)))(x), "third order")


def test_unwritable_cache_means_aten_mm(monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError("read-only cache directory")

    monkeypatch.setattr(kernels, "_state", None)
    exists = kernels.os.path.exists
    monkeypatch.setattr(kernels.os.path, "exists", lambda path: "hoad_mm-" not in path and exists(path))  # never built
    monkeypatch.setattr(kernels.os, "makedirs", refuse)
    assert not kernels.available()
