// The AMX implementation of `linear_amx` (kernels.h): y = x W^T (+ bias) (+ residual) for
// bfloat16 x and W by Intel AMX tile dot products (`tdpbf16ps`), on CPUs with AMX-BF16
// (Sapphire Rapids and later Xeons).
//
// Few rows of x (decode rows, verify blocks: fewer than kManyRows), the tiles compute
// y^T = W x^T: an A tile is 16 rows of W by 32 elements read in place (W's checkpoint layout,
// no packed copy), the B tile 32 elements of up to 16 rows of x laid out in pairs (x^T in
// AMX's VNNI order, built once a call; one row of x is that layout already), a C tile 16 rows
// of W by those rows of x in float32. Many rows (prefill chunks), y = x W^T: A tiles are x's
// rows read in place, B tiles W's rows in pairs (packed per call, a block at a time), C tiles
// y's own layout. Either way every output y[m, n] is accumulated by one `tdpbf16ps` per 32
// elements of K, in order, into its own C element, as x[m, 2p] W[n, 2p] + x[m, 2p + 1]
// W[n, 2p + 1] for p ascending, whose value does not depend on the tile's other elements: the
// same numbers whatever M, the path, the block of x it is in or the thread that computes it,
// so a verify block's rows are bitwise the decode steps' rows, and a prefill chunk's rows are
// the same whatever else shares its forward. Then the bias and the residual are added and the
// sum rounded once to bfloat16.
//
// Why: the AVX512-BF16 kernel (avx512-bf16/linear.cpp) reads W once a call but computes at
// `vdpbf16ps`'s rate, so a 16-row verify block costs ~4x a decode row; a tile does 16 rows in
// the time of one, and a call stays bound by reading W. At a prefill chunk's rows the first
// orientation's C tiles need gathering into y; the second's are stored as they are, and its
// linears keep up with oneDNN's (docs/performance.md, "AMX Xeon").
// Shapes the tiles do not cover (K not a multiple of 32, N not of 16) and processes the OS
// refuses the tile state to are left to the AVX512-BF16 kernel (linear_amx returns false): by
// shape and process, never by row count.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/kernels.h"
#include "../avx512/simd.h"
#include "tiles.h"

namespace {

using agentflash_cpu::TileConfig;
using agentflash_cpu::tiles_granted;
using agentflash_cpu::transpose16;
using agentflash_cpu::widen_bf16;

constexpr int64_t kRows = 16;   // rows of x in a B tile (and rows of W in an A tile)
constexpr int64_t kDepth = 32;  // elements of K a tile dot product takes
constexpr int kGroup = 4;       // C tiles a task keeps: 4 x 16 rows of W share each B tile

// y[m, n .. n + 15] = the 16 sums (+ bias) (+ residual), rounded once to bfloat16.
inline void store_outputs(const agentflash_cpu::LinearArgs& a, int64_t m, int64_t n,
                          __m512 sums) {
  if (a.bias != nullptr) sums = _mm512_add_ps(sums, _mm512_loadu_ps(a.bias + n));
  if (a.residual != nullptr) sums = _mm512_add_ps(sums, widen_bf16(a.residual + m * a.ldy + n));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.y + m * a.ldy + n),
                      (__m256i)_mm512_cvtneps_pbh(sums));
}

// Tiles 0-3: C (16 rows of W x `columns` rows of x, float32); 4: B (16 pairs of K x `columns`
// rows of x); 5, 6: A (16 rows of W x 32 elements of K). A tile's results are the same whatever
// its number of columns: each is its own dot product.
void configure_tiles(int64_t columns) {
  TileConfig config;
  for (int t = 0; t < 7; ++t) config.shape(t, kRows, t < 5 ? static_cast<int>(4 * columns) : 64);
  config.load();
}

