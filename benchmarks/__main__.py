"""``python -m benchmarks [--quick] [--targets] [--only SUBSTRING] [--peers NAMES] [--write-docs] [--no-compile]
[--device cuda [--dtype D]]``

Runs the workloads (:mod:`benchmarks.workloads`) against every peer on one thread, then the
targets the issues set (:mod:`benchmarks.targets`), prints the tables, writes
``benchmarks/results/<stamp>-<mode>.json`` and ``latest.json``, and with ``--write-docs``
regenerates the results section of docs/benchmarks.md. ``--device cuda`` runs the GPU-sized workloads
instead (no targets: they are set for the pinned CPU thread), in ``--dtype`` (float32 by default
there; the CPU suite is float64). ``--peers`` runs the named columns alone (hoad's among them),
for a GPU lease too short for every peer's compile. The results file is rewritten after each
workload, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import sys
import time

from benchmarks.env import configure


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[1])
    parser.add_argument("--quick", action="store_true", help="a few points per workload, short timing (< 5 min)")
    parser.add_argument("--targets", action="store_true", help="run only the targets the issues set (no workloads)")
    parser.add_argument("--only", metavar="SUBSTRING",
                        help="run the workloads whose id contains SUBSTRING, or any of several comma-separated "
                             "(and no targets)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peers")
    parser.add_argument("--peers", metavar="NAMES",
                        help="comma-separated columns to run, the others left out "
                             "(e.g. 'hoad,folx,torch-jet compiled')")
    parser.add_argument("--write-docs", action="store_true", help="replace the results section of docs/benchmarks.md")
    parser.add_argument("--list", action="store_true", help="list the workload ids and the targets, and exit")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU-sized workloads on the first CUDA device (default: cpu, one thread)")
    parser.add_argument("--dtype", choices=("float32", "float64"),
                        help="of the contenders with --device cuda (default float32; the reference is float64)")
    args = parser.parse_args(argv)
    if args.dtype == "float32" and args.device == "cpu":
        parser.error("the CPU suite is float64 (its targets are set there); --dtype float32 needs --device cuda")
    if args.write_docs and (args.only or args.targets):
        parser.error("--write-docs needs the whole suite; drop --only and --targets")
    if args.only and args.targets:
        parser.error("--only selects workloads and --targets runs no workloads: use one of them")

    if args.peers and (args.targets or args.write_docs):
        parser.error("--peers leaves columns out: the targets and docs/benchmarks.md need them all")
    if args.device == "cuda" and args.targets:
        parser.error("the targets are measured on the pinned CPU thread: drop --device cuda or --targets")

    faulthandler.enable()  # should hoad itself crash the process, show where
    configure(args.device)  # before torch or jax is imported anywhere below
    from benchmarks import env, report, targets, workloads
    from benchmarks.runner import Settings, run_workload
    from benchmarks.timing import FULL, QUICK, synchronize_with

    chosen = [] if args.targets else workloads.select(args.quick, args.only, args.device)
    if args.list:
        print("\n".join(f"{w.id}{'  (quick)' if w.quick else ''}" for w in chosen))
        if not args.only and args.device == "cpu":
            print("\n".join(f"target {t.row} (issue {t.issue}): {line.hoad}" for t in targets.TARGETS
                            for line in t.lines))
        return 0
    if args.only and not chosen:
        parser.error(f"no workload id contains {args.only!r} (see --list)")
    if args.device == "cuda":
        problem = env.cuda_problem()
        if problem:
            print(f"python -m benchmarks: {problem}", file=sys.stderr)
            return 2
    import torch

    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cuda" else "float64"))
    synchronize_with(args.device)
    settings = Settings(quick=args.quick, budget=QUICK if args.quick else FULL, compile_peers=not args.no_compile,
                        compile_timeout_s=180.0 if args.quick else 600.0, dtype=dtype,
                        peers=tuple(name.strip() for name in args.peers.split(",")) if args.peers else None)
    start = time.perf_counter()
    mode = "targets" if args.targets else "quick" if args.quick else "full"
    results = {"machine": env.machine(args.device), "mode": mode + ("-cuda" if args.device == "cuda" else ""),
               "command": " ".join(["python -m benchmarks", *argv]), "only": args.only,
               "device": args.device, "dtype": str(dtype).removeprefix("torch."),
               "stamp": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "workloads": []}
    for i, w in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {w.id}", file=sys.stderr, flush=True)
        results["workloads"].append(run_workload(w, settings))
        results["seconds"] = time.perf_counter() - start
        report.write_results(results)  # so far: a run cut short keeps what it measured
    if not args.only and args.device == "cpu":
        results["targets"] = targets.run_targets(settings, results["workloads"])
    results["seconds"] = time.perf_counter() - start

    print(report.render(results))
    path = report.write_results(results)
    print(f"\nresults: {path.relative_to(env.REPO)} (and latest.json)")
    if args.write_docs:
        report.write_doc(results)
        print("docs/benchmarks.md: results section regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
