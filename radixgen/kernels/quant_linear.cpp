// Weight-only quantized linears on CPU: y = x @ dequant(W).T with W stored as 4-, 5-, 6- or 8-bit
// integers in groups of 32 along the input dimension, each group of each row with a scale and
// (4 and 5 bits) a minimum: w = q * scale + min. The records (quant_records.h's kinds) hold GGUF's
// blocks exactly and in as many bytes (gguf_repack.cpp writes them):
//   group records, a float16 scale (and minimum) per group beside its values: kind 4 (Q4_1, and
//     int4 from float weights), 5 (Q5_1), 8 (Q8_0: signed q, no min), and 204 / 205 (Q4_0 / Q5_0,
//     whose minimum, the scale times -8 / -16, is not stored);
//   super-block records, eight groups (256 inputs) with their integer codes and the rows' float16
//     factors: 104 / 105 (Q4_K / Q5_K: scale = d * sc, min = -dmin * m, 6-bit codes per group)
//     and 106 (Q6_K: q - 32, scale = d * sc per 16, int8 codes); the products, formed in float32,
//     are exact.
//
// Layout: output rows in blocks of 16 (the last one padded with zero weights), and per block its
// groups in order, so a step streams W front to back in a single sequence. A group's values for
// the 16 rows:
//   4 bits, 256 bytes: 8 chunks of 32 bytes. Chunk c's byte 2r + j is GGUF byte 2c + j of row r's
//     group: its low nibble is element 2c + j, its high nibble element 2c + j + 16.
//   8 bits, 512 bytes: 16 chunks of 32 bytes. Chunk p's byte 2r + j is element 2p + j of row r.
//   5 bits, 320 bytes, and 6 bits, 384: the 4-bit chunks, then the high bits (64 bytes for 5 bits,
//     128 for 6). The high bits of nibble chunk c, byte position L, lie in byte (c % H) * 32 + L of
//     the high part (H = 2 for 5 bits, 4 for 6) from bit (c / H) * 2e (e extra bits per value):
//     first the low nibble's element's e bits, then the high nibble's.
// A group record is the values, then the 16 rows' scales, then (kinds 4, 5) their minimums (6
// bits: no group records). A super-block record is the eight groups' values, then each group's
// codes, then the rows' factors (quant_records.h).
// Widened to 16-bit lanes, a chunk (4-bit: its low or its high nibbles) holds one pair of
// consecutive elements for each of the 16 rows, which is the operand shape of vpdpwssd (16 sums
// of two int16 products) against one pair of activations broadcast to every lane. Each product
// then serves one row of one token with no horizontal sums, and the group's scale and minimum
// are applied to 16 rows by one multiply-add each.
//
// The activations are first rounded to 16-bit integers per group of 32 (a scale per token and
// group: each value within 2^-16 of its group's largest, where bf16 rounds to 2^-9 of the value
// itself), so a group's 32 products are summed exactly in integers. The float part, per token,
// row and group, is the same two multiply-adds in the same group order whatever the number of
// tokens in the call or in a pass: a token's outputs do not depend on the tokens beside it
// (greedy outputs are the same alone and in a batch, and a speculative step's extend reproduces
// the decode step's logits bit for bit).
//
// Paths: AVX-512 VNNI (vpdpwssd), AVX2 (madd_epi16 on the same layout, 8 rows per register), and
// plain loops. Where a call has more tokens than a pass, 5- (AVX2) and 6-bit records are first
// widened to int8 once. Every step size takes this path: up to 12 tokens per pass over a few
// blocks held in cache, so a prefill reads its activations, not the weights, many times.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "quant_records.h"

#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace radixgen::records;

using radixgen::to_float;

