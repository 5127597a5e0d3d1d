// hoad's float64 kernels: hoad::mm and hoad::gram for CPUs with AVX-512, hoad::jet_sqnorm and
// hoad::jet_mm for CPUs with AVX2 and FMA.
// Built once per machine by hoad/lowering/kernels.py (torch.utils.cpp_extension), loaded as a
// torch library; programs lowered for Inductor call them (see hoad/lowering/inductor.py).

#ifndef HOAD_PANEL_BYTES
#define HOAD_PANEL_BYTES (256 << 10)  // rows of A per pass over B (see dgemm)
#endif
#ifndef HOAD_THREADED_MACS
#define HOAD_THREADED_MACS (1 << 20)  // with more than one thread, MKL takes larger products
#endif
// kernels.fits' limits for the AVX-512 kernel (kernels.FLAGS passes the Python values)
#ifndef HOAD_MAX_K_AVX512
#define HOAD_MAX_K_AVX512 2048
#endif
#ifndef HOAD_MAX_B_AVX512
#define HOAD_MAX_B_AVX512 (1 << 21)
#endif
#ifndef HOAD_MIN_COLUMNS
#define HOAD_MIN_COLUMNS 32
#endif
#ifndef HOAD_MIN_MACS
#define HOAD_MIN_MACS (1 << 14)
#endif

#include <torch/library.h>
#include <torch/autograd.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

// The first `lanes` of 8 (none for lanes <= 0): a mask for the columns of a strip that exist.
static inline __mmask8 lane_mask(int64_t lanes) {
  return lanes >= 8 ? (__mmask8)0xFF : lanes <= 0 ? (__mmask8)0 : (__mmask8)((1u << lanes) - 1);
}

