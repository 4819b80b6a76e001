// The Python module of the native kernels: raw buffer addresses and sizes in, nothing allocated
// here (model/native/kernels.py wraps tensors). Only pybind11 and the kernels' own headers are
// included, so the whole library builds in seconds, not the ~15 s of one torch/extension.h unit.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "kernels.h"
#include "skinny_gemm.h"

namespace py = pybind11;

namespace {

template <typename T>
T* as(std::uintptr_t address) { return reinterpret_cast<T*>(address); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_into", [](std::uintptr_t x, std::uintptr_t w, std::uintptr_t y, int64_t M, int64_t K, int64_t N) {
    skinny_into(as<const float>(x), as<const float>(w), as<float>(y), M, K, N);
  }, py::call_guard<py::gil_scoped_release>());
  m.def("swiglu_experts_into", [](std::uintptr_t x, std::uintptr_t y, int64_t R, int64_t H, int64_t F,
                                  const std::vector<int64_t>& starts, const std::vector<int64_t>& rows,
                                  std::uintptr_t w_gate_up, std::uintptr_t w_down, int64_t num_rows) {
    if (starts.size() != rows.size() + 1) return false;
    return swiglu_experts_into(as<const float>(x), as<float>(y), R, H, F, starts.data(), rows.data(),
                               static_cast<int64_t>(rows.size()), as<const float>(w_gate_up), as<const float>(w_down),
                               num_rows);
  }, py::call_guard<py::gil_scoped_release>());
  m.def("attention_block_decode", [](std::uintptr_t h, std::uintptr_t h_out, int64_t T, int64_t H,
                                     std::uintptr_t norm_w, double eps, std::uintptr_t w_qkv, int64_t Nq, int64_t Nkv,
                                     int64_t D, std::uintptr_t q_norm, std::uintptr_t k_norm, std::uintptr_t cos,
                                     std::uintptr_t sin, std::uintptr_t slots, std::uintptr_t k_cache,
                                     std::uintptr_t v_cache, int64_t num_blocks, int64_t block_size,
                                     std::uintptr_t table, std::uintptr_t ctx, int64_t P, std::uintptr_t w_o,
                                     double scale, int64_t window) {
    return attention_block_decode(as<const float>(h), as<float>(h_out), T, H, as<const float>(norm_w),
                                  static_cast<float>(eps), as<const float>(w_qkv), Nq, Nkv, D, as<const float>(q_norm),
                                  as<const float>(k_norm), as<const float>(cos), as<const float>(sin),
                                  as<const int64_t>(slots), as<float>(k_cache), as<float>(v_cache), num_blocks,
                                  block_size, as<const int64_t>(table), as<const int64_t>(ctx), P,
                                  as<const float>(w_o), static_cast<float>(scale), window);
  }, py::call_guard<py::gil_scoped_release>());
  m.def("moe_block_decode", [](std::uintptr_t h, std::uintptr_t h_out, int64_t T, int64_t H, std::uintptr_t norm_w,
                               double eps, std::uintptr_t w_router, int64_t E, int64_t K, bool renormalize,
                               std::uintptr_t experts, int64_t F, std::uintptr_t counts) {
    return moe_block_decode(as<const float>(h), as<float>(h_out), T, H, as<const float>(norm_w),
                            static_cast<float>(eps), as<const float>(w_router), E, K, renormalize,
                            as<const int64_t>(experts), F, as<int64_t>(counts));
  }, py::call_guard<py::gil_scoped_release>());
  m.def("decode_forward", [](std::uintptr_t h, int64_t T, int64_t H, int64_t L, std::uintptr_t layer_ptrs,
                             std::uintptr_t layer_dims, double eps, std::uintptr_t cos, std::uintptr_t sin,
                             std::uintptr_t slots, int64_t num_blocks, int64_t block_size, std::uintptr_t table,
                             std::uintptr_t ctx, int64_t P, double scale, std::uintptr_t counts,
                             std::uintptr_t seconds) {
    return decode_forward(as<float>(h), T, H, L, as<const int64_t>(layer_ptrs), as<const int64_t>(layer_dims),
                          static_cast<float>(eps), as<const float>(cos), as<const float>(sin), as<const int64_t>(slots),
                          num_blocks, block_size, as<const int64_t>(table), as<const int64_t>(ctx), P,
                          static_cast<float>(scale), as<int64_t>(counts), as<double>(seconds));
  }, py::call_guard<py::gil_scoped_release>());
  m.def("norm_logits", [](std::uintptr_t h, std::uintptr_t logits, int64_t T, int64_t H, std::uintptr_t norm_w,
                          double eps, std::uintptr_t lm_head, int64_t V) {
    norm_logits(as<const float>(h), as<float>(logits), T, H, as<const float>(norm_w), static_cast<float>(eps),
                as<const float>(lm_head), V);
  }, py::call_guard<py::gil_scoped_release>());
  m.def("logit_topk_rows", [](std::uintptr_t x, int64_t n, int64_t V, int64_t k, std::uintptr_t chosen,
                              std::uintptr_t top_values, std::uintptr_t top_ids, std::uintptr_t log_norm,
                              std::uintptr_t chosen_value, std::uintptr_t rank) {
    return logit_topk_rows(as<const float>(x), n, V, k, as<int64_t>(chosen), as<float>(top_values),
                           as<int64_t>(top_ids), as<float>(log_norm), as<float>(chosen_value), as<int64_t>(rank));
  }, py::call_guard<py::gil_scoped_release>());
  m.def("logit_topk_at", [](std::uintptr_t x, int64_t num_rows, int64_t V, std::uintptr_t rows, int64_t n, int64_t k,
                            std::uintptr_t top_values, std::uintptr_t top_ids) {
    return logit_topk_at(as<const float>(x), num_rows, V, as<const int64_t>(rows), n, k, as<float>(top_values),
                         as<int64_t>(top_ids));
  }, py::call_guard<py::gil_scoped_release>());
  m.def("logit_topk_stream", [](std::uintptr_t x, int64_t n, int64_t C, int64_t offset, int64_t k, bool with_norm,
                                std::uintptr_t m, std::uintptr_t total, std::uintptr_t ties, std::uintptr_t top_values,
                                std::uintptr_t top_ids, std::uintptr_t size, std::uintptr_t bad, std::uintptr_t keep,
                                std::uintptr_t words, int64_t W, std::uintptr_t mask_of) {
    return logit_topk_stream(as<const float>(x), n, C, offset, k, with_norm, as<float>(m), as<double>(total),
                             as<int64_t>(ties), as<float>(top_values), as<int64_t>(top_ids), as<int64_t>(size),
                             as<uint8_t>(bad), as<const int64_t>(keep), as<const int32_t>(words), W,
                             as<const int64_t>(mask_of));
  }, py::call_guard<py::gil_scoped_release>());
  m.def("grammar_mask", [](std::uintptr_t x, int64_t num_rows, int64_t V, std::uintptr_t rows, int64_t n,
                           std::uintptr_t words, int64_t W, std::uintptr_t greedy, std::uintptr_t picks) {
    return grammar_mask(as<float>(x), num_rows, V, as<const int64_t>(rows), n, as<const int32_t>(words), W,
                        as<const uint8_t>(greedy), as<int64_t>(picks));
  }, py::call_guard<py::gil_scoped_release>());
  m.def("first_argmax_rows", [](std::uintptr_t x, int64_t n, int64_t V, std::uintptr_t out) {
    return first_argmax_rows(as<const float>(x), n, V, as<int64_t>(out));
  }, py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention_into", [](std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t table,
                                          std::uintptr_t ctx, std::uintptr_t out, int64_t B, int64_t Nq, int64_t D,
                                          int64_t block_size, int64_t Nkv, int64_t P, int64_t num_blocks, double scale,
                                          int64_t window) {
    return paged_decode_attention_into(as<const float>(q), as<const float>(k), as<const float>(v),
                                       as<const int64_t>(table), as<const int64_t>(ctx), as<float>(out), B, Nq, D,
                                       block_size, Nkv, P, num_blocks, static_cast<float>(scale), window);
  }, py::call_guard<py::gil_scoped_release>());
}
