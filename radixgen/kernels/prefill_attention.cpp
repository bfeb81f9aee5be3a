// Prefill attention that reads K/V straight from the token-level pool, flash-style, in bf16.
//
// Request b's new tokens (extend_lens[b] queries at positions prefix_lens[b] ...) attend the
// pool rows req_to_token[rows[b], 0 : prefix + extend] causally: the cached prefix and the new
// tokens alike, with no gather into a padded block and no mask tensor. Blocks of keys past a
// query block's last position are never touched (causal skipping), nor blocks before a
// sliding window.
//
// Two phases. First the keys and values of each (request, kv head) are packed once into the
// layout AVX-512 BF16's dot-product instruction reads, two bf16 values per 32-bit lane, so
// every query head of the group and every query block reuses them. Then each (request, head,
// block of 16 queries) runs an online softmax over blocks of 64 keys: scores, the running max
// and sum and the output stay fp32; the probabilities are rounded to bf16 for the P.V product,
// as GPU flash attention does. Without AVX-512 BF16 the same blocks run through plain loops
// (prefill_attention_native() says which), so the blocking is tested on every machine.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kQueryBlock = 16;
constexpr int64_t kKeyBlock = 64;

using radixgen::bf16_bits_to_float;
using radixgen::exp_approx;
#ifdef RADIXGEN_BF16_DOT
using radixgen::exp_vec;
using radixgen::widen_bf16;
#endif

inline uint16_t float_to_bf16_bits(float x) { return c10::BFloat16(x).x; }  // round to nearest even

// One (request, kv head)'s packed keys and values, `blocks` blocks of kKeyBlock keys starting
// at key `first`, zero past the sequence's end (masked scores; zero values keep 0 * v finite).
//   keys:   [blocks][dim / 2][kKeyBlock] words; word (blk, p, j) holds dims 2p, 2p+1 of key
//           first + blk * kKeyBlock + j (one 32-bit lane of scores per key).
//   values: [blocks * kKeyBlock / 2][dim] words; word (t, d) holds dim d of keys
//           first + 2t and first + 2t + 1 (one lane of output per dim).
struct PackedKV {
  const uint32_t* keys;
  const uint32_t* values;
  int64_t first;
};

// The packed K/V of a call, kept per calling thread and grown, never shrunk: a fresh allocation
// of this size is fresh pages from the OS each call, and their faults cost as much as the
// packing itself.
struct PackBuffers {
  std::unique_ptr<uint32_t[]> keys, values;  // uninitialised: pack_block writes (or zeroes) every word used
  int64_t capacity = 0;
};

constexpr int64_t kKeptPackWords = int64_t{4} << 20;  // 16 MB each for K and V, ~130k keys of one kv head of 64

// The calling thread's kept buffers, or `oversized` (the caller's, freed with it) past the cap.
PackBuffers& pack_buffers(int64_t words, PackBuffers& oversized) {
  thread_local PackBuffers buffers;
  if (words > kKeptPackWords) {  // rare (a huge prefill step): not kept
    oversized.keys.reset(new uint32_t[words]);
    oversized.values.reset(new uint32_t[words]);
    oversized.capacity = words;
    return oversized;
  }
  if (buffers.capacity < words) {
    buffers.keys.reset(new uint32_t[words]);
    buffers.values.reset(new uint32_t[words]);
    buffers.capacity = words;
  }
  return buffers;
}

