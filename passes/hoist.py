"""Hoist: split off the part of a program that reads only the function's free tensors.

A function's closed-over weights are program inputs (read at every call), but derivative
programs compute a lot from them alone: W1ᵀ, products W1 ⊗ W1 of a first layer's remainders,
identity matrices. That part is split into a *prefix* program whose outputs become inputs of
the main one. The prefix runs again only when one of its tensors changed (another object, an
in-place update, new storage) or when autograd must see it; otherwise its outputs are reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from hoad.passes.cost import is_view
from hoad.passes.graph import pure

# Values larger than this are recomputed in the main program rather than kept between calls.
HOIST_LIMIT_BYTES = 64 * 2**20


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def hoistable(gm: fx.GraphModule, free: Sequence[fx.Node], samples: int | None = None) -> set[fx.Node]:
    """Nodes computed from ``free`` placeholders and constants alone, worth keeping between calls:
    layout-only ops (views) are left to the main program unless hoisted work reads them, and
    values over HOIST_LIMIT_BYTES stay computed there with everything that reads them. Under
    batch_dim a value made from constants alone with an axis of ``samples`` entries stays too (a
    seed spread over the samples): the one program for every count computes it at each count."""
    inside: set[fx.Node] = set()
    sources = set(free)
    reads_free = set(free)  # (a value of the weights may have as many rows as there are samples)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            sources.add(node)
        elif pure(node) and all(a in sources or a in inside for a in node.all_input_nodes):
            if any(a in reads_free for a in node.all_input_nodes):
                reads_free.add(node)
            elif samples is not None and samples in getattr(node.meta.get("val"), "shape", ()):
                continue
            if any(a in sources or a in inside for a in node.all_input_nodes):
                inside.add(node)
    changed = True
    while changed:
        changed = False
        for node in list(inside):
            big = _bytes(node) > HOIST_LIMIT_BYTES and any(u not in inside for u in node.users)
            idle = is_view(node) and all(u not in inside for u in node.users)
            if big or idle:
                inside.discard(node)
                changed = True
        for node in gm.graph.nodes:  # (in order) whatever reads a value left in the main program goes too
            if node in inside and any(a not in sources and a not in inside for a in node.all_input_nodes):
                inside.discard(node)
                changed = True
    return inside


def hoist(gm: fx.GraphModule, n_free: int, samples: int | None = None
          ) -> tuple[fx.GraphModule | None, fx.GraphModule, list[int]]:
    """Split ``gm`` (whose last ``n_free`` placeholders are free tensors) into ``(prefix, main,
    reads)``: ``prefix(*free[reads])`` returns the hoisted values, ``main(*inputs, *hoisted)`` the
    program's outputs. ``prefix`` is None (and ``main`` is ``gm``) when nothing is worth hoisting.
    ``samples``: the number under batch_dim (see :func:`hoistable`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    free = placeholders[len(placeholders) - n_free:] if n_free else []
    inside = hoistable(gm, free, samples)
    boundary = [n for n in gm.graph.nodes if n in inside and any(u not in inside for u in n.users)]
    if not boundary:
        return None, gm, []

    prefix_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    reads = [i for i, p in enumerate(free) if any(u in inside for u in p.users)]
    for i in reads:
        env[free[i]] = prefix_graph.placeholder(free[i].name)
        env[free[i]].meta = dict(free[i].meta)
    for node in gm.graph.nodes:
        if node in inside or (node.op == "get_attr" and any(u in inside for u in node.users)):
            env[node] = prefix_graph.node_copy(node, lambda a: env[a])
    prefix_graph.output(tuple(env[n] for n in boundary))
    prefix = fx.GraphModule(gm, prefix_graph)

    last = placeholders[-1]
    for k, node in enumerate(boundary):
        with gm.graph.inserting_after(last):
            ph = gm.graph.placeholder(f"hoisted_{k}_{node.name}")
        ph.meta = dict(node.meta)
        node.replace_all_uses_with(ph)
        last = ph
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return prefix, gm, reads


# Inputs of a prefix past this size (all together) are not copied: the prefix runs at every call.
MAX_KEPT_BYTES = 64 << 20


class Prefix:
    """Runs a prefix program when its inputs changed and otherwise returns its last outputs.

    Changed means another tensor object, a new version (any in-place update through autograd's
    view of it), or other values: a write through ``.data`` or numpy bumps no version, so the
    inputs are also compared with copies kept from the last run."""

    def __init__(self, run, reads: Sequence[int], first_free: int):
        self.run = run
        self.reads = list(reads)
        self.first_free = first_free        # where the free tensors start among the program inputs
        # (state key, the input objects, their copies, the outputs): replaced as one value, so a
        # thread never reads one call's key with another's outputs
        self._last: tuple = (None, (), (), ())

    def __call__(self, free: Sequence[torch.Tensor]) -> tuple:
        inputs = [free[i] for i in self.reads]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
        key = _state(inputs)
        last_key, held, copies, values = self._last
        if (needs_grad or key is None or key != last_key or any(a is not b for a, b in zip(inputs, held))
                or not all(_same_bits(a, c) for a, c in zip(inputs, copies))):
            values = tuple(self.run(*inputs))
            keep = not needs_grad and key is not None and sum(t.nbytes for t in inputs) <= MAX_KEPT_BYTES
            self._last = (key, tuple(inputs), tuple(t.detach().clone() for t in inputs), values) if keep \
                else (None, (), (), ())
        return values


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: torch.equal takes -0.0 for 0.0, which atan2 and copysign tell apart."""
    if a.dtype.is_floating_point and a.element_size() in _BITS and a.shape == b.shape and a.dtype == b.dtype:
        return torch.equal(a.view(_BITS[a.element_size()]), b.view(_BITS[b.element_size()]))
    return torch.equal(a, b)


def _state(tensors: Sequence[torch.Tensor]) -> tuple | None:
    """What tells that a tensor changed: its version counter and storage; None when a tensor
    has no version counter (inference mode), so nothing is reused."""
    try:
        return tuple((t._version, t.data_ptr()) for t in tensors)
    except RuntimeError:
        return None
