"""The Poisson PINN of ``pinn_poisson.py``, trained data-parallel with DistributedDataParallel or FSDP2.

    torchrun --nproc-per-node 2 examples/pinn_ddp.py [--steps N] [--fsdp]

Each rank draws its own collocation points (its own seed), computes the Laplacian of u_θ at them
through hoad (``hoad.laplacian`` over the DDP module), and DDP averages the gradients of
``loss.backward()`` across ranks, so every rank takes the step that one process would take on the
union of all ranks' points. The same file runs on CPUs (gloo) and on GPUs (nccl, one GPU per
rank): nothing in it is specific to either.

With ``--fsdp`` the network is sharded by FSDP2 (``fully_shard`` per layer and at the root: each
rank keeps a shard of every weight), and FSDP reduce-scatters the gradients instead; hoad runs
FSDP's forward protocol around its program, and the training is the same.

Two things a derivative loss needs from DDP:

- ``find_unused_parameters=True``: a Laplacian never reaches a parameter that only shifts the
  output (the last layer's bias), and DDP must be told that a parameter may get no gradient;
- one DDP call per step: the boundary values come from the same program as the Laplacian (its
  ``.value``), so DDP sees one forward per backward.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from pinn_poisson import boundary_points, exact, source  # the same problem (this file's folder is on the path)

import hoad

log = logging.getLogger("pinn_ddp")
DT = torch.float64


def network() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    return nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)).to(DT)


def sharded(net: nn.Module) -> nn.Module:
    """The network sharded by FSDP2: each linear layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(net)


def train(steps: int = 1000, points: int = 256, fsdp: bool = False) -> tuple[nn.Module, float]:
    """Adam on this rank's points; the trained network (its weights gathered) and its relative L2
    error on a grid."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else \
        torch.device("cpu")
    if fsdp:
        model = sharded(network().to(device))
    else:
        model = nn.parallel.DistributedDataParallel(network().to(device), find_unused_parameters=True)
    laplacian = hoad.laplacian(lambda xy: model(xy).squeeze(-1), batch_dim=0)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own points
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    side = torch.linspace(0, 1, 101, dtype=DT)
    grid = torch.cartesian_prod(side, side).to(device)
    start = time.perf_counter()
    for step in range(steps + 1):
        interior = torch.rand(points, 2, generator=g, dtype=DT).to(device)
        edge = boundary_points(points // 4, g).to(device)
        out = laplacian(torch.cat([interior, edge]))  # one program, one DDP/FSDP forward: Δu and u
        residual = out.laplacian[:points] + source(interior)
        loss = (residual**2).mean() + 100 * (out.value[points:] ** 2).mean()
        opt.zero_grad()
        loss.backward()  # DDP averages the gradients across ranks (FSDP reduce-scatters them)
        opt.step()
        sched.step()
        if step % 250 == 0 and rank == 0:
            log.info("step %5d  loss %.3e  (%d ranks, %.0f s)", step, float(loss.detach()), world,
                     time.perf_counter() - start)
    net = model if fsdp else model.module
    with torch.no_grad():
        error = float((net(grid).squeeze(-1) - exact(grid)).norm() / exact(grid).norm())
    return net, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="Adam steps (default 1000)")
    parser.add_argument("--points", type=int, default=256, help="interior points per rank and step (default 256)")
    parser.add_argument("--fsdp", action="store_true", help="shard the network with FSDP2 instead of DDP")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        net, error = train(args.steps, args.points, args.fsdp)
        weights = torch.cat([(p.full_tensor() if args.fsdp else p).detach().reshape(-1) for p in net.parameters()])
        spread = weights.clone()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)  # every rank holds the same weights
        spread -= weights
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print(f"relative L2 error {error:.2e}; ranks {dist.get_world_size()} ({'FSDP2' if args.fsdp else 'DDP'}); "
                  "weights differ across ranks by "
                  f"{float(spread.abs().max()):.1e}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
