// The AVX512-BF16 implementation of linear.cpp's `linear_columns` (kernels.h).
//
// Every output y[m, n] is one dot product of x's row m and W's row n, accumulated by
// `vdpbf16ps` over K in 32-element steps into 16 float32 lanes (the last step masked), then
// summed across lanes by one fixed tree (simd_avx512.h: lane_sums, 16 outputs at once), plus the
// bias and a residual when given, rounded once to bfloat16. That sequence of instructions is the
// same for every output whatever M, the tile it is computed in, or the thread that computes it.
// Tiles of up to 4 rows of x by 4 rows of W keep 16 accumulators in registers and reuse each
// loaded vector 4 times; the next tile's rows of W are prefetched.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "simd_avx512.h"

namespace {

using agentflash_cpu::lane_sums;

constexpr int kTile = 4;           // a tile is up to 4 rows of x by 4 rows of W
constexpr int64_t kRowChunk = 64;  // rows of x per pass over a thread's rows of W

using Args = agentflash_cpu::LinearArgs;

// acc[i][j] += x[i, k:k+32] . w[j, k:k+32] (pairwise, in 16 float32 lanes); with Tail, only the
// first K - k elements (the rest load as zeros).
template <int MB, int NB, bool Tail>
__attribute__((always_inline)) inline void step(__m512 (&acc)[MB][NB], const uint16_t* x,
                                                int64_t ldx, const uint16_t* w, int64_t ldw,
                                                const uint16_t* next, int64_t k, int64_t K) {
  const __mmask32 mask = Tail ? (__mmask32{1} << (K - k)) - 1 : ~__mmask32{0};
  __m512bh wv[NB];
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    wv[j] = (__m512bh)(Tail ? _mm512_maskz_loadu_epi16(mask, w + j * ldw + k)
                            : _mm512_loadu_si512(w + j * ldw + k));
    _mm_prefetch(reinterpret_cast<const char*>(next + j * ldw + k), _MM_HINT_T0);
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i) {
    const __m512bh xv = (__m512bh)(Tail ? _mm512_maskz_loadu_epi16(mask, x + i * ldx + k)
                                        : _mm512_loadu_si512(x + i * ldx + k));
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
  }
}

// y[m0 : m0+MB, n0 : n0+NB]. A smaller tile computes each of its outputs exactly as the full
// 4x4 tile would in the same place (its missing slots are zero vectors in the same tree).
template <int MB, int NB>
void tile(const Args& a, int64_t m0, int64_t n0) {
  const uint16_t* x = a.x + m0 * a.ldx;
  const uint16_t* w = a.w + n0 * a.ldw;
  // the next tile's rows of W, fetched while this one computes (rows stream from memory)
  const uint16_t* next = n0 + 2 * kTile <= a.N ? w + kTile * a.ldw : w;
  __m512 acc[MB][NB];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= a.K; k += 32) step<MB, NB, false>(acc, x, a.ldx, w, a.ldw, next, k, a.K);
  if (k < a.K) step<MB, NB, true>(acc, x, a.ldx, w, a.ldw, next, k, a.K);
  __m512 v[16];
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p)
    v[p] = (p / kTile < MB && p % kTile < NB) ? acc[p / kTile][p % kTile] : _mm512_setzero_ps();
  __m512 sums = lane_sums(v);  // element 4 i + j: output (m0 + i, n0 + j)
  if (a.bias != nullptr)
    sums = _mm512_add_ps(sums, _mm512_broadcast_f32x4(_mm_maskz_loadu_ps((1 << NB) - 1,
                                                                         a.bias + n0)));
  alignas(32) uint16_t out[16];
  if (a.residual != nullptr) {  // sums += residual rows (widened, exact), same layout
    alignas(32) uint16_t res[16] = {};
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i)
      std::memcpy(res + i * kTile, a.residual + (m0 + i) * a.ldy + n0, NB * sizeof(uint16_t));
    sums = _mm512_add_ps(sums, agentflash_cpu::widen_bf16(res));
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(sums));
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
    std::memcpy(a.y + (m0 + i) * a.ldy + n0, out + i * kTile, NB * sizeof(uint16_t));
}

// Rows [m0, m1) of x against NB rows of W from n0 (m0 a multiple of 4).
template <int NB>
void rows(const Args& a, int64_t m0, int64_t m1, int64_t n0) {
  int64_t m = m0;
  for (; m + kTile <= m1; m += kTile) tile<kTile, NB>(a, m, n0);
  switch (m1 - m) {
    case 3: tile<3, NB>(a, m, n0); break;
    case 2: tile<2, NB>(a, m, n0); break;
    case 1: tile<1, NB>(a, m, n0); break;
    default: break;
  }
}

void columns(const Args& a, int64_t m0, int64_t m1, int64_t n0) {
  switch (std::min<int64_t>(kTile, a.N - n0)) {
    case 4: rows<4>(a, m0, m1, n0); break;
    case 3: rows<3>(a, m0, m1, n0); break;
    case 2: rows<2>(a, m0, m1, n0); break;
    default: rows<1>(a, m0, m1, n0); break;
  }
}

}  // namespace

namespace agentflash_cpu {

void linear_columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
    const int64_t m1 = std::min(a.M, m0 + kRowChunk);
    for (int64_t n = n0; n < n1; n += kTile) columns(a, m0, m1, n);
  }
}

}  // namespace agentflash_cpu
