"""Compile: turn a derivative program into the callable a compiled function runs.

``eager``: the FX program itself, with ATen overload calls swapped for the public torch
functions that do the same thing. ``torch.ops.aten.mul.Tensor(a, b)`` goes through the
OpOverload dispatch path (~2.3 µs per call here); ``torch.mul(a, b)`` computes the same kernel
in ~1.2 µs, and small derivative programs are dominated by per-call overhead.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

aten = torch.ops.aten

# ATen overload -> public function with the same positional/keyword signature. Only used when
# the first argument is a tensor (torch.sub(1, t) is not valid Python API).
FAST = {
    aten.mul.Tensor: torch.mul, aten.add.Tensor: torch.add, aten.sub.Tensor: torch.sub, aten.div.Tensor: torch.div,
    aten.neg.default: torch.neg, aten.mm.default: torch.mm, aten.bmm.default: torch.bmm,
    aten.view.default: torch.Tensor.view, aten.permute.default: torch.permute, aten.expand.default: torch.Tensor.expand,
    aten.unsqueeze.default: torch.unsqueeze, aten.squeeze.dims: torch.squeeze, aten.select.int: torch.select,
    aten.clone.default: torch.clone, aten.cat.default: torch.cat, aten.where.self: torch.where,
    aten.exp.default: torch.exp, aten.log.default: torch.log, aten.sin.default: torch.sin, aten.cos.default: torch.cos,
    aten.tanh.default: torch.tanh, aten.sigmoid.default: torch.sigmoid, aten.sqrt.default: torch.sqrt,
    aten.rsqrt.default: torch.rsqrt, aten.reciprocal.default: torch.reciprocal, aten.abs.default: torch.abs,
    aten.relu.default: torch.relu, aten.erf.default: torch.erf, aten.pow.Tensor_Scalar: torch.pow,
    aten.pow.Tensor_Tensor: torch.pow, aten.amax.default: torch.amax, aten.constant_pad_nd.default: torch.constant_pad_nd,
}


def _fast_ok(node: fx.Node) -> bool:
    if node.target not in FAST or not node.args or not isinstance(node.args[0], (fx.Node, list, tuple)):
        return False
    if node.target is aten.sum.dim_IntList and not node.args[1]:
        return False
    return True


def eager_program(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose ATen calls go through the fast public bindings where identical."""
    fast = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for node in fast.graph.nodes:
        if node.op == "call_function" and _fast_ok(node):
            node.target = FAST[node.target]
    fast.recompile()
    return fast


def compile_program(program, backend: str):
    if backend == "eager":
        return eager_program(program.gm)
    raise NotImplementedError(backend)
