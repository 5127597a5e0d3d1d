"""Data parallelism: a hoad program over a DDP or FSDP2 module keeps the wrapper's contract.

DDP averages gradients across ranks through hooks on its parameters' gradient accumulators, and
its reducer expects each forward to announce the backward that follows (``_pre_forward`` before
the module runs, ``_post_forward`` on its outputs). A derivative program reads the parameters at
every call but runs no module: traced once, DDP's forward ran at trace time only, so its reducer
met every later backward unannounced (measured: "Expected to mark a variable ready only once"
under the eager backend, parameters silently off by 8.5e-3 under Inductor).

So hoad traces the module DDP wraps (:func:`traced_as_module`: DDP's forward is bookkeeping and
communication, not maths), records which DDP modules the function called, and runs DDP's own
forward protocol around every call of the program (:func:`synchronized`): the reducer sees one
forward per call and averages the gradients the program's backward produces, exactly as after
``ddp_model(x)``. Nothing is home-made: the hooks, buckets, collectives and ``no_sync`` are
DDP's.

FSDP2 (``fully_shard``) the same way (:func:`gathered`): each sharded module's pre-forward
before a call (its parameters gathered, read by the program as by the module's forward), its
post-forward after, on the program's outputs (parameters freed again, FSDP's pre-backward hooks
on the outputs), and its hooks quiet while hoad traces. The gathers, frees and reduce-scatters
are FSDP's. A program that reads a module DDP wraps without calling DDP (a decorated method,
``ddp_model.module.lap(x)``) is found by its wrapper (:func:`wrappers_of`) and synchronised the
same way while gradients are on (under ``torch.no_grad()`` it runs no collective, as
``ddp_model.module(x)`` runs none).
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.utils._pytree as pytree

from hoad.errors import CaptureError, DistributedError

_LOCAL = threading.local()  # the DDP modules a capture in progress on this thread has called


def _ddp_class():
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


@contextlib.contextmanager
def traced_as_module(called: list):
    """While a capture traces on this thread, a ``DistributedDataParallel`` module runs the module
    it wraps, and is appended to ``called``; other threads' DDP calls are untouched (and FSDP2's
    hooks are quiet: :func:`quiet_hooks`)."""
    ddp = _ddp_class()
    patched = ddp is not None and not getattr(ddp.forward, "_hoad_traced", False)
    if patched:
        original = ddp.forward

        def forward(self, *inputs, **kwargs):
            records = getattr(_LOCAL, "stack", None)
            if not records:
                return original(self, *inputs, **kwargs)
            if self.mixed_precision is not None:
                raise CaptureError("the function calls a DistributedDataParallel module with mixed_precision=: hoad "
                                   "traces the module it wraps in its own dtype; cast the module instead "
                                   "(module.to(dtype)) and wrap it without mixed_precision")
            records[-1].append(self)
            return self.module(*inputs, **kwargs)

        forward._hoad_traced = True
        ddp.forward = forward
    try:
        with quiet_hooks(called):
            yield called
    finally:
        if patched:
            ddp.forward = original


@contextlib.contextmanager
def quiet_hooks(called: list | None = None):
    """FSDP2's forward hooks do nothing on this thread meanwhile, and the DDP modules a capture
    calls go to ``called``: a trace, or the function itself run eagerly inside a call whose
    parameters hoad has gathered (to tell its own errors)."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append([] if called is None else called)
    try:
        yield
    finally:
        stack.pop()


def record_nested(ddps: Sequence) -> None:
    """A program called inside another capture: the outer program calls its DDP modules too."""
    stack = getattr(_LOCAL, "stack", None)
    if stack:
        stack[-1].extend(ddps)


def is_data_parallel(obj) -> bool:
    """A DistributedDataParallel module."""
    ddp = _ddp_class()
    return ddp is not None and isinstance(obj, ddp)


