// The native kernels on raw row-major fp32 buffers; bindings.cpp exposes them to Python, where
// model/native/kernels.py checks shapes and allocates outputs.
#pragma once

#include <cstdint>

// y_sorted [R, H] for x_sorted [R, H] grouped by expert: starts[0..num_used] are the segment
// bounds, rows[i] the weight row of the i-th segment's expert in w_gate_up [num_rows, 2F, H]
// (gate rows first) and w_down [num_rows, H, F]. False (nothing computed) for bounds or rows
// out of range.
bool swiglu_experts_into(const float* x, float* y, int64_t R, int64_t H, int64_t F, const int64_t* starts,
                         const int64_t* rows, int64_t num_used, const float* w_gate_up, const float* w_down,
                         int64_t num_rows);

// out [B, Nq * D]: one query per sequence (q [B, Nq, D]) over paged KV ([num_blocks,
// block_size, Nkv, D] each), block_table [B, P], context_lens [B]; window 0 = none. False
// (nothing computed) where a context needs a page beyond the table or a block that does not exist.
bool paged_decode_attention_into(const float* q, const float* k_cache, const float* v_cache, const int64_t* table,
                                 const int64_t* context_lens, float* out, int64_t B, int64_t Nq, int64_t D,
                                 int64_t block_size, int64_t Nkv, int64_t P, int64_t num_blocks, float scale,
                                 int64_t window);
