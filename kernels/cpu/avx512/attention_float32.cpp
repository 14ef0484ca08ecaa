// `attend_all_float32` (kernels.h): common/attention_op.cpp's attention with keys, values and
// queries widened to float32, 16 lanes a register. The avx512 set's only attention (CPUs
// without native bfloat16 arithmetic: Intel Skylake-SP to Ice Lake), and the one the
// avx512-bf16 set takes where float32 multiply-adds outrun its `vdpbf16ps` (cpu_ops.
// prefer_float32). One task per (run of queries, KV head), split over threads.
//
// Keys go in blocks of 16 at fixed positions (0-15, 16-31, ...). Each block's keys are
// transposed once per task into D float32 vectors (vector d, lane j: key j's element d), so a
// query's 16 scores are D multiply-adds of its element d (broadcast from memory) by vector d,
// in 4 chains (d mod 4) added by a fixed tree: no sum across lanes. Per row (query, head): the
// scores scaled (keys it does not see: -inf), an online softmax step (running maximum and sum,
// the output rescaled by exp(old - new max)), and the output accumulates weight_j * value_j
// for the block's 16 keys in order, in float32, the values widened as read (even and odd
// elements of every 32). At the end the output is divided by the sum and rounded once to
// bfloat16. Rows go in groups of up to 6 that share each key vector and value load; a row's
// sequence depends only on its query, its keys and how many it sees, never on the group, what
// else is in the call or which thread runs it.

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "../common/kernels.h"
#include "simd.h"

namespace {

using agentflash_cpu::KvSource;
using agentflash_cpu::QueryRun;

constexpr int kBlock = 16;   // keys per block
constexpr int kChains = 4;   // a row's score chains
constexpr int kRows = 6;     // rows in a group: 6 x 4 accumulators and a key vector
constexpr float kInf = std::numeric_limits<float>::infinity();

alignas(64) const uint16_t kZeroRow[agentflash_cpu::kMaxHeadDim] = {};

inline __m512 exp16(__m512 x) { return at::vec::Vectorized<float>(x).exp_u20(); }

// Output vectors a group accumulates at once (of D / 16; an even count: a value load of 32
// elements gives two, its even and its odd elements).
template <int D>
constexpr int out_tile() {
  return (D / 16) % 4 == 0 ? 4 : 2;
}

// A block's keys as float32 columns: kt[d] lane j = element d of key j (zeros past `n`).
template <int D>
inline void pack_keys(const uint16_t* const* kr, int n, __m512* kt) {
#pragma GCC unroll 1
  for (int c = 0; c < D / 32; ++c) {
    __m512i rows[16], pairs[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      rows[j] = j < n ? _mm512_loadu_si512(kr[j] + 32 * c) : _mm512_setzero_si512();
    agentflash_cpu::transpose16(rows, pairs);  // pairs[w] lane j: key j's elements 2w, 2w + 1
#pragma GCC unroll 16
    for (int w = 0; w < 16; ++w) {
      kt[32 * c + 2 * w] = agentflash_cpu::widen_even(pairs[w]);
      kt[32 * c + 2 * w + 1] = agentflash_cpu::widen_odd(pairs[w]);
    }
  }
}

// The running softmax state of a run's rows: row r is query t0 + r / G, head r % G.
struct Rows {
  std::vector<float> max, sum, q, out;  // [R], [R], [R * D] widened queries, [R * D]
  void reset(int64_t rows, int64_t dim) {
    max.assign(rows, -kInf);
    sum.assign(rows, 0.f);
    q.resize(rows * dim);
    out.assign(rows * dim, 0.f);  // laid out as the values are read (even / odd of each 32)
  }
};

// NR rows' state after a block (row[i] sees the block's first valid[i] keys, 1..16).
template <int D, int NR>
__attribute__((always_inline)) inline void update_group(Rows& st, const int64_t* row,
                                                        const int* valid, const __m512* kt,
                                                        const uint16_t* const* vr,
                                                        float scale) {
  const float* q[NR];
  float* out[NR];
#pragma GCC unroll 6
  for (int r = 0; r < NR; ++r) {
    q[r] = st.q.data() + row[r] * D;
    out[r] = st.out.data() + row[r] * D;
  }
  // scores: chain c of row r takes elements d = c mod 4
  __m512 acc[NR][kChains];
#pragma GCC unroll 6
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) acc[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int d = 0; d < D; d += kChains)
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) {
      const __m512 k = kt[d + c];
#pragma GCC unroll 6
      for (int r = 0; r < NR; ++r)
        acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d + c]), k, acc[r][c]);
    }
  // the online softmax step: each row's new maximum, every row's rescaling in one exp
  __m512 s[NR];
  alignas(64) float old_max[16] = {}, new_max[16] = {}, rescale[16];  // rows past NR: exp(0)
#pragma GCC unroll 6
  for (int r = 0; r < NR; ++r) {
    const __m512 dots = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                      _mm512_add_ps(acc[r][2], acc[r][3]));
    const __mmask16 live = static_cast<__mmask16>((1u << valid[r]) - 1);
    s[r] = _mm512_mask_mul_ps(_mm512_set1_ps(-kInf), live, dots, _mm512_set1_ps(scale));
    old_max[r] = st.max[row[r]];
    new_max[r] = std::max(old_max[r], _mm512_reduce_max_ps(s[r]));
  }
  // a row's first keys: exp(-inf) = 0 rescales its zero output and sum
  _mm512_store_ps(rescale, exp16(_mm512_sub_ps(_mm512_load_ps(old_max), _mm512_load_ps(new_max))));
  alignas(64) float w[NR][kBlock];
