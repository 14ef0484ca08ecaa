// The AVX2 (+FMA) linear kernel, for weights widened to float32 in registers: bfloat16 weights
// (avx2/linear.cpp) and int8 weights with a float32 scale per row (avx2/linear_int8.cpp), on
// CPUs without native bf16 arithmetic. A format F says how 16 elements of a W row and of an x
// row become two float32 vectors (the same split for both, so that their products pair up) and
// where W's rows are.
//
// Every output y[m, n] is one dot product of x's row m and W's row n over K in 16-element
// chunks: one 8-lane accumulator takes the products of the first, then of the second vector of
// every chunk by FMA (the last chunk zero-padded). Its 8 lanes are added by one fixed tree
// (lane_sums8), then multiplied by the row's scale (int8), the bias and a residual added, and
// the result rounded once to bfloat16. That sequence is the same for every output whatever M,
// the tile it is computed in or the thread that computes it.
//
// How it is fast: a decode step reads each weight once, so one row of x streams W from memory.
// Each thread takes a contiguous run of W's rows and reads it front to back, one row at a time
// (a single sequential stream, prefetched 1 KB ahead: measured on a 2-core EPYC without
// AVX512: 12-14 GB/s, a plain read's speed, where interleaving 8 rows' chunks read 7-9). x's
// rows are widened once per call into a float32 scratch. More rows (a verify block, a prefill
// chunk) are compute-bound. int8 weights: tiles of 3 x rows by 2 W rows (12 accumulators, two
// chains). bfloat16 weights: tiles of 4 x rows by 3 W rows, widening one half of each W chunk
// at a time (tile_halves): 12 accumulators, 3 W halves and one x vector fill the 16 registers,
// each W half serves 4 FMAs and each x vector 3 (measured on a 2-core EPYC without AVX512, 16
// rows: 127-157 GFLOP/s at the 11m and 0.6B shapes, where 2 x 3 tiles of whole chunks reached
// 110-124); a block's last 1-3 rows take one tile of that many rows, not one pass each. While
// the tiles compute a group of W's rows, they ask the memory for the next group (Lookahead).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/kernels.h"
#include "simd.h"

namespace agentflash_cpu::avx2 {

constexpr int kGroup = 8;          // W rows whose outputs are reduced together (lane_sums8)
constexpr int64_t kRowChunk = 32;  // x rows per pass over a thread's rows of W
constexpr int64_t kAhead = 1024;   // bytes of W prefetched ahead of the one being read

// Floats between widened rows of x: their chunks plus one cache line, so that rows are never a
// multiple of 4 KB apart (the up to 12 rows a tile reads at once would share L1 sets).
inline int64_t row_stride(int64_t chunks) { return chunks * 16 + 16; }

// Asks the memory for the next group of W's rows, a few cache lines at each step of the tiles
// that compute this group, so that they arrive while this group computes (a verify block's
// tiles otherwise wait on W at the start of every group: measured 2.6 -> 3.5-4.3 ms for the 11m
// linears of a 16-row block once their 22 MB no longer sit in L2).
struct Lookahead {
  const char* row = nullptr;  // the row being fetched
  int64_t row_bytes = 0;      // from one row to the next
  int64_t line = 0, lines = 0;  // the next line of `row`, and lines a row
  int64_t rows_left = 0;
  int64_t per_step = 0;

  // Fetch `rows` rows of `bytes` bytes each (row_bytes apart) from `first`, over `steps` steps.
  Lookahead(const void* first, int64_t rows, int64_t bytes, int64_t stride, int64_t steps)
      : row(static_cast<const char*>(first)), row_bytes(stride), lines((bytes + 63) / 64),
        rows_left(rows) {
    per_step = steps > 0 ? (rows * lines + steps - 1) / steps : 0;
  }
  Lookahead() = default;

