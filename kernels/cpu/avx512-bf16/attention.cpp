// The AVX512-BF16 implementation of common/attention_op.cpp's `attend_all` (kernels.h): one
// task per (run of queries, KV head), split over threads.
//
// Keys go in blocks of 16 at fixed positions (0-15, 16-31, ...). Each block is packed once per
// (run of queries of a sequence, KV head) for `vdpbf16ps`: its keys transposed into pairs of
// elements (a query's 16 scores are D/2 dot-product steps into 16 float32 lanes, in 8 chains
// added by a fixed tree; no sum across lanes), its values into pairs of keys. Per query head:
// the scores scaled (keys it does not see: -inf), an online softmax step (running maximum and
// sum, the output rescaled by exp(old - new max)), the weights rounded to bfloat16 pairs and
// the values accumulated in float32; at the end the output is divided by the sum and rounded
// once to bfloat16. That sequence depends only on the query, its keys and how many it sees,
// never on what else is in the call or which thread runs it.

#include <algorithm>
#include <cstdint>
#include <limits>

#include "attention_blocks.h"

namespace {

using agentflash_cpu::KvSource;
using agentflash_cpu::QueryRun;
using agentflash_cpu::Rows;
using agentflash_cpu::kBlock;
using agentflash_cpu::PackedBlock;
using agentflash_cpu::store_rows;
using agentflash_cpu::exp16;
using agentflash_cpu::lane_maxes;
using agentflash_cpu::lane_sums;

// The online softmax step of up to 16 rows after a block, given their scores s[0 .. n-1]
// (scaled; -inf for keys a row does not see): each row's running maximum and sum updated, p[i]
// its weights exp(s - new max) (0 past n), rescale[i] = exp(old max - new max), what its output
// so far is multiplied by. The rows go together so their steps overlap; each lane of the
// cross-lane trees (avx512/simd.h) reduces one row's vector by the same tree whatever its slot,
// so a row's result depends on its own scores alone.
__attribute__((always_inline)) inline void softmax_step(Rows& st, const int64_t* row, int n,
                                                        const __m512 (&s)[16], __m512 (&p)[16],
                                                        float* rescale) {
  alignas(64) float old_max[16] = {}, old_sum[16] = {}, top[16];
  for (int i = 0; i < n; ++i) {
    old_max[i] = st.max[row[i]];
    old_sum[i] = st.sum[row[i]];
  }
  const __m512 m = _mm512_max_ps(_mm512_load_ps(old_max), lane_maxes(s));
  _mm512_store_ps(top, m);
  const __m512 r = exp16(_mm512_sub_ps(_mm512_load_ps(old_max), m));  // exp(0) = 1 exactly
  _mm512_store_ps(rescale, r);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    p[i] = i < n ? exp16(_mm512_sub_ps(s[i], _mm512_set1_ps(top[i]))) : _mm512_setzero_ps();
  alignas(64) float sum[16];
  _mm512_store_ps(sum, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(old_sum), r), lane_sums(p)));
  for (int i = 0; i < n; ++i) {
    st.max[row[i]] = top[i];
    st.sum[row[i]] = sum[i];
  }
}

// A query head's 16 scores for a block: scaled dot products with its first `valid` keys (the
// rest -inf), in 8 chains of `vdpbf16ps` added by a fixed tree.
template <int D>
__attribute__((always_inline)) inline __m512 scores(const uint16_t* q, const __m512i* keys,
                                                    int valid, float scale) {
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(q);
  constexpr int kChains = D / 2 < 8 ? D / 2 : 8;
  __m512 part[kChains];
#pragma GCC unroll 8
  for (int i = 0; i < kChains; ++i) part[i] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int i = 0; i < D / 2; ++i)
    part[i % kChains] = _mm512_dpbf16_ps(part[i % kChains],
                                         (__m512bh)_mm512_set1_epi32(qw[i]), (__m512bh)keys[i]);
#pragma GCC unroll 4
  for (int width = kChains / 2; width >= 1; width /= 2)
