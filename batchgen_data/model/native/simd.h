// Fixed-width fp32 vectors for the native kernels: AVX-512 or AVX2+FMA where the CPU has them
// (the sources build with -march=native), else scalar code the compiler may vectorise.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
constexpr int64_t kWidth = 16;
typedef __m512 vec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
constexpr int64_t kWidth = 8;
typedef __m256 vec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int64_t kWidth = 1;  // portable: the compiler vectorises what it can
typedef float vec;
inline vec vzero() { return 0.f; }
inline vec vload(const float* p) { return *p; }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline vec vset1(float a) { return a; }
inline void vstore(float* p, vec v) { *p = v; }
inline float vsum(vec v) { return v; }
#endif

// sum_d a[d] * b[d]
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t nv = n - n % kWidth;
  vec acc = vzero();
  for (int64_t i = 0; i < nv; i += kWidth) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (int64_t i = nv; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[d] += p * x[d]
inline void axpy(float* y, float p, const float* x, int64_t n) {
  const int64_t nv = n - n % kWidth;
  const vec pv = vset1(p);
  for (int64_t i = 0; i < nv; i += kWidth) vstore(y + i, vfma(pv, vload(x + i), vload(y + i)));
  for (int64_t i = nv; i < n; ++i) y[i] += p * x[i];
}
