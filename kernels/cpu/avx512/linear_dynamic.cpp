// The AVX512 implementation of common/linear_op.cpp's `linear_int8_dynamic_columns` (kernels.h), for both
// AVX512 libraries (with and without AVX512-BF16): int8 weights times x's rows quantized on the
// fly to 16-bit integers, the products summed exactly in int32.
//
// Why: a drafter's linears run on 2-16 rows, where the float32 kernels are bound by their
// multiply-adds (16 a vector) and by widening every weight to float32. Here a 32-element chunk of
// a weight row is widened once to 16-bit (one instruction) and each x row takes one `vpdpwssd`
// (AVX512-VNNI: 32 products summed pairwise into 16 int32 lanes, 2x the float32 rate) or, on
// AVX512 without VNNI, `vpmaddwd` + `vpaddd` (the same numbers). The weight rows' int8 values
// stay as they are; only the activations change: every value of x's row m becomes
// round(x * Q / amax_m) (amax_m: the row's largest |x|; Q = kernels.h's `dynamic_levels(K)`,
// at most 32767 and small enough that no int32 sum can overflow), an error of at most
// amax_m / 2Q: 1.5e-5 of the row's largest value at Q = 32767 (K up to 512), 9e-5 at Q = 5461
// (K = 3072), where bfloat16 itself rounds every value by up to 2^-9 of its size.
//
// Every output y[m, n] = (sum over K of q_x[m, k] * q_w[n, k]) * (amax_m / Q) * scale[n]
// (+ bias[n]) (+ residual[m, n]), rounded once to bfloat16: the integer sum is exact, its 16
// lanes added by one fixed tree (avx512/simd.h: lane_reduce), so y depends on its x row and W row
// alone, whatever else is in the call, the tile or the thread.
//
// Tiles: up to 4 x rows by 4 W rows (16 accumulators), 1-2 rows by 8 W rows (8-16: a single
// row's chains must not wait on vpdpwssd's 5-cycle latency).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/kernels.h"
#include "simd.h"

namespace {

using agentflash_cpu::LinearArgs;

constexpr int kGroup = 16;         // W rows whose outputs are reduced together
constexpr int64_t kRowChunk = 32;  // x rows per pass over a thread's rows of W

// int16 elements between quantized rows of x: their chunks plus one cache line (rows never a
// multiple of 4 KB apart).
inline int64_t row_stride(int64_t chunks) { return chunks * 32 + 32; }

inline __mmask32 tail_mask(int64_t n) { return static_cast<__mmask32>((uint64_t{1} << n) - 1); }

// acc + the pairwise sums of x * w's 16-bit products (exact in int32).
inline __m512i dot_pairs(__m512i acc, __m512i x, __m512i w) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, x, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}

inline __m512 add_int(__m512 a, __m512 b) {  // lane_reduce's step on int32 lanes
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

inline __m512 widen_bf16_masked(const uint16_t* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// x's rows m0 .. m1 - 1 as 16-bit integers into `out` (`chunks` of 32 a row, zero-padded) and
// each row's step (amax / Q) into `steps`.
void quantize_rows(const LinearArgs& a, int64_t m0, int64_t m1, int64_t chunks, int16_t* out,
                   float* steps) {
  const float levels = static_cast<float>(agentflash_cpu::dynamic_levels(a.K));
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* x = a.x + m * a.ldx;
    __m512 most = _mm512_setzero_ps();
    for (int64_t k = 0; k < a.K; k += 16) {
      const __mmask16 mask = static_cast<__mmask16>(k + 16 <= a.K ? 0xFFFF : (1u << (a.K - k)) - 1);
      most = _mm512_max_ps(most, _mm512_abs_ps(widen_bf16_masked(x + k, mask)));
    }
    const float amax = _mm512_reduce_max_ps(most);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? levels / amax : 0.f);
    steps[m - m0] = amax / levels;
    int16_t* dst = out + (m - m0) * row_stride(chunks);
    for (int64_t k = 0; k < chunks * 32; k += 16) {
      const __mmask16 mask = static_cast<__mmask16>(
          k + 16 <= a.K ? 0xFFFF : (k < a.K ? (1u << (a.K - k)) - 1 : 0));
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(widen_bf16_masked(x + k, mask), inv));
      _mm256_store_si256(reinterpret_cast<__m256i*>(dst + k), _mm512_cvtsepi32_epi16(q));
    }
  }
}