// c[j] (16 x `columns` float32: row i, column m) = W[16 j + i, :] . x_m for the NB 16-row
// blocks of W from w; xv holds `columns` rows of x in pairs: xv[p][m] = (x[m, 2p], x[m, 2p + 1]).
template <int NB>
void dot_tiles(const uint16_t* xv, int64_t columns, const uint16_t* w, int64_t ldw, int64_t K,
               float* c) {
  const int64_t stride = ldw * 2;  // bytes between W's rows
  const int64_t pairs = 4 * columns;  // bytes between pairs of K in xv
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t k = 0; k < K; k += kDepth) {
    _tile_loadd(4, xv + k * columns, pairs);
    _tile_loadd(5, w + k, stride);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (NB > 1) {
      _tile_loadd(6, w + kRows * ldw + k, stride);
      _tile_dpbf16ps(1, 6, 4);
    }
    if constexpr (NB > 2) {
      _tile_loadd(5, w + 2 * kRows * ldw + k, stride);
      _tile_dpbf16ps(2, 5, 4);
    }
    if constexpr (NB > 3) {
      _tile_loadd(6, w + 3 * kRows * ldw + k, stride);
      _tile_dpbf16ps(3, 6, 4);
    }
  }
  const int64_t tile = kRows * columns;
  _tile_stored(0, c, pairs);
  if constexpr (NB > 1) _tile_stored(1, c + tile, pairs);
  if constexpr (NB > 2) _tile_stored(2, c + 2 * tile, pairs);
  if constexpr (NB > 3) _tile_stored(3, c + 3 * tile, pairs);
}

// Many rows of x: y = x W^T. An A tile is 16 rows of x by 32 elements read in place, a B tile
// 16 pairs of K by 16 rows of W (W^T in VNNI order, packed by the task that uses it), a C tile
// 16 rows of x by 16 rows of W in float32: y's own layout, stored without the gathers the
// other orientation needs.
constexpr int64_t kManyRows = 64;  // from this many rows of x on
constexpr int64_t kBlock = 32;     // rows of x, and of W, a task's tiles cover (2 x 2 C tiles)
constexpr int64_t kChunk = 16;     // blocks of x's rows a task covers

// W's rows [n0, n0 + 32) in pairs, zero past N (a multiple of 16): tile h (rows
// n0 + 16 h ..) of K step s is the 1 KB at out + (s * 2 + h) * 512, its row p the pairs
// 16 s + p of those 16 rows.
void pack_block(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, int64_t n0,
                uint16_t* out) {
  __m512i r[16], cols[16];
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t first = n0 + h * kRows;
    for (int64_t s = 0; s < K / kDepth; ++s) {
      uint16_t* tile = out + (s * 2 + h) * kRows * kDepth;
      if (first >= N) {
        for (int p = 0; p < kRows; ++p)
          _mm512_storeu_si512(tile + p * kDepth, _mm512_setzero_si512());
        continue;
      }
      for (int j = 0; j < kRows; ++j)
        r[j] = _mm512_loadu_si512(w + (first + j) * ldw + s * kDepth);
      transpose16(r, cols);
      for (int p = 0; p < kRows; ++p) _mm512_storeu_si512(tile + p * kDepth, cols[p]);
    }
  }
}

void configure_row_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.shape(t, kRows, 64);
  config.load();
}

// c (32 x 32 float32, row-major) = x's 32 rows from x (ldx apart) . the packed block's rows.
void row_tiles(const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t K, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += kDepth) {
    const uint16_t* b = packed + (k / kDepth) * 2 * kRows * kDepth;
    _tile_loadd(4, x + k, ldx * 2);
    _tile_loadd(5, x + kRows * ldx + k, ldx * 2);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + kRows * kDepth, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, kBlock * 4);
  _tile_stored(1, c + kRows, kBlock * 4);
  _tile_stored(2, c + kRows * kBlock, kBlock * 4);
  _tile_stored(3, c + kRows * kBlock + kRows, kBlock * 4);
}

