"""Lower products: each 2-D matrix product as the program's lowering prefers it.

The algebra emits ``aten.mm`` everywhere; on a machine whose lowering knows better (Inductor on a
CPU with hoad's kernels, see :mod:`hoad.lowering.inductor`), this pass, run after clean, rewrites
each one into ``hoad::mm`` (operands made contiguous first) or into a broadcast product summed
over the inner dimension, which Inductor fuses. The primal layers' products are included.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from hoad.algebra.target import Lowering
from hoad.passes.graph import pure, shape_of
from hoad.passes.graph import traced_call as _call

aten = torch.ops.aten
TALL_PRODUCT = 1 << 18  # multiply-adds below which a product's orientation does not matter


def lower_products(gm: fx.GraphModule, lowering: Lowering) -> fx.GraphModule:
    """Rewrite ``aten.mm`` nodes as ``lowering.product`` says; a no-op for the eager lowering."""
    if not hasattr(lowering, "product"):
        return gm
    changed, restride = False, None  # restride: the fake mode, once a product ran transposed
    for node, (a, b), (va, vb) in _products(gm.graph):
        how = lowering.product(va, vb)
        if how == "mm":
            continue
        with gm.graph.inserting_before(node), va.fake_mode:
            if how == "transposed":
                new = _transposed(gm.graph, a, b, torch.ops.hoad.mm.default, lambda x: _contiguous(gm, x))
            elif how == "kernel":
                ca, cb = _contiguous(gm, a), _contiguous(gm, b)
                new = _call(gm.graph, torch.ops.hoad.mm.default, (ca, cb))
            else:  # a vector-matrix product as a fused reduction: (a[:, :, None] * b[None]).sum(1)
                left = _call(gm.graph, aten.unsqueeze.default, (a, 2))
                right = _call(gm.graph, aten.unsqueeze.default, (b, 0))
                new = _call(gm.graph, aten.sum.dim_IntList, (_call(gm.graph, aten.mul.Tensor, (left, right)), [1]))
        _replace(gm.graph, node, new)
        changed, restride = True, va.fake_mode if how == "transposed" else restride
    if restride:
        _restride(gm.graph, restride)
    if changed:
        gm.recompile()
    return gm


def _transposed(graph: fx.Graph, a: fx.Node, b: fx.Node, product=aten.mm.default, dense=lambda x: x) -> fx.Node:
    """``a @ b`` as ``(bᵀ @ aᵀ)ᵀ`` by ``product``, its operands passed through ``dense``."""
    bt, at = (dense(_call(graph, aten.permute.default, (x, [1, 0]))) for x in (b, a))
    return _call(graph, aten.permute.default, (_call(graph, product, (bt, at)), [1, 0]))


def _restride(graph: fx.Graph, fake) -> None:
    """Recompute every value's layout (a rewrite changed some: a product's result column-major);
    a view that no longer is one becomes a reshape, which copies where it must. Inductor traces
    the program again with the real layouts, and such a view would fail there."""
    with fake:
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            try:
                node.meta["val"] = node.target(*args, **kwargs)
            except (RuntimeError, ValueError):  # fake tensors' view raises ValueError
                if node.target not in (aten.view.default, aten._unsafe_view.default):
                    raise
                node.target = aten.reshape.default
                node.meta["val"] = node.target(*args, **kwargs)


def _replace(graph: fx.Graph, node: fx.Node, new: fx.Node) -> None:
    new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def fuse_jet_squares(gm: fx.GraphModule, lowering: Lowering) -> fx.GraphModule:
    """The collapsed second-order term at a layer as one ``hoad::jet_sqnorm`` or ``jet_mm`` call.

    A collapsed Laplacian forms, at each elementwise layer after a linear one, q[p,m] =
    Σ_s u[s,m] X[p,m,s]² with X = W ᵀ(c ⊙ J): the jets J [P,K,S] of the layer before, scaled by
    its derivative c [P,K,1], through the weight (an ``mm`` of W ᵀ [M,K] by the jets flattened to
    [K, P·S], or of the jets [P·S, K] by W [K,M]: the algebra orients products by their shapes),
    squared and summed over the directions, plainly (``sum``) or weighted (a ``bmm`` by weights
    U [M,1,S], or a broadcast product by U [M,S,1] summed). The algebra writes exactly that
    chain. Where each intermediate is used once, it becomes one ``jet_sqnorm`` call that never
    writes c ⊙ J or X (the last hidden layer); where X is read on (by the next layer's jets), one
    ``jet_mm`` call that stores X once, densely, but not c ⊙ J. Only for lowerings that say
    ``avx2`` (Inductor, float64 on a CPU with AVX2 where the kernels are built), and for the
    layers they say suit the kernels (``jets_suit``).
    """
    if not getattr(lowering, "avx2", False):
        return gm
    g = gm.graph
    changed = False
    for sq in list(g.nodes):
        if sq.graph is not g:  # erased with an earlier match's chain
            continue
        if _fuse_pair_square(g, sq, lowering):
            changed = True
            continue
        match = _jet_square(sq)
        if match is None:
            continue
        out, X, z, (J, c, W, transposed), weights, (P, K, S, M) = match
        if not lowering.jets_suit(K):
            continue
        others = [user for user in X.users if user is not sq]
        order = {n: i for i, n in enumerate(g.nodes)}
        anchor = min(others + [out], key=order.__getitem__)  # before every reader of X and of the result
        if weights is not None and not _move_before(weights, anchor, order):
            continue
        with g.inserting_before(anchor), sq.meta["val"].fake_mode:
            c2 = _call(g, aten.view.default, (c, [P, K]))
            J2 = _call(g, aten.permute.default, (J, [0, 2, 1]))  # [1 or P, S, K]
            if J.meta["val"].shape[0] == 1:
                J2 = _call(g, aten.select.int, (J2, 0, 0))
            if transposed:
                W = _call(g, aten.permute.default, (W, [1, 0]))
            args = (J2, c2, W)
            if weights is not None:
                u = _call(g, aten.permute.default, (_call(g, aten.view.default, (weights, [M, S])), [1, 0]))
                args += (u,)
            if others:
                both = _call(g, torch.ops.hoad.jet_mm.default, args)
                jets = _call(g, aten.permute.default, (_call(g, operator.getitem, (both, 0)), [0, 2, 1]))
                q = _call(g, operator.getitem, (both, 1))
            else:
                q = _call(g, torch.ops.hoad.jet_sqnorm.default, args)
            if weights is not None:  # the bmm's [M, 1, P], or the weighted sum's [M, P]
                q = _call(g, aten.permute.default, (_call(g, aten.view.default, (q, [P, M, 1])), [1, 2, 0]))
                if shape_of(out) == (M, P):
                    q = _call(g, aten.view.default, (q, [M, P]))
        q.meta.update({k: v for k, v in out.meta.items() if k != "val"})
        out.replace_all_uses_with(q)
        _erase_chain(g, out)
        if others:
            jets.meta.update({k: v for k, v in X.meta.items() if k != "val"})
            X.replace_all_uses_with(jets)
            _erase_chain(g, X)
        changed = True
    if changed:
        gm.recompile()
    return gm


def _squared(sq: fx.Node, ndim: int) -> fx.Node | None:
    """X where ``sq`` is ``mul(X, X)``, read once, of a float64 CPU X with ``ndim`` axes; else None."""
    if not (_is(sq, aten.mul.Tensor) and len(sq.args) == 2 and sq.args[0] is sq.args[1] and len(sq.users) == 1):
        return None
    vx = sq.args[0].meta.get("val")
    if not (isinstance(vx, torch.Tensor) and vx.dtype == torch.float64 and vx.device.type == "cpu" and vx.ndim == ndim):
        return None
    return sq.args[0]


def _jet_square(sq: fx.Node):
    """If ``sq`` is ``mul(X, X)`` ending the chain :func:`fuse_jet_squares` describes: (the node
    whose value it computes, X, the product, (J, c, W or W ᵀ, whether transposed), the bmm's
    weights or None, (P, K, S, M)); else None."""
    X = _squared(sq, 3)
    if X is None:
        return None
    P, M, S = X.meta["val"].shape
    (user,) = sq.users
    weights = None
    if (_is(user, aten.sum.dim_IntList) and list(user.args[1]) in ([2], [-1]) and len(user.args) == 2
            and not user.kwargs):
        out = user
    elif _is(user, aten.permute.default) and list(user.args[1]) == [1, 2, 0] and len(user.users) == 1:
        (out,) = user.users  # the squares [M, S, P], weighted over S by a bmm or a broadcast product
        operand = user
        if _is(out, aten.clone.default) and len(out.users) == 1:  # the bmm's operand made dense
            operand, (out,) = out, out.users
        if _is(out, aten.bmm.default) and out.args[1] is operand and shape_of(out.args[0]) == (M, 1, S):
            weights = out.args[0]
        elif (_is(out, aten.mul.Tensor) and operand is user and len(out.users) == 1 and user in out.args
              and shape_of(out.args[out.args.index(user) ^ 1]) == (M, S, 1)):
            weights = out.args[out.args.index(user) ^ 1]
            (out,) = out.users
            if not (_is(out, aten.sum.dim_IntList) and list(out.args[1]) == [1] and len(out.args) == 2
                    and not out.kwargs):
                return None
        else:
            return None
        if not _viewable(weights, [M, S]):
            return None
    else:
        return None
    # X from [M, P·S] (wide) or [P·S, M] (tall); X itself may have other readers
    wide = _is(X, aten.permute.default) and list(X.args[1]) == [1, 0, 2]
    if not (wide or _is(X, aten.permute.default) and list(X.args[1]) == [0, 2, 1]):
        return None
    z = _single(X.args[0], aten.view.default, [M, P, S] if wide else [P, S, M])
    if z is None or not _is(z, aten.mm.default) or len(z.users) != 1:  # (before lower_products)
        return None
    W, flat = z.args if wide else z.args[::-1]  # W: [M, K] (Wᵀ) when wide, [K, M] when tall
    K = W.meta["val"].shape[1 if wide else 0]
    yp = _single(flat, aten.view.default, [K, P * S] if wide else [P * S, K])
    if yp is not None and _is(yp, aten.clone.default) and len(yp.users) == 1:
        yp = yp.args[0]
    y = _single(yp, aten.permute.default, [1, 0, 2] if wide else [0, 2, 1])
    if y is None or not _is(y, aten.mul.Tensor) or len(y.users) != 1 or y.kwargs:
        return None
    if shape_of(y) != (P, K, S) or any(shape_of(a) is None for a in y.args):
        return None
    for c, J in (y.args, y.args[::-1]):
        if shape_of(c) == (P, K, 1) and shape_of(J) in ((1, K, S), (P, K, S)) and S > 1:
            return out, X, z, (J, c, W, wide), weights, (P, K, S, M)
    return None


def _fuse_pair_square(g: fx.Graph, sq: fx.Node, lowering: Lowering) -> bool:
    """The collapsed fourth-order term of a nested operator (a biharmonic: the Laplacian of a
    Laplacian program) as one ``hoad::jet_sqnorm`` or ``jet_mm`` call; True where it rewrote.

    There the jets carry a pair of directions: X[p,m,s,t] = Σ_k W[k,m] J[k,s] c[p,k,t], the
    product of y[p,k,s,t] = J c, with the directions s of a factor J shared by every point and
    the directions t of a per-point factor c (on either pair axis of X); the term is Σ_{s,t} X².
    Each pair (p, t) is a point of the jet kernel (its row c[p,:,t]) whose directions are J's: the
    kernel squares and sums X over s in registers, and a small sum over t follows. Readers of X
    that contract it over s against factors constant in t (:func:`_contractions`) get that
    contraction from two small products instead, and X is never stored; where X has other
    readers, ``jet_mm`` stores it once and they read a permuted view of it. At 64 points, 16 and
    16 directions, 64 units, the product wrote X (8 MB), and Inductor read it back across rows for
    its squares and its contraction: the biharmonic took 7.1 ms, 5.1 with the kernel and stored
    X, 3.75 with the contraction."""
    match = _pair_square(sq)
    if match is None:
        return False
    out, X, (Jf, cf, W, wide, t_axis), (P, K, M) = match
    if not lowering.jets_suit(K):
        return False
    s_axis = 5 - t_axis  # J's pair axis of X, and c's
    S, T = X.meta["val"].shape[s_axis], X.meta["val"].shape[t_axis]
    others = [user for user in X.users if user is not sq]
    contractions = _contractions(X, others, s_axis, t_axis)
    order = {n: i for i, n in enumerate(g.nodes)}
    anchor = min(others + [out], key=order.__getitem__)
    with g.inserting_before(anchor), sq.meta["val"].fake_mode:
        # J [1, K, S] and c [P, K, T] (their pair axes squeezed) as the kernel's [S, K] and [P·T, K]
        J2 = _call(g, aten.permute.default, (_call(g, aten.reshape.default, (Jf, [K, S])), [1, 0]))
        c3 = _call(g, aten.reshape.default, (cf, [P, K, T]))
        c2 = _call(g, aten.reshape.default, (_call(g, aten.permute.default, (c3, [0, 2, 1])), [P * T, K]))
        if wide:
            W = _call(g, aten.permute.default, (W, [1, 0]))
        if others and contractions is None:
            both = _call(g, torch.ops.hoad.jet_mm.default, (J2, c2, W))
            stored = _call(g, aten.view.default, (_call(g, operator.getitem, (both, 0)), [P, T, S, M]))
            # [P, T, S, M] back to X's [P, M, S1, S2]
            jets = _call(g, aten.permute.default, (stored, [0, 3, 2, 1] if t_axis == 3 else [0, 3, 1, 2]))
            q = _call(g, operator.getitem, (both, 1))
        elif K * (T + M) < T * S * M:
            q = _gram_square(g, J2, c3, W, P, K, M)
        else:
            q = _call(g, torch.ops.hoad.jet_sqnorm.default, (J2, c2, W))
        if q.meta["val"].shape[0] == P * T:
            q = _call(g, aten.sum.dim_IntList, (_call(g, aten.view.default, (q, [P, T, M])), [1]))
        q = _call(g, aten.view.default, (q, list(shape_of(out))))
    q.meta.update({k: v for k, v in out.meta.items() if k != "val"})
    out.replace_all_uses_with(q)
    _erase_chain(g, out)
    if others and contractions is None:
        jets.meta.update({k: v for k, v in X.meta.items() if k != "val"})
        X.replace_all_uses_with(jets)
        _erase_chain(g, X)
    for r, factors in contractions or ():
        # Σ_s X[p,m,s,t] G[p,m,s] = Σ_k W[k,m] c[p,k,t] E[p,m,k], E = G Jᵀ: two small products
        with g.inserting_before(r), sq.meta["val"].fake_mode:
            G = factors[0]
            for f in factors[1:]:
                G = _call(g, aten.add.Tensor, (G, f))
            G = _call(g, aten.expand.default, (_call(g, aten.squeeze.dim, (G, t_axis)), [P, M, S]))
            E = _call(g, aten.mm.default, (_call(g, aten.reshape.default, (G, [P * M, S])), J2))
            H = _call(g, aten.mul.Tensor, (_call(g, aten.view.default, (E, [P, M, K])),
                                           _call(g, aten.permute.default, (W, [1, 0]))))
            new = _call(g, aten.view.default, (_call(g, aten.bmm.default, (H, c3)), list(shape_of(r))))
        new.meta.update({k: v for k, v in r.meta.items() if k != "val"})
        r.replace_all_uses_with(new)
        _erase_chain(g, r)
    return True


def _gram_square(g: fx.Graph, J2: fx.Node, c3: fx.Node, W: fx.Node, P: int, K: int, M: int) -> fx.Node:
    """Σ_{s,t} X[p,m,s,t]² for X = Σ_k W[k,m] J[s,k] c[p,k,t], without X: it equals
    Σ_{k,l} W[k,m] W[l,m] G[k,l] C[p,k,l], with G = JᵀJ (shared by the points) and C = c cᵀ per
    point, which costs P·K²·(T + M) multiply-adds instead of the jets' P·T·S·K·M. Returns [P, M].
    At 16 and 16 directions and 64 units that is 3.2x fewer; at 50 and 50 directions and 128
    units, 14x."""
    G = _call(g, aten.mm.default, (_call(g, aten.permute.default, (J2, [1, 0])), J2))           # [K, K]
    C = _call(g, aten.bmm.default, (c3, _call(g, aten.permute.default, (c3, [0, 2, 1]))))      # [P, K, K]
    E = _call(g, aten.mul.Tensor, (C, G))
    F = _call(g, aten.mm.default, (_call(g, aten.view.default, (E, [P * K, K])), W))           # [P·K, M]
    return _call(g, aten.sum.dim_IntList, (_call(g, aten.mul.Tensor, (
        _call(g, aten.view.default, (F, [P, K, M])), W)), [1]))


def _contractions(X: fx.Node, readers: list, s_axis: int, t_axis: int) -> list | None:
    """If every one of X's ``readers`` is a term X·F of a sum over the axis ``s_axis`` (terms
    added, each F constant along ``t_axis``): [(the sum, its factors F)], one entry per sum;
    else None. Such a reader needs X only contracted over s, which two small products give
    without X (:func:`_fuse_pair_square`); a biharmonic's jets have one, Σ_s 2 X·B."""
    sums: dict = {}
    vx = X.meta["val"]
    for reader in readers:
        if not (_is(reader, aten.mul.Tensor) and len(reader.args) == 2 and not reader.kwargs):
            return None
        f = reader.args[1] if reader.args[0] is X else reader.args[0]
        vf = f.meta.get("val") if isinstance(f, fx.Node) else None
        if (f is X or not isinstance(vf, torch.Tensor) or vf.ndim != 4 or vf.shape[t_axis] != 1
                or any(vf.shape[d] not in (1, vx.shape[d]) for d in range(4)) or vf.dtype != vx.dtype):
            return None
        node = reader  # up through single-use additions to the sum
        while len(node.users) == 1 and _is(next(iter(node.users)), aten.add.Tensor):
            node = next(iter(node.users))
        if len(node.users) != 1:
            return None
        (r,) = node.users
        if not (_is(r, aten.sum.dim_IntList) and not r.kwargs and [d % 4 for d in r.args[1]] == [s_axis]
                and r.args[0] is node and shape_of(r) in (_without(vx.shape, s_axis), _kept(vx.shape, s_axis))):
            return None
        sums.setdefault(r, []).append((reader, f))
    for r, terms in sums.items():  # the tree under each sum holds its terms and additions only
        leaves = {t for t, _ in terms}
        stack = [r.args[0]]
        while stack:
            n = stack.pop()
            if n in leaves:
                continue
            if not (_is(n, aten.add.Tensor) and len(n.users) == 1 and not n.kwargs and len(n.args) == 2
                    and all(isinstance(a, fx.Node) for a in n.args)):
                return None
            stack.extend(n.args)
    return [(r, [f for _, f in terms]) for r, terms in sums.items()]


