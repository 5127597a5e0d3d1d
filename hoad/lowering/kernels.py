"""Float64 kernels: ``hoad::mm`` and ``hoad::gram`` for CPUs with AVX-512, ``hoad::jet_sqnorm``,
``hoad::jet_mm`` and ``hoad::mm``'s AVX2 twin for CPUs with AVX2 and FMA (the jet kernels in
AVX-512 where the CPU has it).

Derivative programs multiply many small float64 matrices with short inner dimensions: a
Jacobian [16,64] by a product of weights [64,256], per-sample Jacobians [4096,64] by a [64,64]
layer. MKL runs these at 20-45 GFLOP/s on one core of an AMD EPYC with AVX-512 (it takes its
AVX2 code: MKL chooses by CPU vendor), XLA at 84-94. ``hoad::mm`` is a plain register-blocked
loop: 6 or 4 rows by 32 columns of C in 24 or 16 AVX-512 accumulators, or 8 rows by 16 where
16 columns are left; 65-100 GFLOP/s on those shapes (one [16,64]@[64,256] in 6.8 us against
MKL's 14.7, [256,64]@[64,16] in 6.3 against 23.4). The wide layers of the torch-jet paper's
network too: [384,768]@[768,768] at 94-97 GFLOP/s against MKL's 53-56, where XLA's (folx's)
runs 105. A tall A runs in panels of rows (256 KB of A each) that stay in L2 while every strip
of B passes: [3200,768]@[768,768] (a Laplacian's 50 directions at 64 points) 72-84 GFLOP/s,
48 with A streamed whole once per strip. It is slower than MKL for other narrow products (fewer
than MIN_COLUMNS columns, other than 16) and once B outgrows the caches (more than MAX_B_AVX512
entries: [128,1536]@[1536,2048] 45 against 50), so Inductor programs use it for float64 on CPU
with an inner dimension up to MAX_K_AVX512 and B within that; with more than one thread, MKL
keeps the products large enough to parallelize. On CPUs without
AVX-512, ``hoad::mm`` runs an AVX2 kernel of the same plan (6 rows by 8 columns of C in 12
accumulators, B read in place): 30-37 GFLOP/s where MKL runs 8-30 (:func:`suits_avx2`).

``hoad::gram`` computes per-sample Gram matrices G[b] = J[b]^T diag(w[b]) J[b], the
second-order chain rule through an elementwise layer under a batch: each sample's J is copied
into a dense scratch (whatever its strides), then tiles of 8x16 entries of the upper triangle
accumulate in registers and the lower triangle is mirrored. 256 of 16x16 over 64 terms take
0.13-0.17 ms whatever J's layout (one thread), MKL's bmm 0.42-0.6, Inductor's fused reduction
0.27-0.73 depending on J's layout; samples are split between threads when there are several.

``hoad::jet_sqnorm`` computes q[p,m] = Σ_s u[s,m] ((J[p,s] ⊙ c[p]) @ W)[m]², the collapsed
second-order term of a Laplacian at a layer (its jets J scaled by the previous layer's derivative
c, through the layer's weight W, squared and summed over the directions s), as one register-blocked
product (6 rows by 8 columns in 12 AVX2 accumulators) whose result is squared and summed per point
in registers: the jets after the layer, and their scaled operand, are never written.
``hoad::jet_mm`` also returns those jets X [P,S,M], stored once, for a layer whose jets the next
one carries on. Forward-jet Laplacians spend most of their time in that product and, unfused, in
writing and re-reading its operand and result (2 MB each at 256 points, 16 directions, 64 units).
On one core of an AMD EPYC without AVX-512, where it was written: 38-43 GFLOP/s of a 44 peak,
where MKL's product alone runs at 22-39 on the same shapes. On CPUs with AVX-512 both run strips
of 16 columns in 12 AVX-512 accumulators instead (78-92 GFLOP/s on a Xeon's core, the 8-column
strips 49-55, MKL's product alone 64; on an AMD EPYC with AVX-512 the Laplacian of a 16-64-64-1
PINN at 256 points took 0.49-0.51 ms against 0.75-0.77 with the 8-column strips), for layers of
up to JET_MAX_K_MKL512 inputs where MKL runs AVX-512 too (:func:`jets_suit`).

Eager programs keep ``aten.mm`` and ``bmm``. The operators have autograd formulas (in aten ops,
so differentiable again; registered in C++, so a call that needs no gradient costs what an aten
op's does): compiled programs that autograd goes through may contain them. Under autograd,
``jet_sqnorm`` stores its jets (as ``jet_mm``) for the backward. A backward that is not itself
differentiated (AOTAutograd traces a training compile's backward as one) runs both operators'
formulas as ``hoad::jets_grad``: rows in chunks that stay in the L2 cache, MKL's products over
whole chunks and the elementwise terms in loops. A Laplacian's training step (16-64-64-1, 256
points, one thread) took 4.4 ms through the aten formula under Inductor and takes 2.9. The
library (``kernels.cpp`` beside this file) is built once per machine by
``torch.utils.cpp_extension`` (its caching, locking and ABI flags) into hoad's cache directory:
about 40 s of gcc on 2 cores, then about a second to load in each process. With
``HOAD_COMPILE=background`` (the default) a first build runs on a thread beside the programs,
which use aten's products until the library is loaded; with ``HOAD_COMPILE=wait`` it is built
before a program that may use it is traced. Never in the middle of a trace. Where it
cannot be built or loaded (no AVX2, no compiler or ninja, not Linux x86-64, an unwritable cache,
``HOAD_DGEMM=0``), :func:`available` and :func:`avx2_available` are False and programs keep aten
ops; without AVX-512 only :func:`available` is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import threading
from pathlib import Path

import torch

from hoad.errors import InvalidArgumentError
from hoad.tiers import background_command

log = logging.getLogger("hoad")

MAX_K = 256  # longer inner dimensions: MKL's packed kernels win over the AVX2 kernel
# the AVX-512 kernel, one core of an AMD EPYC (GFLOP/s, MKL/hoad): it won on every shape with
# k <= 2048 and k*n <= 2**21 ([1024,768]@[768,768] 57/94, [4096,2048]@[2048,32] 17/97,
# [1024,1024]@[1024,2048] 57/57); B larger than that lost ([128,2048]@[2048,2048] 50/42)
MAX_K_AVX512, MAX_B_AVX512 = 2048, 2**21
MIN_COLUMNS = 32  # narrower ones waste lanes ([64,64]@[64,20]: 8.3 vs MKL 7.9 us); exactly 16 is full 8x16 tiles
MIN_COLUMNS_AVX2 = 8  # one strip of the AVX2 kernel ([256,64]@[64,8]: 9 us, MKL 31)
MAX_COPIED = 64 * 64  # a non-contiguous operand the AVX2 kernel copies dense first: a weight's size
# wider products than this, and larger than WIDE_MACS, run faster in MKL: the AVX2 kernel reads B in
# strips of 8 columns a row apart ([64,64]@[64,2048] 0.49 vs 0.46 ms, @[64,4096] 1.22 vs 0.90,
# [256,64]@[64,512] 0.49 vs 0.45; [256,128]@[128,256] ties, 128 columns or fewer win)
MAX_COLUMNS_AVX2, WIDE_MACS = 256, 2**21
MIN_MACS = 2**14  # smaller products take ~1.5 us either way
THREADED_MACS = 2**20  # with more than one thread, MKL takes the products larger than this
GRAM_MIN_N, GRAM_MAX_N = 8, 64  # per-sample Gram sizes measured; smaller ones waste the 16-wide tiles
JET_MAX_K_MKL512 = 256  # inputs of the layers the jet kernels take where MKL runs AVX-512 (jets_suit)

SOURCE = Path(__file__).with_name("kernels.cpp")
_state: bool | None = None  # the library is built and loaded; None: not tried yet (or building)
_building: threading.Thread | None = None  # the background build, once started (HOAD_COMPILE=background)
_lock = threading.Lock()
_mkl_avx512: bool | None = None  # mkl_avx512(), once read


def cache_root() -> str:
    """hoad's cache directory: ``$HOAD_CACHE_DIR``, by default ``~/.cache/hoad`` (kept across
    reboots, unlike Inductor's own default under /tmp): the kernels here, Inductor's programs
    beside them (:func:`hoad.lowering.inductor.cache_dir`)."""
    return os.environ.get("HOAD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hoad")


def _build_directory() -> str:
    return os.path.join(cache_root(), "kernels")


FLAGS = ["-O3", "-std=c++20", "-fopenmp", f"-DHOAD_THREADED_MACS={THREADED_MACS}",
         f"-DHOAD_MAX_K_AVX512={MAX_K_AVX512}", f"-DHOAD_MAX_B_AVX512={MAX_B_AVX512}",
         f"-DHOAD_MIN_COLUMNS={MIN_COLUMNS}", f"-DHOAD_MIN_MACS={MIN_MACS}"]


def _library() -> tuple[str, str]:
    """(name, build directory) of the library: the name carries the source, the flags and torch's
    version, so a changed kernel never reuses a stale library."""
    key = SOURCE.read_bytes() + " ".join(FLAGS).encode() + torch.__version__.encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return f"hoad_kernels_{digest}", os.path.join(_build_directory(), digest)


def built() -> bool:
    """Whether the library is on disk already (loading it then takes about a second)."""
    name, where = _library()
    return os.path.exists(os.path.join(where, f"{name}.so"))


def build() -> bool:
    """Build (or find built) and load the library; False where that cannot be done here."""
    from torch.utils.cpp_extension import load

    flags = FLAGS
    name, where = _library()
    os.makedirs(where, exist_ok=True)
    log.info("hoad: loading its float64 kernels (built once per machine into %s, 30-60 s)", where)
    load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
         build_directory=where, is_python_module=False, verbose=False)
    torch.library.register_fake("hoad::mm")(_shape)
    torch.library.register_fake("hoad::gram")(_gram_shape)
    torch.library.register_fake("hoad::jet_sqnorm")(_jet_sqnorm_shape)
    torch.library.register_fake("hoad::jet_mm")(_jet_mm_shape)
    torch.library.register_fake("hoad::jets_grad")(_jets_grad_shape)
    return True


def available() -> bool:
    """Whether ``torch.ops.hoad.mm`` and ``hoad.gram`` run the AVX-512 kernels here (the library is
    built and loaded on the first call; call it before tracing)."""
    return _loaded() and _avx512()


def avx2_available() -> bool:
    """Whether ``torch.ops.hoad.jet_sqnorm`` and ``jet_mm`` run their AVX2 kernel here (as
    :func:`available`)."""
    return _loaded()


def _avx512() -> bool:
    """The library is loaded (never builds) and this CPU runs its AVX-512 kernels."""
    return bool(_state) and torch.backends.cpu.get_cpu_capability() == "AVX512"


def _loaded() -> bool:
    global _state, _building
    if _state is None:
        if not (os.environ.get("HOAD_DGEMM", "1") != "0" and platform.system() == "Linux"
                and platform.machine() == "x86_64" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")):
            _state = False
        elif in_background() and not built():
            # a first build (30-60 s of gcc) runs beside the programs, which use aten products
            # until the library is loaded: never on the critical path of a first call
            with _lock:
                if _building is None:
                    log.info("hoad: building its float64 kernels in the background (once per machine, 30-60 s); "
                             "programs built before they are ready use aten's products")
                    _building = threading.Thread(target=_build_beside, name="hoad-kernels", daemon=True)
                    _building.start()
            return False
        else:
            _settle()
    return bool(_state)


def in_background() -> bool:
    """Whether builds run in the background while the calls go on (``HOAD_COMPILE=background``,
    the default): Inductor's compiles beside the eager program, the library's first build beside
    programs that use aten's products. ``HOAD_COMPILE=wait`` waits for each (benchmarks, and the
    tests of compiled programs)."""
    mode = os.environ.get("HOAD_COMPILE", "background")
    if mode not in ("background", "wait"):
        raise InvalidArgumentError(f"HOAD_COMPILE must be 'background' or 'wait', got {mode!r}")
    return mode == "background"


def _build_beside() -> None:
    """Build the library in a process of its own, then load it here. The process outlives this
    one (its own session): a script that ends before the build does still leaves the library
    built for the next, where a build in a thread of this process would die with it and leave
    cpp_extension's lock behind (every later build waits on that lock for ever)."""
    _build_in_a_process()
    _settle()


