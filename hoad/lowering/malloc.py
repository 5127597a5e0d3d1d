"""Memory: keep freed blocks in glibc's heap, so that each call of a program does not page-fault
its intermediates back in."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

log = logging.getLogger("hoad")

# glibc's malloc returns the large blocks a program frees to the OS (munmap, heap trimming), so
# the next call page-faults its intermediates back in: Inductor allocates every buffer of every
# call afresh. Measured on the per-sample Hessian of a 16-64-64-1 MLP (256 samples): 800-1500
# minor faults per call in most processes, 3.6-6.3 ms per call instead of 2.0-2.3 ms.
# Keeping freed blocks up to this size in the heap removes the faults.
KEEP_FREED_BYTES = 32 * 2**20  # glibc's largest mmap threshold on 64-bit
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
_malloc_tuned: bool | None = None


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks for reuse instead of returning them to the OS.

    Process-wide, once, on Linux with glibc only; left alone when ``HOAD_MALLOC=system`` or when
    the process already tunes malloc through glibc's ``MALLOC_*_`` variables. The cost is that the
    process's resident memory does not shrink after a large call. Returns whether it applied.
    """
    global _malloc_tuned
    if _malloc_tuned is not None:
        return _malloc_tuned
    _malloc_tuned = False
    if (os.environ.get("HOAD_MALLOC", "").lower() == "system" or any(v in os.environ for v in _MALLOC_ENV)
            or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    _malloc_tuned = bool(libc.mallopt(m_mmap_threshold, KEEP_FREED_BYTES)) and bool(
        libc.mallopt(m_trim_threshold, 2 * KEEP_FREED_BYTES))
    if _malloc_tuned:
        log.info("hoad: glibc malloc keeps freed blocks up to %d MB for reuse (HOAD_MALLOC=system leaves it alone)",
                 KEEP_FREED_BYTES >> 20)
    return _malloc_tuned