// Activations as 16-bit integers per group of 32: x ~= xq * xd with xd = max|x| / 32767 over the
// group, rounded to nearest. sum: the group's float sum, for the minimum's term.
void quantize_activations(const float* __restrict x, int64_t tokens, int64_t k, int16_t* __restrict xq,
                          float* __restrict xd, float* __restrict sum) {
  const int64_t groups = k / kGroup;
  for (int64_t i = 0; i < tokens * groups; ++i) {
    const float* xg = x + i * kGroup;
#ifdef __AVX2__
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xg + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      total = _mm256_add_ps(total, v[j]);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float largest = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    sum[i] = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
    xd[i] = largest / 32767.f;
    const __m256 inv = _mm256_set1_ps(largest > 0.f ? 32767.f / largest : 0.f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // rounds to nearest
    // packs works within 128-bit lanes; the permute puts the 16 values back in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kGroup),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kGroup + 16),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
#else
    float largest = 0.f, total = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) largest = std::max(largest, std::abs(xg[j])), total += xg[j];
    xd[i] = largest / 32767.f;
    sum[i] = total;
    const float inv = largest > 0.f ? 32767.f / largest : 0.f;
    for (int64_t j = 0; j < kGroup; ++j) xq[i * kGroup + j] = static_cast<int16_t>(std::nearbyint(xg[j] * inv));
#endif
  }
}

// The integer inputs of one pass: kTokens tokens' 16-bit activations (row stride k), their
// per-group scales and sums (row stride groups).
struct Activations {
  const int16_t* xq;
  const float* xd;
  const float* xs;
  int64_t k, groups;
};

using Blocks = void (*)(const Activations&, const uint8_t*, int64_t, int64_t, int64_t, float*);

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RADIXGEN_QUANT_AVX512 1

// A batch-1 step streams every record from memory once and does little arithmetic on each: every
// line of the record this many ahead is asked for while the current one is multiplied (leaving
// most lines to the hardware's prefetcher kept a 7B model's linears well below the memory's speed).
constexpr int64_t kRecordsAhead = 8;

template <int64_t kBytes>
inline void prefetch_record(const uint8_t* record) {
  for (int64_t off = 0; off < kBytes; off += 64) __builtin_prefetch(record + off);
}

