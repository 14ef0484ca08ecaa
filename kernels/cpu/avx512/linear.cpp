// The AVX512F implementation of common/linear_op.cpp's `linear_columns` and `linear_int8_columns`
// (kernels.h), for CPUs with AVX512 but without native bfloat16 arithmetic (Intel Skylake-SP to
// Ice Lake): weights widened to float32 in 16-lane registers, twice AVX2's width, with 32
// registers for the tiles.
//
// Every output y[m, n] is one dot product of x's row m and W's row n over K in 32-element
// chunks (the last zero-padded): a chunk is split exactly into two float32 vectors of 16 (F
// says how: bfloat16 weights into even and odd elements, int8 into first and second halves,
// x's chunk the same way), whose products go by FMA into two accumulators, one per half, then
// added, summed across lanes by one fixed tree (avx512/simd.h: lane_sums, 16 outputs at once),
// times the row's scale (int8), plus the bias and a residual, rounded once to bfloat16. The same
// sequence for every output whatever M, the tile it is computed in or the thread.
//
// How it is fast: x's rows are widened once per call into a float32 scratch. Then tiles of
// MB x rows by NB W rows: per chunk each W row is loaded once and widened a half at a time, each
// half serving MB FMAs, each x half NB; 2 * MB * NB accumulators (two chains per output: one
// chain's 4-cycle latency would hold a thread below the cache's speed). The tile for each row
// count is in `rows_by_weights`, measured on a 2-core Xeon without AVX512-BF16 (the 11m step's 25
// linears, their 22 MB cycling through L3; medians, alternated in one process with the previous
// tiles: a 1-row decode read W one row at a time, 2-4 and 7+ rows went in tiles of 4 x 3 and a
// remainder, and GCC's `unroll 4` left 5-row tiles' accumulators on the stack): 1 row 531 us
// against 629 (a 0.6B-shaped step's 197 linears: 37.2 against 48.4 ms), 2 rows 545 against 626,
// 3 597 / 640, 4 673 / 715, 5 771 / 798, 6 825 / 957, 7 960 / 1048. From 8 rows tiles of 4 x 3
// (8 rows 1134 us, 16 rows 2195); neither 4 x 4 nor deeper prefetching beat them at 8.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/kernels.h"
#include "simd.h"

namespace {

using agentflash_cpu::LinearArgs;

constexpr int kGroup = 16;         // W rows whose outputs are reduced together (lane_sums)
constexpr int64_t kRowChunk = 32;  // x rows per pass over a thread's rows of W

// Floats between widened rows of x: their chunks plus one cache line, so that rows are never a
// multiple of 4 KB apart (a tile's rows would share L1 sets).
inline int64_t row_stride(int64_t chunks) { return chunks * 32 + 16; }

inline __mmask32 tail_mask(int64_t n) { return static_cast<__mmask32>((uint64_t{1} << n) - 1); }

// bfloat16 weights: a chunk of 32 as its even and its odd elements (a bfloat16 is the high half
// of its float32: even ones shifted up, odd ones masked in place).
struct Bf16Weights {
  using T = uint16_t;
  static const T* rows(const LinearArgs& a) { return a.w; }
  static __m512i load(const T* p) { return _mm512_loadu_si512(p); }
  static __m512i load_tail(const T* p, int64_t n) {
    return _mm512_maskz_loadu_epi16(tail_mask(n), p);
  }
  template <int Half>
  static __m512 widen(__m512i raw) {
    return Half == 0 ? agentflash_cpu::widen_even(raw) : agentflash_cpu::widen_odd(raw);
  }
  static void activations(const uint16_t* p, float* out) {  // the same split for x
    const __m512i raw = _mm512_loadu_si512(p);
    _mm512_store_ps(out, widen<0>(raw));
    _mm512_store_ps(out + 16, widen<1>(raw));
  }
};

// int8 weights: a chunk of 32 as its first and its second 16, converted to float32 (exact).
struct Int8Weights {
  using T = int8_t;
  static const T* rows(const LinearArgs& a) { return a.qw; }
  static __m512i load(const T* p) {
    return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512i load_tail(const T* p, int64_t n) {
    return _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(tail_mask(n), p));
  }
  template <int Half>
  static __m512 widen(__m512i raw) {
    const __m256i q = _mm512_castsi512_si256(raw);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(Half == 0 ? _mm256_castsi256_si128(q)
                                                             : _mm256_extracti128_si256(q, 1)));
  }
  static void activations(const uint16_t* p, float* out) {
    _mm512_store_ps(out, agentflash_cpu::widen_bf16(p));
    _mm512_store_ps(out + 16, agentflash_cpu::widen_bf16(p + 16));
  }
};

