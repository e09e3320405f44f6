// int8 x int8 products with AVX512_VNNI (VPDPBUSD), inline, shared by the W8A8 linear (quantized.cpp), the W8A8
// experts (moe.cpp) and the int8 head screens (heads.cpp).
#pragma once

#include "gemv.h"

#if defined(__AVX512VNNI__)
//
// VPDPBUSD adds 64 products of unsigned by signed bytes an instruction (VDPBF16PS: 32 bf16 pairs): the greedy head's
// screen past a few rows (`screen_argmax_vnni`) and W8A8 linears and experts (`w8a8_linear`, `expert_mlps`), whose
// inputs are rounded to int8 one scale a row (s = max |x| / 127) and stored + 128 as unsigned bytes; the sums less
// 128 times the weight row's sum of q are exact int32.
//
// The int8 copy is kept in tiles of VNNI_TILE = 64 outputs (`vnni_pack`): for each 4 inputs, the 64 outputs' 4
// bytes side by side, 256 bytes; a tile is one sequential stream. For each chunk of VNNI_CHUNK inputs of a tile (64
// KB: read from memory by the first pass, from L2 by the others), passes of up to 6 rows of x hold 6 x 4
// accumulators (16 outputs each) in registers: each 256 bytes of weight loaded serve the pass's rows, each 4 bytes
// of x broadcast serve 64 outputs: twice the multiply-adds an instruction of oneDNN's bf16 GEMM of the layer.

// R rows of x (unsigned bytes, rows I4 apart) times a tile's 4-input steps [s0, s1) into acc [R][64] int32. No
// software prefetch: the hardware's follows a tile's one stream (prefetchnta 2 KB ahead, as the bf16 kernels read,
// made every row count slower).
template <int R>
static void vnni_rows(const uint8_t* xu, int64_t I4, const int8_t* tile, int64_t s0, int64_t s1, int32_t* acc) {
  __m512i c[R * 4];
#pragma GCC unroll 32
  for (int k = 0; k < R * 4; ++k) c[k] = _mm512_loadu_si512(acc + 16 * k);
  const int8_t* p = tile + s0 * 256;
  const uint8_t* xp = xu + 4 * s0;
  for (int64_t s = s0; s < s1; ++s, p += 256, xp += 4) {
    const __m512i w0 = _mm512_loadu_si512(p), w1 = _mm512_loadu_si512(p + 64), w2 = _mm512_loadu_si512(p + 128),
                  w3 = _mm512_loadu_si512(p + 192);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, xp + r * I4, 4);
      const __m512i b = _mm512_set1_epi32(four);
      c[4 * r] = _mm512_dpbusd_epi32(c[4 * r], b, w0);
      c[4 * r + 1] = _mm512_dpbusd_epi32(c[4 * r + 1], b, w1);
      c[4 * r + 2] = _mm512_dpbusd_epi32(c[4 * r + 2], b, w2);
      c[4 * r + 3] = _mm512_dpbusd_epi32(c[4 * r + 3], b, w3);
    }
  }
#pragma GCC unroll 32
  for (int k = 0; k < R * 4; ++k) _mm512_storeu_si512(acc + 16 * k, c[k]);
}

// every row of x (M <= VNNI_MAX_ROWS) times one tile: acc [M][64], exact int32 sums of (x + 128) q; the rows in
// passes of even sizes up to VNNI_PASS (32 rows: 6, 6, 5, 5, 5, 5), each pass over a chunk of VNNI_CHUNK inputs
static void vnni_tile(const uint8_t* xu, int64_t M, int64_t I4, const int8_t* tile, int32_t* acc) {
  std::memset(acc, 0, sizeof(int32_t) * M * 64);
  const int64_t S = I4 / 4, step = VNNI_CHUNK / 4, passes = (M + VNNI_PASS - 1) / VNNI_PASS;
  for (int64_t s0 = 0; s0 < S; s0 += step) {
    const int64_t s1 = std::min(S, s0 + step);
    for (int64_t p = 0, r = 0; p < passes; ++p) {
      const int64_t rows = M / passes + (p < M % passes);
      const uint8_t* xr = xu + r * I4;
      int32_t* ar = acc + r * 64;
      r += rows;
      switch (rows) {
        case 1: vnni_rows<1>(xr, I4, tile, s0, s1, ar); break;
        case 2: vnni_rows<2>(xr, I4, tile, s0, s1, ar); break;
        case 3: vnni_rows<3>(xr, I4, tile, s0, s1, ar); break;
        case 4: vnni_rows<4>(xr, I4, tile, s0, s1, ar); break;
        case 5: vnni_rows<5>(xr, I4, tile, s0, s1, ar); break;
        default: vnni_rows<6>(xr, I4, tile, s0, s1, ar); break;
      }
    }
  }
}

