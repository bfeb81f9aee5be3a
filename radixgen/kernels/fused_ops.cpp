// Fused element-wise steps of a Llama layer: RMSNorm (with the residual add folded in),
// rotary embedding with the K/V write into the pool, and SiLU(gate) * up.
//
// At small batches a layer's few matmuls are surrounded by ~20 small tensor ops, each a
// Python-to-ATen dispatch costing more than its arithmetic; one call per step here replaces
// three to eight of them. Rounding follows the PyTorch path in radixgen/models/layers.py (and
// so transformers'): in reduced precision each intermediate the eager code materialises is
// rounded to the model's dtype at the same place.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common.h"

#include <type_traits>

namespace {

using radixgen::exp_approx;
using radixgen::to_float;

// Rows handed to one thread at a time: small steps (a decode token) run inline.
int64_t row_grain(int64_t row_elements) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elements, 1)); }

// out = weight * normalise(x) per row; with `residual`, first residual += x and normalise that.
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, scalar_t* residual, const scalar_t* weight, scalar_t* out,
                   int64_t rows, int64_t dim, int64_t x_stride, int64_t residual_stride, float eps,
                   bool multiply_in_float) {
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* src = x + r * x_stride;
      if (residual != nullptr) {
        scalar_t* res = residual + r * residual_stride;
        for (int64_t i = 0; i < dim; ++i) res[i] = static_cast<scalar_t>(to_float(res[i]) + to_float(src[i]));
        src = res;
      }
      float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < dim; ++i) sum_sq += to_float(src[i]) * to_float(src[i]);
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
      scalar_t* dst = out + r * dim;
      if (multiply_in_float) {  // Gemma, OLMo 2: multiply in float, round once
        for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<scalar_t>(to_float(src[i]) * inv_rms * to_float(weight[i]));
      } else {
        for (int64_t i = 0; i < dim; ++i) {
          // float32: x * inv_rms * w; reduced precision: round the normalised value, then multiply
          const scalar_t normed = static_cast<scalar_t>(to_float(src[i]) * inv_rms);
          dst[i] = static_cast<scalar_t>(to_float(weight[i]) * to_float(normed));
        }
      }
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu(), "CPU kernel");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
}

// Rotate x [dim] (half-split layout) into out: x * cos + rotate_half(x) * sin.
template <typename scalar_t>
inline void rotate_head(const scalar_t* x, const scalar_t* cos, const scalar_t* sin, scalar_t* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < dim; ++j) {
    const float rotated = j < half ? -to_float(x[j + half]) : to_float(x[j - half]);
    const scalar_t scaled = static_cast<scalar_t>(to_float(x[j]) * to_float(cos[j]));
    out[j] = static_cast<scalar_t>(to_float(scaled) + rotated * to_float(sin[j]));
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool multiply_in_float) {
  check_norm_args(x, weight);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0), 0, static_cast<float>(eps),
                            multiply_in_float);
  });
  return out;
}

// residual += x; returns rms_norm(residual) * weight. Both in one pass over the row.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                        bool multiply_in_float) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            x.stride(0), residual.stride(0), static_cast<float>(eps), multiply_in_float);
  });
  return out;
}

