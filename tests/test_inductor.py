"""The Inductor backend: compiled == eager, caching, recompiles, CUDA.

Compiles cost seconds each, so CI runs a small deliberate set; ``pytest -m slow`` runs every
rule case compiled.
"""

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import rand
from op_cases import CASES

import hoad

W = rand(3, 4, seed=31)


def mixed(x, w):
    """One program touching every rule family: layout, reductions, softmax, mm, elementwise."""
    h = torch.tanh(x @ w) + torch.sigmoid(x[:, :1])
    z = torch.cat([h.exp(), h.sin() * h], 1).flip(0)
    p = torch.softmax(z, dim=1)
    return (p * z).sum(1).log1p() + z.amax(1) + (x.abs() + 0.5).sqrt().prod(1)


def assert_same(a, b):
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(a.value, b.value, rtol=1e-10, atol=1e-10)


def compiles(cf) -> int:
    """Programs built (a count that reuses the program for every count is a second key to it)."""
    return len({id(e) for e in cf._cache.values()})


# Order 3 and forward mode under -m slow: the order-3 program has ~1950 ATen calls and costs
# minutes of Inductor compile on a cold cache; order 2 in reverse (the default choice) covers the
# same rule families in the default suite.
@pytest.mark.parametrize("mode,order", [("reverse", 2), pytest.param("reverse", 3, marks=pytest.mark.slow),
                                        pytest.param("forward", 3, marks=pytest.mark.slow)])
def test_compiled_equals_eager(mode, order):
    args, args2 = (rand(5, 3, seed=1), rand(3, 4, seed=2)), (rand(5, 3, seed=3), rand(3, 4, seed=4))
    eager = hoad.compile(mixed, order=order, wrt=(0, 1), mode=mode, backend="eager")
    cf = hoad.compile(mixed, order=order, wrt=(0, 1), mode=mode, backend="inductor")
    assert_same(cf(*args), eager(*args))
    # a second call with the same signature runs the cached program
    assert_same(cf(*args2), eager(*args2))
    assert compiles(cf) == 1
    assert "inductor" in cf._last.build.stats


def test_per_sample_compiled_and_new_batch_sizes_compile_once_each(caplog):
    def f(X):
        return torch.tanh(X @ W).pow(2).sum(1)

    cf = hoad.compile(f, order=2, batch_dim=0, backend="inductor")
    eager = hoad.compile(f, order=2, batch_dim=0, backend="eager")
    for B in (4, 6, 4, 6):
        X = rand(B, 3, seed=B)
        assert_same(cf(X), eager(X))
    assert compiles(cf) == 2  # 4 samples, then the program for every number of samples
    caplog.clear()  # (a cold compile above logs "still compiling")
    with caplog.at_level(logging.INFO, logger="hoad"):
        X = rand(9, 3)
        assert_same(cf(X), eager(X))
    assert compiles(cf) == 2 and "compiling" not in caplog.text, "a third count must build nothing"


def test_sample_counts_whose_products_lower_differently_share_one_program():
    """A PINN's diagonal Hessian first at 256 points, then at 100: hoad::mm suited the products at
    256 rows and not at 200 ([2·100, 32] @ [32, 32]), so the two programs differed in more than
    sizes and every later count (128, 257, 1024) built its own. The second build now makes the
    first's layout choices, and one program serves every count."""
    torch.manual_seed(46)
    net = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 1)).double()
    f = lambda P: net(P).squeeze(-1)  # noqa: E731
    cf = hoad.compile(f, order=2, batch_dim=0, diagonal=True, backend="inductor")
    eager = hoad.compile(f, order=2, batch_dim=0, diagonal=True, backend="eager")
    with torch.no_grad():
        for n in (256, 100, 128, 257, 1024):
            P = torch.rand(n, 2, dtype=torch.float64)
            got, want = cf(P), eager(P)
            for K in [(0,), (0, 0)]:
                torch.testing.assert_close(got[K], want[K], rtol=1e-12, atol=1e-12, msg=f"{K} at {n} points")
    assert compiles(cf) == 2, "256 points, then one program for every count"
    general = [e for e in cf._cache.values() if e.build.stats.get("any_samples")]
    assert general and len({id(e) for e in cf._cache.values()}) == 2


