// What agentflash's CPU ops (linear_op.cpp, attention_op.cpp: argument checks, work split over
// threads) call into: one implementation per instruction set, linked into that set's library
// (kernels/cpu_ops.py builds <isa>/linear.cpp and attention_<isa>.cpp with the shared files).
//
// Both compute every output by an instruction sequence that depends only on its own inputs
// (its x row and W row; its query and keys), never on what else is in the call, the tile it is
// computed in or the thread that computes it: a verify block's rows are bitwise the decode
// steps' rows, which greedy speculative decoding needs to equal plain decoding.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel.h"

namespace agentflash_cpu {

// y[m, n] = x[m, :] . W[n, :] (* scale[n]) (+ bias[n]) (+ residual[m, n]), rounded once to
// bfloat16. W is bfloat16 (w), or int8 (qw) with a scale per row.
struct LinearArgs {
  const uint16_t* x;         // [M, K] bfloat16, rows ldx apart
  int64_t ldx;
  const uint16_t* w;         // [N, K] bfloat16, rows ldw apart (or nullptr: qw)
  int64_t ldw;
  const float* bias;         // [N] float32 or nullptr
  const uint16_t* residual;  // [M, N] bfloat16 (rows ldy apart) or nullptr
  uint16_t* y;               // [M, N] bfloat16, rows ldy apart
  int64_t ldy;
  int64_t M;
  int64_t K;
  int64_t N;
  const int8_t* qw = nullptr;    // [N, K] int8, rows ldw apart (linear_int8_columns)
  const float* scale = nullptr;  // [N] float32: qw's row scales
};

// Every row of y for W's rows [n0, n1): bfloat16 W, int8 W (this instruction set's kernels).
void linear_columns(const LinearArgs& a, int64_t n0, int64_t n1);
void linear_int8_columns(const LinearArgs& a, int64_t n0, int64_t n1);
// The same for int8 W with x's rows quantized to 16-bit integers first (linear_dynamic_<isa>.cpp).
void linear_int8_dynamic_columns(const LinearArgs& a, int64_t n0, int64_t n1);
// Every row of y for W's rows [n0, n1) (n0 a multiple of kPanelColumns) as a float32 matrix
// product on W packed into bfloat16 panels (avx512/linear_panels.cpp, in the sets with AVX512;
// the layout is there): xs holds x's M rows widened to float32, ldxs apart. Each output is its
// own sequence too, though not linear_columns' one.
constexpr int64_t kPanelColumns = 48;
void linear_panel_columns(const LinearArgs& a, const uint16_t* panels, const float* xs,
                          int64_t ldxs, int64_t n0, int64_t n1);
// Rows [m0, m1) of bfloat16 x [M, K] (rows ldx apart) widened exactly into float32 xs [M, K].
void widen_rows(const uint16_t* x, int64_t ldx, int64_t K, int64_t m0, int64_t m1, float* xs);
// Every row of y for bfloat16 W by AMX tiles, threads splitting W's rows (amx/linear_amx.cpp; only
// in the amx set's library). False, with nothing computed, where W's shape (K a multiple of 32,
// N of 16) or the OS does not allow it: a property of the shape and the process, never of M.
bool linear_amx(const LinearArgs& a);

// The levels linear_int8_dynamic quantizes x's rows to (x -> round(x * Q / max |x|)) for rows of
// K: the most, up to 32767, for which no sum of K products with int8 weights (|q| <= 128, K
// padded to 32) can leave int32.
inline int64_t dynamic_levels(int64_t K) {
  const int64_t padded = (K + 31) / 32 * 32;
  return std::min<int64_t>(32767, int64_t{2147483647} / (128 * std::max<int64_t>(padded, 32)));
}

// Where one (run of queries, KV head)'s keys live: the pool through its sequence's page table,
// and from key `cached` on (when `kn` is set) the run's own new rows (a drafter block's K/V).
struct KvSource {
  const uint16_t* kp;   // the caches [S, Hkv, D]
  const uint16_t* vp;
  const int64_t* pages;
  int64_t page_size;
  int64_t slot_stride;  // elements between slots of the caches (and rows of k_new): Hkv * D
  int64_t cached;       // keys in the pool
  const uint16_t* kn;   // the run's first new row at this KV head, or nullptr
  const uint16_t* vn;
};

// A run of consecutive queries t0 .. t1 - 1 of one sequence, at KV head g: query t's heads
// g * G .. g * G + G - 1 (of Hq) each see the first keys[t] keys of `src`.
struct QueryRun {
  const uint16_t* q;    // [T, Hq, D]
  const int64_t* keys;  // [T]
  int64_t t0;
  int64_t t1;
  int64_t g;
  int64_t G;
  int64_t Hq;
  float scale;
  uint16_t* out;        // [T, Hq, D]

