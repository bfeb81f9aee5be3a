// Prefill attention in float32 on 8-lane FMAs (AVX2), reading K/V from the token-level pool:
// the float32 counterpart of prefill_attention.cpp's bf16 kernel, with the same contract
// (requests' new tokens attend req_to_token's rows causally, cached prefix included; optional
// sliding window and soft-cap) and the same causal skipping of key blocks.
//
// PyTorch's flash kernel runs each head on its own and spends its time in small GEMM calls and
// a softmax pass between them. Here the query heads that share a kv head run together: a work
// item is (request, kv head, block of query positions), its rows are every head of the group at
// every position, so each key block is read once for the whole group. Keys are packed once per
// (request, kv head), transposed, so a score tile is 6 rows x 16 keys of register accumulators
// fed by one broadcast per row and two loads per dimension; values are packed as they lie, and
// the P.V tile is 6 rows x 16 dimensions. The softmax is online per row, in float32 throughout.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXGEN_FLOAT_PREFILL 1
#endif

namespace radixgen::float_prefill {

#ifdef RADIXGEN_FLOAT_PREFILL

constexpr int64_t kKeys = 64;       // keys per block
constexpr int64_t kPositions = 16;  // query positions per work item
constexpr int kTileRows = 6;        // 6 rows x 2 vectors: 12 accumulators of the 16 registers

// The packed K/V of one (request, kv head): `blocks` blocks of kKeys keys from key `first`,
// zero past the sequence's end (their scores are masked; zero values keep 0 * v finite).
//   keys:   [blocks][dim][kKeys], transposed: a score tile reads 16 keys' dim d as two vectors;
//   values: [blocks][kKeys][dim], as in the pool.
struct PackedKV {
  const float* keys;
  const float* values;
  int64_t first;
};

void pack(const float* k_cache, const float* v_cache, const int64_t* slots, int64_t first, int64_t len,
          int64_t blocks, int64_t h, int64_t kv_heads, int64_t dim, float* keys, float* values) {
  const int64_t row = kv_heads * dim;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    float* kt = keys + blk * dim * kKeys;
    float* vb = values + blk * kKeys * dim;
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t key = first + blk * kKeys + j;
      if (key < len) {
        const float* k = k_cache + slots[key] * row + h * dim;
        for (int64_t d = 0; d < dim; ++d) kt[d * kKeys + j] = k[d];
        std::memcpy(vb + j * dim, v_cache + slots[key] * row + h * dim, sizeof(float) * dim);
      } else {
        for (int64_t d = 0; d < dim; ++d) kt[d * kKeys + j] = 0.f;
        std::memset(vb + j * dim, 0, sizeof(float) * dim);
      }
    }
  }
}

// exp_approx's range reduction and polynomial (common.h) on 8 lanes.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float horizontal_sum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// c[r][0..16) = (accumulate ? c[r][0..16) : 0) + sum_i a[r][i] * b[i][0..16) for kRows rows: one
// broadcast of a per row and two loads of b per step. Scores are q x packed keys (depth: dim),
// P.V is probs x values (depth: keys). The accumulators are one-dimensional arrays and the row
// loops unrolled by pragma: GCC kept a two-dimensional one on the stack and stored it back on
// every step.
template <int kRows>
inline void tile_16(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t depth, float* c,
                    int64_t c_stride, bool accumulate) {
  __m256 low[kRows], high[kRows];
  _Pragma("GCC unroll 8") for (int r = 0; r < kRows; ++r) {
    low[r] = accumulate ? _mm256_loadu_ps(c + r * c_stride) : _mm256_setzero_ps();
    high[r] = accumulate ? _mm256_loadu_ps(c + r * c_stride + 8) : _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < depth; ++i) {
    const __m256 b0 = _mm256_loadu_ps(b + i * b_stride), b1 = _mm256_loadu_ps(b + i * b_stride + 8);
    _Pragma("GCC unroll 8") for (int r = 0; r < kRows; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * a_stride + i);
      low[r] = _mm256_fmadd_ps(ar, b0, low[r]);
      high[r] = _mm256_fmadd_ps(ar, b1, high[r]);
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(c + r * c_stride, low[r]);
    _mm256_storeu_ps(c + r * c_stride + 8, high[r]);
  }
}

template <int kRows>
void block_tiles(const float* q, const PackedKV& kv, int64_t blk, int64_t keys, int64_t dim, float* scores,
                 const float* probs, float* out, bool values_pass) {
  if (!values_pass) {
    const float* kt = kv.keys + blk * dim * kKeys;
    for (int64_t j0 = 0; j0 < keys; j0 += 16) tile_16<kRows>(q, dim, kt + j0, kKeys, dim, scores + j0, kKeys, false);
    return;
  }
  const float* vb = kv.values + blk * kKeys * dim;
  int64_t d0 = 0;
  for (; d0 + 16 <= dim; d0 += 16) tile_16<kRows>(probs, kKeys, vb + d0, dim, keys, out + d0, dim, true);
  for (int r = 0; r < kRows; ++r)  // dims past the last multiple of 16
    for (int64_t d = d0; d < dim; ++d) {
      float sum = out[r * dim + d];
      for (int64_t j = 0; j < keys; ++j) sum += probs[r * kKeys + j] * vb[j * dim + d];
      out[r * dim + d] = sum;
    }
}

