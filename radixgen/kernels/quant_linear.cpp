// Weight-only quantized linears on CPU: y = x @ dequant(W).T with W stored as 4-bit or 8-bit
// integers in groups of 32 along the input dimension, each group with a float scale and (4-bit)
// a float minimum: w = q * scale + min. This is GGUF's Q4_1 (Q4_0 is min = -8 * scale) and Q8_0
// (signed q, no min), repacked at load into three arrays. A 4-bit group's 16 bytes hold element
// j in the low nibble of byte j and element j + 16 in its high nibble, as in the GGUF blocks.
//
// With AVX2, each group of 32 weights is decoded into four registers and multiplied with up to
// eight tokens before the next group is read, so W streams at 0.625 (4-bit) or 1.125 (8-bit)
// bytes per weight, against 2 for bf16 and 4 for fp32, and no float copy of it is made at any
// batch size. Without AVX2 a row is decoded into a buffer and dotted with each token.
// quant_dequantize gives the float weight (tests, and callers without the native ops).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;

using radixgen::to_float;

// One output row's weights as floats: out[K] = q * scale + min (one rounding where the compiler
// fuses the multiply-add; GGUF readers round twice: the values may differ in the last bit).
// __restrict: bytes may alias anything, and without it the stores to `out` kept the byte loads
// from being vectorised.
inline void decode_row(const uint8_t* __restrict q, const float* __restrict scales, const float* __restrict mins,
                       int64_t k, int64_t bits, float* __restrict out) {
  const int64_t groups = k / kGroup;
  if (bits == 4) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* __restrict b = q + g * (kGroup / 2);
      const float d = scales[g], m = mins ? mins[g] : 0.f;
      float* __restrict o = out + g * kGroup;
#ifdef __AVX2__
      // GCC's own vectorisation of the nibble loops ran ~10x slower than these eight ops
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm));
      _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm));
      _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm));
#else
      for (int64_t j = 0; j < kGroup / 2; ++j) o[j] = static_cast<float>(b[j] & 0x0F) * d + m;
      for (int64_t j = 0; j < kGroup / 2; ++j) o[j + kGroup / 2] = static_cast<float>(b[j] >> 4) * d + m;
#endif
    }
  } else {
    const int8_t* __restrict s = reinterpret_cast<const int8_t*>(q);
    for (int64_t g = 0; g < groups; ++g) {
      const float d = scales[g];
      for (int64_t j = 0; j < kGroup; ++j) out[g * kGroup + j] = static_cast<float>(s[g * kGroup + j]) * d;
    }
  }
}

// n is a multiple of 32: 32 partial sums (four AVX2 / two AVX-512 registers) keep several FMA
// chains in flight, where one running sum would wait on each add's latency.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kGroup] = {};
  for (int64_t i = 0; i < n; i += kGroup) {
    for (int64_t l = 0; l < kGroup; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float total = 0.f;
  for (int64_t l = 0; l < kGroup; ++l) total += acc[l];
  return total;
}

#ifdef __AVX2__
// One group of 32 weights as four vectors: w = q * d + m.
inline void decode_group(const uint8_t* __restrict q, int64_t bits, float d, float m, __m256 w[4]) {
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  __m128i part[4];
  if (bits == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    part[0] = lo, part[1] = _mm_srli_si128(lo, 8), part[2] = hi, part[3] = _mm_srli_si128(hi, 8);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[i])), vd, vm);
  } else {
    for (int i = 0; i < 4; ++i) {
      part[i] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[i])), vd);
    }
  }
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Rows [begin, end) for kTokens tokens: each group decoded into registers once and multiplied
// with every token, with no buffer. One token keeps four accumulators (four FMA chains in
// flight), two keep two each; from four tokens on, one each is enough.
template <int kTokens>
void fused_rows(const float* __restrict x, const uint8_t* __restrict q, const float* __restrict scales,
                const float* __restrict mins, int64_t k, int64_t bits, int64_t n, int64_t begin, int64_t end,
                float* __restrict out) {
  constexpr int kAcc = kTokens == 1 ? 4 : (kTokens == 2 ? 2 : 1);
  const int64_t groups = k / kGroup, row_bytes = k * bits / 8, group_bytes = kGroup * bits / 8;
  for (int64_t r = begin; r < end; ++r) {
    __m256 acc[kTokens][kAcc];
    for (int t = 0; t < kTokens; ++t)
      for (int a = 0; a < kAcc; ++a) acc[t][a] = _mm256_setzero_ps();
    const uint8_t* row = q + r * row_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 w[4];
      decode_group(row + g * group_bytes, bits, scales[r * groups + g], mins ? mins[r * groups + g] : 0.f, w);
      for (int t = 0; t < kTokens; ++t) {
        const float* xg = x + t * k + g * kGroup;
        for (int i = 0; i < 4; ++i) acc[t][i % kAcc] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xg + 8 * i), acc[t][i % kAcc]);
      }
    }
    for (int t = 0; t < kTokens; ++t) {
      __m256 total = acc[t][0];
      for (int a = 1; a < kAcc; ++a) total = _mm256_add_ps(total, acc[t][a]);
      out[t * n + r] = hsum(total);
    }
  }
}

