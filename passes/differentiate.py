"""The derivative transform: from a primal ATen graph, one program computing the value and every
canonical block of orders 1..N between the wrt inputs.

The transform is an interpreter over the primal graph that carries a :class:`Jet` per node and
asks the rule table for each node's blocks. Traced with ``make_fx``, the interpreter *is* the
derivative program: rules are plain torch, so their ops become the program's ATen nodes. Only
canonical multi-indices are ever requested (Schwarz), and absent blocks are structural zeros.

Two directions, chosen per program:

- ``forward``: propagate blocks of orders 1..N through every node.
- ``reverse`` (the adjoint form, DESIGN §4): propagate orders 1..N-1 forward, run one
  first-order reverse sweep for the adjoints ḡ_v = ∂f/∂v (hoad's VJP rules), and get the top
  order as D^K f = Σ_v ⟨ḡ_v, R^K_v⟩, where the remainder R^K_v is what the node's own rule
  returns when its arguments' order-N blocks are left out (every term with a second or higher
  partial of the op). Linear ops have no remainder, so they cost nothing at the top order.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from hoad.algebra import EAGER_TARGET, Block, Lazy, Target, add, contract, force
from hoad.algebra.block import _canonical
from hoad.algebra.maps import select_out
from hoad.algebra.multiindex import MultiIndex, all_multi_indices, key_name, multi_indices
from hoad.errors import BatchCouplingError, HoadError, HoadInternalError, InvalidArgumentError, UnsupportedOperatorError
from hoad.passes.capture import Captured
from hoad.passes.decompositions import decomposition_table
from hoad.passes.naming import _apply_names, _remember
from hoad.passes.program import OperatorInputs, Program
from hoad.rules import FAMILIES, PIECEWISE_CONSTANT, RULES, VJPS, Ctx, Jet
from hoad.rules.base import Collapse, Contracted, VjpCtx, adjoint_labels, out_labels
from hoad.rules.flat import PRODUCTS, flat_of

DIRECTIONS = ("forward", "reverse")


class Overgrown(Exception):  # noqa: N818 - a signal to the build, never shown to a user
    """A transform stopped once its program had more ATen nodes than its ``node_limit``."""

    def __init__(self, nodes: int):
        super().__init__(f"{nodes} nodes")
        self.nodes = nodes


def differentiate(captured: Captured, order: int, direction: str = "forward",
                  where: Callable[[fx.Node], str] = lambda n: "", batch_dim: int | None = None,
                  target: Target = EAGER_TARGET, diagonal: bool = False,
                  operator: OperatorInputs | None = None, share: tuple[int, int] | None = None,
                  shared: frozenset = frozenset(), node_limit: Sequence[int] | None = None) -> Program:
    """Build the derivative program of ``captured`` up to ``order`` in the given direction.

    ``where(node)`` describes the user's source line of a primal node, for error messages.
    With ``batch_dim=0`` the blocks come back per sample: the output's first axis must stay
    tied (diagonal) to the first axis of every slot, else :class:`BatchCouplingError` names the
    op that coupled the samples; the slots at the wrt positions in ``shared`` (parameters every
    sample shares) have no sample axis, and their blocks carry the output's. With ``diagonal``
    only pure derivatives are computed: the slots of one wrt input share their labels, and each
    block comes back with one copy of its axes.
    ``target``: how products become ops on the machine that runs the program (its lowering),
    and the layout switches tests and nested programs use (see :class:`hoad.algebra.Target`).
    ``share=(rank, world)``: the top order's canonical blocks are dealt to ``world`` ranks,
    balanced by size (:func:`deal`), and the program returns this rank's only.
    ``node_limit``: raise :class:`Overgrown` as soon as the traced program has more nodes than
    ``node_limit[i]`` before the transform's i-th primal node, or would pass ``node_limit[i + 1]``
    within its rule (the last bound holds past the end): the build has a smaller program already,
    and this one is not going to beat it. The program's ``stats["traced"]`` gives the node counts
    before each primal node and at the end (what a limit is made from).
    """
    if direction not in DIRECTIONS:
        raise HoadInternalError(f"unknown direction {direction!r}")
    primal = captured.gm
    placeholders = [n for n in primal.graph.nodes if n.op == "placeholder"]
    leaves = [n.meta["val"] for n in placeholders]
    wrt_names = [captured.leaf_names[i] for i in captured.wrt_leaves]
    slot_shapes = [tuple(leaves[i].shape) for i in captured.wrt_leaves]
    if operator is not None and operator.directions is not None:
        n = leaves[operator.directions].shape[0]
        slot_shapes[0] = (slot_shapes[0][0], n) if batch_dim is not None else (n,)
    interp = _Interpreter(primal, captured.wrt_leaves, slot_shapes, wrt_names, order, where, batch_dim, diagonal,
                          operator, target, share, frozenset(shared), node_limit)
    run = interp.forward_program if direction == "forward" else interp.reverse_program
    try:
        with fx_traceback.preserve_node_meta():
            gm = make_fx(run, decomposition_table=decomposition_table(), tracing_mode="fake",
                         _allow_non_fake_inputs=True)(*leaves)
    except Overgrown:
        raise
    except Exception as e:  # noqa: BLE001 - hoad's own failure: name where it happened
        if interp.overgrown:  # (the bound was passed inside a rule, and the rule's errors wrapped the signal)
            raise Overgrown(interp.overgrown) from e
        if isinstance(e, HoadError):
            raise
        node = interp.current
        at = f" at node {node.name} ({node.target}){where(node)}" if node is not None else ""
        raise HoadInternalError(f"building the {direction} derivative program failed{at}: "
                                f"{type(e).__name__}: {e}") from e
    finally:
        if interp.watched is not None:  # (the graph's own create_node again, for the rewrites after)
            del interp.watched.create_node
    _apply_names(gm, interp.names, captured.leaf_names)
    slot_shapes = interp.slot_shapes if batch_dim is None else \
        [s if k in shared else s[1:] for k, s in enumerate(interp.slot_shapes)]
    return Program(gm, interp.keys, interp.zeros, order, direction, wrt_names, list(captured.leaf_names),
                   captured.out_shape, slot_shapes, stored=interp.stored, batch_dim=batch_dim, shared=frozenset(shared),
                   diagonal=diagonal,
                   operator=operator, owners=interp.owners, rank=share[0] if share else 0,
                   stats={"traced": (*interp.traced, len(gm.graph.nodes))})


def deal(sizes: dict[MultiIndex, int], ranks: int) -> dict[MultiIndex, int]:
    """Each block to a rank, largest first to the least loaded (the same on every rank)."""
    load = [0] * ranks
    owners = {}
    for K in sorted(sizes, key=lambda K: (-int(sizes[K]), K)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owners[K] = r
        load[r] += int(sizes[K])
    return owners


class _Interpreter:
    """Walks the primal graph with jets; its two ``*_program`` methods are what make_fx traces."""

    def __init__(self, primal: fx.GraphModule, wrt_leaves: Sequence[int], slot_shapes, wrt_names, order: int, where,
                 batch_dim: int | None = None, diagonal: bool = False, operator: OperatorInputs | None = None,
                 target: Target = EAGER_TARGET, share: tuple[int, int] | None = None, shared: frozenset = frozenset(),
                 node_limit: Sequence[int] | None = None):
        self.primal = primal
        self.node_limit = node_limit
        self.traced: list[int] = []  # the program's node count before each _apply
        self.watched = None  # (node_limit within a rule: the graph whose create_node counts)
        self.overgrown = 0  # the node count at which the bound stopped the trace inside a rule
        self.shared = shared
        self.share = share
        self.owners: dict[MultiIndex, int] = {}
        self.nodes = list(primal.graph.nodes)
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.output = next(n for n in self.nodes if n.op == "output").args[0]
        self.wrt_of = {leaf: k for k, leaf in enumerate(wrt_leaves)}
        self.slot_shapes = list(slot_shapes)
        self.wrt_names = list(wrt_names)
        self.order = order
        self.where = where
        self.batch_dim = batch_dim
        self.diagonal = diagonal
        self.deps = self._dependencies()
        self.names: list[tuple[fx.Node, str, MultiIndex]] = []
        self.keys: list[MultiIndex] = []
        self.zeros: list[MultiIndex] = []
        self.stored: dict[MultiIndex, int] = {}
        self.current: fx.Node | None = None   # the primal node being transformed, for errors
        self.operator = operator
        self.target = target
        self.collapse: Collapse | None = None  # made from the program's inputs when tracing starts
        self.seed_of: dict[int, Block] = {}

    # ------------------------------------------------------------------------- analysis
    def _dependencies(self) -> dict[fx.Node, frozenset]:
        """wrt positions each node depends on along differentiable paths."""
        deps: dict[fx.Node, frozenset] = {}
        for i, node in enumerate(self.placeholders):
            deps[node] = frozenset({self.wrt_of[i]}) if i in self.wrt_of else frozenset()
        live = self._live()
        complex_ = []  # complex values computed from a wrt input: kept in the flow until it is known
        for node in self.nodes:  # whether a derivative reaches the output through one
            if node.op != "call_function":
                deps.setdefault(node, frozenset())
                continue
            inputs = frozenset().union(*[deps.get(a, frozenset()) for a in node.all_input_nodes])
            if inputs and node in live and "val" not in node.meta:  # a rewrite's node: no dtype to go by
                raise HoadInternalError(f"node {node.name} ({node.target}) has no traced value (meta['val']); "
                                        "its derivatives would be taken as 0")
            if inputs and node in live and _complex(node.meta.get("val")) and node.target not in PIECEWISE_CONSTANT:
                complex_.append(node)
            elif node.target in PIECEWISE_CONSTANT or not _differentiable(node.meta.get("val")) or node not in live:
                inputs = frozenset()
            deps[node] = inputs
        if complex_:
            self._refuse_complex(deps, complex_)
        return deps

    def _refuse_complex(self, deps: dict, complex_: list) -> None:
        """Refuse a complex value a derivative flows through to the output; one computed under
        no_grad or detached (a constant to autograd) only loses its dependencies."""
        needed, todo = set(), [self.output] if isinstance(self.output, fx.Node) and deps.get(self.output) else []
        while todo:
            node = todo.pop()
            if node not in needed:
                needed.add(node)
                todo += [a for a in node.all_input_nodes if deps.get(a)]
        for node in complex_:
            if node in needed:
                raise UnsupportedOperatorError(
                    f"{node.target} (node {node.name}){self.where(node)} computes complex values from a "
                    "differentiated input; hoad differentiates real floating-point programs only. Write the "
                    "computation with real and imaginary parts as separate real tensors.")
            deps[node] = frozenset()
        for node in self.nodes:  # (what read only such values depends on nothing)
            if node.op == "call_function" and node not in complex_:
                inputs = frozenset().union(*[deps.get(a, frozenset()) for a in node.all_input_nodes])
                if deps.get(node) and not inputs:
                    deps[node] = frozenset()

    def _live(self) -> set:
        """Nodes the output depends on. Others (e.g. a batchnorm's running-stat update) are only
        replayed for their side effects; no derivative flows through them."""
        live, todo = set(), [self.output]
        while todo:
            node = todo.pop()
            if isinstance(node, fx.Node) and node not in live:
                live.add(node)
                todo.extend(node.all_input_nodes)
        return live

    def _keys(self, node: fx.Node, orders) -> tuple[MultiIndex, ...]:
        d = self.deps[node]
        return tuple(K for k in orders for K in multi_indices(len(self.slot_shapes), k) if set(K) <= d)

    # --------------------------------------------------------------------------- phases
    def _forward(self, values, max_order: int) -> dict:
        """Primal values and jets of orders 1..max_order for every node."""
        env: dict[fx.Node, object] = {}
        for i, node in enumerate(self.placeholders):
            t = values[i]
            k = self.wrt_of.get(i)
            env[node] = Jet(t, {(k,): self._seed(k, t)} if k is not None and max_order >= 1 else None,
                            varies=k is not None)
        for node in self.nodes:
            self.current = node
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":
                env[node] = Jet(getattr(self.primal, node.target))
            elif node.op != "call_function":
                raise HoadInternalError(f"unexpected {node.op} node {node.name} in a captured graph")
            elif node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
            else:
                with fx_traceback.annotate({"hoad": node.name}):
                    env[node] = self._apply(node, env, range(1, max_order + 1))
        return env

    def _bound(self) -> int:
        """The node count the trace may not pass now: ``node_limit`` at the next primal node."""
        return self.node_limit[min(len(self.traced), len(self.node_limit) - 1)]

    def _counted(self, graph: fx.Graph, create_node: Callable) -> Callable:
        """``graph.create_node`` stopping the trace (Overgrown) before the graph passes :meth:`_bound`."""

        def create(*args, **kwargs):
            if len(graph.nodes) + 1 > self._bound():  # (the node it would add)
                self.overgrown = len(graph.nodes) + 1
                raise Overgrown(self.overgrown)
            return create_node(*args, **kwargs)

        return create

    def _seed(self, k: int, t: torch.Tensor) -> Block:
        """∂x/∂t for the wrt input x = t's slots: the identity, or the operator's directions."""
        if k in self.seed_of:
            return self.seed_of[k]
        if k != 0 or self.operator is None or self.operator.directions is None:
            return Block.identity(t, t.shape, dense=self.target.dense_seeds)
        v = self.values[self.operator.directions].to(t.dtype)   # (S, *x) or (S, *x[1:])
        data = v.movedim(0, -1)
        if self.batch_dim is None:
            return Block.dense(data)
        r = t.ndim
        return _canonical(data.unsqueeze(0), [0] + list(range(1, r)) + [0, r],
                          tuple(t.shape) + (t.shape[0], v.shape[0]))

    def _operator_setup(self) -> None:
        """The collapse, with its weights read from the program's inputs (so they are live)."""
        op = self.operator
        if op is None or op.collapse is None:
            return
        axes = range(len(self.slot_shapes[0]))
        summed = [a for a in axes if a != 0] if self.batch_dim is not None else list(axes)
        weights = {}
        if op.weights is not None:
            (a,) = summed
            weights[(0, a)] = Block.dense(self.values[op.weights])
        self.collapse = Collapse(op.collapse, frozenset((0, a) for a in summed), weights)

    def _apply(self, node: fx.Node, env: dict, orders, adjoint=None):
        mode = get_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        nodes = len(graph.nodes) if graph is not None else 0
        if self.node_limit:
            if nodes > self._bound():
                raise Overgrown(nodes)
            # (and within its rule, against the next node's bound: one rule can multiply lazy sums
            # out into thousands of nodes)
            if graph is not None and graph is not self.watched:
                self.watched = graph
                graph.create_node = self._counted(graph, graph.create_node)
        self.traced.append(nodes)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        if adjoint is None:
            p_args, p_kwargs = fx.node.map_aggregate((args, kwargs), lambda a: a.primal if isinstance(a, Jet) else a)
            out = _primal(node.target, p_args, p_kwargs)
        else:
            out = _primal_of(env[node])
        keys = self._keys(node, orders)
        varies = bool(self.deps[node])
        if not keys:
            return _flat(_constant(out, varies), node, args, kwargs)
        rule = self._rule(RULES, node)
        ctx = Ctx(keys, tuple(self.slot_shapes), out, adjoint, self.diagonal, self.collapse, self.target,
                  self.batch_dim is not None, self.shared)
        blocks = self._call(rule, node, ctx, args, kwargs)
        with fx_traceback.annotate({"rule": rule.__name__}):  # (the lazy blocks forced here are the rule's)
            return self._finish(node, ctx, out, args, kwargs, blocks, varies, adjoint)

    def _finish(self, node: fx.Node, ctx: Ctx, out, args, kwargs, blocks, varies: bool, adjoint):
        if adjoint is not None:  # remainders: ⟨ḡ, R⟩ already (Contracted), or R over the node's axes
            return self._checked(blocks, out, ctx, node, remainders=True) if isinstance(blocks, dict) else blocks
        if isinstance(out, (tuple, list)):
            return tuple(Jet(o, self._checked(b, o, ctx, node), varies=varies and o.dtype.is_floating_point)
                         if isinstance(o, torch.Tensor) else o for o, b in zip(out, blocks))
        flat = flat_of(node, args, kwargs, out) if varies else None
        if flat is not None and node.target in PRODUCTS:  # a product meets the other side's inf there
            blocks = {K: select_out(b, out.ndim, ~flat) for K, b in blocks.items()}
        return Jet(out, self._checked(blocks, out, ctx, node), varies=varies, flat=flat)

    def _rule(self, table: dict, node: fx.Node):
        rule = table.get(node.target)
        if rule is None and getattr(node.target, "__name__", "") in ("cond", "while_loop", "map_impl", "scan"):
            raise UnsupportedOperatorError(
                f"torch.{node.target.__name__} (node {node.name}){self.where(node)} runs one of several subgraphs "
                "chosen by tensor values; hoad builds one derivative program for every input value. Compute both "
                "branches and pick with torch.where(condition, a, b)")
        if rule is None:
            how = ("Register one with hoad.register_elementwise (its scalar derivatives), hoad.register_linear (its "
                   "transpose) or hoad.register_rule" if getattr(node.target, "namespace", "aten") != "aten" else
                   "Rewrite the function with supported ops (see the supported-op table in docs/ops.md), or register a "
                   "rule with hoad.register_elementwise, hoad.register_linear or hoad.register_rule")
            raise UnsupportedOperatorError(f"no derivative rule for {node.target} (node {node.name})"
                                           f"{self.where(node)}. {how}.")
        return rule

    def _call(self, rule, node: fx.Node, ctx, args, kwargs):
        try:
            with fx_traceback.annotate({"rule": rule.__name__}):
                return rule(ctx, *args, **kwargs)
        except HoadError:
            raise
        except Exception as e:  # noqa: BLE001 - a rule failing is hoad's bug (or the user's); name the node
            if FAMILIES.get(node.target) == "user":
                raise InvalidArgumentError(
                    f"the rule registered for {node.target} failed on node {node.name}{self.where(node)}: "
                    f"{type(e).__name__}: {e}; check the functions given to hoad.register_*") from e
            raise HoadInternalError(f"the {FAMILIES.get(node.target)} rule {rule.__name__} for {node.target} failed on "
                                    f"node {node.name}{self.where(node)}: {type(e).__name__}: {e}") from e

    def _checked(self, blocks: dict, out: torch.Tensor, ctx: Ctx, node: fx.Node, remainders: bool = False) -> dict:
        """The rule's blocks for ``ctx.keys`` (a rule may give others: a user's linear rule maps every
        block of its input), shape-checked. Unevaluated (lazy) blocks stay so only while the node has a
        single user that can absorb them; order 1, which everything reads, is forced. ``remainders``:
        a reverse sweep's (see :meth:`reverse_program`), kept as they are."""
        shared = len(node.users) != 1 or node is self.output
        kept = {}
        for K, b in blocks.items():
            if K not in ctx.keys:
                continue
            if remainders and isinstance(b, Contracted):
                kept[K] = b
                continue
            expected = tuple(out.shape) + ctx.slot_shape(K)
            if not isinstance(b, (Block, Lazy)) or b.shape != expected:
                error = InvalidArgumentError if FAMILIES.get(node.target) == "user" else HoadInternalError
                raise error(f"rule for {node.target} gave block {K} = {b!r}, expected a Block of shape {expected}")
            if remainders:
                kept[K] = b
                continue
            if isinstance(b, Lazy) and (shared or len(K) == 1):
                b = b.force()
            kept[K] = b
            if isinstance(b, Block):
                _remember(self.names, b.data, f"d{len(K)}_{node.name}_{key_name(K, self.wrt_names)}", node.name, K)
        return kept

    def _adjoints(self, env: dict, f: torch.Tensor) -> dict:
        """First-order reverse sweep: ḡ_v = ∂f/∂v for every node f depends on through wrt inputs.

        Each adjoint has the node's axes first, then f's axes (a batch of cotangents, one per
        entry of f), seeded with the identity of f.
        """
        adj: dict[fx.Node, object] = {self.output: Block.identity(f, tuple(f.shape), dense=self.target.dense_seeds)}
        owner = {id(v): n for n, v in env.items() if isinstance(v, Jet)}
        for node in reversed(self.nodes):
            self.current = node
            g = adj.get(node)
            if g is None or node.op != "call_function" or not self.deps[node] or _empty(env[node]):
                continue  # an empty result has no entries to pass a cotangent back through
            if node.target is operator.getitem:
                parent, i = node.args
                slots = adj.setdefault(parent, [None] * len(env[parent]))
                slots[i] = g if slots[i] is None else add([slots[i], g])
                continue
            vjp = self._rule(VJPS, node)
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            with fx_traceback.annotate({"hoad": node.name}):
                pairs = self._call(vjp, node, VjpCtx(_primal_of(env[node]), self.target), (g,) + tuple(args), kwargs)
            for jet, ga in pairs:
                src = owner.get(id(jet))
                if src is None or not self.deps.get(src):
                    continue
                if jet.flat is not None and getattr(env[node], "flat", None) is not None:
                    # the cotangent of a flat entry meets nothing that varies: make it 0, not the
                    # 0 · inf of a product with a value that is infinite there (see hoad.rules.flat)
                    ga = select_out(ga, jet.ndim, ~jet.flat)
                adj[src] = ga if src not in adj else add([adj[src], ga])
        return adj

    # ---------------------------------------------------------------------------- programs
    def forward_program(self, *values):
        self.values = values
        self._operator_setup()
        env = self._forward(values, self.order)
        out = env[self.output]
        return self._outputs(out.primal, out.blocks)

    def reverse_program(self, *values):
        """Orders < N forward, one adjoint sweep, then every order of f from the adjoints:
        order 1 is ḡ at the inputs, order k >= 2 is Σ_v ⟨ḡ_v, R^k_v⟩ with jets cut below k.
        Forward jets are thus only built where a remainder reads them; in particular none
        flow past the last nonlinear node to the output."""
        self.values = values
        self._operator_setup()
        env = self._forward(values, self.order - 1)
        f = env[self.output].primal
        adj = self._adjoints(env, f)
        rf = f.ndim
        blocks: dict[MultiIndex, Block] = {}
        for i, node in enumerate(self.placeholders):
            k = self.wrt_of.get(i)
            if k is not None and node in adj:
                g = adj[node]
                r = g.ndim - rf
                seed = self._seed(k, env[node].primal)
                if seed.unit:  # the identity: a relabelling
                    blocks[(k,)] = g.permute(list(range(r, g.ndim)) + list(range(r)))
                else:  # ∂f/∂t = ḡ · ∂x/∂t
                    xl, fl = out_labels(r), adjoint_labels(rf)
                    tl = [("t", a) for a in range(seed.ndim - r)]
                    blocks[(k,)] = contract([(g, xl + fl), (seed, xl + tl)], fl + tl, target=self.target)
        for k in range(2, self.order + 1):
            below = env if k == self.order else _truncated(env, k)
            parts: dict[MultiIndex, list] = {}
            for node in self.nodes:
                self.current = node
                g = adj.get(node)
                if not isinstance(g, Block) or node.op != "call_function" or node.target is operator.getitem:
                    continue
                with fx_traceback.annotate({"hoad": node.name}):
                    rem = self._apply(node, below, [k], adjoint=g)
                if not isinstance(rem, dict):  # no order-k keys here, or a multi-output (linear) op
                    continue
                for K, b in rem.items():
                    parts.setdefault(K, []).append(self._contracted(b, g, rf))
            blocks.update((K, add(bs)) for K, bs in parts.items())
        return self._outputs(f, blocks)

    def _contracted(self, b, g: Block, rf: int) -> Block:
        """⟨ḡ, R⟩ over the node's axes (the combinators usually did it already)."""
        if isinstance(b, Contracted):
            return b.block
        r = g.ndim - rf
        o, fo = out_labels(r), adjoint_labels(rf)
        slots = [("s", a) for a in range(b.ndim - r)]
        return contract([(g, o + fo), (b, o + slots)], fo + slots, target=self.target)

    def _outputs(self, value: torch.Tensor, blocks: dict) -> tuple:
        all_keys = all_multi_indices(len(self.slot_shapes), self.order)
        blocks = {K: force(b) for K, b in blocks.items()}
        self.keys = [K for K in all_keys if K in blocks]
        self.zeros = [K for K in all_keys if K not in blocks]
        if self.share is not None:  # (the others' top-order blocks: not returned, so never computed)
            rank, world = self.share
            dense = {K: math.prod(math.prod(self.slot_shapes[k]) for k in K) for K in self.keys if len(K) == self.order}
            self.owners = deal(dense, world)  # (by the slots' sizes: static, where a sample count may not be)
            self.keys = [K for K in self.keys if self.owners.get(K, rank) == rank]
        self.stored = {K: blocks[K].numel for K in self.keys}
        outputs = [value]
        for K in self.keys:
            with fx_traceback.annotate({"hoad": "output"}):
                t = self._output_block(blocks[K], K, value.ndim)
                if t.dtype != value.dtype and t.dtype.is_floating_point:  # every block in the value's dtype
                    t = t.to(value.dtype)
            _remember(self.names, t, f"d{len(K)}_f_{key_name(K, self.wrt_names)}", "output", K)
            outputs.append(t)
        return tuple(outputs)

    # ------------------------------------------------------------------ batch_dim, diagonal
    def _kept_groups(self, K: MultiIndex, r: int) -> list[list[int]]:
        """Dense axes of block K returned as one: under batch_dim the output's first axis with
        each slot's first (the sample), under diagonal the same axis of every slot of one wrt
        input (the pure derivative ∂^m/∂x_i^m)."""
        ranks = Ctx((), tuple(self.slot_shapes), None, None, self.diagonal, self.collapse).slot_ranks(K)
        offsets, at = [], r
        for n in ranks:
            offsets.append(at)
            at += n
        groups: list[list[int]] = []
        if self.diagonal:
            for k in sorted(set(K)):
                ps = [p for p in range(len(K)) if K[p] == k]
                groups += [[offsets[p] + t for p in ps] for t in range(ranks[ps[0]])] if len(ps) > 1 else []
        if self.batch_dim is not None:
            sample = [0] + [at for at, k in zip(offsets, K) if k not in self.shared]
            groups = [g for g in groups if not set(g) & set(sample)] + [sorted(set(sample).union(
                *[g for g in groups if set(g) & set(sample)]))]
        return groups

    def _output_block(self, blk: Block, K: MultiIndex, r: int) -> torch.Tensor:
        groups = self._kept_groups(K, r)
        if self.batch_dim is not None and blk.shape[0] > 1:
            sample = groups[-1]
            if len({blk.dims[a] for a in sample}) != 1:
                raise self._coupling_error()
        return blk.materialize(groups)

    def _coupling_error(self) -> BatchCouplingError:
        """Name the first op whose first-order blocks stop keeping samples apart."""
        env = self._forward(self.values, 1)
        ok: dict[fx.Node, bool] = {}
        for node in self.nodes:
            v = env.get(node)
            if not isinstance(v, Jet) or not v.blocks:
                continue
            tied = all(b.dims[v.ndim] is not None and b.dims[v.ndim] in b.dims[:v.ndim]
                       for K, b in v.blocks.items() if K[0] not in self.shared)
            parents_ok = all(ok.get(a, True) for a in node.all_input_nodes)
            ok[node] = tied and parents_ok
            if parents_ok and not tied and node.op == "call_function":
                user = (" A rule registered by hoad.register_linear acts on all of x's dims unless told: "
                        "register_linear(op, transpose, acts_on=k) for an op acting on the last k only."
                        if FAMILIES.get(node.target) == "user" else
                        " If it comes from a Python loop over the samples (for x in X, X.unbind(0)), which takes "
                        "them apart and joins them again, write the function for a batch, or map the per-sample "
                        "function with torch.vmap inside it." if getattr(node.target, "overloadpacket", None) in
                        _SAMPLE_LOOP_OPS else "")
                return BatchCouplingError(
                    f"batch_dim=0 promises that samples are independent, but {node.target} (node {node.name})"
                    f"{self.where(node)} mixes entries along the batch axis. Derivatives of such a function are "
                    "not per-sample: drop batch_dim to get the full blocks, or make the function act on each "
                    f"sample separately (e.g. eval-mode batchnorm, attention within a sample).{user}")
        return BatchCouplingError("batch_dim=0 promises that samples are independent, but the output's derivative "
                                  "blocks mix samples; drop batch_dim to get the full blocks.")


def _primal(target, args, kwargs):
    """``target(*args, **kwargs)``; a view of a value that hoad's rules laid out otherwise than
    the trace did (a nested operator's program traced again: its value is permuted) as the reshape
    it stands for, which copies where the view cannot alias."""
    if target is torch.ops.aten.view.default:
        try:
            return target(*args, **kwargs)
        except (RuntimeError, ValueError):
            return torch.ops.aten.reshape.default(*args, **kwargs)
    return target(*args, **kwargs)


def _flat(v, node, args, kwargs):
    """``v`` with its flat mask (see :mod:`hoad.rules.flat`) when it is one varying tensor."""
    if isinstance(v, Jet) and v.varies:
        v.flat = flat_of(node, args, kwargs, v.primal)
    return v


def _truncated(env: dict, k: int) -> dict:
    """The environment with every jet cut to orders below ``k`` (remainders of order k)."""
    def cut(v):
        if isinstance(v, Jet):
            return Jet(v.primal, {K: b for K, b in v.blocks.items() if len(K) < k}, v.varies, v.flat)
        if isinstance(v, tuple):
            return tuple(cut(x) for x in v)
        return v

    return {n: cut(v) for n, v in env.items()}


def _primal_of(v):
    if isinstance(v, Jet):
        return v.primal
    if isinstance(v, (tuple, list)):
        return tuple(_primal_of(x) for x in v)
    return v


def _empty(v) -> bool:
    """Every tensor of a node's value has no entries (gather with an empty index of another rank)."""
    out = _primal_of(v)
    tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.numel() == 0 for t in tensors)


def _complex(out) -> bool:
    if isinstance(out, torch.Tensor):
        return out.dtype.is_complex
    if isinstance(out, (tuple, list)):
        return any(_complex(o) for o in out)
    return False


# what a loop over the samples traces to (unbind's slices and selects, stack's cat)
_SAMPLE_LOOP_OPS = {torch.ops.aten.slice.Tensor.overloadpacket, torch.ops.aten.select.int.overloadpacket,
                    torch.ops.aten.cat.default.overloadpacket, torch.ops.aten.stack.default.overloadpacket,
                    torch.ops.aten.unbind.int.overloadpacket}


def _differentiable(out) -> bool:
    if isinstance(out, torch.Tensor):
        return out.dtype.is_floating_point
    if isinstance(out, (tuple, list)):
        return any(_differentiable(o) for o in out)
    return False


def _constant(out, varies: bool = False) -> object:
    """Jets without blocks; ``varies`` marks values that depend on wrt inputs all the same."""
    if isinstance(out, (tuple, list)):
        return tuple(Jet(o, varies=varies and o.dtype.is_floating_point) if isinstance(o, torch.Tensor) else o
                     for o in out)
    return Jet(out, varies=varies) if isinstance(out, torch.Tensor) else out