  void step() {
    for (int64_t i = 0; i < per_step && rows_left > 0; ++i) {
      _mm_prefetch(row + 64 * line, _MM_HINT_T0);
      if (++line == lines) {
        line = 0;
        row += row_bytes;
        --rows_left;
      }
    }
  }
};

// x's rows m0 .. m1 - 1 widened into `out`: per row `chunks` chunks of 16 as F splits them
// (two float32 vectors), the last zero-padded.
template <class F>
void widen_rows(const LinearArgs& a, int64_t m0, int64_t m1, int64_t chunks, float* out) {
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* x = a.x + m * a.ldx;
    float* dst = out + (m - m0) * row_stride(chunks);
    for (int64_t c = 0; c < chunks; ++c) {
      Widened v;
      if ((c + 1) * 16 <= a.K) {
        v = F::activations(x + 16 * c);
      } else {
        alignas(32) uint16_t tail[16] = {};
        std::memcpy(tail, x + 16 * c, (a.K - 16 * c) * sizeof(uint16_t));
        v = F::activations(tail);
      }
      _mm256_store_ps(dst + 16 * c, v.even);
      _mm256_store_ps(dst + 16 * c + 8, v.odd);
    }
  }
}

// out[i * kGroup + j] = the 8-lane partial sums of x row i (of the MB from xs, `stride` floats
// apart) . W row j (of the NB from w, ldw apart). Per chunk, every W row is widened once and
// every x half loaded once, each used for NB or MB FMAs: this CPU kind sustains about one
// vector load per FMA pair (measured), so loads, not FMAs, bound a tile that reloads its
// operands. `stream`: prefetch W ahead (its first pass over these rows). kLookahead: step
// `ahead` (then never null) once a chunk; a decode row (one x row) streams W itself.
template <class F, int MB, int NB, bool kLookahead = true>
void tile(const float* xs, int64_t stride, int64_t chunks, int64_t K, const typename F::T* w,
          int64_t ldw, bool stream, Lookahead* ahead, __m256* out) {
  using T = typename F::T;
  constexpr int kChains = F::kSplit ? 2 : 1;
  __m256 acc[kChains][MB][NB];
#pragma GCC unroll 3
  for (int h = 0; h < kChains; ++h)
#pragma GCC unroll 3
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 3
      for (int j = 0; j < NB; ++j) acc[h][i][j] = _mm256_setzero_ps();
  auto step = [&](int64_t c, const T* const (&chunk)[NB]) __attribute__((always_inline)) {
    Widened v[NB];
#pragma GCC unroll 3
    for (int j = 0; j < NB; ++j) v[j] = F::weights(chunk[j]);
#pragma GCC unroll 3
    for (int i = 0; i < MB; ++i) {
      const float* xr = xs + i * stride + c * 16;
      const __m256 even = _mm256_load_ps(xr);
#pragma GCC unroll 3
      for (int j = 0; j < NB; ++j) acc[0][i][j] = _mm256_fmadd_ps(even, v[j].even, acc[0][i][j]);
      const __m256 odd = _mm256_load_ps(xr + 8);
#pragma GCC unroll 3
      for (int j = 0; j < NB; ++j)
        acc[kChains - 1][i][j] = _mm256_fmadd_ps(odd, v[j].odd, acc[kChains - 1][i][j]);
    }
  };
  const int64_t full = K / 16;
  constexpr int64_t kLine = 64 / (16 * sizeof(T));  // chunks per cache line
  for (int64_t c = 0; c < full; ++c) {
    const T* chunk[NB];
#pragma GCC unroll 3
    for (int j = 0; j < NB; ++j) {
      chunk[j] = w + j * ldw + 16 * c;
      if (stream && c % kLine == 0)
        _mm_prefetch(reinterpret_cast<const char*>(chunk[j]) + kAhead, _MM_HINT_T0);
    }
    if constexpr (kLookahead) ahead->step();
    step(c, chunk);
  }
  if (full < chunks) {  // the last chunk, zero-padded
    alignas(32) T tail[NB][16] = {};
    const T* chunk[NB];
    for (int j = 0; j < NB; ++j) {
      std::memcpy(tail[j], w + j * ldw + 16 * full, (K - 16 * full) * sizeof(T));
      chunk[j] = tail[j];
    }
    step(full, chunk);
  }
#pragma GCC unroll 3
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NB; ++j)
      out[i * kGroup + j] = F::kSplit ? _mm256_add_ps(acc[0][i][j], acc[kChains - 1][i][j])
                                      : acc[0][i][j];
}

