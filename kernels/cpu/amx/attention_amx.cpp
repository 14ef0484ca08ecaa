// The AMX implementation of `attend_all_amx` (kernels.h): paged attention whose dot products
// are AMX tile dot products (`tdpbf16ps`), on CPUs with AMX-BF16.
//
// As in avx512-bf16/attention.cpp (attention_blocks.h): one task per (run of queries, KV head),
// keys in blocks of 16 at fixed positions, each block packed once (keys in pairs of elements,
// values in pairs of keys: the layouts AMX's B tiles take), an online softmax per query head.
// Here the run's query heads go 16 rows to a tile: a block's scores for 16 rows are D / 32 tile
// dot products (A: the rows' queries, B: the packed keys), and its weighted values D / 16 more
// (A: the rows' weights rounded to bfloat16, B: the packed values), each output element its own
// dot product in a fixed order. Every row's numbers depend only on its query, its keys and how
// many it sees, never on the other rows of its tile, the call or the thread: a verify block's
// rows are bitwise the decode steps' rows. A decode row fills one row of its tile (its G heads
// G rows); a 16-query verify block at G = 3 fills three tiles for about the work of one.

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

// Tile 0: C (16 rows x 16 float32); 1: the rows' queries (16 x 32 elements); 2: the packed keys
// (16 pairs of elements x 16 keys); 3: the rows' weights (16 x 16 keys); 4: the packed values
// (8 pairs of keys x 16 elements).
void configure_tiles() {
  TileConfig config;
  config.shape(0, kTileRows, 64);
  config.shape(1, kTileRows, 64);
  config.shape(2, 16, 64);
  config.shape(3, kTileRows, 2 * kBlock);
  config.shape(4, kBlock / 2, 64);
  config.load();
}

template <int D>
void attend(const KvSource& src, const QueryRun& run) {
  PackedBlock<D> block;
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
  alignas(64) float scores[kTileRows * kBlock];
  alignas(64) uint16_t weights[kTileRows * kBlock];
  alignas(64) float weighted[kTileRows * D];
  const int64_t longest = run.longest();
  KeyChunks<kBlock> blocks(src, run.g, D, longest);
  for (int64_t k0 = 0; k0 < longest; k0 += kBlock) {
    const int in_block = blocks.advance(k0);
    block.pack(blocks.kr, blocks.vr, in_block);
    for (int64_t tile = 0; tile < tiles; ++tile) {
      // the tile's rows that see any of this block's keys (rows that see none are left
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
        valid[n] = static_cast<int>(std::min<int64_t>(kBlock, seen - k0));
        ++n;
      }
      if (n == 0) continue;
      _tile_zero(0);
      for (int c = 0; c < D / 32; ++c) {
        _tile_loadd(1, qs.data() + (tile * kTileRows) * D + 32 * c, 2 * D);
        _tile_loadd(2, block.keys + 16 * c, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, scores, 64);
      __m512 s[16], p[16];
      const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        if (j < n) {
          const __mmask16 live = static_cast<__mmask16>((1u << valid[j]) - 1);
          s[j] = _mm512_mask_blend_ps(
              live, neg_inf,
              _mm512_mul_ps(_mm512_load_ps(scores + at[j] * kBlock), _mm512_set1_ps(run.scale)));
        } else {
          s[j] = neg_inf;
        }
      }
      alignas(64) float rescale[16];
      softmax_step(st, row, n, s, p, rescale);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)  // slots past n hold zeros
        _mm256_store_si256(reinterpret_cast<__m256i*>(weights + j * kBlock),
                           (__m256i)_mm512_cvtneps_pbh(p[j]));
      _tile_loadd(3, weights, 2 * kBlock);
      for (int c = 0; c < D / 16; ++c) {
        _tile_zero(0);
        _tile_loadd(4, block.values + c, (D / 16) * 64);
        _tile_dpbf16ps(0, 3, 4);
        _tile_stored(0, weighted + 16 * c, D * sizeof(float));
      }
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