// Block `blk` of one (request, kv head)'s packed keys and values (layout above). A block past
// the sequence's end is zero.
void pack_block(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* slots, int64_t first, int64_t len,
                int64_t blk, int64_t h, int64_t kv_heads, int64_t dim, uint32_t* keys, uint32_t* values) {
  const int64_t row = kv_heads * dim, words = dim / 2;
  const int64_t start = first + blk * kKeyBlock, count = std::min<int64_t>(kKeyBlock, len - start);
  uint32_t* key_block = keys + blk * words * kKeyBlock;
  uint32_t* value_block = values + blk * (kKeyBlock / 2) * dim;
  if (count < kKeyBlock) {
    std::memset(key_block, 0, sizeof(uint32_t) * words * kKeyBlock);
    std::memset(value_block, 0, sizeof(uint32_t) * (kKeyBlock / 2) * dim);
  }
  for (int64_t j = 0; j < count; ++j) {
    uint32_t key_words[256];
    std::memcpy(key_words, k_cache + slots[start + j] * row + h * dim, sizeof(uint16_t) * dim);
    for (int64_t p = 0; p < words; ++p) key_block[p * kKeyBlock + j] = key_words[p];
  }
#ifdef RADIXGEN_BF16_DOT
  if (dim % 32 == 0) {  // two rows interleaved on 32 lanes; unpack works within 128-bit lanes, permute restores dim order
    const __m512i first_half = radixgen::unpacked_dims_first_half();
    const __m512i second_half = radixgen::unpacked_dims_second_half();
    for (int64_t j = 0; j < count; j += 2) {
      const uint16_t* a = v_cache + slots[start + j] * row + h * dim;
      const uint16_t* b = j + 1 < count ? v_cache + slots[start + j + 1] * row + h * dim : nullptr;
      uint32_t* out = value_block + (j / 2) * dim;
      for (int64_t c = 0; c < dim; c += 32) {
        const __m512i x = _mm512_loadu_si512(a + c);
        const __m512i y = b != nullptr ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
        _mm512_storeu_si512(out + c, _mm512_permutex2var_epi32(lo, first_half, hi));
        _mm512_storeu_si512(out + c + 16, _mm512_permutex2var_epi32(lo, second_half, hi));
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < count; ++j) {
    const uint16_t* value = v_cache + slots[start + j] * row + h * dim;
    uint16_t* pair = reinterpret_cast<uint16_t*>(value_block + (j / 2) * dim) + (j % 2);
    for (int64_t d = 0; d < dim; ++d) pair[2 * d] = value[d];
  }
}

// Every block of every (sequence, kv head): work items are single blocks, so a short batch of
// long sequences still keeps every thread packing. Sequence i's blocks for kv head h go to
// words h * words_per_head + offsets[i].
void pack_all(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table, int64_t table_stride,
              const std::vector<int64_t>& table_rows, const std::vector<int64_t>& firsts,
              const std::vector<int64_t>& lens, const std::vector<int64_t>& blocks,
              const std::vector<int64_t>& offsets, int64_t words_per_head, int64_t kv_heads, int64_t dim,
              uint32_t* keys, uint32_t* values) {
  const int64_t n = static_cast<int64_t>(blocks.size());
  std::vector<int64_t> block_start(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) block_start[i + 1] = block_start[i] + blocks[i];
  const int64_t total = block_start[n];
  at::parallel_for(0, total * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / total, global = item % total;
      const int64_t i = std::upper_bound(block_start.begin(), block_start.end(), global) - block_start.begin() - 1;
      const int64_t offset = h * words_per_head + offsets[i];
      pack_block(k_cache, v_cache, table + table_rows[i] * table_stride, firsts[i], lens[i], global - block_start[i],
                 h, kv_heads, dim, keys + offset, values + offset);
    }
  });
}

// scores[r][j] = q_r . k_j for the block's kQueryBlock rows and kKeyBlock keys (unscaled).
void block_scores(const uint32_t* query_words, const uint32_t* key_block, int64_t words, int64_t live_rows,
                  float* scores) {
#ifdef RADIXGEN_BF16_DOT
  for (int64_t r = 0; r < live_rows; r += 4) {
    __m512 acc[4][4];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t p = 0; p < words; ++p) {
      __m512i k[4];
      for (int c = 0; c < 4; ++c) k[c] = _mm512_loadu_si512(key_block + p * kKeyBlock + 16 * c);
      for (int i = 0; i < 4; ++i) {
        const __m512i q = _mm512_set1_epi32(static_cast<int>(query_words[(r + i) * words + p]));
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)k[c], (__m512bh)q);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(scores + (r + i) * kKeyBlock + 16 * c, acc[i][c]);
  }