// R rows x 8V columns of C in R*V accumulators (6x32: 24, 4x32 or 8x16: 16); MASKED handles
// the last columns of a row. Rows of B are ldb apart, rows of C ldc.
template <int R, int V, bool MASKED>
__attribute__((target("avx512f,fma"))) static inline void block(int64_t ldb, int64_t ldc, int64_t K, const double* A,
                                                                 const double* B, double* C, const __mmask8* m) {
  __m512d c[R][V];
  for (int r = 0; r < R; r++) for (int v = 0; v < V; v++) c[r][v] = _mm512_setzero_pd();
  for (int64_t k = 0; k < K; k++) {
    const double* b = B + k * ldb;
    __m512d bv[V];
    for (int v = 0; v < V; v++) bv[v] = MASKED ? _mm512_maskz_loadu_pd(m[v], b + 8 * v) : _mm512_loadu_pd(b + 8 * v);
    for (int r = 0; r < R; r++) {
      __m512d a = _mm512_set1_pd(A[r * K + k]);
      for (int v = 0; v < V; v++) c[r][v] = _mm512_fmadd_pd(a, bv[v], c[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < V; v++) {
      if (MASKED) _mm512_mask_storeu_pd(C + r * ldc + 8 * v, m[v], c[r][v]);
      else _mm512_storeu_pd(C + r * ldc + 8 * v, c[r][v]);
    }
}

// All M rows of one strip of 8V columns: full blocks of R rows, then the rows left.
template <int R, int V, bool MASKED>
__attribute__((target("avx512f,fma"))) static void columns(int64_t M, int64_t ldb, int64_t N, int64_t K,
                                                           const double* A, const double* B, double* C,
                                                           const __mmask8* m) {
  int64_t i = 0;
  for (; i + R <= M; i += R) block<R, V, MASKED>(ldb, N, K, A + i * K, B, C + i * N, m);
  for (; i + 4 <= M; i += 4) block<4, V, MASKED>(ldb, N, K, A + i * K, B, C + i * N, m);
  switch (M - i) {
    case 3: block<3, V, MASKED>(ldb, N, K, A + i * K, B, C + i * N, m); break;
    case 2: block<2, V, MASKED>(ldb, N, K, A + i * K, B, C + i * N, m); break;
    case 1: block<1, V, MASKED>(ldb, N, K, A + i * K, B, C + i * N, m); break;
  }
}

// C[M,N] = A[M,K] @ B[K,N] for rows of A that stay in L2: B strip by strip, read in place or,
// where `packed` is given, from B's strips copied dense once per product ([K][32] each, in order).
__attribute__((target("avx512f,fma")))
static void strips(int64_t M, int64_t N, int64_t K, const double* A, const double* B, double* C,
                   const double* packed) {
  const __mmask8 full[4] = {0xFF, 0xFF, 0xFF, 0xFF};
  int64_t j = 0;
  for (; j + 32 <= N; j += 32) {
    if (packed == nullptr) {  // (6 rows per pass over a strip read in place: 93-99 -> 110-115 GFLOP/s on
      // [64,768]@[768,768] and [3200,768]@[768,768]; a copied strip gained nothing from 6)
      columns<6, 4, false>(M, N, N, K, A, B + j, C + j, full);
      continue;
    }
    columns<4, 4, false>(M, 32, N, K, A, packed + j * K, C + j, full);
  }
  if (N - j == 16) {
    columns<8, 2, false>(M, N, N, K, A, B + j, C + j, full);
  } else if (j < N) {
    __mmask8 m[4];
    for (int v = 0; v < 4; v++) {
      int64_t lanes = N - j - 8 * v;
      m[v] = lane_mask(lanes);
    }
    if (N - j <= 16) columns<8, 2, true>(M, N, N, K, A, B + j, C + j, m);
    else columns<4, 4, true>(M, N, N, K, A, B + j, C + j, m);
  }
}

// C[M,N] = A[M,K] @ B[K,N], all row-major and dense. Rows in panels of at most PANEL_BYTES of A,
// each meeting every strip of B while it stays in L2: a tall A streamed whole once per strip ran
// from memory ([3200,768]@[768,768]: 48 GFLOP/s on an AMD EPYC's core, MKL's 56; now 72-84).
__attribute__((target("avx512f,fma")))
static void dgemm(int64_t M, int64_t N, int64_t K, const double* A, const double* B, double* C) {
  const __mmask8 full[4] = {0xFF, 0xFF, 0xFF, 0xFF};
  if (K * N <= 4096 && N % 32 == 0) {  // B fits L1: each 4 rows of A (also in L1) meet all of it
    int64_t i = 0, j = 0;
    for (; i + 4 <= M; i += 4)
      for (j = 0; j < N; j += 32) block<4, 4, false>(N, N, K, A + i * K, B + j, C + i * N + j, full);
    if (i < M) for (j = 0; j < N; j += 32) columns<4, 4, false>(M - i, N, N, K, A + i * K, B + j, C + i * N + j, full);
    return;
  }
  const int64_t panel = std::max<int64_t>(8, HOAD_PANEL_BYTES / (8 * K) / 8 * 8);
  // B's rows a power of two of 2 KB or more apart share a few cache sets, so a strip of them
  // (K x 32) is evicted while 4 rows of A pass: such a strip is copied dense first where 256 rows
  // of A or more read it (us, warm / B cold from memory, in place -> copied): [384,768]@[768,512]
  // 2557/2678 -> 2496/2624, [4096,64]@[64,256] 1163/1255 -> 1107/1212. With fewer rows the copy
  // costs more than it saves: [16,768]@[768,512] 118/193 -> 168/282, [16,512]@[512,512] 79/127 ->
  // 127/183, [64,768]@[768,512] 426/513 -> 460/589, [128,512]@[512,512] 545/604 -> 576/660.
  // Each strip is copied once per product, not once per panel ([384,768]@[768,512]: 3.27-3.37 ->
  // 2.88-2.90 ms, [384,512]@[512,512] 2.04-2.13 -> 1.92), into a buffer each thread keeps (a
  // fresh one would fault its pages in at every call).
  const bool copied = N >= 256 && (N & (N - 1)) == 0 && M >= 256;
  const double* packed = nullptr;
  if (copied) {
    thread_local std::unique_ptr<double[]> buffer;  // (every entry written before read)
    thread_local int64_t capacity = 0;
    const int64_t need = N / 32 * 32 * K;
    if (need > capacity) {
      buffer.reset(new double[need]);
      capacity = need;
    }
    for (int64_t j = 0; j + 32 <= N; j += 32)
      for (int64_t k = 0; k < K; k++) std::memcpy(buffer.get() + j * K + 32 * k, B + k * N + j, 32 * sizeof(double));
    packed = buffer.get();
  }
  for (int64_t i = 0; i < M; i += panel) strips(std::min(panel, M - i), N, K, A + i * K, B, C + i * N, packed);
}

// The AVX2 twin of dgemm for CPUs without AVX-512: R rows x 8 columns of C in 2R accumulators
// (R = 6: 12 of the 16 registers), B read in place (a strip of K x 8 stays in L1 for K <= 256).
// `mask`: the lanes (-1) of the last strip's columns where N is not a multiple of 8, else nullptr.
template <int R>
__attribute__((target("avx2,fma"))) static inline void block_avx2(int64_t N, int64_t K, const double* A,
                                                                   const double* B, double* C, const int64_t* mask) {
  __m256d c[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; r++) c[r][0] = c[r][1] = _mm256_setzero_pd();
  const __m256i m0 = mask ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mask)) : _mm256_set1_epi64x(-1);
  const __m256i m1 = mask ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mask + 4)) : _mm256_set1_epi64x(-1);
  for (int64_t k = 0; k < K; k++) {
    const double* b = B + k * N;
    const __m256d b0 = mask ? _mm256_maskload_pd(b, m0) : _mm256_loadu_pd(b);
    const __m256d b1 = mask ? _mm256_maskload_pd(b + 4, m1) : _mm256_loadu_pd(b + 4);
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
      const __m256d a = _mm256_broadcast_sd(A + r * K + k);
      c[r][0] = _mm256_fmadd_pd(a, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_pd(a, b1, c[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; r++) {
    if (mask) {
      _mm256_maskstore_pd(C + r * N, m0, c[r][0]);
      _mm256_maskstore_pd(C + r * N + 4, m1, c[r][1]);
    } else {
      _mm256_storeu_pd(C + r * N, c[r][0]);
      _mm256_storeu_pd(C + r * N + 4, c[r][1]);
    }
  }
}

__attribute__((target("avx2,fma")))
static void dgemm_avx2(int64_t M, int64_t N, int64_t K, const double* A, const double* B, double* C) {
  int64_t mask[8];
  for (int v = 0; v < 8; v++) mask[v] = N % 8 == 0 || v < N % 8 ? -1 : 0;
  for (int64_t j = 0; j < N; j += 8) {
    const int64_t* m = j + 8 > N ? mask : nullptr;
    int64_t i = 0;
    for (; i + 6 <= M; i += 6) block_avx2<6>(N, K, A + i * K, B + j, C + i * N + j, m);
    switch (M - i) {
      case 5: block_avx2<5>(N, K, A + i * K, B + j, C + i * N + j, m); break;
      case 4: block_avx2<4>(N, K, A + i * K, B + j, C + i * N + j, m); break;
      case 3: block_avx2<3>(N, K, A + i * K, B + j, C + i * N + j, m); break;
      case 2: block_avx2<2>(N, K, A + i * K, B + j, C + i * N + j, m); break;
      case 1: block_avx2<1>(N, K, A + i * K, B + j, C + i * N + j, m); break;
    }
  }
}

static at::Tensor mm_cpu(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "hoad::mm: shapes ", a.sizes(), " and ",
              b.sizes(), " cannot be multiplied");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (a.scalar_type() != at::kDouble || b.scalar_type() != at::kDouble || !a.device().is_cpu() ||
      !b.device().is_cpu() || (M * K * N > HOAD_THREADED_MACS && at::get_num_threads() > 1))
    return at::mm(a, b);
  at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = at::empty({M, N}, a.options());
  if (out.numel() == 0) return out;
  if (__builtin_cpu_supports("avx512f"))
    dgemm(M, N, K, ac.const_data_ptr<double>(), bc.const_data_ptr<double>(), out.mutable_data_ptr<double>());
  else
    dgemm_avx2(M, N, K, ac.const_data_ptr<double>(), bc.const_data_ptr<double>(), out.mutable_data_ptr<double>());
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
      const __mmask8 m0 = lane_mask(cols), m1 = lane_mask(cols - 8);
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


// ------------------------------------------------------------------ hoad::jet_sqnorm, hoad::jet_mm
// q[p, m] = sum_s u[s, m] X[p, s, m]^2 with X[p, s] = (J[p, s] * c[p]) @ W: the collapsed
// second-order term of a Laplacian at a layer, its jets J scaled by the previous layer's
// derivative c and carried through the layer's weight W. One GEMM over rows r = p*S + s of the
// virtual operand A[r, k] = J[p, s, k] c[p, k]: six rows at a time are formed (A6, row-major),
// times strips of 8 columns of W packed [K][8]; the result is squared, weighted and summed per
// point in registers. jet_sqnorm never writes X (the last hidden layer: nothing else reads it);
// jet_mm also stores it (a layer whose jets the next one carries on).
#define STREAM_BYTES (4 << 20)  // jets larger than this are stored past the caches
#define JET_CHUNK 128  // terms of the inner dimension per pass of the AVX-512 strips (16 KB of W's strip)

struct JetRows {
  double* q[6];        // q row of each of the six rows; nullptr for padding rows
  const double* u[6];  // weight row of each
  double* x[6];        // X row of each, or nullptr (not stored)
  bool stream;         // store X past the caches: a large X is read back from memory anyway, and
                       // writes that bypass the caches neither read its lines first nor evict
                       // the operands ([64,50,512] jets: 58 -> 44 ms)
};

// The six rows' jets against one strip (columns col..col+7) of W; `tail`: the lanes (-1) of the
// columns that exist, for the last strip where M is not a multiple of 8, else nullptr.
__attribute__((target("avx2,fma")))
static inline void jet_block(int64_t K, const double* A6, const double* Bp, const JetRows& rows, int64_t col,
                             const int64_t* tail) {
  __m256d c[6][2];  // the loops over r are unrolled, so these stay in registers
#pragma GCC unroll 6
  for (int r = 0; r < 6; r++) c[r][0] = c[r][1] = _mm256_setzero_pd();
  for (int64_t k = 0; k < K; k++) {
    const __m256d b0 = _mm256_loadu_pd(Bp + 8 * k), b1 = _mm256_loadu_pd(Bp + 8 * k + 4);
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
      const __m256d a = _mm256_broadcast_sd(A6 + r * K + k);
      c[r][0] = _mm256_fmadd_pd(a, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_pd(a, b1, c[r][1]);
    }
  }
  // rows of one point are consecutive: their weighted squares are summed here, then added to q
  // once (adding each row to q would chain every row's load on the previous row's store)
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
#pragma GCC unroll 6
  for (int r = 0; r < 6; r++) {
    if (!rows.q[r]) break;  // padding rows come last
    if (double* x = rows.x[r]) {
      if (rows.stream && !tail && (reinterpret_cast<uintptr_t>(x + col) & 31) == 0) {
        _mm256_stream_pd(x + col, c[r][0]);
        _mm256_stream_pd(x + col + 4, c[r][1]);
      } else if (!tail) {
        _mm256_storeu_pd(x + col, c[r][0]);
        _mm256_storeu_pd(x + col + 4, c[r][1]);
      } else {
        _mm256_maskstore_pd(x + col, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail)), c[r][0]);
        _mm256_maskstore_pd(x + col + 4, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 4)), c[r][1]);
      }
    }
    const double* u = rows.u[r] + col;
    s0 = _mm256_fmadd_pd(_mm256_mul_pd(c[r][0], c[r][0]), _mm256_loadu_pd(u), s0);
    s1 = _mm256_fmadd_pd(_mm256_mul_pd(c[r][1], c[r][1]), _mm256_loadu_pd(u + 4), s1);
    if (r == 5 || rows.q[r + 1] != rows.q[r]) {
      double* q = rows.q[r] + col;
      _mm256_storeu_pd(q, _mm256_add_pd(s0, _mm256_loadu_pd(q)));
      _mm256_storeu_pd(q + 4, _mm256_add_pd(s1, _mm256_loadu_pd(q + 4)));
      s0 = s1 = _mm256_setzero_pd();
    }
  }
}