// Each pass over a block of keys for rows [0, rows), kTileRows at a time.
void for_row_tiles(int64_t rows, const float* q, const PackedKV& kv, int64_t blk, int64_t keys, int64_t dim,
                   float* scores, const float* probs, float* out, bool values_pass) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    // the scores pass reads q and writes scores; the values pass reads probs and adds to out
    const float* qr = values_pass ? nullptr : q + r0 * dim;
    float* sr = values_pass ? nullptr : scores + r0 * kKeys;
    const float* pr = values_pass ? probs + r0 * kKeys : nullptr;
    float* orow = values_pass ? out + r0 * dim : nullptr;
    switch (std::min<int64_t>(kTileRows, rows - r0)) {
      case 6: block_tiles<6>(qr, kv, blk, keys, dim, sr, pr, orow, values_pass); break;
      case 5: block_tiles<5>(qr, kv, blk, keys, dim, sr, pr, orow, values_pass); break;
      case 4: block_tiles<4>(qr, kv, blk, keys, dim, sr, pr, orow, values_pass); break;
      case 3: block_tiles<3>(qr, kv, blk, keys, dim, sr, pr, orow, values_pass); break;
      case 2: block_tiles<2>(qr, kv, blk, keys, dim, sr, pr, orow, values_pass); break;
      default: block_tiles<1>(qr, kv, blk, keys, dim, sr, pr, orow, values_pass); break;
    }
  }
}

struct Scratch {
  std::vector<float> query, scores, out, running_max, running_sum;
  void fit(int64_t rows, int64_t dim) {
    query.resize(rows * dim);
    scores.resize(rows * kKeys);
    out.assign(rows * dim, 0.f);
    running_max.assign(rows, -INFINITY);
    running_sum.assign(rows, 0.f);
  }
};

// One item: `group` heads x `positions` query positions from `first_position`; row r is head
// r / positions at position first_position + r % positions.
void attend_item(const float* q, int64_t q_token_stride, int64_t group, int64_t positions, int64_t first_position,
                 const PackedKV& kv, int64_t dim, float scale, int64_t window, float softcap, float* out,
                 int64_t out_token_stride, Scratch& s) {
  const int64_t rows = group * positions;
  s.fit(rows, dim);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + (r % positions) * q_token_stride + (r / positions) * dim;
    for (int64_t d = 0; d < dim; ++d) s.query[r * dim + d] = src[d] * scale;
  }
  const int64_t last_position = first_position + positions - 1;
  const int64_t lowest_key = window > 0 ? std::max<int64_t>(kv.first, first_position - window + 1) : kv.first;
  for (int64_t blk = (lowest_key - kv.first) / kKeys; blk <= (last_position - kv.first) / kKeys; ++blk) {
    const int64_t base = kv.first + blk * kKeys;
    const int64_t visible_keys = std::min(kKeys, last_position + 1 - base);  // the rest is past every row
    const int64_t keys = (visible_keys + 15) / 16 * 16;
    for_row_tiles(rows, s.query.data(), kv, blk, keys, dim, s.scores.data(), nullptr, nullptr, false);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = s.scores.data() + r * kKeys;
      const int64_t position = first_position + r % positions;
      // keys a row sees: (position - window, position]; the others' weights are exactly 0
      const int64_t key_end = std::clamp<int64_t>(position + 1 - base, 0, keys);
      const int64_t key_begin = window > 0 ? std::clamp<int64_t>(position - window + 1 - base, 0, keys) : 0;
      if (key_end <= key_begin) {  // nothing visible in this block
        std::fill(row, row + keys, 0.f);
        continue;
      }
      if (softcap > 0.f)
        for (int64_t j = key_begin; j < key_end; ++j) row[j] = softcap * std::tanh(row[j] / softcap);
      const __m256i begin_v = _mm256_set1_epi32(static_cast<int>(key_begin) - 1);
      const __m256i end_v = _mm256_set1_epi32(static_cast<int>(key_end));
      const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      auto visible = [&](int64_t j) {
        const __m256i index = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int>(j)));
        return _mm256_castsi256_ps(
            _mm256_and_si256(_mm256_cmpgt_epi32(index, begin_v), _mm256_cmpgt_epi32(end_v, index)));
      };
      const bool whole_block = key_begin == 0 && key_end == keys;  // most rows of most blocks: no masking
      __m256 peak_v = _mm256_set1_ps(s.running_max[r]);
      for (int64_t j = 0; j < keys; j += 8) {
        const __m256 score = _mm256_loadu_ps(row + j);
        peak_v = _mm256_max_ps(peak_v, whole_block ? score : _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), score, visible(j)));
      }
      const float peak = horizontal_max(peak_v);
      peak_v = _mm256_set1_ps(peak);
      __m256 total_v = _mm256_setzero_ps();
      for (int64_t j = 0; j < keys; j += 8) {
        __m256 weight = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), peak_v));
        if (!whole_block) weight = _mm256_and_ps(weight, visible(j));
        _mm256_storeu_ps(row + j, weight);
        total_v = _mm256_add_ps(total_v, weight);
      }
      if (peak != s.running_max[r]) {
        const float rescale = s.running_max[r] == -INFINITY ? 0.f : exp_approx(s.running_max[r] - peak);
        float* o = s.out.data() + r * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] *= rescale;
        s.running_sum[r] *= rescale;
        s.running_max[r] = peak;
      }
      s.running_sum[r] += horizontal_sum(total_v);
    }
    for_row_tiles(rows, nullptr, kv, blk, keys, dim, nullptr, s.scores.data(), s.out.data(), true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.f / s.running_sum[r];
    float* dst = out + (r % positions) * out_token_stride + (r / positions) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = s.out[r * dim + d] * inverse;
  }
}

