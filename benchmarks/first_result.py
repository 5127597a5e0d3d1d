"""``python -m benchmarks.first_result [--only NAMES]``: how long a new user waits (issue 46).

Each case runs in a fresh process, with hoad's caches (its C++ kernels, Inductor's programs)
empty and then warm, and with Inductor compiling in the background (``HOAD_COMPILE=background``,
the default) or before the first call returns (``wait``):

- ``pinn loop``: a 2-32-32-1 Poisson PINN, 256 points, 300 Adam steps through
  ``loss.backward()`` of ``hoad.laplacian``; the time to the first step and to the last, beside
  the same loop through plain autograd (``create_graph``) and through ``torch.func``;
- ``burgers loop``: issue 46's Burgers PINN, u_t + u u_x - ν u_xx on (x, t), the same network,
  points and steps, with ``hoad.compile(u, order=2, batch_dim=0, diagonal=True)`` (u, its gradient
  and its pure second derivatives in one program), beside autograd and ``torch.func``;
- ``quickstart``, ``laplace_newton``: the examples, start to end;
- ``jets``: issue 44's general 4-jets of the torch-jet paper's network (50-768-768-512-512-1, 16
  points, 4 curves with their higher coefficients): the time to the first result and to 100
  calls, beside torch-jet (eager, and under ``torch.compile``) and torch.func (nested ``jacfwd``
  in t, vmapped).

One thread, the process's whole wall time (Python and torch imports included), and how long
hoad's background processes (compiles in children, the kernels' first build) went on after it:
the next run starts when they are over. Results go to
``benchmarks/results/<stamp>-first.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.env import ONE_THREAD, REPO

LOOP = r'''
import sys, time
start = time.perf_counter()
import torch
torch.set_num_threads(1)
way = sys.argv[1]
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                          torch.nn.Linear(32, 1)).double()
P = torch.rand(256, 2, dtype=torch.float64)
f = 2 * torch.pi ** 2 * torch.sin(torch.pi * P).prod(-1)
u = lambda X: net(X).squeeze(-1)
burgers = sys.argv[2] == "burgers"
if burgers:  # the residual u_t + u u_x - nu u_xx, with (x, t) the columns of X
    nu = 0.01 / torch.pi
    if way == "hoad":
        import hoad
        derivatives = hoad.compile(u, order=2, batch_dim=0, diagonal=True)
        def residual(X):
            res = derivatives(X)
            return res[0][:, 1] + res.value * res[0][:, 0] - nu * res[0, 0][:, 0]
    elif way == "autograd":
        def residual(X):
            X = X.clone().requires_grad_()
            v = u(X)
            g, = torch.autograd.grad(v.sum(), X, create_graph=True)
            gxx, = torch.autograd.grad(g[:, 0].sum(), X, create_graph=True)
            return g[:, 1] + v * g[:, 0] - nu * gxx[:, 0]
    else:
        from torch.func import grad, hessian, vmap
        def one(x):
            s = lambda y: u(y[None])[0]
            g, H = grad(s)(x), hessian(s)(x)
            return g[1] + s(x) * g[0] - nu * H[0, 0]
        residual = vmap(one)
    laplacian = lambda X: residual(X)
    f = torch.zeros(256, dtype=torch.float64)
elif way == "hoad":
    import hoad
    lap = hoad.laplacian(u, batch_dim=0)
    laplacian = lambda X: lap(X).laplacian
elif way == "autograd":
    def laplacian(X):
        X = X.clone().requires_grad_()
        g, = torch.autograd.grad(u(X).sum(), X, create_graph=True)
        return sum(torch.autograd.grad(g[:, i].sum(), X, create_graph=True)[0][:, i] for i in range(X.shape[1]))
else:
    from torch.func import functional_call, hessian, vmap
    def laplacian(X):
        return vmap(lambda x: hessian(lambda y: u(y[None])[0])(x).diagonal().sum())(X)
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
first = None
for step in range(300):
    opt.zero_grad()
    ((laplacian(P) + f) ** 2).mean().backward()
    opt.step()
    if first is None:
        first = time.perf_counter() - start
print(f"FIRST {first:.3f} TOTAL {time.perf_counter() - start:.3f}")
'''


JETS = r'''
import os, sys, time
start = time.perf_counter()
sys.path.insert(0, os.getcwd())
import torch
torch.set_num_threads(1)
from benchmarks.jets import ORDER, _along_curves, _jet, jet_problem
from benchmarks.operators import PAPER_MLP
way = sys.argv[1]
p = jet_problem("general", PAPER_MLP, 16, 4)()
if way == "hoad":
    import hoad
    u = lambda x: p.net.u(x)
    op = hoad.taylor(u, order=ORDER, directions=p.V, higher=p.higher, batch_dim=0)
    call = lambda: op(p.X)[ORDER]
elif way.startswith("torch-jet"):
    call = _jet(p, compiled=way.endswith("compiled"))[1]
else:
    call = lambda: _along_curves(p, zeros=False, orders=ORDER)
first = None
for _ in range(100):
    call()
    if first is None:
        first = time.perf_counter() - start
print(f"FIRST {first:.3f} TOTAL {time.perf_counter() - start:.3f}")
'''

WAYS = {"pinn loop": ("hoad", "autograd", "torch.func"), "burgers loop": ("hoad", "autograd", "torch.func"),
        "jets": ("hoad", "torch-jet", "torch-jet compiled", "torch.func")}


def _run(argv: list[str], env: dict, timeout: float = 1800) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - start, done.stdout


def _background_children() -> list[int]:
    """hoad's processes that outlive a script: its compiles (``python -m hoad.warm``) and the
    kernels' first build."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    line = f.read().replace(b"\0", b" ")
            except OSError:
                continue
            if b"hoad.warm" in line or b"from hoad.lowering import kernels" in line:
                found.append(int(pid))
    return found


