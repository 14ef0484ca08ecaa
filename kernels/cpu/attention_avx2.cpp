// The AVX2 (+FMA) implementation of attention.cpp's `attend_run` (kernels.h), for CPUs without
// native bfloat16 arithmetic: keys, values and queries are widened to float32 in registers.
//
// Keys go in chunks at fixed positions (32 keys at head_dim 64, 16 at 128, 8 above). Each chunk
// is widened once per (run of queries of a sequence, KV head) into a float32 scratch that stays
// in L1, every 16 elements of a key or value split into their even and odd elements
// (simd_avx2.h: widen16); the queries are widened the same way once per run. Per query head and
// chunk: each key's score is one accumulator of 8 lanes taking the even and then the odd
// products of every 16 elements by FMA, 8 keys' accumulators summed across lanes by one fixed
// tree (lane_sums8), scaled (keys it does not see: -inf); one online softmax step for the chunk
// (running maximum and sum, the output rescaled by exp(old - new max)); then the output
// accumulates weight_j * value_j for the chunk's keys in order, in float32. At the end the
// output is divided by the sum and rounded once to bfloat16. That sequence depends only on the
// query, its keys and how many it sees, never on what else is in the call or which thread runs
// it.

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd_avx2.h"

namespace {

using agentflash_cpu::KvSource;
using agentflash_cpu::QueryRun;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Keys per chunk: their widened keys and values (2 * chunk * D floats) stay in L1.
template <int D>
constexpr int chunk_keys() {
  return D <= 64 ? 32 : D <= 128 ? 16 : 8;
}

inline __m256 exp8(__m256 x) { return at::vec::Vectorized<float>(x).exp_u20(); }

// The largest of a vector's 8 lanes, and their sum by one fixed tree.
inline float lane_max(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float lane_sum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// `n` rows of D bfloat16 values widened into `out` (even / odd halves of each 16 elements),
// then zero rows up to `rows`.
template <int D>
inline void widen_rows(const uint16_t* const* src, int n, int rows, float* out) {
  for (int j = 0; j < rows; ++j)
#pragma GCC unroll 16
    for (int c = 0; c < D / 16; ++c) {
      float* dst = out + j * D + 16 * c;
      if (j < n) {
        const agentflash_cpu::Widened v = agentflash_cpu::load_widen16(src[j] + 16 * c);
        _mm256_store_ps(dst, v.even);
        _mm256_store_ps(dst + 8, v.odd);
      } else {
        _mm256_store_ps(dst, _mm256_setzero_ps());
        _mm256_store_ps(dst + 8, _mm256_setzero_ps());
      }
    }
}

constexpr int kKeys = 4;   // keys whose scores a group of rows accumulates at once
constexpr int kRows = 3;   // rows in a group: 3 x 4 accumulators, 3 query vectors, 1 key vector
constexpr int kOut = 4;    // output vectors per row a group accumulates at once

// The scores of NR widened query rows with a chunk of KC widened keys: s[r][v] holds keys
// 8v .. 8v+7, scaled, keys from valid[r] on -inf. Each (row, key) pair's products accumulate in
// 8 lanes (the even, then the odd halves of every 16 elements), summed by one fixed tree
// (lane_sums8) per 8 keys. A group loads each query half once for 4 keys and each key half once
// for its NR rows: this CPU kind sustains about one vector load per FMA pair (measured), so
// loads, not FMAs, bound a loop that reloads its operands.
template <int D, int KC, int NR>
__attribute__((always_inline)) inline void group_scores(const float* const (&q)[NR],
                                                        const float* keys, const int (&valid)[NR],
                                                        float scale, __m256 (&s)[NR][KC / 8]) {
  alignas(32) __m256 part[NR][KC];
#pragma GCC unroll 1
  for (int j0 = 0; j0 < KC; j0 += kKeys) {
    __m256 acc[NR][kKeys];
#pragma GCC unroll 3
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < kKeys; ++j) acc[r][j] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int half = 0; half < D / 8; ++half) {  // the even, then the odd half of each 16
      const int at = 16 * (half / 2) + 8 * (half % 2);
      __m256 qv[NR];
#pragma GCC unroll 3
      for (int r = 0; r < NR; ++r) qv[r] = _mm256_load_ps(q[r] + at);
#pragma GCC unroll 4
      for (int j = 0; j < kKeys; ++j) {
        const __m256 kv = _mm256_load_ps(keys + (j0 + j) * D + at);
#pragma GCC unroll 3
        for (int r = 0; r < NR; ++r) acc[r][j] = _mm256_fmadd_ps(qv[r], kv, acc[r][j]);
      }
    }
#pragma GCC unroll 3
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < kKeys; ++j) part[r][j0 + j] = acc[r][j];
  }
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < KC / 8; ++v) {
      const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
          _mm256_set1_epi32(valid[r] - 8 * v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      const __m256 sums = agentflash_cpu::lane_sums8(
          reinterpret_cast<const __m256(&)[8]>(part[r][8 * v]));
      s[r][v] = _mm256_blendv_ps(_mm256_set1_ps(-kInf),
                                 _mm256_mul_ps(sums, _mm256_set1_ps(scale)), live);
    }
}

