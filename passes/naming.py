"""Readable names in a derivative program: placeholders named after the leaves, block nodes
after their blocks (``d2_y_x_w`` holds ∂²y/∂x∂w), and each node's :class:`NodeInfo` from the
tags the rules left while it was traced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

from hoad.algebra.multiindex import MultiIndex
from hoad.rules.base import NodeInfo


def _remember(names: list, t: torch.Tensor, name: str, owner: str, K: MultiIndex) -> None:
    """Note that the node computing ``t`` holds block ``K``, called ``name`` (if ``owner`` made it)."""
    mode = get_proxy_mode()
    if mode is None:
        return
    try:
        node = get_proxy_slot(t, mode.tracer).proxy.node
    except (KeyError, AttributeError, RuntimeError):
        return
    if node.op == "call_function" and node.meta.get("custom", {}).get("hoad") == owner:
        names.append((node, name, K))


def _apply_names(gm: fx.GraphModule, names: Sequence[tuple[fx.Node, str, MultiIndex]],
                 leaf_names: Sequence[str]) -> None:
    """Name the placeholders after the leaves and the block nodes after their blocks, and turn the
    tags rules left while tracing (``meta["custom"]``) into each node's :class:`NodeInfo`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, leaf_names):
        node._rename(name)
        node.target = name
    blocks: dict = {}
    for node, name, K in names:
        if node.graph is gm.graph and node not in blocks:
            blocks[node] = (name, K)
            node._rename(name)
    for node in gm.graph.nodes:
        tags = node.meta.pop("custom", None) or {}
        name, K = blocks.get(node, (None, None))
        if tags or name is not None:
            node.meta["hoad"] = NodeInfo(block=name, key=K, primal=tags.get("hoad"), rule=tags.get("rule"))
    gm.recompile()
