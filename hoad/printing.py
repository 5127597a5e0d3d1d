"""Readable listings of derivative programs: ``print(cf.graph)``."""

from __future__ import annotations

import torch
import torch.fx as fx


def _fmt(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return str(a)
    if isinstance(a, float):
        return repr(a)
    return repr(a)


def _op(target) -> str:
    name = str(target)
    if name.startswith(("aten.", "hoad.")):
        parts = name.split(".")
        return ".".join(parts[:2]) if parts[-1] in ("default", "Tensor", "int", "Scalar") else name
    return getattr(target, "__name__", name)


def _shape(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return "[" + ", ".join(str(s) for s in val.shape) + "]"
    if isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val):  # an op's outputs
        return "(" + ", ".join("[" + ", ".join(str(s) for s in v.shape) + "]" for v in val) + ")"
    return ""


def _comment(node: fx.Node) -> str:
    info = node.meta.get("hoad")
    text = info.describe() if info is not None else ""
    return f"  # {text}" if text else ""


def format_program(gm: fx.GraphModule, title: str = "program") -> str:
    """The program as Python-like text, one ATen call per line, with the block each line computes."""
    nodes = list(gm.graph.nodes)
    args = [n.name for n in nodes if n.op == "placeholder"]
    lines = [f"def {title}({', '.join(args)}):"]
    for n in nodes:
        if n.op == "call_function":
            arguments = [_fmt(a) for a in n.args] + [f"{k}={_fmt(v)}" for k, v in n.kwargs.items()]
            call = f"{_op(n.target)}({', '.join(arguments)})"
            lines.append(f"    {n.name}: {_shape(n)} = {call}{_comment(n)}")
        elif n.op == "get_attr":
            lines.append(f"    {n.name}: {_shape(n)} = <constant {n.target}>")
        elif n.op == "output":
            lines.append(f"    return {_fmt(n.args[0])}")
    return "\n".join(lines)


class ProgramView:
    """What ``cf.graph`` returns: prints as the program; ``.module`` is the fx.GraphModule."""

    def __init__(self, program, stats: dict | None = None):
        self.program = program
        self.module: fx.GraphModule = program.gm
        self.stats = stats or {}

    @property
    def nodes(self) -> int:
        """Number of ATen calls in the program."""
        return sum(1 for n in self.module.graph.nodes if n.op == "call_function")

    def passes(self) -> list[str]:
        """One line per pipeline stage: the ATen calls it left (the difference it made)."""
        lines, before = [], None
        for stage, st in self.stats.items():
            if not isinstance(st, dict) or "nodes" not in st or st["nodes"] is None:
                continue
            nodes = st["nodes"]
            count = nodes.get(self.program.direction) if isinstance(nodes, dict) else nodes
            if count is None:
                continue
            change = "" if before is None or stage == "differentiate" else f" ({count - before:+d})"
            lines.append(f"# {stage}: {count} ATen calls{change}, {st['seconds'] * 1e3:.0f} ms")
            before = count
        if self.stats.get("any_samples"):
            lines.append(f"# one program for every number of samples: the shapes shown are those of "
                         f"{self.stats.get('samples_shown') or 'the first'} samples (sym_size_int is the call's)")
        if self.program.prefix is not None:
            n = sum(1 for node in self.program.prefix.graph.nodes if node.op == "call_function")
            lines.append(f"# hoisted: {n} ATen calls on free tensors alone, rerun only when those change")
        return lines

    def __str__(self) -> str:
        p = self.program
        header = (f"# hoad derivative program: order {p.order}, wrt {', '.join(p.wrt_names)}, {p.direction}; "
                  f"returns value + {_count(len(p.keys), 'block')} ({_count(len(p.zeros), 'structural zero')} "
                  f"omitted); {self.nodes} ATen calls")
        return "\n".join([header, *self.passes(), format_program(self.module)])

    def __repr__(self) -> str:
        return f"<hoad program: order {self.program.order}, {self.nodes} ATen calls>"


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" if n == 1 else f"{n} {thing}s"