// x's rows m0 .. m1 - 1 widened into `out`, `chunks` chunks a row as F splits them (zero-padded).
template <class F>
void widen_rows(const LinearArgs& a, int64_t m0, int64_t m1, int64_t chunks, float* out) {
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* x = a.x + m * a.ldx;
    float* dst = out + (m - m0) * row_stride(chunks);
    for (int64_t c = 0; c < chunks; ++c) {
      if ((c + 1) * 32 <= a.K) {
        F::activations(x + 32 * c, dst + 32 * c);
      } else {
        alignas(64) uint16_t tail[32] = {};
        std::memcpy(tail, x + 32 * c, (a.K - 32 * c) * sizeof(uint16_t));
        F::activations(tail, dst + 32 * c);
      }
    }
  }
}

// out[i * kGroup + j] = the 16-lane partial sums of x row i (of the MB from xs, `stride` floats
// apart) . W row j (of the NB from w, ldw apart): per chunk, each W row is loaded once and
// widened a half at a time, each half serving MB FMAs, each x half NB.
template <class F, int MB, int NB>
void tile(const float* xs, int64_t stride, int64_t K, const typename F::T* w, int64_t ldw,
          const typename F::T* next, __m512* out) {
  __m512 acc[2][MB][NB];  // one chain per half of a chunk
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[h][i][j] = _mm512_setzero_ps();
  auto step = [&](int64_t c, const __m512i (&raw)[NB]) __attribute__((always_inline)) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m512 v[NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
        v[j] = half == 0 ? F::template widen<0>(raw[j]) : F::template widen<1>(raw[j]);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const __m512 x = _mm512_load_ps(xs + i * stride + c * 32 + 16 * half);
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) acc[half][i][j] = _mm512_fmadd_ps(x, v[j], acc[half][i][j]);
      }
    }
  };
  const int64_t full = K / 32;
  for (int64_t c = 0; c < full; ++c) {
    __m512i raw[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      raw[j] = F::load(w + j * ldw + 32 * c);
      if (next != nullptr)  // the next tile's W rows, fetched while this one computes
        _mm_prefetch(reinterpret_cast<const char*>(next + j * ldw + 32 * c), _MM_HINT_T0);
    }
    step(c, raw);
  }
  if (full * 32 < K) {  // the last chunk, zero-padded
    __m512i raw[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) raw[j] = F::load_tail(w + j * ldw + 32 * full, K - 32 * full);
    step(full, raw);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) out[i * kGroup + j] = _mm512_add_ps(acc[0][i][j], acc[1][i][j]);
}

// A tile of `rows` rows of x by NB rows of W: MR, or a remainder of 1 .. 3 (only tiles of 4 rows
// leave remainders; 5-7 rows take one tile of exactly that many).
template <class F, int MR, int NB>
void tile_rows(int64_t rows, const float* xs, int64_t stride, int64_t K, const typename F::T* w,
               int64_t ldw, const typename F::T* next, __m512* out) {
  switch (rows) {
    case 1: return tile<F, 1, NB>(xs, stride, K, w, ldw, next, out);
    case 2: return tile<F, 2, NB>(xs, stride, K, w, ldw, next, out);
    case 3: return tile<F, 3, NB>(xs, stride, K, w, ldw, next, out);
    default: return tile<F, MR, NB>(xs, stride, K, w, ldw, next, out);
  }
}

// Tiles of up to MR x rows by NC (<= 4) W rows over W's rows w .. w + width - 1: each group of
// NC W rows is read once, by the first row tile, for all of them (the last group may be
// narrower).
template <class F, int MR, int NC>
void tiles(const float* xs, int64_t stride, int64_t K, int64_t rows, const typename F::T* w,
           int64_t ldw, int width, const typename F::T* after, __m512* acc) {
  static_assert(NC >= 1 && NC <= 4);
  for (int j = 0; j < width; j += NC) {
    const int cols = std::min(NC, width - j);
    const typename F::T* wj = w + j * ldw;
    // while the first row tile reads these W rows, fetch the next ones (the next group's first
    // rows after the last)
    const typename F::T* next = j + NC < width ? wj + NC * ldw : after;
    for (int64_t i = 0; i < rows; i += MR) {
      const int64_t r = std::min<int64_t>(MR, rows - i);
      const typename F::T* fetch = i == 0 ? next : nullptr;
      const float* x = xs + i * stride;
      __m512* out = acc + i * kGroup + j;
      switch (cols) {  // NC, or fewer in the last group
        case 4:
          if constexpr (NC >= 4) {
            tile_rows<F, MR, 4>(r, x, stride, K, wj, ldw, fetch, out);
            break;
          }
          [[fallthrough]];
        case 3:
          if constexpr (NC >= 3) {
            tile_rows<F, MR, 3>(r, x, stride, K, wj, ldw, fetch, out);
            break;
          }
          [[fallthrough]];
        case 2:
          if constexpr (NC >= 2) {
            tile_rows<F, MR, 2>(r, x, stride, K, wj, ldw, fetch, out);
            break;
          }
          [[fallthrough]];
        default: tile_rows<F, MR, 1>(r, x, stride, K, wj, ldw, fetch, out);
      }
    }
  }
}

