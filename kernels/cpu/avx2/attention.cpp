// The AVX2 (+FMA) implementation of common/attention_op.cpp's `attend_all` (kernels.h), for CPUs with
// AVX2 but not AVX512: keys, values and queries are widened to float32 in registers.
//
// The work: a run's keys go in segments of kSegment keys at fixed positions (0-127, 128-255, ..).
// A thread takes a run's segment with all its KV heads, and before computing a chunk of keys
// it reads the chunk's K and V slots (every head's row of each key) front to back, one load
// per cache line, so that the hardware prefetcher streams them (touch). A thread per KV head
// reading its 256 B of every 2 KB slot (0.6B's sizes) got about half the memory bandwidth
// (docs/performance.md). With at least twice as many runs as threads a thread takes whole
// runs instead (the same arithmetic).
//
// Within a segment keys go in chunks at fixed positions (32 keys at head_dim 64, 16 at 128, 8
// above), and per chunk each KV head's rows (query, head) that see any of its keys are updated.
// Up to kRows rows read the keys and values in place, widening every 16 elements into their
// even and odd halves in registers (avx2/simd.h: widen16); more rows share one widening of the
// chunk into a float32 scratch laid out the same way (the same values, the same arithmetic).
// Per row and chunk: each key's score is one accumulator of 8 lanes taking the even and then
// the odd products of every 16 elements by FMA, 8 keys' accumulators summed across lanes by one
// fixed tree (lane_sums8), scaled (keys it does not see: -inf); one online softmax step
// (running maximum and sum, the output rescaled by exp(old - new max)); then the output
// accumulates weight_j * value_j for the chunk's keys in order, in float32. Each segment starts
// empty; a row's segments are folded in order (max m of the two maxima, sums and outputs scaled
// by exp(their max - m) and added), and the output is divided by the sum and rounded once to
// bfloat16. That sequence depends only on the query, its keys and how many it sees, never on
// what else is in the call or which thread runs which segment.

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "../common/kernels.h"
#include "simd.h"

namespace {

using agentflash_cpu::AttentionCall;
using agentflash_cpu::kernel_threads;
using agentflash_cpu::parallel_for;

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

constexpr int64_t kSegment = 128;  // keys per segment (a multiple of every chunk size)

// `n` rows of D bfloat16 values widened into `out` (even / odd halves of each 16 elements).
template <int D>
inline void widen_rows(const uint16_t* const* src, int n, float* out) {
  for (int j = 0; j < n; ++j)
#pragma GCC unroll 16
    for (int c = 0; c < D / 16; ++c) {
      const agentflash_cpu::Widened v = agentflash_cpu::load_widen16(src[j] + 16 * c);
      _mm256_store_ps(out + j * D + 16 * c, v.even);
      _mm256_store_ps(out + j * D + 16 * c + 8, v.odd);
    }
}

// A chunk's keys (or values) as float32 vectors: vector v of row j holds the even (v even) or
// odd (v odd) elements of the row's elements 16 (v / 2) .. 16 (v / 2) + 15, as widen_rows lays
// a row out. Widened: rows widen_rows wrote; InPlace: the bfloat16 rows, widened as read.
template <int D>
struct Widened {
  const float* rows;
  __m256 load(int j, int v) const { return _mm256_load_ps(rows + j * D + 8 * v); }
};

struct InPlace {
  const uint16_t* const* rows;
  __m256 load(int j, int v) const {
    const __m256i raw =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + 16 * (v / 2)));
    return v % 2 == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16))
                      : _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(-65536)));
  }
};

constexpr int kKeys = 4;   // keys whose scores a group of rows accumulates at once
constexpr int kRows = 3;   // rows in a group: 3 x 4 accumulators, 3 query vectors, 1 key vector
constexpr int kOut = 4;    // output vectors per row a group accumulates at once

