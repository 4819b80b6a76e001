// Decode attention over paged KV, read in place: one query token per sequence.
//
// The torch path gathers every sequence's pages into a contiguous [B, L, Nkv, D] buffer and then
// runs SDPA over it, so each layer reads the KV twice and writes it once. Here each task (a
// sequence, or one KV head of it) walks its block table in token order and reads each key and
// value once, for all the query heads that share its KV heads (GQA): scores, a max-subtracted
// softmax in fp32, then the weighted sum of values. Tasks run on ATen's thread pool.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd.h"

bool pages_valid(const int64_t* table, const int64_t* ctx, int64_t B, int64_t P, int64_t block_size,
                 int64_t num_blocks) {
  // Every page a sequence reads must exist: a bad table is an error, never a stray read.
  for (int64_t b = 0; b < B; ++b) {
    if (ctx[b] < 0 || ctx[b] > P * block_size) return false;
    for (int64_t i = 0; i < (ctx[b] + block_size - 1) / block_size; ++i)
      if (table[b * P + i] < 0 || table[b * P + i] >= num_blocks) return false;
  }
  return true;
}

bool paged_decode_attention_into(const float* qp, const float* kp, const float* vp, const int64_t* table,
                                 const int64_t* ctx, float* op, int64_t B, int64_t Nq, int64_t D, int64_t block_size,
                                 int64_t Nkv, int64_t P, int64_t num_blocks, float sc, int64_t window) {
  if (!pages_valid(table, ctx, B, P, block_size, num_blocks)) return false;
  const int64_t G = Nq / Nkv;
  const int64_t token_stride = Nkv * D;  // floats between consecutive tokens of a page
  // A task is a sequence with all its KV heads, so each token's record (every head, contiguous
  // in its page) and each page stream in order: the KV of a decode step is cold in cache (the
  // weights streamed through since), and reading one head's slice of every record instead
  // (a 1/Nkv-dense stride) took 4x as long on a 2-core AMD EPYC. Only fewer sequences than
  // threads with long contexts split a sequence by KV head.
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, ctx[b]);
  const int64_t heads_per_task = (B < at::get_num_threads() && max_len >= 1024) ? 1 : Nkv;
  const int64_t tasks_per_seq = Nkv / heads_per_task;
  at::parallel_for(0, B * tasks_per_seq, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / tasks_per_seq;
      const int64_t h0 = (task % tasks_per_seq) * heads_per_task, h1 = h0 + heads_per_task;
      const int64_t len = ctx[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t rows = (h1 - h0) * G;  // query heads of this task: score row r = (h - h0) * G + g
      scores.assign(static_cast<size_t>(rows * std::max<int64_t>(n, 1)), 0.f);
      const int64_t* blocks = table + b * P;
      const float* qb = qp + b * Nq * D;
      for (int64_t t = first; t < len; ++t) {
        const float* rec = kp + (blocks[t / block_size] * block_size + t % block_size) * token_stride;
        for (int64_t h = h0; h < h1; ++h) {
          const float* key = rec + h * D;
          for (int64_t g = 0; g < G; ++g) {
            scores[((h - h0) * G + g) * n + (t - first)] = dot(qb + (h * G + g) * D, key, D) * sc;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* row = scores.data() + r * n;
        float mx = -std::numeric_limits<float>::infinity();
        bool nan = false;
        for (int64_t i = 0; i < n; ++i) {
          mx = std::max(mx, row[i]);
          nan |= std::isnan(row[i]);
        }
        // Below exp(-87) a weight is subnormal in fp32 (slow to compute and multiply, and far
        // under the sum's last bit): it counts as zero. The exponentials are vectors
        // (simd.h's polynomial, ~2e-7 relative error): a scalar std::exp per score was most of
        // the attention time at 64 running sequences. A row holding a NaN takes the scalar
        // loop, which carries the NaN into the output as SDPA does.
        const vec vm = vset1(mx);
        vec acc = vzero();
        int64_t i = 0;
        for (; !nan && i + kWidth <= n; i += kWidth) {
          const vec e = vexp_or_zero(vsub(vload(row + i), vm));
          vstore(row + i, e);
          acc = vadd(acc, e);
        }
        float sum = vsum(acc);
        for (; i < n; ++i) {
          const float z = row[i] - mx;
          row[i] = z < -87.f ? 0.f : std::exp(z);
          sum += row[i];
        }
        const float inv = n > 0 ? 1.f / sum : 0.f;
        for (int64_t j = 0; j < n; ++j) row[j] *= inv;
      }
      float* ob = op + b * Nq * D;
      std::fill(ob + h0 * G * D, ob + h1 * G * D, 0.f);
      for (int64_t t = first; t < len; ++t) {
        const float* rec = vp + (blocks[t / block_size] * block_size + t % block_size) * token_stride;
        for (int64_t h = h0; h < h1; ++h) {
          const float* val = rec + h * D;
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[((h - h0) * G + g) * n + (t - first)];
            if (p != 0.f) axpy(ob + (h * G + g) * D, p, val, D);
          }
        }
      }
    }
  });
  return true;
}
