// The AVX512F implementation of kernels.h's `linear_panel_columns`: y = x W^T as a float32 matrix
// product on W packed ahead into bfloat16 panels (kernels/cpu_ops.py: `pack_panels`), for every
// row count, in the sets with AVX512 (where `cpu_ops.prefer_float32()`).
//
// Every output y[m, n] is one chain of float32 FMAs over k = 0 .. K - 1 in order, from zero
// (x and W widened exactly from bfloat16), plus the bias and a residual, rounded once to
// bfloat16: the same sequence whatever M, the tile it is computed in or the thread, so a decode
// row, a verify block's row and a prefill chunk's row of the same input are the same numbers.
//
// The layout: panel p holds W's rows 48 p .. 48 p + 47 (zeros past N), k in pairs:
// panels[p][k / 2][c][k % 2] = W[48 p + c, k] (K padded to even with zeros). One 64-byte load
// is 16 columns at k and k + 1; shifting its 32-bit lanes up gives k's 16 float32 weights,
// masking them gives k + 1's. A tile is up to 8 rows of x by the panel's 48 columns (one row
// by 4 panels, two rows by 2: more accumulator chains in flight), x's values broadcast from a
// float32 copy of its rows; past 16 rows each panel is widened once into float32 for all the
// tiles. No sum across lanes, W read as bfloat16 (half a float32 panel's bytes). On a 2-core
// Xeon with AVX512-BF16 and no AMX the 11m step's 25 linears take 0.6-0.9x the `vdpbf16ps`
// tiles' time at 8-32 rows, about the same at 1-4 (docs/performance.md).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/kernels.h"
#include "simd.h"

namespace {

using agentflash_cpu::LinearArgs;

constexpr int kLanes = 16;
constexpr int kVectors = 3;                  // 16-column vectors per panel
constexpr int kColumns = kVectors * kLanes;  // a panel's columns
static_assert(kColumns == agentflash_cpu::kPanelColumns);
constexpr int kRows = 8;                     // x rows per tile

// The weights of k + Half (k even) of P consecutive panels, 48 P float32 values: from bfloat16
// pair panels (Pairs: k's pair, one load for both halves, widened) or from one panel widened
// ahead ([K][48] float32).
template <bool Pairs, int P>
struct Weights {
  const void* panel;  // the first
  int64_t stride;     // elements from one panel to the next (Pairs)

  template <int Half>
  __attribute__((always_inline)) void load(int64_t k, __m512 (&w)[kVectors * P]) const {
    if constexpr (Pairs) {
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const uint16_t* pair = static_cast<const uint16_t*>(panel) + p * stride + k * kColumns;
#pragma GCC unroll 3
        for (int j = 0; j < kVectors; ++j) {
          const __m512i raw = _mm512_loadu_si512(pair + j * 2 * kLanes);
          w[p * kVectors + j] =
              Half == 0 ? agentflash_cpu::widen_even(raw) : agentflash_cpu::widen_odd(raw);
        }
      }
    } else {
      static_assert(P == 1);
      const float* row = static_cast<const float*>(panel) + (k + Half) * kColumns;
#pragma GCC unroll 3
      for (int j = 0; j < kVectors; ++j) w[j] = _mm512_load_ps(row + j * kLanes);
    }
  }
};

// acc[i] += x[i, k] * W[:, k] for the tile's rows: one FMA per row and vector.
template <int MR, int V>
__attribute__((always_inline)) inline void accumulate(__m512 (&acc)[MR][V], const __m512 (&w)[V],
                                                      const float* x, int64_t ldxs, int64_t k) {
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512 xb = _mm512_set1_ps(x[i * ldxs + k]);
#pragma GCC unroll 12
    for (int j = 0; j < V; ++j) acc[i][j] = _mm512_fmadd_ps(xb, w[j], acc[i][j]);
  }
}

// y rows m0 .. m0 + MR - 1 for columns n0 .. n0 + width - 1 of P panels (width <= 48 P; with
// more than one panel, a single row or two: more chains in flight than one panel's three).
template <int MR, int P, bool Pairs>
void tile(const LinearArgs& a, const Weights<Pairs, P>& panels, const float* xs, int64_t ldxs,
          int64_t m0, int64_t n0, int width) {
  constexpr int V = kVectors * P;
  __m512 acc[MR][V];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 12
    for (int j = 0; j < V; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* x = xs + m0 * ldxs;
  const int64_t K = a.K;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {  // in pairs: a pair panel's load serves both
    __m512 w[V];
    panels.template load<0>(k, w);
    accumulate<MR, V>(acc, w, x, ldxs, k);
    panels.template load<1>(k, w);
    accumulate<MR, V>(acc, w, x, ldxs, k + 1);
  }
  if (k < K) {  // odd K: the last k alone
    __m512 w[V];
    panels.template load<0>(k, w);
    accumulate<MR, V>(acc, w, x, ldxs, k);
  }
#pragma GCC unroll 12
  for (int j = 0; j < V; ++j) {
    const int cols = std::clamp(width - j * kLanes, 0, kLanes);
    if (cols == 0) break;
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
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
      }
      _mm256_mask_storeu_epi16(a.y + m * a.ldy + n, mask, agentflash_cpu::round_bf16(v));
    }
  }
}

