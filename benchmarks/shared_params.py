"""Per-sample derivatives with respect to parameters every sample shares (issue 47): each
sample's loss differentiated w.r.t. a model's parameters, at order 1 (per-sample gradients,
what DP-SGD clips) and order 2 (per-sample Hessians, influence functions and per-sample
curvature). hoad: ``batch_dim=0`` with the parameters in ``wrt``; torch.func: ``vmap`` of
``grad``/``hessian`` with the parameters unmapped, and ``torch.compile`` of it.

The answer is one tensor per canonical block, ``(B, *p)`` at order 1 and ``(B, *p, *q)`` for
each pair p ≤ q (in ``named_parameters()`` order) at order 2."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.operators import Way, _same, _with_mode

DT = torch.float64


class PerSampleLoss(nn.Module):
    """Each sample's cross-entropy against its label: one loss per sample. Spelled with
    logsumexp, as the formula is written out in most per-sample code."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, X, y):
        logits = self.net(X)
        return torch.logsumexp(logits, -1) - logits.gather(-1, y[:, None]).squeeze(-1)


class Attention(nn.Module):
    """A pre-norm transformer block on a sequence per sample (d_model 16, 2 heads): attention
    with its weights (the softmax path, which torch.func can differentiate forward), a tanh
    feed-forward of width 32, then a mean over the sequence into 5 classes."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 5)

    def forward(self, X):
        h = self.norm(X)
        X = X + self.attn(h, h, h, need_weights=True)[0]
        X = X + self.ff(X)
        return self.head(X.mean(1))


def _model(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """The model (float64) and its inputs' shape."""
    g = torch.Generator().manual_seed(47)
    with torch.random.fork_rng():
        torch.manual_seed(47)
        if kind == "mlp":
            net, shape = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 5)), (64, 10)
        elif kind == "cnn":
            net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3), nn.Tanh(), nn.Flatten(),
                                nn.Linear(4 * 4 * 4, 5))
            shape = (32, 1, 8, 8)
        else:
            net, shape = Attention(), (8, 5, 16)
    X = torch.randn(*shape, generator=g, dtype=DT)
    return PerSampleLoss(net.to(DT)), X


@dataclass
class SharedParamsProblem:
    """``model``'s per-sample loss at (X, y), differentiated w.r.t. the parameters ``names``."""

    kind: str
    order: int
    model: nn.Module
    X: torch.Tensor
    y: torch.Tensor
    names: list[str]
    operator: str = field(default="per-sample-params", init=False)

    def record(self) -> dict:
        P = sum(dict(self.model.named_parameters())[k].numel() for k in self.names)
        return {"operator": self.operator, "model": self.kind, "order": self.order, "samples": self.X.shape[0],
                "parameters": P, "dtype": str(self.X.dtype), "device": str(self.X.device)}

    def reference(self) -> dict[str, torch.Tensor]:
        return _torch_func(self, compiled=False)[0]()

    def answer(self, block: Callable) -> dict[str, torch.Tensor]:
        """{key: block(key)} over the canonical keys, ``block`` taking a tuple of names."""
        if self.order == 1:
            return {a: block((a,)) for a in self.names}
        return {f"{a}|{b}": block((a, b)) for i, a in enumerate(self.names) for b in self.names[i:]}

    def ways(self) -> list[Way]:
        return [
            Way("hoad", "hoad.compile(loss, wrt=params, batch_dim=0), inductor",
                lambda: _same(_hoad(self, "inductor"))),
            Way("hoad eager", "the same, eager", lambda: _same(_hoad(self, "eager"))),
            Way("torch.func", f"vmap({_transform(self)}, in_dims=(None, 0, 0))",
                lambda: _torch_func(self, compiled=False)),
            Way("torch.compile", f"torch.compile(vmap({_transform(self, compiled=True)}))",
                lambda: _torch_func(self, compiled=True), worker=True),
        ]


def shared_params_problem(kind: str, order: int, names: tuple[str, ...] | None = None) -> Callable:
    def build(device: str = "cpu", dtype: torch.dtype = DT) -> SharedParamsProblem:
        model, X = _model(kind)
        g = torch.Generator().manual_seed(48)
        y = torch.randint(0, 5, (X.shape[0],), generator=g)
        model = model.to(device=device, dtype=dtype)
        wrt = list(names) if names else [k for k, _ in model.named_parameters()]
        return SharedParamsProblem(kind, order, model, X.to(device=device, dtype=dtype), y.to(device), wrt)

    return build


def _transform(p: SharedParamsProblem, compiled: bool = False) -> str:
    return "grad" if p.order == 1 else "jacrev(jacrev)" if compiled else "hessian"


def _hoad(p: SharedParamsProblem, backend: str) -> Callable[[], dict]:
    import hoad

    cf = hoad.compile(p.model, order=p.order, wrt=p.names, batch_dim=0, backend=backend)

    def answer():
        with torch.no_grad():
            res = cf(p.X, p.y)
        return p.answer(lambda key: res[key])

    return _with_mode(answer, cf)


def _torch_func(p: SharedParamsProblem, compiled: bool):
    from torch.func import functional_call, grad, hessian, jacrev, vmap

    params = {k: v.detach() for k, v in p.model.named_parameters()}
    rest = {k: v for k, v in params.items() if k not in p.names}

    def one(mine, x, y):
        return functional_call(p.model, {**rest, **mine}, (x[None], y[None]))[0]

    # (torch.compile of vmap(hessian) through functional_call fails in torch 2.13 on a
    # fake-tensor assert in forward AD; the compiled peer differentiates twice in reverse)
    twice = jacrev(jacrev(one)) if compiled else hessian(one)
    step = vmap(grad(one) if p.order == 1 else twice, in_dims=(None, 0, 0))
    if compiled:
        step = torch.compile(step)
    mine = {k: params[k] for k in p.names}

    def answer():
        out = step(mine, p.X, p.y)
        return p.answer(lambda key: out[key[0]] if len(key) == 1 else out[key[0]][key[1]])

    return answer, answer


def workloads(Workload) -> list:
    """The issue's three models at orders 1 and 2 (the transformer w.r.t. its attention's input
    projection, the issue's case; the others w.r.t. every parameter)."""
    group = "8. per-sample derivatives w.r.t. shared parameters (issue 47)"
    rows = [  # (id, label, kind, order, names)
        ("mlp/grad", "per-sample gradients, 10-32-5 tanh classifier, 64 samples (517 params)", "mlp", 1, None),
        ("mlp/hessian", "per-sample Hessians, 10-32-5 tanh classifier, 64 samples (517 params)", "mlp", 2, None),
        ("cnn/grad", "per-sample gradients, 2-conv CNN on 8x8, 32 samples (513 params)", "cnn", 1, None),
        ("cnn/hessian", "per-sample Hessians, 2-conv CNN on 8x8, 32 samples (513 params)", "cnn", 2, None),
        ("attention/grad", "per-sample gradients, transformer block d16 h2, 8 sequences of 5 (every param)",
         "attention", 1, None),
        ("attention/hessian", "per-sample Hessians w.r.t. in_proj (weight, bias), transformer block, 8 sequences",
         "attention", 2, ("net.attn.in_proj_weight", "net.attn.in_proj_bias")),
    ]
    return [Workload(f"per-sample-params/{id_}", group, label, shared_params_problem(kind, order, names),
                     quick=id_ in ("mlp/grad", "mlp/hessian"))
            for id_, label, kind, order, names in rows]
