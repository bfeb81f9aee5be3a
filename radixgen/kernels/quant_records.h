// The quantized linears' record layout (quant_linear.cpp's header describes it): read by
// quant_linear.cpp, written by gguf_repack.cpp, and mirrored in Python by quant_layout.py.
#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace radixgen::records {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockRows = 16;
constexpr int64_t kScaleBytes = kBlockRows * 2;

// bytes of the quantized values of one record (the float16 vectors follow)
constexpr int64_t quant_bytes(int64_t bits) { return bits == 8 ? 512 : 256 + 64 * (bits - 4); }
constexpr int64_t record_bytes(int64_t bits) { return quant_bytes(bits) + (bits == 8 ? 1 : 2) * kScaleBytes; }
constexpr bool has_min(int64_t bits) { return bits == 4 || bits == 5; }
// A 5- or 6-bit record rewritten with its values as int8 in the 8-bit layout (quant_linear.cpp's
// widen_avx2 and widen_avx512), its float16 part unchanged.
constexpr int64_t kWideQuantBytes = 512;
constexpr int64_t wide_record_bytes(int64_t bits) { return kWideQuantBytes + record_bytes(bits) - quant_bytes(bits); }
// extra bits above the nibble, and how many nibble chunks share a byte position of the high part
constexpr int extra_bits(int64_t bits) { return bits == 5 ? 1 : bits == 6 ? 2 : 0; }
constexpr int high_rows(int64_t bits) { return bits == 5 ? 2 : 4; }

// A record's value of element e (0..31) of row r, as the kernels multiply it (6 bits: q - 32).
template <int kBits>
inline int32_t record_value(const uint8_t* rec, int64_t r, int64_t e) {
  const int64_t pair = e / 2, j = e % 2;
  if constexpr (kBits == 8) {
    return reinterpret_cast<const int8_t*>(rec)[32 * pair + 2 * r + j];
  } else {
    const int64_t c = pair % 8, lane = 2 * r + j;
    const bool high_nibble = pair >= 8;
    const uint8_t byte = rec[32 * c + lane];
    int32_t q = high_nibble ? byte >> 4 : byte & 0x0F;
    if constexpr (kBits != 4) {
      constexpr int ex = extra_bits(kBits), h = high_rows(kBits);
      const uint8_t bits = rec[256 + (c % h) * 32 + lane] >> ((c / h) * 2 * ex + (high_nibble ? ex : 0));
      q |= (bits & ((1 << ex) - 1)) << 4;
    }
    return kBits == 6 ? q - 32 : q;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Nibble chunk c (0..7) of a 4/5/6-bit record as 32 int16 lanes (lane 2r + j: row r) with the
// extra bits joined: ``lo`` holds elements 2c + j, ``hi`` elements 2c + j + 16 (6 bits: q - 32).
template <int kBits>
inline void nibble_chunk_avx512(const uint8_t* rec, int c, __m512i& lo, __m512i& hi) {
  const __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * c)));
  lo = _mm512_and_si512(raw, _mm512_set1_epi16(0x0F));
  hi = _mm512_srli_epi16(raw, 4);
  if constexpr (kBits != 4) {
    constexpr int ex = extra_bits(kBits), h = high_rows(kBits);
    const __m512i upper = _mm512_srl_epi16(
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256 + (c % h) * 32))),
        _mm_cvtsi32_si128((c / h) * 2 * ex));
    const __m512i mask = _mm512_set1_epi16((1 << ex) - 1);
    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(upper, mask), 4));
    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(upper, ex), mask), 4));
    if constexpr (kBits == 6) {
      const __m512i offset = _mm512_set1_epi16(32);
      lo = _mm512_sub_epi16(lo, offset), hi = _mm512_sub_epi16(hi, offset);
    }
  }
}
#endif

#if defined(__AVX2__)
// The same chunk on 256-bit registers, its 16 rows in two halves of 8: lo0 / hi0 rows 0-7, lo1 /
// hi1 rows 8-15 (lane 2r + j of a half: its row r).
template <int kBits>
inline void nibble_chunk_avx2(const uint8_t* rec, int c, __m256i& lo0, __m256i& lo1, __m256i& hi0, __m256i& hi1) {
  const __m256i low_nibbles = _mm256_set1_epi16(0x0F);
  const __m256i r0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * c)));
  const __m256i r1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * c + 16)));
  lo0 = _mm256_and_si256(r0, low_nibbles), lo1 = _mm256_and_si256(r1, low_nibbles);
  hi0 = _mm256_srli_epi16(r0, 4), hi1 = _mm256_srli_epi16(r1, 4);
  if constexpr (kBits != 4) {
    constexpr int ex = extra_bits(kBits), h = high_rows(kBits);
    const uint8_t* high = rec + 256 + (c % h) * 32;
    const __m128i shift = _mm_cvtsi32_si128((c / h) * 2 * ex);
    const __m256i h0 = _mm256_srl_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high))), shift);
    const __m256i h1 =
        _mm256_srl_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high + 16))), shift);
    const __m256i mask = _mm256_set1_epi16((1 << ex) - 1);
    lo0 = _mm256_or_si256(lo0, _mm256_slli_epi16(_mm256_and_si256(h0, mask), 4));
    lo1 = _mm256_or_si256(lo1, _mm256_slli_epi16(_mm256_and_si256(h1, mask), 4));
    hi0 = _mm256_or_si256(hi0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h0, ex), mask), 4));
    hi1 = _mm256_or_si256(hi1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h1, ex), mask), 4));
    if constexpr (kBits == 6) {
      const __m256i offset = _mm256_set1_epi16(32);
      lo0 = _mm256_sub_epi16(lo0, offset), lo1 = _mm256_sub_epi16(lo1, offset);
      hi0 = _mm256_sub_epi16(hi0, offset), hi1 = _mm256_sub_epi16(hi1, offset);
    }
  }
}
#endif

}  // namespace radixgen::records
