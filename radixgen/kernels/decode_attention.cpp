// Decode attention that reads K/V straight from the token-level pool.
//
// One query token per request. For request b the keys are the pool rows named by
// req_to_token[rows[b], 0:seq_lens[b]]; nothing is gathered into a padded block and no mask
// is built, so each K/V row is read once from memory per layer (the gather + SDPA path read
// it, copied it and read the copy again). A sliding-window layer reads the last `window` keys;
// a soft-capped one (Gemma 2) caps the scores before the softmax.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kPrefetch = 16;  // keys ahead: slots are scattered over the pool, and 8 ahead was too close to hide a miss

using radixgen::exp_approx;
using radixgen::to_float;
#ifdef RADIXGEN_BF16_DOT
using radixgen::exp_vec;
#endif

// Every cache line of one head's key or value row: a bf16 row of 64 is two lines, and
// prefetching only the first left a miss on the second for each key.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* p, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(scalar_t)); off += 64) __builtin_prefetch(bytes + off);
}

// Attention of the `group` query heads that share kv head `h`, for one request.
template <typename scalar_t, int kDim>
void attend_one(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                const int64_t* slots, int64_t len, scalar_t* out, int64_t h, int64_t num_kv_heads,
                int64_t group, int64_t runtime_dim, float scale, float softcap, std::vector<float>& query,
                std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& inv_sum) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const int64_t row = num_kv_heads * dim;  // pool row of one slot: all kv heads
  query.resize(group * dim);
  acc.assign(group * dim, 0.f);
  scores.resize(group * len);
  inv_sum.resize(group);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < dim; ++d) query[g * dim + d] = to_float(q[g * dim + d]) * scale;
  }
  for (int64_t j = 0; j < len; ++j) {
    if (j + kPrefetch < len) prefetch_row(k_cache + slots[j + kPrefetch] * row + h * dim, dim);
    const scalar_t* key = k_cache + slots[j] * row + h * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query.data() + g * dim;
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += qg[d] * to_float(key[d]);
      scores[g * len + j] = dot;
    }
  }
  if (softcap > 0.f) {  // Gemma 2: cap * tanh(score / cap), before the softmax
    for (int64_t i = 0; i < group * len; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * len;
    float peak = -INFINITY;
    for (int64_t j = 0; j < len; ++j) peak = std::max(peak, s[j]);
    float total = 0.f;
    for (int64_t j = 0; j < len; ++j) {
      s[j] = exp_approx(s[j] - peak);
      total += s[j];
    }
    inv_sum[g] = 1.f / total;
  }
  for (int64_t j = 0; j < len; ++j) {
    if (j + kPrefetch < len) prefetch_row(v_cache + slots[j + kPrefetch] * row + h * dim, dim);
    const scalar_t* value = v_cache + slots[j] * row + h * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + j];
      float* a = acc.data() + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] += p * to_float(value[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<scalar_t>(acc[g * dim + d] * inv_sum[g]);
  }
}

#ifdef RADIXGEN_BF16_DOT
// What of each key's pool row to prefetch, in elements: the item's own head, the whole row (all
// kv heads, read by the same thread next), or nothing (count 0: the row is in cache already).
struct RowPrefetch {
  int64_t first;
  int64_t count;
};

// Attention already computed over keys before this item's (a shared prefix): per query head of
// the item, the unnormalised output [dim] relative to `max`, and the sum of its weights. The
// item's keys extend it (split attention merged by log-sum-exp). out == nullptr: none.
struct PriorAttention {
  const float* out = nullptr;
  const float* max = nullptr;
  const float* sum = nullptr;
};

// Sixteen 16-lane partial sums -> one vector whose lane j is the sum of v[j]'s lanes: four
// rounds of pairwise shuffles and adds (quarters, then halves of quarters, then lanes), then
// one permute undoes the order they leave the sums in.
inline __m512 sum_lanes_of_16(__m512* v) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: key 2i, 8-15: key 2i + 1
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // quarter k: key 4i + k
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // quarter k: keys 8i + k (lanes 0-1), 8i + 4 + k (lanes 2-3)
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4k + m holds key 4m + k
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

