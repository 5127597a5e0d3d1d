"""``python -m benchmarks.worker WORKLOAD_ID ANSWER_PATH [--way NAME] [--dtype DTYPE]``: a torch.compile peer.

Runs in its own process because ``torch.compile`` of nested torch.func can crash the
interpreter (order 3 segfaults on torch 2.13 CPU). Without ``--way`` it compiles the nested
torch.func answer of a derivative workload; with ``--way NAME`` it builds that column of an
operator or training-step workload (:func:`benchmarks.operators.ways`: ``torch.compile``,
``torch-jet compiled``). The workload is built on its own device (the CPU pinned to one thread,
or CUDA) in ``--dtype`` (float64 by default). Protocol, one JSON object per line on the original
stdout, each prefixed ``@@bench `` (stray prints of the libraries go to stderr):

- after the first call: ``{"first_call_s": s}`` (the answer is saved to ANSWER_PATH, on the CPU,
  for the parent to check) or ``{"error": ExceptionClass, "message": first line}``;
- then, for each ``{"run": n}`` read from stdin: ``{"seconds": s}`` for n back-to-back calls.

The process ends when stdin closes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from benchmarks.env import configure

PREFIX = "@@bench "  # marks a protocol line on stdout


def summary(e: BaseException) -> str:
    """An exception's first line, and for a torch.compile failure whose first line is generic
    ("RuntimeError when making fake tensor call") the line naming the error underneath."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    deeper = next((line for line in lines[1:] if "got " in line and "Error(" in line), None)
    if deeper is not None:
        deeper = deeper[deeper.index("got ") + 4:]
        return f"{lines[0][:120]}: {deeper[:200]}"
    return lines[0][:200]


def protocol_channel() -> Callable[[dict], None]:
    """``send(message)``: one protocol line on the original stdout; from here on, anything else
    printed to stdout lands on stderr."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(message: dict) -> None:
        protocol.write(PREFIX + json.dumps(message) + "\n")

    return send


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker")
    parser.add_argument("workload_id")
    parser.add_argument("answer_path")
    parser.add_argument("--way", help="the column of an operator or training-step workload to build")
    parser.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    args = parser.parse_args(argv)
    send = protocol_channel()
    device = "cuda" if args.workload_id.startswith("cuda/") else "cpu"  # the suite, by its id
    configure(device)  # before torch is imported
    import torch

    from benchmarks import operators, workloads
    from benchmarks.reference import answer_fn
    from benchmarks.timing import synchronize, synchronize_with, time_calls

    w = workloads.get(args.workload_id)
    synchronize_with(device)
    try:
        p = w.make(getattr(torch, args.dtype))
        if args.way is None:
            compiled = torch.compile(answer_fn(p))
            answer_of = timed = lambda: compiled(*p.args)  # noqa: E731
        start = time.perf_counter()
        if args.way is not None:
            answer_of, timed = operators.way(p, args.way).build()
        answer = answer_of()
        synchronize()
    except Exception as e:  # the error class is the result
        send({"error": type(e).__name__, "message": summary(e)})
        return
    first_call_s = time.perf_counter() - start
    torch.save({k: v.detach().cpu() for k, v in answer.items()}, args.answer_path)
    send({"first_call_s": first_call_s})
    for line in sys.stdin:
        request = json.loads(line)
        send({"seconds": time_calls(timed, request["run"])})


if __name__ == "__main__":
    main(sys.argv[1:])
