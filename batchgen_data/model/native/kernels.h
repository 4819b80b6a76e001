// The native kernels on raw row-major fp32 buffers; bindings.cpp exposes them to Python, where
// model/native/kernels.py checks shapes and allocates outputs.
#pragma once

#include <cstdint>

// One SwiGLU expert on n rows: y [n, H] = (silu(x Wg^T) * x Wu^T) Wd^T, w_gate_up [2F, H] (gate
// rows first), w_down [H, F]; gate_up [n, 2F] and act [n, F] are scratch.
void swiglu_expert_into(const float* x, float* y, int64_t n, int64_t H, int64_t F, const float* w_gate_up,
                        const float* w_down, float* gate_up, float* act);

// y_sorted [R, H] for x_sorted [R, H] grouped by expert: starts[0..num_used] are the segment
// bounds, rows[i] the weight row of the i-th segment's expert in w_gate_up [num_rows, 2F, H]
// (gate rows first) and w_down [num_rows, H, F]. False (nothing computed) for bounds or rows
// out of range.
bool swiglu_experts_into(const float* x, float* y, int64_t R, int64_t H, int64_t F, const int64_t* starts,
                         const int64_t* rows, int64_t num_used, const float* w_gate_up, const float* w_down,
                         int64_t num_rows);

// The routed experts of one MoE layer: acc [T, H] = the sum over routes
// (token token_of[r], weight route_w[r]) of the weight times the SwiGLU expert of x_sorted [R, H]
// row r, the rows grouped by expert (segment i = starts[i] .. starts[i+1], its expert's weights at
// the addresses addrs[3i .. 3i+2]: gate [F, H], up [F, H] and down [H, F], each row-major; the
// gate and up of a stacked [2F, H] row, or separate tensors such as a memory-mapped checkpoint's
// per-expert w1 and w3). Two parallel regions for the whole layer, not two
// joins per expert: in the first each of routed_f_chunks(F) chunks takes its slice of every
// expert's F (gate and up rows, SiLU and product), in the second its slice of the outputs (rows
// of w_down, whole). Every weight row is read once, contiguously, and every output is one full
// dot product, so the result does not depend on the thread count.
int64_t routed_f_chunks(int64_t F);
void swiglu_routed_into(const float* x_sorted, const int64_t* token_of, const float* route_w, const int64_t* starts,
                        const int64_t* addrs, int64_t num_used, int64_t T, int64_t H, int64_t F, float* acc);

// Every page the B contexts need is named in table [B, P] and exists.
bool pages_valid(const int64_t* table, const int64_t* ctx, int64_t B, int64_t P, int64_t block_size,
                 int64_t num_blocks);

// out [B, Nq * D]: one query per sequence (q [B, Nq, D]) over paged KV ([num_blocks,
// block_size, Nkv, D] each), block_table [B, P], context_lens [B]; window 0 = none. False
// (nothing computed) where a context needs a page beyond the table or a block that does not exist.
bool paged_decode_attention_into(const float* q, const float* k_cache, const float* v_cache, const int64_t* table,
                                 const int64_t* context_lens, float* out, int64_t B, int64_t Nq, int64_t D,
                                 int64_t block_size, int64_t Nkv, int64_t P, int64_t num_blocks, float scale,
                                 int64_t window);

// h_out = h + attention(rms_norm(h)) for T decoding tokens (one per sequence, sequence t's KV
// in table row t): QKV, per-head q/k RMSNorm when q_norm/k_norm are given (else nullptr),
// rotate-half RoPE over all D dims (cos/sin [T, D]), the new K/V written to slots[t], paged
// attention, O. False (nothing written) for a slot, page or block out of range.
bool attention_block_decode(const float* h, float* h_out, int64_t T, int64_t H, const float* norm_w, float eps,
                            const float* w_qkv, int64_t Nq, int64_t Nkv, int64_t D, const float* q_norm,
                            const float* k_norm, const float* cos, const float* sin, const int64_t* slots,
                            float* k_cache, float* v_cache, int64_t num_blocks, int64_t block_size,
                            const int64_t* table, const int64_t* ctx, int64_t P, const float* w_o, float scale,
                            int64_t window);

// h_out = h + MoE(rms_norm(h)) for T tokens: the softmax_topk router (w_router [E, H]), SwiGLU
// experts of FFN size F whose weights sit at the addresses experts [E, 3] (gate [F, H], up [F, H],
// down [H, F]; 0: not held); counts [E] gets the routed tokens per expert. False for a routed
// expert that is not held.
bool moe_block_decode(const float* h, float* h_out, int64_t T, int64_t H, const float* norm_w, float eps,
                      const float* w_router, int64_t E, int64_t K, bool renormalize, const int64_t* experts,
                      int64_t F, int64_t* counts);

