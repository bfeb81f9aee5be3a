// Quantized records decoded back into float weights, for the steps with many tokens: there a
// matrix product on a decoded tile (oneDNN's, on AMX tiles where the CPU has them) outruns the
// integer kernel of quant_linear.cpp, whose cost grows with the tokens while the decoding does not.
//
// The tile is the weight transposed, [K, 16 * blocks] (row-major, row stride ``ld``): a record's
// chunk holds one element pair of each of its block's 16 rows, so splitting the pair's two
// elements gives a whole 16-column run of one row of the transposed tile, with no shuffle
// across the block's rows. Each value is q * scale (+ min), in float32, then rounded to the tile's
// dtype (bfloat16: to nearest even, as a cast would).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>

#include "common.h"
#include "quant_records.h"

namespace {

using namespace radixgen::records;
using radixgen::to_float;

#if defined(__AVX512F__) && defined(__AVX512BW__)

// One pair chunk (32 int16 lanes, lane 2r + j: element e + j of row r) into tile rows e, e + 1.
template <typename T>
inline void store_pair(__m512i lanes, __m512 scale, __m512 min, bool with_min, T* row_e, int64_t ld) {
  // even lanes (j = 0) to the low half, odd lanes to the high half
  const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                         30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i parted = _mm512_permutexvar_epi16(split, lanes);
  for (int j = 0; j < 2; ++j) {
    const __m256i half = j == 0 ? _mm512_castsi512_si256(parted) : _mm512_extracti64x4_epi64(parted, 1);
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(half));
    radixgen::store16(row_e + j * ld, with_min ? _mm512_fmadd_ps(q, scale, min) : _mm512_mul_ps(q, scale));
  }
}

template <int64_t kKind, typename T>
void decode_block(const uint8_t* __restrict block, int64_t groups, T* __restrict tile, int64_t ld) {
  constexpr int kBits = value_bits(kKind);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* rec = group_values<kKind>(block, g);
    T* rows = tile + g * kGroup * ld;
    // second: 4/5 bits, the minimums; 6 bits, the scales of elements 16..31
    const auto [d, second] = group_factors_avx512<kKind>(block, g);
    if constexpr (kBits == 8) {
      for (int p = 0; p < 16; ++p) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * p)));
        store_pair(w, d, d, false, rows + 2 * p * ld, ld);
      }
    } else {
      for (int c = 0; c < 8; ++c) {
        __m512i lo, hi;
        nibble_chunk_avx512<kBits>(rec, c, lo, hi);
        if constexpr (kBits == 6) {
          store_pair(lo, d, d, false, rows + 2 * c * ld, ld);
          store_pair(hi, second, second, false, rows + (2 * c + 16) * ld, ld);
        } else {
          store_pair(lo, d, second, true, rows + 2 * c * ld, ld);
          store_pair(hi, d, second, true, rows + (2 * c + 16) * ld, ld);
        }
      }
    }
  }
}

#elif defined(__AVX2__)

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// bf16 rounded to nearest even, as a cast rounds (a weight is never NaN)
inline void store8(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), radixgen::narrow_bf16(v));
}

// Eight rows' element pairs (int16 lanes, lane 2r + j: row r) into columns 0-7 of tile rows e
// (j = 0) and e + 1 (j = 1).
template <typename T>
inline void store_pairs8(__m256i lanes, __m256 scale, __m256 min, bool with_min, T* row_e, int64_t ld) {
  const __m256i halves[2] = {_mm256_srai_epi32(_mm256_slli_epi32(lanes, 16), 16), _mm256_srai_epi32(lanes, 16)};
  for (int j = 0; j < 2; ++j) {
    const __m256 q = _mm256_cvtepi32_ps(halves[j]);
    store8(row_e + j * ld, with_min ? _mm256_fmadd_ps(q, scale, min) : _mm256_mul_ps(q, scale));
  }
}

