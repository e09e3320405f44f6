// Register-blocked products for many rows (a prefill's experts): bf16 pairs with AVX512_BF16, the weight read as it
// is stored; fp32 FMAs on the other builds (AVX2, AVX-512), a tile's weight rows widened once (inline; used by
// moe.cpp's expert_mlps).
//
// The few-row kernels (gemv.h) keep a weight vector's sums per input row and reduce each output row's 16 lanes at
// its end: past 8 rows they read the weight once a pass of 8 and spend a horizontal sum a row and output. Here the
// lanes are 16 input rows instead: the rows are packed once as bf16 pairs ([pairs][16 rows], `pack_pairs`), a pair
// of one weight row is broadcast to all 16 lanes, and one VDPBF16PS adds the pair's two products to 16 rows' sums of
// that output. A tile of R blocks of 16 rows and N weight rows keeps R x N sums in registers (24 of the 32), loads
// R row vectors and N broadcasts a pair for R x N products, and never reduces across lanes: compute-bound, where
// oneDNN's bf16 GEMM on an expert's few hundred rows ran at about half the machine's bf16 peak. The weight needs no
// packing (a pair is 4 bytes of its row); the N rows of a tile (16 KB at 1024 inputs) stay in L1 while the tile
// walks the expert's row blocks.
#pragma once

#include "simd.h"

constexpr int64_t TILE_LANES = 16;  // rows a vector
constexpr int TILE_BLOCKS = 3;      // row blocks a tile (48 rows)
constexpr int TILE_OUTS = 8;        // weight rows a tile

#if defined(__AVX512BF16__)

// Rows [0, M) of x (ld bf16 apart; K and ld even) as pairs: block b (rows 16b to 16b + 15) at out + b * K * 8, pair
// j of it at out[b * K * 8 + j * 16 + lane] = the 32 bits of x[16b + lane][2j, 2j + 1]; rows past M zero.
static inline void pack_pairs(const B16* x, int64_t M, int64_t K, int64_t ld, uint32_t* out) {
  const int64_t J = K / 2;
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(ld / 2)));
  for (int64_t b = 0; b * TILE_LANES < M; ++b) {
    const int64_t rows = std::min<int64_t>(TILE_LANES, M - b * TILE_LANES);
    const __mmask16 m = rows == 16 ? 0xFFFF : static_cast<__mmask16>((1u << rows) - 1);
    const int32_t* base = reinterpret_cast<const int32_t*>(x + b * TILE_LANES * ld);
    uint32_t* o = out + b * J * TILE_LANES;
    for (int64_t j = 0; j < J; ++j)
      _mm512_storeu_si512(o + j * TILE_LANES, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + j, 4));
  }
}