// The AVX-512 twin of jet_block: the six rows against a strip of 16 columns of W (packed [K][16]),
// in 12 accumulators; `lanes`: the columns of this strip that exist (16 but for the last strip).
// Over one chunk of the inner dimension: `kn` terms of rows `lda` apart, the partial sums carried in
// `acc` (96 doubles) from the chunk before unless `first`; the squares are taken after the `last`.
__attribute__((target("avx512f,fma")))
static inline void jet_block16(int64_t kn, int64_t lda, const double* A6, const double* Bp, double* acc, bool first,
                               bool last, const JetRows& rows, int64_t col, int lanes) {
  __m512d c[6][2];
#pragma GCC unroll 6
  for (int r = 0; r < 6; r++) {
    c[r][0] = first ? _mm512_setzero_pd() : _mm512_loadu_pd(acc + 16 * r);
    c[r][1] = first ? _mm512_setzero_pd() : _mm512_loadu_pd(acc + 16 * r + 8);
  }
  for (int64_t k = 0; k < kn; k++) {
    const __m512d b0 = _mm512_loadu_pd(Bp + 16 * k), b1 = _mm512_loadu_pd(Bp + 16 * k + 8);
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
      const __m512d a = _mm512_set1_pd(A6[r * lda + k]);
      c[r][0] = _mm512_fmadd_pd(a, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_pd(a, b1, c[r][1]);
    }
  }
  if (!last) {
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++) {
      _mm512_storeu_pd(acc + 16 * r, c[r][0]);
      _mm512_storeu_pd(acc + 16 * r + 8, c[r][1]);
    }
    return;
  }
  const __mmask8 m0 = lane_mask(lanes), m1 = lane_mask(lanes - 8);
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
#pragma GCC unroll 6
  for (int r = 0; r < 6; r++) {
    if (!rows.q[r]) break;  // padding rows come last
    if (double* x = rows.x[r]) {
      if (rows.stream && lanes == 16 && (reinterpret_cast<uintptr_t>(x + col) & 63) == 0) {
        _mm512_stream_pd(x + col, c[r][0]);
        _mm512_stream_pd(x + col + 8, c[r][1]);
      } else {
        _mm512_mask_storeu_pd(x + col, m0, c[r][0]);
        _mm512_mask_storeu_pd(x + col + 8, m1, c[r][1]);
      }
    }
    const double* u = rows.u[r] + col;  // u and q rows are padded to whole strips
    s0 = _mm512_fmadd_pd(_mm512_mul_pd(c[r][0], c[r][0]), _mm512_loadu_pd(u), s0);
    s1 = _mm512_fmadd_pd(_mm512_mul_pd(c[r][1], c[r][1]), _mm512_loadu_pd(u + 8), s1);
    if (r == 5 || rows.q[r + 1] != rows.q[r]) {
      double* q = rows.q[r] + col;
      _mm512_storeu_pd(q, _mm512_add_pd(s0, _mm512_loadu_pd(q)));
      _mm512_storeu_pd(q + 8, _mm512_add_pd(s1, _mm512_loadu_pd(q + 8)));
      s0 = s1 = _mm512_setzero_pd();
    }
  }
}

