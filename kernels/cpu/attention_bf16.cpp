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
// slot page_table[seq, j / page_size] * page_size + j % page_size of the caches [S, Hkv, D].
// With k_new / v_new [T, Hkv, D] and cached [B] (the DFlash drafter's blocks, whose own K/V are
// not in the pool), key j >= cached[seq] of a run of queries t0 .. t1 - 1 is instead row
// t0 + j - cached[seq] of k_new / v_new: the run's own rows.
// Keys go in blocks of 16 at fixed positions (0-15, 16-31, ...). Each block is packed once per
// (run of queries of a sequence, KV head) for `vdpbf16ps`: its keys transposed into pairs of
// elements (a query's 16 scores are D/2 dot-product steps into 16 float32 lanes, in 8 chains
// added by a fixed tree; no sum across lanes), its values into pairs of keys. Per query head:
// the scores scaled (keys it does not see: -inf), an online softmax step (running maximum and
// sum, the output rescaled by exp(old - new max)), the weights rounded to bfloat16 pairs and
// the values accumulated in float32; at the end the output is divided by the sum and rounded
// once to bfloat16. That sequence depends only on the query, its keys and how many it sees,
// never on what else is in the call or which thread runs it: a verify block's rows are bitwise
// the decode steps' rows.

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

using agentflash_cpu::store_bf16;

constexpr int kBlock = 16;      // keys per block
constexpr int kMaxDim = 256;    // head_dim, a multiple of 32

inline __m512 exp16(__m512 x) { return at::vec::Vectorized<float>(x).exp_u20(); }

// out[c] = column c of the 16 x 16 matrix of 32-bit words whose rows are r[0..15].
inline void transpose16(const __m512i (&r)[16], __m512i (&out)[16]) {
  __m512i t[16], u[16], v[4][4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // u[4i + k], lane L: column 4L + k of rows 4i .. 4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    v[k][0] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);       // columns k, 8+k of rows 0-7
    v[k][1] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);       // columns 4+k, 12+k
    v[k][2] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);  // the same of rows 8-15
    v[k][3] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    out[k] = _mm512_shuffle_i32x4(v[k][0], v[k][2], 0x88);
    out[8 + k] = _mm512_shuffle_i32x4(v[k][0], v[k][2], 0xDD);
    out[4 + k] = _mm512_shuffle_i32x4(v[k][1], v[k][3], 0x88);
    out[12 + k] = _mm512_shuffle_i32x4(v[k][1], v[k][3], 0xDD);
  }
}

// A block of 16 keys and values laid out for `vdpbf16ps` (keys past `n` are zeros):
// keys[i] lane j = the i-th pair of key j's elements (2i, 2i+1), so a query's 16 scores are
// D/2 dot-product steps with no sum across lanes; values[p * D/16 + c] lane e = the pair
// (key 2p, key 2p+1) of element 16c + e, so the output takes 8 steps per 16 elements.
template <int D>
inline void pack_block(const uint16_t* const* kr, const uint16_t* const* vr, int n,
                       __m512i* keys, __m512i* values) {
#pragma GCC unroll 1
  for (int c = 0; c < D / 32; ++c) {
    __m512i rows[16], cols[16];
    for (int j = 0; j < 16; ++j)
      rows[j] = j < n ? _mm512_loadu_si512(kr[j] + 32 * c) : _mm512_setzero_si512();
    transpose16(rows, cols);
    for (int w = 0; w < 16; ++w) keys[16 * c + w] = cols[w];
  }
  for (int p = 0; p < 8; ++p)
    for (int c = 0; c < D / 16; ++c) {
      const __m512i lo = 2 * p < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(vr[2 * p] + 16 * c)))
                                   : _mm512_setzero_si512();
      const __m512i hi =
          2 * p + 1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                              reinterpret_cast<const __m256i*>(vr[2 * p + 1] + 16 * c)))
                        : _mm512_setzero_si512();
      values[p * (D / 16) + c] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
    }
}