def _build_in_a_process() -> None:
    code = "import sys; from hoad.lowering import kernels; sys.exit(0 if kernels.build() else 1)"
    try:
        subprocess.run(background_command(code), start_new_session=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, env=dict(os.environ, HOAD_COMPILE="wait"), check=False)
    except OSError:
        pass  # (no interpreter to start: the load after it builds, or says why not)


def _settle() -> None:
    global _state
    try:
        state = build()
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, unwritable cache, a failed load
        log.warning("hoad: the float64 kernels are not available (%s: %s); programs use aten ops",
                    type(e).__name__, str(e).strip().splitlines()[-1][:300] if str(e).strip() else "")
        state = False
    _state = state


def wait_for_build(timeout: float | None = None) -> bool:
    """Block until a background build of the library is over (True; at once when none runs)."""
    thread = _building
    if thread is not None:
        thread.join(timeout)
        return not thread.is_alive()
    return True


def suits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a program's product ``a @ b`` (2-D) runs faster as ``hoad::mm``."""
    return a.dtype == b.dtype and a.device.type == b.device.type and fits(a, a.shape[0], a.shape[1], b.shape[1])


def fits(like: torch.Tensor, m: int, k: int, n: int) -> bool:
    """Whether a product [m,k]@[k,n] of ``like``'s dtype and device runs faster as ``hoad::mm``
    (``available()`` must have been asked before: this never builds). Not where MKL runs its own
    AVX-512 code (:func:`mkl_avx512`): on a Xeon with AVX-512, one core, MKL was 3-40% faster on
    every shape measured ([16,64]@[64,256] 5.7 vs 7.3 us, [256,64]@[64,64] 19.7 vs 20.7,
    [64,64]@[64,4096] 338 vs 436, [4096,64]@[64,64] 338 vs 374)."""
    return (_short_product(like, m, k, n, MAX_K_AVX512) and k * n <= MAX_B_AVX512 and (n >= MIN_COLUMNS or n == 16)
            and _avx512() and not mkl_avx512())


