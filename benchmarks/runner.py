"""One workload, start to finish: the reference, each contender's first call and check, then
interleaved timing of the contenders that answered correctly (:func:`measure`, which the targets
use too)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from benchmarks import operators, peers
from benchmarks.fresh import run_fresh
from benchmarks.peers import Outcome
from benchmarks.reference import reference_of
from benchmarks.timing import Budget, interleave
from benchmarks.workloads import Problem, Workload


@dataclass(frozen=True)
class Settings:
    """One benchmark run's settings: budget, peers, dtype and compile limits."""

    quick: bool
    budget: Budget
    compile_peers: bool = True
    compile_timeout_s: float = 300.0
    dtype: torch.dtype = torch.float64  # of the contenders; the reference is always float64
    peers: tuple[str, ...] | None = None  # the columns to run (--peers); None: all


def run_workload(w: Workload, settings: Settings) -> dict:
    """The workload's record for the results file: what ran, and each column's :class:`Outcome`."""
    start = time.perf_counter()
    p = w.make(settings.dtype)
    record = {"id": w.id, "group": w.group, "label": w.label, "device": w.device, "dtype": str(settings.dtype)}
    if isinstance(p, Problem):
        record.update(order=p.order, wrt=list(p.wrt), per_sample=p.per_sample, laplacian=p.laplacian)
    else:
        record.update(p.record())
    try:
        ref = reference_of(w, p, settings.dtype)
    except Exception as e:  # noqa: BLE001 - without a reference nothing can be checked or timed
        names = peers.COLUMNS if isinstance(p, Problem) else [way.name for way in peers.operators.ways(p)]
        record["outcomes"] = {name: Outcome("skipped", note=f"reference failed: {type(e).__name__}: {e}").as_dict()
                              for name in names}
        record["seconds"] = time.perf_counter() - start
        return record
    contenders = peers.contenders(p, w, settings.quick, settings.compile_peers, settings.compile_timeout_s,
                                  settings.dtype)
    if settings.peers is not None:
        contenders = [c if c.name in settings.peers else peers.Skipped(c.name, "skipped", "left out by --peers")
                      for c in contenders]
    outcomes = measure([(c, ref) for c in contenders], settings.budget)
    record["outcomes"] = {name: outcome.as_dict() for name, outcome in outcomes.items()}
    if isinstance(p, operators.TrainProblem):
        del p, ref, contenders
        record["memory"] = step_memory(w, settings)
    record["seconds"] = time.perf_counter() - start
    return record


MEMORY_COLUMNS = ("hoad", "torch.func")  # whose training step's peak memory is measured, hoad first
# glibc malloc in the memory processes: every block of 64 KiB or more is its own mapping, returned
# to the OS when freed, and the heap is trimmed at once, so resident memory follows the live
# tensors: what the checking call freed is not reused unseen by the measured step (setting these
# also keeps hoad's own malloc tuning off, see docs/guide.md)
EXACT_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def step_memory(w: Workload, settings: Settings) -> dict[str, dict]:
    """The peak memory of one training step of each of :data:`MEMORY_COLUMNS`, each in a fresh
    process (:mod:`benchmarks.fresh`): nothing another contender left behind is counted."""
    out = {}
    for name in MEMORY_COLUMNS:
        _progress(f"    memory {name:<8} ", end="")
        out[name] = run_fresh(["step-memory", w.id, name, str(settings.dtype).removeprefix("torch.")],
                              timeout_s=settings.compile_timeout_s, environ=EXACT_MALLOC)
        reply = out[name]
        _progress(f"{reply.get('peak_mb', 0):.0f} MB, step {reply.get('step_s', 0) * 1e3:.1f} ms"
                  if reply.get("status") == "ok" else f"{reply.get('status')}: {reply.get('note', '')}")
    return out


def measure(entries: list[tuple[object, dict]], budget: Budget) -> dict[str, Outcome]:
    """Each contender's :class:`Outcome`, by name: its first call checked against its reference
    (``entries`` pairs them), then interleaved timing of the ones that answered correctly."""
    outcomes: dict[str, Outcome] = {}
    contenders = [c for c, _ in entries]
    try:
        for c, ref in entries:
            _progress(f"    {c.name:<14} ", end="")  # named first: a crash of this process shows where
            outcomes[c.name] = c.start(ref)
            _progress(_first_call_line(outcomes[c.name]))
        timed = [c for c in contenders if outcomes[c.name].status == "ok"]
        samples, failures = interleave(timed, budget)
        for c, times in zip(timed, samples):
            outcomes[c.name].times = times
        for i, e in failures.items():
            outcome = outcomes[timed[i].name]
            outcome.status, outcome.note = "crash", f"failed while timed: {type(e).__name__}: {e}"
    finally:
        for c in contenders:
            c.close()
    return outcomes


def _first_call_line(o: Outcome) -> str:
    first = f"first call {o.first_call_s:.2f} s" if o.first_call_s is not None else ""
    return "  ".join(filter(None, [o.status, o.config, first, o.note]))


def _progress(text: str, end: str = "\n") -> None:
    print(text, end=end, file=sys.stderr, flush=True)
