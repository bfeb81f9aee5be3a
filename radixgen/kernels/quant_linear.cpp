// Weight-only quantized linears on CPU: y = x @ dequant(W).T with W stored as 4-bit or 8-bit
// integers in groups of 32 along the input dimension, each group with a float16 scale and (4-bit)
// a float16 minimum: w = q * scale + min (float16 as the GGUF blocks hold them: a 4-bit group is
// 20 bytes, 24 with float32). This is GGUF's Q4_1 (Q4_0 is min = -8 * scale) and Q8_0
// (signed q, no min), repacked at load into three arrays. A 4-bit group's 16 bytes hold element
// j in the low nibble of byte j and element j + 16 in its high nibble, as in the GGUF blocks.
//
// With AVX2, the activations are first rounded to 16-bit integers per group of 32 (a scale per
// token and group: each value within 2^-16 of its group's largest, where bf16 rounds to 2^-9 of
// the value itself); each group of weights is then widened to 16-bit lanes once and multiplied
// with up to four tokens by integer multiply-adds, summed exactly, and scaled once per group.
// W streams at 0.625 (4-bit) or 1.0625 (8-bit) bytes per weight, scales and minimums included,
// against 2 for bf16 and 4 for fp32, and no float copy of it is made at any batch size. This
// replaced a kernel that decoded the weights to floats in registers: the integer one does half
// the instructions per weight (madd_epi16 multiplies 16 pairs, an FMA 8) and no int-to-float
// conversion of weights.
// Without AVX2 a row is decoded into a float buffer and dotted with each token.
// quant_dequantize gives the float weight (tests, and callers without the native ops).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;
// Rows ahead that the kernels prefetch (q, scales, mins: three streams the hardware prefetcher
// alone kept at about half the read bandwidth; 8 rows ahead took the bundled model's linears at
// batch 1 from 13.5 to 8-9 ms a step, 16 or 32 were slower).
constexpr int64_t kPrefetchRows = 8;

using radixgen::to_float;

// A row's float16 scales or minimums as floats.
inline void half_to_float(const at::Half* __restrict src, int64_t n, float* __restrict dst) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// One output row's weights as floats: out[K] = q * scale + min (one rounding where the compiler
// fuses the multiply-add; GGUF readers round twice: the values may differ in the last bit).
// __restrict: bytes may alias anything, and without it the stores to `out` kept the byte loads
// from being vectorised.
inline void decode_row(const uint8_t* __restrict q, const at::Half* __restrict scales, const at::Half* __restrict mins,
                       int64_t k, int64_t bits, float* __restrict out) {
  const int64_t groups = k / kGroup;
  if (bits == 4) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* __restrict b = q + g * (kGroup / 2);
      const float d = to_float(scales[g]), m = mins ? to_float(mins[g]) : 0.f;
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
      const float d = to_float(scales[g]);
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
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Activations as 16-bit integers per group of 32, for the integer dot products below: x ~= xq * xd
// with xd = max|x| / 32767 over the group, so each value is off by at most 2^-16 of the group's
// largest (bf16 rounding is 2^-9 of each value). sum: the group's float sum, for the minimum's term.
void quantize_activations(const float* __restrict x, int64_t tokens, int64_t k, int16_t* __restrict xq,
                          float* __restrict xd, float* __restrict sum) {
  const int64_t groups = k / kGroup;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < tokens * groups; ++i) {
    const float* xg = x + i * kGroup;
    __m256 v[4], amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xg + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      total = _mm256_add_ps(total, v[j]);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float largest = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    xd[i] = largest / 32767.f;
    sum[i] = hsum(total);
    const __m256 inv = _mm256_set1_ps(largest > 0.f ? 32767.f / largest : 0.f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // rounds to nearest
    // packs works within 128-bit lanes; the permute puts the 16 values back in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kGroup),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kGroup + 16),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
  }
}

// Two consecutive groups' weights as four vectors of 16-bit integers: (w[0], w[1]) the first
// group's elements 0-15 and 16-31, (w[2], w[3]) the second's. A 4-bit group's byte j holds
// elements j and j + 16, so zero-extending its 16 bytes to 16-bit lanes (one instruction, from
// memory) leaves each half one mask or one shift away.
template <int kBits>
inline void load_group_pair(const uint8_t* __restrict q, __m256i w[4]) {
  if constexpr (kBits == 4) {
    const __m256i mask = _mm256_set1_epi16(0x0F);
    const __m256i first = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m256i second = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    w[0] = _mm256_and_si256(first, mask), w[1] = _mm256_srli_epi16(first, 4);
    w[2] = _mm256_and_si256(second, mask), w[3] = _mm256_srli_epi16(second, 4);
  } else {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i)));
  }
}