// out[i * kGroup + j] = the 16 int32 lanes of x row i (of the MB from xs) . W row j (of the NB
// from w): per chunk each W row is loaded and widened once, each x chunk loaded once.
template <int MB, int NB>
void tile(const int16_t* xs, int64_t stride, int64_t K, const int8_t* w, int64_t ldw,
          __m512i* out) {
  __m512i acc[MB][NB];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
  auto step = [&](int64_t c, const __m512i (&wv)[NB]) __attribute__((always_inline)) {
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512i x = _mm512_load_si512(xs + i * stride + 32 * c);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = dot_pairs(acc[i][j], x, wv[j]);
    }
  };
  const int64_t full = K / 32;
  for (int64_t c = 0; c < full; ++c) {
    __m512i wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
      wv[j] = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * ldw + 32 * c)));
    step(c, wv);
  }
  if (full * 32 < K) {  // the last chunk (x's is zero-padded)
    __m512i wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
      wv[j] = _mm512_cvtepi8_epi16(
          _mm256_maskz_loadu_epi8(tail_mask(K - 32 * full), w + j * ldw + 32 * full));
    step(full, wv);
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) out[i * kGroup + j] = acc[i][j];
}

// Rows i0 .. i0 + MB - 1 of the pass by W's rows w .. w + width - 1, NB at a time (the last
// ones one at a time).
template <int MB, int NB>
void rows_by_weights(const int16_t* xs, int64_t stride, int64_t K, const int8_t* w, int64_t ldw,
                     int width, __m512i* acc) {
  int j = 0;
  for (; j + NB <= width; j += NB) tile<MB, NB>(xs, stride, K, w + j * ldw, ldw, acc + j);
  for (; j < width; ++j) tile<MB, 1>(xs, stride, K, w + j * ldw, ldw, acc + j);
}

void pass(const int16_t* xs, int64_t stride, int64_t K, int64_t rows, const int8_t* w,
          int64_t ldw, int width, __m512i* acc) {
  if (rows <= 2) {
    if (rows == 1) return rows_by_weights<1, 8>(xs, stride, K, w, ldw, width, acc);
    return rows_by_weights<2, 8>(xs, stride, K, w, ldw, width, acc);
  }
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4)
    rows_by_weights<4, 4>(xs + i * stride, stride, K, w, ldw, width, acc + i * kGroup);
  const int16_t* rest = xs + i * stride;
  __m512i* out = acc + i * kGroup;
  switch (rows - i) {
    case 3: return rows_by_weights<3, 4>(rest, stride, K, w, ldw, width, out);
    case 2: return rows_by_weights<2, 8>(rest, stride, K, w, ldw, width, out);
    case 1: return rows_by_weights<1, 8>(rest, stride, K, w, ldw, width, out);
    default: return;
  }
}

}  // namespace

namespace agentflash_cpu {

void linear_int8_dynamic_columns(const LinearArgs& a, int64_t n0, int64_t n1) {
  const int64_t chunks = (a.K + 31) / 32;
  const int64_t stride = row_stride(chunks);
  thread_local std::vector<int16_t> scratch;
  alignas(64) __m512i acc[kRowChunk * kGroup];
  float steps[kRowChunk];
  for (int64_t m0 = 0; m0 < a.M; m0 += kRowChunk) {
    const int64_t rows = std::min(a.M - m0, kRowChunk);
    scratch.resize(rows * stride + 32);  // 64-byte aligned below
    int16_t* xs = reinterpret_cast<int16_t*>(
        (reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~static_cast<uintptr_t>(63));
    quantize_rows(a, m0, m0 + rows, chunks, xs, steps);
    for (int64_t g = n0; g < n1; g += kGroup) {
      const int width = static_cast<int>(std::min<int64_t>(kGroup, n1 - g));
      pass(xs, stride, a.K, rows, a.qw + g * a.ldw, a.ldw, width, acc);
      const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
      const __m512 scale = _mm512_maskz_loadu_ps(mask, a.scale + g);
      for (int64_t i = 0; i < rows; ++i) {
        __m512 part[16];
        for (int j = 0; j < 16; ++j)
          part[j] = j < width ? _mm512_castsi512_ps(acc[i * kGroup + j]) : _mm512_setzero_ps();
        const __m512i sums = _mm512_castps_si512(agentflash_cpu::lane_reduce<add_int>(part));
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), scale),
                                 _mm512_set1_ps(steps[i]));
        const int64_t m = m0 + i;
        if (a.bias != nullptr) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, a.bias + g));
        if (a.residual != nullptr) {
          const __m256i r = _mm256_maskz_loadu_epi16(mask, a.residual + m * a.ldy + g);
          y = _mm512_add_ps(
              y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
        }
        _mm256_mask_storeu_epi16(a.y + m * a.ldy + g, mask, agentflash_cpu::round_bf16(y));
      }
    }
  }
}

}  // namespace agentflash_cpu
