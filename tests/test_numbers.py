"""Float arguments as program inputs (hoad.numbers): a float argument whose value alone changes
between calls is traced as an input at its second value, so every later value builds nothing; a
function that needs the value in Python keeps it a constant, and the warning says why."""

import logging
import math
import threading

import pytest
import torch
import torch.nn as nn
from helpers import assert_close, rand
from torch.func import grad, hessian, jacfwd, jacrev

import hoad

DT = torch.float64


def programs(cf) -> int:
    return len({id(e) for e in cf._cache.values()})


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "compiling program" in r.getMessage()]


def test_a_float_argument_becomes_a_program_input_at_its_second_value(caplog):
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(DT)

    def energy(x, beta, nu):
        return (beta * net(x).squeeze(-1) ** 2 + nu * x.sin().sum(-1)).sum() / (1.0 + beta) - 2.0 ** beta

    x = rand(5, 3, seed=1)
    cf = hoad.compile(energy, order=2, backend="eager")
    with caplog.at_level(logging.INFO, logger="hoad"):
        for beta, nu in [(0.5, 0.1), (0.7, 0.1), (1.3, 0.1), (-2.0, 0.1), (1.3, 0.4), (0.25, -3.0)]:
            res = cf(x, beta, nu)
            assert_close(res[0, 0], hessian(energy)(x, beta, nu), f"Hessian at beta={beta}, nu={nu}")
            assert_close(res[0], grad(energy)(x, beta, nu), f"gradient at beta={beta}, nu={nu}")
    assert programs(cf) == 3  # beta made an input at its second value, nu at its second
    assert [m.split("; ")[0] for m in said(caplog)] == ["hoad: energy called with beta=0.7 (was 0.5)",
                                                        "hoad: energy called with nu=0.4 (was 0.1)"], said(caplog)
    assert all("with it as program input" in m for m in said(caplog))


def test_a_float_given_by_keyword_and_to_a_decorated_method():
    class Boltzmann(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1).to(DT)

        @hoad.compile(order=2, backend="eager")
        def energy(self, x, *, beta=1.0):
            return torch.tanh(self.lin(x)).sum() * beta

    m, x = Boltzmann(), rand(3, seed=2)
    for beta in (1.0, 2.0, 0.5, 3.5):
        ref = jacfwd(jacrev(lambda x: torch.tanh(m.lin(x)).sum() * beta))(x)
        assert_close(m.energy(x, beta=beta)[0, 0], ref, f"beta={beta}")
    assert programs(Boltzmann.energy.__get__(m)) == 2


def test_an_operator_with_a_float_argument():
    W = rand(2, 16, seed=3)

    def u(X, c):
        return torch.tanh(c * X @ W).sum(-1)

    X = rand(6, 2, seed=4)
    lap = hoad.laplacian(u, batch_dim=0, backend="eager")
    for c in (0.5, 1.5, 2.5):
        ref = torch.vmap(lambda x: torch.trace(hessian(lambda x: u(x[None], c)[0])(x)))(X)
        assert_close(lap(X, c).laplacian, ref, f"Laplacian at c={c}")
    assert programs(lap.compiled) == 2


def test_dtypes_are_those_a_python_float_gives():
    """A traced float computes in the tensor's dtype beside a floating tensor (float32 stays
    float32, also a 0-d one) and in the default dtype beside an integer tensor, as a float does."""
    x = rand(4, 3, seed=5)
    n = torch.arange(3)
    half = torch.tensor(0.5, dtype=torch.float32)

    def f(x, k):
        return (x * (n * k)).sum() + (x.float() * k + half * k).double().sum() + (x.float() ** k).double().sum()

    cf = hoad.compile(f, order=1, backend="eager")
    for k in (0.1, 0.3, 1.7):  # (float32 terms: float32 rounding, a float's or a traced one's)
        torch.testing.assert_close(cf(x.abs(), k)[0], grad(f)(x.abs(), k), rtol=1e-6, atol=1e-6)
    assert programs(cf) == 2
    seen = {}

    def g(x, k):
        seen["int"] = (n * k).dtype
        seen["float32"] = (x.float() * k).dtype
        seen["0-d"] = (half * k).dtype
        return x.sum()

    cg = hoad.compile(g, order=1, backend="eager")
    cg(x, 0.5)
    plain = dict(seen)
    cg(x, 0.75)  # traced with k as an input
    assert seen == plain == {"int": torch.get_default_dtype(), "float32": torch.float32, "0-d": torch.float32}


def _compares(x, k):
    if k > 1:
        return (x ** 3).sum() * k
    return (x.sin() * k).sum()


def _math(x, k):
    return (x * math.exp(k)).sum()


def _swallowed(x, k):
    try:
        v = float(k)
    except BaseException:  # noqa: BLE001 - a function that hides the refusal: still refused
        v = 1.0
    return (x * v).sum()


def _size(x, k):
    return (x[: int(k)] ** 2).sum()


def _key(x, k):
    return (x * {k: 2.0}.get(k, 1.0)).sum()


def _formatted(x, k):
    return (x * len(f"{k}")).sum()


def _full(x, k):
    return (x * torch.full((3,), k, dtype=DT)).sum()