// The partial sums of every row of the pass (x widened in xs) with W's rows w .. w + width - 1
// into acc[i * kGroup + j], in the tiles measured fastest for that many rows (the header): x
// rows by W rows, at most 28 accumulators and the widened W halves in the 32 registers.
template <class F>
void rows_by_weights(const float* xs, int64_t chunks, int64_t K, int64_t rows,
                     const typename F::T* w, int64_t ldw, int width, const typename F::T* after,
                     __m512* acc) {
  const int64_t stride = row_stride(chunks);
  switch (rows) {
    case 1: return tiles<F, 1, 4>(xs, stride, K, rows, w, ldw, width, after, acc);
    case 2: return tiles<F, 2, 4>(xs, stride, K, rows, w, ldw, width, after, acc);
    case 3: return tiles<F, 3, 4>(xs, stride, K, rows, w, ldw, width, after, acc);
    case 4: return tiles<F, 4, 4>(xs, stride, K, rows, w, ldw, width, after, acc);
    case 5: return tiles<F, 5, 2>(xs, stride, K, rows, w, ldw, width, after, acc);
    case 6: return tiles<F, 6, 2>(xs, stride, K, rows, w, ldw, width, after, acc);
    case 7: return tiles<F, 7, 2>(xs, stride, K, rows, w, ldw, width, after, acc);
    default: return tiles<F, 4, 3>(xs, stride, K, rows, w, ldw, width, after, acc);
  }
}

// y[m, n0 : n0 + width] from its 16-lane partial sums `part` (width <= 16; unused slots zero).
inline void finish(const LinearArgs& a, int64_t m, int64_t n0, int width,
                   const __m512 (&part)[16]) {
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
  __m512 sums = agentflash_cpu::lane_sums(part);
  if (a.scale != nullptr) sums = _mm512_mul_ps(sums, _mm512_maskz_loadu_ps(mask, a.scale + n0));
  if (a.bias != nullptr) sums = _mm512_add_ps(sums, _mm512_maskz_loadu_ps(mask, a.bias + n0));
  if (a.residual != nullptr) {
    const __m256i r = _mm256_maskz_loadu_epi16(mask, a.residual + m * a.ldy + n0);
    sums = _mm512_add_ps(sums,
                         _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
  }
  _mm256_mask_storeu_epi16(a.y + m * a.ldy + n0, mask, agentflash_cpu::round_bf16(sums));
}

// Every row of y for W's rows [n0, n1).
template <class F>
void columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  using T = typename F::T;
  const int64_t chunks = (a.K + 31) / 32;
  thread_local std::vector<float> scratch;
  alignas(64) __m512 acc[kRowChunk * kGroup];
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
    const int64_t rows = std::min(a.M - m0, kRowChunk);
    scratch.resize(rows * row_stride(chunks) + 16);  // 64-byte aligned below
    float* xs = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~static_cast<uintptr_t>(63));
    widen_rows<F>(a, m0, m0 + rows, chunks, xs);
    for (int64_t g = n0; g < n1; g += kGroup) {
      const int width = static_cast<int>(std::min<int64_t>(kGroup, n1 - g));
      const T* w = F::rows(a) + g * a.ldw;
      const T* after = g + kGroup < n1 ? w + kGroup * a.ldw : nullptr;
      rows_by_weights<F>(xs, chunks, a.K, rows, w, a.ldw, width, after, acc);
      for (int64_t i = 0; i < rows; ++i) {
        __m512 part[16];
        for (int j = 0; j < 16; ++j)
          part[j] = j < width ? acc[i * kGroup + j] : _mm512_setzero_ps();
        finish(a, m0 + i, g, width, part);
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