// out[g][d] += p(g, j) v_j[d] + p(g, j + 1) v_{j+1}[d] for kHeads heads, the two rows
// interleaved into bf16 pairs. unpacklo/hi work within 128-bit lanes, so accumulator lo[c]
// lane k holds dim 32c + 8(k / 4) + k % 4 and hi[c] that dim + 4 (undone at the end).
template <int kHeads, int kChunks>
inline void accumulate_pair(const __m512i* first, const __m512i* second, const uint32_t* prob_pairs, int64_t stride,
                            __m512 (*lo)[kChunks], __m512 (*hi)[kChunks]) {
  __m512i pair_lo[kChunks], pair_hi[kChunks];
  for (int c = 0; c < kChunks; ++c) {
    pair_lo[c] = _mm512_unpacklo_epi16(first[c], second[c]);
    pair_hi[c] = _mm512_unpackhi_epi16(first[c], second[c]);
  }
  for (int g = 0; g < kHeads; ++g) {
    const __m512i p = _mm512_set1_epi32(static_cast<int>(prob_pairs[g * stride]));
    for (int c = 0; c < kChunks; ++c) {
      lo[g][c] = _mm512_dpbf16_ps(lo[g][c], (__m512bh)pair_lo[c], (__m512bh)p);
      hi[g][c] = _mm512_dpbf16_ps(hi[g][c], (__m512bh)pair_hi[c], (__m512bh)p);
    }
  }
}

// The P.V pass for kHeads of the group's heads: probs [kHeads][padded] bf16 (zero past len).
template <int kHeads, int kChunks>
void weigh_values(const uint16_t* v_cache, const int64_t* slots, int64_t len, int64_t row, int64_t h,
                  const uint16_t* probs, int64_t padded, const float* inv_sum, uint16_t* out,
                  const RowPrefetch& ahead, const float* prior_out, const float* prior_scale) {
  constexpr int64_t dim = 32 * kChunks;
  __m512 lo[kHeads][kChunks], hi[kHeads][kChunks];
  for (int g = 0; g < kHeads; ++g)
    for (int c = 0; c < kChunks; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  const auto* prob_pairs = reinterpret_cast<const uint32_t*>(probs);
  for (int64_t j = 0; j < len; j += 2) {
    if (j + kPrefetch + 1 < len && ahead.count) {
      prefetch_row(v_cache + slots[j + kPrefetch] * row + ahead.first, ahead.count);
      prefetch_row(v_cache + slots[j + kPrefetch + 1] * row + ahead.first, ahead.count);
    }
    __m512i first[kChunks], second[kChunks];
    const uint16_t* a = v_cache + slots[j] * row + h * dim;
    for (int c = 0; c < kChunks; ++c) first[c] = _mm512_loadu_si512(a + 32 * c);
    if (j + 1 < len) {
      const uint16_t* b = v_cache + slots[j + 1] * row + h * dim;
      for (int c = 0; c < kChunks; ++c) second[c] = _mm512_loadu_si512(b + 32 * c);
    } else {
      for (int c = 0; c < kChunks; ++c) second[c] = _mm512_setzero_si512();
    }
    accumulate_pair<kHeads, kChunks>(first, second, prob_pairs + j / 2, padded / 2, lo, hi);
  }
  // back to dim order
  const __m512i first_half = radixgen::unpacked_dims_first_half();
  const __m512i second_half = radixgen::unpacked_dims_second_half();
  for (int g = 0; g < kHeads; ++g) {
    const __m512 scale = _mm512_set1_ps(inv_sum[g]);
    for (int c = 0; c < kChunks; ++c) {
      __m512 a = _mm512_permutex2var_ps(lo[g][c], first_half, hi[g][c]);
      __m512 b = _mm512_permutex2var_ps(lo[g][c], second_half, hi[g][c]);
      if (prior_out != nullptr) {
        const __m512 weight = _mm512_set1_ps(prior_scale[g]);
        a = _mm512_fmadd_ps(_mm512_loadu_ps(prior_out + g * dim + 32 * c), weight, a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(prior_out + g * dim + 32 * c + 16), weight, b);
      }
      a = _mm512_mul_ps(a, scale);
      b = _mm512_mul_ps(b, scale);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * dim + 32 * c), (__m256i)_mm512_cvtneps_pbh(a));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * dim + 32 * c + 16), (__m256i)_mm512_cvtneps_pbh(b));
    }
  }
}

