"""The memory plan of a derivative program: what its inputs, results and peak take, from the
shapes on its nodes, before it runs.

The peak comes from liveness over the program graph in execution order: a node's output is
allocated when it runs and freed after its last use; a view keeps its base alive instead of
allocating; the program's inputs are held by the caller throughout, its results to the end. It
is an estimate of what the eager program allocates: Inductor fuses elementwise chains and
usually stays below it.
"""

from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass

import torch
import torch.fx as fx

from hoad.passes.clean import storage_base
from hoad.passes.cost import is_view


@dataclass(frozen=True)
class MemoryPlan:
    """A program's estimated memory: its inputs, its results and the peak while it runs."""

    inputs: int    # bytes of the program's inputs (the caller's tensors, free tensors)
    results: int   # bytes of the program's outputs (the value and every stored block)
    peak: int      # estimated peak bytes while the program runs, inputs included

    def __str__(self) -> str:
        return f"inputs {human(self.inputs)}, results {human(self.results)}, estimated peak {human(self.peak)}"


def _bytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_bytes(x) for x in v)
    return 0


def _aliases(node: fx.Node) -> bool:
    """Whether a node's output shares its first input's memory (a view, or a tuple's element)."""
    return is_view(node) or (node.op == "call_function" and node.target is operator.getitem)


def memory_plan(gm: fx.GraphModule) -> MemoryPlan:
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    base: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        base[n] = base[first] if _aliases(n) and first is not None else n
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            b = base[a]
            last_use[b] = max(last_use.get(b, 0), position[n])
    inputs = sum(_bytes(n.meta.get("val")) for n in nodes if n.op == "placeholder")
    constants = sum(_bytes(n.meta.get("val")) for n in nodes if n.op == "get_attr")  # (folded: held throughout)
    out = gm.graph.output_node()
    # results that are views (an expanded block) take their base's memory, once
    results = sum(_bytes(b.meta.get("val")) for b in dict.fromkeys(base[a] for a in out.all_input_nodes))
    # results that are an input or a folded constant, or share another result's memory, are copied
    # as the program returns (hoad.passes.clean.own_outputs; the compile stage adds those copies)
    returned = [a for a in torch.utils._pytree.tree_leaves(out.args) if isinstance(a, fx.Node)]
    seen: set = set()
    copied = 0
    for a in returned:  # (own_outputs' own test)
        b = storage_base(a)
        if b.op in ("placeholder", "get_attr") or b in seen:
            copied += _bytes(a.meta.get("val"))
        seen.add(b)
    live = peak = inputs + constants
    frees: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n is out:
            live += copied
        if n.op == "call_function" and base[n] is n:
            size = _bytes(n.meta.get("val"))
            live += size
            end = last_use.get(n, i)  # an unused node is freed at once
            frees[end] = frees.get(end, 0) + size
        peak = max(peak, live)
        live -= frees.pop(i, 0)
    return MemoryPlan(inputs, results, peak)


# ----------------------------------------------------------------------------------- budget
# the share of the memory available when a program is built that one program may plan to use
BUDGET_SHARE = 0.8


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` now (CUDA: the driver's count; CPU: the kernel's MemAvailable),
    or None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def default_budget(device: torch.device) -> int | None:
    free = available_bytes(device)
    return None if free is None else int(BUDGET_SHARE * free)


def samples_that_fit(samples: int, result: float, peak: float, budget: float, shared: float = 0.0) -> int:
    """How many of ``samples`` one chunk may hold, for a program whose results take ``result`` and
    whose working memory ``peak`` per sample, beside ``shared`` bytes every chunk holds whatever
    its size (parameters, free tensors, hoisted terms): the joined results of every chunk (the last
    padded to a whole chunk) stay next to one chunk's program, whose peak per sample is not exact
    (a margin). The same answer whatever chunk size the program was built for, so advice is
    followed once."""
    def need(c: int) -> float:
        return result * c * math.ceil(samples / c) + shared + peak * c / 0.75

    room = budget - result * samples - shared
    c = min(samples, int(room / peak * 0.75)) if room > 0 and peak > 0 else samples if room > 0 else 0
    while c >= 1 and need(c) > budget:
        c -= 1
    return c


def human(n: float) -> str:
    """Bytes in binary units, named as such (a budget of 1e9 bytes is 953.7 MiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
