// agentflash::linear_bf16: y = x W^T (+ b) (+ residual) for bfloat16 x [M, K] and W [N, K],
// built for the few rows of a decode step or a verify block; agentflash::linear_int8: the same
// for int8 weights with a float32 scale per row (y = (x q^T) * scale + b), half the bytes;
// agentflash::linear_int8_dynamic: int8 weights times x's rows quantized to 16-bit integers,
// summed in int32 (a drafter's linears: linear_dynamic_<isa>.cpp); agentflash::linear_panels:
// bfloat16 W packed ahead into panels, any number of rows as a float32 matrix product (the sets
// with AVX512, where kernels.cpu_ops.prefer_float32(): avx512/linear_panels.cpp).
//
// Why it exists (docs/performance.md): oneDNN's bf16 matmul costs 20-30 us a call at one row
// whatever the size (a 384x384 layer takes as long as a 2048x384 one), so the 24 linears of an
// agentflash-11m step cost ~1.6 ms where their weights stream from cache in ~0.3 ms; on CPUs
// without native bf16 (AVX2) torch's bf16 matmul is slower still. W is read in its checkpoint
// layout (no packed copy), except by linear_panels. This file checks the arguments and splits
// W's rows over threads; <isa>/linear.cpp (and, on AVX2, avx2/linear_int8.cpp) compute them
// (kernels.h: every output by the same instruction sequence); in the amx set,
// amx/linear_amx.cpp computes bfloat16 weights of the shapes its tiles take.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "ops.h"
#ifdef __AMX_BF16__
#include "../amx/tiles.h"
#endif

namespace {

// Threads take W's rows in multiples of this (a multiple of every implementation's tile width).
constexpr int64_t kColumns = 24;

// y = x W^T with the rest of `a` filled in from the tensors (bias, residual, y), computed by
// `compute(a)`.
template <class Compute>
at::Tensor run(const char* op, const at::Tensor& x, int64_t N,
               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
               agentflash_cpu::LinearArgs a, const Compute& compute) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias [N]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor res;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N &&
                    residual->scalar_type() == at::kBFloat16,
                op, ": a bfloat16 residual [M, N]");
    res = residual->contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  a.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  a.ldx = x.stride(0);
  a.bias = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  a.residual = res.defined() ? reinterpret_cast<const uint16_t*>(res.data_ptr()) : nullptr;
  a.y = reinterpret_cast<uint16_t*>(y.data_ptr());
  a.ldy = N;
  a.M = M;
  a.K = K;
  a.N = N;
  compute(a);
  return y;
}

// Every row of y by `columns`, threads splitting W's N rows.
void by_columns(const agentflash_cpu::LinearArgs& a,
                void (*columns)(const agentflash_cpu::LinearArgs&, int64_t, int64_t)) {
  const int64_t blocks = (a.N + kColumns - 1) / kColumns;
  // at least ~16 KB of weights per task: smaller ones cost more to hand out than to compute
  const int64_t grain = std::max<int64_t>(1, 16384 / (2 * kColumns * std::max<int64_t>(a.K, 1)));
  agentflash_cpu::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    columns(a, b0 * kColumns, std::min(a.N, b1 * kColumns));
  });
}

at::Tensor checked_x(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), op,
              ": x [M, K] and weight [N, K], got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": bfloat16 x");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors");
  return x.stride(1) == 1 ? x : x.contiguous();
}

// An op on int8 weights with a float32 scale per row, its arguments checked.
at::Tensor int8_weights(const char* op, const at::Tensor& x, const at::Tensor& qweight,
                        const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual,
                        void (*columns)(const agentflash_cpu::LinearArgs&, int64_t, int64_t)) {
  const at::Tensor xc = checked_x(op, x, qweight);
  TORCH_CHECK(qweight.scalar_type() == at::kChar, op, ": int8 qweight");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == qweight.size(0) &&
                  scale.scalar_type() == at::kFloat,
              op, ": float32 scale [N]");
  const at::Tensor wc = qweight.stride(1) == 1 ? qweight : qweight.contiguous();
  const at::Tensor sc = scale.contiguous();
  agentflash_cpu::LinearArgs a{};
  a.qw = wc.data_ptr<int8_t>();
  a.ldw = wc.stride(0);
  a.scale = sc.data_ptr<float>();
  return run(op, xc, wc.size(0), bias, residual, a,
             [&](const agentflash_cpu::LinearArgs& args) { by_columns(args, columns); });
}

}  // namespace

