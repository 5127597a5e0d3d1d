"""``main(JOB, ...)`` (or ``python -m hoad.warm JOB ...``): run background compiles in a process of its own, to fill
Inductor's cache (:func:`hoad.tiers._in_a_child` writes JOB, a pickled ``(module, function,
arguments)``, and reads back only the exit status and, where it failed, the output). The process
runs as background work beside the user's (:func:`hoad.tiers.background_command`)."""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import sys
import traceback


def main(*paths: str) -> None:
    """Run each JOB in turn (several: those a process handed over as it ended); exit status 1 if
    one failed, with its traceback in the output."""
    import hoad  # noqa: F401 - registers hoad's operators, which the programs call
    from hoad.lowering import kernels

    if kernels.built():  # (its operators exist once it is loaded; a program of the parent's may call them)
        kernels.avx2_available()

    failed = False
    for path in paths:
        with open(path, "rb") as f:
            module, function, arguments = pickle.load(f)
        os.remove(path)
        try:
            getattr(importlib.import_module(module), function)(*arguments)
        except Exception:  # noqa: BLE001 - the others still run; the status says one failed
            traceback.print_exc()
            failed = True
    if failed:
        sys.exit(1)
    for path in paths:  # (the output, kept only where a job failed)
        with contextlib.suppress(OSError):
            os.remove(path[: -len(".job")] + ".log")


if __name__ == "__main__":
    main(*sys.argv[1:])