// attend_one for bf16 heads of 32 * kChunks dims in bf16 dot products: the scores of 16 keys
// at a time (one dot product per key and head, their lane sums batched), the softmax on 16
// lanes, and P.V on pairs of keys with the weights rounded to bf16.
template <int kChunks>
void attend_one_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* slots,
                     int64_t len, uint16_t* out, int64_t h, int64_t num_kv_heads, int64_t group, float scale,
                     float softcap, const RowPrefetch& ahead, const PriorAttention& prior,
                     std::vector<float>& scores, std::vector<float>& inv_sum, std::vector<float>& prior_scale,
                     std::vector<uint16_t>& probs) {
  constexpr int64_t dim = 32 * kChunks;
  const int64_t row = num_kv_heads * dim;
  const int64_t padded = (len + 15) / 16 * 16;
  scores.resize(group * padded);
  probs.resize(group * padded);
  inv_sum.resize(group);
  prior_scale.assign(group, 0.f);
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, len - j0);
    for (int64_t j = j0; j < j0 + count && ahead.count; ++j)
      if (j + kPrefetch < len) prefetch_row(k_cache + slots[j + kPrefetch] * row + ahead.first, ahead.count);
    for (int64_t g = 0; g < group; ++g) {
      __m512i query[kChunks];
      for (int c = 0; c < kChunks; ++c) query[c] = _mm512_loadu_si512(q + g * dim + 32 * c);
      __m512 partial[16];
      for (int64_t j = 0; j < 16; ++j) {
        partial[j] = _mm512_setzero_ps();
        if (j >= count) continue;
        const uint16_t* key = k_cache + slots[j0 + j] * row + h * dim;
        for (int c = 0; c < kChunks; ++c)
          partial[j] = _mm512_dpbf16_ps(partial[j], (__m512bh)_mm512_loadu_si512(key + 32 * c), (__m512bh)query[c]);
      }
      _mm512_storeu_ps(scores.data() + g * padded + j0, _mm512_mul_ps(sum_lanes_of_16(partial), _mm512_set1_ps(scale)));
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * padded;
    if (softcap > 0.f) {
      for (int64_t j = 0; j < len; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
    }
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < padded; j += 16) {
      const __mmask16 live = j + 16 <= len ? 0xffff : static_cast<__mmask16>((1u << (len - j)) - 1);
      peak = _mm512_mask_max_ps(peak, live, peak, _mm512_loadu_ps(s + j));
    }
    float highest = _mm512_reduce_max_ps(peak);
    if (prior.out != nullptr) highest = std::max(highest, prior.max[g]);
    const __m512 top = _mm512_set1_ps(highest);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; j += 16) {
      const __mmask16 live = j + 16 <= len ? 0xffff : static_cast<__mmask16>((1u << (len - j)) - 1);
      const __m512 p = _mm512_maskz_mov_ps(live, exp_vec(_mm512_sub_ps(_mm512_loadu_ps(s + j), top)));
      const __m256i bits = (__m256i)_mm512_cvtneps_pbh(p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs.data() + g * padded + j), bits);
      total = _mm512_add_ps(total, radixgen::widen_bf16(bits));
    }
    float weights = _mm512_reduce_add_ps(total);  // the sum of the weights P.V uses
    if (prior.out != nullptr && prior.max[g] != -INFINITY) {
      prior_scale[g] = exp_approx(prior.max[g] - highest);
      weights += prior.sum[g] * prior_scale[g];
    }
    inv_sum[g] = 1.f / weights;
  }
  // P.V for up to kHeadsPerPass heads at a time: their accumulators stay in registers
  constexpr int kHeadsPerPass = kChunks <= 2 ? 4 : 2;
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsPerPass) {
    const int64_t heads = std::min<int64_t>(kHeadsPerPass, group - g0);
    const uint16_t* p = probs.data() + g0 * padded;
    uint16_t* o = out + g0 * dim;
    const float* prior_o = prior.out != nullptr ? prior.out + g0 * dim : nullptr;
    switch (heads) {
      case 4: weigh_values<4, kChunks>(v_cache, slots, len, row, h, p, padded, inv_sum.data() + g0, o, ahead, prior_o, prior_scale.data() + g0); break;
      case 3: weigh_values<3, kChunks>(v_cache, slots, len, row, h, p, padded, inv_sum.data() + g0, o, ahead, prior_o, prior_scale.data() + g0); break;
      case 2: weigh_values<2, kChunks>(v_cache, slots, len, row, h, p, padded, inv_sum.data() + g0, o, ahead, prior_o, prior_scale.data() + g0); break;
      default: weigh_values<1, kChunks>(v_cache, slots, len, row, h, p, padded, inv_sum.data() + g0, o, ahead, prior_o, prior_scale.data() + g0); break;
    }
  }
}
#endif

