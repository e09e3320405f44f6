// AMX tiles (Intel Sapphire Rapids on), inline, shared by the bf16 AMX linear (linears.cpp) and the prefill experts
// (moe.cpp).
#pragma once

#include <cstring>

#include "gemv.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: sums (row tile r, output block j) = 2r + j; 4-5: the row tiles; 6-7: the weight's two output blocks.
static TileConfig tile_config(int rows) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  const int r0 = std::min(rows, 16), r1 = rows - r0;
  for (int t : {0, 1, 4}) c.rows[t] = r0, c.colsb[t] = 64;
  for (int t : {6, 7}) c.rows[t] = 16, c.colsb[t] = 64;
  if (r1 > 0)
    for (int t : {2, 3, 5}) c.rows[t] = r1, c.colsb[t] = 64;
  return c;
}

// The experts' rows for AMX, where an expert has more rows than VDPBF16PS's passes take well (a prefill's): here
// the weight is the first operand, read as it is (a 16 x 32 tile is 16 outputs' next 32 inputs, rows I apart: no
// second copy of any expert), and the expert's rows are packed for the second (`amx_pack_rows`, once per pass).
// Row chunks of 16 (the last padded with zeros), for each 32 inputs a 16 x 32 tile whose row p holds the chunk's
// 16 rows' inputs 2p and 2p + 1 side by side.
static void amx_pack_rows(const B16* x, int64_t rows, int64_t I, B16* out) {
  const int64_t KB = I / 32;
  const B16 zero(0.0f);
  for (int64_t c = 0; c * 16 < rows; ++c)
    for (int64_t kb = 0; kb < KB; ++kb) {
      B16* tile = out + (c * KB + kb) * 512;
      for (int j = 0; j < 16; ++j) {
        const int64_t r = c * 16 + j;
        const B16* in = x + r * I + kb * 32;
        for (int p = 0; p < 16; ++p) {
          tile[p * 32 + 2 * j] = r < rows ? in[2 * p] : zero;
          tile[p * 32 + 2 * j + 1] = r < rows ? in[2 * p + 1] : zero;
        }
      }
    }
}

// Sums [output o][row j] of outputs [0, n) (n <= 32: the weight's rows at w, I apart) against `chunks` (1 or 2)
// packed row chunks at xp, into c. Tiles 0-3: sums (output tile i, chunk j) = 2i + j; 4-5: the weight; 6-7: rows.
static void amx_weight_rows(const B16* w, int n, const B16* xp, int chunks, int64_t I, float (*c)[32]) {
  const TileConfig cfg = tile_config(n);  // amx_linear's tiles, the weight's outputs in place of its rows
  _tile_loadconfig(&cfg);
  const int64_t KB = I / 32;
  const bool hi = n > 16, two = chunks > 1;
  _tile_zero(0);
  if (two) _tile_zero(1);
  if (hi) _tile_zero(2);
  if (hi && two) _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(4, w + kb * 32, I * 2);
    if (hi) _tile_loadd(5, w + 16 * I + kb * 32, I * 2);
    _tile_loadd(6, xp + kb * 512, 64);
    if (two) _tile_loadd(7, xp + (KB + kb) * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) _tile_dpbf16ps(1, 4, 7);
    if (hi) _tile_dpbf16ps(2, 5, 6);
    if (hi && two) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, &c[0][0], 128);
  if (two) _tile_stored(1, &c[0][16], 128);
  if (hi) _tile_stored(2, &c[16][0], 128);
  if (hi && two) _tile_stored(3, &c[16][16], 128);
}
#endif
