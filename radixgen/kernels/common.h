// Helpers shared by the CPU kernels: float conversions and vectorisable exps.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// AVX-512 BF16's dot product of bf16 pairs (vdpbf16ps): the attention kernels' fast paths.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define RADIXGEN_BF16_DOT 1
#endif

namespace radixgen {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
// The bit shift instead of c10's conversion keeps the loop free of calls, so it vectorises.
inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}
inline float to_float(c10::BFloat16 x) { return bf16_bits_to_float(x.x); }

// exp(x) in a form the compiler vectorises (std::exp stays a scalar libm call): x = n ln2 + r
// with |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial (relative error < 1e-8 before
// float rounding), 2^n built in the exponent bits. x is clamped to [-87, 88]: both ends are
// normal floats, so exp(-inf) comes out ~1.6e-38 rather than 0.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;  // ln2 = hi + lo
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// 16 bf16 values -> 16 floats (exact).
inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 floats -> 16 bf16 values, rounded to nearest even, as a cast rounds (finite values; without
// AVX-512 BF16 by integer arithmetic on the bits).
inline __m256i narrow_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}
#endif

#if defined(__AVX2__)
// 8 floats -> 8 bf16 values, rounded as narrow_bf16 rounds.
inline __m128i narrow_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}
#endif

#if defined(__AVX512F__)

// 16 lanes of a float / bf16 / fp16 array as floats, and back (rounded to nearest even).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m256i narrow16(const c10::BFloat16*, __m512 v) { return narrow_bf16(v); }
inline __m256i narrow16(const c10::Half*, __m512 v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow16(p, v)); }
inline void store16(c10::Half* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow16(p, v)); }
// v rounded to the array type's precision and widened again (float: v itself)
inline __m512 rounded16(const float*, __m512 v) { return v; }
inline __m512 rounded16(const c10::BFloat16* p, __m512 v) { return widen_bf16(narrow16(p, v)); }
inline __m512 rounded16(const c10::Half* p, __m512 v) { return _mm512_cvtph_ps(narrow16(p, v)); }
#endif

// exp_approx's arithmetic on 16 lanes; scalef builds the 2^n.
#ifdef RADIXGEN_BF16_DOT
inline __m512 exp_vec(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// unpacklo/hi_epi16 of two rows of 32 bf16 interleave them within 128-bit lanes: lane k of lo
// holds dim 8(k / 4) + k % 4 of both rows, hi that dim + 4. permutex2var(lo, index, hi) over
// 32-bit lanes with these indices restores dims 0-15 and 16-31 in order.
inline __m512i unpacked_dims_first_half() {
  return _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
}
inline __m512i unpacked_dims_second_half() {
  return _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
}
#endif

}  // namespace radixgen