void linear_many_rows(const agentflash_cpu::LinearArgs& a) {
  const int64_t M = a.M, K = a.K, N = a.N;
  const int64_t row_blocks = (M + kBlock - 1) / kBlock, col_blocks = (N + kBlock - 1) / kBlock;
  // a task: one block of W's rows, packed by it, over a chunk of x's rows (kept in L2; a thread
  // takes consecutive tasks, so the blocks of W of one chunk of x)
  const int64_t chunks = (row_blocks + kChunk - 1) / kChunk;
  // the last rows, zero-padded to a block once (their results are never read)
  const int64_t tail_rows = M % kBlock;
  thread_local std::vector<uint16_t> tail;
  if (tail_rows > 0) {
    tail.assign(kBlock * K, 0);
    for (int64_t i = 0; i < tail_rows; ++i) {
      const uint16_t* row = a.x + (M - tail_rows + i) * a.ldx;
      std::copy(row, row + K, tail.data() + i * K);
    }
  }
  const uint16_t* padded = tail.data();
  agentflash_cpu::parallel_for(0, chunks * col_blocks, 1, [&](int64_t t0, int64_t t1) {
    configure_row_tiles();
    thread_local std::vector<uint16_t> packed;
    packed.resize(kBlock * K);
    alignas(64) float c[kBlock * kBlock];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t cb = t % col_blocks, chunk = t / col_blocks;
      pack_block(a.w, a.ldw, N, K, cb * kBlock, packed.data());
      for (int64_t rb = chunk * kChunk; rb < std::min(row_blocks, (chunk + 1) * kChunk); ++rb) {
        const int64_t m0 = rb * kBlock, rows = std::min(kBlock, M - m0);
        const bool last = rows < kBlock;
        row_tiles(last ? padded : a.x + m0 * a.ldx, last ? K : a.ldx, packed.data(), K, c);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t m = m0 + i;
          for (int64_t h = 0; h < 2; ++h) {
            const int64_t n = cb * kBlock + h * kRows;
            if (n >= N) break;
            store_outputs(a, m, n, _mm512_load_ps(c + i * kBlock + h * kRows));
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace

namespace agentflash_cpu {

bool linear_amx(const LinearArgs& a) {
  if (a.w == nullptr || a.K % kDepth != 0 || a.N % kRows != 0 || !tiles_granted()) return false;
  if (a.M >= kManyRows) {
    linear_many_rows(a);
    return true;
  }
  const int64_t M = a.M, K = a.K, N = a.N;
  const int64_t blocks = (M + kRows - 1) / kRows;
  // x in pairs, 16 rows at a time (the last block has the rest): block b holds rows
  // 16 b .. 16 b + cols - 1 as xv[p][m] = x[16 b + m, 2p : 2p + 2]; one row is x itself
  thread_local std::vector<uint32_t> pairs;
  const uint16_t* xv = a.x;
  if (M > 1) {
    pairs.resize(M * (K / 2));
    for (int64_t m = 0; m < M; ++m) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(a.x + m * a.ldx);
      const int64_t b = m / kRows, cols = std::min(kRows, M - b * kRows);
      uint32_t* dst = pairs.data() + b * kRows * (K / 2) + m % kRows;
      for (int64_t p = 0; p < K / 2; ++p) dst[p * cols] = row[p];
    }
    xv = reinterpret_cast<const uint16_t*>(pairs.data());
  }
  const int64_t span = kGroup * kRows;  // rows of W a task's step covers
  const int64_t groups = (N + span - 1) / span;
  agentflash_cpu::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float c[kGroup * kRows * kRows];
    int64_t configured = 0;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * span;
      const int nb = static_cast<int>(std::min<int64_t>(kGroup, (N - n0) / kRows));
      const uint16_t* w = a.w + n0 * a.ldw;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t cols = std::min(kRows, M - b * kRows);
        if (cols != configured) {
          configure_tiles(cols);
          configured = cols;
        }
        const uint16_t* block = xv + b * kRows * K;
        switch (nb) {
          case 4: dot_tiles<4>(block, cols, w, a.ldw, K, c); break;
          case 3: dot_tiles<3>(block, cols, w, a.ldw, K, c); break;
          case 2: dot_tiles<2>(block, cols, w, a.ldw, K, c); break;
          default: dot_tiles<1>(block, cols, w, a.ldw, K, c); break;
        }
        // y[m, n0 + 16 j + i] = c[(16 j + i) * cols + m]: 16 outputs cols apart
        const __m512i column = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(static_cast<int>(cols)));
        for (int64_t i = 0; i < cols; ++i) {
          const int64_t m = b * kRows + i;
          for (int j = 0; j < nb; ++j) {
            const int64_t n = n0 + j * kRows;
            const float* sums_at = c + j * kRows * cols + i;
            store_outputs(a, m, n, cols == 1 ? _mm512_loadu_ps(sums_at)
                                             : _mm512_i32gather_ps(column, sums_at, 4));
          }
        }
      }
    }
    _tile_release();
  });
  return true;
}

}  // namespace agentflash_cpu
