// The skinny GEMM on raw buffers, for the other native kernels: y[M, N] = x[M, K] @ w[N, K]^T,
// all row-major fp32, on ATen's thread pool (skinny_gemm.cpp).
#pragma once

#include <cstdint>

void skinny_into(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N);

// The same on the calling thread only, with w's rows ldw floats apart (a column block of a wider
// matrix) and y's rows ldy floats apart.
void skinny_serial(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t ldw,
                   int64_t ldy);
