"""Training runs under torch.distributed for tests/test_distributed.py: each rank of a gloo process
group (spawned by the test) trains a Poisson PINN on its own collocation points and saves its
parameters; the test compares them with one process trained on the union of the points."""

from __future__ import annotations

import contextlib
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

import hoad

DT = torch.float64
STEPS, POINTS, LR = 3, 24, 0.1


class PINN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).to(DT)

    def forward(self, X):
        return self.net(X)

    @hoad.laplacian(batch_dim=0)
    def lap(self, X):  # the decorated-method form: ddp_model.module.lap(X)
        return self(X).squeeze(-1)


def points(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.rand(POINTS, 2, generator=g, dtype=DT)


def source(X):
    return (torch.pi * X).sin().prod(-1)


def laplacian_of(form: str, model: nn.Module, backend: str):
    """X -> Δu(X) for the model (a DDP module, or the plain one for the single-process run)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if form == "operator":
        op = hoad.laplacian(lambda X: model(X).squeeze(-1), batch_dim=0, backend=backend)
        return lambda X: op(X).laplacian
    if form == "module":  # the operator over the DDP module itself: one Laplacian per output entry
        op = hoad.laplacian(model, batch_dim=0, backend=backend)
        return lambda X: op(X).laplacian.squeeze(-1)
    if form == "compile":
        cf = hoad.compile(lambda X: model(X).squeeze(-1), order=2, batch_dim=0, diagonal=True, backend=backend)
        return lambda X: cf(X)[0, 0].sum(-1)
    if form == "method":
        return lambda X: inner.lap(X).laplacian
    raise ValueError(form)


def train(model: nn.Module, lap, batches: list[torch.Tensor], accumulate: int = 1, no_sync=None):
    """STEPS SGD steps on mean((Δu + f)²), each over ``accumulate`` micro-batches of the points (the
    first ones under ``no_sync`` when given); the parameters after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    after = []
    for _ in range(STEPS):
        opt.zero_grad()
        for i, X in enumerate(batches):
            quiet = no_sync() if no_sync is not None and i < len(batches) - 1 else contextlib.nullcontext()
            with quiet:
                (((lap(X) + source(X)) ** 2).mean() / len(batches)).backward()
        opt.step()
        after.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return torch.stack(after)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(rank: int, world: int, port: int, case: dict, out: str) -> None:
    """One rank: a gloo group on 127.0.0.1:port, the case's training, its parameters (or the
    error, as text) saved to ``out.<rank>``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HOAD_DEFAULT_BACKEND="eager")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = CASES[case["kind"]](rank, world, **case.get("options", {}))
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


def ddp_training(rank: int, world: int, form: str, backend: str, find_unused: bool = True,
                 accumulate: bool = False):
    """The parameters after each step, and how many gradient buckets DDP averaged in all."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = nn.parallel.DistributedDataParallel(PINN(), find_unused_parameters=find_unused)
    averaged = [0]

    def counted(state, bucket):  # DDP's own allreduce, counted
        averaged[0] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counted)
    X = points(rank)
    batches = [X[: POINTS // 2], X[POINTS // 2:]] if accumulate else [X]
    after = train(model, laplacian_of(form, model, backend), batches, no_sync=model.no_sync if accumulate else None)
    return {"parameters": after, "averaged": averaged[0]}


def ddp_forms(rank: int, world: int, backend: str, runs: list[dict]):
    """Several trainings in one process group (one start-up for all): {name: result or error text}."""
    out = {}
    for run in runs:
        options = dict(run)
        name = options.pop("name")
        try:
            out[name] = ddp_training(rank, world, backend=backend, **options)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(e).__name__}: {e}"
    return out


CASES = {"ddp": ddp_training, "ddp_forms": ddp_forms}
