"""``main(JOB)`` (or ``python -m hoad.warm JOB``): run one background compile in a process of its own, to fill
Inductor's cache (:func:`hoad.tiers._in_a_child` writes JOB, a pickled ``(module, function,
arguments)``, and reads back only the exit status and, where it failed, the output). The process
runs as background work beside the user's (:func:`hoad.tiers.background_command`)."""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import sys


def main(path: str) -> None:
    import hoad  # noqa: F401 - registers hoad's operators, which the programs call
    from hoad.lowering import kernels

    if kernels.built():  # (its operators exist once it is loaded; a program of the parent's may call them)
        kernels.avx2_available()

    with open(path, "rb") as f:
        module, function, arguments = pickle.load(f)
    os.remove(path)
    getattr(importlib.import_module(module), function)(*arguments)
    with contextlib.suppress(OSError):  # (its output, kept only where it failed)
        os.remove(path[: -len(".job")] + ".log")


if __name__ == "__main__":
    main(sys.argv[1])
