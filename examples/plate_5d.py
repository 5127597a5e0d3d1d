"""A biharmonic problem in five dimensions, trained through hoad's randomized biharmonic: the
estimator of torch-jet's paper ("Collapsing Taylor Mode AD"), with new directions at every step.

    Δ²u = f  on the cube [0, 1]⁵,   f = π⁴ u*,   with  u* = (1/5) Σᵢ sin(πxᵢ),

and on the cube's faces u = u* and Δu = -π² u* (a simply supported plate's two conditions, with
data). The exact Δ²u of a network costs a fourth-order jet along every pair of the 5 axes.
``hoad.biharmonic(u, randomization=("normal", S), estimator="gaussian")`` estimates it without
bias from S Gaussian directions v, as (1/3S) Σ ∂⁴u[v, v, v, v]: collapsed 4-jets in one program
that draws new directions inside every call (from a seeded generator). The loss is the mean
squared residual at random interior points plus the two conditions on the faces (u and Δu from
``hoad.laplacian``); its gradient flows through both programs (``loss.backward()``).

Each step costs S collapsed 4-jets per point, and the estimate's noise averages out over the
steps as a stochastic gradient's does. With S = 4, 1500 Adam steps take the relative L2 error
against u* on held-out points from 0.51 to about 0.07, in 25 s on 2 CPU cores (eager programs
while Inductor compiles); a step takes 15 ms, against 61 ms with the exact operator.

    python examples/plate_5d.py [--steps N] [--directions S]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn

import hoad

DT = torch.float64
D = 5


def exact(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(math.pi * x).mean(-1)


def source(x: torch.Tensor) -> torch.Tensor:
    return math.pi**4 * exact(x)


def boundary_points(n: int, g: torch.Generator) -> torch.Tensor:
    """n points on the cube's faces: each point has one coordinate set to 0 or 1."""
    x = torch.rand(n, D, generator=g, dtype=DT)
    axis = torch.randint(0, D, (n,), generator=g)
    x[torch.arange(n), axis] = torch.randint(0, 2, (n,), generator=g).to(DT)
    return x


class Plate(nn.Module):
    """u_θ, its residual loss, and the two operator programs the loss reads."""

    def __init__(self, width: int = 64, directions: int = 4, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(D, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, 1)).to(DT)
        self.draws = torch.Generator().manual_seed(seed + 1)
        self.biharmonic = hoad.biharmonic(self.u, batch_dim=0, randomization=("normal", directions),
                                          estimator="gaussian", generator=self.draws)
        self.exact_biharmonic = hoad.biharmonic(self.u, batch_dim=0)
        self.laplacian = hoad.laplacian(self.u, batch_dim=0)

    def u(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def loss(self, inside: torch.Tensor, edge: torch.Tensor, exact_operator: bool = False) -> torch.Tensor:
        op = self.exact_biharmonic if exact_operator else self.biharmonic
        residual = (op(inside).biharmonic - source(inside)) / math.pi**4  # (in units of f's amplitude)
        on_edge = self.laplacian(edge)
        bending = (on_edge.laplacian + math.pi**2 * exact(edge)) / math.pi**2
        return residual.pow(2).mean() + (on_edge.value - exact(edge)).pow(2).mean() + bending.pow(2).mean()


def relative_l2(plate: Plate, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((plate.u(x) - exact(x)).norm() / exact(x).norm())


def train(steps: int = 1500, directions: int = 4, points: int = 256, seed: int = 0, verbose: bool = True) -> dict:
    plate = Plate(directions=directions, seed=seed)
    g = torch.Generator().manual_seed(seed + 2)
    held_out = torch.rand(2048, D, generator=g, dtype=DT)
    opt = torch.optim.Adam(plate.parameters(), lr=5e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    first, start = relative_l2(plate, held_out), time.perf_counter()
    for step in range(steps):
        inside, edge = torch.rand(points, D, generator=g, dtype=DT), boundary_points(points, g)
        opt.zero_grad()
        loss = plate.loss(inside, edge)
        loss.backward()
        opt.step()
        sched.step()
        if verbose and (step % 250 == 0 or step == steps - 1):
            print(f"step {step:5d}  loss {loss.item():.3e}  relative L2 error {relative_l2(plate, held_out):.3e}")
    seconds = time.perf_counter() - start
    last = relative_l2(plate, held_out)
    per_step = {}
    inside, edge = torch.rand(points, D, generator=g, dtype=DT), boundary_points(points, g)
    for name, exact_operator in (("randomized", False), ("exact", True)):
        plate.loss(inside, edge, exact_operator).backward()  # (built, and run once)
        t = time.perf_counter()
        for _ in range(20):
            plate.loss(inside, edge, exact_operator).backward()
        per_step[name] = (time.perf_counter() - t) / 20
    if verbose:
        print(f"relative L2 error {first:.3e} -> {last:.3e} in {steps} steps ({seconds:.1f} s); one step: "
              f"{per_step['randomized'] * 1e3:.2f} ms with {directions} random directions, "
              f"{per_step['exact'] * 1e3:.2f} ms with the exact operator")
    return {"first": first, "last": last, "seconds": seconds, "per_step": per_step}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--directions", type=int, default=4)
    args = parser.parse_args()
    train(args.steps, args.directions)