template <int64_t kKind, typename T>
void decode_block(const uint8_t* __restrict block, int64_t groups, T* __restrict tile, int64_t ld) {
  constexpr int kBits = value_bits(kKind);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* rec = group_values<kKind>(block, g);
    T* rows = tile + g * kGroup * ld;
    // second: 4/5 bits, the minimums; 6 bits, the scales of elements 16..31
    const Factors256 factors = group_factors_avx2<kKind>(block, g);
    const __m256* d = factors.first;
    const __m256* second = factors.second;
    if constexpr (kBits == 8) {
      for (int p = 0; p < 16; ++p)
        for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * p + 16 * h)));
          store_pairs8(w, d[h], d[h], false, rows + 2 * p * ld + 8 * h, ld);
        }
    } else {
      for (int c = 0; c < 8; ++c) {
        __m256i lo[2], hi[2];
        nibble_chunk_avx2<kBits>(rec, c, lo[0], lo[1], hi[0], hi[1]);
        for (int h = 0; h < 2; ++h) {
          T* low_rows = rows + 2 * c * ld + 8 * h;
          T* high_rows = rows + (2 * c + 16) * ld + 8 * h;
          if constexpr (kBits == 6) {
            store_pairs8(lo[h], d[h], d[h], false, low_rows, ld);
            store_pairs8(hi[h], second[h], second[h], false, high_rows, ld);
          } else {
            store_pairs8(lo[h], d[h], second[h], true, low_rows, ld);
            store_pairs8(hi[h], d[h], second[h], true, high_rows, ld);
          }
        }
      }
    }
  }
}

#else

template <int64_t kKind, typename T>
void decode_block(const uint8_t* __restrict block, int64_t groups, T* __restrict tile, int64_t ld) {
  constexpr int kBits = value_bits(kKind);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* rec = group_values<kKind>(block, g);
    float d[kBlockRows], second[kBlockRows];
    group_factors<kKind>(block, g, d, second);
    for (int64_t e = 0; e < kGroup; ++e) {
      T* row = tile + (g * kGroup + e) * ld;
      for (int64_t r = 0; r < kBlockRows; ++r) {
        const float q = static_cast<float>(record_value<kBits>(rec, r, e));
        float w;
        if constexpr (kBits == 6) {
          w = q * (e < 16 ? d[r] : second[r]);
        } else if constexpr (has_min(kBits)) {
          w = q * d[r] + second[r];
        } else {
          w = q * d[r];
        }
        row[r] = static_cast<T>(w);
      }
    }
  }
}

#endif

template <typename T>
using BlockDecoder = void (*)(const uint8_t*, int64_t, T*, int64_t);

template <typename T>
BlockDecoder<T> decoder_for(int64_t kind) {
  return with_kind(kind, [](auto kind_constant) -> BlockDecoder<T> {
    return decode_block<decltype(kind_constant)::value, T>;
  });
}

}  // namespace

// Blocks [block_begin, block_end) of ``packed`` ([blocks, K / 32, record bytes]) into ``tile``:
// float32 or bfloat16, [K, >= 16 * (block_end - block_begin)] with unit column stride.
void dequantize_records(const at::Tensor& packed, int64_t kind, int64_t block_begin, int64_t block_end,
                        at::Tensor& tile) {
  TORCH_CHECK(valid_kind(kind), "record kind must be 4, 5, 8, 204, 205, 104, 105 or 106, got ", kind);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == record_bytes(kind) && (!is_super(kind) || packed.size(1) % kSuperGroups == 0),
              "packed: contiguous uint8 [blocks, K / 32, ", record_bytes(kind), "] for record kind ", kind);
  TORCH_CHECK(0 <= block_begin && block_begin <= block_end && block_end <= packed.size(0), "block range out of bounds");
  const int64_t groups = packed.size(1), k = groups * kGroup, cols = (block_end - block_begin) * kBlockRows;
  TORCH_CHECK(tile.dim() == 2 && tile.size(0) == k && tile.size(1) >= cols && tile.stride(1) == 1,
              "tile: [K, >= 16 * blocks] with unit column stride");
  TORCH_CHECK(tile.scalar_type() == at::kFloat || tile.scalar_type() == at::kBFloat16, "tile: float32 or bfloat16");
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const int64_t block_bytes = groups * record_bytes(kind), ld = tile.stride(0);
  auto run = [&](auto* out, auto decode) {
    at::parallel_for(block_begin, block_end, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) decode(pp + b * block_bytes, groups, out + (b - block_begin) * kBlockRows, ld);
    });
  };
  if (tile.scalar_type() == at::kFloat) {
    run(tile.data_ptr<float>(), decoder_for<float>(kind));
  } else {
    run(reinterpret_cast<c10::BFloat16*>(tile.data_ptr<at::BFloat16>()), decoder_for<c10::BFloat16>(kind));
  }
}

TORCH_LIBRARY_FRAGMENT(radixgen, m) {
  m.def("dequantize_records(Tensor packed, int kind, int block_begin, int block_end, Tensor(a!) tile) -> ()");
}
TORCH_LIBRARY_IMPL(radixgen, CPU, m) { m.impl("dequantize_records", TORCH_FN(dequantize_records)); }