REFUSED = {
    _compares: "compares it (>)",
    _math: "reads its value",
    _swallowed: "reads its value",
    _size: "converts it to an int",
    _key: "hashes it",
    _formatted: "formats it as text",
    _full: "",  # (a torch function that takes only a Python number: its trace fails instead)
}


@pytest.mark.parametrize("f", list(REFUSED), ids=lambda f: f.__name__.strip("_"))
def test_a_function_that_needs_the_value_keeps_it_a_constant(f, caplog):
    x = rand(3, 3, seed=6) + 0.5
    cf = hoad.compile(f, order=2, backend="eager")
    with caplog.at_level(logging.INFO, logger="hoad"):
        for k in (0.5, 2.0, 3.0, 2.0):
            assert_close(cf(x, k)[0, 0], hessian(f)(x, k), f"{f.__name__} at k={k}")
    assert programs(cf) == 3  # one per value, 2.0 twice
    refusal = [m for m in said(caplog) if "stays part of the program" in m]
    assert len(refusal) == 2, said(caplog)
    assert REFUSED[f] in refusal[0] and "called with k=2.0 (was 0.5)" in refusal[0], refusal[0]
    if REFUSED[f]:
        assert "test_numbers.py:" in refusal[0], refusal[0]  # the user's line


def test_isinstance_takes_the_float_path():
    def f(x, k):
        scale = k if isinstance(k, float) else 1.0
        return (x * scale).sum() ** 2

    x = rand(3, seed=7)
    cf = hoad.compile(f, order=2, backend="eager")
    for k in (0.5, 2.0, 3.0):
        assert_close(cf(x, k)[0, 0], hessian(f)(x, k), f"k={k}")
    assert programs(cf) == 2


def test_a_float_that_changes_with_another_argument_stays_a_constant():
    def f(x, k, n):
        return (x ** n).sum() * k

    x = rand(3, seed=8)
    cf = hoad.compile(f, order=2, backend="eager")
    cf(x, 0.5, 2)
    cf(x, 0.7, 3)  # an int changed too: no float is made an input
    assert not cf._numbers
    for k, n in ((0.7, 3), (0.9, 3), (1.1, 3)):
        assert_close(cf(x, k, n)[0, 0], hessian(f)(x, k, n), f"k={k}, n={n}")
    assert programs(cf) == 3


def test_an_int_argument_says_to_pass_a_tensor(caplog):
    def f(x, n):
        return (x ** n).sum()

    x = rand(3, seed=9)
    cf = hoad.compile(f, order=2, backend="eager")
    cf(x, 2)
    with caplog.at_level(logging.INFO, logger="hoad"):
        cf(x, 3)
    assert "called with n=3 (was 2)" in said(caplog)[0] and "as a tensor" in said(caplog)[0], said(caplog)


def test_training_through_a_program_with_a_float_input():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).to(DT)
    lap = hoad.laplacian(lambda X, c: c * net(X).squeeze(-1), batch_dim=0, backend="eager")
    X = rand(6, 2, seed=10)
    params = dict(net.named_parameters())

    def reference(p, c):
        u = lambda x: c * torch.func.functional_call(net, p, (x[None],))[0, 0]  # noqa: E731
        return (torch.vmap(lambda x: torch.trace(hessian(u)(x)))(X) ** 2).mean()

    for c in (0.5, 1.5, 2.0):
        net.zero_grad()
        (lap(X, c).laplacian ** 2).mean().backward()
        ref = grad(reference)(params, c)
        for name, p in params.items():  # (the last bias never reaches a Laplacian: no gradient)
            assert_close(torch.zeros_like(p) if p.grad is None else p.grad, ref[name], f"{name} at c={c}")
    assert programs(lap.compiled) == 2


def test_threads_calling_with_many_values():
    """Eight threads call one program with values of their own at once, from the first call on:
    every result is right, and the values build at most one program besides the first."""
    W = rand(3, 8, seed=11)

    def f(x, k):
        return torch.tanh(k * x @ W).sum() + k * x.pow(2).sum()

    x = rand(3, seed=12)
    cf = hoad.compile(f, order=2, backend="eager")
    values = [[0.1 * (t * 6 + i + 1) for i in range(6)] for t in range(8)]
    refs = {k: hessian(f)(x, k) for ks in values for k in ks}  # (torch.func's forward levels are global)
    wrong, barrier = [], threading.Barrier(8)

    def work(t):
        barrier.wait()
        for k in values[t]:
            got = cf(x, k)[0, 0]
            ref = refs[k]
            if not torch.allclose(got, ref, rtol=1e-10, atol=1e-12):
                wrong.append((t, k, float((got - ref).abs().max())))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not wrong, wrong
    assert programs(cf) <= 2


@pytest.mark.inductor
def test_a_float_input_under_inductor(monkeypatch):
    monkeypatch.setenv("HOAD_COMPILE", "wait")
    W = rand(3, 4, seed=13)

    def f(x, k):
        return torch.tanh(k * x @ W).sum() * (1.0 - k)

    x = rand(3, seed=14)
    cf = hoad.compile(f, order=2, backend="inductor")
    for k in (0.5, 0.25, 1.5):
        assert_close(cf(x, k)[0, 0], hessian(f)(x, k), f"k={k}")
    assert programs(cf) == 2