// Blocks [begin, end) of 16 rows against kTokens tokens. kSplit integer accumulators per token
// (two where few tokens leave the multiply-adds' latency exposed): integer sums are exact, so the
// split does not change a result. 6 bits: always two, one per half of the group (each half has
// its scale), except widened (kWide: ``packed`` holds blocks [begin, end) as ``widen_avx512``
// rewrote them), where the first half's sums are folded into the floats before the second's begin.
template <int64_t kKind, int kTokens, bool kWide = false>
void blocks_avx512(const Activations& a, const uint8_t* __restrict packed, int64_t n, int64_t begin, int64_t end,
                   float* __restrict out) {
  constexpr int kBits = value_bits(kKind);
  constexpr int kSplit = (kBits == 6 && !kWide) || kTokens <= 4 ? 2 : 1;
  constexpr int64_t stride = kWide ? kWideRecordBytes : record_bytes(kKind);
  const int64_t groups = a.groups;
  const int32_t* __restrict x32 = reinterpret_cast<const int32_t*>(a.xq);  // element pairs
  const int64_t pairs_per_token = a.k / 2;
  for (int64_t b = begin; b < end; ++b) {
    const uint8_t* __restrict block = packed + (kWide ? b - begin : b) * groups * stride;
    __m512 facc[kTokens];
    for (int t = 0; t < kTokens; ++t) facc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* __restrict rec = kWide ? block + g * stride : group_values<kKind>(block, g);
      // a group's share of the stream (super-block records: the average), read front to back
      prefetch_record<stride>(block + (g + kRecordsAhead) * stride);
      // the group's factors, formed where they are used, once its integer sums are made (not held
      // in registers through the products)
      auto factors = [&]() -> Factors512 {
        if constexpr (kWide) {
          const float* f = reinterpret_cast<const float*>(rec + kWideQuantBytes);
          return {_mm512_loadu_ps(f), _mm512_loadu_ps(f + kBlockRows)};
        } else {
          return group_factors_avx512<kKind>(block, g);
        }
      };
      __m512i iacc[kTokens][kSplit];
      for (int t = 0; t < kTokens; ++t)
        for (int s = 0; s < kSplit; ++s) iacc[t][s] = _mm512_setzero_si512();
      const int32_t* __restrict xg = x32 + g * (kGroup / 2);
      auto int8_pair = [&](int p) {  // pair p: elements 2p, 2p + 1 of the 16 rows
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * p)));
        for (int t = 0; t < kTokens; ++t)
          iacc[t][p % kSplit] = _mm512_dpwssd_epi32(iacc[t][p % kSplit], w, _mm512_set1_epi32(xg[t * pairs_per_token + p]));
      };
      // the integer sums in accumulators [first, first + count) times the scales d (6 bits: of the
      // group's half whose sums they are; otherwise the group's)
      auto fold = [&](__m512 d, int first, int count) {
        for (int t = 0; t < kTokens; ++t) {
          __m512i sums = iacc[t][first];
          if (count == 2) sums = _mm512_add_epi32(sums, iacc[t][first + 1]);
          facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(a.xd[t * groups + g])),
                                    facc[t]);
        }
      };
      if constexpr (kWide) {
        constexpr int kParts = kBits == 6 ? 2 : 1, kPairs = 16 / kParts;
        for (int part = 0; part < kParts; ++part) {
          if (part > 0)
            for (int t = 0; t < kTokens; ++t)
              for (int s = 0; s < kSplit; ++s) iacc[t][s] = _mm512_setzero_si512();
          for (int p = part * kPairs; p < (part + 1) * kPairs; ++p) int8_pair(p);
          const Factors512 f = factors();
          fold(part == 0 ? f.first : f.second, 0, kSplit);
        }
      } else if constexpr (kBits == 8) {
        for (int p = 0; p < 16; ++p) int8_pair(p);
      } else {
        for (int c = 0; c < 8; ++c) {
          __m512i lo, hi;
          nibble_chunk_avx512<kBits>(rec, c, lo, hi);
          for (int t = 0; t < kTokens; ++t) {
            const int32_t* xt = xg + t * pairs_per_token;
            iacc[t][0] = _mm512_dpwssd_epi32(iacc[t][0], lo, _mm512_set1_epi32(xt[c]));
            iacc[t][kSplit - 1] = _mm512_dpwssd_epi32(iacc[t][kSplit - 1], hi, _mm512_set1_epi32(xt[c + 8]));
          }
        }
      }
      if constexpr (!kWide) {
        const Factors512 f = factors();
        if constexpr (kBits == 6) {  // each half's sums in an accumulator of its own
          fold(f.first, 0, 1);
          fold(f.second, 1, 1);
        } else {
          fold(f.first, 0, kSplit);
        }
        if constexpr (has_min(kBits))
          for (int t = 0; t < kTokens; ++t)
            facc[t] = _mm512_fmadd_ps(f.second, _mm512_set1_ps(a.xs[t * groups + g]), facc[t]);
      }
    }
    const int64_t r0 = b * kBlockRows, rows = std::min(kBlockRows, n - r0);
    const __mmask16 keep = rows == kBlockRows ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
    for (int t = 0; t < kTokens; ++t) _mm512_mask_storeu_ps(out + t * n + r0, keep, facc[t]);
  }
}

// tokens per pass over a block: two accumulators each fit the 32 registers; 6 bits, three each
constexpr int64_t kPass512 = 12, kPass512SixBits = 8;
template <int64_t kKind>
constexpr Blocks kBlocks512[] = {nullptr,
                                 blocks_avx512<kKind, 1>, blocks_avx512<kKind, 2>, blocks_avx512<kKind, 3>,
                                 blocks_avx512<kKind, 4>, blocks_avx512<kKind, 5>, blocks_avx512<kKind, 6>,
                                 blocks_avx512<kKind, 7>, blocks_avx512<kKind, 8>, blocks_avx512<kKind, 9>,
                                 blocks_avx512<kKind, 10>, blocks_avx512<kKind, 11>, blocks_avx512<kKind, 12>};
// widened records are the same whatever their kind: the 6-bit ones' table serves every kind
constexpr Blocks kWideBlocks512[] = {
    nullptr, blocks_avx512<6, 1, true>, blocks_avx512<6, 2, true>, blocks_avx512<6, 3, true>,
    blocks_avx512<6, 4, true>, blocks_avx512<6, 5, true>, blocks_avx512<6, 6, true>,
    blocks_avx512<6, 7, true>, blocks_avx512<6, 8, true>, blocks_avx512<6, 9, true>,
    blocks_avx512<6, 10, true>, blocks_avx512<6, 11, true>, blocks_avx512<6, 12, true>};

