// The AVX2 (+FMA) implementation of linear.cpp's `linear_columns` (kernels.h), for CPUs without
// native bfloat16 arithmetic: weights stay bfloat16 in memory (half the bytes of float32) and
// are widened to float32 in registers.
//
// Every output y[m, n] is one dot product of x's row m and W's row n over K in 16-element
// chunks: each chunk of both rows is split exactly into its even and odd elements as float32
// (simd_avx2.h: widen16, two instructions), and one 8-lane accumulator takes the even products,
// then the odd products, of every chunk by FMA (the last chunk zero-padded). Its 8 lanes are
// added by one fixed tree (lane_sums8), then the bias and a residual are added and the result
// rounded once to bfloat16. That sequence is the same for every output whatever M,
// the tile it is computed in or the thread that computes it.
//
// How it is fast: a decode step reads each weight once, so one row of x streams W from memory.
// Each thread takes a contiguous run of W's rows and reads it front to back, one row at a time
// (a single sequential stream, prefetched 1 KB ahead: measured on a 2-core EPYC without
// AVX512, 10-13 GB/s where interleaving 8 rows' chunks read 7-9). x's rows are widened once per
// call into a float32 scratch; up to 6 of them go through a W row together (12 accumulators of
// the 16 registers), the later ones reading it from L1.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd_avx2.h"