def data_parallel_wrappers(objects: Iterable) -> list:
    """The ``DistributedDataParallel`` modules that wrap a module among ``objects`` (the objects a
    function reaches), and the FSDP2 states among them (:func:`fully_sharded`); nothing is looked
    at unless a process group is initialized (``objects`` is then read once)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return [], []
    objects = list(objects)
    return wrappers_of(objects), fully_sharded(objects)


def wrappers_of(objects: Sequence) -> list:
    """The ``DistributedDataParallel`` modules that wrap any module among ``objects``: DDP keeps
    the module it wraps in its ``_modules`` table, and nothing on the module points back (three
    scans of the garbage collector's objects, once per program built)."""
    ddp = _ddp_class()
    modules = [o for o in objects if isinstance(o, torch.nn.Module) and not isinstance(o, ddp)]
    if not modules:
        return []
    ids = {id(m) for m in modules}
    found: list = []
    # module <- its wrapper's _modules table <- the wrapper's __dict__ <- the wrapper (a hop fewer
    # where an object holds its attributes without a dict of their own)
    layer = [t for t in gc.get_referrers(*modules) if isinstance(t, dict) and any(id(v) in ids for v in t.values())]
    for _hop in range(2):
        if not layer:
            break
        referrers = gc.get_referrers(*layer)
        found += [o for o in referrers if isinstance(o, ddp) and id(o.module) in ids and o not in found]
        tables = {id(t) for t in layer}
        layer = [d for d in referrers if isinstance(d, dict) and any(id(v) in tables for v in d.values())]
    return found


# --------------------------------------------------------------- FSDP2 (fully_shard) modules
def fully_sharded(objects: Iterable) -> list:
    """The FSDP2 states of the modules sharded by ``fully_shard`` among ``objects`` (the objects a
    function reaches), each with its module, root first and then in module order, as FSDP's own
    forward meets them; the modules' hooks are made quiet while hoad traces (:func:`_quieted`).
    Refused: several modules sharded as one group, and a mixed-precision policy."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    found = [o for o in objects if isinstance(o, FSDPModule)]
    if not found:
        return []
    inner = {id(s) for m in found for s in m.modules() if s is not m}
    out: list = []
    for top in (m for m in found if id(m) not in inner):
        for module in top.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            if any(state is s for s, _m in out):
                continue
            name = type(module).__name__
            if len(state._modules) != 1:
                raise DistributedError(
                    f"the function reaches {name}, sharded by fully_shard together with other modules as one group "
                    "(fully_shard([a, b])); hoad runs FSDP's forward protocol around its program for modules sharded "
                    "one by one: call fully_shard on each module")
            policy = state._mp_policy
            if policy.param_dtype is not None or policy.reduce_dtype is not None or policy.output_dtype is not None:
                raise DistributedError(
                    f"the function reaches {name}, sharded by fully_shard with a MixedPrecisionPolicy; hoad traces "
                    "the module in its parameters' own dtype: cast the module instead (module.to(dtype) before "
                    "fully_shard) and shard it without mp_policy")
            _quieted(module, state)
            out.append((state, module))
    return out


def _quieted(module, state) -> None:
    """FSDP's forward hooks on ``module`` do nothing while hoad traces on the calling thread:
    hoad has gathered the parameters already, and what the hooks do around a module call
    (gather, free, hooks on the outputs) belongs around the program's call, not inside its trace."""
    for table, handle in ((module._forward_pre_hooks, state._pre_forward_hook_handle),
                          (module._forward_hooks, state._post_forward_hook_handle)):
        hook = table.get(handle.id)
        if hook is None or getattr(hook, "_hoad_quiet", False):
            continue

        def quiet(*args, _hook=hook, **kwargs):
            if getattr(_LOCAL, "stack", None):
                return None
            return _hook(*args, **kwargs)

        quiet._hoad_quiet = True
        table[handle.id] = quiet


class Gathered:
    """FSDP's forward protocol around one call of hoad's programs (:func:`gathered`): the
    programs' outputs, on which FSDP hangs its pre-backward hooks."""

    def __init__(self):
        self.opened: list = []
        self.outputs: list = []

    def open(self, states: Sequence) -> None:
        """Each state's pre-forward (its parameters gathered), once per call."""
        for state, module in states:
            if any(state is s for s, _m in self.opened):
                continue
            state._pre_forward(module, (), {})
            self.opened.append((state, module))

    def close(self, outputs: tuple) -> None:
        for state, module in reversed(self.opened):
            state._post_forward(module, (), outputs)


@contextlib.contextmanager
def gathered(states: Sequence):
    """A call on FSDP2-sharded modules: each module's pre-forward runs before the call (the
    parameters gathered: the program reads them, as the module's forward would), and its
    post-forward after, on the outputs of every program the call ran (the non-root parameters
    freed again, and FSDP's pre-backward hooks on the outputs). Their backward then gathers the
    parameters again and reduce-scatters their gradients, as after ``model(x)``."""
    stack = getattr(_LOCAL, "gathered", None)
    if stack is None:
        stack = _LOCAL.gathered = []
    call = Gathered()
    stack.append(call)
    try:
        call.open(states)
        yield call
    except BaseException:
        stack.pop()
        call.close(())
        raise
    stack.pop()
    call.close(tuple(call.outputs))


def enlist(states: Sequence) -> None:
    """States a build found that its call did not gather yet (a module sharded after the first
    call): gathered now, before the trace reads their parameters."""
    stack = getattr(_LOCAL, "gathered", None)
    if states and not stack:
        raise DistributedError("a function that reaches FSDP2-sharded modules was traced outside hoad's call of it; "
                               "call the hoad program itself (cf(x), op(x)), not its internals")
    if states:
        stack[-1].open(states)


def note_outputs(outs: Sequence) -> None:
    """A program's outputs, for the FSDP post-forward of the call in progress (if any)."""
    stack = getattr(_LOCAL, "gathered", None)
    if stack:
        # (a view's base: FSDP hangs its hooks where no in-place op on a view can drop them)
        bases = [t if t._base is None else t._base for t in outs if isinstance(t, torch.Tensor)]
        stack[-1].outputs.extend(t for t in bases if all(t is not o for o in stack[-1].outputs))


def synchronized(ddps: Sequence, run: Callable[[], tuple]) -> tuple:
    """``run()`` between DDP's ``_pre_forward`` and ``_post_forward`` of each module in ``ddps``
    (its outputs go through ``_post_forward``, as a DDP forward's do: unused-parameter search and
    the static graph's sink)."""
    for d in ddps:
        try:
            d._pre_forward()
        except RuntimeError as e:
            if "finished reduction in the prior iteration" not in str(e):
                raise
            raise DistributedError(
                "DistributedDataParallel did not get a gradient for every parameter in the last backward, so it "
                "could not finish averaging them. A loss of derivatives leaves some parameters out (a Laplacian "
                "never reaches the last layer's bias), and DDP needs to be told: wrap the model with "
                "DistributedDataParallel(model, find_unused_parameters=True). The last step's gradients were not "
                "all averaged across ranks") from e
    outs = run()
    for d in ddps:
        outs = tuple(d._post_forward(tuple(outs)))
    return outs


# ------------------------------------------------------------------------------ DTensor inputs
def has_dtensors(args: tuple, kwargs: dict) -> bool:
    """Whether a call passes DTensors (plain tensors alone, the usual call, are told apart at once)."""
    if all(type(a) is torch.Tensor for a in args) and all(type(v) is torch.Tensor for v in kwargs.values()):
        return False
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(leaf, DTensor) for leaf in pytree.tree_leaves((args, kwargs)))


