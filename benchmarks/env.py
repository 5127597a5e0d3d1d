"""The measuring environment: one thread everywhere (or the GPU), and a description of the machine.

:func:`configure` (:func:`pin_one_thread` on the CPU) must run before torch or jax is imported:
the thread pools of OpenMP, MKL, OpenBLAS and XLA, and JAX's platform and memory settings, are
read from the environment when they start.
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
    # each program compiled before its first call returns: the timed calls run the compiled program
    "HOAD_COMPILE": "wait",
    "HOAD_PROGRESS": "0",  # (builds say where they are on stderr otherwise)
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


# On the GPU: no affinity mask and no CPU-only JAX (both would hide the device or starve its
# driver threads); JAX allocates on demand instead of taking 75% of the GPU that torch shares, and
# float32 products are computed in float32 by everyone (no TF32 in XLA, cuBLAS or Inductor).
ON_GPU = {
    "HOAD_COMPILE": "wait",
    "HOAD_PROGRESS": "0",
    "JAX_ENABLE_X64": "1",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "JAX_DEFAULT_MATMUL_PRECISION": "highest",
}


def configure(device: str) -> None:
    """The environment of a run on ``device`` ("cpu" or "cuda"); call before importing torch or jax.
    On the CPU everything shares one thread on one core (:func:`pin_one_thread`); on CUDA the
    process keeps its cores, JAX may use the GPU, and float32 matrix products are exact float32."""
    if device == "cpu":
        pin_one_thread()
        return
    os.environ.update(ON_GPU)
    if os.environ.get("JAX_PLATFORMS") == "cpu":  # inherited from a CPU run: would hide the GPU from JAX
        del os.environ["JAX_PLATFORMS"]
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def cuda_problem() -> str | None:
    """Why ``--device cuda`` cannot run here (None when it can)."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = f"torch {torch.__version__} was built without CUDA" if built is None else \
            f"torch {torch.__version__} (CUDA {built}) sees no CUDA device"
        return f"--device cuda needs a CUDA GPU: {why}. Run without --device for the CPU benchmarks."
    return None


def peer_version(distribution: str) -> str | None:
    """An installed distribution's version (None when absent), read without importing it."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def jax_version() -> str | None:
    """The installed JAX version, or None when ``jax`` is not importable."""
    try:
        import jax
    except ImportError:
        return None
    return jax.__version__


def machine(device: str = "cpu") -> dict:
    """CPU, core count, library versions, git commit and the date, for the report header; on CUDA
    also the GPU, its memory, the CUDA and cuDNN versions torch was built with, and JAX's devices."""
    import torch

    import hoad

    record = {
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
        "device": device,
        "folx": peer_version("folx"),
        "torch-jet": peer_version("jet-for-pytorch"),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        record.update({
            "gpu": torch.cuda.get_device_name(0),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "gpu_capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "jax_devices": _jax_devices(),
        })
    return record


def _jax_devices() -> str | None:
    try:
        import jax

        return ", ".join(sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()}))
    except Exception as e:  # noqa: BLE001 - no JAX, or no backend for it: the header says so
        return f"unavailable ({type(e).__name__})"


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