// Blocks [begin, end) of 6-bit records with their values as int8 in the 8-bit records' layout
// (chunk p: element pair p of the 16 rows; q - 32), the group's float32 factors after them: the
// high bits joined once per call instead of once per pass, and a pass of 12 tokens instead of 8
// (one integer sum per token, each half folded in turn).
template <int64_t kKind>
void widen_avx512(const uint8_t* __restrict packed, int64_t groups, int64_t begin, int64_t end,
                  uint8_t* __restrict wide) {
  constexpr int kBits = value_bits(kKind);
  for (int64_t i = 0; i < (end - begin) * groups; ++i) {
    const uint8_t* __restrict block = packed + (begin + i / groups) * groups * record_bytes(kKind);
    const int64_t g = i % groups;
    const uint8_t* __restrict rec = group_values<kKind>(block, g);
    uint8_t* __restrict to = wide + i * kWideRecordBytes;
    for (int c = 0; c < 8; ++c) {
      __m512i lo, hi;
      nibble_chunk_avx512<kBits>(rec, c, lo, hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 32 * c), _mm512_cvtepi16_epi8(lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 32 * (c + 8)), _mm512_cvtepi16_epi8(hi));
    }
    const Factors512 f = group_factors_avx512<kKind>(block, g);
    float* factors = reinterpret_cast<float*>(to + kWideQuantBytes);
    _mm512_storeu_ps(factors, f.first);
    _mm512_storeu_ps(factors + kBlockRows, f.second);
  }
}

#endif

#if defined(__AVX2__)

