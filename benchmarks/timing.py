"""Interleaved timing: all contenders of a workload run in the same rounds, in rotating order,
so drift on a shared, noisy machine hits them alike; the statistic is the median per call.

A contender only has to offer ``run(calls) -> seconds`` for ``calls`` back-to-back calls (in
this process, or in a worker process that times itself). On CUDA (:func:`synchronize_with`) the
device is synchronized before the clock starts and before it is read: kernels launched by the
timed calls are counted, and none left over from earlier work is.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class Runnable(Protocol):
    """Something the timer can call ``calls`` times and report the seconds it took."""

    def run(self, calls: int) -> float: ...


@dataclass(frozen=True)
class Budget:
    """How long to time each contender: total seconds, block length and round counts."""

    seconds: float  # time per contender per workload, spread over the rounds
    block: float  # target length of one timed block (calls are repeated to reach it)
    min_rounds: int
    max_rounds: int


QUICK = Budget(seconds=0.5, block=0.005, min_rounds=5, max_rounds=21)
FULL = Budget(seconds=2.0, block=0.02, min_rounds=7, max_rounds=41)


_sync: Callable[[], None] = lambda: None  # noqa: E731 - waits for the device (CUDA), else nothing


def synchronize_with(device: str) -> None:
    """Make every timed block wait for ``device`` ("cuda": torch.cuda.synchronize) at both ends."""
    global _sync
    if device == "cuda":
        import torch

        _sync = torch.cuda.synchronize
    else:
        _sync = lambda: None  # noqa: E731


def synchronize() -> None:
    """Wait for the device of this run (nothing on the CPU)."""
    _sync()


def time_calls(fn: Callable[[], object], calls: int) -> float:
    """Seconds for ``calls`` back-to-back calls of ``fn``, with the garbage collector paused
    (a full collection costs ~0.1 s with torch and jax loaded: :func:`interleave` runs one first).
    On CUDA the device is synchronized before the clock starts and before it is read."""
    gc.disable()
    try:
        _sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        return time.perf_counter() - start
    finally:
        gc.enable()


@dataclass
class _Plan:
    calls: int  # calls per timed block
    rounds: int


def _plan(c: Runnable, budget: Budget) -> _Plan:
    per_call = c.run(1)  # also a warm-up call
    if per_call < budget.block:  # too short to time alone: measure a longer run
        n = min(1000, math.ceil(budget.block / max(per_call, 1e-7)))
        per_call = c.run(n) / n
    calls = max(1, round(budget.block / max(per_call, 1e-9)))
    rounds = int(budget.seconds / (calls * per_call)) if per_call > 0 else budget.max_rounds
    return _Plan(calls, min(budget.max_rounds, max(budget.min_rounds, rounds)))


def interleave(contenders: Sequence[Runnable], budget: Budget) -> tuple[list[list[float]], dict[int, Exception]]:
    """Per-call seconds of each contender, one sample per round (round r starts at contender r),
    and the exceptions of contenders that failed while being timed (they drop out)."""
    gc.collect()
    n = len(contenders)
    plans: list[_Plan] = []
    failures: dict[int, Exception] = {}
    for i, c in enumerate(contenders):
        try:
            plans.append(_plan(c, budget))
        except Exception as e:  # noqa: BLE001 - a contender dying mid-run is a result
            plans.append(_Plan(calls=1, rounds=0))
            failures[i] = e
    samples: list[list[float]] = [[] for _ in contenders]
    for r in range(max((p.rounds for p in plans), default=0)):
        for i in [(r + j) % n for j in range(n)]:
            if r >= plans[i].rounds:
                continue
            try:
                samples[i].append(contenders[i].run(plans[i].calls) / plans[i].calls)
            except Exception as e:  # noqa: BLE001
                plans[i].rounds = r
                failures[i] = e
    return samples, failures


def median(samples: Sequence[float]) -> float | None:
    return statistics.median(samples) if samples else None
