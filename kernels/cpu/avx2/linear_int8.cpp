// The AVX2 (+FMA) implementation of common/linear_op.cpp's `linear_int8_columns` (kernels.h): y = (x . q)
// * scale for int8 weights q [N, K] with one float32 scale per row, bfloat16 x and y (the
// AVX512-BF16 library has its own: avx512-bf16/linear.cpp), with avx2/linear.h's kernel: a chunk
// of 16 int8 weights becomes its first and its second 8 as float32 (exact), x's chunk the same
// halves of its bfloat16 values. A decode step reads half the bytes of bfloat16 weights.

#include "linear.h"

namespace {

struct Int8Weights {
  using T = int8_t;
  // Two accumulators (halves apart): with one, a decode step's single FMA chain would hold
  // a thread below the memory's speed at half the bytes a weight (measured: 2x).
  static constexpr bool kHalves = false;
  static constexpr bool kSplit = true;
  static constexpr int kRows = 3;  // tiles of 3 x rows by 2 W rows: 12 accumulators
  static constexpr int kCols = 2;
  static agentflash_cpu::Widened weights(const int8_t* p) {
    const __m128i low = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i high = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high))};
  }
  static agentflash_cpu::Widened activations(const uint16_t* p) {
    return {agentflash_cpu::load_widen8(p), agentflash_cpu::load_widen8(p + 8)};
  }
  static const int8_t* row(const agentflash_cpu::LinearArgs& a, int64_t n) {
    return a.qw + n * a.ldw;
  }
};

}  // namespace

namespace agentflash_cpu {

void linear_int8_columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  avx2::columns<Int8Weights>(a, n0, n1);
}

}  // namespace agentflash_cpu