// qkv [T, (H + 2 KVH) * D] -> rotated q [T, H, D]; rotated k and v are written to the pool rows
// out_cache_loc of k_cache / v_cache [slots, KVH, D].
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& out_cache_loc, int64_t num_heads) {
  TORCH_CHECK(qkv.device().is_cpu(), "CPU kernel");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous [slots, kv_heads, head_dim]");
  const int64_t num_tokens = qkv.size(0), num_kv_heads = k_cache.size(1), dim = k_cache.size(2);
  const int64_t width = (num_heads + 2 * num_kv_heads) * dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width && qkv.stride(1) == 1, "qkv must be [T, ", width, "]");
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
                  cos.size(1) == dim,
              "cos/sin must be contiguous [positions, head_dim]");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && qkv.scalar_type() == cos.scalar_type() &&
                  qkv.scalar_type() == v_cache.scalar_type() && qkv.scalar_type() == sin.scalar_type(),
              "qkv, cos/sin and the caches must share a dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && out_cache_loc.scalar_type() == at::kLong &&
                  positions.numel() == num_tokens && out_cache_loc.numel() == num_tokens,
              "positions and out_cache_loc: one int64 per token");
  const at::Tensor pos = positions.contiguous(), loc = out_cache_loc.contiguous();
  const int64_t* pos_ptr = pos.data_ptr<int64_t>();
  const int64_t* loc_ptr = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(pos_ptr[t] >= 0 && pos_ptr[t] < cos.size(0), "token ", t, ": position ", pos_ptr[t],
                " outside the rotary table of ", cos.size(0));
    TORCH_CHECK(loc_ptr[t] >= 0 && loc_ptr[t] < k_cache.size(0), "token ", t, ": slot ", loc_ptr[t],
                " outside the pool of ", k_cache.size(0));
  }
  auto q = at::empty({num_tokens, num_heads, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store_kv", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* cos_ptr = cos.data_ptr<scalar_t>();
    const scalar_t* sin_ptr = sin.data_ptr<scalar_t>();
    scalar_t* q_ptr = q.data_ptr<scalar_t>();
    scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
    scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
    const int64_t kv_row = num_kv_heads * dim, stride = qkv.stride(0);
    at::parallel_for(0, num_tokens, row_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = src + t * stride;
        const scalar_t* c = cos_ptr + pos_ptr[t] * dim;
        const scalar_t* s = sin_ptr + pos_ptr[t] * dim;
        for (int64_t h = 0; h < num_heads; ++h) rotate_head(row + h * dim, c, s, q_ptr + (t * num_heads + h) * dim, dim);
        const scalar_t* k_src = row + num_heads * dim;
        scalar_t* k_dst = k_ptr + loc_ptr[t] * kv_row;
        for (int64_t h = 0; h < num_kv_heads; ++h) rotate_head(k_src + h * dim, c, s, k_dst + h * dim, dim);
        std::copy(k_src + kv_row, k_src + 2 * kv_row, v_ptr + loc_ptr[t] * kv_row);
      }
    });
  });
  return q;
}

// gate_up [T, 2I] -> silu(gate) * up [T, I], silu rounded to the dtype before the product (as
// the PyTorch definition materialises it). 16 lanes at a time where the CPU has AVX-512 BF16:
// the scalar loop did not vectorise (4x slower than PyTorch's at 64 rows).
template <typename scalar_t>
void silu_mul_row(const scalar_t* __restrict gate, const scalar_t* __restrict up, scalar_t* __restrict o, int64_t inter) {
  int64_t i = 0;
#ifdef RADIXGEN_BF16_DOT
  if constexpr (!std::is_same_v<scalar_t, double>) {
    for (; i + 16 <= inter; i += 16) {
      const __m512 g = radixgen::load16(gate + i);
      const __m512 e = radixgen::exp_vec(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = radixgen::rounded16(o, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      radixgen::store16(o + i, _mm512_mul_ps(silu, radixgen::load16(up + i)));
    }
  }
#endif
  for (; i < inter; ++i) {
    const float g = to_float(gate[i]);
    const scalar_t silu = static_cast<scalar_t>(g / (1.f + exp_approx(-g)));
    o[i] = static_cast<scalar_t>(to_float(silu) * to_float(up[i]));
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "CPU kernel");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up must be [T, 2 * intermediate] with contiguous rows");
  const int64_t num_tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({num_tokens, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* src = gate_up.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, num_tokens, row_grain(inter), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_mul_row(src + t * stride, src + t * stride + inter, dst + t * inter, inter);
    });
  });
  return out;
}

// [B, V] float32 -> [B] int64: each row's first largest index, a NaN counting as largest (as
// torch.argmax). PyTorch's CPU argmax does not vectorise (4.3 ms for 64 x 49k logits); this one
// keeps 16 running maxima and their positions, then the first position holding the row's maximum.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "argmax_rows: float32 CPU logits [B, V]");
  const at::Tensor rows = logits.contiguous();
  const int64_t batch = rows.size(0), vocab = rows.size(1);
  TORCH_CHECK(vocab > 0, "argmax_rows: empty rows");
  auto out = at::empty({batch}, rows.options().dtype(at::kLong));
  const float* src = rows.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = src + b * vocab;
      float best = row[0];
      int64_t at = 0;
      int64_t i = 0;
