"""Canonical multi-indices and the combinatorics of the chain and product rules.

A multi-index is a sorted tuple of wrt positions: ``(0, 0, 1)`` names ∂³/∂x₀∂x₀∂x₁. Schwarz
symmetry means only sorted tuples are ever computed; each position of a multi-index is a *slot*
of the block (one group of axes per slot).

Faà di Bruno and Leibniz both sum over ways of distributing the slots of ``K`` among factors.
Distributions that give every factor the same sub-multi-index produce the same product up to a
permutation of slots, so :func:`partition_terms` and :func:`distribution_terms` group them: each
distinct product is computed once and its permuted copies are added.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

MultiIndex = tuple[int, ...]


def multi_indices(n_wrt: int, order: int) -> list[MultiIndex]:
    """All canonical multi-indices of exactly ``order`` over ``n_wrt`` inputs."""
    return list(itertools.combinations_with_replacement(range(n_wrt), order))


def all_multi_indices(n_wrt: int, max_order: int) -> list[MultiIndex]:
    """Canonical multi-indices of orders 1..max_order, lower orders first."""
    return [K for k in range(1, max_order + 1) for K in multi_indices(n_wrt, k)]


def sub_multi_indices(K: MultiIndex) -> list[MultiIndex]:
    """The distinct non-empty sub-multisets of ``K``, lower orders first."""
    subs = {tuple(K[i] for i in positions)
            for k in range(1, len(K) + 1) for positions in itertools.combinations(range(len(K)), k)}
    return sorted(subs, key=lambda s: (len(s), s))


def closure(keys: Sequence[MultiIndex]) -> list[MultiIndex]:
    """``keys`` with every non-empty sub-multi-index, lower orders first."""
    subs = {s for K in keys for s in sub_multi_indices(K)}
    return sorted(subs, key=lambda s: (len(s), s))


@dataclass(frozen=True)
class Term:
    """One distinct product in a sum over slot distributions.

    ``parts[f]`` lists the slot positions (into K) that factor ``f`` differentiates, each sorted.
    ``copies`` lists slot permutations: the full sum is Σ_σ product.permute_slots(σ), where
    ``σ[p]`` is the slot of the computed product that lands at position ``p``.
    """

    parts: tuple[tuple[int, ...], ...]
    copies: tuple[tuple[int, ...], ...]

    def sub_indices(self, K: MultiIndex) -> tuple[MultiIndex, ...]:
        return tuple(tuple(K[p] for p in part) for part in self.parts)


def _set_partitions(items: tuple[int, ...]) -> Iterator[list[tuple[int, ...]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [(first,)] + part
        for i in range(len(part)):
            yield part[:i] + [(first,) + part[i]] + part[i + 1:]


def _group(K: MultiIndex, distributions: Sequence[Sequence[tuple[int, ...]]], ordered: bool) -> tuple[Term, ...]:
    """Group slot distributions by the sub-multi-indices they hand to the factors."""
    groups: dict[tuple, list[list[tuple[int, ...]]]] = {}
    for parts in distributions:
        parts = [tuple(sorted(p)) for p in parts]
        if not ordered:  # factors are interchangeable: sort them by what they differentiate
            parts.sort(key=lambda p: (tuple(K[i] for i in p), p))
        signature = tuple(tuple(K[i] for i in p) for p in parts)
        groups.setdefault(signature, []).append(parts)
    terms = []
    for members in groups.values():
        rep = members[0]
        rep_slots = [p for part in rep for p in part]
        copies = []
        for parts in members:
            slots = [p for part in parts for p in part]
            # slot rep_slots[t] of the representative plays the role of slots[t] here
            sigma = [0] * len(K)
            for t, p in enumerate(slots):
                sigma[p] = rep_slots[t]
            copies.append(tuple(sigma))
        terms.append(Term(tuple(rep), tuple(copies)))
    return tuple(terms)


@functools.lru_cache(maxsize=None)
def partition_terms(K: MultiIndex) -> tuple[Term, ...]:
    """Faà di Bruno: D^K φ(u) = Σ over set partitions π of the slots of φ^(|π|)(u) Π_{B∈π} D^{K_B} u."""
    return _group(K, list(_set_partitions(tuple(range(len(K))))), ordered=False)


@functools.lru_cache(maxsize=None)
def distribution_terms(K: MultiIndex, n_factors: int) -> tuple[Term, ...]:
    """Leibniz: D^K (a·b·…) = Σ over assignments of slots to factors of Π_f D^{K_f} factor_f."""
    dists = []
    for owner in itertools.product(range(n_factors), repeat=len(K)):
        dists.append([tuple(p for p in range(len(K)) if owner[p] == f) for f in range(n_factors)])
    return _group(K, dists, ordered=True)


def key_name(K: MultiIndex, names: Sequence[str]) -> str:
    return "_".join(names[k] for k in K)
