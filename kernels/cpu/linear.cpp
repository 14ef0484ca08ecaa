// agentflash::linear_bf16: y = x W^T (+ b) (+ residual) for bfloat16 x [M, K] and W [N, K],
// built for the few rows of a decode step or a verify block.
//
// Why it exists (docs/performance.md): oneDNN's bf16 matmul costs 20-30 us a call at one row
// whatever the size (a 384x384 layer takes as long as a 2048x384 one), so the 24 linears of an
// agentflash-11m step cost ~1.6 ms where their weights stream from cache in ~0.3 ms; on CPUs
// without native bf16 (AVX2) torch's bf16 matmul is slower still. W is read in its checkpoint
// layout (no packed copy). This file checks the arguments and splits W's rows over threads;
// linear_<isa>.cpp computes them (kernels.h: every output by the same instruction sequence).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace {

// Threads take W's rows in multiples of this (a multiple of every implementation's tile width).
constexpr int64_t kColumns = 24;

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear_bf16: x [M, K] and weight [N, K], got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "linear_bf16: bfloat16 x and weight");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_bf16: CPU tensors");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = weight.stride(1) == 1 ? weight : weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear_bf16: bias [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N &&
                    residual->scalar_type() == at::kBFloat16,
                "linear_bf16: a bfloat16 residual [M, N]");
    res = residual->contiguous();
  }
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const agentflash_cpu::LinearArgs a{
      reinterpret_cast<const uint16_t*>(xc.data_ptr()), xc.stride(0),
      reinterpret_cast<const uint16_t*>(wc.data_ptr()), wc.stride(0),
      bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
      res.defined() ? reinterpret_cast<const uint16_t*>(res.data_ptr()) : nullptr,
      reinterpret_cast<uint16_t*>(y.data_ptr()), N, M, K, N};
  const int64_t blocks = (N + kColumns - 1) / kColumns;
  // at least ~16 KB of weights per task: smaller ones cost more to hand out than to compute
  const int64_t grain = std::max<int64_t>(1, 16384 / (2 * kColumns * std::max<int64_t>(K, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    agentflash_cpu::linear_columns(a, b0 * kColumns, std::min(N, b1 * kColumns));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentflash, m) {
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(agentflash, CPU, m) { m.impl("linear_bf16", &linear_bf16); }
