"""A float64 matrix product for CPUs with AVX-512: the operator ``hoad::mm``.

Derivative programs multiply many small float64 matrices with short inner dimensions: a
Jacobian [16,64] by a product of weights [64,256], a [64,64] layer by per-sample Jacobians
[64,4096]. MKL runs these at 33-45 GFLOP/s on one core of an AMD EPYC with AVX-512 (it takes
its AVX2 code: MKL chooses by CPU vendor), XLA at 84-94. The kernel below is a plain register-blocked loop, 4 rows
by 32 columns of C in 16 AVX-512 accumulators, no packing: 65-100 GFLOP/s on those shapes (one
[16,64]@[64,256] in 8.1 us against MKL's 15.7), but slower than MKL for narrow products (fewer
than MIN_COLUMNS columns), and no better once operands outgrow the caches. So Inductor programs
use it for float64 on CPU with an inner dimension up to MAX_K; with more than one thread, MKL
keeps the products large enough to parallelize. Eager programs keep ``aten.mm``: they are
differentiable by autograd, and this operator has no derivative of its own.

It is built once per machine with the system's C++ compiler against torch's headers (about 10 s)
into hoad's cache directory and loaded as a torch extension. Where that cannot be done (no
AVX-512, no compiler, not Linux x86-64, ``HOAD_DGEMM=0``), :func:`available` is False and
programs use ``aten.mm``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time

import torch

log = logging.getLogger("hoad")

MAX_K = 256  # longer inner dimensions: MKL's packed kernels win
MIN_COLUMNS = 32  # narrower products waste AVX-512 lanes: MKL is faster ([64,64]@[64,16]: 8.2 vs 6.6 us)
MIN_MACS = 2**14  # smaller products take ~1.5 us either way
THREADED_MACS = 2**20  # with more than one thread, MKL takes the products larger than this

SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// 4 rows x 32 columns of C in 16 accumulators; MASKED handles the last columns of a row.
template <int R, bool MASKED>
__attribute__((target("avx512f,fma"))) static inline void block(int64_t N, int64_t K, const double* A, const double* B,
                                                                 double* C, const __mmask8* m) {
  __m512d c[R][4];
  for (int r = 0; r < R; r++) for (int v = 0; v < 4; v++) c[r][v] = _mm512_setzero_pd();
  for (int64_t k = 0; k < K; k++) {
    const double* b = B + k * N;
    __m512d bv[4];
    for (int v = 0; v < 4; v++) bv[v] = MASKED ? _mm512_maskz_loadu_pd(m[v], b + 8 * v) : _mm512_loadu_pd(b + 8 * v);
    for (int r = 0; r < R; r++) {
      __m512d a = _mm512_set1_pd(A[r * K + k]);
      for (int v = 0; v < 4; v++) c[r][v] = _mm512_fmadd_pd(a, bv[v], c[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < 4; v++) {
      if (MASKED) _mm512_mask_storeu_pd(C + r * N + 8 * v, m[v], c[r][v]);
      else _mm512_storeu_pd(C + r * N + 8 * v, c[r][v]);
    }
}

template <bool MASKED>
__attribute__((target("avx512f,fma"))) static void columns(int64_t M, int64_t N, int64_t K, const double* A,
                                                           const double* B, double* C, const __mmask8* m) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) block<4, MASKED>(N, K, A + i * K, B, C + i * N, m);
  switch (M - i) {
    case 3: block<3, MASKED>(N, K, A + i * K, B, C + i * N, m); break;
    case 2: block<2, MASKED>(N, K, A + i * K, B, C + i * N, m); break;
    case 1: block<1, MASKED>(N, K, A + i * K, B, C + i * N, m); break;
  }
}

// C[M,N] = A[M,K] @ B[K,N], all row-major and dense.
__attribute__((target("avx512f,fma")))
static void dgemm(int64_t M, int64_t N, int64_t K, const double* A, const double* B, double* C) {
  const __mmask8 full[4] = {0xFF, 0xFF, 0xFF, 0xFF};
  int64_t j = 0;
  for (; j + 32 <= N; j += 32) columns<false>(M, N, K, A, B + j, C + j, full);
  if (j < N) {
    __mmask8 m[4];
    for (int v = 0; v < 4; v++) {
      int64_t lanes = N - j - 8 * v;
      m[v] = lanes >= 8 ? (__mmask8)0xFF : lanes <= 0 ? (__mmask8)0 : (__mmask8)((1u << lanes) - 1);
    }
    columns<true>(M, N, K, A, B + j, C + j, m);
  }
}

static at::Tensor mm_cpu(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "hoad::mm: shapes ", a.sizes(), " and ",
              b.sizes(), " cannot be multiplied");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (a.scalar_type() != at::kDouble || b.scalar_type() != at::kDouble || !a.device().is_cpu() ||
      !b.device().is_cpu() || (M * K * N > THREADED_MACS && at::get_num_threads() > 1))
    return at::mm(a, b);
  at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = at::empty({M, N}, a.options());
  if (out.numel()) dgemm(M, N, K, ac.const_data_ptr<double>(), bc.const_data_ptr<double>(), out.mutable_data_ptr<double>());
  return out;
}

TORCH_LIBRARY(hoad, m) { m.def("mm(Tensor a, Tensor b) -> Tensor"); }
TORCH_LIBRARY_IMPL(hoad, CPU, m) { m.impl("mm", &mm_cpu); }
"""