// One group (a row's odd last one): w[0], w[1].
template <int kBits>
inline void load_group(const uint8_t* __restrict q, __m256i w[2]) {
  if constexpr (kBits == 4) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w[0] = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), w[1] = _mm256_srli_epi16(bytes, 4);
  } else {
    for (int i = 0; i < 2; ++i)
      w[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i)));
  }
}

// The 32 products of one group's weights and one token's 16-bit activations, summed exactly:
// eight 32-bit partial sums (madd_epi16: 16 products per instruction, and no int-to-float
// conversion of the weights).
inline __m256i group_products(const __m256i w0, const __m256i w1, const int16_t* __restrict x) {
  return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                          _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
}

inline float dot_floats(const float* __restrict a, const float* __restrict b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float total = hsum(acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// Rows [begin, end) against kTokens tokens of 16-bit activations. Per group and token the
// products' integer sums are scaled once, by weight scale x activation scale (computed for a
// whole row up front, so the loop broadcasts them from memory); the minimum's term is the row's
// minimums dotted with the groups' sums of x. Groups go in pairs, each group of the pair with an
// accumulator of its own (two FMA chains in flight) for every token count, so a token's result
// does not depend on how many tokens share the call: greedy outputs are the same alone and in a
// batch, and a speculative step's extend reproduces the decode step's logits bit for bit.
template <int kBits, int kTokens>
void int_rows(const int16_t* __restrict xq, const float* __restrict xd, const float* __restrict xs,
              const uint8_t* __restrict q, const at::Half* __restrict scales, const at::Half* __restrict mins, int64_t k,
              int64_t n, int64_t begin, int64_t end, float* __restrict out) {
  constexpr int kAcc = 2;  // one per group of a pair, whatever kTokens is (see above)
  constexpr int64_t group_bytes = kGroup * kBits / 8;
  const int64_t groups = k / kGroup, row_bytes = k * kBits / 8;
  thread_local std::vector<float> row_scale, row_floats;
  row_scale.resize(kTokens * groups), row_floats.resize(2 * groups);
  float* __restrict rs = row_scale.data();
  float* __restrict d = row_floats.data();  // the row's scales, then its minimums, as floats
  float* __restrict m = d + groups;
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* row = q + r * row_bytes;
    if (r + kPrefetchRows < end) {
      const uint8_t* ahead = row + kPrefetchRows * row_bytes;
      for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(ahead + line);
      for (int64_t line = 0; line < groups; line += 32) {
        __builtin_prefetch(scales + (r + kPrefetchRows) * groups + line);
        if (mins) __builtin_prefetch(mins + (r + kPrefetchRows) * groups + line);
      }
    }
    half_to_float(scales + r * groups, groups, d);
    if (mins) half_to_float(mins + r * groups, groups, m);
    for (int t = 0; t < kTokens; ++t)
      for (int64_t g = 0; g < groups; ++g) rs[t * groups + g] = d[g] * xd[t * groups + g];
    __m256 acc[kTokens][kAcc];
    for (int t = 0; t < kTokens; ++t)
      for (int a = 0; a < kAcc; ++a) acc[t][a] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
      __m256i w[4];
      load_group_pair<kBits>(row + g * group_bytes, w);
      for (int t = 0; t < kTokens; ++t) {
        const int16_t* xg = xq + t * k + g * kGroup;
        const float* st = rs + t * groups + g;
        const __m256 first = _mm256_cvtepi32_ps(group_products(w[0], w[1], xg));
        const __m256 second = _mm256_cvtepi32_ps(group_products(w[2], w[3], xg + kGroup));
        acc[t][0] = _mm256_fmadd_ps(first, _mm256_broadcast_ss(st), acc[t][0]);
        acc[t][kAcc - 1] = _mm256_fmadd_ps(second, _mm256_broadcast_ss(st + 1), acc[t][kAcc - 1]);
      }
    }
    if (g < groups) {
      __m256i w[2];
      load_group<kBits>(row + g * group_bytes, w);
      for (int t = 0; t < kTokens; ++t) {
        const __m256 sums = _mm256_cvtepi32_ps(group_products(w[0], w[1], xq + t * k + g * kGroup));
        acc[t][0] = _mm256_fmadd_ps(sums, _mm256_broadcast_ss(rs + t * groups + g), acc[t][0]);
      }
    }
    for (int t = 0; t < kTokens; ++t) {
      __m256 total = acc[t][0];
      for (int a = 1; a < kAcc; ++a) total = _mm256_add_ps(total, acc[t][a]);
      out[t * n + r] = hsum(total) + (mins ? dot_floats(m, xs + t * groups, groups) : 0.f);
    }
  }
}

