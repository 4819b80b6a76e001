// Greedy sampling's argmax on logits rows: the first maximum of each row (NaN counts as the
// maximum, the first NaN wins, as torch.argmax and transformers' greedy search pick it). Each
// row is read once as vectors for its maximum (and whether it holds a NaN), then searched from
// cache, as vectors, for the first position holding that value (a scalar search walked a long
// row element by element where the maximum lies late). One native call replaces the ~12 torch ops
// of the block search, which cost ~0.2 ms a step at one sequence.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels.h"
#include "simd.h"

namespace {

int64_t first_max(const float* row, int64_t V) {
  const int64_t nv = V - V % kWidth;
  vec m = vset1(-std::numeric_limits<float>::infinity());
  bool nan = false;
  for (int64_t j = 0; j < nv; j += kWidth) {
    const vec v = vload(row + j);
    nan |= vhasnan(v);
    m = vmax(m, v);
  }
  float best = vmaxall(m);
  for (int64_t j = nv; j < V; ++j) {
    nan |= std::isnan(row[j]);
    best = std::max(best, row[j]);
  }
  if (nan) {
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(row[j])) return j;
  }
  // The first position holding the maximum, a vector of the row (now in cache) at a time.
  for (int64_t j = 0; j < nv; j += kWidth) {
    const uint32_t hit = vmask_eq(vload(row + j), best);
    if (hit != 0) return j + __builtin_ctz(hit);
  }
  for (int64_t j = nv; j < V; ++j)
    if (row[j] == best) return j;
  return 0;  // unreachable: the maximum is in the row
}

}  // namespace

bool first_argmax_rows(const float* x, int64_t n, int64_t V, int64_t* out) {
  if (V <= 0) return false;
#pragma omp parallel for schedule(static) if (n > 1)
  for (int64_t i = 0; i < n; ++i) out[i] = first_max(x + i * V, V);
  return true;
}
