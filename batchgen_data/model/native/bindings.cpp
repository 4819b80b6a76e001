// The Python module of the native kernels (one module, built from every source in this folder).
#include <torch/extension.h>

#include <vector>

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w);
torch::Tensor swiglu_experts(torch::Tensor x_sorted, std::vector<int64_t> starts, std::vector<int64_t> rows,
                             torch::Tensor w_gate_up, torch::Tensor w_down);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor context_lens, double scale,
                                     int64_t window);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "x [M, K] @ w [N, K]^T for few rows, fp32, CPU");
  m.def("swiglu_experts", &swiglu_experts,
        "a layer's routed SwiGLU experts over rows grouped by expert, few rows each, fp32, CPU");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence [B, Nq, D] over paged KV [blocks, block_size, Nkv, D] -> [B, Nq * D]");
}