// For logprobs, per row i of x [n, V], reading it once from memory: log_norm[i] = log sum_j
// exp(x[i, j]); its k largest logits (top_values [n, k] descending, top_ids [n, k]; ties: the
// smaller id first); chosen[i] (in: a token id, or -1 for the row's first maximum, written
// back); chosen_value[i] = x[i, chosen[i]] and rank[i] = how many of the row's logits are >= it.
// A row holding a NaN or +inf, or only -inf, gets that as log_norm and nothing else written.
// Returns how many rows did; -1 (nothing computed) unless 0 < k <= V and every chosen[i] < V.
int64_t logit_topk_rows(const float* x, int64_t n, int64_t V, int64_t k, int64_t* chosen, float* top_values,
                        int64_t* top_ids, float* log_norm, float* chosen_value, int64_t* rank);

// The top k of rows rows[0..n) of x [num_rows, V] in place (top_values, top_ids [n, k], order
// as above), no sums: a row holding a NaN gets top_ids[i * k] = -1 and nothing else. Returns
// how many did; -1 (nothing computed) unless 0 < k <= V and every row is in range.
int64_t logit_topk_at(const float* x, int64_t num_rows, int64_t V, const int64_t* rows, int64_t n, int64_t k,
                      float* top_values, int64_t* top_ids);

// The same over a vocabulary too long to keep as logits, a chunk x [n, C] of them at a time
// (tokens offset .. offset + C, in order; the lm_head's GEMM writes each chunk while the last
// is in cache): per row, the maximum so far m, sum exp(x - m) (total, with_norm only), how many
// logits equal m (ties: the greedy token's rank), the top k (top_values, top_ids, size of
// them: a heap whose first entry is the k-th, the one every other comes before; the caller
// sorts them after the last chunk) and bad (a NaN or +inf seen: the row must take the full
// logits; a chunk all -inf, a grammar mask's disallowed tokens, is not bad). Start each row at
// m = -inf, total = ties = size = bad = 0. keep (null: k for every row): row i keeps its top
// keep[i] <= k (top_values and top_ids stay [n, k]). words (null: none): grammar bitmasks
// [r, W] of the whole vocabulary (bit t % 32 of word t / 32 allows token t); row i is under
// mask row mask_of[i] (-1: none): only its allowed tokens count, as if the others were -inf,
// except that they are not offered to its top (size may stay below kk), and blocks it allows
// nothing of are not read. -1 for k or C <= 0, a keep outside 1..k, or masks with an offset
// that is not a multiple of 32 or words too short for the chunk.
int64_t logit_topk_stream(const float* x, int64_t n, int64_t C, int64_t offset, int64_t k, bool with_norm, float* m,
                          double* total, int64_t* ties, float* top_values, int64_t* top_ids, int64_t* size,
                          uint8_t* bad, const int64_t* keep, const int32_t* words, int64_t W, const int64_t* mask_of);

// Structured outputs: grammar bitmasks ([n, W] int32 words, W = ceil(V / 32); bit t % 32 of word
// t / 32 allows token t) on rows rows[i] of x [num_rows, V]. A greedy row (greedy[i] != 0) is not
// written: picks[i] is the first maximum over its allowed tokens (NaN first, as argmax). Every
// other row, and a greedy row allowing nothing (picks[i] = -1), gets -inf at each disallowed
// token. False (nothing done) for a row index out of range or W that does not match V.
bool grammar_mask(float* x, int64_t num_rows, int64_t V, const int64_t* rows, int64_t n, const int32_t* words,
                  int64_t W, const uint8_t* greedy, int64_t* picks);

// Greedy sampling: out[i] = the first maximum of row i of x [n, V] (NaN counts as the maximum,
// the first NaN wins, as torch.argmax). False for V <= 0.
bool first_argmax_rows(const float* x, int64_t n, int64_t V, int64_t* out);

// A whole decode forward over L decoder layers, each ``attention_block_decode`` then
// ``moe_block_decode``, h [T, H] updated in place. Per layer, layer_ptrs [L, kLayerPtrs]: input
// norm, w_qkv, q_norm (or 0), k_norm (or 0), k_cache, v_cache, w_o, post-attention norm,
// w_router, experts (the [E, 3] address table of ``moe_block_decode``); layer_dims [L, kLayerDims]:
// Nq, Nkv, D, window, E, K, renormalize, F. counts gets every layer's routed tokens per expert in turn;
// seconds [4]: the attention blocks' and the MoE blocks' wall time, the (layer, expert) pairs
// that ran and the token rows they ran. False as the blocks are.
constexpr int64_t kLayerPtrs = 10;
constexpr int64_t kLayerDims = 8;
bool decode_forward(float* h, int64_t T, int64_t H, int64_t L, const int64_t* layer_ptrs, const int64_t* layer_dims,
                    float eps, const float* cos, const float* sin, const int64_t* slots, int64_t num_blocks,
                    int64_t block_size, const int64_t* table, const int64_t* ctx, int64_t P, float scale,
                    int64_t* counts, double* seconds);

// logits [T, V] = rms_norm(h [T, H]) @ lm_head [V, H]^T: a decode step's final norm and LM head.
void norm_logits(const float* h, float* logits, int64_t T, int64_t H, const float* norm_w, float eps,
                 const float* lm_head, int64_t V);