class LocalCall:
    """A call with DTensor arguments as each rank's call on its local tensors.

    Supported placements, on a 1-D device mesh: ``Shard(0)`` along the samples (under
    ``batch_dim=0``: each rank differentiates its own samples, and results come back sharded the
    same way) and ``Replicate()`` (each rank holds the whole tensor; a weight, say). Plain tensors
    are every rank's own. Gradients flow back through ``to_local``/``from_local``: a replicated
    input's gradient is ``Partial`` when the results are sharded (each rank's share of the sum).
    """

    def __init__(self, args: tuple, kwargs: dict, batch_dim: int | None, names: Sequence[str]):
        from torch.distributed.tensor import DTensor, Partial, Replicate

        paths, self.spec = pytree.tree_flatten_with_path((args, kwargs))
        leaves = [leaf for _path, leaf in paths]
        named = [(_argument_name(path, names), leaf) for path, leaf in paths]
        given = [(name, leaf) for name, leaf in named if isinstance(leaf, DTensor)]
        self.mesh = given[0][1].device_mesh
        for name, d in given:
            if d.device_mesh != self.mesh:
                raise DistributedError(
                    f"the DTensor arguments live on different device meshes ({given[0][0]!r} on {self.mesh}, {name!r} "
                    f"on {d.device_mesh}): hoad runs one program per rank of one mesh; redistribute them onto one")
        if self.mesh.ndim != 1:
            raise DistributedError(f"the DTensor arguments live on a {self.mesh.ndim}-D device mesh; hoad runs each "
                                   "rank's program on a 1-D mesh: flatten it, or pass the local tensors")
        counts = set()
        for name, d in given:
            (p,) = d.placements
            if p.is_shard() and p.dim == 0 and d.ndim > 0:
                counts.add(d.shape[0])
            elif not p.is_replicate():
                raise DistributedError(
                    f"argument {name!r} is a DTensor placed as {p}; hoad runs each rank's program on DTensors sharded "
                    "along the samples (Shard(0), with batch_dim=0) or replicated (Replicate()). Redistribute it: "
                    "x.redistribute(mesh, [Shard(0)]) or [Replicate()]")
        self.sharded = bool(counts)
        if self.sharded and batch_dim is None:
            raise DistributedError("DTensor arguments sharded along dim 0 hold samples that each rank differentiates "
                                   "on its own: pass batch_dim=0 (per-sample blocks), or Replicate() the inputs")
        if len(counts) > 1:
            raise DistributedError(f"the arguments sharded along dim 0 hold different numbers of samples "
                                   f"{sorted(counts)}; batch_dim=0 needs one number")
        self.samples = counts.pop() if counts else None
        grad = [Partial()] if self.sharded else [Replicate()]
        local = [(leaf.to_local() if leaf.placements[0].is_shard() else leaf.to_local(grad_placements=grad))
                 if isinstance(leaf, DTensor) else leaf for leaf in leaves]
        self.args, self.kwargs = pytree.tree_unflatten(local, self.spec)

    def wrap(self, t: torch.Tensor) -> torch.Tensor:
        """A local result as a DTensor: sharded along the samples, or replicated."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not self.sharded:
            return DTensor.from_local(t, self.mesh, [Replicate()], run_check=False)
        t = t.contiguous()
        shape = (self.samples, *t.shape[1:])
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(t, self.mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)


def _argument_name(path, names: Sequence[str]) -> str:
    """The argument a leaf of ``(args, kwargs)`` belongs to, by name where the signature gives one."""
    top, key, *rest = path
    if top.idx == 0:
        name = names[key.idx] if key.idx < len(names) else f"argument {key.idx}"
    else:
        name = str(key.key)
    return name + pytree.keystr(tuple(rest))


# ------------------------------------------------------------------- blocks split over ranks
def check_split(split) -> None:
    """``split_blocks``: None/False, True (the default group) or a process group."""
    if split is None or split is False or split is True:
        return
    if not torch.distributed.is_available() or not isinstance(split, torch.distributed.ProcessGroup):
        raise DistributedError(f"split_blocks must be True (the default process group) or a "
                               f"torch.distributed ProcessGroup, got {type(split).__name__}")


def _group(split):
    return None if split is True else split


def share_of(split) -> tuple[int, int]:
    """(this rank, ranks) of the group the blocks are split over."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        raise DistributedError("split_blocks deals the blocks to the ranks of a process group, and none is "
                               "initialized: call torch.distributed.init_process_group first (torchrun sets it up)")
    group = _group(split)
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


