// The agentflash ops as C++ functions (linear_op.cpp, attention_op.cpp): what their TORCH_LIBRARY
// registrations dispatch to, and what shims.cpp calls directly for AOTInductor programs.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace agentflash_cpu {

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual);

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual);

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual);

at::Tensor linear_int8_dynamic(const at::Tensor& x, const at::Tensor& qweight,
                               const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual);

at::Tensor paged_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& page_table,
                                int64_t page_size, const at::Tensor& token_seq,
                                const at::Tensor& token_keys, double scale,
                                const std::optional<at::Tensor>& k_new,
                                const std::optional<at::Tensor>& v_new,
                                const std::optional<at::Tensor>& cached);

}  // namespace agentflash_cpu