def _wait_for_children(timeout: float = 900) -> float:
    """Seconds until hoad's background processes are over: the next run is warm only then."""
    start = time.perf_counter()
    while _background_children() and time.perf_counter() - start < timeout:
        time.sleep(0.2)
    return time.perf_counter() - start


def measure(only: set[str] | None) -> list[dict]:
    rows = []
    cases = [(loop, way) for loop in ("pinn loop", "burgers loop") for way in WAYS[loop]] + [
        ("quickstart", None), ("laplace_newton", None)] + [("jets", way) for way in WAYS["jets"]]
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {"loop": os.path.join(tmp, "loop.py"), "jets": os.path.join(tmp, "jets.py")}
        for name, text in (("loop", LOOP), ("jets", JETS)):
            with open(scripts[name], "w") as fh:
                fh.write(text)
        for case, way in cases:
            if only and case not in only:
                continue
            modes = ("background", "wait") if way in (None, "hoad") else ("-",)
            for mode in modes:
                for cache in ("empty", "warm"):
                    if mode == "-" and cache == "warm":
                        continue
                    cache_dir = os.path.join(tmp, f"cache-{case}-{way}-{mode}".replace(" ", "_").replace(".", "_"))
                    if cache == "empty" and os.path.exists(cache_dir):
                        raise RuntimeError("a cache meant to be empty exists")
                    env = dict(os.environ, **ONE_THREAD, HOAD_CACHE_DIR=cache_dir)
                    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
                    if mode != "-":
                        env["HOAD_COMPILE"] = mode
                    else:  # (torch.compile's programs: from an empty cache too)
                        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
                    loop = case in WAYS
                    argv = [sys.executable, scripts["loop"], way, case.split()[0]] if case.endswith(" loop") else \
                        [sys.executable, scripts["jets"], way] if case == "jets" else \
                        [sys.executable, str(REPO / "examples" / f"{case}.py")]
                    seconds, out = _run(argv, env)
                    row = {"case": case, "way": way or "hoad", "compile": mode, "cache": cache, "seconds": seconds,
                           # (its compiles and kernel build going on after it: the next run waits for them)
                           "children_after_s": round(_wait_for_children(), 1)}
                    if loop:
                        words = out.split()
                        row["first"], row["total"] = float(words[words.index("FIRST") + 1]), \
                            float(words[words.index("TOTAL") + 1])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_result", description=__doc__.split("\n\n")[1])
    parser.add_argument("--only", help="comma-separated cases: pinn loop, burgers loop, quickstart, laplace_newton, "
                        "jets")
    args = parser.parse_args(argv)
    rows = measure(set(s.strip() for s in args.only.split(",")) if args.only else None)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = REPO / "benchmarks" / "results" / f"{stamp}-first.json"
    path.write_text(json.dumps(rows, indent=1))
    print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
