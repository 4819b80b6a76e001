// A decoder layer's two residual blocks for a few decoding tokens (one per sequence), each in
// one call: at one to eight running sequences a decode step is ~1,000 small torch ops, 1-5 us
// each, a third of the step beside the weights it streams. The maths follows the torch path
// operation by operation (RMSNorm in fp32, rotate-half RoPE, the router's fp32 softmax and top-k,
// per-expert SwiGLU, routes added in expert order); only summation orders differ.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kernels.h"
#include "skinny_gemm.h"

namespace {

// y = w * (x * rsqrt(mean(x^2) + eps)) over rows of n (RMSNorm as the reference computes it).
void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.f / std::sqrt(static_cast<float>(ss / n) + eps);
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) {
      const float t = xr[i] * inv;
      yr[i] = w[i] * t;
    }
  }
}

// x * cos + rotate_half(x) * sin over one head of d dims (rotate_half = [-x[d/2:], x[:d/2]]).
void rope_head(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  std::vector<float> out(static_cast<size_t>(d));
  for (int64_t i = 0; i < d; ++i) {
    const float rotated = i < half ? -x[i + half] : x[i - half];
    const float a = x[i] * cos[i];
    const float b = rotated * sin[i];
    out[i] = a + b;
  }
  std::copy(out.begin(), out.end(), x);
}

}  // namespace

bool attention_block_decode(const float* h, float* h_out, int64_t T, int64_t H, const float* norm_w, float eps,
                            const float* w_qkv, int64_t Nq, int64_t Nkv, int64_t D, const float* q_norm,
                            const float* k_norm, const float* cos, const float* sin, const int64_t* slots,
                            float* k_cache, float* v_cache, int64_t num_blocks, int64_t block_size,
                            const int64_t* table, const int64_t* ctx, int64_t P, const float* w_o, float scale,
                            int64_t window) {
  const int64_t width = (Nq + 2 * Nkv) * D;
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] < 0 || slots[t] >= num_blocks * block_size) return false;
  if (!pages_valid(table, ctx, T, P, block_size, num_blocks)) return false;  // before any K/V is written
  std::vector<float> x(static_cast<size_t>(T * H)), qkv(static_cast<size_t>(T * width));
  rms_norm_rows(h, norm_w, x.data(), T, H, eps);
  skinny_into(x.data(), w_qkv, qkv.data(), T, H, width);
  std::vector<float> q(static_cast<size_t>(T * Nq * D));
  for (int64_t t = 0; t < T; ++t) {
    float* row = qkv.data() + t * width;
    float* qh = row;
    float* kh = row + Nq * D;
    const float* vh = row + (Nq + Nkv) * D;
    if (q_norm != nullptr) {  // per-head RMSNorm of q and k (Qwen3)
      rms_norm_rows(qh, q_norm, qh, Nq, D, eps);
      rms_norm_rows(kh, k_norm, kh, Nkv, D, eps);
    }
    for (int64_t i = 0; i < Nq; ++i) rope_head(qh + i * D, cos + t * D, sin + t * D, D);
    for (int64_t i = 0; i < Nkv; ++i) rope_head(kh + i * D, cos + t * D, sin + t * D, D);
    std::copy(qh, qh + Nq * D, q.data() + t * Nq * D);
    std::copy(kh, kh + Nkv * D, k_cache + slots[t] * Nkv * D);
    std::copy(vh, vh + Nkv * D, v_cache + slots[t] * Nkv * D);
  }
  std::vector<float> attn(static_cast<size_t>(T * Nq * D));
  if (!paged_decode_attention_into(q.data(), k_cache, v_cache, table, ctx, attn.data(), T, Nq, D, block_size, Nkv, P,
                                   num_blocks, scale, window))
    return false;
  skinny_into(attn.data(), w_o, h_out, T, Nq * D, H);
  for (int64_t i = 0; i < T * H; ++i) h_out[i] = h[i] + h_out[i];
  return true;
}