def _without(shape, axis: int) -> tuple:
    return tuple(n for d, n in enumerate(shape) if d != axis)


def _kept(shape, axis: int) -> tuple:
    return tuple(1 if d == axis else n for d, n in enumerate(shape))


def _pair_square(sq: fx.Node):
    """If ``sq`` is ``mul(X, X)`` of the chain :func:`_fuse_pair_square` describes, summed over both
    direction axes (in one ``sum`` or two, kept or not, then maybe viewed [P, M]): (the node whose
    value is the sum, X, (J's factor, c's factor, W or Wᵀ, whether Wᵀ, c's pair axis of X: 2 or
    3), (P, K, M)); else None."""
    X = _squared(sq, 4)
    if X is None:
        return None
    P, M, S1, S2 = X.meta["val"].shape
    axes: list = [0, 1, 2, 3]  # the axes of X left in the current node (None: a kept, summed one)
    out = sq
    while {2, 3} & {a for a in axes if a is not None}:
        if len(out.users) != 1:
            return None
        (user,) = out.users
        if not (_is(user, aten.sum.dim_IntList) and not user.kwargs and len(user.args) in (2, 3)):
            return None
        keep = len(user.args) == 3 and bool(user.args[2])
        dims = {d % len(axes) for d in user.args[1]}
        if not {axes[d] for d in dims} <= {2, 3}:
            return None
        axes = [None if d in dims else a for d, a in enumerate(axes)] if keep else \
            [a for d, a in enumerate(axes) if d not in dims]
        out = user
    if len(out.users) == 1 and _is(next(iter(out.users)), aten.view.default) and \
            list(next(iter(out.users)).args[1]) == [P, M]:
        (out,) = out.users
    # X from the product of y [P,K,S1,S2]: wide, Wᵀ [M,K] @ [K, P·S1·S2]; tall, [P·S1·S2, K] @ W [K,M]
    wide = _is(X, aten.permute.default) and list(X.args[1]) == [1, 0, 2, 3]
    if not (wide or _is(X, aten.permute.default) and list(X.args[1]) == [0, 3, 1, 2]):
        return None
    z = _single(X.args[0], aten.view.default, [M, P, S1, S2] if wide else [P, S1, S2, M])
    if z is None or not _is(z, aten.mm.default) or len(z.users) != 1:
        return None
    W, flat = z.args if wide else z.args[::-1]
    K = W.meta["val"].shape[1 if wide else 0]
    yp = _single(flat, aten.view.default, [K, P * S1 * S2] if wide else [P * S1 * S2, K])
    if yp is not None and _is(yp, aten.clone.default) and len(yp.users) == 1:
        yp = yp.args[0]
    y = _single(yp, aten.permute.default, [1, 0, 2, 3] if wide else [0, 2, 3, 1])
    if y is None or not _is(y, aten.mul.Tensor) or len(y.users) != 1 or y.kwargs or shape_of(y) != (P, K, S1, S2):
        return None
    for Jf, cf in (y.args, y.args[::-1]):
        if not all(isinstance(f, fx.Node) for f in (Jf, cf)):
            continue
        for t_axis, (js, cs), S in ((3, ((1, K, S1, 1), (P, K, 1, S2)), S1), (2, ((1, K, 1, S2), (P, K, S1, 1)), S2)):
            if shape_of(Jf) == js and shape_of(cf) == cs and S > 1:
                return out, X, (Jf, cf, W, wide, t_axis), (P, K, M)
    return None


