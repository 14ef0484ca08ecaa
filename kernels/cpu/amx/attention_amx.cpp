// The AMX implementation of `attend_all_amx` (kernels.h): paged attention whose dot products
// are AMX tile dot products (`tdpbf16ps`), on CPUs with AMX-BF16.
//
// As in avx512-bf16/attention.cpp (attention_blocks.h): one task per (run of queries, KV head),
// keys packed once per call (keys in pairs of elements, values in pairs of keys: the layouts
// AMX's B tiles take), an online softmax per query head. Here the keys go in spans of 64 at
// fixed positions (0, 64, 128, ...), one softmax step each, and the run's query heads 16 rows to
// a tile: a span's scores for 16 rows are 4 x D / 32 tile dot products (A: the rows' queries,
// B: the packed keys of a block of 16), its weighted values 2 x D / 16 more (A: the rows'
// weights of 32 keys rounded to bfloat16, B: their packed values), each output element its own
// dot product in a fixed order. Every row's numbers depend only on its query, its keys and how
// many it sees, never on the other rows of its tile, the call or the thread: a verify block's
// rows are bitwise the decode steps' rows. A decode row fills one row of its tile (its G heads
// G rows); a 16-query verify block at G = 3 fills three tiles for about the work of one. A span
// of 64 keys (against the AVX512-BF16 kernel's 16) rescales each row's output a quarter as
// often and keeps four tile products in flight (docs/performance.md, "AMX Xeon").

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../avx512-bf16/attention_blocks.h"
#include "tiles.h"

