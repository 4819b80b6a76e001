// Grammar bitmasks on logits rows (structured outputs), one pass over each row's mask words:
// a greedy row's token is the first maximum over its allowed tokens, found without writing the
// row; every other row gets -inf at its disallowed tokens. A mask row is ceil(V / 32) int32
// words; token t is allowed when bit t % 32 of word t / 32 is set. An all-ones word is read as
// vectors and an all-zeros word is skipped (or filled whole), so a grammar state that allows
// most of the vocabulary costs about one read of the row, and one that allows few costs little
// more than its set bits.
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr uint32_t kAllOnes = 0xFFFFFFFFu;

constexpr int64_t kMaxRun = 64;  // all-ones words reduced together (2,048 tokens, 8 KiB)

// The first position in row[begin, end) holding `value` (a NaN for a NaN value).
int64_t first_equal(const float* row, int64_t begin, int64_t end, float value) {
  for (int64_t t = begin; t < end; ++t) {
    if (row[t] == value || (std::isnan(value) && std::isnan(row[t]))) return t;
  }
  return end;
}

// The first maximum over the allowed tokens of one row (NaN counts as the maximum, the first
// NaN wins, as in torch.argmax); -1 when the row allows no token. A run of all-ones words is
// reduced with vectors, and searched for its maximum's position only when it beats the best.
int64_t first_allowed_max(const float* row, int64_t V, const uint32_t* words, int64_t W) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_token = -1;
  int64_t w = 0;
  while (w < W) {
    uint32_t word = words[w];
    const int64_t base = w * 32;
    if (word == 0) {
      ++w;
      continue;
    }
    if (word == kAllOnes && base + 32 <= V && kWidth > 1) {
      int64_t end_w = w + 1;
      while (end_w < W && end_w - w < kMaxRun && words[end_w] == kAllOnes && (end_w + 1) * 32 <= V) ++end_w;
      const int64_t end = end_w * 32;
      vec m = vload(row + base);
      bool nan = vhasnan(m);
      for (int64_t t = base + kWidth; t < end; t += kWidth) {
        const vec v = vload(row + t);
        nan |= vhasnan(v);
        m = vmax(m, v);
      }
      if (nan) return first_equal(row, base, end, std::numeric_limits<float>::quiet_NaN());
      const float run_max = vmaxall(m);
      if (best_token < 0 || run_max > best) {
        best = run_max;
        best_token = first_equal(row, base, end, run_max);
      }
      w = end_w;
      continue;
    }
    while (word != 0) {
      const int64_t token = base + __builtin_ctz(word);
      word &= word - 1;
      if (token >= V) break;
      const float v = row[token];
      if (std::isnan(v)) return token;
      if (best_token < 0 || v > best) {
        best = v;
        best_token = token;
      }
    }
    ++w;
  }
  return best_token;
}

// -inf at every disallowed token of one row.
void mask_disallowed(float* row, int64_t V, const uint32_t* words, int64_t W) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const vec fill = vset1(minus_inf);
  for (int64_t w = 0; w < W; ++w) {
    const uint32_t word = words[w];
    if (word == kAllOnes) continue;
    const int64_t base = w * 32;
    if (word == 0 && base + 32 <= V) {
      for (int64_t k = 0; k < 32; k += kWidth) vstore(row + base + k, fill);
      continue;
    }
    uint32_t clear = ~word;
    while (clear != 0) {
      const int64_t token = base + __builtin_ctz(clear);
      clear &= clear - 1;
      if (token >= V) break;
      row[token] = minus_inf;
    }
  }
}

}  // namespace

bool grammar_mask(float* x, int64_t num_rows, int64_t V, const int64_t* rows, int64_t n, const int32_t* words,
                  int64_t W, const uint8_t* greedy, int64_t* picks) {
  if (V <= 0 || W != (V + 31) / 32) return false;
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0 || rows[i] >= num_rows) return false;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    float* row = x + rows[i] * V;
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(words) + i * W;
    int64_t pick = -1;
    if (greedy[i]) pick = first_allowed_max(row, V, mask, W);
    if (pick < 0) mask_disallowed(row, V, mask, W);
    picks[i] = pick;
  }
  return true;
}
