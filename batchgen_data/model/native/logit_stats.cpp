// What logprobs need of a logits row, in one read of it: log sum exp (the normaliser), the top k
// tokens, the chosen token (given, or the row's first maximum for greedy rows) with its value and
// its rank (vLLM's: how many logits are >= its logit).
//
// The row is read once, in blocks of 64 tokens: each block's maximum is kept (64 KiB-ish per
// row: V / 64 floats) and, while the block is in registers, exp(x - m) is added to a running sum
// whose shift m is the largest block maximum so far (the sum is rescaled on the rare block that
// raises it). Then, from the cache: the k largest block maxima name the only blocks that can hold
// the k largest tokens (``top_k``), and those blocks and the tail after the last whole block are
// searched for them. The rank needs no
// second pass when every token >= the chosen one is in the top k; else the row is counted again.
// A row holding a NaN or +inf gets that as its log sum exp and nothing else is defined (callers
// fall back to the torch passes, which carry torch's semantics for them).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kBlock = 128;
constexpr int64_t kVecs = kBlock / kWidth;
constexpr int64_t kFlush = 64;  // blocks summed in fp32 lanes before the sum moves to a double
constexpr float kLowest = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0, for a sum of them: relative error below 3.1e-6 (a degree-4 polynomial
// fitted to exp on [-ln2/2, ln2/2], the relative error minimised; a log sum exp moves by at
// most that, 60x inside the 2e-4 logprobs keep against transformers); below -87 the result is exp(-87), not 0; a NaN input gives NaN (the
// clamp's operands are ordered so that it passes: max returns its second operand when one is
// NaN), which is how the pass finds a NaN in a row without testing every vector. n = round(x /
// ln 2) comes from adding 1.5 * 2^23 (its bits then hold n + 127 where the exponent goes), which
// saves ``vexp_nonpos``'s round and conversion.
inline vec exp_for_sum(vec x) {
  x = vmax(vset1(-87.f), x);
  const vec shifter = vset1(12582912.f + 127.f);  // 1.5 * 2^23 + the exponent bias
  const vec t = vfma(x, vset1(1.44269504088896341f), shifter);
  const vec n = vsub(t, shifter);
  vec r = vfma(n, vset1(-0.693145751953125f), x);
  r = vfma(n, vset1(-1.428606765330187e-06f), r);
  vec p = vset1(0.041589923202991486f);
  p = vfma(p, r, vset1(0.16790641844272614f));
  p = vfma(p, r, vset1(0.5000222325325012f));
  p = vfma(p, r, vset1(0.999963641166687f));
  p = vfma(p, r, vset1(1.f));
  return vmul(p, vshift_exponent(t));
}

// Order of the top k: larger value first, then the smaller token id (torch's first maximum).
inline bool before(float av, int64_t ai, float bv, int64_t bi) { return av > bv || (av == bv && ai < bi); }

// Offers (v, id) to the sorted list (values, ids) of `size` entries, at most k.
inline void offer(float v, int64_t id, float* values, int64_t* ids, int64_t& size, int64_t k) {
  if (size == k && !before(v, id, values[k - 1], ids[k - 1])) return;
  int64_t p = size < k ? size++ : k - 1;
  for (; p > 0 && before(v, id, values[p - 1], ids[p - 1]); --p) {
    values[p] = values[p - 1];
    ids[p] = ids[p - 1];
  }
  values[p] = v;
  ids[p] = id;
}

// The stream's top k is a heap whose root (entry 0) is the kept entry every other comes before
// (the k-th, the threshold to beat): an entry goes in with log2 k moves where the sorted list
// takes k / 2 on average (64 lazy candidates: ~560 entries a row over the 152k vocabulary).
inline void offer_heap(float v, int64_t id, float* values, int64_t* ids, int64_t& size, int64_t k) {
  int64_t i;
  if (size < k) {  // up from the new leaf while its parent comes before it
    i = size++;
    while (i > 0) {
      const int64_t parent = (i - 1) / 2;
      if (!before(values[parent], ids[parent], v, id)) break;
      values[i] = values[parent];
      ids[i] = ids[parent];
      i = parent;
    }
  } else {
    if (!before(v, id, values[0], ids[0])) return;
    i = 0;  // down from the root while a child comes after it (the later child first)
    for (;;) {
      int64_t child = 2 * i + 1;
      if (child >= size) break;
      if (child + 1 < size && before(values[child], ids[child], values[child + 1], ids[child + 1])) ++child;
      if (!before(v, id, values[child], ids[child])) break;
      values[i] = values[child];
      ids[i] = ids[child];
      i = child;
    }
  }
  values[i] = v;
  ids[i] = id;
}

// Loads the block at p into v; returns its maximum.
inline float load_block(const float* p, vec* v) {
  vec vm = vset1(kLowest);
  for (int64_t i = 0; i < kVecs; ++i) {
    v[i] = vload(p + i * kWidth);
    vm = vmax(vm, v[i]);
  }
  return vmaxall(vm);
}

// The blocks' maxima and the row's log sum exp (NaN if the row holds one, +inf if it holds +inf).
float stats_pass(const float* row, int64_t V, float* block_max) {
  const int64_t blocks = V / kBlock;
  float m = kLowest;
  double total = 0.0;  // sum of exp(x - m) over the flushed blocks
  vec acc = vzero();   // ... and over the blocks since
  bool nan = false;
  for (int64_t b = 0; b < blocks; ++b) {
    vec v[kVecs];
    const float bm = load_block(row + b * kBlock, v);
    block_max[b] = bm;
    if (bm > m) {  // a new shift: what is summed so far is scaled to it (exp(-inf) = 0 at the start)
      const float scale = std::exp(m - bm);
      total *= scale;
      acc = vfma(acc, vset1(scale), vzero());
      m = bm;
    }
    if (m == kLowest) {  // every token so far is -inf (or NaN): nothing to add
      for (int64_t i = 0; i < kVecs; ++i) nan |= vhasnan(v[i]);
      continue;
    }
    const vec vshift = vset1(m);  // a NaN anywhere from here on makes the sum NaN
    for (int64_t i = 0; i < kVecs; ++i) acc = vadd(acc, exp_for_sum(vsub(v[i], vshift)));
    if ((b + 1) % kFlush == 0) {
      total += vsum(acc);
      acc = vzero();
    }
  }
  total += vsum(acc);
  float tail_max = kLowest;
  for (int64_t j = blocks * kBlock; j < V; ++j) {
    nan |= std::isnan(row[j]);
    tail_max = std::max(tail_max, row[j]);
  }
  const float top = std::max(m, tail_max);
  if (top == std::numeric_limits<float>::infinity()) {  // its sum is NaN (inf - inf): look for a NaN
    return std::any_of(row, row + V, [](float v) { return std::isnan(v); }) ? std::numeric_limits<float>::quiet_NaN() : top;
  }
  if (nan || std::isnan(total)) return std::numeric_limits<float>::quiet_NaN();
  if (top == kLowest) return top;  // every logit is -inf
  if (m != kLowest) total *= std::exp(static_cast<double>(m) - top);
  for (int64_t j = blocks * kBlock; j < V; ++j) total += std::exp(static_cast<double>(row[j]) - top);
  return top + static_cast<float>(std::log(total));
}

// The blocks' maxima alone (no sum); false if the row holds a NaN.
bool max_pass(const float* row, int64_t V, float* block_max) {
  const int64_t blocks = V / kBlock;
  bool nan = false;
  for (int64_t b = 0; b < blocks; ++b) {
    vec v[kVecs];
    block_max[b] = load_block(row + b * kBlock, v);
    for (int64_t i = 0; i < kVecs; ++i) nan |= vhasnan(v[i]);
  }
  for (int64_t j = blocks * kBlock; j < V; ++j) nan |= std::isnan(row[j]);
  return !nan;
}

// The k largest tokens (values, ids: sorted by `before`), from the block maxima: each of the k
// largest tokens lies in a block whose maximum is among the k largest block maxima (in the same
// order; else k blocks' maxima would each come before it), or in the tail.
void top_k(const float* row, int64_t V, const float* block_max, int64_t k, float* values, int64_t* ids) {
  const int64_t blocks = V / kBlock;
  std::vector<float> best_max(k);
  std::vector<int64_t> best(k);
  int64_t num_best = 0;
  for (int64_t b = 0; b < blocks; ++b) offer(block_max[b], b, best_max.data(), best.data(), num_best, k);
  int64_t size = 0;
  for (int64_t i = 0; i < num_best; ++i) {
    const int64_t start = best[i] * kBlock;
    for (int64_t j = start; j < start + kBlock; ++j) offer(row[j], j, values, ids, size, k);
  }
  for (int64_t j = blocks * kBlock; j < V; ++j) offer(row[j], j, values, ids, size, k);
}

constexpr uint32_t kLanes = kWidth >= 32 ? ~0u : (1u << kWidth) - 1;  // every lane of a vector
enum class Allowed { kAll, kSome, kNone };  // what a grammar mask allows of a block
static_assert(kBlock % 32 == 0, "a block is whole mask words");

// A block under a grammar mask (its kBlock / 32 words at wb): kAll and kNone load nothing. For
// kSome, allowed[j] holds vector j's lanes that it allows, v those lanes with -inf at the others,
// and bm their maximum.
inline Allowed load_allowed(const float* p, const uint32_t* wb, vec* v, uint32_t* allowed, float& bm) {
  uint32_t any = 0, all = ~0u;
  for (int64_t q = 0; q < kBlock / 32; ++q) {
    any |= wb[q];
    all &= wb[q];
  }
  if (all == ~0u) return Allowed::kAll;
  if (any == 0) return Allowed::kNone;
  const vec fill = vset1(kLowest);
  vec vm = fill;
  for (int64_t j = 0; j < kVecs; ++j) {
    const int64_t first = j * kWidth;
    allowed[j] = (wb[first / 32] >> (first % 32)) & kLanes;
    v[j] = vselect(allowed[j], vload(p + first), fill);
    vm = vmax(vm, v[j]);
  }
  bm = vmaxall(vm);
  return Allowed::kSome;
}

// Offers block v's lanes set in allowed (tokens base, base + 1, ...) to the top kk heap; once kk
// are held, only the lanes >= the kk-th value (a vector compare, not a scalar test per token).
inline void offer_block(const vec* v, const uint32_t* allowed, int64_t base, float* values, int64_t* ids,
                        int64_t& size, int64_t kk) {
  alignas(64) float lanes[kWidth];
  for (int64_t j = 0; j < kVecs; ++j) {
    uint32_t bits = allowed[j];
    if (size == kk) bits &= vmask_ge(v[j], values[0]);
    if (bits == 0) continue;
    vstore(lanes, v[j]);
    while (bits != 0) {
      const int t = __builtin_ctz(bits);
      bits &= bits - 1;
      offer_heap(lanes[t], base + j * kWidth + t, values, ids, size, kk);
    }
  }
}

// How many logits of the row are >= s.
int64_t count_at_least(const float* row, int64_t V, float s) {
  const int64_t nv = V - V % kWidth;
  int64_t count = 0;
  for (int64_t j = 0; j < nv; j += kWidth) count += __builtin_popcount(vmask_ge(vload(row + j), s));
  for (int64_t j = nv; j < V; ++j) count += row[j] >= s;
  return count;
}

}  // namespace