#else
  for (int64_t r = 0; r < live_rows; ++r) {
    float* out = scores + r * kKeyBlock;
    std::fill(out, out + kKeyBlock, 0.f);
    for (int64_t p = 0; p < words; ++p) {
      const uint32_t qw = query_words[r * words + p];
      const float q0 = bf16_bits_to_float(qw & 0xffff), q1 = bf16_bits_to_float(qw >> 16);
      const uint32_t* kw = key_block + p * kKeyBlock;
      for (int64_t j = 0; j < kKeyBlock; ++j)
        out[j] += q0 * bf16_bits_to_float(kw[j] & 0xffff) + q1 * bf16_bits_to_float(kw[j] >> 16);
    }
  }
#endif
}

#ifdef RADIXGEN_BF16_DOT
// out[r][d0 .. d0 + 16 * kChunks) = out * rescale[r] + sum_t probs(r, t) . values(t, d), 4 rows at a time.
template <int kChunks>
inline void accumulate_chunks(const uint32_t* prob_words, const uint32_t* value_block, const float* rescale,
                              int64_t dim, int64_t d0, int64_t r, float* out) {
  __m512 acc[4][kChunks];
  for (int i = 0; i < 4; ++i) {
    const __m512 factor = _mm512_set1_ps(rescale[r + i]);
    for (int c = 0; c < kChunks; ++c)
      acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(out + (r + i) * dim + d0 + 16 * c), factor);
  }
  for (int64_t t = 0; t < kKeyBlock / 2; ++t) {
    __m512i v[kChunks];
    for (int c = 0; c < kChunks; ++c) v[c] = _mm512_loadu_si512(value_block + t * dim + d0 + 16 * c);
    for (int i = 0; i < 4; ++i) {
      const __m512i p = _mm512_set1_epi32(static_cast<int>(prob_words[(r + i) * (kKeyBlock / 2) + t]));
      for (int c = 0; c < kChunks; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)v[c], (__m512bh)p);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(out + (r + i) * dim + d0 + 16 * c, acc[i][c]);
}

#endif

// out[r][d] = out[r][d] * rescale[r] + sum_j probs[r][j] * v_j[d] over the block's keys.
void block_accumulate(const uint32_t* prob_words, const uint32_t* value_block, const float* rescale, int64_t dim,
                      int64_t live_rows, float* out) {
#ifdef RADIXGEN_BF16_DOT
  if (dim % 16 == 0) {
    for (int64_t r = 0; r < live_rows; r += 4) {
      int64_t d0 = 0;
      for (; d0 + 64 <= dim; d0 += 64) accumulate_chunks<4>(prob_words, value_block, rescale, dim, d0, r, out);
      for (; d0 < dim; d0 += 16) accumulate_chunks<1>(prob_words, value_block, rescale, dim, d0, r, out);
    }
    return;
  }
#endif
  for (int64_t r = 0; r < live_rows; ++r) {
    float* o = out + r * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] *= rescale[r];
    for (int64_t t = 0; t < kKeyBlock / 2; ++t) {
      const uint32_t pw = prob_words[r * (kKeyBlock / 2) + t];
      const float p0 = bf16_bits_to_float(pw & 0xffff), p1 = bf16_bits_to_float(pw >> 16);
      const uint32_t* vw = value_block + t * dim;
      for (int64_t d = 0; d < dim; ++d)
        o[d] += p0 * bf16_bits_to_float(vw[d] & 0xffff) + p1 * bf16_bits_to_float(vw[d] >> 16);
    }
  }
}

