// y = x @ W.T + b for a few rows of x, reading W in its plain [out, in] layout.
//
// At one or two tokens a linear layer is a matrix-vector product bound by how fast W streams
// from memory. oneDNN's blocked GEMM, which the engine uses for batches, reached ~20 GB/s here
// at batch 1; one dot product per output row, the rows split between threads, reads W at the
// ~32 GB/s a plain sum over memory reaches (SmolLM2's layers and head: fp32 24.7 -> 16.6 ms,
// bf16 13.6 -> 8.7 ms per step). From ~4 tokens on the blocked GEMM wins, so the caller
// switches by token count.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "common.h"

namespace {

using radixgen::to_float;

template <typename scalar_t>
void small_linear_kernel(const float* x, const scalar_t* w, const scalar_t* bias, scalar_t* y,
                         int64_t num_tokens, int64_t in, int64_t out) {
  // Each W row is read from memory once and reused from L1 for every token.
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const scalar_t* w_row = w + o * in;
      const float b = bias ? to_float(bias[o]) : 0.f;
      for (int64_t t = 0; t < num_tokens; ++t) {
        const float* x_row = x + t * in;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < in; ++i) sum += to_float(w_row[i]) * x_row[i];
        y[t * out + o] = static_cast<scalar_t>(sum + b);
      }
    }
  });
}

}  // namespace

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_linear is a CPU kernel");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_linear: x [T, in] and weight [out, in], got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const int64_t num_tokens = x.size(0), in = x.size(1), out = weight.size(0);
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!bias_c.defined() || (bias_c.numel() == out && bias_c.scalar_type() == x.scalar_type()),
              "bias must be [out] in the weight's dtype");
  const at::Tensor x_float = x.to(at::kFloat).contiguous();  // converted once, not per W row
  auto y = at::empty({num_tokens, out}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "small_linear", [&] {
    small_linear_kernel<scalar_t>(x_float.data_ptr<float>(), weight.data_ptr<scalar_t>(),
                                  bias_c.defined() ? bias_c.data_ptr<scalar_t>() : nullptr,
                                  y.data_ptr<scalar_t>(), num_tokens, in, out);
  });
  return y;
}

// The schema is defined in radixgen/kernels/ops.py.
TORCH_LIBRARY_IMPL(radixgen, CPU, m) { m.impl("small_linear", TORCH_FN(small_linear)); }
