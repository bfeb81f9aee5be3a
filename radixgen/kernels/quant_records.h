// The quantized linears' record layout (quant_linear.cpp's header describes it): read by
// quant_linear.cpp, written by gguf_repack.cpp, and mirrored in Python by quant_layout.py.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace radixgen::records {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockRows = 16;
constexpr int64_t kScaleBytes = kBlockRows * 2;

// A record kind: its values' width (4, 5 or 8 bits) for the group records, whose float16
// scales (and minimums) follow each group's values; kOffset + width for group records of Q4_0 /
// Q5_0, whose minimum is the scale times -2^(width - 1) and is not stored; kSuper + width for the
// K-quants' records, which keep their blocks' 256-weight super-blocks (quant_linear.cpp's header
// gives the layouts).
constexpr int64_t kSuper = 100, kOffset = 200;
constexpr bool is_super(int64_t kind) { return kind / 100 == kSuper / 100; }
constexpr bool is_offset(int64_t kind) { return kind / 100 == kOffset / 100; }
constexpr int value_bits(int64_t kind) { return static_cast<int>(kind % 100); }
constexpr bool valid_kind(int64_t kind) {
  return kind == 4 || kind == 5 || kind == 8 || kind == kOffset + 4 || kind == kOffset + 5 ||
         kind == kSuper + 4 || kind == kSuper + 5 || kind == kSuper + 6;
}

// Every record kind as a template argument: f<kind>() for the kind given at run time.
template <typename F>
auto with_kind(int64_t kind, F&& f) {
  switch (kind) {
    case 4: return f(std::integral_constant<int64_t, 4>{});
    case 5: return f(std::integral_constant<int64_t, 5>{});
    case 8: return f(std::integral_constant<int64_t, 8>{});
    case kOffset + 4: return f(std::integral_constant<int64_t, kOffset + 4>{});
    case kOffset + 5: return f(std::integral_constant<int64_t, kOffset + 5>{});
    case kSuper + 4: return f(std::integral_constant<int64_t, kSuper + 4>{});
    case kSuper + 5: return f(std::integral_constant<int64_t, kSuper + 5>{});
    default: return f(std::integral_constant<int64_t, kSuper + 6>{});
  }
}

// bytes of the quantized values of one group of 16 rows
constexpr int64_t quant_bytes(int64_t kind) {
  const int bits = value_bits(kind);
  return bits == 8 ? 512 : 256 + 64 * (bits - 4);
}
constexpr bool has_min(int64_t kind) { return value_bits(kind) == 4 || value_bits(kind) == 5; }

// Super-block records: 8 groups' values, then each group's scale part (4/5 bits: 24 bytes of the
// 16 rows' 6-bit scale and min codes; 6 bits: 32 bytes, the int8 scales of elements 0..15 then
// 16..31), then the 16 rows' float16 factors (4/5 bits: d then dmin; 6 bits: d).
constexpr int64_t kSuperGroups = 8;
constexpr int64_t super_scale_bytes(int64_t kind) { return value_bits(kind) == 6 ? 32 : 24; }
constexpr int64_t super_head_bytes(int64_t kind) { return value_bits(kind) == 6 ? kScaleBytes : 2 * kScaleBytes; }
constexpr int64_t super_bytes(int64_t kind) {
  return kSuperGroups * (quant_bytes(kind) + super_scale_bytes(kind)) + super_head_bytes(kind);
}

// bytes per group of 16 rows (a super-block record's share: its bytes / 8), the records' last dimension
constexpr int64_t record_bytes(int64_t kind) {
  if (is_super(kind)) return super_bytes(kind) / kSuperGroups;
  return quant_bytes(kind) + (value_bits(kind) == 8 || is_offset(kind) ? 1 : 2) * kScaleBytes;
}

// Group g's values within a block of records (the group's whole record for the group records).
template <int64_t kKind>
inline const uint8_t* group_values(const uint8_t* block, int64_t g) {
  if constexpr (is_super(kKind)) return block + (g / kSuperGroups) * super_bytes(kKind) + (g % kSuperGroups) * quant_bytes(kKind);
  else return block + g * record_bytes(kKind);
}

