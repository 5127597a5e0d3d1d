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
