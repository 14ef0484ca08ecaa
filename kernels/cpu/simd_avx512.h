// AVX512 helpers shared by agentflash's AVX512-BF16 kernels (linear_avx512.cpp,
// attention_avx512.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace agentflash_cpu {

// Lane reductions of 16 vectors: element p of the result reduces v[p]'s 16 lanes, always by
// the same tree (lanes 2 apart, then 1 apart within each 128-bit quarter, then quarters 1 apart,
// then 2 apart), so a sum's rounding depends on its vector alone, never on the other 15 or on
// the slot p it was given.
template <__m512 (*Op)(__m512, __m512)>
inline __m512 lane_reduce(const __m512 (&v)[16]) {
  __m512 l1[8], l2[4], l3[2];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p)  // per quarter of a, b: [a0+a2, b0+b2, a1+a3, b1+b3]
    l1[p] = Op(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]),
               _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q)  // per quarter: the 4 sources' partial sums, in order
    l2[q] = Op(_mm512_shuffle_ps(l1[2 * q], l1[2 * q + 1], 0x44),
               _mm512_shuffle_ps(l1[2 * q], l1[2 * q + 1], 0xEE));
#pragma GCC unroll 2
  for (int r = 0; r < 2; ++r)  // quarters 0+1 and 2+3 of each group of 4 sources
    l3[r] = Op(_mm512_shuffle_f32x4(l2[2 * r], l2[2 * r + 1], 0x88),
               _mm512_shuffle_f32x4(l2[2 * r], l2[2 * r + 1], 0xDD));
  return Op(_mm512_shuffle_f32x4(l3[0], l3[1], 0x88), _mm512_shuffle_f32x4(l3[0], l3[1], 0xDD));
}

inline __m512 add16(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 max16(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }

// Element p: the sum (or the maximum) of v[p]'s lanes.
inline __m512 lane_sums(const __m512 (&v)[16]) { return lane_reduce<add16>(v); }
inline __m512 lane_maxes(const __m512 (&v)[16]) { return lane_reduce<max16>(v); }

// 16 bfloat16 values widened to float32 (exact).
inline __m512 widen_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 16 float32 values rounded to bfloat16 (to nearest even) and stored.
inline void store_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

}  // namespace agentflash_cpu
