// What logprobs need of a logits row, in one read of it: the maxima of its blocks (for the
// top-k, model/native/kernels.py) and log sum exp (the normaliser). A row is cut into chunks
// that fit the L2 cache; each chunk is read once from memory for its block maxima and its max,
// then again from cache for sum exp(x - max); the chunks' (max, sum) pairs are then combined.
// A row holding a NaN gets a NaN log sum exp (as torch.logsumexp gives), and its block maxima
// are not defined (callers that need them exact check the log sum exp first).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kChunk = 16384;  // floats: 64 KiB, in L2 between the two passes

}  // namespace

bool logit_row_stats(const float* x, int64_t n, int64_t V, int64_t block, float* block_max, float* log_norm) {
  if (block <= 0 || block % kWidth != 0 || V <= 0) return false;
  const int64_t num_blocks = V / block;  // the tail (V % block) is in no block
  const int64_t chunk = std::max<int64_t>(1, kChunk / block) * block;
  const int64_t chunks = (V + chunk - 1) / chunk;
  std::vector<float> chunk_max(n * chunks), chunk_sum(n * chunks);
  const float lowest = -std::numeric_limits<float>::infinity();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* row = x + i * V;
      const int64_t begin = c * chunk, end = std::min(V, begin + chunk);
      float m = lowest;
      bool nan = false;
      int64_t j = begin;
      for (; j + block <= end; j += block) {
        vec vm = vset1(lowest);
        for (int64_t k = 0; k < block; k += kWidth) {
          const vec v = vload(row + j + k);
          nan |= vhasnan(v);
          vm = vmax(vm, v);
        }
        const float bm = vmaxall(vm);
        block_max[i * num_blocks + j / block] = bm;
        m = std::max(m, bm);
      }
      for (; j < end; ++j) {
        nan |= std::isnan(row[j]);
        m = std::max(m, row[j]);
      }
      if (nan) m = std::numeric_limits<float>::quiet_NaN();  // the row's log sum exp is NaN
      const vec vm = vset1(m);
      vec acc = vzero();
      j = begin;
      for (; j + kWidth <= end; j += kWidth) acc = vadd(acc, vexp_nonpos(vsub(vload(row + j), vm)));
      float s = vsum(acc);
      for (; j < end; ++j) s += std::exp(row[j] - m);
      chunk_max[i * chunks + c] = m;
      chunk_sum[i * chunks + c] = s;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* cm = chunk_max.data() + i * chunks;
    const float* cs = chunk_sum.data() + i * chunks;
    if (std::any_of(cm, cm + chunks, [](float v) { return std::isnan(v); })) {
      log_norm[i] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float m = *std::max_element(cm, cm + chunks);
    double s = 0.0;
    for (int64_t c = 0; c < chunks; ++c) s += cm[c] == lowest ? 0.0 : cs[c] * std::exp(static_cast<double>(cm[c] - m));
    log_norm[i] = m + static_cast<float>(std::log(s));
  }
  return true;
}
