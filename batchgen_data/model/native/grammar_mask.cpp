// Grammar bitmasks on logits rows (structured outputs), one pass over each row's mask words:
// a greedy row's token is the first maximum over its allowed tokens, found without writing the
// row; every other row gets -inf at its disallowed tokens. A mask row is ceil(V / 32) int32
// words; token t is allowed when bit t % 32 of word t / 32 is set. Non-zero words are read as
// masked vectors and all-zero words skipped (or filled whole), so a grammar state that allows
// most of the vocabulary costs about one read of the row, and one that allows few costs little
// more than the words holding its tokens.
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr uint32_t kAllOnes = 0xFFFFFFFFu;

constexpr int64_t kMaxRun = 64;  // non-zero words reduced together (2,048 tokens, 8 KiB)

// The first allowed position in row[base, base + 32 * num_words) holding `value`, or -1.
int64_t first_allowed_equal(const float* row, const uint32_t* words, int64_t base, int64_t num_words, float value) {
  for (int64_t w = 0; w < num_words; ++w) {
    uint32_t word = words[w];
    while (word != 0) {
      const int64_t token = base + w * 32 + __builtin_ctz(word);
      word &= word - 1;
      if (row[token] == value) return token;
    }
  }
  return -1;
}

// The scalar walk over the set bits of words [w0, w1): updates (best, best_token); returns the
// first allowed NaN's position, or -1.
int64_t walk_bits(const float* row, int64_t V, const uint32_t* words, int64_t w0, int64_t w1, float& best,
                  int64_t& best_token) {
  for (int64_t w = w0; w < w1; ++w) {
    uint32_t word = words[w];
    while (word != 0) {
      const int64_t token = w * 32 + __builtin_ctz(word);
      word &= word - 1;
      if (token >= V) return -1;
      const float v = row[token];
      if (std::isnan(v)) return token;
      if (best_token < 0 || v > best) {
        best = v;
        best_token = token;
      }
    }
  }
  return -1;
}

// The first maximum over the allowed tokens of one row (NaN counts as the maximum, the first
// NaN wins, as in torch.argmax); -1 when the row allows no token. Runs of non-zero words are
// reduced with masked vector maxima and searched for their maximum's position only when it
// beats the best so far; a run holding a NaN, and the last word when V is not a multiple of 32,
// take the scalar walk.
int64_t first_allowed_max(const float* row, int64_t V, const uint32_t* words, int64_t W) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_token = -1;
  const int64_t full_words = kWidth > 1 ? V / 32 : 0;  // words whose 32 tokens are all below V
  int64_t w = 0;
  while (w < full_words) {
    if (words[w] == 0) {
      ++w;
      continue;
    }
    int64_t end_w = w + 1;
    while (end_w < full_words && end_w - w < kMaxRun && words[end_w] != 0) ++end_w;
    vec m = vset1(-std::numeric_limits<float>::infinity());
    bool nan = false;
    for (int64_t u = w; u < end_w; ++u) {
      const uint32_t word = words[u];
      for (int64_t k = 0; k < 32; k += kWidth) {
        const vec v = vload(row + u * 32 + k);
        nan |= vhasnan(v);
        m = vmax_masked(m, v, word >> k);
      }
    }
    if (nan) {  // exact, in token order
      const int64_t first_nan = walk_bits(row, V, words, w, end_w, best, best_token);
      if (first_nan >= 0) return first_nan;
    } else {
      const float run_max = vmaxall(m);
      if (best_token < 0 || run_max > best) {
        best = run_max;
        best_token = first_allowed_equal(row, words + w, w * 32, end_w - w, run_max);
      }
    }
    w = end_w;
  }
  const int64_t first_nan = walk_bits(row, V, words, w, W, best, best_token);
  return first_nan >= 0 ? first_nan : best_token;
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