// The outputs of NR rows after a chunk: out[r] = out[r] * rescale[r], then + w[r][j] * value_j
// for j = 0 .. KC - 1 in order. A group loads each value vector once for its NR rows.
template <int D, int KC, int NR>
__attribute__((always_inline)) inline void group_values(const float (&w)[NR][KC],
                                                        const float (&rescale)[NR],
                                                        const float* values,
                                                        float* const (&out)[NR]) {
#pragma GCC unroll 1
  for (int u0 = 0; u0 < D / 8; u0 += kOut) {
    __m256 o[NR][kOut];
#pragma GCC unroll 3
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < kOut; ++u)
        o[r][u] = _mm256_mul_ps(_mm256_load_ps(out[r] + 8 * (u0 + u)),
                                _mm256_set1_ps(rescale[r]));
#pragma GCC unroll 2
    for (int j = 0; j < KC; ++j) {
      __m256 p[NR];
#pragma GCC unroll 3
      for (int r = 0; r < NR; ++r) p[r] = _mm256_broadcast_ss(&w[r][j]);
#pragma GCC unroll 4
      for (int u = 0; u < kOut; ++u) {
        const __m256 vv = _mm256_load_ps(values + j * D + 8 * (u0 + u));
#pragma GCC unroll 3
        for (int r = 0; r < NR; ++r) o[r][u] = _mm256_fmadd_ps(p[r], vv, o[r][u]);
      }
    }
#pragma GCC unroll 3
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < kOut; ++u) _mm256_store_ps(out[r] + 8 * (u0 + u), o[r][u]);
  }
}

// NR rows' state after a chunk of KC keys (row i sees the first valid[i] of them): scores, one
// online softmax step per row (running maximum and sum; the output rescaled by
// exp(old - new max)), the values weighted (unseen keys weigh 0).
template <int D, int KC, int NR>
__attribute__((always_inline)) inline void update_rows(const float* const (&q)[NR],
                                                       const int (&valid)[NR],
                                                       float* (&max)[NR], float* (&sum)[NR],
                                                       float* const (&out)[NR],
                                                       const float* keys, const float* values,
                                                       float scale) {
  __m256 s[NR][KC / 8];
  group_scores<D, KC, NR>(q, keys, valid, scale, s);
  alignas(32) float w[NR][KC];
  float rescale[NR];
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r) {
    __m256 top = s[r][0];
#pragma GCC unroll 4
    for (int v = 1; v < KC / 8; ++v) top = _mm256_max_ps(top, s[r][v]);
    const float new_max = std::max(*max[r], lane_max(top));
    const __m256 m = _mm256_set1_ps(new_max);
    rescale[r] = _mm256_cvtss_f32(exp8(_mm256_set1_ps(*max[r] - new_max)));  // exp(0) = 1
    __m256 total = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int v = 0; v < KC / 8; ++v) {
      const __m256 p = exp8(_mm256_sub_ps(s[r][v], m));
      _mm256_store_ps(&w[r][8 * v], p);
      total = _mm256_add_ps(total, p);
    }
    *max[r] = new_max;
    *sum[r] = *sum[r] * rescale[r] + lane_sum(total);
  }
  group_values<D, KC, NR>(w, rescale, values, out);
}