bool moe_block_decode(const float* h, float* h_out, int64_t T, int64_t H, const float* norm_w, float eps,
                      const float* w_router, int64_t E, int64_t K, bool renormalize, const int64_t* experts,
                      int64_t F, int64_t* counts) {
  if (K < 1 || K > E) return false;
  std::vector<float> x(static_cast<size_t>(T * H)), logits(static_cast<size_t>(T * E));
  rms_norm_rows(h, norm_w, x.data(), T, H, eps);
  skinny_into(x.data(), w_router, logits.data(), T, H, E);
  // Router: fp32 softmax over the experts, the top k (ties to the lower id), optionally renormalised.
  std::vector<int64_t> ids(static_cast<size_t>(T * K));
  std::vector<float> weights(static_cast<size_t>(T * K));
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::fill(counts, counts + E, 0);
  for (int64_t t = 0; t < T; ++t) {
    float* p = logits.data() + t * E;
    const float mx = *std::max_element(p, p + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = std::exp(p[e] - mx);
      sum += p[e];
    }
    for (int64_t e = 0; e < E; ++e) p[e] = p[e] / sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [p](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float kept = 0.f;
    for (int64_t j = 0; j < K; ++j) kept += p[order[j]];
    for (int64_t j = 0; j < K; ++j) {
      ids[t * K + j] = order[j];
      weights[t * K + j] = renormalize ? p[order[j]] / kept : p[order[j]];
      if (experts[order[j] * 3] == 0) return false;  // an expert this store does not hold
      ++counts[order[j]];
    }
  }
  // The routes grouped by expert in ascending id, tokens in order within each (as the
  // expert-sorted routes of the torch path), then every expert in two parallel regions.
  std::vector<int64_t> starts{0}, addrs, token_of;
  std::vector<float> route_w, xs;
  token_of.reserve(static_cast<size_t>(T * K));
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] == 0) continue;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j)
        if (ids[t * K + j] == e) {
          token_of.push_back(t);
          route_w.push_back(weights[t * K + j]);
          xs.insert(xs.end(), x.data() + t * H, x.data() + (t + 1) * H);
        }
    addrs.insert(addrs.end(), experts + e * 3, experts + e * 3 + 3);
    starts.push_back(static_cast<int64_t>(token_of.size()));
  }
  std::vector<float> acc(static_cast<size_t>(T * H));
  swiglu_routed_into(xs.data(), token_of.data(), route_w.data(), starts.data(), addrs.data(),
                     static_cast<int64_t>(starts.size()) - 1, T, H, F, acc.data());
  for (int64_t i = 0; i < T * H; ++i) h_out[i] = h[i] + acc[i];
  return true;
}

bool decode_forward(float* h, int64_t T, int64_t H, int64_t L, const int64_t* layer_ptrs, const int64_t* layer_dims,
                    float eps, const float* cos, const float* sin, const int64_t* slots, int64_t num_blocks,
                    int64_t block_size, const int64_t* table, const int64_t* ctx, int64_t P, float scale,
                    int64_t* counts, double* seconds) {
  std::vector<float> mid(static_cast<size_t>(T * H)), out(static_cast<size_t>(T * H));
  seconds[0] = seconds[1] = seconds[2] = seconds[3] = 0.0;
  int64_t expert_offset = 0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* p = layer_ptrs + l * kLayerPtrs;
    const int64_t* d = layer_dims + l * kLayerDims;
    auto as_f = [](int64_t a) { return reinterpret_cast<float*>(a); };
    const auto t0 = std::chrono::steady_clock::now();
    if (!attention_block_decode(h, mid.data(), T, H, as_f(p[0]), eps, as_f(p[1]), d[0], d[1], d[2], as_f(p[2]),
                                as_f(p[3]), cos, sin, slots, as_f(p[4]), as_f(p[5]), num_blocks, block_size, table, ctx,
                                P, as_f(p[6]), scale, d[3]))
      return false;
    const auto t1 = std::chrono::steady_clock::now();
    if (!moe_block_decode(mid.data(), out.data(), T, H, as_f(p[7]), eps, as_f(p[8]), d[4], d[5], d[6] != 0,
                          reinterpret_cast<const int64_t*>(p[9]), d[7], counts + expert_offset))
      return false;
    const auto t2 = std::chrono::steady_clock::now();
    seconds[0] += std::chrono::duration<double>(t1 - t0).count();
    seconds[1] += std::chrono::duration<double>(t2 - t1).count();
    for (int64_t e = 0; e < d[4]; ++e) {
      const int64_t c = counts[expert_offset + e];
      seconds[2] += c > 0 ? 1.0 : 0.0;
      seconds[3] += static_cast<double>(c);
    }
    expert_offset += d[4];
    std::copy(out.begin(), out.end(), h);
  }
  return true;
}

void norm_logits(const float* h, float* logits, int64_t T, int64_t H, const float* norm_w, float eps,
                 const float* lm_head, int64_t V) {
  std::vector<float> x(static_cast<size_t>(T * H));
  rms_norm_rows(h, norm_w, x.data(), T, H, eps);
  skinny_into(x.data(), lm_head, logits, T, H, V);
}