// The running softmax state of a run's query heads: row r is query t0 + r / G, head r % G.
struct Rows {
  std::vector<float> max, sum, out;  // [R], [R], [R * D]
  void reset(int64_t rows, int64_t dim) {
    max.assign(rows, -std::numeric_limits<float>::infinity());
    sum.assign(rows, 0.f);
    out.assign(rows * dim, 0.f);
  }
};

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
// scores, the online softmax step (running max and sum, the output rescaled by exp(old - new
// max)), and the values weighted by the probabilities rounded to bfloat16 pairs. The rows go
// together so their steps overlap; each lane of the cross-lane trees (simd.h) reduces one row's
// vector by the same tree whatever its slot, so a row's result depends on its query and keys
// alone.
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
  alignas(64) float old_max[16] = {}, old_sum[16] = {}, top[16], rescale[16];
  for (int i = 0; i < n; ++i) {
    old_max[i] = st.max[row[i]];
    old_sum[i] = st.sum[row[i]];
  }
  const __m512 m = _mm512_max_ps(_mm512_load_ps(old_max), agentflash_cpu::lane_maxes(s));
  _mm512_store_ps(top, m);
  const __m512 r = exp16(_mm512_sub_ps(_mm512_load_ps(old_max), m));  // exp(0) = 1 exactly
  _mm512_store_ps(rescale, r);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    p[i] = i < n ? exp16(_mm512_sub_ps(s[i], _mm512_set1_ps(top[i]))) : _mm512_setzero_ps();
  alignas(64) float sum[16];
  _mm512_store_ps(sum, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(old_sum), r),
                                     agentflash_cpu::lane_sums(p)));
  for (int i = 0; i < n; ++i) {
    st.max[row[i]] = top[i];
    st.sum[row[i]] = sum[i];
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

// Where one (run, KV head)'s keys live: the pool through its sequence's page table, and from
// key `cached` on (when `kn` is set) the run's own new rows.
struct Source {
  const uint16_t* kp;
  const uint16_t* vp;
  const int64_t* pages;
  int64_t page_size;
  int64_t slot_stride;  // elements between slots of the caches (and rows of k_new): Hkv * D
  int64_t cached;       // keys in the pool
  const uint16_t* kn;   // the run's first new row at this KV head, or nullptr
  const uint16_t* vn;
};

template <int D>
void attend_run(const Source& src, const uint16_t* qp, const int64_t* keys, int64_t t0,
                int64_t t1, int64_t g, int64_t G, int64_t Hq, float scale, Rows& st,
                uint16_t* op) {
  alignas(64) __m512i kblock[D / 2];
  alignas(64) __m512i vblock[8 * (D / 16)];
  int64_t longest = 0;
  for (int64_t t = t0; t < t1; ++t) longest = std::max(longest, keys[t]);
  st.reset((t1 - t0) * G, D);
  // the rows of keys k0 .. k0 + n - 1 (one division per block)
  auto block_rows = [&](int64_t k0, int n, const uint16_t** kr, const uint16_t** vr) {
    int64_t page = k0 / src.page_size, offset = k0 % src.page_size;
    for (int j = 0; j < n; ++j) {
      const int64_t key = k0 + j;
      if (src.kn != nullptr && key >= src.cached) {
        kr[j] = src.kn + (key - src.cached) * src.slot_stride;
        vr[j] = src.vn + (key - src.cached) * src.slot_stride;
        continue;
      }
      const int64_t base =
          (src.pages[page] * src.page_size + offset) * src.slot_stride + g * D;
      kr[j] = src.kp + base;
      vr[j] = src.vp + base;
      if (++offset == src.page_size) {
        ++page;
        offset = 0;
      }
    }
  };
  const uint16_t* kr[kBlock];
  const uint16_t* vr[kBlock];
  const uint16_t* next_kr[kBlock];
  const uint16_t* next_vr[kBlock];
  block_rows(0, static_cast<int>(std::min<int64_t>(kBlock, longest)), next_kr, next_vr);
  for (int64_t k0 = 0; k0 < longest; k0 += kBlock) {
    const int in_block = static_cast<int>(std::min<int64_t>(kBlock, longest - k0));
    std::copy(next_kr, next_kr + in_block, kr);
    std::copy(next_vr, next_vr + in_block, vr);
    // the next block's keys and values, fetched while this one computes
    const int next_n = static_cast<int>(std::clamp<int64_t>(longest - k0 - kBlock, 0, kBlock));
    block_rows(k0 + kBlock, next_n, next_kr, next_vr);
    for (int j = 0; j < next_n; ++j)
      for (int c = 0; c < D; c += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(next_kr[j] + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next_vr[j] + c), _MM_HINT_T0);
      }
    pack_block<D>(kr, vr, in_block, kblock, vblock);
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
        q[n] = qp + (t * Hq + g * G + h) * D;
        valid[n] = static_cast<int>(std::min<int64_t>(kBlock, keys[t] - k0));
        if (++n == 16) {
          update_rows<D>(st, row, q, valid, n, kblock, vblock, scale);
          n = 0;
        }
      }
    }
    if (n > 0) update_rows<D>(st, row, q, valid, n, kblock, vblock, scale);
  }
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = (t - t0) * G + h;
      const __m512 total = _mm512_set1_ps(st.sum[r]);
      uint16_t* dst = op + (t * Hq + g * G + h) * D;
      for (int64_t d = 0; d < D; d += 16)
        store_bf16(dst + d, _mm512_div_ps(_mm512_loadu_ps(st.out.data() + r * D + d), total));
    }
}

