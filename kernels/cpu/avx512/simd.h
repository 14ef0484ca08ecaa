// AVX512 helpers shared by agentflash's AVX512 kernels: avx512-bf16/linear.cpp and
// avx512-bf16/attention.cpp (AVX512-BF16), avx512/linear.cpp, avx512/linear_panels.cpp
// and avx512/attention_float32.cpp (AVX512F).
// All but store_bf16 are AVX512F.
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

// 32 bfloat16 values (one 64-byte load) as two float32 vectors, exactly (a bfloat16 is the high
// half of its float32): the even elements 0, 2, .., 30 shifted up, the odd ones masked in place.
inline __m512 widen_even(__m512i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)); }
inline __m512 widen_odd(__m512i raw) {
  return _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(-65536)));
}

// 16 float32 values rounded to bfloat16 as torch rounds them (to nearest even; NaN to 0x7FC0),
// each in the low half of its 32-bit lane (AVX512F: CPUs without AVX512-BF16).
inline __m512i round_bf16_lanes(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
}

// The same, packed into 16 consecutive bfloat16 values.
inline __m256i round_bf16(__m512 v) { return _mm512_cvtepi32_epi16(round_bf16_lanes(v)); }

// 32 values given as `even` / `odd` (as widen_even / widen_odd split them), rounded and stored
// in order.
inline void store_bf16_32(uint16_t* p, __m512 even, __m512 odd) {
  _mm512_storeu_si512(p, _mm512_or_si512(round_bf16_lanes(even),
                                         _mm512_slli_epi32(round_bf16_lanes(odd), 16)));
}

// out[c] = column c of the 16 x 16 matrix of 32-bit words whose rows are r[0..15].
inline void transpose16(const __m512i (&r)[16], __m512i (&out)[16]) {
  __m512i t[16], u[16], v[4][4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // u[4i + k], lane L: column 4L + k of rows 4i .. 4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    v[k][0] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);       // columns k, 8+k of rows 0-7
    v[k][1] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);       // columns 4+k, 12+k
    v[k][2] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);  // the same of rows 8-15
    v[k][3] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    out[k] = _mm512_shuffle_i32x4(v[k][0], v[k][2], 0x88);
    out[8 + k] = _mm512_shuffle_i32x4(v[k][0], v[k][2], 0xDD);
    out[4 + k] = _mm512_shuffle_i32x4(v[k][1], v[k][3], 0x88);
    out[12 + k] = _mm512_shuffle_i32x4(v[k][1], v[k][3], 0xDD);
  }
}

// 16 float32 values rounded to bfloat16 (to nearest even) and stored.
inline void store_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

}  // namespace agentflash_cpu
