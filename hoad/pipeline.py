"""The pipeline, declared once: capture → differentiate → prune → clean → choose → compile.

Each stage takes the :class:`Build` so far and returns it with its own product filled in; the
list :data:`PIPELINE` is the architecture. Per-stage node counts and times land in
``build.stats`` for :func:`hoad.explain`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from hoad.errors import InvalidArgumentError
from hoad.passes.capture import CallLayout, Captured, capture, locate
from hoad.passes.clean import clean
from hoad.passes.compile import compile_program
from hoad.passes.cost import estimate
from hoad.passes.differentiate import Program, differentiate
from hoad.passes.prune import prune

log = logging.getLogger(__name__)


@dataclass
class Config:
    order: int
    backend: str = "inductor"
    mode: str = "auto"          # "forward", "reverse", or "auto": build both, keep the cheaper
    batch_dim: int | None = None  # 0: dim 0 of the output and of every wrt input indexes samples
    diagonal: bool = False        # pure derivatives only (∂²/∂x_i², the diagonal of each block)

    @property
    def directions(self) -> tuple[str, ...]:
        return ("forward", "reverse") if self.mode == "auto" else (self.mode,)


@dataclass
class Build:
    """Everything one call signature's compilation produces."""

    fn: Callable
    layout: CallLayout
    tensors: Sequence[torch.Tensor]
    wrt_leaves: list[int]
    config: Config
    captured: Captured | None = None
    candidates: dict[str, Program] = field(default_factory=dict)
    program: Program | None = None
    run: Callable | None = None
    stats: dict = field(default_factory=dict)


def _capture(b: Build) -> Build:
    b.captured = capture(b.fn, b.layout, b.tensors, b.wrt_leaves)
    if b.config.batch_dim is not None:
        out = b.captured.out_shape
        if not out:
            raise InvalidArgumentError("batch_dim=0 needs an output whose dim 0 indexes the samples, but the function "
                                       "returns a scalar; return one value per sample (e.g. drop the final .sum())")
        for leaf in b.wrt_leaves:
            shape = tuple(b.tensors[leaf].shape)
            if not shape or shape[0] != out[0]:
                raise InvalidArgumentError(
                    f"batch_dim=0: wrt input {b.layout.names[leaf]!r} has shape {shape}, but the output has {out[0]} "
                    "samples along dim 0; every wrt input must have the same number of samples in dim 0")
    return b


def _differentiate(b: Build) -> Build:
    where = lambda node: locate(b.fn, b.layout, b.tensors, node)  # noqa: E731
    fused = b.config.backend == "inductor"
    b.candidates = {d: differentiate(b.captured, b.config.order, d, where=where, batch_dim=b.config.batch_dim,
                                     fused=fused, diagonal=b.config.diagonal)
                    for d in b.config.directions}
    return b


def _prune(b: Build) -> Build:
    for p in b.candidates.values():
        p.gm = prune(p.gm)
    return b


def _clean(b: Build) -> Build:
    for p in b.candidates.values():
        p.gm = clean(p.gm)
    return b


def _choose(b: Build) -> Build:
    """Keep the candidate with the lowest estimated cost (the only one unless mode="auto")."""
    for p in b.candidates.values():
        p.stats["cost"] = estimate(p.gm, b.config.backend)
    b.program = min(b.candidates.values(), key=lambda p: p.stats["cost"]["score"])
    b.stats["costs"] = {d: p.stats["cost"] for d, p in b.candidates.items()}
    b.stats["direction"] = b.program.direction
    return b


def _compile(b: Build) -> Build:
    b.run = compile_program(b.program, b.config.backend, example_inputs=b.tensors)
    if hasattr(b.run, "cache_hit"):
        b.stats["inductor"] = {"seconds": b.run.seconds, "cache_hit": b.run.cache_hit}
    return b


PIPELINE: tuple[tuple[str, Callable[[Build], Build]], ...] = (
    ("capture", _capture),
    ("differentiate", _differentiate),
    ("prune", _prune),
    ("clean", _clean),
    ("choose", _choose),
    ("compile", _compile),
)


def build(fn: Callable, layout: CallLayout, tensors: Sequence[torch.Tensor], wrt_leaves: list[int], config: Config) -> Build:
    b = Build(fn, layout, tensors, wrt_leaves, config)
    for name, stage in PIPELINE:
        start = time.perf_counter()
        b = stage(b)
        gms = [p.gm for p in b.candidates.values()] or ([b.captured.gm] if b.captured is not None else [])
        b.stats[name] = {"seconds": time.perf_counter() - start, "nodes": {d: _count(p.gm) for d, p in b.candidates.items()}
                         if b.candidates else _count(gms[0]) if gms else None}
        log.debug("%s: %.3fs, %s nodes", name, b.stats[name]["seconds"], b.stats[name]["nodes"])
    return b


def _count(gm: fx.GraphModule | None) -> int | None:
    if gm is None:
        return None
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")