// tile's sums for bfloat16 weights and MB > 1, one half of each chunk at a time: W's chunks
// are loaded once per half (the second load hits L1) and only that half widened (even: a left
// shift; odd: right then left, no constant register), so MB x NB = 12 accumulators, NB W
// halves and one x vector fit AVX2's 16 registers. Each accumulator still takes the even, then
// the odd products of every chunk in order: the sums are tile's, bit for bit.
template <int MB, int NB>
void tile_halves(const float* xs, int64_t stride, int64_t chunks, int64_t K, const uint16_t* w,
                 int64_t ldw, bool stream, Lookahead* ahead, __m256* out) {
  __m256 acc[MB][NB];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  auto step = [&](int64_t c, const uint16_t* const (&chunk)[NB]) __attribute__((always_inline)) {
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m256 v[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk[j]));
        v[j] = _mm256_castsi256_ps(
            half == 0 ? _mm256_slli_epi32(raw, 16)
                      : _mm256_slli_epi32(_mm256_srli_epi32(raw, 16), 16));
      }
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        const __m256 x = _mm256_load_ps(xs + i * stride + c * 16 + 8 * half);
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(x, v[j], acc[i][j]);
      }
    }
  };
  const int64_t full = K / 16;
  for (int64_t c = 0; c < full; ++c) {
    const uint16_t* chunk[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      chunk[j] = w + j * ldw + 16 * c;
      if (stream && c % 2 == 0)  // a cache line holds 2 chunks
        _mm_prefetch(reinterpret_cast<const char*>(chunk[j]) + kAhead, _MM_HINT_T0);
    }
    ahead->step();
    step(c, chunk);
  }
  if (full < chunks) {  // the last chunk, zero-padded
    alignas(32) uint16_t tail[NB][16] = {};
    const uint16_t* chunk[NB];
    for (int j = 0; j < NB; ++j) {
      std::memcpy(tail[j], w + j * ldw + 16 * full, (K - 16 * full) * sizeof(uint16_t));
      chunk[j] = tail[j];
    }
    step(full, chunk);
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) out[i * kGroup + j] = acc[i][j];
}

// A tile of MB rows of x by `width` (1..3) rows of W.
template <class F, int MB>
void tile_of(int width, const float* xs, int64_t stride, int64_t chunks, int64_t K,
             const typename F::T* w, int64_t ldw, bool stream, Lookahead* ahead, __m256* out) {
  if constexpr (F::kHalves && MB > 1) {
    switch (width) {
      case 3: return tile_halves<MB, 3>(xs, stride, chunks, K, w, ldw, stream, ahead, out);
      case 2: return tile_halves<MB, 2>(xs, stride, chunks, K, w, ldw, stream, ahead, out);
      default: return tile_halves<MB, 1>(xs, stride, chunks, K, w, ldw, stream, ahead, out);
    }
  }
  switch (width) {
    case 3:
      if constexpr (F::kCols >= 3)
        return tile<F, MB, 3>(xs, stride, chunks, K, w, ldw, stream, ahead, out);
      [[fallthrough]];
    case 2: return tile<F, MB, 2>(xs, stride, chunks, K, w, ldw, stream, ahead, out);
    default: return tile<F, MB, 1>(xs, stride, chunks, K, w, ldw, stream, ahead, out);
  }
}

// A tile of `rows` (1 .. F::kRows) rows of x by `width` rows of W.
template <class F>
void tile_rows(int64_t rows, int width, const float* xs, int64_t stride, int64_t chunks,
               int64_t K, const typename F::T* w, int64_t ldw, bool stream, Lookahead* ahead,
               __m256* out) {
  static_assert(F::kRows <= 4);
  switch (rows) {
    case 1: return tile_of<F, 1>(width, xs, stride, chunks, K, w, ldw, stream, ahead, out);
    case 2: return tile_of<F, 2>(width, xs, stride, chunks, K, w, ldw, stream, ahead, out);
    case 3:
      if constexpr (F::kRows >= 3)
        return tile_of<F, 3>(width, xs, stride, chunks, K, w, ldw, stream, ahead, out);
      break;
    default:
      if constexpr (F::kRows >= 4)
        return tile_of<F, 4>(width, xs, stride, chunks, K, w, ldw, stream, ahead, out);
      break;
  }
}