// The running state of a run's query heads: row r is query t0 + r / G, head r % G; q and out
// are laid out as widen_rows lays out a row.
struct Rows {
  std::vector<float> max, sum, q, out;  // [R], [R], [R * D], [R * D] (+ alignment)
  float* qs;
  float* outs;
  void reset(int64_t rows, int64_t dim) {
    max.assign(rows, -kInf);
    sum.assign(rows, 0.f);
    q.resize(rows * dim + 8);
    out.assign(rows * dim + 8, 0.f);
    qs = aligned(q);
    outs = aligned(out);
  }
  static float* aligned(std::vector<float>& v) {
    return reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(v.data()) + 31) & ~static_cast<uintptr_t>(31));
  }
};

// update_rows for the NR rows listed first in `rows` (of at least NR) of the state.
template <int D, int KC, int NR>
inline void update_group(Rows& st, const int64_t* rows, const int* valid_of, const float* keys,
                         const float* values, float scale) {
  const float* q[NR];
  float* out[NR];
  float* max[NR];
  float* sum[NR];
  int valid[NR];
  for (int i = 0; i < NR; ++i) {
    q[i] = st.qs + rows[i] * D;
    out[i] = st.outs + rows[i] * D;
    max[i] = &st.max[rows[i]];
    sum[i] = &st.sum[rows[i]];
    valid[i] = valid_of[i];
  }
  update_rows<D, KC, NR>(q, valid, max, sum, out, keys, values, scale);
}

template <int D>
void attend(const KvSource& src, const QueryRun& run) {
  constexpr int KC = chunk_keys<D>();
  alignas(32) float kchunk[KC * D];
  alignas(32) float vchunk[KC * D];
  const int64_t t0 = run.t0, t1 = run.t1, g = run.g, G = run.G;
  const int64_t* keys = run.keys;
  thread_local Rows st;
  const int64_t longest = run.longest();
  st.reset((t1 - t0) * G, D);
  for (int64_t t = t0; t < t1; ++t)  // the run's query heads, widened once
    for (int64_t h = 0; h < G; ++h) {
      const uint16_t* q = run.q + (t * run.Hq + g * G + h) * D;
      widen_rows<D>(&q, 1, 1, st.qs + ((t - t0) * G + h) * D);
    }
  agentflash_cpu::KeyChunks<KC> chunks(src, g, D, longest);
  for (int64_t k0 = 0; k0 < longest; k0 += KC) {
    const int in_chunk = chunks.advance(k0);
    widen_rows<D>(chunks.kr, in_chunk, KC, kchunk);
    widen_rows<D>(chunks.vr, in_chunk, KC, vchunk);
    // every row that sees any of this chunk's keys, kRows at a time (rows that see none are
    // left untouched, as in a call without them)
    int64_t group[kRows];
    int valid[kRows];
    int n = 0;
    for (int64_t t = t0; t < t1; ++t) {
      if (keys[t] <= k0) continue;
      for (int64_t h = 0; h < G; ++h) {
        group[n] = (t - t0) * G + h;
        valid[n] = static_cast<int>(std::min<int64_t>(KC, keys[t] - k0));
        if (++n == kRows) {
          update_group<D, KC, kRows>(st, group, valid, kchunk, vchunk, run.scale);
          n = 0;
        }
      }
    }
    if (n == 2) update_group<D, KC, 2>(st, group, valid, kchunk, vchunk, run.scale);
    if (n == 1) update_group<D, KC, 1>(st, group, valid, kchunk, vchunk, run.scale);
  }
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = (t - t0) * G + h;
      const __m256 total = _mm256_set1_ps(st.sum[r]);
      const float* o = st.outs + r * D;
      uint16_t* dst = run.out + (t * run.Hq + g * G + h) * D;
      for (int c = 0; c < D / 16; ++c)
        agentflash_cpu::store_bf16_16(dst + 16 * c,
                                      _mm256_div_ps(_mm256_load_ps(o + 16 * c), total),
                                      _mm256_div_ps(_mm256_load_ps(o + 16 * c + 8), total));
    }
}

}  // namespace

namespace agentflash_cpu {

void attend_run(int64_t head_dim, const KvSource& src, const QueryRun& run) {
  with_head_dim(head_dim, [&](auto dim) { attend<decltype(dim)::value>(src, run); });
}

}  // namespace agentflash_cpu
