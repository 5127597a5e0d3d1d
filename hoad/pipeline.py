"""The pipeline, declared once: capture → differentiate → prune → clean → compile.

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

from hoad.passes.capture import CallLayout, Captured, capture, locate
from hoad.passes.clean import clean
from hoad.passes.differentiate import Program, differentiate
from hoad.passes.prune import prune

log = logging.getLogger(__name__)


@dataclass
class Config:
    order: int
    backend: str = "eager"
    mode: str = "auto"


@dataclass
class Build:
    """Everything one call signature's compilation produces."""

    fn: Callable
    layout: CallLayout
    tensors: Sequence[torch.Tensor]
    wrt_leaves: list[int]
    config: Config
    captured: Captured | None = None
    program: Program | None = None
    run: Callable | None = None
    stats: dict = field(default_factory=dict)


def _capture(b: Build) -> Build:
    b.captured = capture(b.fn, b.layout, b.tensors, b.wrt_leaves)
    return b


def _differentiate(b: Build) -> Build:
    b.program = differentiate(b.captured, b.config.order, where=lambda node: locate(b.fn, b.layout, b.tensors, node))
    return b


def _prune(b: Build) -> Build:
    b.program.gm = prune(b.program.gm)
    return b


def _clean(b: Build) -> Build:
    b.program.gm = clean(b.program.gm)
    return b


def _compile(b: Build) -> Build:
    if b.config.backend == "eager":
        b.run = b.program.gm
    else:
        from hoad.passes.compile import compile_program

        b.run = compile_program(b.program, b.config.backend)
    return b


PIPELINE: tuple[tuple[str, Callable[[Build], Build]], ...] = (
    ("capture", _capture),
    ("differentiate", _differentiate),
    ("prune", _prune),
    ("clean", _clean),
    ("compile", _compile),
)


def build(fn: Callable, layout: CallLayout, tensors: Sequence[torch.Tensor], wrt_leaves: list[int], config: Config) -> Build:
    b = Build(fn, layout, tensors, wrt_leaves, config)
    for name, stage in PIPELINE:
        start = time.perf_counter()
        b = stage(b)
        gm = b.program.gm if b.program is not None else (b.captured.gm if b.captured is not None else None)
        b.stats[name] = {"seconds": time.perf_counter() - start, "nodes": _count(gm)}
        log.debug("%s: %.3fs, %s nodes", name, b.stats[name]["seconds"], b.stats[name]["nodes"])
    return b


def _count(gm: fx.GraphModule | None) -> int | None:
    if gm is None:
        return None
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")