using IntRows = void (*)(const int16_t*, const float*, const float*, const uint8_t*, const at::Half*, const at::Half*,
                         int64_t, int64_t, int64_t, int64_t, float*);
template <int kBits>
constexpr IntRows kIntRows[] = {nullptr, int_rows<kBits, 1>, int_rows<kBits, 2>, int_rows<kBits, 3>,
                                int_rows<kBits, 4>};

#endif

void check(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins, int64_t bits,
           int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qweight.device().is_cpu() && qweight.is_contiguous() && qweight.dim() == 2, "qweight: contiguous [N, K*bits/8]");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "qweight: uint8 for 4 bits, int8 for 8");
  TORCH_CHECK(k % kGroup == 0 && qweight.size(1) == k * bits / 8, "K must be a multiple of 32 and match qweight");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({qweight.size(0), k / kGroup}),
              "scales: float16 [N, K/32]");
  TORCH_CHECK(!mins.defined() || mins.numel() == 0 ||
                  (mins.scalar_type() == at::kHalf && mins.is_contiguous() && mins.sizes() == scales.sizes()),
              "mins: float16 [N, K/32] or empty");
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
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.defined() && mins.numel() ? mins.data_ptr<at::Half>() : nullptr;
  const int64_t row_bytes = qweight.size(1), groups = k / kGroup;
  // grain: enough rows per task that a task reads a few tens of KB of weights
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_bytes));
#ifdef __AVX2__
  // Tokens in chunks of up to 4 per pass over a block of rows (4 tokens x 2 accumulators fit
  // the 16 vector registers with the weights; chunks of 8 measured slower): the block's weights stay in
  // cache between passes, and no float copy of W is made at any batch size (a dequantized
  // LM head for the float GEMM was 2x slower than these passes at 64 tokens).
  constexpr int64_t kChunk = 4, kRowBlock = 64;
  if (tokens > 0) {
    // per thread, kept across calls: a step calls ~120 linears, and each allocated four tensors
    thread_local std::vector<int16_t> xq;
    thread_local std::vector<float> xd, xs;
    xq.resize(tokens * k), xd.resize(tokens * groups), xs.resize(tokens * groups);
    quantize_activations(xp, tokens, k, xq.data(), xd.data(), xs.data());
    const int16_t* xqp = xq.data();
    const float* xdp = xd.data();
    const float* xsp = xs.data();
    const IntRows* table = bits == 4 ? kIntRows<4> : kIntRows<8>;
    at::parallel_for(0, n, std::max<int64_t>(grain, 1), [&](int64_t begin, int64_t end) {
      for (int64_t rows = begin; rows < end; rows += kRowBlock) {
        const int64_t rows_end = std::min(end, rows + kRowBlock);
        for (int64_t t = 0; t < tokens; t += kChunk) {
          const int64_t count = std::min(kChunk, tokens - t);
          table[count](xqp + t * k, xdp + t * groups, xsp + t * groups, qp, sp, mp, k, n, rows, rows_end, op + t * n);
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
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.defined() && mins.numel() ? mins.data_ptr<at::Half>() : nullptr;
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
