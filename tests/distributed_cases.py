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


def dtensor_programs(rank: int, world: int, samples: int = 9):
    """Programs called with DTensors: points sharded along the samples (uneven: 9 over 2 ranks),
    a replicated weight. Every result gathered (full_tensor), the weight's gradient of a loss
    on the sharded results, and the messages of the placements hoad refuses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    X = torch.rand(samples, 3, generator=torch.Generator().manual_seed(5), dtype=DT)
    W = torch.rand(3, 4, generator=torch.Generator().manual_seed(6), dtype=DT)
    Xd = distribute_tensor(X, mesh, [Shard(0)])
    Wd = distribute_tensor(W, mesh, [Replicate()]).requires_grad_()

    def u(x, w):
        return (x @ w).tanh().pow(2).sum(-1)

    out = {}
    res = hoad.compile(u, order=2, batch_dim=0)(Xd, Wd)
    out["placements"] = [str(res.value.placements[0]), str(res[0, 0].placements[0])]
    out["local rows"] = res.value.to_local().shape[0]
    out["value"], out["hessian"] = res.value.full_tensor().detach(), res[0, 0].full_tensor().detach()
    lap = hoad.laplacian(u, batch_dim=0)(Xd, Wd).laplacian
    out["laplacian"] = lap.full_tensor().detach()
    loss = (lap ** 2).mean().full_tensor()
    loss.backward()
    out["grad placement"] = str(Wd.grad.placements[0])
    out["grad"] = Wd.grad.full_tensor()
    replicated = hoad.compile(u, order=1)(distribute_tensor(X[0], mesh, [Replicate()]), W)
    out["replicated"] = (str(replicated[0].placements[0]), replicated[0].full_tensor())
    errors = {}
    for name, call in {
        "Shard(1)": lambda: hoad.compile(u, order=1, batch_dim=0)(distribute_tensor(X, mesh, [Shard(1)]), W),
        "no batch_dim": lambda: hoad.compile(u, order=1)(Xd, W),
    }.items():
        try:
            call()
            errors[name] = "no error"
        except hoad.HoadError as e:
            errors[name] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


class Classifier(nn.Module):
    def __init__(self, sizes=(4, 8, 8, 3)):
        super().__init__()
        torch.manual_seed(1)
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.Tanh()]
        self.net = nn.Sequential(*layers[:-1]).to(DT)

    def loss(self, X, y):
        return nn.functional.cross_entropy(self.net(X), y)


def classifier_data(n: int = 16, d: int = 4, classes: int = 3):
    g = torch.Generator().manual_seed(9)
    return torch.randn(n, d, generator=g, dtype=DT), torch.randint(0, classes, (n,), generator=g)


def split_hessian(rank: int, world: int, backend: str = "eager"):
    """A classifier loss's Hessian in its parameters, its blocks dealt to the ranks: each rank's
    own blocks, their owners, every block after gather(), and the refusal of another's block."""
    model = Classifier()
    X, y = classifier_data()
    cf = hoad.compile(model.loss, order=2, wrt=hoad.parameters, split_blocks=True, backend=backend)
    res = cf(X, y)
    keys = [k for k in res if len(k) == 2]
    out = {"owners": {k: res.owner(k) for k in keys}, "own": {k: res[k] for k in keys if res.owner(k) == rank},
           "gradient": {k: res[k] for k in res if len(k) == 1}}
    other = next(k for k in keys if res.owner(k) not in (None, rank))
    try:
        res[other]
        out["refusal"] = "no error"
    except hoad.DistributedError as e:
        out["refusal"] = str(e)
    out["gathered"] = {k: v for k, v in res.gather().order(2).items()}
    at_zero = res.gather(dst=0)
    held = []
    for k in keys:
        try:
            at_zero[k]
            held.append(k)
        except hoad.DistributedError:
            pass
    out["held after gather(dst=0)"] = held
    return out