def mm_used() -> bool:
    """Whether programs laid out for Inductor run products as ``hoad::mm`` here (its AVX-512
    kernel where MKL does not run AVX-512 code, or its AVX2 kernel; as :func:`fits`)."""
    return _loaded() and not (_avx512() and mkl_avx512())


def mkl_avx512() -> bool:
    """torch's BLAS is MKL and runs its AVX-512 code here: an Intel CPU with AVX-512 (MKL picks its
    code by vendor and takes AVX2 on AMD's, where hoad's kernels were tuned)."""
    global _mkl_avx512
    if _mkl_avx512 is None:
        try:
            with open("/proc/cpuinfo") as f:
                intel = any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
        except OSError:
            intel = False
        _mkl_avx512 = (intel and torch.backends.mkl.is_available()
                       and torch.backends.cpu.get_cpu_capability() == "AVX512")
    return _mkl_avx512


def jets_suit(k: int) -> bool:
    """Whether a layer's jets with ``k`` inputs run faster through ``hoad::jet_sqnorm``/``jet_mm``
    than through MKL's product and Inductor's kernels. Everywhere MKL takes AVX2; where it runs
    AVX-512 (:func:`mkl_avx512`, where the jet kernels run their AVX-512 strips too) up to
    JET_MAX_K_MKL512 inputs, as measured on a Xeon, one core, against the aten ops: 256 points,
    16 directions, 64 to 64 units 0.45 vs 0.79 ms; 50 directions at 64 points, 128 units 4.8 vs
    7.3, 256 units 4.4-4.9 vs 5.3. Wider layers gain nothing (384 units 11.2 vs 10.8-11.3, 512
    18.7-21.0 vs 19.5-19.9, 768 42.7-43.1 vs 42.1-42.5, with the inner dimension in chunks of 128
    shared by 192 rows; without the chunks 768 took 61.5)."""
    return k <= JET_MAX_K_MKL512 or not mkl_avx512()


