// hoad's float64 kernels for CPUs with AVX-512: the operators hoad::mm and hoad::gram.
// Built once per machine by hoad/lowering/kernels.py (torch.utils.cpp_extension), loaded as a
// torch library; programs lowered for Inductor call them (see hoad/lowering/inductor.py).

#ifndef HOAD_THREADED_MACS
#define HOAD_THREADED_MACS (1 << 20)  // with more than one thread, MKL takes larger products
#endif

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
      !b.device().is_cpu() || (M * K * N > HOAD_THREADED_MACS && at::get_num_threads() > 1))
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
