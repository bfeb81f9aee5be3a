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
#include <vector>

namespace {

constexpr int64_t kPrefetch = 16;  // keys ahead: slots are scattered over the pool, and 8 ahead was too close to hide a miss

using radixgen::exp_approx;
using radixgen::to_float;

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

// Work items are (request, kv head): the G query heads of a kv head are scored against each K
// row while it is in registers, and a request's three or more items keep both threads busy
// even at batch 1. at::parallel_for runs on torch's own OpenMP team (built with -fopenmp; the
// extension links the libgomp torch already loaded), so no second thread pool competes.
template <typename scalar_t, int kDim>
void decode_attention_kernel(
    const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
    const int64_t* req_to_token, int64_t row_stride, const int64_t* rows, const int64_t* seq_lens,
    scalar_t* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t runtime_dim,
    float scale, int64_t window, float softcap) {
  const int64_t dim = kDim > 0 ? kDim : runtime_dim;
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query, scores, acc, inv_sum;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t offset = (b * num_heads + h * group) * dim;
      // a sliding window reads the last `window` keys only (slot index == position)
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
      attend_one<scalar_t, kDim>(q + offset, k_cache, v_cache, req_to_token + rows[b] * row_stride + first,
                                 seq_lens[b] - first, out + offset, h, num_kv_heads, group, dim, scale,
                                 softcap, query, scores, acc, inv_sum);
    }
  });
}

template <typename scalar_t>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& req_to_token, const at::Tensor& rows,
                  const at::Tensor& seq_lens, at::Tensor& out, double scale, int64_t window,
                  double softcap) {
  const int64_t batch = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  auto run = [&](auto dim_tag) {
    constexpr int kDim = decltype(dim_tag)::value;
    decode_attention_kernel<scalar_t, kDim>(
        q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        req_to_token.data_ptr<int64_t>(), req_to_token.stride(0), rows.data_ptr<int64_t>(),
        seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), batch, num_heads, num_kv_heads,
        dim, static_cast<float>(scale), window, static_cast<float>(softcap));
  };
  if (dim == 64) run(std::integral_constant<int, 64>{});
  else if (dim == 128) run(std::integral_constant<int, 128>{});
  else run(std::integral_constant<int, 0>{});
}

}  // namespace

at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor req_to_token, at::Tensor rows,
                               at::Tensor seq_lens, double scale, int64_t window, double softcap) {
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
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    dispatch_dim<scalar_t>(q, k_cache, v_cache, req_to_token, rows, seq_lens, out, scale, window, softcap);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(radixgen, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor rows, "
        "Tensor seq_lens, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