// Where a block's keys sit relative to the rows that score them.
struct BlockGeometry {
  int64_t base;            // position of the block's first key
  int64_t first_position;  // position of row 0 (row r is first_position + r)
  int64_t window;          // 0: none
  bool edge;               // some key of the block is hidden from some row
  bool hidden(int64_t key, int64_t position) const {
    return key > position || (window > 0 && key <= position - window);
  }
};

// One row's scores of a block (scaled, soft-capped, masked) into bf16 weights, updating the
// row's running max and sum; returns the factor its output so far must be scaled by.
float row_softmax(float* row, int64_t position, const BlockGeometry& geo, float scale, float softcap,
                  float& running_max, float& running_sum, uint16_t* probs) {
#ifdef RADIXGEN_BF16_DOT
  if (softcap == 0.f) {
    constexpr int kVecs = kKeyBlock / 16;
    __m512 x[kVecs];
    __mmask16 visible[kVecs];
    const __m512 scale_vec = _mm512_set1_ps(scale);
    __m512 peak_vec = _mm512_set1_ps(running_max);
    for (int c = 0; c < kVecs; ++c) {
      visible[c] = 0xffff;
      if (geo.edge) {
        const __m512i keys = _mm512_add_epi32(
            _mm512_set1_epi32(static_cast<int>(geo.base - position + 16 * c)),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));  // key - position
        visible[c] = _mm512_cmple_epi32_mask(keys, _mm512_setzero_si512());
        if (geo.window > 0)
          visible[c] &= _mm512_cmpgt_epi32_mask(keys, _mm512_set1_epi32(static_cast<int>(-geo.window)));
      }
      x[c] = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), scale_vec);
      peak_vec = _mm512_mask_max_ps(peak_vec, visible[c], peak_vec, x[c]);
    }
    const float peak = _mm512_reduce_max_ps(peak_vec);
    if (peak == -INFINITY) {
      std::fill(probs, probs + kKeyBlock, 0);
      return 1.f;
    }
    const float rescale = running_max == -INFINITY ? 0.f : exp_approx(running_max - peak);
    const __m512 peak_b = _mm512_set1_ps(peak);
    __m512 total = _mm512_setzero_ps();
    for (int c = 0; c < kVecs; ++c) {
      const __m512 p = _mm512_maskz_mov_ps(visible[c], exp_vec(_mm512_sub_ps(x[c], peak_b)));
      const __m256i bits = (__m256i)_mm512_cvtneps_pbh(p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + 16 * c), bits);
      total = _mm512_add_ps(total, widen_bf16(bits));
    }
    running_sum = running_sum * rescale + _mm512_reduce_add_ps(total);
    running_max = peak;
    return rescale;
  }
#endif
  for (int64_t j = 0; j < kKeyBlock; ++j) {
    row[j] *= scale;
    if (softcap > 0.f) row[j] = softcap * std::tanh(row[j] / softcap);
    if (geo.edge && geo.hidden(geo.base + j, position)) row[j] = -INFINITY;
  }
  float peak = running_max;
  for (int64_t j = 0; j < kKeyBlock; ++j) peak = std::max(peak, row[j]);
  if (peak == -INFINITY) {  // nothing visible to this row yet
    std::fill(probs, probs + kKeyBlock, 0);
    return 1.f;
  }
  const float rescale = running_max == -INFINITY ? 0.f : exp_approx(running_max - peak);
  float total = 0.f;
  for (int64_t j = 0; j < kKeyBlock; ++j) {
    const uint16_t bits = row[j] == -INFINITY ? 0 : float_to_bf16_bits(exp_approx(row[j] - peak));
    probs[j] = bits;
    total += bf16_bits_to_float(bits);  // the sum of the weights the product uses
  }
  running_sum = running_sum * rescale + total;
  running_max = peak;
  return rescale;
}