// Work items are (request, kv head): the G query heads of a kv head are scored against each K
// row while it is in registers, and a request's three or more items keep both threads busy
// even at batch 1. at::parallel_for runs on torch's own OpenMP team (built with -fopenmp; the
// extension links the libgomp torch already loaded), so no second thread pool competes.
template <typename scalar_t, int kDim>
void decode_attention_kernel(
    const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
    const int64_t* req_to_token, int64_t row_stride, const int64_t* rows, const int64_t* seq_lens,
    scalar_t* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t runtime_dim,
    float scale, int64_t window, float softcap, const int64_t* key_start, const float* prior_out,
    const float* prior_max, const float* prior_sum) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const int64_t group = num_heads / num_kv_heads;
#ifdef RADIXGEN_BF16_DOT
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && (kDim == 64 || kDim == 128)) {
    // With requests enough to share out, an item is a whole request: its kv heads one after
    // the other on one thread, the first pass fetching whole pool rows (all kv heads, ~6 cache
    // lines in a row) and the later ones finding them in cache. Items of one kv head read a
    // third of each row and left DRAM fetching the rest apart, three times.
    const bool whole_rows = batch >= 4 * at::get_num_threads();
    const int64_t heads_per_item = whole_rows ? num_kv_heads : 1;
    at::parallel_for(0, batch * num_kv_heads / heads_per_item, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, inv_sum, prior_scale;
      std::vector<uint16_t> probs;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item * heads_per_item / num_kv_heads;
        const bool extends = key_start != nullptr && key_start[b] > 0;  // keys before key_start[b] done already
        const int64_t first = extends ? key_start[b] : window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
        const int64_t* slots = req_to_token + rows[b] * row_stride + first;
        for (int64_t h = item * heads_per_item % num_kv_heads, n = 0; n < heads_per_item; ++h, ++n) {
          const RowPrefetch ahead = !whole_rows ? RowPrefetch{h * kDim, kDim}
                                    : n == 0    ? RowPrefetch{0, num_kv_heads * kDim}
                                                : RowPrefetch{0, 0};
          const int64_t offset = (b * num_heads + h * group) * kDim;
          const int64_t head0 = b * num_heads + h * group;
          const PriorAttention prior = extends ? PriorAttention{prior_out + head0 * kDim, prior_max + head0,
                                                                prior_sum + head0}
                                               : PriorAttention{};
          attend_one_bf16<kDim / 32>(reinterpret_cast<const uint16_t*>(q + offset),
                                     reinterpret_cast<const uint16_t*>(k_cache),
                                     reinterpret_cast<const uint16_t*>(v_cache), slots, seq_lens[b] - first,
                                     reinterpret_cast<uint16_t*>(out + offset), h, num_kv_heads, group, scale,
                                     softcap, ahead, prior, scores, inv_sum, prior_scale, probs);
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query, scores, acc, inv_sum;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t offset = (b * num_heads + h * group) * dim;
      // a sliding window reads the last `window` keys only (slot index == position)
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
      attend_one<scalar_t, kDim>(q + offset, k_cache, v_cache, req_to_token + rows[b] * row_stride + first,
                                 seq_lens[b] - first, out + offset, h, num_kv_heads, group, dim, scale, softcap,
                                 query, scores, acc, inv_sum);
    }
  });
}

