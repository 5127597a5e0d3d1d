"""The measuring environment: one thread everywhere, and a description of the machine.

:func:`pin_one_thread` must run before torch or jax is imported: the thread pools of OpenMP,
MKL, OpenBLAS and XLA read their sizes from the environment when they start.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "JAX_PLATFORMS": "cpu",
    "JAX_ENABLE_X64": "1",  # the workloads are float64, as is the reference
    # Inductor compiles in this process instead of starting a pool of compile workers.
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}


def pin_one_thread() -> None:
    """Set every thread-count knob to 1 and pin the process to one core (call before importing
    torch or jax). XLA's CPU client keeps worker threads whatever the flags say (measured: 1.5x
    CPU per wall second on a "single-threaded" jax.jit(vmap(hessian))), so the affinity mask is
    what makes every contender share exactly one core."""
    os.environ.update(ONE_THREAD)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or inter-op work already started: harmless either way
        pass


def jax_version() -> str | None:
    """The installed JAX version, or None when ``jax`` is not importable."""
    try:
        import jax
    except ImportError:
        return None
    return jax.__version__


def machine() -> dict:
    """CPU, core count, library versions, git commit and the date, for the report header."""
    import torch

    import hoad

    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "pinned_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "jax": jax_version(),
        "hoad": hoad.__version__,
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        # tracked changes only: a new module matters only once a tracked one imports it
        dirty = subprocess.run(["git", "diff", "HEAD", "--name-only", "--", "hoad", "passes"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")