int64_t logit_topk_rows(const float* x, int64_t n, int64_t V, int64_t k, int64_t* chosen, float* top_values,
                        int64_t* top_ids, float* log_norm, float* chosen_value, int64_t* rank) {
  if (V <= 0 || k <= 0 || k > V) return -1;
  for (int64_t i = 0; i < n; ++i)
    if (chosen[i] >= V) return -1;
#pragma omp parallel
  {
    std::vector<float> block_max(V / kBlock);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float* row = x + i * V;
      log_norm[i] = stats_pass(row, V, block_max.data());
      if (!std::isfinite(log_norm[i])) continue;
      float* values = top_values + i * k;
      int64_t* ids = top_ids + i * k;
      top_k(row, V, block_max.data(), k, values, ids);
      if (chosen[i] < 0) chosen[i] = ids[0];  // greedy: the first maximum
      const float c = row[chosen[i]];
      chosen_value[i] = c;
      if (values[k - 1] < c) {  // every logit >= c is in the top k
        rank[i] = std::count_if(values, values + k, [c](float v) { return v >= c; });
      } else {
        rank[i] = count_at_least(row, V, c);
      }
    }
  }
  return std::count_if(log_norm, log_norm + n, [](float v) { return !std::isfinite(v); });
}

int64_t logit_topk_stream(const float* x, int64_t n, int64_t C, int64_t offset, int64_t k, bool with_norm, float* m,
                          double* total, int64_t* ties, float* top_values, int64_t* top_ids, int64_t* size,
                          uint8_t* bad, const int64_t* keep, const int32_t* words, int64_t W, const int64_t* mask_of) {
  if (C <= 0 || k <= 0 || n < 0) return -1;
  if (words != nullptr && (offset % 32 != 0 || offset / 32 + (C + 31) / 32 > W)) return -1;
  for (int64_t i = 0; keep != nullptr && i < n; ++i)
    if (keep[i] < 1 || keep[i] > k) return -1;
  const int64_t blocks = C / kBlock;
  // Static: each thread reads the rows torch's GEMM just wrote from its own cache (a dynamic
  // schedule made the plain greedy top 1 cost 1.08-1.10x the chunks' GEMMs instead of 1.06x,
  // benchmarks/lm_head_kernel.py).
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * C;
    const int64_t kk = keep != nullptr ? keep[i] : k;
    const uint32_t* mask = words != nullptr && mask_of[i] >= 0
                               ? reinterpret_cast<const uint32_t*>(words) + mask_of[i] * W + offset / 32
                               : nullptr;
    float mi = m[i];
    double ti = total[i];
    int64_t tie = ties[i], sz = size[i];
    bool nan = bad[i] != 0;
    float* values = top_values + i * k;
    int64_t* ids = top_ids + i * k;
    vec acc = vzero();
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = row + b * kBlock;
      vec v[kVecs];
      uint32_t allowed[kVecs];
      float bm = kLowest;
      const Allowed what = mask == nullptr ? Allowed::kAll : load_allowed(p, mask + b * (kBlock / 32), v, allowed, bm);
      if (what == Allowed::kNone) continue;  // nothing of it counts: not read
      if (what == Allowed::kAll) {
        bm = load_block(p, v);
        for (int64_t j = 0; j < kVecs; ++j) allowed[j] = kLanes;
      }
      if (bm > mi) {  // a new maximum: the sum so far is scaled to it, its ties start again
        const double scale = std::exp(static_cast<double>(mi) - bm);
        ti = (ti + vsum(acc)) * scale;
        acc = vzero();
        mi = bm;
        tie = 0;
      }
      if (bm == mi) {
        for (int64_t j = 0; j < kVecs; ++j) tie += __builtin_popcount(vmask_eq(v[j], bm));
      }
      if (!with_norm || mi == kLowest) {  // no exp to carry a NaN: test the block for one
        for (int64_t j = 0; j < kVecs; ++j) nan |= vhasnan(v[j]);
      } else {
        const vec vshift = vset1(mi);
        for (int64_t j = 0; j < kVecs; ++j) acc = vadd(acc, exp_for_sum(vsub(v[j], vshift)));
        if ((b + 1) % kFlush == 0) {
          ti += vsum(acc);
          acc = vzero();
        }
      }
      // A block all -inf offers nothing once kk are held.
      if (sz < kk || (bm >= values[0] && bm != kLowest)) {
        offer_block(v, allowed, offset + b * kBlock, values, ids, sz, kk);
      }
    }
    ti += vsum(acc);
    for (int64_t j = blocks * kBlock; j < C; ++j) {  // the tail of the last chunk
      if (mask != nullptr && !((mask[j / 32] >> (j % 32)) & 1u)) continue;
      const float v = row[j];
      nan |= std::isnan(v);
      if (v > mi) {
        ti *= std::exp(static_cast<double>(mi) - v);
        mi = v;
        tie = 0;
      }
      tie += v == mi;
      if (with_norm && mi != kLowest) ti += std::exp(static_cast<double>(v) - mi);
      offer_heap(v, offset + j, values, ids, sz, kk);
    }
    m[i] = mi;
    total[i] = ti;
    ties[i] = tie;
    size[i] = sz;
    // -inf so far is not bad: a masked chunk can allow nothing (the caller rejects a row whose
    // maximum stays -inf over the whole vocabulary).
    bad[i] = nan || std::isnan(ti) || (std::isinf(mi) && mi > 0);
  }
  return 0;
}

int64_t logit_topk_at(const float* x, int64_t num_rows, int64_t V, const int64_t* rows, int64_t n, int64_t k,
                      float* top_values, int64_t* top_ids) {
  if (V <= 0 || k <= 0 || k > V) return -1;
  for (int64_t i = 0; i < n; ++i)
    if (rows[i] < 0 || rows[i] >= num_rows) return -1;
  int64_t with_nan = 0;
#pragma omp parallel reduction(+ : with_nan)
  {
    std::vector<float> block_max(V / kBlock);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float* row = x + rows[i] * V;
      if (!max_pass(row, V, block_max.data())) {
        top_ids[i * k] = -1;
        ++with_nan;
        continue;
      }
      top_k(row, V, block_max.data(), k, top_values + i * k, top_ids + i * k);
    }
  }
  return with_nan;
}