namespace agentflash_cpu {
namespace {

constexpr int kTileRows = 16;
constexpr int kSpan = 64;                 // keys per softmax step: 4 packed blocks of 16
constexpr int kParts = kSpan / kBlock;

template <int D>
using Span = PackedBlock<D, kParts>;  // the span's 64 keys and values

// Every tile 16 rows x 64 bytes. Tiles 0-3: C (16 rows x 16 float32: the scores of a block of
// 16 keys each, then 16 elements of the weighted values each). For the scores, 4: the rows'
// queries (16 x 32 elements), 5-7: keys (16 pairs of elements x 16 keys); for the weighted
// values, 6: the rows' weights of 32 keys (16 x 32), 4, 5, 7: values (16 pairs of keys x 16
// elements).
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.shape(t, kTileRows, 64);
  config.load();
}

// scores (16 rows x 64 keys, float32) = the tile's queries . the first `parts` blocks' keys
// (C tiles 0-3 a block each; the keys through tiles 5-7 in turn, so loads overlap products)
template <int D>
void score_tiles(const uint16_t* queries, const Span<D>& span, int parts, float* scores) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int c = 0; c < D / 32; ++c) {
    const __m512i* keys = span.keys + 16 * c;
    _tile_loadd(4, queries + 32 * c, 2 * D);
    _tile_loadd(5, keys, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (parts > 1) {
      _tile_loadd(6, keys + D / 2, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (parts > 2) {
      _tile_loadd(7, keys + D, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (parts > 3) {
      _tile_loadd(5, keys + 3 * (D / 2), 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  constexpr int stride = kSpan * sizeof(float);
  _tile_stored(0, scores, stride);
  _tile_stored(1, scores + kBlock, stride);
  _tile_stored(2, scores + 2 * kBlock, stride);
  _tile_stored(3, scores + 3 * kBlock, stride);
}

// weighted (16 rows x D, float32) = the slots' weights (16 x 64 keys, bfloat16) . the span's
// values, over its first `halves` 32 keys: 64 elements at a time in C tiles 0-3, each summed
// over the halves in order; the values through tiles 4, 5, 7 in turn
template <int D>
void weigh_tiles(const uint16_t* weights, const Span<D>& span, int halves, float* weighted) {
  constexpr int chunks = D / 16;
  for (int c0 = 0; c0 < chunks; c0 += 4) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int h = 0; h < halves; ++h) {
      const __m512i* values = span.values + 16 * h * chunks + c0;
      _tile_loadd(6, weights + 32 * h, kSpan * sizeof(uint16_t));
      _tile_loadd(4, values, chunks * 64);
      _tile_dpbf16ps(0, 6, 4);
      if (c0 + 1 < chunks) {
        _tile_loadd(5, values + 1, chunks * 64);
        _tile_dpbf16ps(1, 6, 5);
      }
      if (c0 + 2 < chunks) {
        _tile_loadd(7, values + 2, chunks * 64);
        _tile_dpbf16ps(2, 6, 7);
      }
      if (c0 + 3 < chunks) {
        _tile_loadd(4, values + 3, chunks * 64);
        _tile_dpbf16ps(3, 6, 4);
      }
    }
    constexpr int stride = D * sizeof(float);
    _tile_stored(0, weighted + 16 * c0, stride);
    if (c0 + 1 < chunks) _tile_stored(1, weighted + 16 * (c0 + 1), stride);
    if (c0 + 2 < chunks) _tile_stored(2, weighted + 16 * (c0 + 2), stride);
    if (c0 + 3 < chunks) _tile_stored(3, weighted + 16 * (c0 + 3), stride);
  }
}

// A row's 64 scores scaled in place, -inf past the `valid` keys it sees; returns their
// elementwise maximum over the span's four blocks.
inline __m512 scale_scores(float* scores, float scale, int valid) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = neg_inf;
#pragma GCC unroll 4
  for (int q = 0; q < kParts; ++q) {
    const int live = std::clamp(valid - q * kBlock, 0, kBlock);
    const __m512 x = _mm512_mask_blend_ps(static_cast<__mmask16>((1u << live) - 1), neg_inf,
                                          _mm512_mul_ps(_mm512_load_ps(scores + q * kBlock),
                                                        _mm512_set1_ps(scale)));
    _mm512_store_ps(scores + q * kBlock, x);
    top = _mm512_max_ps(top, x);
  }
  return top;
}

template <int D>
void attend(const KvSource& src, const QueryRun& run) {
  Span<D> span_kv;
  const int64_t R = (run.t1 - run.t0) * run.G;
  const int64_t tiles = (R + kTileRows - 1) / kTileRows;
  thread_local Rows st;
  st.reset(R, D);
  // the run's query heads as rows (row r: query t0 + r / G, head r % G), 16 to a tile; the
  // last tile's rows past R are left as they are (their results are never read)
  thread_local std::vector<uint16_t> qs;
  qs.resize(tiles * kTileRows * D);
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(qs.data() + r * D,
                run.q + ((run.t0 + r / run.G) * run.Hq + run.g * run.G + r % run.G) * D,
                D * sizeof(uint16_t));
  configure_tiles();
  alignas(64) float scores[kTileRows * kSpan];
  alignas(64) uint16_t weights[kTileRows * kSpan];
  alignas(64) float weighted[kTileRows * D];
  const int64_t longest = run.longest();
  KeyChunks<kSpan, false> chunks(src, run.g, D, longest);
  for (int64_t k0 = 0; k0 < longest; k0 += kSpan) {
    const int in_span = chunks.advance(k0);
    const int parts = (in_span + kBlock - 1) / kBlock;
    span_kv.pack(chunks.kr, chunks.vr, in_span);
    for (int64_t tile = 0; tile < tiles; ++tile) {
      // the tile's rows that see any of this span's keys (rows that see none are left
      // untouched, as in a call without them), slot j for row[j] at tile position at[j]
      int64_t row[kTileRows];
      int at[kTileRows], valid[kTileRows];
      int n = 0;
      for (int i = 0; i < kTileRows; ++i) {
        const int64_t r = tile * kTileRows + i;
        if (r >= R) break;
        const int64_t seen = run.keys[run.t0 + r / run.G];
        if (seen <= k0) continue;
        row[n] = r;
        at[n] = i;
        valid[n] = static_cast<int>(std::min<int64_t>(kSpan, seen - k0));
        ++n;
      }
      if (n == 0) continue;
      score_tiles<D>(qs.data() + tile * kTileRows * D, span_kv, parts, scores);
      // the online softmax step over the span: each row's maximum and sum by the same
      // cross-lane trees whatever its slot (avx512/simd.h), so its numbers are its own
      alignas(64) float old_max[16] = {}, old_sum[16] = {}, top[16], rescale[16];
      __m512 v[16];
      for (int j = 0; j < 16; ++j) {
        if (j < n) {
          old_max[j] = st.max[row[j]];
          old_sum[j] = st.sum[row[j]];
          v[j] = scale_scores(scores + at[j] * kSpan, run.scale, valid[j]);
        } else {
          v[j] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        }
      }
      const __m512 m = _mm512_max_ps(_mm512_load_ps(old_max), lane_maxes(v));
      _mm512_store_ps(top, m);
      _mm512_store_ps(rescale, exp16(_mm512_sub_ps(_mm512_load_ps(old_max), m)));
      for (int j = 0; j < 16; ++j) {
        if (j >= n) {
          v[j] = _mm512_setzero_ps();
          continue;
        }
        const float* scaled = scores + at[j] * kSpan;
        const __m512 t = _mm512_set1_ps(top[j]);
        __m512 p[kParts];
#pragma GCC unroll 4
        for (int q = 0; q < kParts; ++q) {
          p[q] = exp16(_mm512_sub_ps(_mm512_load_ps(scaled + q * kBlock), t));
          store_bf16(weights + j * kSpan + q * kBlock, p[q]);
        }
        v[j] = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
      }
      alignas(64) float sum[16];
      _mm512_store_ps(sum, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(old_sum),
                                                       _mm512_load_ps(rescale)),
                                         lane_sums(v)));
      for (int j = 0; j < n; ++j) {
        st.max[row[j]] = top[j];
        st.sum[row[j]] = sum[j];
      }
      // the weighted values of slots 0 .. n-1 (rows past n hold stale weights: their
      // results are never read)
      weigh_tiles<D>(weights, span_kv, (parts + 1) / 2, weighted);
      for (int j = 0; j < n; ++j) {
        float* out = st.out.data() + row[j] * D;
        const __m512 factor = _mm512_set1_ps(rescale[j]);
#pragma GCC unroll 16
        for (int c = 0; c < D / 16; ++c)
          _mm512_storeu_ps(out + 16 * c,
                           _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(out + 16 * c), factor),
                                         _mm512_load_ps(weighted + j * D + 16 * c)));
      }
    }
  }
  _tile_release();
  store_rows<D>(st, run);
}

}  // namespace

bool attend_all_amx(const AttentionCall& call) {
  if (!tiles_granted()) return false;
  attend_per_kv_head(call, [](auto dim, const KvSource& src, const QueryRun& run) {
    attend<decltype(dim)::value>(src, run);
  });
  return true;
}

}  // namespace agentflash_cpu