// The same arithmetic on 256-bit registers: a chunk's 16 rows as two halves of 8, madd_epi16 (16
// products summed in pairs) then an add in place of vpdpwssd. 6 bits: the group's two halves have
// scales of their own, so each keeps integer sums of its own. kWide: ``packed`` holds blocks
// [begin, end) as ``widen_avx2`` rewrote them.
template <int64_t kKind, int kTokens, bool kWide = false>
void blocks_avx2(const Activations& a, const uint8_t* __restrict packed, int64_t n, int64_t begin, int64_t end,
                 float* __restrict out) {
  constexpr int kBits = value_bits(kKind);
  constexpr int64_t stride = kWide ? kWideRecordBytes : record_bytes(kKind);
  constexpr int kSubs = kBits == 6 ? 2 : 1;
  const int64_t groups = a.groups;
  const int32_t* __restrict x32 = reinterpret_cast<const int32_t*>(a.xq);
  const int64_t pairs_per_token = a.k / 2;
  for (int64_t b = begin; b < end; ++b) {
    const uint8_t* __restrict block = packed + (kWide ? b - begin : b) * groups * stride;
    __m256 facc[kTokens][2];
    for (int t = 0; t < kTokens; ++t) facc[t][0] = facc[t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* __restrict rec = kWide ? block + g * stride : group_values<kKind>(block, g);
      // the group's factors, formed where they are used, once its integer sums are made
      auto factors = [&]() -> Factors256 {
        if constexpr (kWide) {
          const float* given = reinterpret_cast<const float*>(rec + kWideQuantBytes);
          Factors256 f;
          for (int h = 0; h < 2; ++h)
            f.first[h] = _mm256_loadu_ps(given + 8 * h), f.second[h] = _mm256_loadu_ps(given + kBlockRows + 8 * h);
          return f;
        } else {
          return group_factors_avx2<kKind>(block, g);
        }
      };
      // integer sums held at once: one set per half for 6 bits, except widened, where the first
      // half's are folded into the floats before the second's begin (fewer registers, same sums)
      constexpr int kHeld = kWide ? 1 : kSubs;
      __m256i iacc[kTokens][2][kHeld];
      auto zero = [&] {
        for (int t = 0; t < kTokens; ++t)
          for (int s = 0; s < kHeld; ++s) iacc[t][0][s] = iacc[t][1][s] = _mm256_setzero_si256();
      };
      const int32_t* __restrict xg = x32 + g * (kGroup / 2);
      auto accumulate = [&](const __m256i w_low_rows, const __m256i w_high_rows, int pair, int held) {
        for (int t = 0; t < kTokens; ++t) {
          const __m256i x = _mm256_set1_epi32(xg[t * pairs_per_token + pair]);
          iacc[t][0][held] = _mm256_add_epi32(iacc[t][0][held], _mm256_madd_epi16(w_low_rows, x));
          iacc[t][1][held] = _mm256_add_epi32(iacc[t][1][held], _mm256_madd_epi16(w_high_rows, x));
        }
      };
      auto int8_pair = [&](int p) {  // pair p: elements 2p, 2p + 1 of the 16 rows
        accumulate(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * p))),
                   _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 * p + 16))), p, 0);
      };
      auto fold = [&](const __m256* d, int held) {  // sums times the scales d of their part (6 bits: a half)
        for (int t = 0; t < kTokens; ++t) {
          const __m256 xd = _mm256_set1_ps(a.xd[t * groups + g]);
          for (int h = 0; h < 2; ++h)
            facc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[t][h][held]), _mm256_mul_ps(d[h], xd), facc[t][h]);
        }
      };
      auto add_min = [&](const __m256* m) {  // the minimums times the group's activation sums
        for (int t = 0; t < kTokens; ++t) {
          const __m256 xs = _mm256_set1_ps(a.xs[t * groups + g]);
          for (int h = 0; h < 2; ++h) facc[t][h] = _mm256_fmadd_ps(m[h], xs, facc[t][h]);
        }
      };
      zero();
      if constexpr (kWide) {
        constexpr int kPairsPerSub = 16 / kSubs;
        for (int s = 0; s < kSubs; ++s) {
          if (s > 0) zero();
          for (int p = s * kPairsPerSub; p < (s + 1) * kPairsPerSub; ++p) int8_pair(p);
          const Factors256 f = factors();
          fold(s == 0 ? f.first : f.second, 0);
          if (has_min(kBits) && s == kSubs - 1) add_min(f.second);
        }
      } else {
        if constexpr (kBits == 8) {
          for (int p = 0; p < 16; ++p) int8_pair(p);
        } else {
          for (int c = 0; c < 8; ++c) {
            __m256i lo0, lo1, hi0, hi1;
            nibble_chunk_avx2<kBits>(rec, c, lo0, lo1, hi0, hi1);
            accumulate(lo0, lo1, c, 0);
            accumulate(hi0, hi1, c + 8, kSubs - 1);
          }
        }
        const Factors256 f = factors();
        fold(f.first, 0);
        if constexpr (kSubs == 2) fold(f.second, 1);
        if constexpr (has_min(kBits)) add_min(f.second);
      }
    }
    const int64_t r0 = b * kBlockRows, rows = std::min(kBlockRows, n - r0);
    for (int t = 0; t < kTokens; ++t) {
      if (rows == kBlockRows) {
        _mm256_storeu_ps(out + t * n + r0, facc[t][0]);
        _mm256_storeu_ps(out + t * n + r0 + 8, facc[t][1]);
      } else {
        alignas(32) float tmp[kBlockRows];
        _mm256_store_ps(tmp, facc[t][0]);
        _mm256_store_ps(tmp + 8, facc[t][1]);
        for (int64_t r = 0; r < rows; ++r) out[t * n + r0 + r] = tmp[r];
      }
    }
  }
}

constexpr int64_t kPassAvx2 = 2;  // 2 tokens x (2 integer + 2 float accumulators) + 4 weights: 16 registers
template <int64_t kKind>
constexpr Blocks kBlocksAvx2[] = {nullptr, blocks_avx2<kKind, 1>, blocks_avx2<kKind, 2>};
// widened records depend on the values' width only (5 bits: one scale and a minimum; 6: two scales)
template <int kBits>
constexpr Blocks kWideBlocksAvx2[] = {nullptr, blocks_avx2<kBits, 1, true>, blocks_avx2<kBits, 2, true>};