// The partial sums of every row of the pass (x widened in xs) with W's rows w .. w + width - 1
// (width <= kGroup) into acc[i * kGroup + j]. One row of x (a decode step) reads W one row at a
// time front to back; more rows go in tiles of F::kRows x rows by F::kCols W rows.
template <class F>
void rows_by_weights(const float* xs, int64_t chunks, int64_t K, int64_t rows,
                     const typename F::T* w, int64_t ldw, int width, Lookahead* ahead,
                     __m256* acc) {
  const int64_t stride = row_stride(chunks);
  if (rows == 1) {
    for (int j = 0; j < width; ++j)
      tile<F, 1, 1, false>(xs, stride, chunks, K, w + j * ldw, ldw, true, nullptr, acc + j);
    return;
  }
  for (int j = 0; j < width; j += F::kCols) {
    const int cols = std::min(F::kCols, width - j);
    for (int64_t i = 0; i < rows; i += F::kRows)  // the last tile takes the rows left
      tile_rows<F>(std::min<int64_t>(F::kRows, rows - i), cols, xs + i * stride, stride, chunks,
                   K, w + j * ldw, ldw, i == 0, ahead, acc + i * kGroup + j);
  }
}

// y[m, n0 : n0 + width] from its 8-lane partial sums `part` (width <= 8; unused slots zero):
// each output's lanes summed, times its scale (int8 weights), plus its bias and residual,
// rounded to bfloat16.
inline void finish(const LinearArgs& a, int64_t m, int64_t n0, int width,
                   const __m256 (&part)[8]) {
  __m256 sums = lane_sums8(part);
  uint16_t* y = a.y + m * a.ldy + n0;
  if (width == 8) {
    if (a.scale != nullptr) sums = _mm256_mul_ps(sums, _mm256_loadu_ps(a.scale + n0));
    if (a.bias != nullptr) sums = _mm256_add_ps(sums, _mm256_loadu_ps(a.bias + n0));
    if (a.residual != nullptr)
      sums = _mm256_add_ps(sums, load_widen8(a.residual + m * a.ldy + n0));
    store_bf16_8(y, sums);
    return;
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, sums);
  for (int j = 0; j < width; ++j) {
    if (a.scale != nullptr) out[j] *= a.scale[n0 + j];
    if (a.bias != nullptr) out[j] += a.bias[n0 + j];
    if (a.residual != nullptr) {
      const uint32_t bits = static_cast<uint32_t>(a.residual[m * a.ldy + n0 + j]) << 16;
      float r;
      std::memcpy(&r, &bits, sizeof r);
      out[j] += r;
    }
    y[j] = round_bf16(out[j]);
  }
}

// Every row of y for W's rows [n0, n1) (F::row: where row n of W is).
template <class F>
void columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  const int64_t chunks = (a.K + 15) / 16;
  thread_local std::vector<float> scratch;
  alignas(32) __m256 acc[kRowChunk * kGroup];
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
    const int64_t rows = std::min(a.M - m0, kRowChunk);
    scratch.resize(rows * row_stride(chunks) + 8);  // 32-byte aligned below
    float* xs = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~static_cast<uintptr_t>(31));
    widen_rows<F>(a, m0, m0 + rows, chunks, xs);
    for (int64_t g = n0; g < n1; g += kGroup) {
      const int width = static_cast<int>(std::min<int64_t>(kGroup, n1 - g));
      Lookahead ahead;  // rows > 1: the next group's W, over this group's tile steps
      if (rows > 1 && g + kGroup < n1) {
        const int64_t tiles = ((width + F::kCols - 1) / F::kCols) *
                              ((rows + F::kRows - 1) / F::kRows);
        ahead = Lookahead(F::row(a, g + kGroup), std::min<int64_t>(kGroup, n1 - g - kGroup),
                          a.K * static_cast<int64_t>(sizeof(typename F::T)),
                          a.ldw * static_cast<int64_t>(sizeof(typename F::T)), tiles * (a.K / 16));
      }
      rows_by_weights<F>(xs, chunks, a.K, rows, F::row(a, g), a.ldw, width, &ahead, acc);
      for (int64_t i = 0; i < rows; ++i) {
        __m256 part[8];
        for (int j = 0; j < 8; ++j)
          part[j] = j < width ? acc[i * kGroup + j] : _mm256_setzero_ps();
        finish(a, m0 + i, g, width, part);
      }
    }
  }
}

}  // namespace agentflash_cpu::avx2
