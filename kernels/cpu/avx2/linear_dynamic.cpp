// The AVX2 implementation of common/linear_op.cpp's `linear_int8_dynamic_columns` (kernels.h): int8
// weights times x's rows quantized on the fly to 16-bit integers (avx512/linear_dynamic.cpp says
// how and why), 16-element chunks: a chunk of a weight row widened once to 16-bit, each x row
// one `vpmaddwd` + `vpaddd` (8 int32 lanes), each output's lanes added by one fixed tree
// (avx2/simd.h: lane_reduce8). Tiles of 2 x rows by 4 W rows (8 accumulators in the 16
// registers).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/kernels.h"
#include "simd.h"

namespace {

using agentflash_cpu::LinearArgs;

constexpr int kGroup = 8;          // W rows whose outputs are reduced together
constexpr int kCols = 4;           // W rows a tile
constexpr int64_t kRowChunk = 32;  // x rows per pass over a thread's rows of W

inline int64_t row_stride(int64_t chunks) { return chunks * 16 + 32; }  // int16 elements

inline __m256 add_int(__m256 a, __m256 b) {
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
}

inline float widen_one(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// x's rows m0 .. m1 - 1 as 16-bit integers (`chunks` of 16 a row, zero-padded) and their steps.
void quantize_rows(const LinearArgs& a, int64_t m0, int64_t m1, int64_t chunks, int16_t* out,
                   float* steps) {
  const float levels = static_cast<float>(agentflash_cpu::dynamic_levels(a.K));
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* x = a.x + m * a.ldx;
    __m256 most = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= a.K; k += 8)
      most = _mm256_max_ps(most, _mm256_andnot_ps(sign, agentflash_cpu::load_widen8(x + k)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, most);
    float amax = 0.f;
    for (float v : lanes) amax = std::max(amax, v);
    for (; k < a.K; ++k) amax = std::max(amax, std::abs(widen_one(x[k])));
    const float inv = amax > 0.f ? levels / amax : 0.f;
    steps[m - m0] = amax / levels;
    int16_t* dst = out + (m - m0) * row_stride(chunks);
    k = 0;
    for (; k + 8 <= a.K; k += 8) {
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(agentflash_cpu::load_widen8(x + k),
                                                         _mm256_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k),
                       _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
    }
    for (; k < chunks * 16; ++k)  // the tail as the vector path rounds it (to nearest even)
      dst[k] = k < a.K ? static_cast<int16_t>(std::nearbyint(widen_one(x[k]) * inv)) : 0;
  }
}

// out[i * kGroup + j] = the 8 int32 lanes of x row i (of MB) . W row j (of NB).
template <int MB, int NB>
void tile(const int16_t* xs, int64_t stride, int64_t K, const int8_t* w, int64_t ldw,
          __m256i* out) {
  __m256i acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
  const int64_t full = K / 16;
  auto step = [&](int64_t c, const __m256i (&wv)[NB]) __attribute__((always_inline)) {
#pragma GCC unroll 2
    for (int i = 0; i < MB; ++i) {
      const __m256i x =
          _mm256_load_si256(reinterpret_cast<const __m256i*>(xs + i * stride + 16 * c));
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j)
        acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(x, wv[j]));
    }
  };
  for (int64_t c = 0; c < full; ++c) {
    __m256i wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j)
      wv[j] = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * ldw + 16 * c)));
    step(c, wv);
  }
  if (full * 16 < K) {  // the last chunk, zero-padded
    __m256i wv[NB];
    for (int j = 0; j < NB; ++j) {
      alignas(16) int8_t tail[16] = {};
      std::copy(w + j * ldw + 16 * full, w + j * ldw + K, tail);
      wv[j] = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
    }
    step(full, wv);
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * kGroup + j] = acc[i][j];
}

template <int MB>
void rows_by_weights(const int16_t* xs, int64_t stride, int64_t K, const int8_t* w, int64_t ldw,
                     int width, __m256i* acc) {
  int j = 0;
  for (; j + kCols <= width; j += kCols) tile<MB, kCols>(xs, stride, K, w + j * ldw, ldw, acc + j);
  for (; j < width; ++j) tile<MB, 1>(xs, stride, K, w + j * ldw, ldw, acc + j);
}

}  // namespace

namespace agentflash_cpu {

void linear_int8_dynamic_columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  const int64_t chunks = (a.K + 15) / 16;
  const int64_t stride = row_stride(chunks);
  thread_local std::vector<int16_t> scratch;
  alignas(32) __m256i acc[kRowChunk * kGroup];
  float steps[kRowChunk];
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
    const int64_t rows = std::min(a.M - m0, kRowChunk);
    scratch.resize(rows * stride + 16);  // 32-byte aligned below
    int16_t* xs = reinterpret_cast<int16_t*>(
        (reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~static_cast<uintptr_t>(31));
    quantize_rows(a, m0, m0 + rows, chunks, xs, steps);
    for (int64_t g = n0; g < n1; g += kGroup) {
      const int width = static_cast<int>(std::min<int64_t>(kGroup, n1 - g));
      const int8_t* w = a.qw + g * a.ldw;
      int64_t i = 0;
      for (; i + 2 <= rows; i += 2)
        rows_by_weights<2>(xs + i * stride, stride, a.K, w, a.ldw, width, acc + i * kGroup);
      if (i < rows)
        rows_by_weights<1>(xs + i * stride, stride, a.K, w, a.ldw, width, acc + i * kGroup);
      for (int64_t r = 0; r < rows; ++r) {
        __m256 part[8];
        for (int j = 0; j < 8; ++j)
          part[j] = j < width ? _mm256_castsi256_ps(acc[r * kGroup + j]) : _mm256_setzero_ps();
        const __m256i sums = _mm256_castps_si256(agentflash_cpu::lane_reduce8<add_int>(part));
        alignas(32) float y[8];
        _mm256_store_ps(y, _mm256_cvtepi32_ps(sums));
        const int64_t m = m0 + r;
        for (int j = 0; j < width; ++j) {
          float v = y[j] * a.scale[g + j] * steps[r];
          if (a.bias != nullptr) v += a.bias[g + j];
          if (a.residual != nullptr) v += widen_one(a.residual[m * a.ldy + g + j]);
          a.y[m * a.ldy + g + j] = agentflash_cpu::round_bf16(v);
        }
      }
    }
  }
}

}  // namespace agentflash_cpu