// Blocks [begin, end) of 5- or 6-bit records rewritten for passes of two tokens: joining a chunk's
// high bits costs more than its products, so with more tokens than a pass the values are joined
// once into the 8-bit records' layout (chunk p: element pair p of the 16 rows, as int8; 6 bits:
// q - 32) and each pass reads them with one load; the group's float32 factors follow.
template <int64_t kKind>
void widen_avx2(const uint8_t* __restrict packed, int64_t groups, int64_t begin, int64_t end, uint8_t* __restrict wide) {
  constexpr int kBits = value_bits(kKind);
  for (int64_t i = 0; i < (end - begin) * groups; ++i) {
    const uint8_t* __restrict block = packed + (begin + i / groups) * groups * record_bytes(kKind);
    const int64_t g = i % groups;
    const uint8_t* __restrict rec = group_values<kKind>(block, g);
    uint8_t* __restrict to = wide + i * kWideRecordBytes;
    for (int c = 0; c < 8; ++c) {
      __m256i lo0, lo1, hi0, hi1;
      nibble_chunk_avx2<kBits>(rec, c, lo0, lo1, hi0, hi1);
      // packs interleaves the halves' 128-bit lanes; the permute puts rows 0-7 before rows 8-15
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 32 * c),
                          _mm256_permute4x64_epi64(_mm256_packs_epi16(lo0, lo1), 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 32 * (c + 8)),
                          _mm256_permute4x64_epi64(_mm256_packs_epi16(hi0, hi1), 0xD8));
    }
    const Factors256 f = group_factors_avx2<kKind>(block, g);
    float* factors = reinterpret_cast<float*>(to + kWideQuantBytes);
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_ps(factors + 8 * h, f.first[h]);
      _mm256_storeu_ps(factors + kBlockRows + 8 * h, f.second[h]);
    }
  }
}

#else

// Plain loops over the same layout and the same per-group arithmetic.
template <int64_t kKind, int kTokens>
void blocks_plain(const Activations& a, const uint8_t* __restrict packed, int64_t n, int64_t begin, int64_t end,
                  float* __restrict out) {
  constexpr int kBits = value_bits(kKind);
  const int64_t groups = a.groups;
  for (int64_t b = begin; b < end; ++b) {
    float facc[kTokens][kBlockRows] = {};
    const uint8_t* block = packed + b * groups * record_bytes(kKind);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* rec = group_values<kKind>(block, g);
      float d[kBlockRows], second[kBlockRows];
      group_factors<kKind>(block, g, d, second);
      for (int t = 0; t < kTokens; ++t) {
        const int16_t* x = a.xq + t * a.k + g * kGroup;
        for (int64_t r = 0; r < kBlockRows; ++r) {
          int32_t sums[2] = {0, 0};  // 6 bits: elements 0..15 and 16..31 apart
          for (int64_t e = 0; e < kGroup; ++e) sums[kBits == 6 && e >= 16] += record_value<kBits>(rec, r, e) * x[e];
          const float xd = a.xd[t * groups + g];
          facc[t][r] += static_cast<float>(sums[0]) * (d[r] * xd);
          if constexpr (kBits == 6) facc[t][r] += static_cast<float>(sums[1]) * (second[r] * xd);
          if constexpr (has_min(kBits)) facc[t][r] += second[r] * a.xs[t * groups + g];
        }
      }
    }
    const int64_t r0 = b * kBlockRows, rows = std::min(kBlockRows, n - r0);
    for (int t = 0; t < kTokens; ++t)
      for (int64_t r = 0; r < rows; ++r) out[t * n + r0 + r] = facc[t][r];
  }
}

template <int64_t kKind>
constexpr Blocks kBlocksPlain[] = {nullptr, blocks_plain<kKind, 1>};

#endif

// The block functions for a record width, by tokens per pass (index 1..pass), and where the
// records are first rewritten for them (``widen``: blocks [begin, end) into a buffer of
// ``wide_bytes`` per block; null: they read the records as they are).
using Widen = void (*)(const uint8_t*, int64_t, int64_t, int64_t, uint8_t*);
struct Kernel {
  const Blocks* table;
  int64_t pass;
  Widen widen = nullptr;
  int64_t wide_bytes = 0;
};