struct Scratch {
  std::vector<uint32_t> query_words, prob_words;
  std::vector<float> scores, out, running_max, running_sum, rescale;
  void fit(int64_t dim) {
    query_words.assign(kQueryBlock * dim / 2, 0);
    prob_words.assign(kQueryBlock * kKeyBlock / 2, 0);
    scores.resize(kQueryBlock * kKeyBlock);
    out.assign(kQueryBlock * dim, 0.f);
    running_max.assign(kQueryBlock, -INFINITY);
    running_sum.assign(kQueryBlock, 0.f);
    rescale.assign(kQueryBlock, 1.f);
  }
};

// One block of up to kQueryBlock query rows of one head over its visible key blocks, into the
// scratch's running max, sum and unnormalised output. Row r sits at position first_position + r,
// or at first_position for every row when `same_position` (queries of several requests over
// their shared prefix).
void run_query_block(const uint16_t* q, int64_t q_stride, int64_t num_rows, int64_t first_position,
                     bool same_position, const PackedKV& kv, int64_t dim, float scale, int64_t window,
                     float softcap, Scratch& s) {
  const int64_t words = dim / 2;
  s.fit(dim);
  const int64_t live_rows = (num_rows + 3) / 4 * 4;  // the native tiles are 4 rows
  for (int64_t r = 0; r < num_rows; ++r) std::memcpy(&s.query_words[r * words], q + r * q_stride, sizeof(uint16_t) * dim);
  const int64_t last_position = same_position ? first_position : first_position + num_rows - 1;
  // keys a row sees: (position - window, position]; without a window, [0, position]
  const int64_t lowest_key = window > 0 ? std::max<int64_t>(kv.first, first_position - window + 1) : kv.first;
  const int64_t first_block = (lowest_key - kv.first) / kKeyBlock;
  const int64_t last_block = (last_position - kv.first) / kKeyBlock;
  for (int64_t blk = first_block; blk <= last_block; ++blk) {
    BlockGeometry geo{kv.first + blk * kKeyBlock, first_position, window, false};
    geo.edge = geo.base + kKeyBlock - 1 > first_position || (window > 0 && geo.base <= last_position - window);
    block_scores(s.query_words.data(), kv.keys + blk * words * kKeyBlock, words, live_rows, s.scores.data());
    for (int64_t r = 0; r < num_rows; ++r) {
      s.rescale[r] = row_softmax(s.scores.data() + r * kKeyBlock, same_position ? first_position : first_position + r,
                                 geo, scale, softcap, s.running_max[r], s.running_sum[r],
                                 reinterpret_cast<uint16_t*>(s.prob_words.data()) + r * kKeyBlock);
    }
    block_accumulate(s.prob_words.data(), kv.values + blk * (kKeyBlock / 2) * dim, s.rescale.data(), dim,
                     live_rows, s.out.data());
  }
}

void attend_query_block(const uint16_t* q, int64_t q_stride, int64_t num_rows, int64_t first_position,
                        const PackedKV& kv, int64_t dim, float scale, int64_t window, float softcap,
                        uint16_t* out, int64_t out_stride, Scratch& s) {
  run_query_block(q, q_stride, num_rows, first_position, false, kv, dim, scale, window, softcap, s);
  for (int64_t r = 0; r < num_rows; ++r) {
    const float inverse = 1.f / s.running_sum[r];
    const float* o = s.out.data() + r * dim;
    for (int64_t d = 0; d < dim; ++d) out[r * out_stride + d] = float_to_bf16_bits(o[d] * inverse);
  }
}

}  // namespace

// Whether the fast path for `dtype` is built here: bfloat16 needs AVX-512 BF16 (elsewhere its
// plain loops run), float32 AVX2 and FMA (elsewhere the op refuses float32).
bool prefill_attention_native(std::optional<at::ScalarType> dtype) {
  if (dtype.value_or(at::kBFloat16) == at::kFloat) return radixgen::float_prefill::available();
#ifdef RADIXGEN_BF16_DOT
  return dtype.value_or(at::kBFloat16) == at::kBFloat16;
#else
  return false;
#endif
}

