// Skinny fp32 GEMM for decode steps: y[M, N] = x[M, K] @ w[N, K]^T with few rows (M <= ~32).
//
// With few rows a decode GEMM is bound by reading w once from memory. This kernel streams each
// thread's contiguous slab of w rows exactly once and dots every group of 4 w rows with all M
// rows of x while the group is in L1 (x stays in L1/L2), with AVX-512 or AVX2 FMAs where the
// CPU has them (built with -march=native), accumulated in fp32. Threads come from ATen's pool
// (at::parallel_for), the one every other torch op uses, so no second OpenMP runtime competes.
#include <ATen/Parallel.h>

#include <cstdint>

#include "simd.h"
#include "skinny_gemm.h"

namespace {

// y[m, r .. r+4] and y[m+1, r .. r+4]: four w rows against two x rows (8 accumulators). pf0 and
// pf1 (or nullptr): w rows of the next group to prefetch into L1 meanwhile, a line per step.
inline void four_by_two(const float* const* wr, const float* x0, const float* x1, float* y0, float* y1, int64_t K,
                        const float* pf0, const float* pf1) {
  const int64_t kv = K - K % kWidth;
  vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  vec b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
  for (int64_t k = 0; k < kv; k += kWidth) {
    if (pf0 != nullptr) __builtin_prefetch(pf0 + k, 0, 3);
    if (pf1 != nullptr) __builtin_prefetch(pf1 + k, 0, 3);
    const vec u = vload(x0 + k), v = vload(x1 + k);
    const vec w0 = vload(wr[0] + k), w1 = vload(wr[1] + k), w2 = vload(wr[2] + k), w3 = vload(wr[3] + k);
    a0 = vfma(w0, u, a0); b0 = vfma(w0, v, b0);
    a1 = vfma(w1, u, a1); b1 = vfma(w1, v, b1);
    a2 = vfma(w2, u, a2); b2 = vfma(w2, v, b2);
    a3 = vfma(w3, u, a3); b3 = vfma(w3, v, b3);
  }
  float s[8] = {vsum(a0), vsum(a1), vsum(a2), vsum(a3), vsum(b0), vsum(b1), vsum(b2), vsum(b3)};
  for (int64_t k = kv; k < K; ++k) {
    for (int i = 0; i < 4; ++i) {
      s[i] += wr[i][k] * x0[k];
      s[4 + i] += wr[i][k] * x1[k];
    }
  }
  for (int i = 0; i < 4; ++i) {
    y0[i] = s[i];
    y1[i] = s[4 + i];
  }
}

// y[m, r .. r+4]: four w rows against one x row (4 accumulators).
inline void four_by_one(const float* const* wr, const float* x0, float* y0, int64_t K) {
  const int64_t kv = K - K % kWidth;
  vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (int64_t k = 0; k < kv; k += kWidth) {
    const vec u = vload(x0 + k);
    a0 = vfma(vload(wr[0] + k), u, a0);
    a1 = vfma(vload(wr[1] + k), u, a1);
    a2 = vfma(vload(wr[2] + k), u, a2);
    a3 = vfma(vload(wr[3] + k), u, a3);
  }
  float s[4] = {vsum(a0), vsum(a1), vsum(a2), vsum(a3)};
  for (int64_t k = kv; k < K; ++k)
    for (int i = 0; i < 4; ++i) s[i] += wr[i][k] * x0[k];
  for (int i = 0; i < 4; ++i) y0[i] = s[i];
}


// y[:, r .. r+4] for every x row: the four w rows (4 K floats) stay in L1 while the x rows pass.
// w's rows are ldw floats apart, y's rows ldy. With 4 or more x rows the group computes longer
// than memory takes to bring the next four w rows, and the hardware prefetcher does not run that
// far ahead: the pairs of x rows prefetch the next group's rows between them (decode steps of
// 16-32 sequences, benchmarks/decode_steps.py). With fewer rows the step is bound by memory anyway.
inline void four_rows(const float* w, const float* x, float* y, int64_t M, int64_t K, int64_t N, int64_t ldw,
                      int64_t ldy, int64_t r) {
  const float* wr[4] = {w + r * ldw, w + (r + 1) * ldw, w + (r + 2) * ldw, w + (r + 3) * ldw};
  const int64_t pairs = M / 2;
  const bool prefetch = pairs >= 2 && r + 8 <= N;
  int64_t m = 0;
  for (int64_t p = 0; m + 2 <= M; m += 2, ++p) {
    // Pair p prefetches next-group rows [4p / pairs, 4(p + 1) / pairs): one or two of them.
    const int64_t lo = 4 * p / pairs, hi = 4 * (p + 1) / pairs;
    const float* pf0 = prefetch && lo < hi ? wr[lo] + 4 * ldw : nullptr;
    const float* pf1 = prefetch && lo + 1 < hi ? wr[lo + 1] + 4 * ldw : nullptr;
    four_by_two(wr, x + m * K, x + (m + 1) * K, y + m * ldy + r, y + (m + 1) * ldy + r, K, pf0, pf1);
  }
  if (m < M) four_by_one(wr, x + m * K, y + m * ldy + r, K);
}

inline void one_row(const float* w, const float* x, float* y, int64_t M, int64_t K, int64_t ldw, int64_t ldy,
                    int64_t r) {
  const float* wr = w + r * ldw;
  const int64_t kv = K - K % kWidth;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    vec a = vzero();
    for (int64_t k = 0; k < kv; k += kWidth) a = vfma(vload(wr + k), vload(xr + k), a);
    float s = vsum(a);
    for (int64_t k = kv; k < K; ++k) s += wr[k] * xr[k];
    y[m * ldy + r] = s;
  }
}

inline void row_groups(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t ldw,
                       int64_t ldy, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t r = 4 * g;
    const int64_t left = N - r;
    if (left >= 4) {
      four_rows(w, x, y, M, K, N, ldw, ldy, r);
    } else {
      for (int64_t i = 0; i < left; ++i) one_row(w, x, y, M, K, ldw, ldy, r + i);
    }
  }
}

}  // namespace

void skinny_serial(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t ldw,
                   int64_t ldy) {
  if (M == 0 || N == 0) return;
  row_groups(x, w, y, M, K, N, ldw, ldy, 0, (N + 3) / 4);
}

void skinny_into(const float* xp, const float* wp, float* yp, int64_t M, int64_t K, int64_t N) {
  if (M == 0 || N == 0) return;
  // Whole 4-row groups per task; at least ~64 KiB of w per task, so small weights stay on one thread.
  const int64_t groups = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, 4 * K));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) { row_groups(xp, wp, yp, M, K, N, K, N, g0, g1); });
}