namespace {

using agentflash_cpu::LinearArgs;
using agentflash_cpu::Widened;

constexpr int kGroup = 8;          // W rows whose outputs are reduced together (lane_sums8)
constexpr int kMaxRows = 2;        // a tile's rows of x ...
constexpr int kMaxCols = 3;        // ... by rows of W: 6 accumulators, 6 widened W vectors
constexpr int64_t kRowChunk = 32;  // x rows per pass over a thread's rows of W
constexpr int64_t kAhead = 512;    // elements of W prefetched ahead of the one being read

// Floats between widened rows of x: their chunks plus one cache line, so that rows are never a
// multiple of 4 KB apart (the up to 12 rows a tile reads at once would share L1 sets).
inline int64_t row_stride(int64_t chunks) { return chunks * 16 + 16; }

// x's rows m0 .. m1 - 1 widened into `out`: per row `chunks` chunks of [even 8 | odd 8]
// float32, the last zero-padded.
void widen_rows(const LinearArgs& a, int64_t m0, int64_t m1, int64_t chunks, float* out) {
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* x = a.x + m * a.ldx;
    float* dst = out + (m - m0) * row_stride(chunks);
    for (int64_t c = 0; c < chunks; ++c) {
      Widened v;
      if ((c + 1) * 16 <= a.K) {
        v = agentflash_cpu::load_widen16(x + 16 * c);
      } else {
        alignas(32) uint16_t tail[16] = {};
        std::memcpy(tail, x + 16 * c, (a.K - 16 * c) * sizeof(uint16_t));
        v = agentflash_cpu::load_widen16(tail);
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
// operands. `stream`: prefetch W ahead (its first pass over these rows).
template <int MB, int NB>
void tile(const float* xs, int64_t stride, int64_t chunks, int64_t K, const uint16_t* w,
          int64_t ldw, bool stream, __m256* out) {
  __m256 acc[MB][NB];
#pragma GCC unroll 3
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  auto step = [&](int64_t c, const uint16_t* const (&chunk)[NB]) __attribute__((always_inline)) {
    Widened v[NB];
#pragma GCC unroll 3
    for (int j = 0; j < NB; ++j) v[j] = agentflash_cpu::load_widen16(chunk[j]);
#pragma GCC unroll 3
    for (int i = 0; i < MB; ++i) {
      const float* xr = xs + i * stride + c * 16;
      const __m256 even = _mm256_load_ps(xr);
#pragma GCC unroll 3
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(even, v[j].even, acc[i][j]);
      const __m256 odd = _mm256_load_ps(xr + 8);
#pragma GCC unroll 3
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(odd, v[j].odd, acc[i][j]);
    }
  };
  const int64_t full = K / 16;
  for (int64_t c = 0; c < full; ++c) {
    const uint16_t* chunk[NB];
#pragma GCC unroll 3
    for (int j = 0; j < NB; ++j) {
      chunk[j] = w + j * ldw + 16 * c;
      if (stream && (c & 1) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(chunk[j] + kAhead), _MM_HINT_T0);
    }
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
#pragma GCC unroll 3
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < NB; ++j) out[i * kGroup + j] = acc[i][j];
}

// A tile of MB rows of x by `width` (1..3) rows of W.
template <int MB>
void tile_of(int width, const float* xs, int64_t stride, int64_t chunks, int64_t K,
             const uint16_t* w, int64_t ldw, bool stream, __m256* out) {
  switch (width) {
    case 3: return tile<MB, 3>(xs, stride, chunks, K, w, ldw, stream, out);
    case 2: return tile<MB, 2>(xs, stride, chunks, K, w, ldw, stream, out);
    default: return tile<MB, 1>(xs, stride, chunks, K, w, ldw, stream, out);
  }
}

// The partial sums of every row of the pass (x widened in xs) with W's rows w .. w + width - 1
// (width <= kGroup) into acc[i * kGroup + j]. One row of x (a decode step) reads W one row at a
// time front to back; more rows go in tiles of 2 x rows by 3 W rows.
void rows_by_weights(const float* xs, int64_t chunks, int64_t K, int64_t rows,
                     const uint16_t* w, int64_t ldw, int width, __m256* acc) {
  const int64_t stride = row_stride(chunks);
  if (rows == 1) {
    for (int j = 0; j < width; ++j) tile<1, 1>(xs, stride, chunks, K, w + j * ldw, ldw, true,
                                               acc + j);
    return;
  }
  for (int j = 0; j < width; j += kMaxCols) {
    const int cols = std::min(kMaxCols, width - j);
    int64_t i = 0;
    for (; i + kMaxRows <= rows; i += kMaxRows)
      tile_of<kMaxRows>(cols, xs + i * stride, stride, chunks, K, w + j * ldw, ldw, i == 0,
                        acc + i * kGroup + j);
    const float* x = xs + i * stride;
    __m256* out = acc + i * kGroup + j;
    if (rows - i == 2)
      tile_of<2>(cols, x, stride, chunks, K, w + j * ldw, ldw, i == 0, out);
    else if (rows - i == 1)
      tile_of<1>(cols, x, stride, chunks, K, w + j * ldw, ldw, i == 0, out);
  }
}

// y[m, n0 : n0 + width] from its 8-lane partial sums `part` (width <= 8; unused slots zero):
// each output's lanes summed, plus its bias and residual, rounded to bfloat16.
void finish(const LinearArgs& a, int64_t m, int64_t n0, int width, const __m256 (&part)[8]) {
  __m256 sums = agentflash_cpu::lane_sums8(part);
  uint16_t* y = a.y + m * a.ldy + n0;
  if (width == 8) {
    if (a.bias != nullptr) sums = _mm256_add_ps(sums, _mm256_loadu_ps(a.bias + n0));
    if (a.residual != nullptr)
      sums = _mm256_add_ps(sums, agentflash_cpu::load_widen8(a.residual + m * a.ldy + n0));
    agentflash_cpu::store_bf16_8(y, sums);
    return;
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, sums);
  for (int j = 0; j < width; ++j) {
    if (a.bias != nullptr) out[j] += a.bias[n0 + j];
    if (a.residual != nullptr) {
      const uint32_t bits = static_cast<uint32_t>(a.residual[m * a.ldy + n0 + j]) << 16;
      float r;
      std::memcpy(&r, &bits, sizeof r);
      out[j] += r;
    }
    y[j] = agentflash_cpu::round_bf16(out[j]);
  }
}

}  // namespace

namespace agentflash_cpu {

void linear_columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  const int64_t chunks = (a.K + 15) / 16;
  thread_local std::vector<float> scratch;
  alignas(32) __m256 acc[kRowChunk * kGroup];
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
    const int64_t rows = std::min(a.M - m0, kRowChunk);
    scratch.resize(rows * row_stride(chunks) + 8);  // 32-byte aligned below
    float* xs = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~static_cast<uintptr_t>(31));
    widen_rows(a, m0, m0 + rows, chunks, xs);
    for (int64_t g = n0; g < n1; g += kGroup) {
      const int width = static_cast<int>(std::min<int64_t>(kGroup, n1 - g));
      rows_by_weights(xs, chunks, a.K, rows, a.w + g * a.ldw, a.ldw, width, acc);
      for (int64_t i = 0; i < rows; ++i) {
        __m256 part[8];
        for (int j = 0; j < 8; ++j)
          part[j] = j < width ? acc[i * kGroup + j] : _mm256_setzero_ps();
        finish(a, m0 + i, g, width, part);
      }
    }
  }
}

}  // namespace agentflash_cpu
