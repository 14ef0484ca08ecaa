// agentflash::paged_attention_bf16: attention of a few new queries per sequence (decode rows,
// verify blocks) over their sequences' keys in the paged KV pool, read in place, on CPUs with
// AVX512-BF16.
//
// Why it exists (docs/performance.md): the torch path gathers every layer's whole context into
// a contiguous copy and runs small batched matmuls, each a library call of tens of
// microseconds; at agentflash-11m that is a third of a decode step, at Qwen3-0.6B's sizes the
// copies alone cost ~9 ms a step at 1000 tokens of context.
//
// Query t (of sequence token_seq[t]) sees keys 0 .. token_keys[t] - 1 of its sequence, key j in
// slot key_slots[seq, j] of the caches [S, Hkv, D]. For each query and head: keys go in blocks
// of 16 at fixed positions (0-15, 16-31, ...); a block's 16 scores are dot products over D
// (`vdpbf16ps`, float32) summed across lanes by one fixed tree, scaled; then an online softmax
// (the running maximum, the sum and the output rescaled by exp(old - new max)) and the values
// accumulated key by key in float32; the output is divided by the sum and rounded once to
// bfloat16. That sequence depends only on the query, its keys and how many it sees, never on
// what else is in the call or which thread runs it: a verify block's rows are bitwise the
// decode steps' rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

using agentflash_cpu::lane_sums;
using agentflash_cpu::load_bf16;
using agentflash_cpu::store_bf16;
using agentflash_cpu::widen_bf16;

constexpr int kBlock = 16;      // keys per block
constexpr int kMaxDim = 256;    // head_dim, a multiple of 32
constexpr int kMaxGroup = 16;   // query heads per KV head

inline __m512 exp16(__m512 x) { return at::vec::Vectorized<float>(x).exp_u20(); }

struct Head {  // one query head's running softmax state
  float max;
  float sum;
  alignas(64) float out[kMaxDim];
};

// One query head's state after a block of `valid` keys (1..16): their scores (dot products of
// the query with the keys kr[j], scaled), the online softmax step, the values accumulated.
template <int D>
__attribute__((always_inline)) inline void update_head(Head& st, const uint16_t* q,
                                                       const uint16_t* const* kr,
                                                       const float* values, int valid,
                                                       float scale) {
  constexpr int steps = D / 32;
  __m512bh qv[steps];
#pragma GCC unroll 8
  for (int s = 0; s < steps; ++s) qv[s] = load_bf16(q + 32 * s, ~__mmask32{0});
  __m512 dots[kBlock];
#pragma GCC unroll 16
  for (int j = 0; j < kBlock; ++j) {
    __m512 acc = _mm512_setzero_ps();
    if (j < valid) {
#pragma GCC unroll 8
      for (int s = 0; s < steps; ++s)
        acc = _mm512_dpbf16_ps(acc, qv[s], load_bf16(kr[j] + 32 * s, ~__mmask32{0}));
    }
    dots[j] = acc;
  }
  const __mmask16 live = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 scores = _mm512_mask_blend_ps(
      live, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
      _mm512_mul_ps(lane_sums(dots), _mm512_set1_ps(scale)));
  const float top = std::max(st.max, _mm512_reduce_max_ps(scores));
  const __m512 rescale = exp16(_mm512_set1_ps(st.max - top));
  const __m512 p = exp16(_mm512_sub_ps(scores, _mm512_set1_ps(top)));
  alignas(64) float pw[kBlock];
  _mm512_store_ps(pw, p);
  st.sum = st.sum * _mm512_cvtss_f32(rescale) + _mm512_reduce_add_ps(p);
  st.max = top;
  __m512 o[D / 16];
#pragma GCC unroll 16
  for (int d = 0; d < D / 16; ++d) o[d] = _mm512_mul_ps(_mm512_load_ps(st.out + 16 * d), rescale);
  for (int j = 0; j < valid; ++j) {
    const __m512 pj = _mm512_set1_ps(pw[j]);
#pragma GCC unroll 16
    for (int d = 0; d < D / 16; ++d)
      o[d] = _mm512_fmadd_ps(pj, _mm512_load_ps(values + j * D + 16 * d), o[d]);
  }
#pragma GCC unroll 16
  for (int d = 0; d < D / 16; ++d) _mm512_store_ps(st.out + 16 * d, o[d]);
}

