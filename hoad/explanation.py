"""``cf.explain()``: what a compiled derivative program computes and what it costs.

Tables in the spirit of opt_einsum's PathInfo: one row per canonical block (dense entries vs the
entries the program stores, structural zeros), the cost of each direction the cost model
compared, and the node count and time of every pipeline stage.
"""

from __future__ import annotations

import math

from tabulate import tabulate

from hoad.algebra.multiindex import all_multi_indices
from hoad.budget import human

# dense over unique entries of the top order (nᵏ / C(n+k-1, k)) from which packed=True pays, and
# from which it pays once the lattice has PACKED_WIDE_LATTICE directions or more
PACKED_PAYS = 50
PACKED_PAYS_WIDE, PACKED_WIDE_LATTICE = 35, 400


def packed_pays(n: int, k: int) -> bool:
    """Whether computing the unique entries alone (``packed=True``) is the faster for order k over
    n entries: where the dense entries are :data:`PACKED_PAYS` times the unique ones, or
    :data:`PACKED_PAYS_WIDE` times with :data:`PACKED_WIDE_LATTICE` lattice directions or more.
    Measured on a tanh MLP at a point, one thread, ms dense against packed: order 6 at n = 8
    (153x) 23.4 vs 3.70, n = 5 (74x, 210 directions) 1.34 vs 1.01; order 5 at n = 16 (68x) 57.6
    vs 25.0, n = 8 (41x, 792 directions) 1.38-1.40 vs 0.81-0.82, n = 7 (36x, 462) 0.58-0.61 vs
    0.55-0.56; but n = 6 (31x, 252) 0.37 vs 0.46 and order 6 at n = 4 (49x, 84) 0.43 vs 0.60.
    Never below order 5: the ratio stays under k!."""
    unique = math.comb(n + k - 1, k)
    return n ** k >= PACKED_PAYS * unique or (n ** k >= PACKED_PAYS_WIDE * unique and unique >= PACKED_WIDE_LATTICE)


class Explanation:
    """What :func:`hoad.explain` shows: a build's direction, stages, costs and memory plan."""

    def __init__(self, build):
        self.build = build
        self.program = build.program

    @property
    def direction(self) -> str:
        return self.program.direction

    def blocks_table(self) -> list[list]:
        p = self.program
        out = math.prod(p.out_shape)
        rows = []
        for K in all_multi_indices(len(p.wrt_names), p.order):
            slots = dict.fromkeys(K) if p.diagonal else K  # pure derivatives carry each input once
            dense = out * math.prod(math.prod(p.slot_shapes[k]) for k in slots)
            # (what a symmetric block needs: each multiset of one input's entries once)
            unique = dense if p.diagonal else out * math.prod(
                math.comb(math.prod(p.slot_shapes[k]) + K.count(k) - 1, K.count(k)) for k in set(K))
            key = "(" + ", ".join(p.wrt_names[k] for k in K) + ")"
            if K in p.stored:
                rows.append([len(K), key, dense, unique, p.stored[K], f"{dense / max(p.stored[K], 1):.1f}x"])
            else:
                rows.append([len(K), key, dense, unique, 0, "structural zero"])
        return rows

    def packed_advice(self) -> str:
        """A line pointing to ``packed=True`` where it pays (:func:`packed_pays`): a dense program
        there was asked for (``packed=False``) or could not be packed."""
        p = self.program
        if p.diagonal:
            return ""
        n, k = sum(math.prod(s) for s in p.slot_shapes), p.order
        unique = math.comb(n + k - 1, k)
        if not packed_pays(n, k):
            return ""
        return (f"order {k} over {n} entries: {n ** k} dense, {unique} unique. hoad.compile(..., packed=True) "
                "computes the unique entries alone, from Taylor jets: 6.3x faster at order 6 over 8 entries "
                "(a tanh MLP, docs/guide.md)")

    def symmetry(self) -> tuple[int, int]:
        """(ordered blocks a naive nesting computes, canonical blocks hoad computes)."""
        p = self.program
        n = len(p.wrt_names)
        ordered = sum(n**k for k in range(1, p.order + 1))
        return ordered, len(all_multi_indices(n, p.order))

    def __str__(self) -> str:
        b, p = self.build, self.program
        ordered, canonical = self.symmetry()
        extras = "".join([", batch_dim=0" if p.batch_dim is not None else "", ", diagonal" if p.diagonal else ""])
        lines = [f"hoad program: order {p.order}, wrt ({', '.join(p.wrt_names)}), output shape {tuple(p.out_shape)}, "
                 f"direction {p.stats.get('label', p.direction)} (mode={b.config.mode}), backend {b.config.backend}"
                 f"{extras}",
                 f"Schwarz symmetry: {canonical} canonical blocks instead of {ordered} ordered ones"
                 + (f" ({len(p.zeros)} of them {'a structural zero' if len(p.zeros) == 1 else 'structural zeros'}, "
                    "not computed)" if p.zeros else ""),
                 "",
                 tabulate(self.blocks_table(),
                          headers=["order", "block", "dense entries", "unique entries", "stored entries", "saved"])]
        advice = self.packed_advice()
        lines += ["", advice] if advice else []
        costs = b.stats.get("costs", {})
        if costs:
            chosen = p.stats.get("label", p.direction)
            rows = [[d, c["flops"], c["bytes"], c["calls"], c["score"], "chosen" if d == chosen else ""]
                    for d, c in costs.items()]
            rows += [[d, "-", "-", "-", "-", f"stopped at {n} traced nodes (jets multiplied out)"]
                     for d, n in b.stats.get("dropped", {}).items()]
            lines += ["", tabulate(rows, headers=["direction", "FLOPs", "bytes", "ATen calls", "score", ""])]
        memory = b.stats.get("memory")
        if memory:
            budget = "none" if memory["budget"] is None else human(memory["budget"])
            lines += ["", f"memory: {memory['plan']}; budget {budget}"]
        stages = []
        for name, st in b.stats.items():
            if isinstance(st, dict) and "seconds" in st:
                nodes = st.get("nodes")
                if nodes is None:  # Inductor's compile: no ATen graph of its own
                    nodes = "(kernels from the cache)" if st.get("cache_hit") else "(kernels compiled)"
                stages.append([name, f"{st['seconds'] * 1e3:.1f} ms", _per_candidate(nodes)])
                stages += [[f"· {sub}" + ("" if s["changed"] else " (no change)"), f"{s['seconds'] * 1e3:.1f} ms",
                            _per_candidate(s["nodes"])] for sub, s in st.get("rewrites", {}).items()]
        lines += ["", tabulate(stages, headers=["stage", "time", "ATen calls after"])]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)


def _per_candidate(nodes):
    """A node count, or one per candidate program (``forward: 12, reverse: 14``)."""
    return ", ".join(f"{d}: {n}" for d, n in nodes.items()) if isinstance(nodes, dict) else nodes
