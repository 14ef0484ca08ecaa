// What the AMX kernels (amx/linear_amx.cpp, amx/attention_amx.cpp) share: the OS's grant of
// the tile state and a tile configuration.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace agentflash_cpu {

// Linux hands a process the AMX tile state only when asked (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); threads started later inherit it.
inline bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Palette 1 with tile t of rows[t] rows of colsb[t] bytes (unused tiles: 0).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void shape(int tile, int tile_rows, int bytes) {
    rows[tile] = static_cast<uint8_t>(tile_rows);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
  void load() const { _tile_loadconfig(this); }
};

}  // namespace agentflash_cpu
