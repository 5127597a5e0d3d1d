"""One program for every number of samples: a ``batch_dim`` program whose sizes follow its input.

hoad builds programs for concrete shapes: the number of samples B appears as plain integers in
the arguments of views, expands and new tensors. Two builds of the same function at B1 and B2
samples differ only in those integers when the program's structure does not depend on B; each
such integer is then ``a·B``, a fixed multiple of the sample count (a block's leading dims are
B, or B times a product of fixed sizes; an integer that is not a multiple in both builds, such as
B + 1 or B², means the structure depends on B). :func:`generalize` checks that the two
programs are the same node for node and rewrites every differing integer as that expression of
the first batched input's ``size(0)``, so Inductor compiles it once with B as a symbol.
Only an argument that holds sizes (SymInt in the op's schema) may differ so: an integer operand
(``y / X.shape[0]``) is a value computed from B. Anything else that differs (a float, a folded
constant's shape or values, a different node) means the structure depends on B: there is no
general program and each size keeps its own. The second build takes the first's direction and
its layout choices by size (:class:`~hoad.algebra.target.Recorded`), which would part them
otherwise (a product run by hoad's kernel at 256 rows and by MKL at 200). (The pipeline also traces the
function at a third
count, since two counts may agree by chance on such a value; :func:`difference` says in words
where two programs part.)
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from hoad.passes.graph import size_arguments

aten = torch.ops.aten


class _Differs(Exception):
    """The two programs differ in more than B-dependent integers (the message says where)."""


def generalize(gm1: fx.GraphModule, b1: int, gm2: fx.GraphModule, b2: int, batched: int) -> fx.GraphModule | None:
    """``gm1`` (built for ``b1`` samples) with its sample-count integers read from placeholder
    ``batched``'s dim 0, or None when ``gm2`` (built for ``b2``) shows the structure depends on B."""
    try:
        rewrites = _matched(gm1, b1, gm2, b2) if b1 != b2 else None
    except _Differs:
        return None
    if rewrites is None:
        return None
    gm = fx.GraphModule(gm1, gm1.graph.__deepcopy__())
    nodes = dict(zip(gm1.graph.nodes, gm.graph.nodes))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1]):
        samples = gm.graph.call_function(aten.sym_size.int, (placeholders[batched], 0))
    expressions: dict[tuple[int, int], fx.Node] = {}

    def expression(a: int, c: int) -> fx.Node:
        if (a, c) not in expressions:
            with gm.graph.inserting_after(samples):
                node = samples if a == 1 else gm.graph.call_function(operator.mul, (samples, a))
                if c:
                    with gm.graph.inserting_after(node):
                        node = gm.graph.call_function(operator.add, (node, c))
            expressions[(a, c)] = node
        return expressions[(a, c)]

    for old, (args, kwargs) in rewrites.items():
        nodes[old].args, nodes[old].kwargs = _build((args, kwargs), nodes, expression)
    gm.graph.lint()
    gm.recompile()
    return gm


def difference(gm1: fx.GraphModule | None, b1: int, gm2: fx.GraphModule | None,
               b2: int) -> tuple[fx.Node | None, str] | None:
    """Where the two programs (for ``b1`` and ``b2`` samples) differ in more than sample-count
    sizes: the node of ``gm2`` and the difference in words; None where they do not."""
    if gm1 is None or gm2 is None:
        return None if gm1 is gm2 else (None, "one of them has a part computed from the parameters alone")
    try:
        _matched(gm1, b1, gm2, b2)
    except _Differs as e:
        return e.args[1], e.args[0]
    return None