  int64_t longest() const {  // the most keys any of the run's queries sees
    int64_t most = 0;
    for (int64_t t = t0; t < t1; ++t) most = std::max(most, keys[t]);
    return most;
  }
};

// One paged_attention call, its arguments checked (attention_op.cpp): queries [T, Hq, D] in runs of
// consecutive queries of one sequence; query t sees the first keys[t] keys of sequence seq[t].
struct AttentionCall {
  const uint16_t* q;          // [T, Hq, D]
  const uint16_t* kp;         // the caches [S, Hkv, D]
  const uint16_t* vp;
  const int64_t* table;       // [B, P] pages of each sequence
  int64_t P;
  int64_t page_size;
  const int64_t* seq;         // [T]
  const int64_t* keys;        // [T]
  int64_t Hq, Hkv, D;
  float scale;
  const uint16_t* kn;         // [B * new_rows, Hkv, D] each sequence's own new rows, or nullptr
  const uint16_t* vn;         // (then vn and pooled too)
  const int64_t* pooled;      // [B] keys of each sequence in the pool (when kn is set)
  int64_t new_rows;           // kn's rows per sequence (when kn is set)
  uint16_t* out;              // [T, Hq, D]
  const std::vector<std::pair<int64_t, int64_t>>* runs;  // [t0, t1) of each run