at::Tensor prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor req_to_token,
                             at::Tensor rows, at::Tensor prefix_lens, at::Tensor extend_lens, double scale,
                             int64_t window, double softcap) {
  TORCH_CHECK(q.device().is_cpu(), "prefill_attention is the CPU kernel");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [T,H,D], caches [S,KVH,D]");
  const bool float32 = q.scalar_type() == at::kFloat;
  TORCH_CHECK((float32 || q.scalar_type() == at::kBFloat16) && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "prefill_attention runs bfloat16 or float32 q and caches of q's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(dim == k_cache.size(2) && dim % 2 == 0 && dim <= 512, "head_dim must match the cache, be even, <= 512");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.stride(1) == 1, "req_to_token int64, rows contiguous");
  rows = rows.contiguous();
  prefix_lens = prefix_lens.contiguous();
  extend_lens = extend_lens.contiguous();
  TORCH_CHECK(rows.scalar_type() == at::kLong && prefix_lens.scalar_type() == at::kLong &&
                  extend_lens.scalar_type() == at::kLong,
              "rows, prefix_lens, extend_lens int64");
  const int64_t batch = rows.numel();
  TORCH_CHECK(prefix_lens.numel() == batch && extend_lens.numel() == batch, "one row, prefix and extend per request");
  q = q.stride(2) == 1 && q.stride(1) == dim ? q : q.contiguous();
  const int64_t q_stride = q.stride(0);
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* prefix_of = prefix_lens.data_ptr<int64_t>();
  const int64_t* extend_of = extend_lens.data_ptr<int64_t>();

  // Per request: where its queries start, the first key any of them sees, its packed blocks,
  // and where its work items begin.
  std::vector<int64_t> query_start(batch), first_key(batch), blocks(batch), pack_offset(batch + 1, 0),
      item_start(batch + 1, 0);
  int64_t tokens_seen = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = prefix_of[b] + extend_of[b];
    TORCH_CHECK(row_of[b] >= 0 && row_of[b] < req_to_token.size(0) && prefix_of[b] >= 0 && extend_of[b] >= 1 &&
                    len <= req_to_token.size(1),
                "request ", b, ": row ", row_of[b], " / length ", len, " outside req_to_token ", req_to_token.sizes());
    query_start[b] = tokens_seen;
    tokens_seen += extend_of[b];
    first_key[b] = window > 0 ? std::max<int64_t>(0, prefix_of[b] - window + 1) : 0;
    blocks[b] = (len - first_key[b] + kKeyBlock - 1) / kKeyBlock;
    pack_offset[b + 1] = pack_offset[b] + blocks[b] * kKeyBlock * dim / 2;  // words per kv head
    item_start[b + 1] = item_start[b] + heads * ((extend_of[b] + kQueryBlock - 1) / kQueryBlock);
  }
  TORCH_CHECK(tokens_seen == tokens, "extend_lens sum to ", tokens_seen, " but q has ", tokens, " tokens");
  if (float32)
    return radixgen::float_prefill::attend(q, k_cache, v_cache, req_to_token, {row_of, row_of + batch},
                                           {prefix_of, prefix_of + batch}, {extend_of, extend_of + batch},
                                           query_start, first_key, scale, window, softcap);

  const int64_t words_per_head = pack_offset[batch];
  PackBuffers oversized;
  PackBuffers& packed = pack_buffers(words_per_head * kv_heads, oversized);
  const auto* k_bits = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* v_bits = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  {
    std::vector<int64_t> table_rows(row_of, row_of + batch), lens(batch);
    for (int64_t b = 0; b < batch; ++b) lens[b] = prefix_of[b] + extend_of[b];
    pack_all(k_bits, v_bits, req_to_token.data_ptr<int64_t>(), req_to_token.stride(0), table_rows, first_key, lens,
             blocks, pack_offset, words_per_head, kv_heads, dim, packed.keys.get(), packed.values.get());
  }

  auto out = at::empty({tokens, heads, dim}, q.options());
  const auto* q_bits = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* out_bits = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, item_start[batch], 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    int64_t b = std::upper_bound(item_start.begin(), item_start.end(), begin) - item_start.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= item_start[b + 1]) ++b;
      const int64_t per_head = (item_start[b + 1] - item_start[b]) / heads;
      const int64_t h = (item - item_start[b]) / per_head, qb = (item - item_start[b]) % per_head;
      const int64_t offset = (h / group) * words_per_head + pack_offset[b];
      const PackedKV kv{packed.keys.get() + offset, packed.values.get() + offset, first_key[b]};
      const int64_t token = query_start[b] + qb * kQueryBlock;
      attend_query_block(q_bits + token * q_stride + h * dim, q_stride,
                         std::min(kQueryBlock, extend_of[b] - qb * kQueryBlock), prefix_of[b] + qb * kQueryBlock,
                         kv, dim, static_cast<float>(scale), window, static_cast<float>(softcap),
                         out_bits + (token * heads + h) * dim, heads * dim, scratch);
    }
  });
  return out;
}