// Rows of x [M, I] (fp32 or bf16) rounded to int8, one scale a row (vLLM's dynamic per-token W8A8: s = max |x| / 127,
// q = round(x / s), ties to even) -> xu [M, I4] (q + 128; zeros past I stored as 128, q = 0) and xs [M] (s; 1 for a
// row of zeros; NaN for a row that is not finite, so that its outputs are NaN as F.linear's would be).
template <typename T>
static void int8_rows_of(const T* x, int64_t M, int64_t I, int64_t I4, uint8_t* xu, float* xs) {
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) {
      const T* r = x + m * I;
      float amax = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < I; ++i) {
        const float v = static_cast<float>(r[i]);
        finite = finite && std::isfinite(v);
        amax = std::max(amax, std::fabs(v));
      }
      const float s = !finite ? std::numeric_limits<float>::quiet_NaN() : amax > 0.0f ? amax / 127.0f : 1.0f;
      uint8_t* u = xu + m * I4;
      for (int64_t i = 0; i < I; ++i) {
        const float v = std::nearbyint(static_cast<float>(r[i]) / s);
        u[i] = static_cast<uint8_t>(static_cast<int>(std::max(-127.0f, std::min(127.0f, v))) + 128);
      }
      for (int64_t i = I; i < I4; ++i) u[i] = 128;
      xs[m] = s;
    }
  });
}

// A W8A8 weight as the kernels take it: `packed` its int8 values in vnni_pack's tiles, `scale` fp32 [2, O]: row 0
// each output row's scale, row 1 the row's sum of its int8 values (exact in fp32: |sum| <= 127 I < 2^24)
struct W8A8 {
  const int8_t* packed;
  const float* scale;
  const float* colsum;
  int64_t O, I4, T;
};

static W8A8 w8a8_of(const at::Tensor& packed, const at::Tensor& scale, int64_t I) {
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == 2 && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "w8a8: scale fp32 [2, out] (the row scales, then the rows' sums of q)");
  const int64_t O = scale.size(1), I4 = (I + 3) / 4 * 4, T = (O + VNNI_TILE - 1) / VNNI_TILE;
  TORCH_CHECK(I <= 65536, "w8a8: at most 65536 inputs (the int32 sums)");
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.numel() == T * I4 * VNNI_TILE && packed.device().is_cpu(),
              "w8a8: the weight as vnni_pack packs an int8 [", O, ", ", I, "] one");
  const float* sp = scale.data_ptr<float>();
  return {packed.data_ptr<int8_t>(), sp, sp + O, O, I4, T};
}

// Tile t of w for rows [0, M) (any number: VNNI_MAX_ROWS at a time) of xu/xs -> out(m, o0, n, v): v 16 lanes of
// outputs o0 .. o0 + n (n <= 16) of row m, float(sum) * scale[o] * xs[m] in fp32
template <typename Out>
static void w8a8_tile(const W8A8& w, int64_t t, const uint8_t* xu, const float* xs, int64_t M, int32_t* acc,
                      const Out& out) {
  const int8_t* tile = w.packed + t * w.I4 * VNNI_TILE;
  const int64_t o0 = t * VNNI_TILE, n = std::min(VNNI_TILE, w.O - o0);
  for (int64_t r = 0; r < M; r += VNNI_MAX_ROWS) {
    const int64_t rows = std::min(VNNI_MAX_ROWS, M - r);
    vnni_tile(xu + r * w.I4, rows, w.I4, tile, acc);
    for (int64_t j = 0; j < n; j += 16) {
      const int64_t k = std::min<int64_t>(16, n - j);
      const __mmask16 mask = static_cast<__mmask16>(k >= 16 ? 0xFFFF : (1u << k) - 1);
      const __m512i c128 = _mm512_slli_epi32(_mm512_cvtps_epi32(_mm512_maskz_loadu_ps(mask, w.colsum + o0 + j)), 7);
      const __m512 sc = _mm512_maskz_loadu_ps(mask, w.scale + o0 + j);
      for (int64_t m = 0; m < rows; ++m) {
        const __m512i dot = _mm512_sub_epi32(_mm512_loadu_si512(acc + m * 64 + j), c128);
        out(r + m, o0 + j, k, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), sc), _mm512_set1_ps(xs[r + m])));
      }
    }
  }
}

// 16 floats (the first n) rounded to T and stored at p
template <typename T>
static inline void store_n(T* p, __m512 v, int64_t n) {
  alignas(64) float f[16];
  _mm512_store_ps(f, v);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(f[i]);
}
#endif
