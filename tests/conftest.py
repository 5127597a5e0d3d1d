"""Test-wide settings: run programs eagerly unless a test asks for Inductor (compiles cost seconds),
and compile in the foreground (tests of compiled programs check what Inductor built; the tiered
path, HOAD_COMPILE=background, has its own tests), with no progress reports."""

import os

os.environ.setdefault("HOAD_DEFAULT_BACKEND", "eager")
os.environ.setdefault("HOAD_COMPILE", "wait")
os.environ.setdefault("HOAD_PROGRESS", "0")  # (builds' progress reports have their own tests)


def pytest_configure(config):
    """On a machine where hoad's float64 kernels were never built (a fresh CI runner), start their
    build (15-40 s of gcc) now, in a process of its own, beside the eager tests: the first compiled
    program of each worker waited for it otherwise (HOAD_COMPILE=wait), the other worker idle on
    its lock. Once per run: in the controller of xdist's workers, or in a run without them."""
    import subprocess
    import sys

    if hasattr(config, "workerinput"):
        return
    code = "from hoad.lowering import kernels; kernels.avx2_available()"  # (builds where it can, else nothing)
    subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, env=dict(os.environ, HOAD_COMPILE="wait"))