// a[k] = j[k] * c[k]: one row of the virtual operand
__attribute__((target("avx2,fma")))
static void jet_row(int64_t K, const double* j, const double* c, double* a) {
  for (int64_t k = 0; k < K; k++) a[k] = j[k] * c[k];
}

static void check_jets(const char* op, const at::Tensor& J, const at::Tensor& c, const at::Tensor& W,
                       const std::optional<at::Tensor>& u) {
  TORCH_CHECK((J.dim() == 2 || J.dim() == 3) && c.dim() == 2 && W.dim() == 2 && J.size(-1) == c.size(1) &&
              W.size(0) == c.size(1) && (J.dim() == 2 || J.size(0) == c.size(0)) && (!u || u->dim() <= 2),
              "hoad::", op, ": J [S,K] or [P,S,K], c [P,K], W [K,M] and u [S,M] expected, got ", J.sizes(), ", ",
              c.sizes(), " and ", W.sizes());
}

// X [P, S, M] (through aten where the kernel does not run) and q [P, M].
static std::tuple<at::Tensor, at::Tensor> jets_aten(const at::Tensor& J, const at::Tensor& c, const at::Tensor& W,
                                                    const std::optional<at::Tensor>& u) {
  at::Tensor jets = at::matmul(J * c.unsqueeze(1), W);
  at::Tensor squares = jets * jets;
  return {jets, (u ? squares * *u : squares).sum(1)};
}

// The AVX-512 strips on every CPU with AVX-512: 78-92 GFLOP/s on one core of a Xeon, the AVX2
// strips 49-55 (256 points, 16 directions, 64 units: 0.43 vs 0.69 ms); on an AMD EPYC (Zen 5) the
// whole Laplacian of that PINN took 0.49-0.51 ms against 0.75-0.77 with the AVX2 strips, which
// had been kept on AMD CPUs. HOAD_JETS_AVX2=1 keeps the AVX2 strips anywhere, to compare.
static bool jets_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && !std::getenv("HOAD_JETS_AVX2");
  return yes;
}

static bool jets_fast(std::initializer_list<const at::Tensor*> ts) {
  bool fast = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  for (const at::Tensor* t : ts) fast = fast && t->scalar_type() == at::kDouble && t->device().is_cpu();
  return fast;
}