// The 6-bit codes of a 4/5-bit super-block record's group scale part: byte r (0..15) holds row r's
// scale code's low nibble under its minimum code's; byte 16 + i (i < 8) the bits above them, 2 each:
// row i's scale's, row i's minimum's, row i + 8's scale's, row i + 8's minimum's. (One byte per
// row for the nibbles, so that a vector's lanes widen from consecutive bytes.)
inline int super_code(const uint8_t* part, int64_t r, bool minimum) {
  const int low = (part[r] >> (minimum ? 4 : 0)) & 0xF;
  const int high = (part[16 + r % 8] >> (4 * (r / 8) + (minimum ? 2 : 0))) & 3;
  return low | high << 4;
}

// A group record without a stored minimum (Q4_0 / Q5_0): its minimum is the scale times this.
template <int64_t kKind>
constexpr float offset_factor() { return -static_cast<float>(1 << (value_bits(kKind) - 1)); }

// A super-block record's group scale part and its rows' float16 factors, for group g of a block.
template <int64_t kKind>
inline const uint8_t* super_part(const uint8_t* block, int64_t g) {
  return block + (g / kSuperGroups) * super_bytes(kKind) + kSuperGroups * quant_bytes(kKind) +
         (g % kSuperGroups) * super_scale_bytes(kKind);
}
template <int64_t kKind>
inline const uint8_t* super_head(const uint8_t* block, int64_t g) {
  return block + (g / kSuperGroups) * super_bytes(kKind) + kSuperGroups * (quant_bytes(kKind) + super_scale_bytes(kKind));
}

// The float32 factors of group g of a block, per row: ``first`` the scale (6 bits: of elements
// 0..15), ``second`` the minimum (4/5 bits), the scale of elements 16..31 (6 bits) or unused (8 bits).
// Super-block records: products of the float16 factor and the integer code, exact in float32.
template <int64_t kKind>
inline void group_factors(const uint8_t* block, int64_t g, float* first, float* second) {
  auto half = [](const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  };
  if constexpr (!is_super(kKind)) {
    const uint8_t* f = block + g * record_bytes(kKind) + quant_bytes(kKind);
    for (int64_t r = 0; r < kBlockRows; ++r) {
      first[r] = half(f + 2 * r);
      if constexpr (is_offset(kKind)) second[r] = offset_factor<kKind>() * first[r];
      else second[r] = value_bits(kKind) == 8 ? 0.f : half(f + kScaleBytes + 2 * r);
    }
  } else {
    const uint8_t* part = super_part<kKind>(block, g);
    const uint8_t* head = super_head<kKind>(block, g);
    for (int64_t r = 0; r < kBlockRows; ++r) {
      if constexpr (value_bits(kKind) == 6) {
        const float d = half(head + 2 * r);
        first[r] = d * static_cast<int8_t>(part[r]), second[r] = d * static_cast<int8_t>(part[16 + r]);
      } else {
        first[r] = half(head + 2 * r) * super_code(part, r, false);
        second[r] = half(head + kScaleBytes + 2 * r) * -super_code(part, r, true);
      }
    }
  }
}

// A widened record (quant_linear.cpp's widen_avx2 / widen_avx512): its group's values as int8 in
// the 8-bit layout, then the group factors' two float32 vectors.
constexpr int64_t kWideQuantBytes = 512;
constexpr int64_t kWideRecordBytes = kWideQuantBytes + 2 * kBlockRows * 4;
// extra bits above the nibble, and how many nibble chunks share a byte position of the high part
constexpr int extra_bits(int64_t bits) { return bits == 5 ? 1 : bits == 6 ? 2 : 0; }
constexpr int high_rows(int64_t bits) { return bits == 5 ? 2 : 4; }

// A record's value of element e (0..31) of row r, as the kernels multiply it (6 bits: q - 32).
// (rec: the group's values, ``group_values``)
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Factors512 {
  __m512 first, second;  // as group_factors gives them, one lane per row
};