def _short_product(like: torch.Tensor, m: int, k: int, n: int, max_k: int = MAX_K) -> bool:
    """A float64 CPU product with an inner dimension up to ``max_k``, not too small to gain: what
    either kernel of ``hoad::mm`` asks first."""
    return like.dtype == torch.float64 and like.device.type == "cpu" and 0 < k <= max_k and m * k * n >= MIN_MACS


def suits_avx2(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a program's product ``a @ b`` (2-D) runs faster as ``hoad::mm`` through its AVX2
    kernel (6 rows by 8 columns in 12 accumulators), on a CPU without AVX-512. Every float64 shape
    with 8 to 256 columns measured beat MKL's (which runs its AVX2 code here too), one core:
    [256,64]@[64,64] 56 us against 83, [256,64]@[64,16] 16 against 42, [16,64]@[64,256] 16 against
    23, [1024,64]@[64,64] 236 against 327; the smallest ones tie. Not for one row (MKL's is as
    fast), nor for large products wider than MAX_COLUMNS_AVX2 (MKL's are faster), nor where an
    operand would be copied dense first and is larger than a layer's weight: MKL reads a
    transposed one in place, and the copy of a [64,256] one takes 19 us, more than hoad's whole
    [16,64]@[64,256] (15 us; MKL's 20). Such a product runs transposed instead where that needs
    no copy (``hoad.passes.lower.lower_products``)."""
    (m, k), n = a.shape, b.shape[1]
    return (a.dtype == b.dtype and a.device.type == b.device.type and _short_product(a, m, k, n)
            and n >= MIN_COLUMNS_AVX2 and m > 1 and all(t.is_contiguous() or t.numel() <= MAX_COPIED for t in (a, b))
            and (n <= MAX_COLUMNS_AVX2 or m * k * n <= WIDE_MACS) and _loaded() and not _avx512())


def gram_suits(j: torch.Tensor, k: int, n: int) -> bool:
    """Whether per-sample Gram matrices [n, n] over ``k`` terms of ``j`` run faster as ``hoad::gram``."""
    return (j.dtype == torch.float64 and j.device.type == "cpu" and k > 1
            and GRAM_MIN_N <= n <= GRAM_MAX_N and _avx512())


def _shape(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


def _gram_shape(J: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return J.new_empty((J.shape[0], J.shape[2], J.shape[2]))


def _jet_sqnorm_shape(J: torch.Tensor, c: torch.Tensor, W: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    return c.new_empty((c.shape[0], W.shape[1]))


def _jet_mm_shape(J: torch.Tensor, c: torch.Tensor, W: torch.Tensor, u: torch.Tensor | None = None):
    return c.new_empty((c.shape[0], J.shape[-2], W.shape[1])), c.new_empty((c.shape[0], W.shape[1]))


def _jets_grad_shape(J: torch.Tensor, c: torch.Tensor, W: torch.Tensor, u: torch.Tensor | None,
                     X: torch.Tensor | None, gX: torch.Tensor | None, gq: torch.Tensor | None):
    du = c.new_empty(u.shape if u is not None else (0,))
    return J.new_empty(J.shape), c.new_empty(c.shape), W.new_empty(W.shape), du
