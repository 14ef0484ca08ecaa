// agentflash::run_program: one forward of an AOTInductor package (engine.cpu.compiled's decode
// and draft programs), called through the dispatcher.
//
// Why it exists (docs/performance.md): torch's Python loader (`aoti_load_package(...).loader.
// boxed_run`) keeps the GIL for the whole forward, so a server's event loop stood still through
// every engine step (up to ~30 ms for a prefill chunk): requests were not read, rendered or
// tokenized and first tokens not sent until the step ended. An op called from Python runs with
// the GIL released, so the loop works while the engine computes.
//
// `Program` holds the package's loader (`torch.classes.agentflash.Program(path)`); the op takes
// the program's inputs in order (their ownership passes to the run, as with `boxed_run`) and
// returns its outputs. The CPU kernels' workers (parallel.h) are held awake through it.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include "parallel.h"

namespace {

struct Program : torch::CustomClassHolder {
  explicit Program(const std::string& path) : loader(path) {}
  torch::inductor::AOTIModelPackageLoader loader;
};

std::vector<at::Tensor> run_program(const c10::intrusive_ptr<Program>& program,
                                    std::vector<at::Tensor> inputs) {
  agentflash_cpu::Hold hold;  // the kernels' workers spin through the forward
  return program->loader.boxed_run(std::move(inputs));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentflash, m) {
  m.class_<Program>("Program").def(torch::init<std::string>());
  m.def("run_program(__torch__.torch.classes.agentflash.Program program, Tensor[] inputs) "
        "-> Tensor[]",
        &run_program);
}