// J [S, K] (the same for every point) or [P, S, K]; c [P, K]; W [K, M]; ue (weights) [S, M], or
// none (ones). X: where to store the jets [P, S, M] (dense), or undefined.
// NW: the columns of a strip, 8 (AVX2: jet_block) or 16 (AVX-512: jet_block16).
template <int NW>
static at::Tensor jets_kernel(const at::Tensor& J, const at::Tensor& c, const at::Tensor& W,
                              const std::optional<at::Tensor>& ue, at::Tensor X) {
  const int64_t P = c.size(0), K = c.size(1), S = J.size(-2), M = W.size(1);
  const int64_t NT = (M + NW - 1) / NW, MP = NW * NT;
  at::Tensor q = at::zeros({P, MP}, c.options());
  if (P == 0 || S == 0) return q.narrow(1, 0, M).contiguous();
  // W in strips of NW columns, [K][NW] each (the last one's missing columns zero); u [S, MP]
  std::vector<double> Bp(NT * K * NW), up(S * MP, ue ? 0.0 : 1.0);
  {
    const double* w = W.const_data_ptr<double>();
    const int64_t wk = W.stride(0), wm = W.stride(1);
    for (int64_t t = 0; t < NT; t++)
      for (int64_t k = 0; k < K; k++) {
        double* dst = Bp.data() + (t * K + k) * NW;
        const double* src = w + k * wk + NW * t * wm;
        for (int64_t v = 0; v < NW; v++) dst[v] = NW * t + v < M ? src[v * wm] : 0.0;
      }
    if (ue) {
      auto uu = ue->accessor<double, 2>();
      for (int64_t s = 0; s < S; s++)
        for (int64_t m = 0; m < M; m++) up[s * MP + m] = uu[s][m];
    }
  }
  int64_t tail[8];  // the lanes of the last strip's columns, where M is not a multiple of 8
  for (int v = 0; v < 8; v++) tail[v] = 8 * (NT - 1) + v < M ? -1 : 0;
  const at::Tensor cc = c.contiguous();
  const double* cp = cc.const_data_ptr<double>();
  // rows of J are read once per point: dense ones (a shared J is small; a per-point one is read once either way)
  const at::Tensor Jd = J.stride(-1) == 1 ? J : J.contiguous();
  const double* jp = Jd.const_data_ptr<double>();
  const int64_t jsp = Jd.dim() == 3 ? Jd.stride(0) : 0, jss = Jd.stride(-2);
  double* qp = q.mutable_data_ptr<double>();
  double* xp = X.defined() ? X.mutable_data_ptr<double>() : nullptr;
  const bool stream = X.defined() && X.numel() * 8 > STREAM_BYTES;
  // six-row panels formed at once: a strip of W (a chunk of it, AVX-512) is reused by all of them;
  // with long inner dimensions W outgrows the L2 cache, so more panels share each chunk
  const int64_t G = NW == 16 && K > JET_CHUNK ? 32 : 4;
  at::parallel_for(0, P, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, S * K)), [&](int64_t p0, int64_t p1) {
    std::vector<double> A(G * 6 * K), acc(NW == 16 ? G * 96 : 0);
    std::vector<JetRows> rows(G);
    for (JetRows& rw : rows) rw.stream = stream;
    int64_t p = p0, s = 0;  // the point and direction of row r0
    for (int64_t r0 = p0 * S; r0 < p1 * S; r0 += G * 6) {
      const int64_t r1 = std::min(r0 + G * 6, p1 * S);
      for (int64_t i = 0; i < G * 6; i++) {
        double* a = A.data() + i * K;
        JetRows& rw = rows[i / 6];
        if (r0 + i >= r1) {
          std::fill(a, a + K, 0.0);
          rw.q[i % 6] = rw.x[i % 6] = nullptr;
          rw.u[i % 6] = up.data();
          continue;
        }
        jet_row(K, jp + p * jsp + s * jss, cp + p * K, a);
        rw.q[i % 6] = qp + p * MP;
        rw.u[i % 6] = up.data() + s * MP;
        rw.x[i % 6] = xp ? xp + (r0 + i) * M : nullptr;
        if (++s == S) s = 0, p++;
      }
      const int64_t panels = (r1 - r0 + 5) / 6;
      for (int64_t t = 0; t < NT; t++) {
        if constexpr (NW == 16) {
          // chunks of the inner dimension: a chunk of the strip of W stays in L1 for all the panels
          for (int64_t k0 = 0; k0 < K; k0 += JET_CHUNK) {
            const int64_t kn = std::min<int64_t>(JET_CHUNK, K - k0);
            for (int64_t g = 0; g < panels; g++)
              jet_block16(kn, K, A.data() + 6 * g * K + k0, Bp.data() + (t * K + k0) * 16, acc.data() + 96 * g,
                          k0 == 0, k0 + kn == K, rows[g], 16 * t, (int)std::min<int64_t>(16, M - 16 * t));
          }
        } else {
          for (int64_t g = 0; g < panels; g++)
            jet_block(K, A.data() + 6 * g * K, Bp.data() + t * K * 8, rows[g], 8 * t,
                      8 * t + 8 > M ? tail : nullptr);
        }
      }
    }
    if (stream) _mm_sfence();  // this thread's streamed stores are visible before X is read
  });
  return MP == M ? q : q.narrow(1, 0, M).contiguous();
}

// jets_kernel in the strips this CPU runs (jets_avx512)
static at::Tensor jets(const at::Tensor& J, const at::Tensor& c, const at::Tensor& W,
                       const std::optional<at::Tensor>& ue, at::Tensor X) {
  return jets_avx512() ? jets_kernel<16>(J, c, W, ue, X) : jets_kernel<8>(J, c, W, ue, X);
}

// u expanded to [S, M], or none (ones)
static std::optional<at::Tensor> expanded(const std::optional<at::Tensor>& u, int64_t S, int64_t M) {
  return u ? std::optional<at::Tensor>(u->expand({S, M})) : std::nullopt;
}

static at::Tensor jet_sqnorm_cpu(const at::Tensor& J, const at::Tensor& c, const at::Tensor& W,
                                 const std::optional<at::Tensor>& u) {
  check_jets("jet_sqnorm", J, c, W, u);
  const int64_t K = c.size(1), S = J.size(-2), M = W.size(1);
  const auto ue = expanded(u, S, M);
  if (!jets_fast({&J, &c, &W, ue ? &*ue : &c}) || K == 0) return std::get<1>(jets_aten(J, c, W, u));
  return jets(J, c, W, ue, at::Tensor());
}

static std::tuple<at::Tensor, at::Tensor> jet_mm_cpu(const at::Tensor& J, const at::Tensor& c, const at::Tensor& W,
                                                     const std::optional<at::Tensor>& u) {
  check_jets("jet_mm", J, c, W, u);
  const int64_t P = c.size(0), K = c.size(1), S = J.size(-2), M = W.size(1);
  const auto ue = expanded(u, S, M);
  if (!jets_fast({&J, &c, &W, ue ? &*ue : &c}) || K == 0) {
    auto [X, q] = jets_aten(J, c, W, u);
    return {X.expand({P, S, M}).contiguous(), q};
  }
  at::Tensor X = at::empty({P, S, M}, c.options());
  at::Tensor q = jets(J, c, W, ue, X);
  return {X, q};
}

// ------------------------------------------------------------------ hoad::jets_grad
// The gradients of jet_sqnorm and jet_mm (the maths of jets_backward below) for a backward that
// is not differentiated again: with A = J c, X = A W and G = gX + 2 u gq X per row r = (p, s),
// dA = G W^T, dJ = dA c (summed over p where J is shared), dc = sum_s dA J, dW = A^T G and
// du = sum_p gq X^2. The rows run in chunks of about JETS_GRAD_ROWS (A, X, G and dA of a chunk stay
// in the L2 cache): the products (dA, dW, and X again where jet_mm did not store it) are MKL's, over
// whole chunks, and the elementwise terms are loops over the chunk's rows. Through aten ops, AOTAutograd's backward of a Laplacian
// (16-64-64-1, 256 points) wrote and reread every [P,S,M] intermediate, some of them transposed
// element by element: 3.5 ms against this op's ~1.1.
#define JETS_GRAD_ROWS 512