namespace agentflash_cpu {

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  const at::Tensor xc = checked_x("linear_bf16", x, weight);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_bf16: bfloat16 x and weight");
  const at::Tensor wc = weight.stride(1) == 1 ? weight : weight.contiguous();
  agentflash_cpu::LinearArgs a{};
  a.w = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  a.ldw = wc.stride(0);
  return run("linear_bf16", xc, wc.size(0), bias, residual, a,
             [](const agentflash_cpu::LinearArgs& args) {
#ifdef __AMX_BF16__
               if (linear_amx(args)) return;
#endif
               by_columns(args, linear_columns);
             });
}

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "linear_panels: bfloat16 CPU x [M, K], got ", x.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 &&
                  panels.device().is_cpu() && panels.is_contiguous() &&
                  panels.size(0) == (n + kPanelColumns - 1) / kPanelColumns &&
                  panels.size(1) == (K + 1) / 2 && panels.size(2) == kPanelColumns &&
                  panels.size(3) == 2,
              "linear_panels: panels of W [n = ", n, ", K = ", K,
              "] (kernels.cpu_ops.pack_panels), got ", panels.sizes(), " ", panels.scalar_type());
#ifdef CPU_CAPABILITY_AVX512
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const auto* w = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  return run("linear_panels", xc, n, bias, residual, agentflash_cpu::LinearArgs{},
             [w](const agentflash_cpu::LinearArgs& a) {
               // x's rows widened once (exact), read by every thread's tiles
               thread_local std::vector<float> widened;
               widened.resize(a.M * a.K);
               float* xs = widened.data();
               agentflash_cpu::parallel_for(0, a.M, std::max<int64_t>(1, 8192 / a.K),
                                            [&](int64_t m0, int64_t m1) {
                 agentflash_cpu::widen_rows(a.x, a.ldx, a.K, m0, m1, xs);
               });
               const int64_t count = (a.N + kPanelColumns - 1) / kPanelColumns;
               // a row or two take up to 4 panels at a time (avx512/linear_panels.cpp)
               const int64_t grain = a.M <= 2 ? 4 : 1;
               agentflash_cpu::parallel_for(0, count, grain, [&](int64_t p0, int64_t p1) {
                 agentflash_cpu::linear_panel_columns(a, w, xs, a.K, p0 * kPanelColumns,
                                                      std::min(a.N, p1 * kPanelColumns));
               });
             });
#else
  TORCH_CHECK(false, "linear_panels: this instruction set's library has no float32 panels "
              "(kernels.cpu_ops.prefer_float32() is False here)");
#endif
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  return int8_weights("linear_int8", x, qweight, scale, bias, residual, linear_int8_columns);
}

at::Tensor linear_int8_dynamic(const at::Tensor& x, const at::Tensor& qweight,
                               const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual) {
  return int8_weights("linear_int8_dynamic", x, qweight, scale, bias, residual,
                      linear_int8_dynamic_columns);
}

}  // namespace agentflash_cpu

TORCH_LIBRARY_FRAGMENT(agentflash, m) {
  m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None) -> "
        "Tensor");
  m.def("linear_panels(Tensor x, Tensor panels, int n, Tensor? bias=None, "
        "Tensor? residual=None) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor qweight, Tensor scale, Tensor? bias=None, "
        "Tensor? residual=None) -> Tensor");
  m.def("linear_int8_dynamic(Tensor x, Tensor qweight, Tensor scale, Tensor? bias=None, "
        "Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(agentflash, CPU, m) {
  m.impl("linear_bf16", &agentflash_cpu::linear_bf16);
  m.impl("linear_panels", &agentflash_cpu::linear_panels);
  m.impl("linear_int8", &agentflash_cpu::linear_int8);
  m.impl("linear_int8_dynamic", &agentflash_cpu::linear_int8_dynamic);
}