Kernel kernel_for(int64_t kind, int64_t tokens, int64_t groups) {
  return with_kind(kind, [&](auto kind_constant) -> Kernel {
    constexpr int64_t kKind = decltype(kind_constant)::value;
    constexpr int kBits = value_bits(kKind);
    (void)tokens, (void)groups;
#if defined(RADIXGEN_QUANT_AVX512)
    // 5 bits gain nothing here (their high bits cost a pass about what the int8 loads do); 6 bits
    // gain from 12 tokens a pass instead of 8, measured past two passes
    if constexpr (kBits == 6)
      if (tokens > 2 * kPass512SixBits) return {kWideBlocks512, kPass512, widen_avx512<kKind>, groups * kWideRecordBytes};
    return {kBlocks512<kKind>, kBits == 6 ? kPass512SixBits : kPass512};
#elif defined(__AVX2__)
    if constexpr (kBits == 5 || kBits == 6)
      if (tokens > kPassAvx2) return {kWideBlocksAvx2<kBits>, kPassAvx2, widen_avx2<kKind>, groups * kWideRecordBytes};
    return {kBlocksAvx2<kKind>, kPassAvx2};
#else
    return {kBlocksPlain<kKind>, 1};
#endif
  });
}

void check(const at::Tensor& packed, int64_t n, int64_t k, int64_t kind) {
  TORCH_CHECK(valid_kind(kind), "record kind must be 4, 5 or 8 (group records), 204 or 205 (group "
              "records without minimums) or 104, 105 or 106 (super-block records), got ", kind);
  const int64_t span = is_super(kind) ? kSuperGroups * kGroup : kGroup;
  TORCH_CHECK(k % span == 0, "the input size must be a multiple of ", span, " for record kind ", kind, ", got ", k);
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "packed: a contiguous uint8 CPU tensor");
  TORCH_CHECK(packed.sizes() == at::IntArrayRef({(n + kBlockRows - 1) / kBlockRows, k / kGroup, record_bytes(kind)}),
              "packed: [ceil(N / 16), K / 32, ", record_bytes(kind), "] for record kind ", kind, ", got ", packed.sizes());
}

}  // namespace

// x [T, K] (float32 / bfloat16 / float16) -> [T, N] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t kind) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, K]");
  const int64_t tokens = x.size(0), k = x.size(1), groups = k / kGroup;
  check(packed, n, k, kind);
  auto out = at::empty({tokens, n}, x.options().dtype(at::kFloat));
  if (tokens == 0) return out.to(x.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  // per thread, kept across calls: a step calls ~120 linears
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> xd, xs;
  xq.resize(tokens * k), xd.resize(tokens * groups), xs.resize(tokens * groups);
  quantize_activations(xf.data_ptr<float>(), tokens, k, xq.data(), xd.data(), xs.data());
  // pointers, not the vectors: inside the parallel region a thread_local names the worker's own
  const int16_t* xqp = xq.data();
  const float* xdp = xd.data();
  const float* xsp = xs.data();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const Kernel kernel = kernel_for(kind, tokens, groups);
  const int64_t blocks = packed.size(0), block_bytes = groups * record_bytes(kind);
  // tasks of a few tens of KB of weights; within a task, a few blocks at a time go through every
  // pass of tokens while their records are in L1/L2
  const int64_t grain = std::max<int64_t>(1, 32768 / block_bytes);
  const int64_t tile = std::max<int64_t>(1, 24576 / block_bytes);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> wide;
    for (int64_t b = begin; b < end; b += tile) {
      const int64_t b_end = std::min(end, b + tile);
      const uint8_t* records = pp;
      if (kernel.widen != nullptr) {
        wide.resize(tile * kernel.wide_bytes);
        kernel.widen(pp, groups, b, b_end, wide.data());
        records = wide.data();
      }
      for (int64_t t = 0; t < tokens; t += kernel.pass) {
        const int64_t count = std::min(kernel.pass, tokens - t);
        const Activations a{xqp + t * k, xdp + t * groups, xsp + t * groups, k, groups};
        kernel.table[count](a, records, n, b, b_end, op + t * n);
      }
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// The schema is defined in radixgen/kernels/ops.py.
TORCH_LIBRARY_IMPL(radixgen, CPU, m) { m.impl("quant_linear", TORCH_FN(quant_linear)); }
