// The AVX2 (+FMA) implementation of common/linear_op.cpp's `linear_columns` (kernels.h), for CPUs without
// native bfloat16 arithmetic: weights stay bfloat16 in memory (half the bytes of float32) and
// are widened to float32 in registers by avx2/linear.h's kernel. A chunk of 16 elements is split
// exactly into its even and odd elements (avx2/simd.h: widen16, two instructions).

#include "linear.h"

namespace {

struct Bf16Weights {
  using T = uint16_t;
  static constexpr bool kSplit = false;  // one accumulator (decode streams W at memory speed)
  static constexpr bool kHalves = true;  // tiles of more x rows widen W a half at a time:
  static constexpr int kRows = 4;        // 4 x rows by 3 W rows
  static constexpr int kCols = 3;
  static agentflash_cpu::Widened weights(const uint16_t* p) {
    return agentflash_cpu::load_widen16(p);
  }
  static agentflash_cpu::Widened activations(const uint16_t* p) {
    return agentflash_cpu::load_widen16(p);
  }
  static const uint16_t* row(const agentflash_cpu::LinearArgs& a, int64_t n) {
    return a.w + n * a.ldw;
  }
};

}  // namespace

namespace agentflash_cpu {

void linear_columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  avx2::columns<Bf16Weights>(a, n0, n1);
}

}  // namespace agentflash_cpu