// One row r = (p, s) of G: g[m] = gx[m] + 2 gq[m] u[m] x[m] (gx, u absent: zeros, ones), and
// du[m] += gq[m] x[m]^2 where du
__attribute__((target("avx2,fma")))
static void grad_row(int64_t M, const double* __restrict__ gx, const double* __restrict__ gq,
                     const double* __restrict__ u, const double* __restrict__ x, double* __restrict__ g,
                     double* __restrict__ du) {
  if (u)
    for (int64_t m = 0; m < M; m++) g[m] = 2.0 * gq[m] * u[m] * x[m];
  else
    for (int64_t m = 0; m < M; m++) g[m] = 2.0 * gq[m] * x[m];
  if (gx)
    for (int64_t m = 0; m < M; m++) g[m] += gx[m];
  if (du)
    for (int64_t m = 0; m < M; m++) du[m] += gq[m] * x[m] * x[m];
}

// One row of the chain back through A = J c: dj[k] = da[k] c[k] (added where J is shared) and
// dc[k] += da[k] j[k]
__attribute__((target("avx2,fma")))
static void chain_row(int64_t K, const double* __restrict__ da, const double* __restrict__ j,
                      const double* __restrict__ c, double* __restrict__ dj, bool shared, double* __restrict__ dc) {
  if (shared)
    for (int64_t k = 0; k < K; k++) dj[k] += da[k] * c[k];
  else
    for (int64_t k = 0; k < K; k++) dj[k] = da[k] * c[k];
  for (int64_t k = 0; k < K; k++) dc[k] += da[k] * j[k];
}

using JetsGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The same maths in aten ops (differentiable again: a backward with create_graph uses it). du is
// undefined where there is no u or no gq.
static JetsGrads jets_grad_aten(const at::Tensor& J, const at::Tensor& c, const at::Tensor& W, const at::Tensor& u,
                                const at::Tensor& X0, const at::Tensor& gX, const at::Tensor& gq) {
  const at::Tensor A = J * c.unsqueeze(1);  // [P, S, K]
  const at::Tensor X = X0.defined() ? X0 : at::matmul(A, W);
  at::Tensor G = gX.defined() ? gX.expand_as(X) : at::zeros_like(X);
  if (gq.defined()) G = G + (u.defined() ? 2 * gq.unsqueeze(1) * u * X : 2 * gq.unsqueeze(1) * X);
  const at::Tensor dA = at::matmul(G, W.mT());
  at::Tensor dJ = dA * c.unsqueeze(1);
  if (J.dim() == 2) dJ = dJ.sum(0);
  const at::Tensor dc = (dA * J).sum(1);
  const int64_t rows = A.size(0) * A.size(1);  // (spelled out: a -1 is ambiguous for empty K or M)
  const at::Tensor dW = at::matmul(A.reshape({rows, A.size(2)}).mT(), G.reshape({rows, G.size(2)}));
  const at::Tensor du = u.defined() && gq.defined() ? (gq.unsqueeze(1) * X * X).sum(0).sum_to_size(u.sizes())
                                                    : at::Tensor();
  return {dJ, dc, dW, du};
}