// The scores of NR widened query rows with a chunk of KC keys: s[r][v] holds keys 8v .. 8v+7,
// scaled, keys from valid[r] on -inf. Each (row, key) pair's products accumulate in 8 lanes
// (the even, then the odd halves of every 16 elements), summed by one fixed tree (lane_sums8)
// per 8 keys. A group loads each query half once for 4 keys and each key half once for its NR
// rows: this CPU kind sustains about one vector load per FMA pair (measured), so loads, not
// FMAs, bound a loop that reloads its operands.
template <int D, int KC, int NR, typename Keys>
__attribute__((always_inline)) inline void group_scores(const float* const (&q)[NR],
                                                        const Keys& keys, const int (&valid)[NR],
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
      __m256 qv[NR];
#pragma GCC unroll 3
      for (int r = 0; r < NR; ++r) qv[r] = _mm256_load_ps(q[r] + 8 * half);
#pragma GCC unroll 4
      for (int j = 0; j < kKeys; ++j) {
        const __m256 kv = keys.load(j0 + j, half);
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

// The outputs of NR rows after a chunk: out[r] = out[r] * rescale[r] (0 for a row's first
// chunk: nothing to rescale), then + w[r][j] * value_j for j = 0 .. KC - 1 in order. A group
// loads each value vector once for its NR rows.
template <int D, int KC, int NR, typename Values>
__attribute__((always_inline)) inline void group_values(const float (&w)[NR][KC],
                                                        const float (&rescale)[NR],
                                                        const bool (&first)[NR],
                                                        const Values& values,
                                                        float* const (&out)[NR]) {
#pragma GCC unroll 1
  for (int u0 = 0; u0 < D / 8; u0 += kOut) {
    __m256 o[NR][kOut];
#pragma GCC unroll 3
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < kOut; ++u)
        o[r][u] = first[r] ? _mm256_setzero_ps()
                           : _mm256_mul_ps(_mm256_load_ps(out[r] + 8 * (u0 + u)),
                                           _mm256_set1_ps(rescale[r]));
#pragma GCC unroll 2
    for (int j = 0; j < KC; ++j) {
      __m256 p[NR];
#pragma GCC unroll 3
      for (int r = 0; r < NR; ++r) p[r] = _mm256_broadcast_ss(&w[r][j]);
#pragma GCC unroll 4
      for (int u = 0; u < kOut; ++u) {
        const __m256 vv = values.load(j, u0 + u);
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

// Rows' state: the running maximum and sum and the unnormalised output of each (query, head)
// row of a run, row r = (t - t0) * Hq + head; outputs laid out as widen_rows lays out a row.
struct State {
  float* max;  // [R]
  float* sum;  // [R]
  float* out;  // [R * D], 32-byte aligned
};

// NR rows' state after a chunk of KC keys (row head + rows[i] sees the first valid[i] of them):
// scores, one online softmax step per row (running maximum and sum; the output rescaled by
// exp(old - new max)), the values weighted (unseen keys weigh 0).
template <int D, int KC, int NR, typename Keys>
inline void update_group(const State& st, const float* qs, int64_t head, const int64_t* rows,
                         const int* valid_of, const Keys& keys, const Keys& values, float scale) {
  const float* q[NR];
  float* out[NR];
  float* max[NR];
  float* sum[NR];
  int valid[NR];
  for (int i = 0; i < NR; ++i) {
    q[i] = qs + (head + rows[i]) * D;
    out[i] = st.out + (head + rows[i]) * D;
    max[i] = st.max + head + rows[i];
    sum[i] = st.sum + head + rows[i];
    valid[i] = valid_of[i];
  }
  __m256 s[NR][KC / 8];
  group_scores<D, KC, NR>(q, keys, valid, scale, s);
  alignas(32) float w[NR][KC];
  float rescale[NR];
  bool first[NR];  // the row's first keys: its sum and output are not set yet
#pragma GCC unroll 3
  for (int r = 0; r < NR; ++r) {
    first[r] = *max[r] == -kInf;
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
    *sum[r] = first[r] ? lane_sum(total) : *sum[r] * rescale[r] + lane_sum(total);
  }
  group_values<D, KC, NR>(w, rescale, first, values, out);
}

// update_group over `n` rows, kRows at a time.
template <int D, int KC, typename Keys>
inline void update_rows(const State& st, const float* qs, int64_t head, const int64_t* rows,
                        const int* valid, int64_t n, const Keys& keys, const Keys& values,
                        float scale) {
  int64_t i = 0;
  for (; i + kRows <= n; i += kRows)
    update_group<D, KC, kRows>(st, qs, head, rows + i, valid + i, keys, values, scale);
  if (n - i == 2) update_group<D, KC, 2>(st, qs, head, rows + i, valid + i, keys, values, scale);
  if (n - i == 1) update_group<D, KC, 1>(st, qs, head, rows + i, valid + i, keys, values, scale);
}

alignas(32) const uint16_t kZeroRow[agentflash_cpu::kMaxHeadDim] = {};

// Reads n K or V slots (every KV head's row of a key) front to back, one load per cache line:
// a stream the hardware prefetcher follows, so the heads that follow find them in cache. Read
// head by head (at 0.6B, 256 B pieces of 2 KB slots) the prefetcher does not follow them.
inline void touch(const uint16_t* const* slots, int n, int64_t slot) {
  uint32_t sum = 0;
  for (int j = 0; j < n; ++j)
    for (int64_t e = 0; e < slot; e += 32) sum += slots[j][e];
  asm volatile("" : : "r"(sum));
}

// Run i's rows over its keys [s0, s1) (s0 a multiple of kSegment, s1 - s0 <= kSegment), into
// `st` (reset to empty here); qs: the run's queries widened.
template <int D>
void attend_segment(const AttentionCall& c, size_t i, int64_t s0, int64_t s1, const float* qs,
                    const State& st) {
  constexpr int KC = chunk_keys<D>();
  alignas(32) float kchunk[KC * D];
  alignas(32) float vchunk[KC * D];
  const uint16_t* ks[KC];  // the chunk's slots
  const uint16_t* vs[KC];
  const uint16_t* kr[KC];  // their rows at one KV head (zero rows past the chunk's keys)
  const uint16_t* vr[KC];
  const int64_t t0 = (*c.runs)[i].first, t1 = (*c.runs)[i].second;
  const int64_t G = c.Hq / c.Hkv, R = (t1 - t0) * c.Hq, slot = c.Hkv * D;
  std::fill(st.max, st.max + R, -kInf);  // sums and outputs are set by a row's first keys
  thread_local std::vector<int64_t> rows;
  thread_local std::vector<int> valid;
  rows.resize((t1 - t0) * G);
  valid.resize((t1 - t0) * G);
  for (int64_t k0 = s0; k0 < s1; k0 += KC) {
    const int n = static_cast<int>(std::min<int64_t>(KC, s1 - k0));
    agentflash_cpu::key_rows(c.source(i, 0), 0, D, k0, n, ks, vs);
    touch(ks, n, slot);
    touch(vs, n, slot);
    // the rows that see any of this chunk's keys, at KV head 0 (rows that see none are left
    // untouched, as in a call without them); KV head g's are G * g rows further
    int64_t count = 0;
    for (int64_t t = t0; t < t1; ++t) {
      if (c.keys[t] <= k0) continue;
      for (int64_t h = 0; h < G; ++h) {
        rows[count] = (t - t0) * c.Hq + h;
        valid[count++] = static_cast<int>(std::min<int64_t>(KC, c.keys[t] - k0));
      }
    }
    for (int64_t g = 0; g < c.Hkv; ++g) {
      for (int j = 0; j < KC; ++j) {
        kr[j] = j < n ? ks[j] + g * D : kZeroRow;
        vr[j] = j < n ? vs[j] + g * D : kZeroRow;
      }
      if (count <= kRows) {
        update_rows<D, KC>(st, qs, g * G, rows.data(), valid.data(), count, InPlace{kr},
                           InPlace{vr}, c.scale);
      } else {
        widen_rows<D>(kr, KC, kchunk);
        widen_rows<D>(vr, KC, vchunk);
        update_rows<D, KC>(st, qs, g * G, rows.data(), valid.data(), count,
                           Widened<D>{kchunk}, Widened<D>{vchunk}, c.scale);
      }
    }
  }
}

// Folds a segment's state `seg` into a run's running state `acc`, row by row (rows that saw
// none of the segment's keys stay as they are): m = max(acc, seg), each side scaled by
// exp(its max - m) and added.
template <int D>
void fold(const State& acc, const State& seg, int64_t R) {
  for (int64_t r = 0; r < R; ++r) {
    if (seg.max[r] == -kInf) continue;
    const float m = std::max(acc.max[r], seg.max[r]);
    const float a = _mm256_cvtss_f32(exp8(_mm256_set1_ps(acc.max[r] - m)));
    const float b = _mm256_cvtss_f32(exp8(_mm256_set1_ps(seg.max[r] - m)));
    acc.max[r] = m;
    acc.sum[r] = acc.sum[r] * a + seg.sum[r] * b;
    float* o = acc.out + r * D;
    const float* so = seg.out + r * D;
    for (int v = 0; v < D / 8; ++v)
      _mm256_store_ps(o + 8 * v, _mm256_fmadd_ps(_mm256_load_ps(so + 8 * v), _mm256_set1_ps(b),
                                                 _mm256_mul_ps(_mm256_load_ps(o + 8 * v),
                                                               _mm256_set1_ps(a))));
  }
}

// Run i's queries widened into qs [R * D].
template <int D>
void widen_queries(const AttentionCall& c, size_t i, float* qs) {
  const int64_t t0 = (*c.runs)[i].first, t1 = (*c.runs)[i].second;
  for (int64_t r = 0; r < (t1 - t0) * c.Hq; ++r) {
    const uint16_t* q = c.q + (t0 * c.Hq + r) * D;
    widen_rows<D>(&q, 1, qs + r * D);
  }
}

// Run i's outputs from its folded state: out / sum, rounded once to bfloat16.
template <int D>
void finish(const AttentionCall& c, size_t i, const State& acc) {
  const int64_t t0 = (*c.runs)[i].first, t1 = (*c.runs)[i].second;
  for (int64_t r = 0; r < (t1 - t0) * c.Hq; ++r) {
    const __m256 total = _mm256_set1_ps(acc.sum[r]);
    const float* o = acc.out + r * D;
    uint16_t* dst = c.out + (t0 * c.Hq + r) * D;
    for (int v = 0; v < D / 16; ++v)
      agentflash_cpu::store_bf16_16(dst + 16 * v,
                                    _mm256_div_ps(_mm256_load_ps(o + 16 * v), total),
                                    _mm256_div_ps(_mm256_load_ps(o + 16 * v + 8), total));
  }
}

// Float storage for states: 32-byte aligned pieces carved from one buffer.
struct Arena {
  std::vector<float> data;
  static int64_t size(int64_t R, int64_t D) { return R * D + 2 * ((R + 7) / 8 * 8); }
  float* base() {
    return reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(data.data()) + 31) & ~static_cast<uintptr_t>(31));
  }
  void reserve(int64_t floats) { data.resize(floats + 8); }
  static State at(float* p, int64_t R, int64_t D) {
    const int64_t padded = (R + 7) / 8 * 8;
    return {p + R * D, p + R * D + padded, p};
  }
};

template <int D>
void attend_all_d(const AttentionCall& c) {
  const auto& runs = *c.runs;
  const int64_t n_runs = static_cast<int64_t>(runs.size());
  const auto rows_of = [&](size_t i) { return (runs[i].second - runs[i].first) * c.Hq; };
  std::vector<int64_t> most(runs.size());  // the most keys any of a run's queries sees
  for (size_t i = 0; i < runs.size(); ++i) most[i] = c.run(i, 0).longest();
  // whole runs per thread, folded as they go
  if (n_runs >= 2 * kernel_threads()) {
    parallel_for(0, n_runs, 1, [&](int64_t begin, int64_t end) {
      thread_local Arena qa, aa, sa;
      for (int64_t item = begin; item < end; ++item) {
        const size_t i = static_cast<size_t>(item);
        const int64_t R = rows_of(i);
        qa.reserve(R * D);
        aa.reserve(Arena::size(R, D));
        sa.reserve(Arena::size(R, D));
        const State acc = Arena::at(aa.base(), R, D), seg = Arena::at(sa.base(), R, D);
        widen_queries<D>(c, i, qa.base());
        attend_segment<D>(c, i, 0, std::min(most[i], kSegment), qa.base(), acc);
        for (int64_t s0 = kSegment; s0 < most[i]; s0 += kSegment) {
          attend_segment<D>(c, i, s0, std::min(most[i], s0 + kSegment), qa.base(), seg);
          fold<D>(acc, seg, R);
        }
        finish<D>(c, i, acc);
      }
    });
    return;
  }
  // few runs: a task per (run, segment), each state kept, then folded run by run
  std::vector<std::pair<size_t, int64_t>> tasks;  // (run, first key)
  std::vector<int64_t> offset;                    // of each task's state in the arena
  std::vector<int64_t> first_task(n_runs + 1);
  int64_t floats = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    first_task[i] = static_cast<int64_t>(tasks.size());
    for (int64_t s0 = 0; s0 < most[i]; s0 += kSegment) {
      tasks.emplace_back(i, s0);
      offset.push_back(floats);
      floats += Arena::size(rows_of(i), D);
    }
  }
  first_task[n_runs] = static_cast<int64_t>(tasks.size());
  thread_local Arena states;
  states.reserve(floats);
  float* base = states.base();
  parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local Arena qa;
    size_t widened = runs.size();  // the run whose queries qa holds (none yet)
    for (int64_t k = begin; k < end; ++k) {
      const auto [i, s0] = tasks[k];
      const int64_t R = rows_of(i);
      if (i != widened) {
        qa.reserve(R * D);
        widen_queries<D>(c, i, qa.base());
        widened = i;
      }
      attend_segment<D>(c, i, s0, std::min(most[i], s0 + kSegment), qa.base(),
                        Arena::at(base + offset[k], R, D));
    }
  });
  parallel_for(0, n_runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const size_t i = static_cast<size_t>(item);
      const int64_t R = rows_of(i);
      const int64_t k0 = first_task[i];
      const State acc = Arena::at(base + offset[k0], R, D);  // the first segment's state
      for (int64_t k = k0 + 1; k < first_task[i + 1]; ++k)
        fold<D>(acc, Arena::at(base + offset[k], R, D), R);
      finish<D>(c, i, acc);
    }
  });
}

}  // namespace

namespace agentflash_cpu {

void attend_all(const AttentionCall& call) {
  with_head_dim(call.D, [&](auto dim) { attend_all_d<decltype(dim)::value>(call); });
}

}  // namespace agentflash_cpu
