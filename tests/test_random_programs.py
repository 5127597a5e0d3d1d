"""Random small programs, every canonical block checked against nested torch.func in float64
(STYLE.md "Tests": property tests).

A program is data: input shapes and a list of steps ``v3 = op(v1, v2; params)`` over the nodes
drawn so far (inputs first), so hypothesis can shrink it and a failure prints a readable program.
Every step is written once, for a per-sample tensor with ``b`` leading batch axes left alone:
``b = 0`` is the function itself (and the per-sample function under ``batch_dim=0``), ``b = 1``
the batched function hoad compiles under ``batch_dim=0``, whose reference is ``vmap`` of the
per-sample one. Shapes are found while drawing by running the steps on meta tensors.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import string

import pytest
import torch
import torch.nn.functional as F
from helpers import DT, assert_close, rand, reference, reference_block
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.func import vmap

import hoad

MAX_INPUT_ENTRIES = 12  # per input (per sample)
MAX_NODE_ENTRIES = 24  # intermediates may grow a little (broadcasting, expand, cat, stack)
MAX_OUTPUT_ENTRIES = 12
MAX_RANK = 3

# times_one and neg_neg compute nothing new: prune removes them, which once lost the copy a later
# view of an expanded or transposed operand was traced on
UNARY = ["sin", "cos", "tanh", "sigmoid", "softplus", "exp_tanh", "square", "log1p_square", "times_one", "neg_neg"]
BINARY = ["add", "mul", "sub", "div_soft"]


# ------------------------------------------------------------------------------ the steps
def fixed_weight(rows, cols, seed):
    """A matmul step's weight. Made when the function is built, before any trace: one made while
    hoad traces would be a fake tensor."""
    return rand(rows, cols, seed=1000 * seed + 30 * cols + rows) / math.sqrt(rows)


def weight_shape(op, params, x):
    """(rows, cols) of the fixed weight a matmul step multiplies its operand ``x`` by."""
    if op == "matmul":
        return x.shape[-1], params[0]
    return params[0], x.shape[-2]


def _meta(shape):
    return torch.empty(shape, dtype=DT, device="meta")


def _aligned(x, y, b):
    """Per-sample broadcasting: pad the lower-rank operand with size-1 axes after the batch axes
    (plain broadcasting would align a batch axis with a sample axis)."""
    rx, ry = x.ndim - b, y.ndim - b
    if rx < ry:
        x = x.reshape(x.shape[:b] + (1,) * (ry - rx) + x.shape[b:])
    elif ry < rx:
        y = y.reshape(y.shape[:b] + (1,) * (rx - ry) + y.shape[b:])
    return x, y


def apply(op, params, xs, b, w=None):
    """One step on its operands ``xs``; sample axes start at ``b``; ``w`` the weight of a matmul."""
    x = xs[0]
    if op == "sin":
        return x.sin()
    if op == "cos":
        return x.cos()
    if op == "tanh":
        return x.tanh()
    if op == "sigmoid":
        return torch.sigmoid(x)
    if op == "softplus":
        return F.softplus(x)
    if op == "exp_tanh":  # exp of a bounded value
        return x.tanh().exp()
    if op == "square":
        return x * x
    if op == "log1p_square":
        return torch.log1p(x * x)
    if op == "times_one":
        return x * 1.0
    if op == "neg_neg":
        return -(-x)  # noqa: B002
    if op in BINARY:
        x, y = _aligned(x, xs[1], b)
        if op == "add":
            return x + y
        if op == "mul":
            return x * y
        if op == "sub":
            return x - y
        return x / (1 + y * y)
    if op in ("sum", "mean"):
        (dim,) = params  # None: every sample axis
        dims = tuple(range(b, x.ndim)) if dim is None else (dim + b,)
        if not dims:  # a per-sample scalar: nothing to reduce (x.sum(()) would sum the batch axis)
            return x * 1.0
        return x.sum(dims) if op == "sum" else x.mean(dims)
    if op == "softmax":
        (dim,) = params
        return torch.softmax(x, dim + b)
    if op == "matmul":  # x @ W over the last axis
        return x @ (torch.empty(weight_shape(op, params, x), dtype=DT, device="meta") if w is None else w)
    if op == "rmatmul":  # W @ x over the second-to-last axis of a per-sample matrix
        return (torch.empty(weight_shape(op, params, x), dtype=DT, device="meta") if w is None else w) @ x
    if op == "reshape":
        (shape,) = params
        return x.reshape(x.shape[:b] + shape)
    if op == "transpose":
        d0, d1 = params
        return x.transpose(d0 + b, d1 + b)
    if op == "unsqueeze":
        (dim,) = params
        return x.unsqueeze(dim + b)
    if op == "expand":  # a size-1 axis (new when ``new``) broadcast to ``size``
        dim, size, new = params
        if new:
            x = x.unsqueeze(dim + b)
        shape = list(x.shape)
        shape[dim + b] = size
        return x.expand(shape)
    if op == "cat":
        (dim,) = params
        return torch.cat([x, xs[1]], dim + b)
    if op == "stack":
        (dim,) = params
        return torch.stack([x, xs[1]], dim + b)
    if op == "index":  # advanced indexing with a fixed index (repeats allowed): aten.index.Tensor
        dim, index = params
        return x[(slice(None),) * (dim + b) + (list(index),)]
    if op == "index_select":
        dim, index = params
        return x.index_select(dim + b, torch.tensor(index, device=x.device))
    if op == "select":
        dim, i = params
        return x.select(dim + b, i)
    raise AssertionError(op)


# the names of each op's parameters (dims count sample axes: the batch axis is not one)
PARAMS = {
    "sum": ("dim",), "mean": ("dim",), "softmax": ("dim",), "matmul": ("cols", "seed"), "rmatmul": ("rows", "seed"),
    "reshape": ("shape",), "transpose": ("dim0", "dim1"), "unsqueeze": ("dim",), "expand": ("dim", "size", "new"),
    "cat": ("dim",), "stack": ("dim",), "index": ("dim", "index"), "index_select": ("dim", "index"),
    "select": ("dim", "i"),
}


@dataclasses.dataclass(frozen=True)
class Step:
    op: str
    args: tuple[int, ...]  # node numbers
    params: tuple = ()

    def __repr__(self):
        params = "".join(f", {name}={p!r}" for name, p in zip(PARAMS.get(self.op, ()), self.params))
        return f"{self.op}({', '.join(f'v{a}' for a in self.args)}{params})"


@dataclasses.dataclass(frozen=True)
class Case:
    shapes: tuple[tuple[int, ...], ...]  # per-sample input shapes
    steps: tuple[Step, ...]
    wrt: tuple[int, ...]
    order: int
    mode: str
    batch: int | None  # number of samples under batch_dim=0, None without
    diagonal: bool
    seed: int

    def __repr__(self):
        lines = [f"v{i}: input {tuple(s)}" for i, s in enumerate(self.shapes)]
        n = len(self.shapes)
        lines += [f"v{n + i} = {s!r}" for i, s in enumerate(self.steps)]
        options = (f"order={self.order}, wrt={self.wrt}, mode={self.mode!r}, batch_dim={0 if self.batch else None}"
                   f" (B={self.batch}), diagonal={self.diagonal}, seed={self.seed}")
        return "Case(\n    " + "\n    ".join(lines) + f"\n    return v{n + len(self.steps) - 1}\n    {options}\n)"

    def _repr_pretty_(self, p, cycle):  # hypothesis prints the program, not the dataclass fields
        p.text(repr(self))

    def function(self, b):
        nodes = [_meta(s) for s in self.shapes]  # per-sample shapes, to find each matmul's weight
        weights = []  # a list in f's closure: hoad finds the tensors it reads
        for s in self.steps:
            xs = [nodes[a] for a in s.args]
            matmul = s.op in ("matmul", "rmatmul")
            weights.append(fixed_weight(*weight_shape(s.op, s.params, xs[0]), s.params[1]) if matmul else None)
            nodes.append(apply(s.op, s.params, xs, 0))

        def f(*inputs):
            nodes = list(inputs)
            for s, w in zip(self.steps, weights):
                nodes.append(apply(s.op, s.params, [nodes[a] for a in s.args], b, w))
            return nodes[-1]

        return f

    def inputs(self):
        lead = (self.batch,) if self.batch else ()
        return tuple(torch.randn(lead + s, dtype=DT, generator=torch.Generator().manual_seed(self.seed * 10 + i))
                     for i, s in enumerate(self.shapes))


# --------------------------------------------------------------------------- the strategy
@st.composite
def shapes(draw):
    rank = draw(st.integers(0, 2))
    while True:
        shape = tuple(draw(st.integers(1, 4)) for _ in range(rank))
        if math.prod(shape) <= MAX_INPUT_ENTRIES:
            return shape


def _factorizations(n):
    out = [(), (n,)] if n == 1 else [(n,)]
    out += [(a, n // a) for a in range(1, n + 1) if n % a == 0]
    return out


@st.composite
def step_for(draw, nodes):
    """A step whose first operand is a recent node (shrinks toward a chain on the last one)."""
    a = len(nodes) - 1 - draw(st.integers(0, len(nodes) - 1))
    x = nodes[a]
    r = x.ndim
    kinds = {  # drawn kind first, then the op: every kind is drawn about as often
        "elementwise": UNARY,
        "binary": BINARY,
        "reduction": ["sum", "mean"] + ["softmax"] * (r >= 1),
        "contraction": ["matmul"] * (r >= 1) + ["rmatmul"] * (r >= 2),
        "layout": ["reshape", "expand", "unsqueeze"] + ["transpose"] * (r >= 2),
        "indexing": ["select", "index_select", "index"] if r >= 1 else [],
        "join": ["cat", "stack"] * (r >= 1),
    }
    ops = draw(st.sampled_from([ops for ops in kinds.values() if ops]))
    op = draw(st.sampled_from(ops))
    args, params = (a,), ()
    if op in BINARY or op in ("cat", "stack"):
        if op in BINARY:
            ok = lambda y: _broadcasts(x.shape, y.shape)  # noqa: E731
        elif op == "cat":
            ok = lambda y: y.ndim == r  # noqa: E731
        else:
            ok = lambda y: y.shape == x.shape  # noqa: E731
        partners = [i for i, y in enumerate(nodes) if ok(y)]  # includes a: a node used twice
        c = draw(st.sampled_from(partners[::-1]))
        if op == "cat":
            dims = [d for d in range(r) if x.shape[:d] + x.shape[d + 1:] == nodes[c].shape[:d] + nodes[c].shape[d + 1:]]
            if not dims:
                c, dims = a, list(range(r))
            params = (draw(st.sampled_from(dims)),)
        elif op == "stack":
            params = (draw(st.integers(0, r)),)
        args = (a, c)
    elif op in ("sum", "mean"):
        params = (draw(st.sampled_from([None, *range(r)])),)
    elif op in ("softmax", "select", "index", "index_select"):
        dim = draw(st.integers(0, r - 1))
        n = x.shape[dim]
        if op == "softmax":
            params = (dim,)
        elif op == "select":
            params = (dim, draw(st.integers(0, n - 1)))
        else:
            params = (dim, tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3))))
    elif op in ("matmul", "rmatmul"):
        params = (draw(st.integers(1, 3)), draw(st.integers(0, 9)))  # the weight's free size, its seed
    elif op == "reshape":
        target = draw(st.sampled_from(_factorizations(x.numel())))
        params = (target,)
    elif op == "transpose":
        d0, d1 = draw(st.sampled_from(list(itertools.combinations(range(r), 2))))
        params = (d0, d1)
    elif op == "unsqueeze":
        if r >= MAX_RANK:
            return None
        params = (draw(st.integers(0, r)),)
    elif op == "expand":
        ones = [d for d in range(r) if x.shape[d] == 1]
        new = not ones or draw(st.booleans())
        if new and r >= MAX_RANK:
            return None
        dim = draw(st.integers(0, r)) if new else draw(st.sampled_from(ones))
        params = (dim, draw(st.integers(2, 3)), new)
    step = Step(op, args, params)
    out = apply(op, params, [nodes[i] for i in args], 0)
    if out.numel() > MAX_NODE_ENTRIES or out.ndim > MAX_RANK:
        return None
    return step


def _broadcasts(s, t):
    return all(p == q or p == 1 or q == 1 for p, q in zip(reversed(s), reversed(t)))


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 3)) if draw(st.booleans()) else None  # samples under batch_dim=0
    shapes_ = tuple(draw(shapes()) for _ in range(draw(st.integers(1, 2))))
    nodes = [_meta(s) for s in shapes_]
    steps = []
    n_steps = draw(st.integers(2, 6))
    while len(steps) < n_steps:
        step = draw(step_for(nodes))
        if step is None:
            continue
        steps.append(step)
        nodes.append(apply(step.op, step.params, [nodes[i] for i in step.args], 0))
    if nodes[-1].numel() > MAX_OUTPUT_ENTRIES or draw(st.booleans()):
        step = Step("sum", (len(nodes) - 1,), (None,))  # a scalar output
        steps.append(step)
        nodes.append(apply(step.op, step.params, [nodes[-1]], 0))
    subsets = [w for n in range(len(shapes_), 0, -1) for w in itertools.combinations(range(len(shapes_)), n)]
    wrt = draw(st.sampled_from(subsets))
    order = draw(st.sampled_from([3, 2, 1, 4]))  # 3 first: 40 examples should be mostly order 3
    small = nodes[-1].numel() <= 4 and all(math.prod(shapes_[i]) <= 4 for i in wrt)
    if order == 4 and not small:
        order = 3
    return Case(
        shapes=shapes_,
        steps=tuple(steps),
        wrt=wrt,
        order=order,
        mode=draw(st.sampled_from(["forward", "reverse"])),
        batch=batch,
        diagonal=draw(st.booleans()),
        seed=draw(st.integers(0, 99)),
    )


# ------------------------------------------------------------------------- the reference
def _pure(block, out_rank, K, shapes_):
    """The entries of a dense block that ``diagonal=True`` keeps: the slots of one input share an
    index; each input appears once, in order of first appearance in ``K``."""
    letters = iter(string.ascii_letters)
    out = [next(letters) for _ in range(out_rank)]
    label = {k: next(letters) for k in dict.fromkeys(K)}
    flat = block.reshape(block.shape[:out_rank] + tuple(math.prod(shapes_[k]) for k in K))
    spec = "".join(out) + "".join(label[k] for k in K) + "->" + "".join(out) + "".join(label.values())
    return torch.einsum(spec, flat).reshape(block.shape[:out_rank] + tuple(s for k in label for s in shapes_[k]))


def reference_blocks(case):
    """{canonical key over input positions: expected block}, per sample under batch_dim."""
    f = case.function(0)

    def blocks(*args):
        ref = reference(f, args, case.wrt, case.order)
        out = {}
        for K, t in ref.items():
            key = tuple(case.wrt[k] for k in K)
            if case.diagonal:
                t = _pure(t, t.ndim - sum(args[k].ndim for k in key), key, [a.shape for a in args])
            out[key] = t
        return out

    return vmap(blocks)(*case.inputs()) if case.batch else blocks(*case.inputs())


def check_case(case):
    args = case.inputs()
    f = case.function(1 if case.batch else 0)
    cf = hoad.compile(f, order=case.order, wrt=case.wrt, mode=case.mode,
                      batch_dim=0 if case.batch else None, diagonal=case.diagonal)
    res = cf(*args)
    assert_close(res.value, f(*args), "value")
    ref = reference_blocks(case)
    assert sorted(res) == sorted(ref), f"keys {sorted(res)} != {sorted(ref)}"
    for key, expected in ref.items():
        assert_close(res[key], expected, f"block {key}")
    if not case.diagonal and len(case.wrt) > 1:  # non-canonical keys are permuted views
        samples = tuple(a[0] for a in args) if case.batch else args
        positions = {w: i for i, w in enumerate(case.wrt)}
        canonical = {tuple(positions[k] for k in key): t for key, t in ref.items()}
        for key in ref:
            if len(set(key)) > 1:
                rkey = key[::-1]
                expected = reference_block(canonical, tuple(positions[k] for k in rkey), samples, case.wrt)
                assert_close(res[rkey], expected, f"block {rkey}")


# ------------------------------------------------------------------------------ the tests
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


def count(case):
    """What the examples cover: pytest --hypothesis-show-statistics lists these."""
    for label in (f"order {case.order}", f"mode {case.mode}", f"batch_dim {case.batch is not None}",
                  f"diagonal {case.diagonal}", f"{len(case.wrt)} wrt of {len(case.shapes)}"):
        event(label)
    for s in case.steps:
        event(s.op)


@settings(max_examples=40, **SETTINGS)
@given(cases())
def test_random_programs_agree_with_torch_func(case):
    count(case)
    check_case(case)


@pytest.mark.slow
@settings(max_examples=400, **SETTINGS)
@given(cases())
def test_random_programs_agree_with_torch_func_many(case):
    count(case)
    check_case(case)


# Once a BatchCouplingError: a matmul that torch computes by merging the batch axis with a sample
# axis, (B, n, k) @ W -> view (B*n, k) -> mm -> view, or W @ (B, n, k, l) -> expand, view
# (B*n, m, k) -> bmm; hoad's sample pass (passes/samples.py) keeps the axes apart.
@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("shape, op", [((2, 2), "matmul"), ((2, 2, 1), "rmatmul"), ((2, 3, 2), "rmatmul")])
def test_matmul_merging_the_batch_axis(shape, op, mode):
    check_case(Case(shapes=(shape,), steps=(Step(op, (0,), (1, 0)),), wrt=(0,), order=1, mode=mode,
                    batch=3, diagonal=False, seed=0))


# Once a BatchCouplingError (index_rule left the batch axis untied): advanced indexing per sample.
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_index_under_batch_dim(mode):
    check_case(Case(shapes=((3,),), steps=(Step("index", (0,), (0, (0, 2))),), wrt=(0,), order=1, mode=mode,
                    batch=2, diagonal=False, seed=0))
