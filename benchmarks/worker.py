"""``python -m benchmarks.worker WORKLOAD_ID ANSWER_PATH``: the torch.compile peer of one workload.

Runs in its own process because ``torch.compile`` of nested torch.func can crash the
interpreter (order 3 segfaults on torch 2.13 CPU). Protocol, one JSON object per line on the
original stdout, each prefixed ``@@bench `` (stray prints of the libraries go to stderr):

- after the first call: ``{"first_call_s": s}`` (the answer is saved to ANSWER_PATH for the
  parent to check) or ``{"error": ExceptionClass, "message": first line}``;
- then, for each ``{"run": n}`` read from stdin: ``{"seconds": s}`` for n back-to-back calls.

The process ends when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

from benchmarks.env import pin_one_thread


PREFIX = "@@bench "  # marks a protocol line on stdout


def protocol_channel() -> Callable[[dict], None]:
    """``send(message)``: one protocol line on the original stdout; from here on, anything else
    printed to stdout lands on stderr."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(message: dict) -> None:
        protocol.write(PREFIX + json.dumps(message) + "\n")

    return send


def main(workload_id: str, answer_path: str) -> None:
    send = protocol_channel()
    pin_one_thread()
    import torch

    from benchmarks import workloads
    from benchmarks.reference import answer_fn
    from benchmarks.timing import time_calls

    p = workloads.get(workload_id).build()
    compiled = torch.compile(answer_fn(p))
    start = time.perf_counter()
    try:
        answer = compiled(*p.args)
    except Exception as e:  # the error class is the result
        lines = str(e).strip().splitlines()
        send({"error": type(e).__name__, "message": lines[0][:200] if lines else ""})
        return
    first_call_s = time.perf_counter() - start
    torch.save(answer, answer_path)
    send({"first_call_s": first_call_s})
    for line in sys.stdin:
        request = json.loads(line)
        send({"seconds": time_calls(lambda: compiled(*p.args), request["run"])})


if __name__ == "__main__":
    main(*sys.argv[1:3])