// Every row of x against one panel, in tiles of up to 8 rows.
template <bool Pairs>
void rows(const LinearArgs& a, const Weights<Pairs, 1>& panel, const float* xs, int64_t ldxs,
          int64_t n, int width) {
  for (int64_t m = 0; m < a.M; m += kRows) {
    switch (std::min<int64_t>(kRows, a.M - m)) {
      case 1: tile<1>(a, panel, xs, ldxs, m, n, width); break;
      case 2: tile<2>(a, panel, xs, ldxs, m, n, width); break;
      case 3: tile<3>(a, panel, xs, ldxs, m, n, width); break;
      case 4: tile<4>(a, panel, xs, ldxs, m, n, width); break;
      case 5: tile<5>(a, panel, xs, ldxs, m, n, width); break;
      case 6: tile<6>(a, panel, xs, ldxs, m, n, width); break;
      case 7: tile<7>(a, panel, xs, ldxs, m, n, width); break;
      default: tile<kRows>(a, panel, xs, ldxs, m, n, width);
    }
  }
}

// One or two rows against P panels at a time while a whole group is left, then one by one.
template <int MR, int P>
void few_rows(const LinearArgs& a, const uint16_t* pairs, int64_t stride, const float* xs,
              int64_t ldxs, int64_t n, int64_t n1) {
  for (; n + P * kColumns <= n1; n += P * kColumns, pairs += P * stride)
    tile<MR>(a, Weights<true, P>{pairs, stride}, xs, ldxs, 0, n, P * kColumns);
  for (; n < n1; n += kColumns, pairs += stride)
    tile<MR>(a, Weights<true, 1>{pairs, stride}, xs, ldxs, 0, n,
             static_cast<int>(std::min<int64_t>(kColumns, n1 - n)));
}

// A pair panel widened into float32 [K][48] (exact), for calls of more than one tile of rows.
void widen_panel(const uint16_t* pairs, int64_t K, float* out) {
  for (int64_t k = 0; k + 2 <= K; k += 2) {
#pragma GCC unroll 3
    for (int j = 0; j < kVectors; ++j) {
      const __m512i raw = _mm512_loadu_si512(pairs + k * kColumns + j * 2 * kLanes);
      _mm512_store_ps(out + k * kColumns + j * kLanes, agentflash_cpu::widen_even(raw));
      _mm512_store_ps(out + (k + 1) * kColumns + j * kLanes, agentflash_cpu::widen_odd(raw));
    }
  }
  if (K % 2 == 1) {
    const int64_t k = K - 1;
    for (int j = 0; j < kVectors; ++j) {
      const __m512i raw = _mm512_loadu_si512(pairs + k * kColumns + j * 2 * kLanes);
      _mm512_store_ps(out + k * kColumns + j * kLanes, agentflash_cpu::widen_even(raw));
    }
  }
}

}  // namespace

namespace agentflash_cpu {

void widen_rows(const uint16_t* x, int64_t ldx, int64_t K, int64_t m0, int64_t m1, float* xs) {
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* row = x + m * ldx;
    float* out = xs + m * K;
    for (int64_t k = 0; k < K; k += kLanes) {
      const __mmask16 live = static_cast<__mmask16>(
          K - k >= kLanes ? 0xFFFF : (1u << (K - k)) - 1);
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, row + k));
      _mm512_mask_storeu_ps(out + k, live, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
  }
}

void linear_panel_columns(const LinearArgs& a, const uint16_t* panels, const float* xs,
                          int64_t ldxs, int64_t n0, int64_t n1) {
  const int64_t pair_k = (a.K + 1) / 2 * 2;
  thread_local std::vector<float> buffer;
  if (a.M > 2 * kRows) buffer.resize(a.K * kColumns + kLanes);
  float* widened = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~static_cast<uintptr_t>(63));
  const int64_t stride = pair_k * kColumns;
  const uint16_t* first = panels + (n0 / kColumns) * stride;
  if (a.M == 1) return few_rows<1, 4>(a, first, stride, xs, ldxs, n0, n1);
  if (a.M == 2) return few_rows<2, 2>(a, first, stride, xs, ldxs, n0, n1);
  for (int64_t n = n0; n < n1; n += kColumns) {
    const uint16_t* pairs = first + (n - n0) / kColumns * stride;
    const int width = static_cast<int>(std::min<int64_t>(kColumns, n1 - n));
    if (a.M > 2 * kRows) {  // the panel widened once for all the tiles
      widen_panel(pairs, a.K, widened);
      rows(a, Weights<false, 1>{widened, 0}, xs, ldxs, n, width);
    } else {
      rows(a, Weights<true, 1>{pairs, stride}, xs, ldxs, n, width);
    }
  }
}

}  // namespace agentflash_cpu
