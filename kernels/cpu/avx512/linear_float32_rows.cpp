// The AVX512F implementation of kernels.h's `linear_float32_rows`: a prefill chunk's hundreds of
// rows as a float32 matrix product, for every set with AVX512 (avx512, avx512-bf16; amx takes
// bfloat16 weights on its tiles first).
//
// Every output y[m, n] is one chain of float32 FMAs over k = 0 .. K - 1 in order, from zero
// (x and W widened exactly from bfloat16), plus the bias and a residual, rounded once to
// bfloat16: the same sequence whatever M, the tile it is computed in or the thread. (Not the
// sequence of `linear_columns`, which the decode and verify rows take: the caller gives each
// row one of the two by what the row is, never by what else shares the call.)
//
// How it is fast where `linear_columns` is not: no sum across lanes. Each thread widens its
// W rows 48 at a time into a panel [K][48] (16 x 16 transposes), then runs tiles of up to 8 x
// rows by the panel's 48 columns: per k, three panel loads and eight broadcasts of x feed 24
// FMAs into 24 accumulators. On a 2-core Intel Xeon with AVX512-BF16 (no AMX) it reaches about
// twice the rate of the `vdpbf16ps` tiles at 512 rows of agentflash-11m's shapes, oneDNN's
// float32 rate (docs/performance.md).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/kernels.h"
#include "simd.h"

namespace {

using agentflash_cpu::LinearArgs;

constexpr int kLanes = 16;
constexpr int kPanel = 3;   // 16-column vectors per panel
constexpr int kRows = 8;    // x rows per tile

// panel[k * kPanel * 16 + c] = W[n0 + c, k] widened, for c < width (the rest zero).
void pack_panel(const LinearArgs& a, int64_t n0, int width, float* panel) {
  const int64_t K = a.K;
  constexpr int64_t stride = kPanel * kLanes;
  for (int v = 0; v < kPanel; ++v) {
    const int cols = std::clamp(width - v * kLanes, 0, kLanes);
    for (int64_t k0 = 0; k0 < K; k0 += kLanes) {
      const int depth = static_cast<int>(std::min<int64_t>(kLanes, K - k0));
      const __mmask16 live = static_cast<__mmask16>((1u << depth) - 1);
      __m512i rows[16], cols_out[16];
      for (int c = 0; c < 16; ++c) {
        rows[c] = c < cols ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                 live, a.w + (n0 + v * kLanes + c) * a.ldw + k0)), 16)
                           : _mm512_setzero_si512();
      }
      agentflash_cpu::transpose16(rows, cols_out);
      for (int d = 0; d < depth; ++d)
        _mm512_store_si512(panel + (k0 + d) * stride + v * kLanes, cols_out[d]);
    }
  }
}

// y rows m0 .. m0 + MR - 1 for the panel's columns n0 .. n0 + width - 1 (NV vectors of 16).
template <int MR, int NV>
void tile(const LinearArgs& a, const float* xs, int64_t ldxs, int64_t m0, const float* panel,
          int64_t n0, int width) {
  constexpr int64_t stride = kPanel * kLanes;
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* x = xs + m0 * ldxs;
  for (int64_t k = 0; k < a.K; ++k) {
    __m512 w[NV];
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) w[j] = _mm512_load_ps(panel + k * stride + j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldxs + k]);
#pragma GCC unroll 3
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
    }
  }
#pragma GCC unroll 3
  for (int j = 0; j < NV; ++j) {
    const int cols = std::clamp(width - j * kLanes, 0, kLanes);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    const int64_t n = n0 + j * kLanes;
    const __m512 bias =
        a.bias != nullptr ? _mm512_maskz_loadu_ps(mask, a.bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int64_t m = m0 + i;
      __m512 v = acc[i][j];
      if (a.bias != nullptr) v = _mm512_add_ps(v, bias);
      if (a.residual != nullptr) {
        const __m256i r = _mm256_maskz_loadu_epi16(mask, a.residual + m * a.ldy + n);
        const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(widened));
      }
      _mm256_mask_storeu_epi16(a.y + m * a.ldy + n, mask, agentflash_cpu::round_bf16(v));
    }
  }
}

template <int NV>
void tile_rows(int64_t rows, const LinearArgs& a, const float* xs, int64_t ldxs, int64_t m0,
               const float* panel, int64_t n0, int width) {
  switch (rows) {
    case 1: return tile<1, NV>(a, xs, ldxs, m0, panel, n0, width);
    case 2: return tile<2, NV>(a, xs, ldxs, m0, panel, n0, width);
    case 3: return tile<3, NV>(a, xs, ldxs, m0, panel, n0, width);
    case 4: return tile<4, NV>(a, xs, ldxs, m0, panel, n0, width);
    case 5: return tile<5, NV>(a, xs, ldxs, m0, panel, n0, width);
    case 6: return tile<6, NV>(a, xs, ldxs, m0, panel, n0, width);
    case 7: return tile<7, NV>(a, xs, ldxs, m0, panel, n0, width);
    default: return tile<kRows, NV>(a, xs, ldxs, m0, panel, n0, width);
  }
}

}  // namespace

namespace agentflash_cpu {

void linear_float32_rows(const LinearArgs& a, const float* xs, int64_t ldxs, int64_t n0,
                         int64_t n1) {
  thread_local std::vector<float> buffer;
  buffer.resize(a.K * kPanel * kLanes + 16);
  float* panel = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~static_cast<uintptr_t>(63));
  for (int64_t n = n0; n < n1; n += kPanel * kLanes) {
    const int width = static_cast<int>(std::min<int64_t>(kPanel * kLanes, n1 - n));
    pack_panel(a, n, width, panel);
    const int vectors = (width + kLanes - 1) / kLanes;
    for (int64_t m = 0; m < a.M; m += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, a.M - m);
      switch (vectors) {
        case 1: tile_rows<1>(rows, a, xs, ldxs, m, panel, n, width); break;
        case 2: tile_rows<2>(rows, a, xs, ldxs, m, panel, n, width); break;
        default: tile_rows<3>(rows, a, xs, ldxs, m, panel, n, width);
      }
    }
  }
}

}  // namespace agentflash_cpu
