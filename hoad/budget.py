"""The memory budget, in one place: what a program may plan to use, whether a program, a count of
samples or a chunked call fits in it, and the ways out when it does not.

:mod:`hoad.passes.memory` estimates a program's :class:`MemoryPlan` from its graph; everything
here reads only that plan, so the API's checks at call time need no graph.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from hoad.errors import MemoryBudgetError

# the share of the memory available when a program is built that one program may plan to use
BUDGET_SHARE = 0.8


@dataclass(frozen=True)
class MemoryPlan:
    """A program's estimated memory: its inputs, its results and the peak while it runs."""

    inputs: int    # bytes of the program's inputs (the caller's tensors, free tensors)
    results: int   # bytes of the program's outputs (the value and every stored block)
    peak: int      # estimated peak bytes while the program runs, inputs included

    def __str__(self) -> str:
        return f"inputs {human(self.inputs)}, results {human(self.results)}, estimated peak {human(self.peak)}"


@dataclass(frozen=True)
class Budget:
    """A built program's plan against its budget: refused at build time, for a new number of
    samples and for the joined results of a chunked call, each with the ways out."""

    plan: MemoryPlan
    limit: float | None  # bytes; None where the free memory cannot be read (nothing is refused)
    given: bool          # memory_budget= set it (else a share of the memory free at build time)
    count: int | None    # the samples the plan was made for (batch_dim), else None
    shared: float = 0.0  # bytes every chunk holds whatever its size (parameters, free tensors)

    def fit(self, samples: int, built: int | None = None) -> int:
        """How many of ``samples`` one chunk may hold (:func:`samples_that_fit`), the plan scaled
        from the ``built`` samples it was made for."""
        n = built or self.count
        return samples_that_fit(samples, self.plan.results / n, (self.plan.peak - self.shared) / n, self.limit,
                                self.shared)

    def check_program(self, order: int, fewer: list[str]) -> None:
        """Refuse the program before it runs when its estimated peak is over the budget; ``fewer``
        are the ways out that compute less."""
        plan, limit = self.plan, self.limit
        if limit is None or plan.peak <= limit:
            return
        given = "memory_budget=" if self.given else f"{BUDGET_SHARE:.0%} of the memory free now; memory_budget= sets it"
        ways = []
        if self.count is None:
            ways.append("batch_dim=0 when dim 0 indexes independent samples (per-sample blocks, not the "
                        "cross-sample ones)")
        else:
            n, shared, fit = self.count, self.shared, self.fit(self.count)
            if fit >= 1:  # chunks bound the working memory, not the results
                ways.append(f"chunk_size={fit} to run {fit} samples at a time")
            elif plan.results + shared >= limit:
                ways.append(f"fewer samples per call (their results, {human(plan.results)}, and the parameters and "
                            f"shared inputs, {human(shared)}, leave no room)")
            else:
                one = shared + (plan.peak - shared) / n + plan.results / n
                ways.append(f"none by chunking (one sample at a time still needs about {human(one)}, the parameters "
                            f"and shared inputs {human(shared)} of it)")
        ways += fewer + ["a larger memory_budget"]
        raise MemoryBudgetError(
            f"the order-{order} program needs an estimated peak of {human(plan.peak)} ({plan}), over the memory "
            f"budget of {human(limit)} ({given}). Ways out: " + "; ".join(ways) + ".")

    def check_count(self, count: int, fewer: list[str]) -> None:
        """Refuse a number of samples whose estimated peak (the plan scaled from the count it was
        built for) is over the budget."""
        if self.limit is None:
            return
        peak = self.shared + (self.plan.peak - self.shared) * count / self.count
        if peak > self.limit:
            fit = max(1, self.fit(count))
            raise MemoryBudgetError(
                f"{count} samples need an estimated peak of {human(peak)}, over the memory budget of "
                f"{human(self.limit)}. Ways out: " + "; ".join([f"chunk_size={fit} to run {fit} samples at a time"]
                                                                + fewer))

    def check_joined(self, chunks: int, chunk_size: int, samples: int, fewer: list[str]) -> None:
        """Refuse a chunked call whose joined results and one chunk's program are over the budget,
        whatever the size of one chunk's program (this plan is one chunk's)."""
        if self.limit is None:
            return
        total = self.plan.results * chunks + self.plan.peak
        if total > self.limit:
            fit = self.fit(samples, chunk_size)
            ways = ([f"chunk_size={fit}"] if 1 <= fit < chunk_size else []) + fewer
            raise MemoryBudgetError(
                f"the joined results of all {chunks} chunks and one chunk's program take {human(total)}, over the "
                f"memory budget of {human(self.limit)}: chunking bounds the program's working memory, not its "
                f"results. Ways out: {'; '.join(ways + ['fewer samples per call', 'a larger memory_budget'])}")


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` now (CUDA: the driver's count; CPU: the kernel's MemAvailable),
    or None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def default_budget(device: torch.device) -> int | None:
    """:data:`BUDGET_SHARE` of the memory free on ``device`` now, or None where it cannot be read."""
    free = available_bytes(device)
    return None if free is None else int(BUDGET_SHARE * free)


def samples_that_fit(samples: int, result: float, peak: float, budget: float, shared: float = 0.0) -> int:
    """How many of ``samples`` one chunk may hold, for a program whose results take ``result`` and
    whose working memory ``peak`` per sample, beside ``shared`` bytes every chunk holds whatever
    its size (parameters, free tensors, hoisted terms): the joined results of every chunk (the last
    padded to a whole chunk) stay next to one chunk's program, whose peak per sample is not exact
    (a margin). The same answer whatever chunk size the program was built for, so advice is
    followed once."""
    def need(c: int) -> float:
        return result * c * math.ceil(samples / c) + shared + peak * c / 0.75

    room = budget - result * samples - shared
    c = min(samples, int(room / peak * 0.75)) if room > 0 and peak > 0 else samples if room > 0 else 0
    while c >= 1 and need(c) > budget:
        c -= 1
    return c


def human(n: float) -> str:
    """Bytes in binary units, named as such (a budget of 1e9 bytes is 953.7 MiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