// J [S,K] or [P,S,K], c [P,K], W [K,M], u (weights, to [S,M]) or none, X the jets [P,S,M] where
// jet_mm stored them (else computed again), gX and gq the gradients of X and q (either may be
// absent). Returns dJ, dc, dW and du (u's shape; zeros [0] where there is no u).
static JetsGrads jets_grad_cpu(const at::Tensor& J, const at::Tensor& c, const at::Tensor& W,
                               const std::optional<at::Tensor>& u, const std::optional<at::Tensor>& X,
                               const std::optional<at::Tensor>& gX, const std::optional<at::Tensor>& gq) {
  check_jets("jets_grad", J, c, W, u);
  const int64_t P = c.size(0), K = c.size(1), S = J.size(-2), M = W.size(1);
  TORCH_CHECK((!X || X->sizes() == at::IntArrayRef({P, S, M})) && (!gX || gX->sizes() == at::IntArrayRef({P, S, M})) &&
                  (!gq || gq->sizes() == at::IntArrayRef({P, M})),
              "hoad::jets_grad: X and gX [P,S,M] and gq [P,M] expected for J ", J.sizes(), ", c ", c.sizes(), ", W ",
              W.sizes());
  const auto opts = c.options();
  const at::Tensor none;
  const auto ue = expanded(u, S, M);
  if (!jets_fast({&J, &c, &W, ue ? &*ue : &c, X ? &*X : &c, gX ? &*gX : &c, gq ? &*gq : &c}) || P * S * K * M == 0) {
    auto [dJ, dc, dW, du] = jets_grad_aten(J, c, W, u.value_or(none), X.value_or(none), gX.value_or(none),
                                           gq.value_or(none));
    if (!du.defined()) du = u ? at::zeros_like(*u) : at::zeros({0}, opts);
    return {dJ.contiguous(), dc.contiguous(), dW.contiguous(), du.contiguous()};
  }
  const bool shared = J.dim() == 2;
  const at::Tensor Jd = J.contiguous(), cd = c.contiguous(), ud = ue ? ue->contiguous() : none;
  const at::Tensor Xd = X ? X->contiguous() : none, gXd = gX ? gX->contiguous() : none;
  const at::Tensor gqd = gq ? gq->contiguous() : none;
  const double *jp = Jd.const_data_ptr<double>(), *cp = cd.const_data_ptr<double>();
  const double* up = ue ? ud.const_data_ptr<double>() : nullptr;
  const double* gxp = gX ? gXd.const_data_ptr<double>() : nullptr;
  const double* gqp = gq ? gqd.const_data_ptr<double>() : nullptr;
  at::Tensor dJ = shared ? at::zeros({S, K}, opts) : at::empty({P, S, K}, opts), dc = at::zeros({P, K}, opts);
  double *djp = dJ.mutable_data_ptr<double>(), *dcp = dc.mutable_data_ptr<double>();
  const int64_t CP = std::max<int64_t>(1, JETS_GRAD_ROWS / S);  // points per chunk
  const int64_t chunks = (P + CP - 1) / CP;
  // per thread: its sums of dW, of dJ where J is shared, and of du (added up at the end)
  const int64_t T = at::get_num_threads();
  std::vector<at::Tensor> dWs(T), dJs(T), dus(T);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    // Below autograd on every thread, as the caller is (below<>): a worker thread starts with
    // autograd's defaults, and there the products of an autograd backward (W requires grad)
    // failed ("mm(): functions with out=... arguments don't support automatic differentiation")
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const int64_t t = at::get_thread_num();
    if (!dWs[t].defined()) {
      dWs[t] = at::zeros({K, M}, opts);
      if (shared) dJs[t] = at::zeros({S, K}, opts);
      if (ue && gq) dus[t] = at::zeros({S, M}, opts);
    }
    double* dj = shared ? dJs[t].mutable_data_ptr<double>() : djp;
    double* du = ue && gq ? dus[t].mutable_data_ptr<double>() : nullptr;
    // a chunk's rows: A, its jets X (computed again unless stored), G and dA
    const int64_t R = CP * S;
    at::Tensor A = at::empty({R, K}, opts), G = at::empty({R, M}, opts), dA = at::empty({R, K}, opts);
    at::Tensor Xb = X ? none : at::empty({R, M}, opts);
    for (int64_t ch = c0; ch < c1; ch++) {
      const int64_t p0 = ch * CP, n = std::min(CP, P - p0), rows = n * S, r0 = p0 * S;
      at::Tensor Ac = A.narrow(0, 0, rows), Gc = G.narrow(0, 0, rows), dAc = dA.narrow(0, 0, rows);
      double *ap = Ac.mutable_data_ptr<double>(), *gp = Gc.mutable_data_ptr<double>();
      for (int64_t r = 0; r < rows; r++) {
        const int64_t p = p0 + r / S, s = r % S;
        jet_row(K, jp + (shared ? 0 : p * S * K) + s * K, cp + p * K, ap + r * K);
      }
      at::Tensor Xc = X ? Xd.view({P * S, M}).narrow(0, r0, rows) : Xb.narrow(0, 0, rows);
      if (!X) at::mm_out(Xc, Ac, W);
      const double* xp = Xc.const_data_ptr<double>();
      for (int64_t r = 0; r < rows; r++) {
        const int64_t p = p0 + r / S, s = r % S;
        if (gqp)
          grad_row(M, gxp ? gxp + (r0 + r) * M : nullptr, gqp + p * M, up ? up + s * M : nullptr, xp + r * M,
                   gp + r * M, du ? du + s * M : nullptr);
        else if (gxp)
          std::memcpy(gp + r * M, gxp + (r0 + r) * M, M * sizeof(double));
      }
      if (!gqp && !gxp) Gc.zero_();
      at::mm_out(dAc, Gc, W.t());
      dWs[t].addmm_(Ac.t(), Gc);
      const double* dap = dAc.const_data_ptr<double>();
      for (int64_t r = 0; r < rows; r++) {
        const int64_t p = p0 + r / S, s = r % S, j = (shared ? 0 : p * S * K) + s * K;
        chain_row(K, dap + r * K, jp + j, cp + p * K, dj + j, shared, dcp + p * K);
      }
    }
  });
  at::Tensor dW = at::zeros({K, M}, opts), du = ue ? at::zeros({S, M}, opts) : at::zeros({0}, opts);
  for (int64_t t = 0; t < T; t++) {
    if (!dWs[t].defined()) continue;
    dW.add_(dWs[t]);
    if (shared) dJ.add_(dJs[t]);
    if (dus[t].defined()) du.add_(dus[t]);
  }
  if (u) du = du.sum_to_size(u->sizes()).contiguous();
  return {dJ, dc, dW, du};
}

// ------------------------------------------------------------------ autograd
// Derivatives of the operators in aten ops (so differentiable again): programs that autograd goes
// through (training under Inductor) may contain them. Registered in C++: a Python autograd kernel
// (torch.library.register_autograd) is entered on every call, grad or not, ~7 us each.
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Each operator below autograd (its CPU kernel, or a fake one while a program is traced), its
// handle looked up once: a static per operator name (one per signature sent gram to mm's kernel).
using MmSig = at::Tensor(const at::Tensor&, const at::Tensor&);
using JetSqnormSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using JetMmSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&);

static constexpr char MM[] = "hoad::mm", GRAM[] = "hoad::gram", JET_SQNORM[] = "hoad::jet_sqnorm",
                      JET_MM[] = "hoad::jet_mm", JETS_GRAD[] = "hoad::jets_grad";

template <class Sig, const char* Name, class... Args>
static auto below(const Args&... args) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(Name, "").template typed<Sig>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(args...);
}

static bool needs_grad(std::initializer_list<const at::Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

// A product of hoad::mm's backward: through hoad::mm where its AVX-512 kernel wins (the shapes
// kernels.fits takes), else at::matmul. Through the dispatcher, so that a backward which builds a
// graph (create_graph) records it. An eager program's backward (a training step while Inductor
// compiles) ran its products in MKL, which runs AVX2 code on AMD's CPUs: [512,32]@[32,32] 32 us
// against the kernel's 10, [32,256]@[256,32] 17 against 6.
static at::Tensor backward_product(const at::Tensor& a, const at::Tensor& b) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (a.scalar_type() == at::kDouble && a.device().is_cpu() && __builtin_cpu_supports("avx512f") && k > 0 &&
      k <= HOAD_MAX_K_AVX512 && k * n <= HOAD_MAX_B_AVX512 && (n >= HOAD_MIN_COLUMNS || n == 16) &&
      m * k * n >= HOAD_MIN_MACS) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(MM, "").typed<MmSig>();
    return op.call(a, b);
  }
  return at::matmul(a, b);
}