at::Tensor paged_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& page_table,
                                int64_t page_size, const at::Tensor& token_seq,
                                const at::Tensor& token_keys, double scale,
                                const std::optional<at::Tensor>& k_new,
                                const std::optional<at::Tensor>& v_new,
                                const std::optional<at::Tensor>& cached) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention_bf16: q [T, Hq, D], caches [S, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "paged_attention_bf16: bfloat16 q and caches");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D % 32 == 0 && D <= kMaxDim,
              "paged_attention_bf16: head_dim a multiple of 32 up to 256, got ", D);
  TORCH_CHECK(Hq % Hkv == 0, "paged_attention_bf16: query heads a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention_bf16: contiguous caches");
  TORCH_CHECK(page_table.dim() == 2 && page_table.scalar_type() == at::kLong &&
                  token_seq.scalar_type() == at::kLong && token_keys.scalar_type() == at::kLong &&
                  token_seq.numel() == T && token_keys.numel() == T && page_size >= 1 &&
                  k_cache.size(0) % page_size == 0,
              "paged_attention_bf16: int64 page_table [B, P], token_seq [T], token_keys [T], "
              "caches of whole pages");
  const at::Tensor qc = q.contiguous();
  const at::Tensor table_c = page_table.contiguous();
  const at::Tensor seq_c = token_seq.contiguous(), keys_c = token_keys.contiguous();
  const int64_t* seq = seq_c.data_ptr<int64_t>();
  const int64_t* keys = keys_c.data_ptr<int64_t>();
  const int64_t B = table_c.size(0), P = table_c.size(1), L = P * page_size;
  const int64_t num_pages = k_cache.size(0) / page_size;
  const int64_t* table = table_c.data_ptr<int64_t>();
  const bool with_new = k_new.has_value() && k_new->defined();
  TORCH_CHECK(with_new == (v_new.has_value() && v_new->defined()) &&
                  with_new == (cached.has_value() && cached->defined()),
              "paged_attention_bf16: k_new, v_new and cached go together");
  at::Tensor kn_c, vn_c, cached_c;
  if (with_new) {
    TORCH_CHECK(k_new->dim() == 3 && k_new->size(0) == T && k_new->size(1) == Hkv &&
                    k_new->size(2) == D && v_new->sizes() == k_new->sizes() &&
                    k_new->scalar_type() == at::kBFloat16 &&
                    v_new->scalar_type() == at::kBFloat16 && cached->dim() == 1 &&
                    cached->size(0) == B && cached->scalar_type() == at::kLong,
                "paged_attention_bf16: bfloat16 k_new, v_new [T, Hkv, D] and int64 cached [B]");
    kn_c = k_new->contiguous();
    vn_c = v_new->contiguous();
    cached_c = cached->contiguous();
  }
  const int64_t* pooled = with_new ? cached_c.data_ptr<int64_t>() : nullptr;
  // runs of consecutive queries of one sequence (a decode row, a verify block, a draft block)
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(seq[t] >= 0 && seq[t] < B, "paged_attention_bf16: query ", t, " of sequence ",
                seq[t], " (", B, " sequences)");
    if (runs.empty() || seq[t] != seq[runs.back().first] || t != runs.back().second)
      runs.emplace_back(t, t + 1);
    else
      runs.back().second = t + 1;
  }
  for (const auto& [t0, t1] : runs) {
    const int64_t b = seq[t0];
    const int64_t in_pool = with_new ? pooled[b] : L;
    TORCH_CHECK(in_pool >= 0 && in_pool <= L, "paged_attention_bf16: ", in_pool,
                " cached keys of sequence ", b, " (up to ", L, ")");
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t most = with_new ? in_pool + (t1 - t0) : L;
      TORCH_CHECK(keys[t] >= 1 && keys[t] <= most, "paged_attention_bf16: query ", t,
                  " sees ", keys[t], " keys of sequence ", b, " (it has ", most, ")");
      const int64_t from_pool = std::min(keys[t], in_pool);
      for (int64_t p = 0; p < (from_pool + page_size - 1) / page_size; ++p)
        TORCH_CHECK(table[b * P + p] >= 0 && table[b * P + p] < num_pages,
                    "paged_attention_bf16: page ", table[b * P + p], " of sequence ", b,
                    " is not in the cache (", num_pages, " pages)");
    }
  }
  at::Tensor out = at::empty({T, Hq, D}, qc.options());
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t G = Hq / Hkv, slot_stride = Hkv * D;
  const float fscale = static_cast<float>(scale);
  using Run = void (*)(const Source&, const uint16_t*, const int64_t*, int64_t, int64_t,
                       int64_t, int64_t, int64_t, float, Rows&, uint16_t*);
  const Run attend = D == 32 ? &attend_run<32> : D == 64 ? &attend_run<64>
                     : D == 96 ? &attend_run<96> : D == 128 ? &attend_run<128>
                     : D == 160 ? &attend_run<160> : D == 192 ? &attend_run<192>
                     : D == 224 ? &attend_run<224> : &attend_run<256>;
  const uint16_t* knp = with_new ? reinterpret_cast<const uint16_t*>(kn_c.data_ptr()) : nullptr;
  const uint16_t* vnp = with_new ? reinterpret_cast<const uint16_t*>(vn_c.data_ptr()) : nullptr;
  // one task per (run, KV head): its queries and their G heads share each packed block of keys
  at::parallel_for(0, static_cast<int64_t>(runs.size()) * Hkv, 1,
                   [&](int64_t begin, int64_t end) {
                     Rows rows;
                     for (int64_t item = begin; item < end; ++item) {
                       const auto [t0, t1] = runs[item / Hkv];
                       const int64_t g = item % Hkv, b = seq[t0];
                       const int64_t first = (t0 * Hkv + g) * D;
                       const Source src{kp, vp, table + b * P, page_size, slot_stride,
                                        with_new ? pooled[b] : L,
                                        with_new ? knp + first : nullptr,
                                        with_new ? vnp + first : nullptr};
                       attend(src, qp, keys, t0, t1, g, G, Hq, fscale, rows, op);
                     }
                   });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentflash, m) {
  m.def(
      "paged_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
      "int page_size, Tensor token_seq, Tensor token_keys, float scale, Tensor? k_new=None, "
      "Tensor? v_new=None, Tensor? cached=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(agentflash, CPU, m) {
  m.impl("paged_attention_bf16", &paged_attention_bf16);
}
