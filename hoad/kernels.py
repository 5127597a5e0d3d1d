"""Float64 kernels for CPUs with AVX-512: the operators ``hoad::mm`` and ``hoad::gram``.

Derivative programs multiply many small float64 matrices with short inner dimensions: a
Jacobian [16,64] by a product of weights [64,256], per-sample Jacobians [4096,64] by a [64,64]
layer. MKL runs these at 20-45 GFLOP/s on one core of an AMD EPYC with AVX-512 (it takes its
AVX2 code: MKL chooses by CPU vendor), XLA at 84-94. ``hoad::mm`` is a plain register-blocked
loop, no packing: 4 rows by 32 columns of C in 16 AVX-512 accumulators, or 8 rows by 16 where
16 columns are left; 65-100 GFLOP/s on those shapes (one [16,64]@[64,256] in 6.8 us against
MKL's 14.7, [256,64]@[64,16] in 6.3 against 23.4). It is slower than MKL for other narrow
products (fewer than MIN_COLUMNS columns, other than 16) and no better once operands outgrow the
caches, so Inductor programs use it for float64 on CPU with an inner dimension up to MAX_K; with
more than one thread, MKL keeps the products large enough to parallelize.

``hoad::gram`` computes per-sample Gram matrices G[b] = J[b]^T diag(w[b]) J[b], the
second-order chain rule through an elementwise layer under a batch: each sample's J is copied
into a dense scratch (whatever its strides), then tiles of 8x16 entries of the upper triangle
accumulate in registers and the lower triangle is mirrored. 256 of 16x16 over 64 terms take
0.13-0.17 ms whatever J's layout (one thread), MKL's bmm 0.42-0.6, Inductor's fused reduction
0.27-0.73 depending on J's layout; samples are split between threads when there are several.

Eager programs keep ``aten.mm`` and ``bmm``: they are differentiable by autograd, and these
operators have no derivatives of their own. The library is built once per machine with the
system's C++ compiler against torch's headers (about 10 s) into hoad's cache directory and
loaded as a torch extension. Where that cannot be done (no AVX-512, no compiler, not Linux
x86-64, ``HOAD_DGEMM=0``), :func:`available` is False and programs use ``aten.mm``.
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
MIN_COLUMNS = 32  # narrower ones waste lanes ([64,64]@[64,20]: 8.3 vs MKL 7.9 us); exactly 16 is full 8x16 tiles
MIN_MACS = 2**14  # smaller products take ~1.5 us either way
THREADED_MACS = 2**20  # with more than one thread, MKL takes the products larger than this
GRAM_MIN_N, GRAM_MAX_N = 8, 64  # per-sample Gram sizes measured; smaller ones waste the 16-wide tiles

SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>

// R rows x 8V columns of C in R*V accumulators (4x32 or 8x16: 16); MASKED handles the last
// columns of a row.
template <int R, int V, bool MASKED>
__attribute__((target("avx512f,fma"))) static inline void block(int64_t N, int64_t K, const double* A, const double* B,
                                                                 double* C, const __mmask8* m) {
  __m512d c[R][V];
  for (int r = 0; r < R; r++) for (int v = 0; v < V; v++) c[r][v] = _mm512_setzero_pd();
  for (int64_t k = 0; k < K; k++) {
    const double* b = B + k * N;
    __m512d bv[V];
    for (int v = 0; v < V; v++) bv[v] = MASKED ? _mm512_maskz_loadu_pd(m[v], b + 8 * v) : _mm512_loadu_pd(b + 8 * v);
    for (int r = 0; r < R; r++) {
      __m512d a = _mm512_set1_pd(A[r * K + k]);
      for (int v = 0; v < V; v++) c[r][v] = _mm512_fmadd_pd(a, bv[v], c[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) {
      if (MASKED) _mm512_mask_storeu_pd(C + r * N + 8 * v, m[v], c[r][v]);
      else _mm512_storeu_pd(C + r * N + 8 * v, c[r][v]);
    }
}

// All M rows of one strip of 8V columns: full blocks of R rows, then the rows left.
template <int R, int V, bool MASKED>
__attribute__((target("avx512f,fma"))) static void columns(int64_t M, int64_t N, int64_t K, const double* A,
                                                           const double* B, double* C, const __mmask8* m) {
  int64_t i = 0;
  for (; i + R <= M; i += R) block<R, V, MASKED>(N, K, A + i * K, B, C + i * N, m);
  for (; i + 4 <= M; i += 4) block<4, V, MASKED>(N, K, A + i * K, B, C + i * N, m);
  switch (M - i) {
    case 3: block<3, V, MASKED>(N, K, A + i * K, B, C + i * N, m); break;
    case 2: block<2, V, MASKED>(N, K, A + i * K, B, C + i * N, m); break;
    case 1: block<1, V, MASKED>(N, K, A + i * K, B, C + i * N, m); break;
  }
}

// C[M,N] = A[M,K] @ B[K,N], all row-major and dense.
__attribute__((target("avx512f,fma")))
static void dgemm(int64_t M, int64_t N, int64_t K, const double* A, const double* B, double* C) {
  const __mmask8 full[4] = {0xFF, 0xFF, 0xFF, 0xFF};
  int64_t j = 0;
  if (K * N <= 4096 && N % 32 == 0) {  // B fits L1: each 4 rows of A (also in L1) meet all of it
    int64_t i = 0;
    for (; i + 4 <= M; i += 4)
      for (j = 0; j < N; j += 32) block<4, 4, false>(N, K, A + i * K, B + j, C + i * N + j, full);
    if (i < M) for (j = 0; j < N; j += 32) columns<4, 4, false>(M - i, N, K, A + i * K, B + j, C + i * N + j, full);
    return;
  }
  for (; j + 32 <= N; j += 32) columns<4, 4, false>(M, N, K, A, B + j, C + j, full);
  if (N - j == 16) {
    columns<8, 2, false>(M, N, K, A, B + j, C + j, full);
  } else if (j < N) {
    __mmask8 m[4];
    for (int v = 0; v < 4; v++) {
      int64_t lanes = N - j - 8 * v;
      m[v] = lanes >= 8 ? (__mmask8)0xFF : lanes <= 0 ? (__mmask8)0 : (__mmask8)((1u << lanes) - 1);
    }
    if (N - j <= 16) columns<8, 2, true>(M, N, K, A, B + j, C + j, m);
    else columns<4, 4, true>(M, N, K, A, B + j, C + j, m);
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

// G = S^T diag(w) S for one sample: S [K, NP] row-major, its columns past N zero; G [N, N].
// Rows of G in tiles of 8 by 16 columns (16 accumulators), only the tiles reaching the upper
// triangle; the lower triangle is then copied from the upper one, so G is exactly symmetric.
__attribute__((target("avx512f,fma")))
static void gram_one(int64_t K, int64_t N, int64_t NP, const double* S, const double* w, double* G) {
  for (int64_t i0 = 0; i0 < N; i0 += 8) {
    for (int64_t j0 = i0 / 16 * 16; j0 < N; j0 += 16) {
      __m512d c[8][2];
      for (int r = 0; r < 8; r++) c[r][0] = c[r][1] = _mm512_setzero_pd();
      for (int64_t k = 0; k < K; k++) {
        const double* s = S + k * NP;
        const __m512d wk = _mm512_set1_pd(w[k]);
        const __m512d r0 = _mm512_mul_pd(_mm512_loadu_pd(s + j0), wk);
        const __m512d r1 = _mm512_mul_pd(_mm512_loadu_pd(s + j0 + 8), wk);
        for (int r = 0; r < 8; r++) {
          const __m512d a = _mm512_set1_pd(s[i0 + r]);
          c[r][0] = _mm512_fmadd_pd(a, r0, c[r][0]);
          c[r][1] = _mm512_fmadd_pd(a, r1, c[r][1]);
        }
      }
      const int64_t cols = N - j0;
      const __mmask8 m0 = cols >= 8 ? 0xFF : (__mmask8)((1u << cols) - 1);
      const __mmask8 m1 = cols >= 16 ? 0xFF : cols <= 8 ? 0 : (__mmask8)((1u << (cols - 8)) - 1);
      for (int r = 0; r < 8 && i0 + r < N; r++) {
        _mm512_mask_storeu_pd(G + (i0 + r) * N + j0, m0, c[r][0]);
        _mm512_mask_storeu_pd(G + (i0 + r) * N + j0 + 8, m1, c[r][1]);
      }
    }
  }
  for (int64_t i = 1; i < N; i++)
    for (int64_t j = 0; j < i; j++) G[i * N + j] = G[j * N + i];
}

// dst[c * ld + r] = src[r * rs + c] for r < R, c < C: 8x8 blocks transposed in registers.
__attribute__((target("avx512f")))
static void transpose(int64_t R, int64_t C, const double* src, int64_t rs, double* dst, int64_t ld) {
  const __m512i lo2 = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi2 = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  const __m512i lo4 = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0), hi4 = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
  int64_t r0 = 0;
  for (; r0 + 8 <= R; r0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= C; c0 += 8) {
      __m512d x[8], t[8], u[8];
      for (int i = 0; i < 8; i++) x[i] = _mm512_loadu_pd(src + (r0 + i) * rs + c0);
      for (int i = 0; i < 8; i += 2) {  // t[i]: even columns of rows i, i+1 interleaved; t[i+1]: odd ones
        t[i] = _mm512_unpacklo_pd(x[i], x[i + 1]);
        t[i + 1] = _mm512_unpackhi_pd(x[i], x[i + 1]);
      }
      for (int h = 0; h < 8; h += 4) {  // u: columns {0,4}, {2,6}, {1,5}, {3,7} of four rows
        u[h] = _mm512_permutex2var_pd(t[h], lo2, t[h + 2]);
        u[h + 1] = _mm512_permutex2var_pd(t[h], hi2, t[h + 2]);
        u[h + 2] = _mm512_permutex2var_pd(t[h + 1], lo2, t[h + 3]);
        u[h + 3] = _mm512_permutex2var_pd(t[h + 1], hi2, t[h + 3]);
      }
      const int col[4] = {0, 2, 1, 3};
      for (int i = 0; i < 4; i++) {
        _mm512_storeu_pd(dst + (c0 + col[i]) * ld + r0, _mm512_permutex2var_pd(u[i], lo4, u[i + 4]));
        _mm512_storeu_pd(dst + (c0 + col[i] + 4) * ld + r0, _mm512_permutex2var_pd(u[i], hi4, u[i + 4]));
      }
    }
    for (; c0 < C; c0++)
      for (int64_t r = r0; r < r0 + 8; r++) dst[c0 * ld + r] = src[r * rs + c0];
  }
  for (; r0 < R; r0++)
    for (int64_t c = 0; c < C; c++) dst[c * ld + r0] = src[r0 * rs + c];
}

// G[b] = J[b]^T diag(w[b]) J[b] for J [B, K, N] and w [B, K] of any strides; G [B, N, N].
static at::Tensor gram_cpu(const at::Tensor& J, const at::Tensor& w) {
  TORCH_CHECK(J.dim() == 3 && w.dim() == 2 && w.size(0) == J.size(0) && w.size(1) == J.size(1),
              "hoad::gram: J [B,K,N] and w [B,K] expected, got ", J.sizes(), " and ", w.sizes());
  if (J.scalar_type() != at::kDouble || w.scalar_type() != at::kDouble || !J.device().is_cpu() || !w.device().is_cpu()) {
    at::Tensor jw = J * w.unsqueeze(2);
    return at::bmm(jw.transpose(1, 2), J);
  }
  const int64_t B = J.size(0), K = J.size(1), N = J.size(2), NP = (N + 15) / 16 * 16;
  const int64_t sb = J.stride(0), sk = J.stride(1), sn = J.stride(2), wb = w.stride(0), wk = w.stride(1);
  at::Tensor out = at::empty({B, N, N}, J.options());
  if (out.numel() == 0) return out;
  if (K == 0) return out.zero_();
  const double* jp = J.const_data_ptr<double>();
  const double* wp = w.const_data_ptr<double>();
  double* gp = out.mutable_data_ptr<double>();
  // samples are independent: with more than one thread, each takes a share with its own scratch
  at::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    std::vector<double> S(K * NP, 0.0), ws(K);
    for (int64_t b = begin; b < end; b++) {
      const double* jb = jp + b * sb;
      if (sn == 1) {
        for (int64_t k = 0; k < K; k++) std::memcpy(&S[k * NP], jb + k * sk, N * sizeof(double));
      } else if (sk == 1) {
        transpose(N, K, jb, sn, S.data(), NP);
      } else {
        for (int64_t k = 0; k < K; k++)
          for (int64_t n = 0; n < N; n++) S[k * NP + n] = jb[k * sk + n * sn];
      }
      for (int64_t k = 0; k < K; k++) ws[k] = wp[b * wb + k * wk];
      gram_one(K, N, NP, S.data(), ws.data(), gp + b * N * N);
    }
  });
  return out;
}

TORCH_LIBRARY(hoad, m) {
  m.def("mm(Tensor a, Tensor b) -> Tensor");
  m.def("gram(Tensor J, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(hoad, CPU, m) {
  m.impl("mm", &mm_cpu);
  m.impl("gram", &gram_cpu);
}
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
    # at::parallel_for is OpenMP in torch's headers; the library then shares torch's libgomp
    flags = ["-O3", "-shared", "-fPIC", "-std=c++20", "-fopenmp",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    digest = hashlib.sha256("\\0".join([source, compiler, *flags, torch.__version__]).encode()).hexdigest()[:16]
    where = os.path.join(os.path.dirname(cache_dir()), "kernels")
    path = os.path.join(where, f"hoad_mm-{digest}.so")
    if os.path.exists(path):
        return path
    os.makedirs(where, exist_ok=True)
    log.info("hoad: building its float64 kernels into %s (once per machine, ~10 s)", where)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        src, lib = os.path.join(tmp, "hoad_mm.cpp"), os.path.join(tmp, "hoad_mm.so")
        with open(src, "w") as f:
            f.write(source)
        command = [compiler, *flags, *[f"-I{p}" for p in include_paths()], src, "-o", lib,
                   *[f"-L{p}" for p in library_paths()], "-lc10", "-ltorch_cpu", "-ltorch"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("hoad: the float64 kernels did not build (%s); programs use aten.mm",
                        done.stderr.strip()[-300:])
            return None
        os.replace(lib, path)  # atomic: a concurrent process loads the whole library or builds its own
    log.info("hoad: built the float64 kernels in %.1f s", time.perf_counter() - start)
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
                torch.library.register_fake("hoad::gram")(_gram_shape)
                torch.library.register_autograd("hoad::mm", mm_backward, setup_context=_save_inputs)
                torch.library.register_autograd("hoad::gram", gram_backward, setup_context=_save_inputs)
                _state = True
        except (OSError, RuntimeError) as e:  # unwritable cache, a library that does not load
            log.warning("hoad: the float64 kernels are not available (%s); programs use aten.mm", e)
    return _state


def suits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a program's product ``a @ b`` (2-D) runs faster as ``hoad::mm``."""
    return a.dtype == b.dtype and a.device.type == b.device.type and fits(a, a.shape[0], a.shape[1], b.shape[1])


