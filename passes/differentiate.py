"""The derivative transform: from a primal ATen graph, one program computing the value and every
canonical block of orders 1..N between the wrt inputs.

The transform is an interpreter over the primal graph that carries a :class:`Jet` per node and
asks the rule table for each node's blocks. Traced with ``make_fx``, the interpreter *is* the
derivative program: rules are plain torch, so their ops become the program's ATen nodes. Only
canonical multi-indices are ever requested (Schwarz), and absent blocks are structural zeros.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx

from hoad.blocks import Block
from hoad.errors import HoadError, HoadInternalError, UnsupportedOperatorError
from hoad.multiindex import MultiIndex, all_multi_indices, key_name
from hoad.rules import FAMILIES, PIECEWISE_CONSTANT, RULES, Ctx, Jet
from hoad.passes.capture import Captured, decomposition_table


@dataclass
class Program:
    """A derivative program: ``gm(*leaves) -> (value, *blocks)``, plus what each output holds."""

    gm: fx.GraphModule
    keys: list[MultiIndex]                 # canonical multi-index of each returned block
    zeros: list[MultiIndex]                # canonical multi-indices that are structural zeros
    order: int
    wrt_names: list[str]
    leaf_names: list[str]
    out_shape: tuple[int, ...]
    slot_shapes: list[tuple[int, ...]]
    stats: dict = field(default_factory=dict)


def differentiate(captured: Captured, order: int, where: Callable[[fx.Node], str] = lambda n: "") -> Program:
    """Build the forward derivative program of ``captured`` up to ``order``.

    ``where(node)`` describes the user's source line of a primal node, for error messages.
    """
    primal = captured.gm
    placeholders = [n for n in primal.graph.nodes if n.op == "placeholder"]
    leaves = [n.meta["val"] for n in placeholders]
    wrt_names = [captured.leaf_names[i] for i in captured.wrt_leaves]
    slot_shapes = [tuple(leaves[i].shape) for i in captured.wrt_leaves]
    all_keys = all_multi_indices(len(wrt_names), order)
    names: list[tuple[fx.Node, str]] = []
    result: dict = {}

    def program(*values):
        env: dict[fx.Node, object] = {}
        wrt_of = {leaf: k for k, leaf in enumerate(captured.wrt_leaves)}
        for i, node in enumerate(placeholders):
            k = wrt_of.get(i)
            t = values[i]
            env[node] = Jet(t, {(k,): Block.identity(t, t.shape)} if k is not None else None)
        for node in primal.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":
                env[node] = Jet(getattr(primal, node.target))
                continue
            if node.op != "call_function":
                raise HoadInternalError(f"unexpected {node.op} node {node.name} in a captured graph")
            if node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
                continue
            with fx_traceback.annotate({"hoad": node.name}):
                env[node] = _apply(node, env, order, slot_shapes, wrt_names, where, names)
        out = env[_output_arg(primal)]
        result["keys"] = [K for K in all_keys if K in out.blocks]
        result["zeros"] = [K for K in all_keys if K not in out.blocks]
        outputs = [out.primal]
        for K in result["keys"]:
            with fx_traceback.annotate({"hoad": "output"}):
                t = out.blocks[K].materialize()
            _remember(names, t, f"d{len(K)}_f_{key_name(K, wrt_names)}", "output")
            outputs.append(t)
        return tuple(outputs)

    with fx_traceback.preserve_node_meta():
        gm = make_fx(program, decomposition_table=decomposition_table(), tracing_mode="fake",
                     _allow_non_fake_inputs=True)(*leaves)
    _apply_names(gm, names, captured.leaf_names)
    return Program(gm, result["keys"], result["zeros"], order, wrt_names, list(captured.leaf_names),
                   captured.out_shape, slot_shapes)


def _apply(node: fx.Node, env: dict, order: int, slot_shapes, wrt_names, where, names) -> object:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    p_args, p_kwargs = fx.node.map_aggregate((args, kwargs), lambda a: a.primal if isinstance(a, Jet) else a)
    out = node.target(*p_args, **p_kwargs)
    jets = [a for a in _flat(args, kwargs) if isinstance(a, Jet) and a.blocks]
    if not jets or node.target in PIECEWISE_CONSTANT or not _differentiable(out):
        return _constant(out)
    rule = RULES.get(node.target)
    if rule is None:
        raise UnsupportedOperatorError(
            f"no derivative rule for {node.target} (node {node.name}){where(node)}. "
            "Add a rule to the matching family in hoad/rules/ (elementwise ops only need their scalar "
            "derivatives), or rewrite the function with supported ops; see the supported-op table in the README."
        )
    deps = sorted({k for j in jets for K in j.blocks for k in K})
    keys = tuple(K for K in all_multi_indices(len(slot_shapes), order) if set(K) <= set(deps))
    ctx = Ctx(keys, tuple(slot_shapes), out)
    try:
        with fx_traceback.annotate({"rule": rule.__name__}):
            blocks = rule(ctx, *args, **kwargs)
    except HoadError:
        raise
    except Exception as e:  # noqa: BLE001 - a rule failing is hoad's bug; name the node
        raise HoadInternalError(f"the {FAMILIES.get(node.target)} rule for {node.target} failed on node "
                                f"{node.name}{where(node)}: {type(e).__name__}: {e}") from e
    if isinstance(out, (tuple, list)):
        return tuple(Jet(o, _checked(b, o, ctx, node, names, wrt_names)) if isinstance(o, torch.Tensor) else o
                     for o, b in zip(out, blocks))
    return Jet(out, _checked(blocks, out, ctx, node, names, wrt_names))


def _checked(blocks: dict, out: torch.Tensor, ctx: Ctx, node: fx.Node, names, wrt_names) -> dict:
    kept = {}
    for K, b in blocks.items():
        if K not in ctx.keys:
            continue
        expected = tuple(out.shape) + ctx.slot_shape(K)
        if b.shape != expected:
            raise HoadInternalError(f"rule for {node.target} gave block {K} of shape {b.shape}, expected {expected}")
        kept[K] = b
        _remember(names, b.data, f"d{len(K)}_{node.name}_{key_name(K, wrt_names)}", node.name)
    return kept


def _differentiable(out) -> bool:
    if isinstance(out, torch.Tensor):
        return out.dtype.is_floating_point
    if isinstance(out, (tuple, list)):
        return any(_differentiable(o) for o in out)
    return False


def _constant(out) -> object:
    if isinstance(out, (tuple, list)):
        return tuple(Jet(o) if isinstance(o, torch.Tensor) else o for o in out)
    return Jet(out) if isinstance(out, torch.Tensor) else out


def _flat(args, kwargs) -> list:
    flat: list = []
    fx.node.map_aggregate((args, kwargs), lambda a: flat.append(a))
    return flat


def _output_arg(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


# -------------------------------------------------------------------------------- naming
def _remember(names: list, t: torch.Tensor, name: str, owner: str) -> None:
    """Note that the node computing ``t`` holds a block called ``name`` (if ``owner`` made it)."""
    mode = get_proxy_mode()
    if mode is None:
        return
    try:
        node = get_proxy_slot(t, mode.tracer).proxy.node
    except (KeyError, AttributeError, RuntimeError):
        return
    if node.op == "call_function" and node.meta.get("custom", {}).get("hoad") == owner:
        names.append((node, name))


def _apply_names(gm: fx.GraphModule, names: Sequence[tuple[fx.Node, str]], leaf_names: Sequence[str]) -> None:
    done: set = set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, leaf_names):
        node._rename(name)
        node.target = name
    for node, name in names:
        if node in done or node.graph is not gm.graph:
            continue
        done.add(node)
        node._rename(name)
        node.meta["hoad_block"] = name
    gm.recompile()
