"""The examples do what their docstrings say."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pinn_poisson_learns():
    """A short run (eager programs in the test suite): the error falls well below the untrained one."""
    pinn = _load("pinn_poisson")
    _net, error = pinn.train(steps=150, lbfgs_steps=20, points=128)
    assert error < 0.2


@pytest.mark.slow
def test_pinn_poisson_reaches_its_stated_error():
    pinn = _load("pinn_poisson")
    _net, error = pinn.train()
    assert error < 1e-3


def test_laplace_newton_converges_quadratically_and_the_evidence_picks_the_true_prior():
    """The data are drawn with w ~ N(0, I): the evidence peaks at α = 1. Every Newton run ends
    below 1e-10 in a handful of steps, the Hessian at the MAP is torch.func's, and the Laplace
    predictive is less confident than the MAP's far from the data."""
    import torch
    from torch.func import hessian

    ex = _load("laplace_newton")
    out = ex.run(verbose=False)
    assert out["best"] == 1.0
    for alpha, r in out["results"].items():
        assert r["norms"][-1] < 1e-10 and r["steps"] <= 8, (alpha, r["norms"])
    r = out["results"][1.0]
    a = torch.tensor(1.0, dtype=torch.float64)
    H = hessian(ex.negative_log_joint)(r["w"], out["X"], out["y"], a)
    torch.testing.assert_close(r["H"], H, rtol=1e-10, atol=1e-10)
    assert bool(((out["p_laplace"] - 0.5).abs() <= (out["p_map"] - 0.5).abs()).all())


def test_force_constants_match_differences_and_each_order_gains_a_power():
    """LJ8's known global minimum (-19.821489), force constants that agree with central
    differences of Hessians, and Taylor models whose error falls as s³, s⁴ and s⁵."""
    ex = _load("force_constants")
    out = ex.analyse(n=8, verbose=False)
    assert out["gradient"].norm() < 1e-8
    assert abs(ex.energy(out["x0"]).item() + 19.821489) < 1e-6
    assert out["cubic_error"] < 1e-5 and out["quartic_error"] < 1e-5
    (s1, _, *small), (s2, _, *large) = out["taylor"][:2]
    assert s2 == 2 * s1
    for order, (a, b) in enumerate(zip(small, large), start=2):
        assert b / a > 0.75 * 2 ** (order + 1), (order, a, b)  # error ~ s^(order + 1)
    assert small[0] > small[1] > small[2]
    k, d = out["mode"], out["along"]  # res.along(q): the modal constants along q, from the Cartesian blocks
    want = [0.0, out["omega"][k].item() ** 2, out["phi3"][k, k, k].item(), out["phi4"][k, k, k, k].item()]
    assert abs(d[0]) < 1e-8 and all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(d[1:], want[1:])), (d, want)


@pytest.mark.parametrize("sharding", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_pinn_ddp_trains_under_torchrun(sharding):
    """The data-parallel PINN as its docstring launches it: 2 ranks on the CPU (gloo), each on its
    own points; the ranks end with the same weights (DDP: each rank's own copy) and the error falls."""
    import os
    import re
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", HOAD_DEFAULT_BACKEND="eager")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(EXAMPLES / "pinn_ddp.py"), "--steps", "150", "--points", "64"]
                         + (["--fsdp"] if sharding == "fsdp" else []),
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = re.search(r"relative L2 error (\S+); ranks 2 \((\S+)\); weights differ across ranks by (\S+)", run.stdout)
    assert found, run.stdout[-2000:] + run.stderr[-2000:]
    assert found.group(2) == {"ddp": "DDP", "fsdp": "FSDP2"}[sharding]
    assert float(found.group(1)) < 0.8 and float(found.group(3)) == 0.0


@pytest.mark.slow  # (25 s)
def test_plate_5d_learns_through_the_randomized_biharmonic():
    """The docstring's run: the error falls from 0.51 to below 0.1, and a step with 4 random
    directions costs less than one with the exact operator."""
    plate = _load("plate_5d")
    out = plate.train(verbose=False)
    assert out["first"] > 0.4 and out["last"] < 0.1, out
    assert out["per_step"]["randomized"] < out["per_step"]["exact"], out