def test_a_replayed_lowering_makes_the_recorded_choices():
    """Recorded writes down each choice by size; given that record, it makes the same choices for
    other sizes, and asks the lowering afresh where the record names another method."""
    from hoad.algebra.target import Recorded
    from hoad.lowering.inductor import InductorLowering

    lowering = InductorLowering(kernels=False, avx2=False)
    a, b = rand(1, 8), rand(8, 1)  # a tiny vector product: a fused reduction
    first = Recorded(lowering)
    assert first.product(a, b) == "reduction" and first.batched_as_reduction(4, 4, False)
    assert first.made == [("product", "reduction"), ("batched_as_reduction", True)]
    big = rand(512, 512)
    again = Recorded(lowering, tuple(first.made))
    assert again.product(big, big) == "reduction", "the recorded choice, not the one for these sizes"
    assert again.jets_suit(8) == lowering.jets_suit(8), "another method at this place: asked afresh"
    assert again.fused is True and Recorded(lowering).product(big, big) == "mm"


def test_default_backend_is_inductor_outside_the_test_suite():
    import subprocess
    import sys

    code = "import hoad; print(hoad.compile(lambda x: x.sin().sum(), order=1).config.backend)"
    env = {k: v for k, v in __import__("os").environ.items() if k != "HOAD_DEFAULT_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "inductor"


def test_programs_hold_no_efficient_zero_tensors():
    cf = hoad.compile(mixed, order=2, wrt=(0, 1), backend="eager")
    cf(rand(5, 3), W)
    targets = {str(n.target) for n in cf.graph.module.graph.nodes}
    assert not any("efficientzerotensor" in t for t in targets)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_cuda_inputs_run_on_cuda(backend):
    args = (rand(5, 3, seed=1).cuda(), rand(3, 4, seed=2).cuda())
    res = hoad.compile(mixed, order=3, wrt=(0, 1), backend=backend)(*args)
    ref = hoad.compile(mixed, order=3, wrt=(0, 1), backend="eager")(*(a.cpu() for a in args))
    for key in ref:
        assert res[key].device.type == "cuda"
        torch.testing.assert_close(res[key].cpu(), ref[key], rtol=1e-9, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("op", sorted(CASES, key=str), ids=str)
def test_every_rule_compiled(op):
    case = CASES[op]
    order = min(case.order, 3)
    eager = hoad.compile(case.fn, order=order, wrt=case.wrt, backend="eager")(*case.args)
    compiled = hoad.compile(case.fn, order=order, wrt=case.wrt, backend="inductor")(*case.args)
    tol = case.tol or 1e-10
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=tol, atol=tol)


def small(x, w):
    h = torch.tanh(x @ w)
    return (h * h.exp()).sum(1).log1p()


# the default suite trains through a small program (the AOT backward of `mixed` at order 2 costs
# two minutes of cold compile, `small` with a softmax 10 s more than this one); -m slow through
# `mixed` at order 3
@pytest.mark.parametrize("fn,order", [(small, 2), pytest.param(mixed, 3, marks=pytest.mark.slow)],
                         ids=["small-2", "mixed-3"])
def test_backward_through_compiled_derivatives_matches_the_eager_program(fn, order):
    """The compiled program records no autograd graph of its own; a call that needs one gets a
    compiled backward. A loss mixing its derivatives with other terms trains every term."""
    x, w = rand(5, 3, seed=1), rand(3, 4, seed=2).requires_grad_()
    compiled_program = hoad.compile(fn, order=order, wrt=(0, 1), mode="reverse", backend="inductor")
    res = compiled_program(x, w)
    ((w ** 2).sum() + res[0, 1].sum()).backward()
    compiled = w.grad.clone()
    w.grad = None
    eager = hoad.compile(fn, order=order, wrt=(0, 1), mode="reverse", backend="eager")(x, w)
    ((w ** 2).sum() + eager[0, 1].sum()).backward()
    torch.testing.assert_close(compiled, w.grad, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        assert not compiled_program(x, w)[0, 1].requires_grad


def test_float64_tanh_in_compiled_programs_is_within_an_ulp():
    """Inductor's vectorized float64 tanh in hoad's programs is Cephes' formula (its SLEEF call
    takes twice as long): within 1 ulp of tanh, so 2 of torch's; across the switch of formula at
    |x| = 0.625, for tiny, huge and signed-zero inputs; its derivative from it. The override is
    undone after the compile (other torch.compile users keep SLEEF's)."""
    from torch._inductor.codegen.cpp import CppVecOverrides

    stock = CppVecOverrides.__dict__["tanh"]
    x = torch.cat([rand(1000, seed=1) * s for s in (1e-9, 1e-3, 0.3, 1, 4, 40)]
                  + [torch.linspace(0.62, 0.63, 999, dtype=torch.float64),
                     torch.tensor([0.0, -0.0, 0.625, -0.625, 400.0, -400.0, 1e-300, -1e-300], dtype=torch.float64)])
    cf = hoad.compile(torch.tanh, order=1, batch_dim=0, backend="inductor")  # per sample: a scalar
    res = cf(x)
    assert CppVecOverrides.__dict__["tanh"] is stock
    ref = torch.tanh(x)
    eps = torch.finfo(torch.float64).eps
    assert ((res.value - ref).abs() <= 2 * eps * ref.abs()).all()
    assert torch.equal(res.value.signbit(), ref.signbit())
    torch.testing.assert_close(res[0], 1 - ref * ref, rtol=1e-15, atol=1e-15)


def test_no_two_dimensional_tiling_over_a_reduction_nested_below_another_loop():
    """torch 2.13 stores such a kernel's reduction a whole tile wide past the outer loop's tail
    (hoad.lowering.inductor.safe_tiling): where loops lie between the tiled one and the
    reduction, hoad's compiles tile the reduction's loop alone; elsewhere Inductor's choice stands."""
    from torch._inductor.codegen.cpp import TilingSelect

    from hoad.lowering.inductor import _select_tiling

    stock = TilingSelect.__dict__["select_tiling"]
    chosen = {}
    safe = _select_tiling(lambda self, fns, sizes: chosen["tiling"])
    three_loops = [((8, 512), (64,))]  # loops x0, x1 and the reduction x2
    chosen["tiling"] = ([16, 16], [0, 2], "stats")
    assert safe(None, [], three_loops) == ([16], [2], "stats")
    chosen["tiling"] = ([16, 16], [1, 2], "stats")  # the reduction directly inside the tiled loop
    assert safe(None, [], three_loops) == ([16, 16], [1, 2], "stats")
    assert safe(None, [], [((8, 512, 64), ())]) == ([16, 16], [1, 2], "stats")  # no reduction
    chosen["tiling"] = ([16], [0], "stats")
    assert safe(None, [], three_loops) == ([16], [0], "stats")
    assert TilingSelect.__dict__["select_tiling"] is stock  # only while hoad compiles


def test_stochastic_biharmonic_with_half_a_tile_of_directions():
    """The kernel that torch 2.13 mis-tiled: a stochastic biharmonic whose number of directions is
    half Inductor's tile (8 with AVX-512, 4 with AVX2) stored its jets' reduction past the buffer,
    a heap corruption that aborted the process. Compiled equals eager."""
    from torch._inductor import cpu_vec_isa

    S = max(1, cpu_vec_isa.pick_vec_isa().nelements(torch.float) // 2)
    W1, b1, W2, b2, W3 = (rand(*s, seed=40 + i) / 3 for i, s in enumerate(((4, 16), (16,), (16, 16), (16,), (16, 1))))

    def u(x):
        return (torch.tanh(torch.tanh(x @ W1 + b1) @ W2 + b2) @ W3).squeeze(-1)

    X, V = rand(8, 4, seed=46), rand(S, 4, seed=47)
    compiled = hoad.biharmonic(u, batch_dim=0, directions=V, estimator="nested", backend="inductor")(X).biharmonic
    eager = hoad.biharmonic(u, batch_dim=0, directions=V, estimator="nested", backend="eager")(X).biharmonic
    torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_a_scatter_add_along_the_last_dim_on_two_threads(mode):
    """The transpose of a reflect or replicate pad accumulates along the last dim; torch 2.13's
    two-dimensional tile of such a kernel writes at a doubled offset on its multi-threaded path
    (pytorch#191837): a conv after F.pad aborted the process ("double free or corruption")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = rand(4, 2, 3, 3, seed=48)

        def f(x):
            return F.conv2d(F.pad(x, (1, 1, 1, 1), mode=mode), w).sin().sum()

        x = rand(3, 2, 5, 5, seed=49)
        res = hoad.compile(f, order=1, backend="inductor")(x)
        torch.testing.assert_close(res[0], torch.func.grad(f)(x), rtol=1e-10, atol=1e-10)
    finally:
        torch.set_num_threads(threads)


def test_training_through_an_average_pooling_with_ceil_mode():
    """Inductor (torch 2.13) compiled the autograd program of a ceil_mode pooling whose last
    window is partial wrongly: a parameter's gradient through the Hessian was 0.56 off in the last
    entry. Such programs train through the eager program."""
    a = rand(7, seed=50).requires_grad_(True)

    def f(x):
        return F.avg_pool1d(x * a, 2, ceil_mode=True).pow(3).sum()

    x = rand(2, 3, 7, seed=51)
    got, = torch.autograd.grad(hoad.compile(f, order=2, backend="inductor")(x)[0, 0].sum(), a)
    want, = torch.autograd.grad(torch.func.hessian(f)(x).sum(), a)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_training_through_a_circular_pad(backend):
    """Circular padding copies into a fresh buffer, a functional copy torch's autograd has no
    formula for: backward raised "derivative for aten::copy is not implemented" (eager) and the
    autograd compile failed (Inductor)."""
    a = rand(5, seed=52).requires_grad_(True)

    def f(x):
        return F.pad(torch.tanh(x * a), (1, 1), mode="circular").pow(3).sum()

    x = rand(2, 3, 5, seed=53)
    got, = torch.autograd.grad(hoad.compile(f, order=2, backend=backend)(x)[0, 0].sum(), a)
    want, = torch.autograd.grad(torch.func.hessian(f)(x).sum(), a)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_strided_inputs_are_copied_dense():
    """An Inductor program asserts the dense strides it was traced with: a transposed, step-sliced
    or expanded input (or a closed-over transposed weight) was an ExecutionError naming a fake
    kernel, on the first call and on a program built from a dense input."""
    Wt = rand(4, 3, seed=32).T  # (3, 4), strides (1, 3)

    def u(x):
        return torch.tanh(x @ Wt).sin().sum(-1)

    cf = hoad.compile(u, order=2, batch_dim=0, backend="inductor")
    ref = hoad.compile(u, order=2, batch_dim=0, backend="eager")
    base = rand(8, 6, seed=33)
    for X in (base[:, ::2], base.T.contiguous().T[:, :3], rand(3, seed=34).expand(8, 3), base[:, :3].contiguous()):
        assert_same(cf(X), ref(X.contiguous()))
    x = base[:, ::2].clone().requires_grad_()
    cf(x[:, [2, 0, 1]].T.contiguous().T).value.sum().backward()  # through autograd too
    assert x.grad is not None and torch.isfinite(x.grad).all()
    cf(base[:, :3])
    Wt = rand(3, 4, seed=35)  # rebound to a dense weight of the same shape: built again, not misread
    assert_same(cf(base[:, :3]), ref(base[:, :3]))


def test_cpu_programs_are_refused_under_a_torch_whose_codegen_is_unchecked(monkeypatch):
    """torch 2.11's C++ codegen corrupts the heap on some of hoad's CPU programs: a CompileError
    naming the way out, before anything is compiled (the CUDA codegen is not concerned)."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cpu")
    cf = hoad.compile(lambda x: x.sin().sum(), order=2, backend="inductor")
    with pytest.raises(hoad.CompileError, match=r"torch >= 2\.13.*backend='eager'"):
        cf(torch.randn(3, dtype=torch.float64))
    eager = hoad.compile(lambda x: x.sin().sum(), order=2, backend="eager")(torch.zeros(3, dtype=torch.float64))
    assert torch.equal(eager[0, 0], torch.zeros(3, 3, dtype=torch.float64))
