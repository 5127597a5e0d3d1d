"""``python -m benchmarks.fresh memory|first-call [...]``: measurements that need a process of their own.

- ``memory BACKEND BATCH ORDER``: hoad's per-sample derivatives of the tanh MLP on BATCH points.
  The first call compiles and is checked (on its first :data:`CHECK_ROWS` samples, against nested
  torch.func); then the memory high-water mark is reset, and the growth of the process's peak
  resident memory over one more call is reported, with that call's time.
- ``first-call``: the tanh MLP's order-3 program at one point, with the default backend: wall
  time of import + compile + first call, from the top of this process. The Inductor cache is
  wherever the environment points (the parent gives it a fresh directory, then the same one again).

The reply is one JSON object on stdout, on a line that starts with :data:`benchmarks.worker.PREFIX`.
Nothing is imported at module level that imports torch: the clock of ``first-call`` starts first.
"""

from __future__ import annotations

import sys
import time

from benchmarks.worker import protocol_channel

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
            "error": check.error, "note": check.note, "cache": hoad.cache_dir()}


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
        else:
            raise SystemExit(f"unknown measurement {kind!r}: memory or first-call")
    except Exception as e:  # hoad failing is the result
        lines = str(e).strip().splitlines()
        send({"status": "error", "note": f"{type(e).__name__}: {lines[0][:200] if lines else ''}"})


if __name__ == "__main__":
    main(sys.argv[1:])
