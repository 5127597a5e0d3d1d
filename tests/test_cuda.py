"""The same programs on a GPU: every rule case in float64 and float32, a compiled case per rule
family, the operators and a training step, against the CPU float64 program. Skipped without CUDA.

float32 is checked against the float64 reference with a tolerance scaled to the result
(derivative blocks of order 4 amplify rounding; 1e-3 relative is float32's honest reach here).
"""

import op_cases
import pytest
import torch
from op_cases import CASES

import hoad
from hoad.rules import FAMILIES

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float64: 1e-9, torch.float32: 1e-3}
# every module-level tensor of op_cases a case closes over (the pooling cases' input and indices
# too: left on the CPU in float64 they were a device-propagation error and a dtype refusal)
CLOSED_OVER = tuple(name for name, value in vars(op_cases).items()
                    if isinstance(value, torch.Tensor) and name.isupper())


def _moved(t, device: str, dtype: torch.dtype):
    """A floating tensor in the case's dtype on the device; any other (indices) on the device."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.to(device, dtype) if t.dtype.is_floating_point else t.to(device)


@pytest.fixture
def on_cuda(monkeypatch):
    """Run a case's function on CUDA: its closed-over tensors moved there, new tensors made there."""

    def use(dtype):
        for name in CLOSED_OVER:
            monkeypatch.setattr(op_cases, name, _moved(getattr(op_cases, name), "cuda", dtype))
        torch.set_default_device("cuda")
        return lambda t: _moved(t, "cuda", dtype)

    yield use
    torch.set_default_device("cpu")


def _close(got, ref, dtype, what):
    assert got.device.type == "cuda", f"{what}: result on {got.device}"
    got = got.to("cpu", torch.float64)
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(got, ref, rtol=TOL[dtype], atol=TOL[dtype] * scale, equal_nan=True, msg=what)