def _matched(gm1: fx.GraphModule, b1: int, gm2: fx.GraphModule, b2: int) -> dict:
    """{node of gm1: its arguments with the sample-count integers as _Affine} for the nodes that
    have any; raises _Differs where the programs differ in more than those integers."""
    n1, n2 = list(gm1.graph.nodes), list(gm2.graph.nodes)
    if len(n1) != len(n2):
        raise _Differs(f"the program has {len(n1)} nodes at {b1} samples and {len(n2)} at {b2}", None)
    pairs = dict(zip(n1, n2))
    rewrites: dict[fx.Node, tuple] = {}
    for a, b in pairs.items():
        if a.op != b.op or (a.target != b.target and a.op != "placeholder"):  # (inputs by position)
            raise _Differs(f"node {a.name} is {_what(a)} at {b1} samples and {_what(b)} at {b2}", b)
        if a.op == "get_attr":
            if not _same_constant(_attr(gm1, a.target), _attr(gm2, b.target)):
                raise _Differs(f"the constant {a.target} differs between {b1} and {b2} samples", b)
            continue
        sizes = size_arguments(a.target) if a.op == "call_function" else frozenset()
        names = _argument_names(a.target) if a.op == "call_function" else []
        if len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
            raise _Differs(f"node {a.name} ({_what(a)}) takes other arguments at {b1} and {b2} samples", b)
        try:
            args = [_match(x, y, pairs, b1, b2, i < len(names) and names[i] in sizes)
                    for i, (x, y) in enumerate(zip(a.args, b.args))]
            kwargs = {k: _match(a.kwargs[k], b.kwargs[k], pairs, b1, b2, k in sizes) for k in a.kwargs}
        except _Differs as e:
            shown_1, shown_2, why = e.args
            raise _Differs(f"node {a.name} ({_what(a)}) takes {shown_1} at {b1} samples and {shown_2} at {b2}{why}",
                           b) from None
        if any(c for _, c in args) or any(c for _, c in kwargs.values()):
            rewrites[a] = (tuple(v for v, _ in args), {k: v for k, (v, _) in kwargs.items()})
    return rewrites


def _what(node: fx.Node) -> str:
    return node.op if node.op != "call_function" else getattr(node.target, "__name__", str(node.target))


class _Affine:
    """An integer that is ``a·B + c``."""

    __slots__ = ("a", "c")

    def __init__(self, a: int, c: int):
        self.a, self.c = a, c


def _match(x, y, pairs, b1, b2, size: bool):
    """(x with B-dependent integers replaced by _Affine, whether any was); raises _Differs(x, y,
    why). Only an argument that holds ``size``s may follow B: an integer operand (``y /
    X.shape[0]``) that differs is a value the program computes with, so the structure depends on B."""
    if isinstance(x, fx.Node):
        if not isinstance(y, fx.Node) or pairs.get(x) is not y:
            raise _Differs(_shown(x), _shown(y), "")
        return x, False
    if isinstance(x, bool) or not isinstance(x, (int, tuple, list, dict)):
        if type(x) is not type(y) or (x != y and not (isinstance(x, float) and x != x and y != y)):
            raise _Differs(_shown(x), _shown(y), "")
        return x, False
    if isinstance(x, int):
        if not isinstance(y, int) or isinstance(y, bool):
            raise _Differs(_shown(x), _shown(y), "")
        if x == y:
            return x, False
        if not size:
            raise _Differs(x, y, " (an operand computed from the number of samples, not a size)")
        # sizes of per-sample blocks are multiples of B (B, B·9, …): anything else (B + 1, B²)
        # is a structure that depends on B
        if x % b1 or y % b2 or x // b1 != y // b2:
            raise _Differs(x, y, " (a size that is no fixed multiple of the number of samples)")
        return _Affine(x // b1, 0), True
    if type(x) is not type(y) or len(x) != len(y):
        raise _Differs(_shown(x), _shown(y), "")
    if isinstance(x, dict):
        if x.keys() != y.keys():
            raise _Differs(_shown(x), _shown(y), "")
        out = {k: _match(x[k], y[k], pairs, b1, b2, size) for k in x}
        return {k: v for k, (v, _) in out.items()}, any(c for _, c in out.values())
    items = [_match(u, v, pairs, b1, b2, size) for u, v in zip(x, y)]
    return type(x)(v for v, _ in items), any(c for _, c in items)


def _shown(x) -> str:
    return f"node {x.name}" if isinstance(x, fx.Node) else repr(x)


def _argument_names(target) -> list[str]:
    schema = getattr(target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def _build(x, remap, expression):
    if isinstance(x, _Affine):
        return expression(x.a, x.c)
    if isinstance(x, fx.Node):
        return remap[x]
    if isinstance(x, dict):
        return {k: _build(v, remap, expression) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_build(v, remap, expression) for v in x)
    return x


def _attr(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _same_constant(u, v) -> bool:
    """Constants of the two builds are the same: their values too (``torch.tensor(float(B))``
    differs between counts and is no size)."""
    if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor):
        return (u.shape, u.dtype, u.device) == (v.shape, v.dtype, v.device) and bool(
            torch.equal(u, v) or (u.dtype.is_floating_point and torch.equal(u.isnan(), v.isnan())
                                  and torch.equal(u.nan_to_num(), v.nan_to_num())))
    return type(u) is type(v) and u == v