class Split:
    """Which rank of a group holds each top-order block of a result (``split_blocks``)."""

    def __init__(self, split, owners: dict, rank: int):
        self.group = _group(split)
        self.owners = dict(owners)
        self.rank = rank

    def elsewhere(self, K) -> int | None:
        """The rank that holds block K when it is not this one's, else None."""
        owner = self.owners.get(K, self.rank)
        return None if owner == self.rank else owner

    def refuse(self, K, name) -> None:
        owner = self.elsewhere(K)
        if owner is not None:
            raise DistributedError(
                f"block {name} was computed on rank {owner} (split_blocks deals the top order's blocks to the "
                f"ranks, and this is rank {self.rank}): res.gather() on every rank brings every block to each, "
                f"res.gather(dst=r) to rank r only; res.owner(key) says where a block is")

    def gather(self, blocks: dict, shape, like: torch.Tensor, dst: int | None) -> dict:
        """Every block, each broadcast from its owner (a collective: every rank of the group calls
        it, in the same order); with ``dst`` only that rank keeps the others'."""
        out = dict(blocks)
        for K in sorted(self.owners):
            owner = self.owners[K]
            t = blocks[K] if owner == self.rank else like.new_empty(shape(K))
            src = owner if self.group is None else torch.distributed.get_global_rank(self.group, owner)
            with torch.no_grad():
                torch.distributed.broadcast(t.contiguous() if owner == self.rank else t, src=src, group=self.group)
            if dst is None or dst == self.rank:
                out[K] = t
        return out
