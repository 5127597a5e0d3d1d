"""One workload, start to finish: the reference, each contender's first call and check, then
interleaved timing of the contenders that answered correctly (:func:`measure`, which the targets
use too)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from benchmarks import peers
from benchmarks.peers import Outcome
from benchmarks.reference import reference
from benchmarks.timing import Budget, interleave
from benchmarks.workloads import Workload


@dataclass(frozen=True)
class Settings:
    quick: bool
    budget: Budget
    compile_peers: bool = True
    compile_timeout_s: float = 300.0


def run_workload(w: Workload, settings: Settings) -> dict:
    """The workload's record for the results file: what ran, and each column's :class:`Outcome`."""
    start = time.perf_counter()
    p = w.build()
    record = {"id": w.id, "group": w.group, "label": w.label, "order": p.order, "wrt": list(p.wrt),
              "per_sample": p.per_sample, "laplacian": p.laplacian}
    try:
        ref = reference(p)
    except Exception as e:  # noqa: BLE001 - without a reference nothing can be checked or timed
        record["outcomes"] = {name: Outcome("skipped", note=f"reference failed: {type(e).__name__}: {e}").as_dict()
                              for name in peers.COLUMNS}
        record["seconds"] = time.perf_counter() - start
        return record
    contenders = peers.contenders(p, w, settings.quick, settings.compile_peers, settings.compile_timeout_s)
    outcomes = measure([(c, ref) for c in contenders], settings.budget)
    record["outcomes"] = {name: outcome.as_dict() for name, outcome in outcomes.items()}
    record["seconds"] = time.perf_counter() - start
    return record


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
