// The skinny GEMM on raw buffers, for the other native kernels: y[M, N] = x[M, K] @ w[N, K]^T,
// all row-major fp32, on ATen's thread pool (skinny_gemm.cpp).
#pragma once

#include <cstdint>

void skinny_into(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N);
