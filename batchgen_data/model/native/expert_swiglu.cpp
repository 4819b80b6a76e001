// The routed experts of one MoE layer for few rows each, in one call: per expert,
// gate_up = x W_gu^T (skinny GEMM), a = silu(gate) * up, y = a W_d^T (skinny GEMM).
//
// The torch path runs each expert as five ops from Python (two GEMMs, chunk, silu, multiply)
// plus a copy into the output; at decode's 1-8 rows per expert that per-op cost is a tenth of
// the layer. Here one call walks the experts, reusing one scratch buffer.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "simd.h"
#include "skinny_gemm.h"

// g[k] = silu(g[k]) * u[k]
static void silu_mul(float* g, const float* u, int64_t n) {
  const int64_t nv = n - n % kWidth;
  for (int64_t k = 0; k < nv; k += kWidth) vstore(g + k, vsilu_mul(vload(g + k), vload(u + k)));
  for (int64_t k = nv; k < n; ++k) g[k] = g[k] / (1.f + std::exp(-g[k])) * u[k];
}

void swiglu_expert_into(const float* x, float* y, int64_t n, int64_t H, int64_t F, const float* w_gate_up,
                        const float* w_down, float* gate_up, float* act) {
  skinny_into(x, w_gate_up, gate_up, n, H, 2 * F);
  for (int64_t m = 0; m < n; ++m) {
    const float* g = gate_up + m * 2 * F;
    const float* u = g + F;
    float* a = act + m * F;
    for (int64_t f = 0; f < F; ++f) a[f] = g[f] / (1.f + std::exp(-g[f])) * u[f];
  }
  skinny_into(act, w_down, y, n, F, H);
}

bool swiglu_experts_into(const float* x, float* y, int64_t R, int64_t H, int64_t F, const int64_t* starts,
                         const int64_t* rows, int64_t num_used, const float* w_gate_up, const float* w_down,
                         int64_t num_rows) {
  // Segments in order within [0, R], weight rows that exist: else an error, never a stray access.
  if (num_used > 0 && (starts[0] < 0 || starts[num_used] > R)) return false;
  for (int64_t i = 0; i < num_used; ++i)
    if (starts[i + 1] < starts[i] || rows[i] < 0 || rows[i] >= num_rows) return false;
  int64_t most = 0;
  for (int64_t i = 0; i < num_used; ++i) most = std::max(most, starts[i + 1] - starts[i]);
  std::vector<float> gate_up(static_cast<size_t>(most * 2 * F)), act(static_cast<size_t>(most * F));
  for (int64_t i = 0; i < num_used; ++i) {
    const int64_t lo = starts[i], n = starts[i + 1] - starts[i];
    if (n == 0) continue;
    swiglu_expert_into(x + lo * H, y + lo * H, n, H, F, w_gate_up + rows[i] * 2 * F * H, w_down + rows[i] * H * F,
                       gate_up.data(), act.data());
  }
  return true;
}

int64_t routed_f_chunks(int64_t F) { return std::clamp<int64_t>(F / 512, 1, 16); }

void swiglu_routed_into(const float* x_sorted, const int64_t* token_of, const float* route_w, const int64_t* starts,
                        const int64_t* addrs, int64_t num_used, int64_t T, int64_t H, int64_t F, float* acc) {
  auto at = [addrs](int64_t i, int64_t which) { return reinterpret_cast<const float*>(addrs[i * 3 + which]); };
  const int64_t R = starts[num_used];
  std::vector<float> act(static_cast<size_t>(R * F)), y(static_cast<size_t>(R * H));
  const int64_t C = routed_f_chunks(F);
  auto bound = [&](int64_t c, int64_t n) { return c == C ? n : (n * c / C) / 16 * 16; };
  int64_t most = 0;
  for (int64_t i = 0; i < num_used; ++i) most = std::max(most, starts[i + 1] - starts[i]);
  // Gate, up and their product: chunk c takes columns f0 .. f1 of every expert's F.
  at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> up(static_cast<size_t>(most * (F / C + 32)));  // every chunk is at most F / C + 16 wide
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t f0 = bound(c, F), fc = bound(c + 1, F) - f0;
      for (int64_t i = 0; i < num_used; ++i) {
        const int64_t lo = starts[i], n = starts[i + 1] - starts[i];
        if (n == 0 || fc == 0) continue;
        const float* x = x_sorted + lo * H;
        skinny_serial(x, at(i, 0) + f0 * H, act.data() + lo * F + f0, n, H, fc, H, F);
        skinny_serial(x, at(i, 1) + f0 * H, up.data(), n, H, fc, H, fc);
        for (int64_t m = 0; m < n; ++m) silu_mul(act.data() + (lo + m) * F + f0, up.data() + m * fc, fc);
      }
    }
  });
  // The down projection: chunk c takes output columns h0 .. h1 (its rows of w_down, whole).
  at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t h0 = bound(c, H), hc = bound(c + 1, H) - h0;
      for (int64_t i = 0; i < num_used; ++i) {
        const int64_t lo = starts[i], n = starts[i + 1] - starts[i];
        if (n == 0 || hc == 0) continue;
        skinny_serial(act.data() + lo * F, at(i, 2) + h0 * F, y.data() + lo * H + h0, n, F, hc, F, H);
      }
    }
  });
  // Every route's weighted output added to its token's sum, experts in ascending id.
  std::fill(acc, acc + T * H, 0.f);
  for (int64_t r = 0; r < R; ++r) {
    float* out = acc + token_of[r] * H;
    const float* yr = y.data() + r * H;
    for (int64_t k = 0; k < H; ++k) out[k] += yr[k] * route_w[r];
  }
}