def _cpu_reference(case, order):
    return hoad.compile(case.fn, order=order, wrt=case.wrt, backend="eager")(*case.args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("op", sorted(CASES, key=str), ids=str)
def test_every_rule_on_cuda(op, dtype, on_cuda):
    case = CASES[op]
    order = min(case.order, 3 if dtype == torch.float32 else case.order)
    ref = _cpu_reference(case, order)
    move = on_cuda(dtype)
    res = hoad.compile(case.fn, order=order, wrt=case.wrt, backend="eager")(*map(move, case.args))
    for key in ref:
        _close(res[key], ref[key], dtype if case.tol is None else torch.float32, f"{op} block {key}")


def _one_case_per_family():
    chosen = {}
    for op in sorted(CASES, key=str):
        chosen.setdefault(FAMILIES[op], op)
    return sorted(chosen.values(), key=str)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("op", _one_case_per_family(), ids=str)
def test_compiled_rule_family_on_cuda(op, dtype, on_cuda):
    case = CASES[op]
    ref = _cpu_reference(case, 2)
    move = on_cuda(dtype)
    res = hoad.compile(case.fn, order=2, wrt=case.wrt, backend="inductor")(*map(move, case.args))
    for key in ref:
        _close(res[key], ref[key], dtype, f"{op} block {key}")


@pytest.mark.slow
@pytest.mark.parametrize("op", sorted(CASES, key=str), ids=str)
def test_every_rule_compiled_on_cuda(op, on_cuda):
    case = CASES[op]
    ref = _cpu_reference(case, 2)
    move = on_cuda(torch.float64)
    res = hoad.compile(case.fn, order=2, wrt=case.wrt, backend="inductor")(*map(move, case.args))
    for key in ref:
        _close(res[key], ref[key], torch.float64, f"{op} block {key}")


def _mlp(device, dtype):
    g = torch.Generator().manual_seed(0)
    W1 = (torch.randn(4, 16, generator=g, dtype=torch.float64) / 2).to(device, dtype)
    W2 = (torch.randn(16, 1, generator=g, dtype=torch.float64) / 4).to(device, dtype)

    def u(x):
        return (torch.tanh(x @ W1) @ W2).squeeze(-1)

    return u


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_operators_on_cuda(dtype, backend):
    X = torch.randn(64, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_lap = hoad.laplacian(_mlp("cpu", torch.float64), batch_dim=0, backend="eager")(X)
    ref_bih = hoad.biharmonic(_mlp("cpu", torch.float64), batch_dim=0, backend="eager")(X)
    Xc = X.to("cuda", dtype)
    lap = hoad.laplacian(_mlp("cuda", dtype), batch_dim=0, backend=backend)(Xc)
    _close(lap.laplacian, ref_lap.laplacian, dtype, "laplacian")
    _close(lap.gradient, ref_lap.gradient, dtype, "gradient")
    bih = hoad.biharmonic(_mlp("cuda", dtype), batch_dim=0, backend=backend)(Xc)
    _close(bih.biharmonic, ref_bih.biharmonic, dtype, "biharmonic")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_a_training_step_on_cuda(dtype):
    """Parameter gradients of a Laplacian-residual loss through the compiled program and its
    compiled backward, on the GPU, against the CPU eager program."""
    results = {}
    for device, backend in (("cpu", "eager"), ("cuda", "inductor")):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(torch.float64)
        net = net.to(device, dtype if device == "cuda" else torch.float64)
        X = torch.rand(32, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        X = X.to(device, dtype if device == "cuda" else torch.float64)
        lap = hoad.laplacian(lambda x: net(x).squeeze(-1), batch_dim=0, backend=backend)
        loss = (lap(X).laplacian ** 2).mean()
        loss.backward()
        results[device] = [p.grad if p.grad is not None else torch.zeros_like(p) for p in net.parameters()]
    for got, ref in zip(results["cuda"], results["cpu"]):
        _close(got, ref, dtype, "parameter gradient")


# ------------------------------------------------------------------------------ CUDA graphs
def _graphs_of(compiled) -> list:
    """The CUDA-graph runners of a compiled function's programs (hoad.passes.compile.CudaGraphs)."""
    return [entry.build.main.graphs for entry in compiled._cache.values()
            if getattr(entry.build.main, "graphs", None) is not None]


def test_inductor_programs_replay_cuda_graphs_with_fresh_results(monkeypatch):
    """A compiled program on CUDA is replayed from a CUDA graph: its results equal the launched
    program's, a later call never overwrites an earlier call's results, and a weight updated in
    place, new points and a new number of points are all read afresh."""
    monkeypatch.setenv("HOAD_CUDA_GRAPHS", "1")
    g = torch.Generator().manual_seed(3)
    W1 = (torch.randn(3, 32, generator=g, dtype=torch.float64) / 2).cuda()
    W2 = (torch.randn(32, 1, generator=g, dtype=torch.float64) / 4).cuda()

    def u(x):
        return (torch.tanh(x @ W1) @ W2).squeeze(-1)

    def truth(X):
        cf = hoad.compile(u, order=2, batch_dim=0, backend="eager")
        return cf(X)

    cf = hoad.compile(u, order=2, batch_dim=0, backend="inductor")
    X1 = torch.randn(64, 3, generator=g, dtype=torch.float64).cuda()
    X2 = torch.randn(64, 3, generator=g, dtype=torch.float64).cuda()
    first = cf(X1)
    H1 = first[0, 0].clone()
    torch.testing.assert_close(first[0, 0], truth(X1)[0, 0], rtol=1e-12, atol=1e-12)
    runners = _graphs_of(cf)
    assert runners and all(r.broken is None for r in runners), [r.broken for r in runners]
    assert sum(len(r.graphs) for r in runners) == 1
    second = cf(X2)
    torch.testing.assert_close(second[0, 0], truth(X2)[0, 0], rtol=1e-12, atol=1e-12)
    assert torch.equal(first[0, 0], H1), "a later call overwrote an earlier call's results"
    W1.mul_(1.5)  # in place: the graph reads its copy of the weight afresh
    torch.testing.assert_close(cf(X2)[0, 0], truth(X2)[0, 0], rtol=1e-12, atol=1e-12)
    X3 = torch.randn(40, 3, generator=g, dtype=torch.float64).cuda()  # another count: another graph
    torch.testing.assert_close(cf(X3)[0, 0], truth(X3)[0, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cf(X3).value, u(X3), rtol=1e-12, atol=1e-12)


def test_cuda_graphs_are_off_by_default(monkeypatch):
    monkeypatch.delenv("HOAD_CUDA_GRAPHS", raising=False)
    W = torch.randn(4, 4, dtype=torch.float64, device="cuda")
    cf = hoad.compile(lambda x: torch.sin(x @ W).sum(), order=2, backend="inductor")
    x = torch.randn(4, dtype=torch.float64, device="cuda")
    res = cf(x)
    assert not _graphs_of(cf)
    ref = torch.func.hessian(lambda x: torch.sin(x @ W).sum())(x)
    torch.testing.assert_close(res[0, 0], ref, rtol=1e-12, atol=1e-12)


def test_a_program_writing_its_inputs_is_not_graphed(monkeypatch):
    """Batch norm in training mode writes its running statistics: those writes must reach the
    module's buffers, which a graph's copies of them would not."""
    monkeypatch.setenv("HOAD_CUDA_GRAPHS", "1")
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3).to("cuda", torch.float64)
    twin = torch.nn.BatchNorm1d(3).to("cuda", torch.float64)
    X = torch.randn(16, 3, dtype=torch.float64, device="cuda")
    cf = hoad.compile(lambda x: bn(x).tanh().sum(), order=2, backend="inductor")
    cf(X)
    twin(X)
    torch.testing.assert_close(bn.running_mean, twin.running_mean)
    torch.testing.assert_close(bn.running_var, twin.running_var)
    assert not _graphs_of(cf)


def test_cuda_graphs_serve_threads_calling_at_once(monkeypatch):
    """Threads share a graph's input and output buffers: each call's copies and replay are queued
    after the previous call's, so every thread gets its own points' results."""
    import threading

    monkeypatch.setenv("HOAD_CUDA_GRAPHS", "1")
    g = torch.Generator().manual_seed(4)
    W = (torch.randn(3, 16, generator=g, dtype=torch.float64) / 2).cuda()

    def u(x):
        return torch.tanh(x @ W).sum(-1)

    lap = hoad.laplacian(u, batch_dim=0, backend="inductor")
    points = [torch.randn(32, 3, generator=g, dtype=torch.float64).cuda() for _ in range(8)]
    truth = [hoad.laplacian(u, batch_dim=0, backend="eager")(X).laplacian for X in points]
    lap(points[0])
    assert _graphs_of(lap.compiled), "the operator's program is not graphed"
    wrong = []

    def work(k):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for i in range(20):
                j = (k + i) % len(points)
                got = lap(points[j]).laplacian
                stream.synchronize()
                if not torch.allclose(got, truth[j], rtol=1e-12, atol=1e-12):
                    wrong.append((k, i))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, wrong