using FusedRows = void (*)(const float*, const uint8_t*, const float*, const float*, int64_t, int64_t, int64_t,
                           int64_t, int64_t, float*);
constexpr FusedRows kFused[] = {nullptr, fused_rows<1>, fused_rows<2>, fused_rows<3>, fused_rows<4>,
                                fused_rows<5>, fused_rows<6>, fused_rows<7>, fused_rows<8>};
#endif

void check(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
           int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qweight.device().is_cpu() && qweight.is_contiguous() && qweight.dim() == 2, "qweight: contiguous [N, K*bits/8]");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "qweight: uint8 for 4 bits, int8 for 8");
  TORCH_CHECK(k % kGroup == 0 && qweight.size(1) == k * bits / 8, "K must be a multiple of 32 and match qweight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({qweight.size(0), k / kGroup}),
              "scales: float32 [N, K/32]");
  TORCH_CHECK(!mins.defined() || mins.numel() == 0 ||
                  (mins.scalar_type() == at::kFloat && mins.is_contiguous() && mins.sizes() == scales.sizes()),
              "mins: float32 [N, K/32] or empty");
}

}  // namespace

// x [T, K] (float32 / bfloat16 / float16) -> [T, N] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& mins, int64_t bits) {
  TORCH_CHECK(x.dim() == 2, "x must be [T, K]");
  const int64_t tokens = x.size(0), k = x.size(1), n = qweight.size(0);
  check(qweight, scales, mins, bits, k);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({tokens, n}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.defined() && mins.numel() ? mins.data_ptr<float>() : nullptr;
  const int64_t row_bytes = qweight.size(1), groups = k / kGroup;
  // grain: enough rows per task that a task reads a few tens of KB of weights
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_bytes));
#ifdef __AVX2__
  // Tokens in chunks of up to 8 per pass over a block of rows: the block's weights stay in
  // cache between passes, and no float copy of W is made at any batch size (a dequantized
  // LM head for the float GEMM was 2x slower than these passes at 64 tokens).
  constexpr int64_t kChunk = 8, kRowBlock = 64;
  if (tokens > 0) {
    at::parallel_for(0, n, std::max<int64_t>(grain, 1), [&](int64_t begin, int64_t end) {
      for (int64_t rows = begin; rows < end; rows += kRowBlock) {
        const int64_t rows_end = std::min(end, rows + kRowBlock);
        for (int64_t t = 0; t < tokens; t += kChunk) {
          const int64_t count = std::min(kChunk, tokens - t);
          kFused[count](xp + t * k, qp, sp, mp, k, bits, n, rows, rows_end, op + t * n);
        }
      }
    });
    return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
  }
#endif
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    for (int64_t r = begin; r < end; ++r) {
      decode_row(qp + r * row_bytes, sp + r * groups, mp ? mp + r * groups : nullptr, k, bits, row.data());
      for (int64_t t = 0; t < tokens; ++t) op[t * n + r] = dot(row.data(), xp + t * k, k);
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// The float [N, K] weight, in `dtype` (for steps large enough to be compute-bound).
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                            int64_t bits, at::ScalarType dtype) {
  const int64_t n = qweight.size(0), k = qweight.size(1) * 8 / bits;
  check(qweight, scales, mins, bits, k);
  auto out = at::empty({n, k}, qweight.options().dtype(at::kFloat));
  const uint8_t* qp = static_cast<const uint8_t*>(qweight.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.defined() && mins.numel() ? mins.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = qweight.size(1), groups = k / kGroup;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      decode_row(qp + r * row_bytes, sp + r * groups, mp ? mp + r * groups : nullptr, k, bits, op + r * k);
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

TORCH_LIBRARY_FRAGMENT(radixgen, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int bits) -> Tensor");
  m.def("quant_dequantize(Tensor qweight, Tensor scales, Tensor mins, int bits, ScalarType dtype) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, TORCH_FN(quant_linear));
  m.impl("quant_dequantize", c10::DispatchKey::CPU, TORCH_FN(quant_dequantize));
}