def fsdp_pinn(mp_policy=None) -> nn.Module:
    """The PINN sharded by FSDP2, per layer and at the root."""
    from torch.distributed.fsdp import fully_shard

    model = PINN()
    options = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def whole(model: nn.Module) -> torch.Tensor:
    """Every parameter entry, gathered from its shards."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])


def boundary_points(rank: int) -> torch.Tensor:
    """Points where a boundary term calls the model itself (they require grad, as a user's may)."""
    return points(10 + rank).requires_grad_()


def with_boundary(model: nn.Module, lap, X: torch.Tensor, Xb: torch.Tensor) -> torch.Tensor:
    """The PINN loss with a boundary term from a plain forward of the model in the same step."""
    return ((lap(X) + source(X)) ** 2).mean() + (model(Xb).squeeze(-1) ** 2).mean()


def fsdp_training(rank: int, world: int, form: str, backend: str, accumulate: bool = False, boundary: bool = False):
    """The parameters after each step of the FSDP2-sharded PINN (gathered), and how many
    reduce-scatters FSDP ran in all (counted through its own custom-collective hook). With
    ``boundary`` the loss adds a term from a plain forward of the sharded model (:func:`with_boundary`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    scattered = [0]

    class Counted(DefaultReduceScatter):  # FSDP's own reduce-scatter, counted
        def __call__(self, *args, **kwargs):
            scattered[0] += 1
            return super().__call__(*args, **kwargs)

    model = fsdp_pinn()
    for m in model.modules():
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None:
            m.set_custom_reduce_scatter(Counted())
    lap = laplacian_of(form, model, backend)
    X = points(rank)
    with torch.no_grad():  # an inference call first: FSDP frees what it gathered, nothing is reduced
        lap(X)
    batches = [X[: POINTS // 2], X[POINTS // 2:]] if accumulate else [X]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    after = []
    for _ in range(STEPS):
        opt.zero_grad()
        for i, B in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)  # FSDP's no_sync
            loss = with_boundary(model, lap, B, boundary_points(rank)) if boundary else \
                ((lap(B) + source(B)) ** 2).mean()
            (loss / len(batches)).backward()
        opt.step()
        after.append(whole(model))
    return {"parameters": torch.stack(after), "scattered": scattered[0],
            "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters())}


def fsdp_forms(rank: int, world: int, backend: str, runs: list[dict]):
    out = {}
    for run in runs:
        options = dict(run)
        name = options.pop("name")
        options.pop("find_unused", None)
        try:
            out[name] = fsdp_training(rank, world, backend=backend, **options)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return out


def fsdp_hessian(rank: int, world: int, backend: str):
    """A classifier loss's parameter Hessian and gradient with the parameters sharded by FSDP2,
    whole and split over the ranks, beside the unsharded model's on this rank."""
    from torch.distributed.fsdp import fully_shard

    X, y = classifier_data()
    plain = Classifier()
    reference = hoad.compile(plain.loss, order=2, wrt=hoad.parameters, backend=backend)(X, y)
    model = Classifier()
    for layer in model.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    res = hoad.compile(model.loss, order=2, wrt=hoad.parameters, backend=backend)(X, y)
    split = hoad.compile(model.loss, order=2, wrt=hoad.parameters, split_blocks=True, backend=backend)(X, y)
    gathered = split.gather()
    return {"reference": {k: reference[k].detach() for k in reference}, "whole": {k: res[k].detach() for k in res},
            "split": {k: gathered[k].detach() for k in gathered},
            "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters())}


def sharded_later(rank: int, world: int, backend: str) -> dict:
    """An operator called on a plain model, the model then sharded by FSDP2 and the operator called
    again: the Laplacian before and after, and where the gradients of a loss on it land."""
    from torch.distributed.fsdp import fully_shard

    model = PINN()
    lap = hoad.laplacian(lambda X: model(X).squeeze(-1), batch_dim=0, backend=backend)
    X = points(rank)
    before = lap(X).laplacian.detach()
    for layer in model.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    after = lap(X).laplacian
    ((after + source(X)) ** 2).mean().backward()
    return {"before": before, "after": after.detach(),
            "gradients": [type(p.grad).__name__ for p in model.parameters() if p.grad is not None]}


def fsdp_refusals(rank: int, world: int, backend: str) -> dict:
    """What hoad says of FSDP2 uses it does not support: a mixed-precision policy, modules
    sharded as one group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    grouped = PINN()
    fully_shard([grouped.net[0], grouped.net[2]])
    fully_shard(grouped)
    for name, model in (("mixed precision", fsdp_pinn(MixedPrecisionPolicy(param_dtype=torch.float32))),
                        ("grouped", grouped)):
        try:
            hoad.laplacian(lambda X, m=model: m(X).squeeze(-1), batch_dim=0, backend=backend)(points(rank))
            out[name] = "no error"
        except hoad.HoadError as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def suite(rank: int, world: int, backend: str, runs: list[dict]):
    """Every pattern in one process group (one start-up for all): DDP and FSDP2 training in each
    form, DTensor arguments, a split parameter Hessian, one over FSDP2 shards; each part's result
    or error text."""
    out = {"ddp": ddp_forms(rank, world, backend, runs),
           "fsdp": fsdp_forms(rank, world, backend, [r for r in runs if r.get("find_unused", True)]
                              + [dict(name="with a plain forward", form="operator", boundary=True)])}
    for name, part in (("dtensor", lambda: dtensor_programs(rank, world)),
                       ("split", lambda: split_hessian(rank, world, backend)),
                       ("fsdp hessian", lambda: fsdp_hessian(rank, world, backend)),
                       ("fsdp refusals", lambda: fsdp_refusals(rank, world, backend)),
                       ("sharded later", lambda: sharded_later(rank, world, backend))):
        try:
            out[name] = part()
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return out


CASES = {"suite": suite}
