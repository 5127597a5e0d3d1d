"""``python -m benchmarks.scaling [--quick] [--ranks 1,2]``: hoad past one process.

Each rank is a process of a gloo group on this machine, pinned to a core of its own with one
thread, as ``torchrun`` would start it. Three patterns (issue 42), each timed at 1 and 2 ranks:

- ``pinn step`` (weak scaling): one Adam step of a Poisson PINN, 16-64-64-1, 256 points per
  rank, ``loss.backward()`` through ``hoad.laplacian`` of the DistributedDataParallel model;
- ``per-sample Hessians`` (weak scaling): ``hoad.compile(u, order=2, batch_dim=0)`` of the same
  MLP on 4096 points per rank, passed as a DTensor sharded along the samples;
- ``split Hessian`` (strong scaling): the Hessian of a 10-64-64-5 classifier's cross-entropy on
  256 samples in its 5189 parameters, the blocks dealt to the ranks (``split_blocks=True``), the
  reverse program at every rank count.

``pinn step alone`` is the control: the same step with each rank training its own
model, no DDP. On a machine whose cores are shared (a VM), two ranks that never talk already lose
time to each other, and the control says how much.

Per pattern: the median time per step of the slowest rank, after warm-up (compiles included
there, not in the figure), the efficiency (1-rank time over n-rank time for weak scaling; the
speed-up over n for strong scaling), written to ``benchmarks/results/<stamp>-scaling.json``.
``--rounds`` alternates the rank counts (1, 2, 1, 2, ...) and takes each figure's median over
the rounds, so a slow minute of the machine does not land on one count alone.
Inductor programs (the default backend); the machine must be otherwise idle.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time

from benchmarks.env import ONE_THREAD, REPO

PATTERNS = ("pinn step", "pinn step alone", "per-sample Hessians", "split Hessian")
STRONG = {"split Hessian"}


def _tanh_net(sizes, seed: int):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def _pinn_step(rank: int, world: int, quick: bool, communicate: bool = True):
    import torch

    import hoad

    model = _tanh_net((16, 64, 64, 1), 0)
    if communicate:
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    lap = hoad.laplacian(lambda X: model(X).squeeze(-1), batch_dim=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    X = torch.rand(256, 16, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    f = X.sin().sum(-1)

    def step():
        opt.zero_grad()
        ((lap(X).laplacian + f) ** 2).mean().backward()
        opt.step()

    return step, 3, 20 if quick else 100


def _pinn_alone(rank: int, world: int, quick: bool):
    """The PINN step on each rank's own model, no DDP: what the machine itself gives two ranks
    that never talk (the control for the pattern above)."""
    return _pinn_step(rank, world, quick, communicate=False)


def _per_sample(rank: int, world: int, quick: bool):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import hoad

    net = _tanh_net((16, 64, 64, 1), 0)
    mesh = init_device_mesh("cpu", (world,))
    X = torch.rand(4096 * world, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    Xd = distribute_tensor(X, mesh, [Shard(0)])
    cf = hoad.compile(lambda x: net(x).squeeze(-1), order=2, batch_dim=0)

    def step():
        with torch.no_grad():
            cf(Xd)

    return step, 2, 5 if quick else 20


def _split(rank: int, world: int, quick: bool):
    import torch
    import torch.nn.functional as F

    import hoad

    net = _tanh_net((10, 64, 64, 5), 1)
    g = torch.Generator().manual_seed(2)
    X, y = torch.randn(256, 10, generator=g, dtype=torch.float64), torch.randint(0, 5, (256,), generator=g)

    def loss(*params):
        return F.cross_entropy(torch.func.functional_call(net, dict(zip(names, params)), (X,)), y)

    names = [n for n, _ in net.named_parameters()]
    params = [p.detach() for p in net.parameters()]
    # mode="reverse" at every count, so that the ranks share out the same program: split_blocks
    # builds the reverse program, and mode="auto" picks forward-over-reverse for one rank here,
    # 1.6x slower than reverse (3.6 against 2.2 s, 2026-11-29): 1 rank against 2 compared two programs
    cf = hoad.compile(loss, order=2, wrt=tuple(range(len(params))), split_blocks=world > 1, mode="reverse")

    def step():
        cf(*params)

    return step, 1, 2 if quick else 5


BUILDERS = {"pinn step": _pinn_step, "pinn step alone": _pinn_alone, "per-sample Hessians": _per_sample,
            "split Hessian": _split}


def _rank(rank: int, world: int, port: int, quick: bool, patterns: list[str], out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(ONE_THREAD, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if hasattr(os, "sched_setaffinity"):
        # the computing thread on a core of its own, pinned after gloo has started its threads: pinned
        # with it, gloo's threads waited for the compute thread's time slices (PINN step at 2 ranks on
        # 2 cores: 11.7 ms pinned before, 7.5 after, 5.5 at 1 rank)
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    times = {}
    for name in patterns:
        step, warm, n = BUILDERS[name](rank, world, quick)
        for _ in range(warm):
            step()
        dist.barrier()
        samples = []
        for _ in range(n):
            dist.barrier()
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(times, fh)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, quick: bool, patterns: list[str]) -> dict[str, float]:
    """{pattern: the slowest rank's median seconds per step} at ``world`` ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_rank, args=(world, _free_port(), quick, patterns, out), nprocs=world, join=True)
        per_rank = [json.load(open(f"{out}.{r}")) for r in range(world)]
    return {name: max(r[name] for r in per_rank) for name in patterns}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.split("\n\n")[1])
    parser.add_argument("--quick", action="store_true", help="fewer steps per pattern")
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts (default 1,2)")
    parser.add_argument("--only", help="comma-separated patterns: " + ", ".join(PATTERNS))
    parser.add_argument("--rounds", type=int, default=3, help="runs of every rank count, alternated (default 3)")
    args = parser.parse_args(argv)
    patterns = [p.strip() for p in args.only.split(",")] if args.only else list(PATTERNS)
    unknown = set(patterns) - set(PATTERNS)
    if unknown:
        parser.error(f"unknown patterns {sorted(unknown)}; known: {', '.join(PATTERNS)}")
    worlds = [int(n) for n in args.ranks.split(",")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if max(worlds) > cores:
        parser.error(f"{max(worlds)} ranks need as many cores, this machine gives {cores}")
    runs: dict[int, list[dict[str, float]]] = {world: [] for world in worlds}
    for _ in range(args.rounds):
        for world in worlds:
            runs[world].append(measure(world, args.quick, patterns))
    results = {world: {name: statistics.median(r[name] for r in runs[world]) for name in patterns}
               for world in worlds}
    base = results[worlds[0]]
    rows = []
    print(f"{'pattern':<22} " + " ".join(f"{f'{w} rank' + ('s' if w > 1 else ''):>12}" for w in worlds)
          + f" {'efficiency':>11}")
    for name in patterns:
        last = results[worlds[-1]][name]
        # weak: the same time per step at every count is 100%; strong: n ranks n times faster is 100%
        efficiency = base[name] / last if name not in STRONG else base[name] / last / (worlds[-1] / worlds[0])
        rows.append({"pattern": name, "seconds": {w: results[w][name] for w in worlds}, "efficiency": efficiency,
                     "rounds": {w: [r[name] for r in runs[w]] for w in worlds},
                     "scaling": "strong" if name in STRONG else "weak"})
        print(f"{name:<22} " + " ".join(f"{results[w][name] * 1e3:>9.2f} ms" for w in worlds)
              + f" {efficiency:>10.0%}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = REPO / "benchmarks" / "results" / f"{stamp}-scaling.json"
    path.write_text(json.dumps({"quick": args.quick, "cores": cores, "rounds": args.rounds, "rows": rows}, indent=1))
    print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