at::Tensor paged_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& key_slots,
                                const at::Tensor& token_seq, const at::Tensor& token_keys,
                                double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention_bf16: q [T, Hq, D], caches [S, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "paged_attention_bf16: bfloat16 q and caches");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D % 32 == 0 && D <= kMaxDim,
              "paged_attention_bf16: head_dim a multiple of 32 up to 256, got ", D);
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup,
              "paged_attention_bf16: up to 16 query heads per KV head");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention_bf16: contiguous caches");
  TORCH_CHECK(key_slots.dim() == 2 && key_slots.scalar_type() == at::kLong &&
                  token_seq.scalar_type() == at::kLong && token_keys.scalar_type() == at::kLong &&
                  token_seq.numel() == T && token_keys.numel() == T,
              "paged_attention_bf16: int64 key_slots [B, L], token_seq [T], token_keys [T]");
  const at::Tensor qc = q.contiguous();
  const at::Tensor slots_c = key_slots.contiguous();
  const at::Tensor seq_c = token_seq.contiguous(), keys_c = token_keys.contiguous();
  const int64_t* seq = seq_c.data_ptr<int64_t>();
  const int64_t* keys = keys_c.data_ptr<int64_t>();
  const int64_t B = slots_c.size(0), L = slots_c.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(seq[t] >= 0 && seq[t] < B && keys[t] >= 1 && keys[t] <= L,
                "paged_attention_bf16: query ", t, " sees ", keys[t], " keys of sequence ",
                seq[t], " (", B, " sequences of up to ", L, " keys)");
  at::Tensor out = at::empty({T, Hq, D}, qc.options());
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t G = Hq / Hkv, slot_stride = Hkv * D;
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  using Update = void (*)(Head&, const uint16_t*, const uint16_t* const*, const float*, int,
                          float);
  const Update update = D == 32 ? &update_head<32> : D == 64 ? &update_head<64>
                        : D == 96 ? &update_head<96> : D == 128 ? &update_head<128>
                        : D == 160 ? &update_head<160> : D == 192 ? &update_head<192>
                        : D == 224 ? &update_head<224> : &update_head<256>;

  // runs of consecutive queries of one sequence (a decode row, a verify block)
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t t = 0; t < T; ++t) {
    if (runs.empty() || seq[t] != seq[runs.back().first] || t != runs.back().second)
      runs.emplace_back(t, t + 1);
    else
      runs.back().second = t + 1;
  }
  // one task per (run, KV head): its queries and their G heads share each block of keys, whose
  // values are widened to float32 once
  at::parallel_for(0, static_cast<int64_t>(runs.size()) * Hkv, 1, [&](int64_t begin,
                                                                      int64_t end) {
    alignas(64) float values[kBlock * kMaxDim];
    std::vector<Head> heads;
    for (int64_t item = begin; item < end; ++item) {
      const auto [t0, t1] = runs[item / Hkv];
      const int64_t g = item % Hkv;
      const int64_t* row = slots + seq[t0] * L;
      int64_t longest = 0;
      for (int64_t t = t0; t < t1; ++t) longest = std::max(longest, keys[t]);
      heads.resize((t1 - t0) * G);
      for (Head& st : heads) {
        st.max = neg_inf;
        st.sum = 0.f;
        std::fill(st.out, st.out + D, 0.f);
      }
      for (int64_t k0 = 0; k0 < longest; k0 += kBlock) {
        const int in_block = static_cast<int>(std::min<int64_t>(kBlock, longest - k0));
        const uint16_t* kr[kBlock];
        for (int j = 0; j < in_block; ++j) {
          const int64_t base = row[k0 + j] * slot_stride + g * D;
          kr[j] = kp + base;
          for (int64_t d = 0; d < D; d += 16)
            _mm512_store_ps(values + j * D + d, widen_bf16(vp + base + d));
        }
        for (int64_t t = t0; t < t1; ++t) {
          if (keys[t] <= k0) continue;
          const int valid = static_cast<int>(std::min<int64_t>(kBlock, keys[t] - k0));
          for (int64_t h = 0; h < G; ++h)
            update(heads[(t - t0) * G + h], qp + (t * Hq + g * G + h) * D, kr, values, valid,
                   fscale);
        }
      }
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < G; ++h) {
          const Head& st = heads[(t - t0) * G + h];
          const __m512 total = _mm512_set1_ps(st.sum);
          uint16_t* dst = op + (t * Hq + g * G + h) * D;
          for (int64_t d = 0; d < D; d += 16)
            store_bf16(dst + d, _mm512_div_ps(_mm512_load_ps(st.out + d), total));
        }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentflash, m) {
  m.def(
      "paged_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor key_slots, "
      "Tensor token_seq, Tensor token_keys, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(agentflash, CPU, m) {
  m.impl("paged_attention_bf16", &paged_attention_bf16);
}