  // Where run i's keys live at KV head g.
  KvSource source(size_t i, int64_t g) const {
    const int64_t b = seq[(*runs)[i].first];
    const int64_t first = (b * new_rows * Hkv + g) * D;
    return {kp, vp, table + b * P, page_size, Hkv * D,
            kn != nullptr ? pooled[b] : P * page_size, kn != nullptr ? kn + first : nullptr,
            kn != nullptr ? vn + first : nullptr};
  }
  // Run i at KV head g.
  QueryRun run(size_t i, int64_t g) const {
    return {q, keys, (*runs)[i].first, (*runs)[i].second, g, Hq / Hkv, Hq, scale, out};
  }
};

// Every output of the call (this instruction set's kernels and split of the work over threads;
// the avx2 and avx512-bf16 sets' own, which amx shares).
void attend_all(const AttentionCall& call);
// The same in float32 (avx512/attention_float32.cpp: the avx512 set's attention, also in the
// avx512-bf16 and amx sets' libraries, taken where cpu_ops.prefer_float32 sets it).
void attend_all_float32(const AttentionCall& call);
// The same by AMX tiles (amx/attention_amx.cpp; only in the amx set's library). False, with
// nothing computed, where the OS does not grant the tile state (a property of the process).
bool attend_all_amx(const AttentionCall& call);

constexpr int64_t kMaxHeadDim = 256;

// f(std::integral_constant<int, D>) for head_dim D (a multiple of 32 up to kMaxHeadDim): what
// the implementations' attention is instantiated for.
template <typename F>
inline void with_head_dim(int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 96: return f(std::integral_constant<int, 96>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 160: return f(std::integral_constant<int, 160>{});
    case 192: return f(std::integral_constant<int, 192>{});
    case 224: return f(std::integral_constant<int, 224>{});
    default: return f(std::integral_constant<int, 256>{});
  }
}

// attend_all for kernels that take one (run, KV head) at a time: one task each, split over
// threads; attend(std::integral_constant<int, D>, source, run) computes its outputs (the run's
// queries and their G heads share each block of keys).
template <typename F>
inline void attend_per_kv_head(const AttentionCall& call, F&& attend) {
  const int64_t Hkv = call.Hkv;
  with_head_dim(call.D, [&](auto dim) {
    parallel_for(0, static_cast<int64_t>(call.runs->size()) * Hkv, 1,
                     [&](int64_t begin, int64_t end) {
                       for (int64_t item = begin; item < end; ++item) {
                         const size_t i = static_cast<size_t>(item / Hkv);
                         attend(dim, call.source(i, item % Hkv), call.run(i, item % Hkv));
                       }
                     });
  });
}

// The keys k0 .. k0 + n - 1 of `src` at KV head g: their K and V rows (one division per call).
inline void key_rows(const KvSource& src, int64_t g, int64_t head_dim, int64_t k0, int n,
                     const uint16_t** kr, const uint16_t** vr) {
  int64_t page = k0 / src.page_size, offset = k0 % src.page_size;
  for (int j = 0; j < n; ++j) {
    const int64_t key = k0 + j;
    if (src.kn != nullptr && key >= src.cached) {
      kr[j] = src.kn + (key - src.cached) * src.slot_stride;
      vr[j] = src.vn + (key - src.cached) * src.slot_stride;
      continue;
    }
    const int64_t base =
        (src.pages[page] * src.page_size + offset) * src.slot_stride + g * head_dim;
    kr[j] = src.kp + base;
    vr[j] = src.vp + base;
    if (++offset == src.page_size) {
      ++page;
      offset = 0;
    }
  }
}

// A run's keys 0 .. longest - 1 at KV head g, chunk by chunk at fixed positions (0, Chunk,
// 2 Chunk, ...): `advance(k0)` makes kr / vr the rows of the chunk from k0 and returns how many
// there are, with Prefetch after asking the memory for the next chunk's rows (fetched while
// this one computes; the AMX kernel's 64-key chunks are faster left to the hardware's
// prefetchers: 256 prefetches a chunk cost more than they saved).
template <int Chunk, bool Prefetch = true>
struct KeyChunks {
  const KvSource& src;
  int64_t g, head_dim, longest;
  const uint16_t* kr[Chunk];
  const uint16_t* vr[Chunk];
  const uint16_t* next_kr[Chunk];
  const uint16_t* next_vr[Chunk];

  KeyChunks(const KvSource& s, int64_t kv_head, int64_t dim, int64_t keys)
      : src(s), g(kv_head), head_dim(dim), longest(keys) {
    key_rows(src, g, head_dim, 0, static_cast<int>(std::min<int64_t>(Chunk, longest)), next_kr,
             next_vr);
  }

  int advance(int64_t k0) {
    const int n = static_cast<int>(std::min<int64_t>(Chunk, longest - k0));
    std::copy(next_kr, next_kr + n, kr);
    std::copy(next_vr, next_vr + n, vr);
    const int next_n = static_cast<int>(std::clamp<int64_t>(longest - k0 - Chunk, 0, Chunk));
    key_rows(src, g, head_dim, k0 + Chunk, next_n, next_kr, next_vr);
    if (!Prefetch) return n;
    for (int j = 0; j < next_n; ++j)
      for (int64_t c = 0; c < head_dim; c += 32) {  // a cache line of each row at a time
        _mm_prefetch(reinterpret_cast<const char*>(next_kr[j] + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(next_vr[j] + c), _MM_HINT_T0);
      }
    return n;
  }
};

}  // namespace agentflash_cpu
