// AVX2 helpers shared by agentflash's AVX2 kernels (avx2/linear.cpp, avx2/attention.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace agentflash_cpu {

// 16 bfloat16 values as two float32 vectors, exactly (a bfloat16 is the high half of its
// float32): `even` holds elements 0, 2, .., 14 and `odd` elements 1, 3, .., 15.
struct Widened {
  __m256 even;
  __m256 odd;
};

inline Widened widen16(__m256i raw) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(-65536)))};
}

inline Widened load_widen16(const uint16_t* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 8 consecutive bfloat16 values as float32, exactly.
inline __m256 load_widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// Lane reductions of 8 vectors: element p reduces v[p]'s 8 lanes, always by the tree
// ((l0 . l1) . (l2 . l3)) . ((l4 . l5) . (l6 . l7)), so a sum's rounding depends on its vector
// alone, never on the other 7 or on the slot p it was given.
template <__m256 (*Op)(__m256, __m256)>
inline __m256 lane_reduce8(const __m256 (&v)[8]) {
  // [a0.a1, a2.a3, b0.b1, b2.b3 | a4.a5, a6.a7, b4.b5, b6.b7]
  auto pairs = [](__m256 a, __m256 b) {
    return Op(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
  };
  const __m256 a0 = pairs(v[0], v[1]), a1 = pairs(v[2], v[3]);
  const __m256 a2 = pairs(v[4], v[5]), a3 = pairs(v[6], v[7]);
  const __m256 b0 = pairs(a0, a1), b1 = pairs(a2, a3);  // lanes 0-3 of each half: 4 sources
  return Op(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline __m256 add8(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256 max8(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }

// Element p: the sum (or the maximum) of v[p]'s lanes.
inline __m256 lane_sums8(const __m256 (&v)[8]) { return lane_reduce8<add8>(v); }
inline __m256 lane_maxes8(const __m256 (&v)[8]) { return lane_reduce8<max8>(v); }

// 8 float32 values rounded to bfloat16 as torch rounds them (to nearest even; NaN to 0x7FC0),
// in the low halves of the 32-bit lanes.
inline __m256i round_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}

// 16 values given as `even` / `odd` (as widen16 splits them), rounded and stored in order.
inline void store_bf16_16(uint16_t* p, __m256 even, __m256 odd) {
  const __m256i words =
      _mm256_or_si256(round_bf16(even), _mm256_slli_epi32(round_bf16(odd), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), words);
}

// 8 values rounded and stored in order.
inline void store_bf16_8(uint16_t* p, __m256 v) {
  const __m256i r = round_bf16(v);  // each value < 2^16: packing without saturation
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// The scalar version of round_bf16.
inline uint16_t round_bf16(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, sizeof bits);
  if (f != f) return 0x7FC0;
  return static_cast<uint16_t>((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16);
}

}  // namespace agentflash_cpu