def fits(like: torch.Tensor, m: int, k: int, n: int) -> bool:
    """Whether a product [m,k]@[k,n] of ``like``'s dtype and device runs faster as ``hoad::mm``."""
    return (like.dtype == torch.float64 and like.device.type == "cpu"
            and 0 < k <= MAX_K and (n >= MIN_COLUMNS or n == 16) and m * k * n >= MIN_MACS and available())


def gram_suits(j: torch.Tensor, k: int, n: int) -> bool:
    """Whether per-sample Gram matrices [n, n] over ``k`` terms of ``j`` run faster as ``hoad::gram``."""
    return (j.dtype == torch.float64 and j.device.type == "cpu" and k > 1
            and GRAM_MIN_N <= n <= GRAM_MAX_N and available())


def _shape(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


def _gram_shape(J: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return J.new_empty((J.shape[0], J.shape[2], J.shape[2]))


# Derivatives of the operators, in aten ops (so they are differentiable again): programs that
# autograd goes through (training under Inductor) may contain them.
def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def mm_backward(ctx, g: torch.Tensor):
    """C = A B: dA = g Bᵀ, dB = Aᵀ g."""
    a, b = ctx.saved_tensors
    return g @ b.mT, a.mT @ g


def gram_backward(ctx, g: torch.Tensor):
    """G[b] = J[b]ᵀ diag(w[b]) J[b]: dJ[b] = diag(w[b]) J[b] (g[b] + g[b]ᵀ), dw[b,k] = (J[b] g[b] J[b]ᵀ)_kk."""
    j, w = ctx.saved_tensors
    dj = (j * w.unsqueeze(2)) @ (g + g.mT)
    dw = ((j @ g) * j).sum(2)
    return dj, dw