template <typename scalar_t>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& req_to_token, const at::Tensor& rows,
                  const at::Tensor& seq_lens, at::Tensor& out, double scale, int64_t window,
                  double softcap, const int64_t* key_start, const float* prior_out, const float* prior_max,
                  const float* prior_sum) {
  const int64_t batch = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  auto run = [&](auto dim_tag) {
    constexpr int kDim = decltype(dim_tag)::value;
    decode_attention_kernel<scalar_t, kDim>(
        q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        req_to_token.data_ptr<int64_t>(), req_to_token.stride(0), rows.data_ptr<int64_t>(),
        seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch, num_heads, num_kv_heads,
        dim, static_cast<float>(scale), window, static_cast<float>(softcap), key_start, prior_out, prior_max,
        prior_sum);
  };
  if (dim == 64) run(std::integral_constant<int, 64>{});
  else if (dim == 128) run(std::integral_constant<int, 128>{});
  else run(std::integral_constant<int, 0>{});
}

}  // namespace

at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor req_to_token, at::Tensor rows,
                               at::Tensor seq_lens, double scale, int64_t window, double softcap,
                               const std::optional<at::Tensor>& key_start, const std::optional<at::Tensor>& prior_out,
                               const std::optional<at::Tensor>& prior_max, const std::optional<at::Tensor>& prior_sum) {
  TORCH_CHECK(q.device().is_cpu(), "decode_attention is the CPU kernel");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [B,H,D], caches [S,KVH,D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "head_dim differs between q and the cache");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.stride(1) == 1, "req_to_token int64, rows contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "rows/seq_lens int64");
  q = q.contiguous();
  rows = rows.contiguous();
  seq_lens = seq_lens.contiguous();
  TORCH_CHECK(rows.numel() == q.size(0) && seq_lens.numel() == q.size(0), "one row and length per request");
  // The slots themselves come from the allocator; rows and lengths are checked because a bad
  // one would read past req_to_token.
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(row_ptr[b] >= 0 && row_ptr[b] < req_to_token.size(0) && len_ptr[b] >= 1 &&
                    len_ptr[b] <= req_to_token.size(1),
                "request ", b, ": row ", row_ptr[b], " / length ", len_ptr[b], " outside req_to_token ",
                req_to_token.sizes());
  }
  // Extending attention over a shared prefix (shared_prefix_attention's output): the bf16
  // dot-product path only, no window.
  const int64_t* start_ptr = nullptr;
  const float *prior_out_ptr = nullptr, *prior_max_ptr = nullptr, *prior_sum_ptr = nullptr;
  at::Tensor start_c, out_c, max_c, sum_c;
  if (key_start.has_value()) {
#ifdef RADIXGEN_BF16_DOT
    const bool extendable = q.scalar_type() == at::kBFloat16 && (q.size(2) == 64 || q.size(2) == 128);
#else
    const bool extendable = false;
#endif
    TORCH_CHECK(extendable && window == 0, "key_start needs bf16 heads of 64 or 128, AVX-512 BF16 and no window");
    TORCH_CHECK(prior_out.has_value() && prior_max.has_value() && prior_sum.has_value(), "key_start needs the prior");
    start_c = key_start->contiguous();
    out_c = prior_out->contiguous();
    max_c = prior_max->contiguous();
    sum_c = prior_sum->contiguous();
    TORCH_CHECK(start_c.scalar_type() == at::kLong && start_c.numel() == q.size(0), "key_start: int64 per request");
    TORCH_CHECK(out_c.scalar_type() == at::kFloat && out_c.numel() == q.numel() && max_c.numel() == q.size(0) * q.size(1) &&
                    sum_c.numel() == max_c.numel(),
                "prior: float32 [B,H,D], [B,H], [B,H]");
    start_ptr = start_c.data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); ++b)
      TORCH_CHECK(start_ptr[b] >= 0 && start_ptr[b] < len_ptr[b], "request ", b, ": key_start ", start_ptr[b],
                  " leaves no key of its own (length ", len_ptr[b], ")");
    prior_out_ptr = out_c.data_ptr<float>();
    prior_max_ptr = max_c.data_ptr<float>();
    prior_sum_ptr = sum_c.data_ptr<float>();
  }
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    dispatch_dim<scalar_t>(q, k_cache, v_cache, req_to_token, rows, seq_lens, out, scale, window, softcap, start_ptr,
                           prior_out_ptr, prior_max_ptr, prior_sum_ptr);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(radixgen, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor rows, "
        "Tensor seq_lens, float scale, int window=0, float softcap=0.0, Tensor? key_start=None, "
        "Tensor? prior_out=None, Tensor? prior_max=None, Tensor? prior_sum=None) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