#pragma GCC unroll 6
  for (int r = 0; r < NR; ++r) {
    const __m512 p = exp16(_mm512_sub_ps(s[r], _mm512_set1_ps(new_max[r])));
    _mm512_store_ps(w[r], p);
    st.max[row[r]] = new_max[r];
    st.sum[row[r]] = st.sum[row[r]] * rescale[r] + _mm512_reduce_add_ps(p);
  }
  // values: out = out * rescale + w_0 v_0 + .. + w_15 v_15, in order
  constexpr int kOut = out_tile<D>();
#pragma GCC unroll 1
  for (int u0 = 0; u0 < D / 16; u0 += kOut) {
    __m512 o[NR][kOut];
#pragma GCC unroll 6
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < kOut; ++u)
        o[r][u] = _mm512_mul_ps(_mm512_loadu_ps(out[r] + 16 * (u0 + u)),
                                _mm512_set1_ps(rescale[r]));
#pragma GCC unroll 2
    for (int j = 0; j < kBlock; ++j) {
#pragma GCC unroll 2
      for (int u = 0; u < kOut; u += 2) {
        const __m512i raw = _mm512_loadu_si512(vr[j] + 16 * (u0 + u));
        const __m512 even = agentflash_cpu::widen_even(raw);
        const __m512 odd = agentflash_cpu::widen_odd(raw);
#pragma GCC unroll 6
        for (int r = 0; r < NR; ++r) {
          const __m512 p = _mm512_set1_ps(w[r][j]);
          o[r][u] = _mm512_fmadd_ps(p, even, o[r][u]);
          o[r][u + 1] = _mm512_fmadd_ps(p, odd, o[r][u + 1]);
        }
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < kOut; ++u) _mm512_storeu_ps(out[r] + 16 * (u0 + u), o[r][u]);
  }
}

template <int D>
void update_rows(Rows& st, const int64_t* row, const int* valid, int n, const __m512* kt,
                 const uint16_t* const* vr, float scale) {
  switch (n) {
    case 1: return update_group<D, 1>(st, row, valid, kt, vr, scale);
    case 2: return update_group<D, 2>(st, row, valid, kt, vr, scale);
    case 3: return update_group<D, 3>(st, row, valid, kt, vr, scale);
    case 4: return update_group<D, 4>(st, row, valid, kt, vr, scale);
    case 5: return update_group<D, 5>(st, row, valid, kt, vr, scale);
    default: return update_group<D, kRows>(st, row, valid, kt, vr, scale);
  }
}

template <int D>
void attend(const KvSource& src, const QueryRun& run) {
  alignas(64) __m512 kt[D];
  const uint16_t* vr[kBlock];
  const int64_t t0 = run.t0, t1 = run.t1, g = run.g, G = run.G;
  thread_local Rows st;
  st.reset((t1 - t0) * G, D);
  for (int64_t t = t0; t < t1; ++t)  // the queries widened, in order
    for (int64_t h = 0; h < G; ++h) {
      const uint16_t* q = run.q + (t * run.Hq + g * G + h) * D;
      float* qf = st.q.data() + ((t - t0) * G + h) * D;
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(qf + d, agentflash_cpu::widen_bf16(q + d));
    }
  const int64_t longest = run.longest();
  agentflash_cpu::KeyChunks<kBlock> blocks(src, g, D, longest);
  for (int64_t k0 = 0; k0 < longest; k0 += kBlock) {
    const int n = blocks.advance(k0);
    pack_keys<D>(blocks.kr, n, kt);
    for (int j = 0; j < kBlock; ++j) vr[j] = j < n ? blocks.vr[j] : kZeroRow;
    // the rows that see any of this block's keys, kRows at a time (rows that see none are left
    // untouched, as in a call without them)
    int64_t row[kRows];
    int valid[kRows];
    int count = 0;
    for (int64_t t = t0; t < t1; ++t) {
      if (run.keys[t] <= k0) continue;
      for (int64_t h = 0; h < G; ++h) {
        row[count] = (t - t0) * G + h;
        valid[count] = static_cast<int>(std::min<int64_t>(kBlock, run.keys[t] - k0));
        if (++count == kRows) {
          update_rows<D>(st, row, valid, count, kt, vr, run.scale);
          count = 0;
        }
      }
    }
    if (count > 0) update_rows<D>(st, row, valid, count, kt, vr, run.scale);
  }
  for (int64_t t = t0; t < t1; ++t)  // out / sum, rounded once, back in order
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = (t - t0) * G + h;
      const __m512 total = _mm512_set1_ps(st.sum[r]);
      const float* o = st.out.data() + r * D;
      uint16_t* dst = run.out + (t * run.Hq + g * G + h) * D;
      for (int c = 0; c < D / 32; ++c)
        agentflash_cpu::store_bf16_32(dst + 32 * c,
                                      _mm512_div_ps(_mm512_loadu_ps(o + 32 * c), total),
                                      _mm512_div_ps(_mm512_loadu_ps(o + 32 * c + 16), total));
    }
}

}  // namespace

namespace agentflash_cpu {

void attend_all_float32(const AttentionCall& call) {
  attend_per_kv_head(call, [](auto dim, const KvSource& src, const QueryRun& run) {
    attend<decltype(dim)::value>(src, run);
  });
}

}  // namespace agentflash_cpu
