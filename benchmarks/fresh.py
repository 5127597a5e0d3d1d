"""``python -m benchmarks.fresh memory|first-call|step-memory [...]``: measurements that need a process of their own.

- ``memory BACKEND BATCH ORDER``: hoad's per-sample derivatives of the tanh MLP on BATCH points.
  The first call compiles and is checked (on its first :data:`CHECK_ROWS` samples, against nested
  torch.func); then the memory high-water mark is reset, and the growth of the process's peak
  resident memory over one more call is reported, with that call's time.
- ``first-call``: the tanh MLP's order-3 program at one point, with the default backend: wall
  time of import + compile + first call, from the top of this process. The Inductor cache is
  wherever the environment points (the parent gives it a fresh directory, then the same one again).
- ``step-memory WORKLOAD_ID WAY [DTYPE]``: one column (:func:`benchmarks.operators.ways`) of a
  training-step workload. Its first call (compile included) is checked against the float64
  reference; then the peak memory of one more step is reported: on the CPU the growth of the
  process's resident high-water mark (VmHWM, reset first) over the step, on CUDA the growth of
  torch.cuda.max_memory_allocated over what was allocated before it (JAX's own GPU memory is not
  counted there; the columns measured are torch ones).

:func:`run_fresh` starts such a process from the parent and returns its reply.

The reply is one JSON object on stdout, on a line that starts with :data:`benchmarks.worker.PREFIX`.
Nothing is imported at module level that imports torch: the clock of ``first-call`` starts first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from benchmarks.worker import PREFIX, protocol_channel, summary

CHECK_ROWS = 64  # samples of a large batch that are checked against the reference


def memory(backend: str, batch: int, order: int) -> dict:
    import dataclasses
    import gc

    import hoad
    from benchmarks import workloads
    from benchmarks.peers import HoadOption, hoad_answer, hoad_config
    from benchmarks.reference import compare, reference

    p = workloads.tanh_mlp(order, batch)()
    option = HoadOption(backend, "batch_dim")
    cf = hoad.compile(p.fn, order=order, backend=backend, batch_dim=0)
    start = time.perf_counter()
    answer = hoad_answer(p, cf, option, every_order=True)
    first_call_s = time.perf_counter() - start
    rows = dataclasses.replace(p, args=(p.sample[:CHECK_ROWS],))
    check = compare({K: block[:CHECK_ROWS] for K, block in answer.items()}, reference(rows))
    reply = {"config": hoad_config(cf, option), "first_call_s": first_call_s, "error": check.error,
             "checked_rows": CHECK_ROWS}
    if not check.ok:
        return {**reply, "status": "WRONG", "note": check.note}
    del answer, rows
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    cf(*p.args)
    call_s = time.perf_counter() - start
    return {**reply, "status": "ok", "call_s": call_s, "growth_mb": (_status_kib("VmHWM") - before) / 1024}


def first_call() -> dict:
    start = time.perf_counter()
    from benchmarks.env import pin_one_thread

    pin_one_thread()  # imports torch
    import hoad
    from benchmarks import workloads
    from benchmarks.peers import HoadOption, hoad_answer, hoad_config
    from benchmarks.reference import compare, reference

    p = workloads.tanh_mlp(3, None)()
    cf = hoad.compile(p.fn, order=p.order)
    option = HoadOption(cf.config.backend, "dense")
    answer = hoad_answer(p, cf, option, every_order=True)
    seconds = time.perf_counter() - start
    check = compare(answer, reference(p))
    return {"status": "ok" if check.ok else "WRONG", "seconds": seconds, "config": hoad_config(cf, option),
            "error": check.error, "note": check.note,
            # (whether the cache was the temporary empty one, not its path: no machine paths in results)
            "cache": "temporary" if os.path.basename(os.path.dirname(hoad.cache_dir())).startswith("hoad-cache-")
            else "given"}


def step_memory(workload_id: str, way_name: str, dtype_name: str) -> dict:
    import gc

    import torch

    from benchmarks import operators, workloads
    from benchmarks.reference import compare, reference_of
    from benchmarks.timing import synchronize, synchronize_with

    w = workloads.get(workload_id)
    synchronize_with(w.device)
    dtype = getattr(torch, dtype_name)
    p = w.make(dtype)
    ref = reference_of(w, p, dtype)
    way = operators.way(p, way_name)
    start = time.perf_counter()
    answer, timed = way.build()
    check = compare(answer(), ref)
    synchronize()
    reply = {"config": way.config, "first_call_s": time.perf_counter() - start, "error": check.error}
    if not check.ok:
        return {**reply, "status": "WRONG", "note": check.note}
    del ref
    gc.collect()
    cuda = w.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        before = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    timed()
    synchronize()
    step_s = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024
    what = "torch.cuda.max_memory_allocated growth" if cuda else "VmHWM growth (resident high-water mark)"
    return {**reply, "status": "ok", "step_s": step_s, "peak_mb": (peak - before) / 2**20, "what": what}


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS: resident now; VmHWM: its high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def main(argv: list[str]) -> None:
    send = protocol_channel()
    kind, *args = argv
    try:
        if kind == "memory":
            from benchmarks.env import pin_one_thread

            pin_one_thread()
            backend, batch, order = args
            send(memory(backend, int(batch), int(order)))
        elif kind == "first-call":
            send(first_call())
        elif kind == "step-memory":
            workload_id, way_name, *dtype = args
            from benchmarks.env import configure

            configure("cuda" if workload_id.startswith("cuda/") else "cpu")
            send(step_memory(workload_id, way_name, dtype[0] if dtype else "float64"))
        else:
            raise SystemExit(f"unknown measurement {kind!r}: memory, first-call or step-memory")
    except Exception as e:  # hoad failing is the result
        send({"status": "error", "note": f"{type(e).__name__}: {summary(e)}"})


def run_fresh(args: list[str], timeout_s: float, environ: dict | None = None) -> dict:
    """Run ``python -m benchmarks.fresh ARGS`` and return its reply (a status on failure)."""
    from benchmarks import env

    child = {k: v for k, v in os.environ.items() if k != "HOAD_DEFAULT_BACKEND"}  # the library's default
    child.update(environ or {})
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.fresh", *args], cwd=env.REPO, env=child,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "note": f"no answer within {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX):])
    if done.returncode < 0:
        return {"status": "crash", "note": f"killed by {signal.Signals(-done.returncode).name}"}
    tail = done.stderr.strip().splitlines()[-1:] or [""]
    return {"status": "crash", "note": f"exited with code {done.returncode}: {tail[0][:200]}"}


if __name__ == "__main__":
    main(sys.argv[1:])