template <int64_t kKind>
inline Factors512 group_factors_avx512(const uint8_t* block, int64_t g) {
  auto halves = [](const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); };
  if constexpr (!is_super(kKind)) {
    const uint8_t* f = block + g * record_bytes(kKind) + quant_bytes(kKind);
    const __m512 scale = halves(f);
    if constexpr (is_offset(kKind)) return {scale, _mm512_mul_ps(scale, _mm512_set1_ps(offset_factor<kKind>()))};
    return {scale, value_bits(kKind) == 8 ? _mm512_setzero_ps() : halves(f + kScaleBytes)};
  } else {
    const uint8_t* part = super_part<kKind>(block, g);
    const uint8_t* head = super_head<kKind>(block, g);
    const __m512 d = halves(head);
    if constexpr (value_bits(kKind) == 6) {
      auto codes = [](const uint8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      };
      return {_mm512_mul_ps(d, codes(part)), _mm512_mul_ps(d, codes(part + 16))};
    } else {
      const __m512i low = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(part)));
      // the upper bits' 8 bytes in both halves of the lanes, rows 8-15 shifted down to their nibble
      int64_t upper_bytes;
      std::memcpy(&upper_bytes, part + 16, 8);
      const __m512i upper = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(upper_bytes)),
                                              _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0));
      const __m512i nibble = _mm512_set1_epi32(0xF), top_bits = _mm512_set1_epi32(0x30);
      const __m512i scale_code = _mm512_or_si512(_mm512_and_si512(low, nibble),
                                                 _mm512_and_si512(_mm512_slli_epi32(upper, 4), top_bits));
      const __m512i min_code = _mm512_or_si512(_mm512_srli_epi32(low, 4),
                                               _mm512_and_si512(_mm512_slli_epi32(upper, 2), top_bits));
      const __m512 neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), halves(head + kScaleBytes));
      return {_mm512_mul_ps(d, _mm512_cvtepi32_ps(scale_code)), _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(min_code))};
    }
  }
}
#endif

#if defined(__AVX2__)
struct Factors256 {
  __m256 first[2], second[2];  // rows 0-7, 8-15
};

template <int64_t kKind>
inline Factors256 group_factors_avx2(const uint8_t* block, int64_t g) {
  auto halves = [](const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  Factors256 f;
  if constexpr (!is_super(kKind)) {
    const uint8_t* p = block + g * record_bytes(kKind) + quant_bytes(kKind);
    for (int h = 0; h < 2; ++h) {
      f.first[h] = halves(p + 16 * h);
      if constexpr (is_offset(kKind)) f.second[h] = _mm256_mul_ps(f.first[h], _mm256_set1_ps(offset_factor<kKind>()));
      else f.second[h] = value_bits(kKind) == 8 ? _mm256_setzero_ps() : halves(p + kScaleBytes + 16 * h);
    }
  } else {
    const uint8_t* part = super_part<kKind>(block, g);
    const uint8_t* head = super_head<kKind>(block, g);
    auto bytes = [](const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); };
    for (int h = 0; h < 2; ++h) {
      const __m256 d = halves(head + 16 * h);
      if constexpr (value_bits(kKind) == 6) {
        auto codes = [](const uint8_t* p) {
          return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
        };
        f.first[h] = _mm256_mul_ps(d, codes(part + 8 * h)), f.second[h] = _mm256_mul_ps(d, codes(part + 16 + 8 * h));
      } else {
        const __m256i low = bytes(part + 8 * h);
        const __m256i upper = _mm256_srl_epi32(bytes(part + 16), _mm_cvtsi32_si128(4 * h));
        const __m256i nibble = _mm256_set1_epi32(0xF), top_bits = _mm256_set1_epi32(0x30);
        const __m256i scale_code = _mm256_or_si256(_mm256_and_si256(low, nibble),
                                                   _mm256_and_si256(_mm256_slli_epi32(upper, 4), top_bits));
        const __m256i min_code = _mm256_or_si256(_mm256_srli_epi32(low, 4),
                                                 _mm256_and_si256(_mm256_slli_epi32(upper, 2), top_bits));
        const __m256 neg_dmin = _mm256_sub_ps(_mm256_setzero_ps(), halves(head + kScaleBytes + 16 * h));
        f.first[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(scale_code));
        f.second[h] = _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(min_code));
      }
    }
  }
  return f;
}
#endif

}  // namespace radixgen::records