// sums[r][n] = the sums over pairs [j0, j1) of row block r (x + r * J * 16, packed as `pack_pairs` packs: J pairs a
// block) with weight row w[n] (bf16, 2J values): 16 rows' sums of output n, fp32, each pair's two products added by
// one VDPBF16PS. Not inlined: the loop has the registers to itself (R x N sums, R row vectors, a broadcast).
template <int R, int N>
__attribute__((noinline)) static void tile_sums(const uint32_t* x, const B16* const* w, int64_t J, int64_t j0,
                                                int64_t j1, float (*sums)[N][TILE_LANES]) {
  __m512 acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = _mm512_setzero_ps();
  const int32_t* wp[N];
  for (int n = 0; n < N; ++n) wp[n] = reinterpret_cast<const int32_t*>(w[n]);
  for (int64_t j = j0; j < j1; ++j) {
    if ((j & 15) == 0)  // the weight rows a line ahead of the loads (a tenth faster at 16 and 32 rows an expert)
      for (int n = 0; n < N; ++n) _mm_prefetch(reinterpret_cast<const char*>(wp[n] + j + 32), _MM_HINT_T0);
    __m512bh xv[R];
    for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(x + (r * J + j) * TILE_LANES);
    for (int n = 0; n < N; ++n) {
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(wp[n][j]);
      for (int r = 0; r < R; ++r) acc[r][n] = _mm512_dpbf16_ps(acc[r][n], xv[r], wb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(sums[r][n], acc[r][n]);
}

// f(rb, std::integral_constant<int, R>) for groups of R (1 to TILE_BLOCKS) row blocks from rb, covering `blocks`:
// threes, and two twos where a one would be left (a tile of one block runs at about a third of the rate)
template <typename F>
static inline void for_block_groups(int64_t blocks, F&& f) {
  int64_t rb = 0;
  for (; blocks - rb >= 3 && blocks - rb != 4; rb += 3) f(rb, std::integral_constant<int, 3>{});
  for (; blocks - rb >= 2; rb += 2) f(rb, std::integral_constant<int, 2>{});
  if (rb < blocks) f(rb, std::integral_constant<int, 1>{});
}

// Two vectors of 16 rows' values (outputs 2j and 2j + 1) as pair j of those rows: each rounded to bf16 (to nearest
// even, as c10::BFloat16), the first in the low half of each lane.
static inline __m512i pair_of(__m512 lo, __m512 hi) {
  const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
  const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
  return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

// Outputs [0, nv) (nv <= 8) of `rows` (<= 16) rows, a[n] holding output n of the 16 rows (bf16 in 16-bit lanes),
// into y (row l at y + l * ld): the 8 x 16 values transposed in registers (three rounds of unpacks), each row's
// outputs one masked 16-byte store.
static inline void store_rows8(const __m256i (&a)[8], uint16_t* y, int64_t ld, int64_t rows, int nv) {
  __m256i b[8], c[8], d[8];
  for (int i = 0; i < 4; ++i) {  // b[2i], b[2i+1]: outputs 2i, 2i+1 interleaved, rows 0-3 / 4-7 of each half
    b[2 * i] = _mm256_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm256_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h)  // outputs 4h to 4h + 3: rows (0, 1), (2, 3), (4, 5), (6, 7) of each half
    for (int i = 0; i < 2; ++i) {
      c[4 * h + 2 * i] = _mm256_unpacklo_epi32(b[4 * h + i], b[4 * h + 2 + i]);
      c[4 * h + 2 * i + 1] = _mm256_unpackhi_epi32(b[4 * h + i], b[4 * h + 2 + i]);
    }
  for (int i = 0; i < 4; ++i) {  // d[2i], d[2i+1]: rows 2i, 2i + 1 (and 8 on in the high half), all 8 outputs
    d[2 * i] = _mm256_unpacklo_epi64(c[i], c[4 + i]);
    d[2 * i + 1] = _mm256_unpackhi_epi64(c[i], c[4 + i]);
  }
  const __mmask8 m = static_cast<__mmask8>((1u << nv) - 1);
  for (int64_t l = 0; l < rows; ++l)
    _mm_mask_storeu_epi16(y + l * ld, m, l < 8 ? _mm256_castsi256_si128(d[l]) : _mm256_extracti128_si256(d[l - 8], 1));
}

#else  // no bf16 products (AVX2 + FMA, AVX-512 without AVX512_BF16): the same tiles in fp32 FMAs

// Tiles of fp32 multiply-adds: lanes VW input rows (widened from bf16 once, `pack_rows_f32`), a weight value
// broadcast from a tile's N rows widened once into L1 (`widen_rows`), R x N sums in registers: 3 x 8 of AVX-512's
// 32 registers, 2 x 6 of AVX2's 16.
#if defined(__AVX512F__)
constexpr int TILE_F32_BLOCKS = 3, TILE_F32_OUTS = 8;
#else
constexpr int TILE_F32_BLOCKS = 2, TILE_F32_OUTS = 6;
#endif

// Rows [0, M) of x (ld bf16 apart; K and ld even) widened and packed: block b (rows VW b to VW b + VW - 1) at
// out + b * K * VW, input k of it at out[b * K * VW + k * VW + lane] = x[VW b + lane][k]; rows past M zero.
static inline void pack_rows_f32(const B16* x, int64_t M, int64_t K, int64_t ld, float* out) {
  const int64_t J = K / 2;
  for (int64_t b = 0; b * VW < M; ++b) {
    const int rows = static_cast<int>(std::min<int64_t>(VW, M - b * VW));
    const int32_t* base = reinterpret_cast<const int32_t*>(x + b * VW * ld);
    float* o = out + b * K * VW;
#if defined(__AVX512F__)
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(ld / 2)));
    const __mmask16 m = rows == 16 ? 0xFFFF : static_cast<__mmask16>((1u << rows) - 1);
    for (int64_t j = 0; j < J; ++j) {  // a pair of bf16 a lane: the low one is input 2j, the high one 2j + 1
      const __m512i p = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + j, 4);
      _mm512_storeu_ps(o + 2 * j * VW, _mm512_castsi512_ps(_mm512_slli_epi32(p, 16)));
      _mm512_storeu_ps(o + (2 * j + 1) * VW, _mm512_castsi512_ps(_mm512_and_si512(p, _mm512_set1_epi32(-65536))));
    }
#else
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_epi32(static_cast<int>(ld / 2)));
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t j = 0; j < J; ++j) {
      const __m256i p = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), base + j, idx, m, 4);
      _mm256_storeu_ps(o + 2 * j * VW, _mm256_castsi256_ps(_mm256_slli_epi32(p, 16)));
      _mm256_storeu_ps(o + (2 * j + 1) * VW, _mm256_castsi256_ps(_mm256_and_si256(p, _mm256_set1_epi32(-65536))));
    }
#endif
  }
}

// sums[r][n] = the sums over inputs [k0, k1) of row block r (x + r * K * VW, packed as `pack_rows_f32` packs) with
// weight row n of w ([N][K] fp32): VW rows' sums of output n. Not inlined: the loop has the registers to itself.
template <int R, int N>
__attribute__((noinline)) static void tile_sums_f32(const float* x, const float* w, int64_t K, int64_t k0, int64_t k1,
                                                    float (*sums)[N][VW]) {
  vf acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = vzero();
  for (int64_t k = k0; k < k1; ++k) {
    vf xv[R];
    for (int r = 0; r < R; ++r) xv[r] = vload(x + (r * K + k) * VW);
    for (int n = 0; n < N; ++n) {
      const vf wb = vset(w[n * K + k]);
      for (int r = 0; r < R; ++r) acc[r][n] = vfma(xv[r], wb, acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) vstore(sums[r][n], acc[r][n]);
}

// f(rb, std::integral_constant<int, R>) for groups of R (1 to TILE_F32_BLOCKS) row blocks from rb, covering `blocks`
template <typename F>
static inline void for_block_groups_f32(int64_t blocks, F&& f) {
  int64_t rb = 0;
  if constexpr (TILE_F32_BLOCKS == 3) {
    for (; blocks - rb >= 3 && blocks - rb != 4; rb += 3) f(rb, std::integral_constant<int, 3>{});
  }
  for (; blocks - rb >= 2; rb += 2) f(rb, std::integral_constant<int, 2>{});
  if (rb < blocks) f(rb, std::integral_constant<int, 1>{});
}

#endif
