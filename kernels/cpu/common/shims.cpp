// C entry points of the agentflash ops for AOTInductor programs (engine/compiled.py).
//
// Why they exist: a compiled step calls an op without a C shim through AOTInductor's proxy
// executor, which boxes every argument and dispatches by name on each call: 33 calls in the 11m
// step (25 linears, 6 attentions, the drafter's 2 context projections), 5 in its draft. With
// these, the program calls the ops as plain C functions, without that overhead. Their names and
// arguments follow AOTInductor's convention for `aot_inductor.custom_ops_to_c_shims` (kernels/cpu_ops.py: `aoti_shims` declares them):
// tensors as handles, optional tensors as pointers to handles (null for None), the result
// through the last pointer. The library is loaded with its symbols global, so a program that
// calls them resolves them when it is loaded. Each records itself under the op's name, as the
// dispatcher would, for torch.profiler (tools/profile_step.py): nearly free when none runs.

#include <ATen/record_function.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include "ops.h"

using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

namespace {

std::optional<at::Tensor> optional(AtenTensorHandle* handle) {
  if (handle == nullptr) return std::nullopt;
  return *tensor_handle_to_tensor_pointer(*handle);
}

const at::Tensor& tensor(AtenTensorHandle handle) {
  return *tensor_handle_to_tensor_pointer(handle);
}

}  // namespace

extern "C" {

AOTITorchError aoti_torch_cpu_linear_bf16(AtenTensorHandle x, AtenTensorHandle weight,
                                          AtenTensorHandle* bias, AtenTensorHandle* residual,
                                          AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("agentflash::linear_bf16", std::vector<c10::IValue>());
    *ret0 = new_tensor_handle(agentflash_cpu::linear_bf16(tensor(x), tensor(weight),
                                                          optional(bias), optional(residual)));
  });
}

AOTITorchError aoti_torch_cpu_linear_panels(AtenTensorHandle x, AtenTensorHandle panels,
                                            int64_t n, AtenTensorHandle* bias,
                                            AtenTensorHandle* residual, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("agentflash::linear_panels", std::vector<c10::IValue>());
    *ret0 = new_tensor_handle(agentflash_cpu::linear_panels(tensor(x), tensor(panels), n,
                                                            optional(bias), optional(residual)));
  });
}

AOTITorchError aoti_torch_cpu_linear_int8(AtenTensorHandle x, AtenTensorHandle qweight,
                                          AtenTensorHandle scale, AtenTensorHandle* bias,
                                          AtenTensorHandle* residual, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("agentflash::linear_int8", std::vector<c10::IValue>());
    *ret0 = new_tensor_handle(agentflash_cpu::linear_int8(
        tensor(x), tensor(qweight), tensor(scale), optional(bias), optional(residual)));
  });
}

AOTITorchError aoti_torch_cpu_linear_int8_dynamic(AtenTensorHandle x, AtenTensorHandle qweight,
                                                  AtenTensorHandle scale, AtenTensorHandle* bias,
                                                  AtenTensorHandle* residual,
                                                  AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("agentflash::linear_int8_dynamic", std::vector<c10::IValue>());
    *ret0 = new_tensor_handle(agentflash_cpu::linear_int8_dynamic(
        tensor(x), tensor(qweight), tensor(scale), optional(bias), optional(residual)));
  });
}

AOTITorchError aoti_torch_cpu_paged_attention_bf16(
    AtenTensorHandle q, AtenTensorHandle k_cache, AtenTensorHandle v_cache,
    AtenTensorHandle page_table, int64_t page_size, AtenTensorHandle token_seq,
    AtenTensorHandle token_keys, double scale, AtenTensorHandle* k_new, AtenTensorHandle* v_new,
    AtenTensorHandle* cached, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("agentflash::paged_attention_bf16", std::vector<c10::IValue>());
    *ret0 = new_tensor_handle(agentflash_cpu::paged_attention_bf16(
        tensor(q), tensor(k_cache), tensor(v_cache), tensor(page_table), page_size,
        tensor(token_seq), tensor(token_keys), scale, optional(k_new), optional(v_new),
        optional(cached)));
  });
}

}  // extern "C"
