// The routed experts of one MoE layer for few rows each, in one call: per expert,
// gate_up = x W_gu^T (skinny GEMM), a = silu(gate) * up, y = a W_d^T (skinny GEMM).
//
// The torch path runs each expert as five ops from Python (two GEMMs, chunk, silu, multiply)
// plus a copy into the output; at decode's 1-8 rows per expert that per-op cost is a tenth of
// the layer. Here one call walks the experts, reusing one scratch buffer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "skinny_gemm.h"

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