def _move_before(node: fx.Node, anchor: fx.Node, order: dict) -> bool:
    """Move ``node`` and those of its inputs that come after ``anchor`` to just before it, if they
    are plain ATen calls (no random or mutating ops); False, and nothing moved, where they are not."""
    late, stack = [], [node]
    while stack:
        n = stack.pop()
        if order[n] < order[anchor] or n in late:
            continue
        # the anchor itself among the inputs would be a cycle
        if n is anchor or not isinstance(n.target, torch._ops.OpOverload) or not pure(n):
            return False
        late.append(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(late, key=order.__getitem__):
        anchor.prepend(n)
    return True


def _viewable(node: fx.Node, shape: list) -> bool:
    try:
        node.meta["val"].view(shape)
    except RuntimeError:
        return False
    return True


def _single(node, target, shape_or_dims) -> fx.Node | None:
    """``node``'s input if ``node`` is ``target(input, shape_or_dims)`` used once, else None."""
    if (not isinstance(node, fx.Node) or not _is(node, target) or len(node.users) != 1
            or list(node.args[1]) != list(shape_or_dims)):
        return None
    return node.args[0]


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _erase_chain(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and, backwards, every input left without users (the matched chain)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function":
            continue
        inputs = [a for a in n.all_input_nodes]
        graph.erase_node(n)
        stack.extend(inputs)


def sink_permutes(gm: fx.GraphModule, lowering: Lowering) -> fx.GraphModule:
    """Give a fusing compiler the layouts the traced program assumed, for the operands of products.

    The algebra reshapes a jet into a matrix as ``view(permute(e), shape)``, valid because eager
    elementwise ops lay ``e`` out like their operands (a [256,64,16] jet stored [256,16,64]).
    Inductor lays every elementwise value out in its logical order instead, so the view is no
    longer one: it wrote ``e`` once and again reordered (7.6 of 25 ms for a [256,128,50] jet).
    Here such an ``e`` is computed in its stored order (operands permuted: a view each) and the
    matrix is read from it as ``permute(view(e'))``, which Inductor passes to BLAS as a strided
    operand without a copy. Only for fused lowerings; the eager program already works this way.
    """
    if not lowering.fused:
        return gm
    changed = False
    for view in list(gm.graph.nodes):
        if view.op != "call_function" or view.target not in (aten.view.default, aten._unsafe_view.default):
            continue
        perm = view.args[0]
        if not isinstance(perm, fx.Node) or perm.target is not aten.permute.default or len(perm.users) != 1:
            continue
        e = perm.args[0]
        if (not isinstance(e, fx.Node) or e.op != "call_function" or len(e.users) != 1 or e.kwargs
                or torch.Tag.pointwise not in getattr(e.target, "tags", ())):
            continue
        ve = e.meta.get("val")
        if not isinstance(ve, torch.Tensor) or ve.is_contiguous() or perm.meta["val"].is_contiguous():
            continue
        stored = sorted(range(ve.ndim), key=lambda d: (-ve.stride(d), d))  # e's axes, outermost first
        groups = _merged(list(perm.meta["val"].shape), list(view.args[1]))
        if groups is None:
            continue
        at = {d: stored.index(d) for d in range(ve.ndim)}
        runs = [[at[perm.args[1][i]] for i in g] for g in groups]
        if any(r != list(range(r[0], r[0] + len(r))) for r in runs if r):
            continue
        with gm.graph.inserting_before(perm), ve.fake_mode:
            new = _call(gm.graph, e.target, tuple(_permuted(gm, a, ve.ndim, stored) for a in e.args))
            if not new.meta["val"].is_contiguous():
                gm.graph.erase_node(new)
                continue
            new.meta.update({k: v for k, v in e.meta.items() if k != "val"})
            by_start = sorted(range(len(runs)), key=lambda i: runs[i][0] if runs[i] else -1)
            shape = [math.prod(perm.meta["val"].shape[j] for j in groups[i]) for i in by_start]
            flat = _call(gm.graph, aten.view.default, (new, shape))
            out = _call(gm.graph, aten.permute.default, (flat, [by_start.index(i) for i in range(len(runs))]))
        view.replace_all_uses_with(out)
        for dead in (view, perm, e):
            gm.graph.erase_node(dead)
        changed = True
    if changed:
        gm.recompile()
    return gm


def orient_products(gm: fx.GraphModule) -> fx.GraphModule:
    """Each tall matrix product ``a @ b`` (many more rows than columns) as ``(bᵀ @ aᵀ)ᵀ``.

    MKL's dgemm runs the short-wide form up to twice as fast here (see
    :mod:`hoad.lowering.inductor`). The algebra orients its own products; this pass is for graphs
    it did not write: AOTAutograd's backward of a program, whose ``mm`` backward computes the
    gradient of a column-major operand in the tall form to return it column-major (the weight
    gradients of a Laplacian's jets: [4096,64]@[64,64] took 2.5x the time of the wide form).
    """
    if _orient(gm.graph):
        gm.recompile()
    return gm


class OrientProducts(CustomGraphPass):
    """:func:`orient_products` as Inductor's post-grad pass (``post_grad_custom_post_pass``): it
    runs on each graph AOTAutograd hands Inductor, and its uuid enters Inductor's and
    AOTAutograd's cache keys, so an artifact compiled without it is never served."""

    def __call__(self, graph: fx.Graph) -> None:
        _orient(graph)

    def uuid(self):
        return get_hash_for_files((__file__,))


def _orient(graph: fx.Graph) -> bool:
    changed = False
    for node, (a, b), (va, vb) in _products(graph):
        (m, k), n = va.shape, vb.shape[1]
        if not (isinstance(m, int) and isinstance(n, int) and m > 4 * n and m * k * n >= TALL_PRODUCT):
            continue
        with graph.inserting_before(node), va.fake_mode:
            new = _transposed(graph, a, b)
        _replace(graph, node, new)
        changed = True
    return changed


def _products(graph: fx.Graph):
    """Each ``aten.mm`` node of ``graph`` whose operands carry traced values: (node, operands, values)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.mm.default or node.kwargs:
            continue
        a, b = node.args
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            yield node, (a, b), (va, vb)


def _merged(shape: list, target: list) -> list | None:
    """The axes of ``shape`` that each axis of ``target`` merges (consecutive runs), or None if the
    reshape splits an axis; trailing size-1 axes join the last run."""
    groups, i = [], 0
    for n in target:
        run, size = [], 1
        while i < len(shape) and size < n:
            run.append(i)
            size *= shape[i]
            i += 1
        if size != n:
            return None
        groups.append(run)
    if any(shape[j] != 1 for j in range(i, len(shape))) or not groups:
        return None
    groups[-1].extend(range(i, len(shape)))
    return groups


def _permuted(gm: fx.GraphModule, a, ndim: int, order: list):
    """Operand ``a`` of an elementwise op of rank ``ndim``, with its axes in ``order``."""
    if not isinstance(a, fx.Node) or not isinstance(a.meta.get("val"), torch.Tensor):
        return a
    shape = list(a.meta["val"].shape)
    if len(shape) < ndim:
        a = _call(gm.graph, aten.view.default, (a, [1] * (ndim - len(shape)) + shape))
    return _call(gm.graph, aten.permute.default, (a, order))


def _contiguous(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """``node``, or a contiguous copy of it (hoad::mm reads dense row-major operands)."""
    if node.meta["val"].is_contiguous():
        return node
    new = gm.graph.call_function(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    new.meta["val"] = node.meta["val"].clone(memory_format=torch.contiguous_format)
    return new
