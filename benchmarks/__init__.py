"""hoad's benchmark suite: ``python -m benchmarks`` (see ``__main__``).

Modules, one concern each: ``workloads`` (what is differentiated), ``operators`` (the
differential operators and training steps, and every library's way to compute them: hoad, torch.func,
JAX, folx, torch-jet), ``reference`` (nested torch.func, and the check every contender passes),
``peers`` (hoad and the peers, one column each), ``worker`` (torch.compile peers in their own process),
``timing`` (interleaved rounds,
medians), ``runner`` (one workload end to end), ``targets`` (the numbers the issues ask for, each
against its baseline), ``fresh`` (memory and first-call measurements in a process of their own),
``report`` (tables, JSON, the section of docs/benchmarks.md).
Nothing here imports torch at package import: ``env.configure`` (``env.pin_one_thread`` on the
CPU) must run first.
"""
