"""Training through compiled derivative programs: results that autograd can differentiate.

An Inductor program records no autograd graph. When a call needs one (grad is enabled and an
input requires grad: a PINN's parameters, closed over or passed), its outputs come from
:class:`Differentiable`, an ``autograd.Function`` whose

- forward is the compiled program itself, unchanged;
- backward is a second compiled program, the VJP of the derivative program, traced once per
  pattern of inputs that require grad. It recomputes the forward values it needs instead of
  keeping them from the forward call, so a training step holds no activations between the two;
- backward with ``create_graph=True`` (a gradient that is itself differentiated) runs the same
  derivative program eagerly under autograd, so double backward works as in the eager backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from hoad.passes.compile import eager_program, inductor_program


class Trainable:
    """What :class:`Differentiable` needs of one program: its compiled forward, its eager twin,
    and the compiled VJP programs built so far (one per set of inputs that require grad)."""

    def __init__(self, gm: fx.GraphModule, run: Callable, label: str):
        self.gm = gm
        self.run = run
        self.label = label
        self._eager: Callable | None = None
        self._vjps: dict[tuple[int, ...], tuple[Callable, list[int]]] = {}
        # inputs the program writes into (batch norm's running statistics): the recomputations
        # of the backward work on copies, so the forward call stays the only write
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.written = {placeholders.index(n.args[0]) for n in gm.graph.nodes
                        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
                        and n.args[0] in placeholders}

    @property
    def eager(self) -> Callable:
        if self._eager is None:
            self._eager = eager_program(self.gm)
        return self._eager

    def _private(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() if i in self.written else t for i, t in enumerate(inputs)]

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        return Differentiable.apply(self, *inputs)

    def vjp(self, inputs: Sequence[torch.Tensor], cotangents: Sequence[torch.Tensor],
            needs: tuple[int, ...]) -> tuple[Callable, list[int]]:
        """The compiled VJP program for the inputs at positions ``needs``, and which outputs it
        takes cotangents for (those that depend on them)."""
        if needs not in self._vjps:
            self._vjps[needs] = self._build_vjp(inputs, cotangents, needs)
        return self._vjps[needs]

    def _build_vjp(self, inputs, cotangents, needs) -> tuple[Callable, list[int]]:
        n = len(inputs)
        varying = _varying_outputs(self.eager, inputs, needs)

        def vjp(*args):
            primals = [a.detach().requires_grad_(i in needs) for i, a in enumerate(self._private(args[:n]))]
            with torch.enable_grad():
                outs = self.eager(*primals)
                grads = torch.autograd.grad([outs[k] for k in varying], [primals[i] for i in needs],
                                            list(args[n:]), allow_unused=True)
            return tuple(torch.zeros_like(primals[i]) if g is None else g for i, g in zip(needs, grads))

        examples = [t.detach() for t in inputs] + [cotangents[k].detach() for k in varying]
        gm = make_fx(vjp, tracing_mode="fake", _allow_non_fake_inputs=True)(*examples)
        return inductor_program(gm, examples, f"the backward of {self.label}"), varying


def _varying_outputs(eager: Callable, inputs: Sequence[torch.Tensor], needs: tuple[int, ...]) -> list[int]:
    """Outputs that depend on the inputs requiring grad (the others get no cotangent)."""
    with torch.enable_grad():
        fake = [t.detach().requires_grad_(i in needs) for i, t in enumerate(inputs)]
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            outs = eager(*[mode.from_tensor(t) for t in fake])
    return [k for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]


class Differentiable(torch.autograd.Function):
    """The outputs of a compiled program, differentiable with respect to its inputs."""

    @staticmethod
    def forward(ctx, program: Trainable, *inputs):
        outs = tuple(program.run(*inputs))
        ctx.program = program
        ctx.save_for_backward(*inputs)
        ctx.mark_non_differentiable(*[o for o in outs if not o.dtype.is_floating_point])
        return outs

    @staticmethod
    def backward(ctx, *cotangents):
        program: Trainable = ctx.program
        inputs = ctx.saved_tensors
        needs = tuple(i for i in range(len(inputs)) if ctx.needs_input_grad[i + 1])
        grads: list = [None] * len(inputs)
        if torch.is_grad_enabled():  # create_graph=True: the gradient must be differentiable itself
            # fresh aliases: gradients with respect to them count only the paths through this
            # program, not those that already join the inputs upstream (a prefix computes some
            # inputs from others), and stay connected to the inputs for the next differentiation
            primals = [t.view_as(t) if i in needs else t.detach() for i, t in enumerate(program._private(inputs))]
            outs = program.eager(*primals)
            pairs = [(o, c) for o, c in zip(outs, cotangents) if o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], [primals[i] for i in needs],
                                      [c for _, c in pairs], create_graph=True, allow_unused=True) if pairs else ()
        else:
            run, varying = program.vjp(inputs, cotangents, needs)
            got = run(*[t.detach() for t in inputs], *[cotangents[k] for k in varying])
        for i, g in zip(needs, got):
            grads[i] = g
        return (None, *grads)
