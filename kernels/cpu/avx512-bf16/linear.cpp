// The AVX512-BF16 implementation of common/linear_op.cpp's `linear_columns` and `linear_int8_columns`
// (kernels.h), one kernel for both weight formats: bfloat16 weights as they are, int8 weights
// turned into bfloat16 in registers (exact: every int8 is a bfloat16), their row's float32 scale
// applied to the sum.
//
// Every output y[m, n] is one dot product of x's row m and W's row n, accumulated by
// `vdpbf16ps` over K in 32-element steps into 16 float32 lanes (the last step masked), then
// summed across lanes by one fixed tree (avx512/simd.h: lane_sums, 16 outputs at once), times
// the row's scale (int8), plus the bias and a residual when given, rounded once to bfloat16.
// That sequence of instructions is the same for every output whatever M, the tile it is computed
// in, or the thread that computes it. A decode row reads W's rows one after another (one
// stream); more rows go in tiles of up to 4 rows of x by 4 rows of W, which keep 16
// accumulators in registers and reuse each loaded (and, for int8, converted) vector 4 times,
// the next tile's rows of W prefetched.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../common/kernels.h"
#include "../avx512/simd.h"

namespace {

using agentflash_cpu::lane_sums;

constexpr int kTile = 4;           // a tile is up to 4 rows of x by 4 rows of W
constexpr int64_t kRowChunk = 64;  // rows of x per pass over a thread's rows of W

using Args = agentflash_cpu::LinearArgs;

// bfloat16 weights: 32 elements of a row as they are.
struct Bf16Weights {
  using T = uint16_t;
  static const T* rows(const Args& a) { return a.w; }
  template <bool Tail>
  static __m512bh load(const T* p, __mmask32 mask) {
    return (__m512bh)(Tail ? _mm512_maskz_loadu_epi16(mask, p) : _mm512_loadu_si512(p));
  }
};

// int8 weights: 32 elements of a row widened to int32, converted to float32 and packed to
// bfloat16 pairs in order (all exact: |q| <= 128 needs 8 significant bits).
struct Int8Weights {
  using T = int8_t;
  static const T* rows(const Args& a) { return a.qw; }
  template <bool Tail>
  static __m512bh load(const T* p, __mmask32 mask) {
    const __m256i q = Tail ? _mm256_maskz_loadu_epi8(mask, p)
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    return _mm512_cvtne2ps_pbh(high, low);
  }
};

// acc[i][j] += x[i, k:k+32] . w[j, k:k+32] (pairwise, in 16 float32 lanes); with Tail, only the
// first K - k elements (the rest load as zeros). With Prefetch, next's rows are fetched too.
template <class F, int MB, int NB, bool Tail, bool Prefetch = true>
__attribute__((always_inline)) inline void step(__m512 (&acc)[MB][NB], const uint16_t* x,
                                                int64_t ldx, const typename F::T* w, int64_t ldw,
                                                const typename F::T* next, int64_t k,
                                                int64_t K) {
  const __mmask32 mask = Tail ? (__mmask32{1} << (K - k)) - 1 : ~__mmask32{0};
  __m512bh wv[NB];
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    wv[j] = F::template load<Tail>(w + j * ldw + k, mask);
    if constexpr (Prefetch)
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

// 4 float32 values of `p` (the first NB; the rest 0) repeated in each 128-bit quarter.
template <int NB>
inline __m512 per_column(const float* p) {
  return _mm512_broadcast_f32x4(_mm_maskz_loadu_ps((1 << NB) - 1, p));
}

// y[m0 : m0+MB, n0 : n0+NB]. A smaller tile computes each of its outputs exactly as the full
// 4x4 tile would in the same place (its missing slots are zero vectors in the same tree).
// W's rows n0 .. n0 + NB - 1 are w (rows ldw apart); `next` the rows fetched meanwhile.
template <class F, int MB, int NB>
void tile(const Args& a, int64_t m0, int64_t n0, const typename F::T* w, int64_t ldw,
          const typename F::T* next) {
  using T = typename F::T;
  const uint16_t* x = a.x + m0 * a.ldx;
  __m512 acc[MB][NB];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  if constexpr (MB == 1) {
    // One row of x (a decode step) reads W's rows one after another, front to back: a single
    // stream, which the hardware prefetcher follows (measured, 2-core EPYC, alternating call by
    // call: ~20% faster than interleaving the 4 rows, whether W streams from memory or from
    // L3; a software prefetch ahead of it, at 512 B to 4 KB, made it slower).
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      __m512 one[1][1] = {{acc[0][j]}};
      const T* row = w + j * ldw;
      int64_t k = 0;
      for (; k + 32 <= a.K; k += 32)
        step<F, 1, 1, false, false>(one, x, a.ldx, row, ldw, row, k, a.K);
      if (k < a.K) step<F, 1, 1, true, false>(one, x, a.ldx, row, ldw, row, k, a.K);
      acc[0][j] = one[0][0];
    }
  } else {
    int64_t k = 0;
    for (; k + 32 <= a.K; k += 32) step<F, MB, NB, false>(acc, x, a.ldx, w, ldw, next, k, a.K);
    if (k < a.K) step<F, MB, NB, true>(acc, x, a.ldx, w, ldw, next, k, a.K);
  }
  __m512 v[16];
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p)
    v[p] = (p / kTile < MB && p % kTile < NB) ? acc[p / kTile][p % kTile] : _mm512_setzero_ps();
  __m512 sums = lane_sums(v);  // element 4 i + j: output (m0 + i, n0 + j)
  if (a.scale != nullptr) sums = _mm512_mul_ps(sums, per_column<NB>(a.scale + n0));
  if (a.bias != nullptr) sums = _mm512_add_ps(sums, per_column<NB>(a.bias + n0));
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

// Rows [m0, m1) of x against NB rows of W from n0 (w, rows ldw apart; m0 a multiple of 4).
template <class F, int NB>
void rows(const Args& a, int64_t m0, int64_t m1, int64_t n0, const typename F::T* w, int64_t ldw,
          const typename F::T* next) {
  int64_t m = m0;
  for (; m + kTile <= m1; m += kTile) tile<F, kTile, NB>(a, m, n0, w, ldw, next);
  switch (m1 - m) {
    case 3: tile<F, 3, NB>(a, m, n0, w, ldw, next); break;
    case 2: tile<F, 2, NB>(a, m, n0, w, ldw, next); break;
    case 1: tile<F, 1, NB>(a, m, n0, w, ldw, next); break;
    default: break;
  }
}

// Rows [m0, m1) of x against NB rows of W from n0. Past one tile of x rows, int8 rows are
// turned into bfloat16 once, into a scratch the tiles then read (the same values: the same
// outputs, bit for bit), rather than once per tile.
template <class F, int NB>
void group(const Args& a, int64_t m0, int64_t m1, int64_t n0) {
  using T = typename F::T;
  const T* w = F::rows(a) + n0 * a.ldw;
  // the next tile's rows of W, fetched while this one computes (rows stream from memory)
  const T* next = n0 + 2 * kTile <= a.N ? w + kTile * a.ldw : w;
  if constexpr (std::is_same_v<F, Int8Weights>) {
    if (m1 - m0 > kTile) {
      const int64_t ld = (a.K + 31) / 32 * 32;
      thread_local std::vector<uint16_t> scratch;
      scratch.resize(kTile * ld);
      uint16_t* buf = scratch.data();
      for (int j = 0; j < NB; ++j) {
        const T* src = w + j * a.ldw;
        uint16_t* dst = buf + j * ld;
        int64_t k = 0;
        for (; k + 32 <= a.K; k += 32)
          _mm512_storeu_si512(dst + k, (__m512i)F::template load<false>(src + k, 0));
        if (k < a.K)
          _mm512_storeu_si512(dst + k, (__m512i)F::template load<true>(
                                           src + k, (__mmask32{1} << (a.K - k)) - 1));
      }
      return rows<Bf16Weights, NB>(a, m0, m1, n0, buf, ld, buf);
    }
  }
  rows<F, NB>(a, m0, m1, n0, w, a.ldw, next);
}

template <class F>
void columns(const Args& a, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
    const int64_t m1 = std::min(a.M, m0 + kRowChunk);
    for (int64_t n = n0; n < n1; n += kTile) {
      switch (std::min<int64_t>(kTile, a.N - n)) {
        case 4: group<F, 4>(a, m0, m1, n); break;
        case 3: group<F, 3>(a, m0, m1, n); break;
        case 2: group<F, 2>(a, m0, m1, n); break;
        default: group<F, 1>(a, m0, m1, n); break;
      }
    }
  }
}

}  // namespace

namespace agentflash_cpu {

void linear_columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  columns<Bf16Weights>(a, n0, n1);
}

void linear_int8_columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  columns<Int8Weights>(a, n0, n1);
}

}  // namespace agentflash_cpu