#pragma GCC unroll 4
    for (int i = 0; i < width; ++i) part[i] = _mm512_add_ps(part[i], part[i + width]);
  const __mmask16 live = static_cast<__mmask16>((1u << valid) - 1);
  return _mm512_mask_blend_ps(live, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                              _mm512_mul_ps(part[0], _mm512_set1_ps(scale)));
}

// Up to 16 rows' state after a block (row[i] sees the block's first valid[i] keys, 1..16): their
// scores, the online softmax step, and the values weighted by the probabilities rounded to
// bfloat16 pairs; a row's result depends on its query and keys alone.
template <int D>
__attribute__((always_inline)) inline void update_rows(Rows& st, const int64_t* row,
                                                       const uint16_t* const* q,
                                                       const int* valid, int n,
                                                       const __m512i* keys,
                                                       const __m512i* values, float scale) {
  __m512 s[16], p[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    s[i] = i < n ? scores<D>(q[i], keys, valid[i], scale)
                 : _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float rescale[16];
  softmax_step(st, row, n, s, p, rescale);
  for (int i = 0; i < n; ++i) {
    alignas(32) uint32_t pairs[8];  // the 16 weights as 8 bfloat16 pairs
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), (__m256i)_mm512_cvtneps_pbh(p[i]));
    float* out = st.out.data() + row[i] * D;
    const __m512 scale_out = _mm512_set1_ps(rescale[i]);
    // two chains per 16 elements (pairs 0-3 onto the rescaled output, pairs 4-7 from zero)
    __m512 o[D / 16], o2[D / 16];
#pragma GCC unroll 16
    for (int c = 0; c < D / 16; ++c) {
      o[c] = _mm512_mul_ps(_mm512_loadu_ps(out + 16 * c), scale_out);
      o2[c] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pairs[k]);
      const __m512bh w2 = (__m512bh)_mm512_set1_epi32(pairs[k + 4]);
#pragma GCC unroll 16
      for (int c = 0; c < D / 16; ++c) {
        o[c] = _mm512_dpbf16_ps(o[c], w, (__m512bh)values[k * (D / 16) + c]);
        o2[c] = _mm512_dpbf16_ps(o2[c], w2, (__m512bh)values[(k + 4) * (D / 16) + c]);
      }
    }
#pragma GCC unroll 16
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_add_ps(o[c], o2[c]));
  }
}

template <int D>
void attend(const KvSource& src, const QueryRun& run) {
  PackedBlock<D> block;
  const int64_t t0 = run.t0, t1 = run.t1, g = run.g, G = run.G;
  const int64_t* keys = run.keys;
  thread_local Rows st;
  const int64_t longest = run.longest();
  st.reset((t1 - t0) * G, D);
  agentflash_cpu::KeyChunks<kBlock> blocks(src, g, D, longest);
  for (int64_t k0 = 0; k0 < longest; k0 += kBlock) {
    const int in_block = blocks.advance(k0);
    block.pack(blocks.kr, blocks.vr, in_block);
    // the rows that see any of this block's keys, 16 at a time (rows that see none are left
    // untouched, as in a call without them)
    int64_t row[16];
    const uint16_t* q[16];
    int valid[16];
    int n = 0;
    for (int64_t t = t0; t < t1; ++t) {
      if (keys[t] <= k0) continue;
      for (int64_t h = 0; h < G; ++h) {
        row[n] = (t - t0) * G + h;
        q[n] = run.q + (t * run.Hq + g * G + h) * D;
        valid[n] = static_cast<int>(std::min<int64_t>(kBlock, keys[t] - k0));
        if (++n == 16) {
          update_rows<D>(st, row, q, valid, n, block.keys, block.values, run.scale);
          n = 0;
        }
      }
    }
    if (n > 0) update_rows<D>(st, row, q, valid, n, block.keys, block.values, run.scale);
  }
  store_rows<D>(st, run);
}

}  // namespace

namespace agentflash_cpu {

void attend_all(const AttentionCall& call) {
  attend_per_kv_head(call, [](auto dim, const KvSource& src, const QueryRun& run) {
    attend<decltype(dim)::value>(src, run);
  });
}

}  // namespace agentflash_cpu
