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
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
// The float whose bits are t's shifted left by 23 (2^(n) when t's low mantissa bits hold n + 127).
inline vec vshift_exponent(vec t) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23)); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vmaxall(vec v) { return _mm512_reduce_max_ps(v); }
inline bool vhasnan(vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
inline uint32_t vmask_eq(vec v, float s) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(s), _CMP_EQ_OQ); }
inline uint32_t vmask_ge(vec v, float s) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(s), _CMP_GE_OQ); }
// max(acc, v) in the lanes whose bit of `bits` is set, acc elsewhere (lane i: bit i).
inline vec vmax_masked(vec acc, vec v, uint32_t bits) { return _mm512_mask_max_ps(acc, static_cast<__mmask16>(bits), acc, v); }
inline vec vselect(uint32_t bits, vec v, vec fill) { return _mm512_mask_blend_ps(static_cast<__mmask16>(bits), fill, v); }
inline vec vround(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2i(vec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
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
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vshift_exponent(vec t) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float vmaxall(vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline bool vhasnan(vec v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
inline uint32_t vmask_eq(vec v, float s) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(s), _CMP_EQ_OQ)));
}
inline uint32_t vmask_ge(vec v, float s) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(s), _CMP_GE_OQ)));
}
inline vec vlanes(uint32_t bits) {  // all ones in the lanes whose bit of `bits` is set (lane i: bit i)
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bits), lane_bits);
  return _mm256_castsi256_ps(on);
}
inline vec vmax_masked(vec acc, vec v, uint32_t bits) { return _mm256_blendv_ps(acc, _mm256_max_ps(acc, v), vlanes(bits)); }
// v's lanes whose bit is set, fill's elsewhere.
inline vec vselect(uint32_t bits, vec v, vec fill) { return _mm256_blendv_ps(fill, v, vlanes(bits)); }
inline vec vround(vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2i(vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
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
inline vec vadd(vec a, vec b) { return a + b; }
inline vec vsub(vec a, vec b) { return a - b; }
inline vec vmul(vec a, vec b) { return a * b; }
inline vec vshift_exponent(vec t) {
  uint32_t bits;
  __builtin_memcpy(&bits, &t, 4);
  bits <<= 23;
  __builtin_memcpy(&t, &bits, 4);
  return t;
}
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline float vmaxall(vec v) { return v; }
inline bool vhasnan(vec v) { return v != v; }
inline uint32_t vmask_eq(vec v, float s) { return v == s ? 1u : 0u; }
inline uint32_t vmask_ge(vec v, float s) { return v >= s ? 1u : 0u; }
inline vec vmax_masked(vec acc, vec v, uint32_t bits) { return (bits & 1u) && v > acc ? v : acc; }
inline vec vselect(uint32_t bits, vec v, vec fill) { return (bits & 1u) ? v : fill; }
inline vec vround(vec v) { return __builtin_nearbyintf(v); }
inline vec vpow2i(vec n) { return __builtin_ldexpf(1.f, static_cast<int>(n)); }
#endif

// exp(x) for x <= 0 (Cody-Waite reduction, degree-6 polynomial: relative error ~2e-7; below -87
// the result is exp(-87) ~ 1.6e-38, not 0, and a NaN input gives that too).
inline vec vexp_nonpos(vec x) {
  x = vmax(x, vset1(-87.f));
  const vec n = vround(vfma(x, vset1(1.44269504088896341f), vzero()));
  vec r = vfma(n, vset1(-0.693145751953125f), x);
  r = vfma(n, vset1(-1.428606765330187e-06f), r);
  vec p = vset1(1.f / 720.f);
  p = vfma(p, r, vset1(1.f / 120.f));
  p = vfma(p, r, vset1(1.f / 24.f));
  p = vfma(p, r, vset1(1.f / 6.f));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.f));
  p = vfma(p, r, vset1(1.f));
  return vfma(p, vpow2i(n), vzero());
}

// exp(x) for -87 <= x <= 0 and 0 below -87 (a softmax weight under exp(-87) ~ 1.6e-38 counts as
// zero, so no product with it goes subnormal); NaN gives 0 too.
inline vec vexp_or_zero(vec x) {
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(-87.f), _CMP_GE_OQ), vexp_nonpos(x));
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_and_ps(_mm256_cmp_ps(x, vset1(-87.f), _CMP_GE_OQ), vexp_nonpos(x));
#else
  return x >= -87.f ? vexp_nonpos(x) : 0.f;
#endif
}

// silu(g) * u = g * sigmoid(g) * u, the sigmoid from e = exp(-|g|) (1 / (1 + e) for g >= 0,
// e / (1 + e) below), so nothing overflows; a NaN g gives NaN.
inline vec vsilu_mul(vec g, vec u) {
#if defined(__AVX512F__)
  const vec e = vexp_nonpos(vsub(vzero(), _mm512_abs_ps(g)));
  const vec num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, vzero(), _CMP_GE_OQ), e, vset1(1.f));
  return _mm512_mul_ps(_mm512_mul_ps(g, _mm512_div_ps(num, vadd(vset1(1.f), e))), u);
#elif defined(__AVX2__) && defined(__FMA__)
  const vec e = vexp_nonpos(vsub(vzero(), _mm256_andnot_ps(vset1(-0.f), g)));
  const vec num = _mm256_blendv_ps(e, vset1(1.f), _mm256_cmp_ps(g, vzero(), _CMP_GE_OQ));
  return _mm256_mul_ps(_mm256_mul_ps(g, _mm256_div_ps(num, vadd(vset1(1.f), e))), u);
#else
  return g / (1.f + __builtin_expf(-g)) * u;
#endif
}

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