_state: bool | None = None  # None: not tried yet


def _build() -> str | None:
    """Path of the compiled extension, building it first if this machine has none yet."""
    if os.environ.get("HOAD_DGEMM", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None
    from torch.utils.cpp_extension import include_paths, library_paths

    from hoad.passes.compile import cache_dir

    source = SOURCE.replace("THREADED_MACS", str(THREADED_MACS))
    digest = hashlib.sha256("\\0".join([source, compiler, torch.__version__]).encode()).hexdigest()[:16]
    where = os.path.join(os.path.dirname(cache_dir()), "kernels")
    path = os.path.join(where, f"hoad_mm-{digest}.so")
    if os.path.exists(path):
        return path
    os.makedirs(where, exist_ok=True)
    log.info("hoad: building its float64 matrix kernel into %s (once per machine, ~10 s)", where)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        src, lib = os.path.join(tmp, "hoad_mm.cpp"), os.path.join(tmp, "hoad_mm.so")
        with open(src, "w") as f:
            f.write(source)
        command = [compiler, "-O3", "-shared", "-fPIC", "-std=c++20",
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   *[f"-I{p}" for p in include_paths()], src, "-o", lib,
                   *[f"-L{p}" for p in library_paths()], "-lc10", "-ltorch_cpu", "-ltorch"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("hoad: the float64 matrix kernel did not build (%s); programs use aten.mm",
                        done.stderr.strip()[-300:])
            return None
        os.replace(lib, path)  # atomic: a concurrent process loads the whole library or builds its own
    log.info("hoad: built the float64 matrix kernel in %.1f s", time.perf_counter() - start)
    return path


def available() -> bool:
    """Whether ``torch.ops.hoad.mm`` runs the AVX-512 kernel here (built and loaded on first use)."""
    global _state
    if _state is None:
        _state = False
        try:
            path = _build()
            if path is not None:
                torch.ops.load_library(path)
                torch.library.register_fake("hoad::mm")(_shape)
                _state = True
        except (OSError, RuntimeError) as e:  # unwritable cache, a library that does not load
            log.warning("hoad: the float64 matrix kernel is not available (%s); programs use aten.mm", e)
    return _state


def suits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a program's product ``a @ b`` (2-D) runs faster as ``hoad::mm``."""
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    return (a.dtype == b.dtype == torch.float64 and a.device.type == b.device.type == "cpu"
            and 0 < k <= MAX_K and n >= MIN_COLUMNS and m * k * n >= MIN_MACS and available())


def _shape(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))
