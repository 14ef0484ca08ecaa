// What the AVX512-BF16 and AMX attention kernels (avx512-bf16/attention.cpp,
// amx/attention_amx.cpp) share: blocks of 16 keys packed for bfloat16 dot products, the running
// softmax state of a run's query heads and its final division.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "../avx512/simd.h"
#include "../common/kernels.h"

namespace agentflash_cpu {

constexpr int kBlock = 16;      // keys per block

inline __m512 exp16(__m512 x) { return at::vec::Vectorized<float>(x).exp_u20(); }

// Blocks of 16 keys and values laid out for `vdpbf16ps` (keys past `n` are zeros), N blocks
// in a row: keys[16 b + i] lane j = the i-th pair of block b's key j's elements (2i, 2i+1),
// so a query's 16 scores are D/2 dot-product steps with no sum across lanes; values[p * D/16 +
// c] lane e = the pair (key 2p, key 2p+1) of element 16c + e over all 16 N keys, so the output
// takes 8 steps per 16 elements (and AMX's B tiles read 16 pairs of keys in a row).
template <int D, int N = 1>
struct PackedBlock {
  alignas(64) __m512i keys[N * D / 2];
  alignas(64) __m512i values[N * 8 * (D / 16)];

  // the keys kr[0 .. n-1] and their values vr[0 .. n-1]
  void pack(const uint16_t* const* kr, const uint16_t* const* vr, int n) {
#pragma GCC unroll 1
    for (int b = 0; b < N; ++b)
#pragma GCC unroll 1
      for (int c = 0; c < D / 32; ++c) {
        __m512i rows[16], cols[16];
        for (int j = 0; j < 16; ++j)
          rows[j] = 16 * b + j < n ? _mm512_loadu_si512(kr[16 * b + j] + 32 * c)
                                   : _mm512_setzero_si512();
        transpose16(rows, cols);
        for (int w = 0; w < 16; ++w) keys[b * (D / 2) + 16 * c + w] = cols[w];
      }
    for (int p = 0; p < 8 * N; ++p)
      for (int c = 0; c < D / 16; ++c) {
        const __m512i lo = 2 * p < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(vr[2 * p] + 16 * c)))
                                     : _mm512_setzero_si512();
        const __m512i hi =
            2 * p + 1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(vr[2 * p + 1] + 16 * c)))
                          : _mm512_setzero_si512();
        values[p * (D / 16) + c] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      }
  }
};

// The running softmax state of a run's query heads: row r is query t0 + r / G, head r % G.
struct Rows {
  std::vector<float> max, sum, out;  // [R], [R], [R * D]
  void reset(int64_t rows, int64_t dim) {
    max.assign(rows, -std::numeric_limits<float>::infinity());
    sum.assign(rows, 0.f);
    out.assign(rows * dim, 0.f);
  }
};

// Each row's output, its weighted values divided by its sum, rounded once to bfloat16 (row r:
// query t0 + r / G of the run, head r % G).
template <int D>
inline void store_rows(const Rows& st, const QueryRun& run) {
  const int64_t rows = (run.t1 - run.t0) * run.G;
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 total = _mm512_set1_ps(st.sum[r]);
    uint16_t* dst = run.out + ((run.t0 + r / run.G) * run.Hq + run.g * run.G + r % run.G) * D;
    for (int64_t d = 0; d < D; d += 16)
      store_bf16(dst + d, _mm512_div_ps(_mm512_loadu_ps(st.out.data() + r * D + d), total));
  }
}

}  // namespace agentflash_cpu