#ifdef RADIXGEN_BF16_DOT
      if (vocab >= 16 && vocab <= INT32_MAX) {  // positions in 32-bit lanes
        __m512 lane_best = _mm512_loadu_ps(row);
        __m512i lane_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i index = lane_at;
        const __m512i step = _mm512_set1_epi32(16);
        bool has_nan = _mm512_cmp_ps_mask(lane_best, lane_best, _CMP_UNORD_Q) != 0;
        for (i = 16; i + 16 <= vocab; i += 16) {
          index = _mm512_add_epi32(index, step);
          const __m512 v = _mm512_loadu_ps(row + i);
          has_nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
          const __mmask16 larger = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);  // strictly: keeps the first
          lane_best = _mm512_mask_mov_ps(lane_best, larger, v);
          lane_at = _mm512_mask_mov_epi32(lane_at, larger, index);
        }
        if (has_nan) {
          i = 0;  // rare: the plain loop below finds the first NaN
        } else {
          best = _mm512_reduce_max_ps(lane_best);
          alignas(64) float values[16];
          alignas(64) int32_t positions[16];
          _mm512_store_ps(values, lane_best);
          _mm512_store_si512(positions, lane_at);
          at = vocab;
          for (int l = 0; l < 16; ++l)
            if (values[l] == best && positions[l] < at) at = positions[l];
        }
      }
#endif
      for (; i < vocab; ++i) {
        const float v = row[i];
        if (std::isnan(v)) {
          if (!std::isnan(best) || i == 0) best = v, at = i;
          break;
        }
        if (v > best) best = v, at = i;
      }
      dst[b] = at;
    }
  });
  return out;
}

// The schemas are defined in radixgen/kernels/ops.py, with the PyTorch and Triton implementations.
// logits [B, V] float32 (in place), bitmask [B, W] int32 with W*32 >= V: the logits of tokens
// whose bit is clear become -inf. Inside a JSON string nearly every word allows all 32 tokens,
// and most other masks are mostly all-clear words, so a word is skipped or filled whole and only
// the few mixed words are read bit by bit (the reference's byte-table gather writes every logit).
void apply_bitmask(at::Tensor& logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous(),
              "apply_bitmask: contiguous float32 CPU logits [B, V]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.size(0) == logits.size(0) &&
                  bitmask.size(1) * 32 >= logits.size(1),
              "apply_bitmask: int32 bitmask [B, W] with W*32 >= V");
  const at::Tensor words = bitmask.contiguous();
  const int64_t batch = logits.size(0), vocab = logits.size(1), width = words.size(1);
  float* dst = logits.data_ptr<float>();
  const uint32_t* src = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>());
  const float blocked = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* row = dst + b * vocab;
      const uint32_t* mask = src + b * width;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = mask[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t first = w * 32, count = std::min<int64_t>(32, vocab - first);
#if defined(__AVX512F__)
        if (count == 32) {  // each clear bit selects a lane to store -inf into
          const __m512 fill = _mm512_set1_ps(blocked);
          _mm512_mask_storeu_ps(row + first, static_cast<__mmask16>(~word & 0xFFFFu), fill);
          _mm512_mask_storeu_ps(row + first + 16, static_cast<__mmask16>((~word >> 16) & 0xFFFFu), fill);
          continue;
        }
#endif
        if (word == 0) {
          for (int64_t i = 0; i < count; ++i) row[first + i] = blocked;
          continue;
        }
        for (int64_t i = 0; i < count; ++i)
          if (!((word >> i) & 1u)) row[first + i] = blocked;
      }
    }
  });
}

TORCH_LIBRARY_IMPL(radixgen, CPU, m) {
  m.impl("rms_norm", TORCH_FN(rms_norm));
  m.impl("add_rms_norm", TORCH_FN(add_rms_norm));
  m.impl("rope_store_kv", TORCH_FN(rope_store_kv));
  m.impl("silu_mul", TORCH_FN(silu_mul));
  m.impl("argmax_rows", TORCH_FN(argmax_rows));
  m.impl("apply_bitmask", TORCH_FN(apply_bitmask));
}