struct MmFn : torch::autograd::Function<MmFn> {  // C = A B: dA = g B^T, dB = A^T g
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    ctx->save_for_backward({a, b});
    return below<MmSig, MM>(a, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto s = ctx->get_saved_variables();
    return {backward_product(g[0], s[1].mT()), backward_product(s[0].mT(), g[0])};
  }
};

// G[b] = J[b]^T diag(w[b]) J[b]: dJ[b] = diag(w[b]) J[b] (g[b] + g[b]^T), dw[b,k] = (J[b] g[b] J[b]^T)_kk
struct GramFn : torch::autograd::Function<GramFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& J, const at::Tensor& w) {
    ctx->save_for_backward({J, w});
    return below<MmSig, GRAM>(J, w);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &J = s[0], &w = s[1];
    return {at::matmul(J * w.unsqueeze(2), g[0] + g[0].mT()), (at::matmul(J, g[0]) * J).sum(2)};
  }
};

using JetsGradSig = JetsGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&);

// Saved: J, c, W, u, X. A backward that builds a graph (create_graph) differentiates the aten
// formula, with the jets X where they are an output (jet_mm's: autograd connects them to J, c and
// W), else computed again from those; a plain one (AOTAutograd traces a program's backward as one)
// calls hoad::jets_grad.
static variable_list jets_backward(const variable_list& s, const at::Tensor& gX, const at::Tensor& gq,
                                   bool output_jets) {
  const at::Tensor &J = s[0], &c = s[1], &W = s[2], &u = s[3], &X = s[4];
  if (at::GradMode::is_enabled()) {
    auto [dJ, dc, dW, du] = jets_grad_aten(J, c, W, u, output_jets ? X : at::Tensor(), gX, gq);
    return {dJ, dc, dW, du};
  }
  const auto some = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  auto [dJ, dc, dW, du] = below<JetsGradSig, JETS_GRAD>(J, c, W, some(u), some(X), some(gX), some(gq));
  return {dJ, dc, dW, u.defined() ? du : at::Tensor()};
}

struct JetSqnormFn : torch::autograd::Function<JetSqnormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& J, const at::Tensor& c, const at::Tensor& W,
                            const std::optional<at::Tensor>& u) {
    // the jets are stored for the backward (jet_mm): writing them costs ~5% of the kernel, computing
    // them again a third of the backward (256 points, 16 directions, 64 units: 1.28 -> 1.03 ms)
    auto [X, q] = below<JetMmSig, JET_MM>(J, c, W, u);
    ctx->save_for_backward({J, c, W, u.value_or(at::Tensor()), X});
    return q;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return jets_backward(ctx->get_saved_variables(), at::Tensor(), g[0], false);
  }
};

struct JetMmFn : torch::autograd::Function<JetMmFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& J, const at::Tensor& c, const at::Tensor& W,
                               const std::optional<at::Tensor>& u) {
    auto [X, q] = below<JetMmSig, JET_MM>(J, c, W, u);
    ctx->save_for_backward({J, c, W, u.value_or(at::Tensor()), X});
    return {X, q};
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return jets_backward(ctx->get_saved_variables(), g[0], g[1], true);
  }
};

// Where no input needs a gradient, straight to the operator (no autograd node).
static at::Tensor mm_autograd(const at::Tensor& a, const at::Tensor& b) {
  return needs_grad({&a, &b}) ? MmFn::apply(a, b) : below<MmSig, MM>(a, b);
}

static at::Tensor gram_autograd(const at::Tensor& J, const at::Tensor& w) {
  return needs_grad({&J, &w}) ? GramFn::apply(J, w) : below<MmSig, GRAM>(J, w);
}

static at::Tensor jet_sqnorm_autograd(const at::Tensor& J, const at::Tensor& c, const at::Tensor& W,
                                      const std::optional<at::Tensor>& u) {
  const at::Tensor none;
  if (!needs_grad({&J, &c, &W, u ? &*u : &none})) return below<JetSqnormSig, JET_SQNORM>(J, c, W, u);
  return JetSqnormFn::apply(J, c, W, u);
}

static std::tuple<at::Tensor, at::Tensor> jet_mm_autograd(const at::Tensor& J, const at::Tensor& c,
                                                          const at::Tensor& W, const std::optional<at::Tensor>& u) {
  const at::Tensor none;
  if (!needs_grad({&J, &c, &W, u ? &*u : &none})) return below<JetMmSig, JET_MM>(J, c, W, u);
  const variable_list out = JetMmFn::apply(J, c, W, u);
  return {out[0], out[1]};
}

TORCH_LIBRARY(hoad, m) {
  m.def("mm(Tensor a, Tensor b) -> Tensor");
  m.def("gram(Tensor J, Tensor w) -> Tensor");
  m.def("jet_sqnorm(Tensor J, Tensor c, Tensor W, Tensor? u=None) -> Tensor");
  m.def("jet_mm(Tensor J, Tensor c, Tensor W, Tensor? u=None) -> (Tensor, Tensor)");
  m.def("jets_grad(Tensor J, Tensor c, Tensor W, Tensor? u, Tensor? X, Tensor? gX, Tensor? gq) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(hoad, CPU, m) {
  m.impl("mm", &mm_cpu);
  m.impl("gram", &gram_cpu);
  m.impl("jet_sqnorm", &jet_sqnorm_cpu);
  m.impl("jet_mm", &jet_mm_cpu);
  m.impl("jets_grad", &jets_grad_cpu);
}
TORCH_LIBRARY_IMPL(hoad, Autograd, m) {
  m.impl("mm", &mm_autograd);
  m.impl("gram", &gram_autograd);
  m.impl("jet_sqnorm", &jet_sqnorm_autograd);
  m.impl("jet_mm", &jet_mm_autograd);
}