// Packed K/V of a call, per calling thread, grown and never shrunk (fresh pages each call
// would fault as much as the packing costs), up to a bound: a rare huge prefill step packs into
// `oversized`, freed with the call, so it does not pin its size for the process's life.
constexpr int64_t kKeptPackFloats = int64_t{8} << 20;  // 32 MiB for K and V, as the bf16 kernel keeps
float* pack_buffer(int64_t floats, std::vector<float>& oversized) {
  thread_local std::vector<float> buffer;
  std::vector<float>& chosen = floats > kKeptPackFloats ? oversized : buffer;
  if (static_cast<int64_t>(chosen.size()) < floats) chosen.resize(floats);
  return chosen.data();
}

#endif  // RADIXGEN_FLOAT_PREFILL

bool available() {
#ifdef RADIXGEN_FLOAT_PREFILL
  return true;
#else
  return false;
#endif
}

// The checked call of prefill_attention (prefill_attention.cpp) for float32 q and caches. Per
// request: its row, cached prefix, new tokens, where its queries start in q, and the first
// key any of them sees.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& req_to_token, const std::vector<int64_t>& row_of,
                  const std::vector<int64_t>& prefix_of, const std::vector<int64_t>& extend_of,
                  const std::vector<int64_t>& query_start, const std::vector<int64_t>& first_key, double scale,
                  int64_t window, double softcap) {
  TORCH_CHECK(available(), "float32 prefill_attention needs a build with AVX2 and FMA");
#ifdef RADIXGEN_FLOAT_PREFILL
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  const int64_t batch = static_cast<int64_t>(row_of.size()), group = heads / kv_heads;
  std::vector<int64_t> blocks(batch), pack_offset(batch + 1, 0), item_start(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    blocks[b] = (prefix_of[b] + extend_of[b] - first_key[b] + kKeys - 1) / kKeys;
    pack_offset[b + 1] = pack_offset[b] + blocks[b] * kKeys * dim;  // floats of K (and of V) per kv head
    item_start[b + 1] = item_start[b] + kv_heads * ((extend_of[b] + kPositions - 1) / kPositions);
  }
  const int64_t per_head = pack_offset[batch];
  std::vector<float> oversized;
  float* keys = pack_buffer(2 * per_head * kv_heads, oversized);
  float* values = keys + per_head * kv_heads;
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t table_stride = req_to_token.stride(0);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads, offset = h * per_head + pack_offset[b];
      pack(k_ptr, v_ptr, table + row_of[b] * table_stride, first_key[b], prefix_of[b] + extend_of[b], blocks[b], h,
           kv_heads, dim, keys + offset, values + offset);
    }
  });

  auto out = at::empty({tokens, heads, dim}, q.options());
  const float* q_ptr = q.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0);
  // An item costs more the later its positions (more keys to see). A static split of the items
  // in order gave one thread the costly tail, so they are handed out one at a time, from the
  // last (within a request and kv head, the costliest) to the first.
  const int64_t items = item_start[batch];
  std::atomic<int64_t> taken{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t n; (n = taken.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t item = items - 1 - n;
      const int64_t b = std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
      const int64_t per_kv_head = (item_start[b + 1] - item_start[b]) / kv_heads;
      const int64_t h = (item - item_start[b]) / per_kv_head, block = (item - item_start[b]) % per_kv_head;
      const int64_t offset = h * per_head + pack_offset[b];
      const PackedKV kv{keys + offset, values + offset, first_key[b]};
      const int64_t token = query_start[b] + block * kPositions;
      attend_item(q_ptr + token * q_stride + h * group * dim, q_stride, group,
                  std::min(kPositions, extend_of[b] - block * kPositions), prefix_of[b] + block * kPositions, kv,
                  dim, static_cast<float>(scale), window, static_cast<float>(softcap),
                  out_ptr + (token * heads + h * group) * dim, heads * dim, scratch);
    }
  });
  return out;
#else
  return {};
#endif
}

}  // namespace radixgen::float_prefill