// Decode rows that share a cached prefix (one system prompt under many requests) read the same
// prefix keys once per row, as matrix-vector products. Here each group's prefix is attended by
// all its rows at once, as the blocks above: the rows of a group and kv head (member x query
// head of the kv head) are the queries, the prefix is packed once. The result is each row's
// unnormalised output with its running max and sum, which decode_attention then extends over
// the row's own keys (the log-sum-exp merge of split attention).
//   shared_prefix[b]: keys of row b covered here (0: none); group_leader[b]: the batch index
//   whose req_to_token row holds the group's prefix (every member's begins with the same slots).
std::tuple<at::Tensor, at::Tensor, at::Tensor> shared_prefix_attention(
    at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor req_to_token, at::Tensor rows,
    at::Tensor shared_prefix, at::Tensor group_leader, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "shared_prefix_attention runs bfloat16 q [B,H,D] and contiguous caches");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && dim == k_cache.size(2) && dim % 2 == 0 && dim <= 512, "bad head shapes");
  rows = rows.contiguous();
  shared_prefix = shared_prefix.contiguous();
  group_leader = group_leader.contiguous();
  TORCH_CHECK(rows.numel() == batch && shared_prefix.numel() == batch && group_leader.numel() == batch,
              "one row, prefix and leader per request");
  q = q.contiguous();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* prefix_of = shared_prefix.data_ptr<int64_t>();
  const int64_t* leader_of = group_leader.data_ptr<int64_t>();
  const int64_t group = heads / kv_heads;

  // groups: leader -> members (batch order)
  std::vector<int64_t> leaders;
  std::vector<std::vector<int64_t>> members;
  std::vector<int64_t> group_index(batch, -1);
  for (int64_t b = 0; b < batch; ++b) {
    if (prefix_of[b] <= 0) continue;
    const int64_t leader = leader_of[b];
    TORCH_CHECK(leader >= 0 && leader < batch && prefix_of[leader] == prefix_of[b] && leader_of[leader] == leader,
                "request ", b, ": its group's leader ", leader, " does not lead a group of its prefix");
    TORCH_CHECK(prefix_of[b] <= req_to_token.size(1) && row_of[leader] >= 0 && row_of[leader] < req_to_token.size(0),
                "request ", b, ": shared prefix outside req_to_token");
    if (group_index[leader] < 0) {
      group_index[leader] = static_cast<int64_t>(leaders.size());
      leaders.push_back(leader);
      members.emplace_back();
    }
    members[group_index[leader]].push_back(b);
  }
  auto raw_out = at::zeros({batch, heads, dim}, q.options().dtype(at::kFloat));
  auto row_max = at::full({batch, heads}, -INFINITY, q.options().dtype(at::kFloat));
  auto row_sum = at::zeros({batch, heads}, q.options().dtype(at::kFloat));
  const int64_t num_groups = static_cast<int64_t>(leaders.size());
  if (num_groups == 0) return {raw_out, row_max, row_sum};

  std::vector<int64_t> pack_offset(num_groups + 1, 0), item_start(num_groups + 1, 0), blocks(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    blocks[g] = (prefix_of[leaders[g]] + kKeyBlock - 1) / kKeyBlock;
    pack_offset[g + 1] = pack_offset[g] + blocks[g] * kKeyBlock * dim / 2;
    const int64_t query_rows = static_cast<int64_t>(members[g].size()) * group;
    item_start[g + 1] = item_start[g] + kv_heads * ((query_rows + kQueryBlock - 1) / kQueryBlock);
  }
  const int64_t words_per_head = pack_offset[num_groups];
  PackBuffers oversized;
  PackBuffers& packed = pack_buffers(words_per_head * kv_heads, oversized);
  const auto* k_bits = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* v_bits = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  {
    std::vector<int64_t> table_rows(num_groups), firsts(num_groups, 0), lens(num_groups);
    for (int64_t g = 0; g < num_groups; ++g) {
      table_rows[g] = row_of[leaders[g]];
      lens[g] = prefix_of[leaders[g]];
    }
    pack_all(k_bits, v_bits, table, req_to_token.stride(0), table_rows, firsts, lens, blocks, pack_offset,
             words_per_head, kv_heads, dim, packed.keys.get(), packed.values.get());
  }

  const auto* q_bits = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  float* out_ptr = raw_out.data_ptr<float>();
  float* max_ptr = row_max.data_ptr<float>();
  float* sum_ptr = row_sum.data_ptr<float>();
  at::parallel_for(0, item_start[num_groups], 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    std::vector<uint16_t> queries(kQueryBlock * dim);
    std::vector<int64_t> dest(kQueryBlock);  // (request, head) of each query row
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
      const int64_t per_head = (item_start[g + 1] - item_start[g]) / kv_heads;
      const int64_t h = (item - item_start[g]) / per_head, qb = (item - item_start[g]) % per_head;
      const int64_t total_rows = static_cast<int64_t>(members[g].size()) * group;
      const int64_t num_rows = std::min(kQueryBlock, total_rows - qb * kQueryBlock);
      for (int64_t r = 0; r < num_rows; ++r) {  // row = member x head of kv head h
        const int64_t flat = qb * kQueryBlock + r;
        dest[r] = members[g][flat / group] * heads + h * group + flat % group;
        std::memcpy(&queries[r * dim], q_bits + dest[r] * dim, sizeof(uint16_t) * dim);
      }
      const int64_t offset = h * words_per_head + pack_offset[g];
      const PackedKV kv{packed.keys.get() + offset, packed.values.get() + offset, 0};
      run_query_block(queries.data(), dim, num_rows, prefix_of[leaders[g]] - 1, true, kv, dim,
                      static_cast<float>(scale), 0, static_cast<float>(softcap), scratch);
      for (int64_t r = 0; r < num_rows; ++r) {
        std::memcpy(out_ptr + dest[r] * dim, scratch.out.data() + r * dim, sizeof(float) * dim);
        max_ptr[dest[r]] = scratch.running_max[r];
        sum_ptr[dest[r]] = scratch.running_sum[r];
      }
    }
  });
  return {raw_out, row_max, row_sum};
}

TORCH_LIBRARY_FRAGMENT(radixgen, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor rows, "
        "Tensor prefix_lens, Tensor extend_lens, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
  m.def("prefill_attention_native(ScalarType? dtype=None) -> bool");
  m.def("shared_prefix_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor rows, "
        "Tensor shared_prefix, Tensor group_leader, float scale, float softcap=0.0) -> (Tensor, Tensor, Tensor)");
  m.impl("shared_prefix_attention", c10::DispatchKey::CPU, TORCH_FN(shared_prefix_attention));
  m.impl("prefill_attention_native", c10::DispatchKey::CatchAll, TORCH_FN(prefill_attention_native));
}
