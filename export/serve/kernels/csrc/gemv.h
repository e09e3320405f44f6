// The few-row GEMV kernels, inline, shared by every op that streams a weight (linears, quantised linears, experts,
// the head screens): output rows read start to end, one sequential stream a thread, each loaded weight vector
// multiplied with every input row's (1 to MAX_ROWS rows, in L1), fp32 sums, one rounding to the output. Templates
// on the weight's type (fp32, bf16, int8, packed int4), the row count and where a row's sum goes (`Out`).
#pragma once

#include <type_traits>

#include "kernels.h"
#include "simd.h"


// Where a row's sum goes: y[m, o] in W with the bias added in fp32, one rounding (`linear`); or, in fp32, times the
// row's scale (the int8 head screen's approximate sums, `screen_argmax`).
template <typename W>
struct ToBiased {
  const W* bias;
  W* y;
  int64_t O;
  void operator()(int64_t m, int64_t o, float s) const {
    y[m * O + o] = static_cast<W>(bias ? s + static_cast<float>(bias[o]) : s);
  }
};
struct ToScaled {
  const float* scale;
  float* y;
  int64_t O;
  void operator()(int64_t m, int64_t o, float s) const { y[m * O + o] = s * scale[o]; }
};

// int8 weights' sums (pipeline/quantize.py `quantize_int8`): times the output row's scale, plus the bias, rounded
// once to W
template <typename W>
struct ToDequantized {
  const float* scale;
  const W* bias;
  W* y;
  int64_t O;
  void operator()(int64_t m, int64_t o, float s) const {
    const float v = s * scale[o];
    y[m * O + o] = static_cast<W>(bias ? v + static_cast<float>(bias[o]) : v);
  }
};

// Whether the weight vector at i + u * VW starts a prefetch: a line per 64 bytes (fp32 every vector; bf16 every
// other; int8 every line's first)
template <typename W>
static inline bool prefetches(int64_t i, int u) {
  return sizeof(W) == 4 || (sizeof(W) == 2 ? u % 2 == 0 : (i + u * VW) % 64 == 0);
}

// One input row (batch-1 decode): output rows one after another, each read start to end with U independent sums,
// so a thread's share of the weight is one sequential stream. The hardware prefetcher follows one stream far
// better than GROUP interleaved rows of a few KB each (in bf16, a fifth more GB/s when the memory is fast).
template <typename W, typename Out>
static void row1(const W* w, const float* x, int64_t I, int64_t o0, int64_t o1, const Out& out) {
  constexpr int U = 4;
  for (int64_t o = o0; o < o1; ++o) {
    const W* wr = w + o * I;
    vf acc[U];
    for (int u = 0; u < U; ++u) acc[u] = vzero();
    int64_t i = 0;
    for (; i + U * VW <= I; i += U * VW)
      for (int u = 0; u < U; ++u) {
        if (prefetches<W>(i, u)) ahead(wr + i + u * VW);
        acc[u] = vfma(vload(wr + i + u * VW), vload(x + i + u * VW), acc[u]);
      }
    for (; i + VW <= I; i += VW) acc[0] = vfma(vload(wr + i), vload(x + i), acc[0]);
    float s = vsum(acc[0] + acc[1] + acc[2] + acc[3]);
    for (; i < I; ++i) s += static_cast<float>(wr[i]) * x[i];
    out(0, o, s);
  }
}

// 2-8 input rows: as row1, each output row's weight read start to end once (one sequential stream a thread), every
// input row's x (M rows, in L1) multiplied with each loaded vector, U independent sums per input row. Reading
// GROUP rows side by side instead (a weight vector of each, then all of x) ran at about half this speed: the
// hardware prefetcher does not follow GROUP streams.
template <typename W, int M, typename Out>
static void rows(const W* w, const float* x, int64_t I, int64_t o0, int64_t o1, const Out& out) {
  constexpr int U = M <= 2 ? 4 : M <= 4 ? 2 : 1;  // M x U sums in registers
  for (int64_t o = o0; o < o1; ++o) {
    const W* wr = w + o * I;
    vf acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = vzero();
    int64_t i = 0;
    for (; i + U * VW <= I; i += U * VW)
      for (int u = 0; u < U; ++u) {
        if (prefetches<W>(i, u)) ahead(wr + i + u * VW);
        const vf wv = vload(wr + i + u * VW);
        for (int m = 0; m < M; ++m) acc[m][u] = vfma(wv, vload(x + m * I + i + u * VW), acc[m][u]);
      }
    for (; i + VW <= I; i += VW) {
      const vf wv = vload(wr + i);
      for (int m = 0; m < M; ++m) acc[m][0] = vfma(wv, vload(x + m * I + i), acc[m][0]);
    }
    for (int m = 0; m < M; ++m) {
      vf v = acc[m][0];
      for (int u = 1; u < U; ++u) v = v + acc[m][u];
      float s = vsum(v);
      for (int64_t j = i; j < I; ++j) s += static_cast<float>(wr[j]) * x[m * I + j];
      out(m, o, s);
    }
  }
}

// f(std::integral_constant<int, M>) for M (1 to MAX_ROWS) input rows: a kernel instantiated for that many
template <typename F>
static void for_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>());
    case 2: return f(std::integral_constant<int, 2>());
    case 3: return f(std::integral_constant<int, 3>());
    case 4: return f(std::integral_constant<int, 4>());
    case 5: return f(std::integral_constant<int, 5>());
    case 6: return f(std::integral_constant<int, 6>());
    case 7: return f(std::integral_constant<int, 7>());
    default: return f(std::integral_constant<int, 8>());
  }
}

// M (1 to MAX_ROWS) input rows: the kernel instantiated for that many.
template <typename W, typename Out>
static void rows_any(int64_t M, const W* w, const float* x, int64_t I, int64_t o0, int64_t o1, const Out& out) {
  if (M == 1) return row1<W>(w, x, I, o0, o1, out);
  for_rows(M, [&](auto m) { rows<W, decltype(m)::value>(w, x, I, o0, o1, out); });
}

#if defined(__AVX512BF16__)
// bf16 weight and x as they are: VDPBF16PS multiplies 32 bf16 pairs and adds them into 16 fp32 sums in one
// instruction, with no widening. The shift-and-FMA path above is compute-bound in bf16 (a thread reads bf16 slower
// than fp32 there); this one reads nearly twice as fast.

// One input row, bf16: row1's sequential stream with VDPBF16PS, U independent sums of 32 pairs each. U = 2 with the
// non-temporal prefetch (AMD): on Zen 4 it read a fifth or more GB/s than U = 4 for every weight shape of the peer
// benchmark's Qwen3-MoE (the variants alternated in one process); U = 1 about as fast, U = 8 between. Intel's (T0)
// build keeps 4, as it was measured there (docs/serving.md, "CPU kernels").
#if defined(MOE_PREFETCH_T0)
constexpr int DP_SUMS = 4;
#else
constexpr int DP_SUMS = 2;
#endif
// One row's sum of U independent sums of 32 pairs (the weight prefetched ahead where `Ahead`): row1_dp's, and the
// screens' re-check of one candidate as a pass of `linear` sums it (`dp_row_of`)
template <int U, bool Ahead>
static inline float dp_row(const B16* wr, const B16* x, int64_t I) {
  __m512 acc[U];
  for (int u = 0; u < U; ++u) acc[u] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 * U <= I; i += 32 * U)
    for (int u = 0; u < U; ++u) {
      if (Ahead) ahead(wr + i + 32 * u);
      acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_loadu_si512(wr + i + 32 * u),
                                (__m512bh)_mm512_loadu_si512(x + i + 32 * u));
    }
  for (; i + 32 <= I; i += 32)
    acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512(wr + i), (__m512bh)_mm512_loadu_si512(x + i));
  for (int u = 1; u < U; ++u) acc[0] = _mm512_add_ps(acc[0], acc[u]);
  float s = _mm512_reduce_add_ps(acc[0]);
  for (; i < I; ++i) s += static_cast<float>(wr[i]) * static_cast<float>(x[i]);
  return s;
}

static void row1_dp(const B16* w, const B16* x, const B16* bias, B16* y, int64_t I, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const float s = dp_row<DP_SUMS, true>(w + o * I, x, I);
    y[o] = static_cast<B16>(bias ? s + static_cast<float>(bias[o]) : s);
  }
}

// 2-8 input rows, bf16: rows' sequential stream with VDPBF16PS.
// The AMD (non-temporal) build keeps 2 sums for 2 rows too (faster than 4 there, as for row1_dp); at 4 and 8 rows
// the counts below were as fast as any.
template <int M>
static void rows_dp(const B16* w, const B16* x, const B16* bias, B16* y, int64_t I, int64_t O, int64_t o0,
                        int64_t o1) {
  constexpr int U = M <= 2 ? DP_SUMS : M <= 4 ? 2 : 1;
  for (int64_t o = o0; o < o1; ++o) {
    const B16* wr = w + o * I;
    __m512 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 * U <= I; i += 32 * U)
      for (int u = 0; u < U; ++u) {
        ahead(wr + i + 32 * u);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + i + 32 * u);
        for (int m = 0; m < M; ++m)
          acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, (__m512bh)_mm512_loadu_si512(x + m * I + i + 32 * u));
      }
    for (; i + 32 <= I; i += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + i);
      for (int m = 0; m < M; ++m)
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, (__m512bh)_mm512_loadu_si512(x + m * I + i));
    }
    for (int m = 0; m < M; ++m) {
      __m512 v = acc[m][0];
      for (int u = 1; u < U; ++u) v = _mm512_add_ps(v, acc[m][u]);
      float s = _mm512_reduce_add_ps(v);
      for (int64_t j = i; j < I; ++j) s += static_cast<float>(wr[j]) * static_cast<float>(x[m * I + j]);
      y[m * O + o] = static_cast<B16>(bias ? s + static_cast<float>(bias[o]) : s);
    }
  }
}

static void rows_dp_any(int64_t M, const B16* w, const B16* x, const B16* bias, B16* y, int64_t I, int64_t O,
                        int64_t o0, int64_t o1) {
  if (M == 1) return row1_dp(w, x, bias, y, I, o0, o1);
  for_rows(M, [&](auto m) { rows_dp<decltype(m)::value>(w, x, bias, y, I, O, o0, o1); });
}
#endif

template <typename W>
static void run(int64_t M, const W* w, const float* x, const W* bias, W* y, int64_t I, int64_t O) {
  const int64_t groups = (O + GROUP - 1) / GROUP;
  shared_range(groups, grain(I, sizeof(W)), [&](int64_t b, int64_t e) {
    const int64_t o0 = b * GROUP, o1 = std::min(O, e * GROUP);
    rows_any(M, w, x, I, o0, o1, ToBiased<W>{bias, y, O});
  });
}


// x as fp32: itself, or its n values widened into scratch
template <typename W>
static const float* widened(const W* x, int64_t n, float* scratch) {
  if constexpr (std::is_same<W, float>::value) {
    return x;
  } else {
    for (int64_t k = 0; k < n; ++k) scratch[k] = static_cast<float>(x[k]);
    return scratch;
  }
}

#if defined(__AVX512BF16__)
// bf16 rows with AVX512_BF16: each 32 int8 widened once to bf16 (exact: |q| <= 127 has 7 significant bits), then
// one VDPBF16PS per input row (x as the caller's bf16), where `rows` on int8 spends two FMAs a row. That path
// is compute-bound past one row (8 rows of the int8 copy took longer than the whole bf16 layer). This one, with 4
// sums for one row and 2 for two (faster than 1 sum), reads the int8 copy in less time than the bf16 layer at 1 to 8
// rows (benchmarks/head_screen.py).
template <int M, typename Out>
static void rows_i8_dp(const int8_t* q, const B16* x, int64_t I, int64_t o0, int64_t o1, const Out& out) {
  constexpr int U = M == 1 ? 4 : M == 2 ? 2 : 1;  // independent sums: VDPBF16PS's latency hidden (M x U >= 3)
  auto widened = [](const int8_t* p) {  // 32 int8 as bf16, elements in order
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15 from lo, 16-31 from hi
  };
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* qr = q + o * I;
    __m512 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 * U <= I; i += 32 * U)
      for (int u = 0; u < U; ++u) {
        if ((i + 32 * u) % 64 == 0) ahead(qr + i + 32 * u);
        const __m512bh wv = widened(qr + i + 32 * u);
        for (int m = 0; m < M; ++m)
          acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, (__m512bh)_mm512_loadu_si512(x + m * I + i + 32 * u));
      }
    for (; i + 32 <= I; i += 32) {
      const __m512bh wv = widened(qr + i);
      for (int m = 0; m < M; ++m)
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, (__m512bh)_mm512_loadu_si512(x + m * I + i));
    }
    for (int m = 0; m < M; ++m) {
      for (int u = 1; u < U; ++u) acc[m][0] = _mm512_add_ps(acc[m][0], acc[m][u]);
      float s = _mm512_reduce_add_ps(acc[m][0]);
      for (int64_t j = i; j < I; ++j) s += static_cast<float>(qr[j]) * static_cast<float>(x[m * I + j]);
      out(m, o, s);
    }
  }
}

// M (1 to MAX_ROWS) input rows: rows_i8_dp instantiated for that many.
template <typename Out>
static void rows_i8_dp_any(int64_t M, const int8_t* q, const B16* x, int64_t I, int64_t o0, int64_t o1,
                           const Out& out) {
  for_rows(M, [&](auto m) { rows_i8_dp<decltype(m)::value>(q, x, I, o0, o1, out); });
}
#endif

// -- int4 weights in groups --------------------------------------------------------------------------------------
//
// q uint8 [O, I / 2]: each 64 inputs of a row in 32 bytes, byte j holding input j in its low nibble and input 32 + j
// in its high one, each as its int4 value + 8 (pipeline/quantize.py `pack_int4`); scale fp32 [O, I / group], one per
// `group` inputs of a row (a multiple of 64 dividing I). y = sum over groups of scale * (q . x), + bias, rounded once.
#if defined(__AVX512BF16__)
// bf16 x: 32 nibbles at a time become bf16 by one VPERMW from a 16-entry table of the values -8..7 (exact), then
// VDPBF16PS; a group's sums times its scale into each row's total. Two sums a group (the low and high halves).
template <int M, typename Out>
static void rows_i4_dp(const uint8_t* q, const float* scale, const B16* x, int64_t I, int64_t group, int64_t o0,
                       int64_t o1, const Out& out) {
  alignas(64) uint16_t table[32] = {};
  for (int v = 0; v < 16; ++v) table[v] = c10::BFloat16(static_cast<float>(v - 8)).x;
  const __m512i lut = _mm512_load_si512(table);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t G = I / group, chunks = group / 64;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* qr = q + o * (I / 2);
    const float* sr = scale + o * G;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512 a[M], b[M];
      for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_ps();
      for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c) {
        const uint8_t* p = qr + c * 32;
        if (c % 2 == 0) ahead(p);
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(bytes, low)), lut);
        const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(
            _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low)), lut);
        for (int m = 0; m < M; ++m) {
          const B16* xm = x + m * I + c * 64;
          a[m] = _mm512_dpbf16_ps(a[m], w0, (__m512bh)_mm512_loadu_si512(xm));
          b[m] = _mm512_dpbf16_ps(b[m], w1, (__m512bh)_mm512_loadu_si512(xm + 32));
        }
      }
      const __m512 sg = _mm512_set1_ps(sr[g]);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_add_ps(a[m], b[m]), sg, acc[m]);
    }
    for (int m = 0; m < M; ++m) out(m, o, _mm512_reduce_add_ps(acc[m]));
  }
}

// M (1 to MAX_ROWS) input rows: rows_i4_dp instantiated for that many.
template <typename Out>
static void rows_i4_dp_any(int64_t M, const uint8_t* q, const float* scale, const B16* x, int64_t I, int64_t group,
                           int64_t o0, int64_t o1, const Out& out) {
  for_rows(M, [&](auto m) { rows_i4_dp<decltype(m)::value>(q, scale, x, I, group, o0, o1, out); });
}
#endif

// Any CPU: x in fp32; each 64-input chunk's 32 bytes unpacked VW at a time to floats (`vnibbles`: the low nibbles
// are inputs j, the high ones 32 + j), each unpacked vector multiplied with every input row's; P independent sums per
// row and half (a chunk's VW-steps in turn), so that one row's FMAs do not wait on each other; a group's sums times its
// scale into each row's total.
template <int M, typename Out>
static void rows_i4(const uint8_t* q, const float* scale, const float* x, int64_t I, int64_t group, int64_t o0,
                    int64_t o1, const Out& out) {
  constexpr int STEPS = 32 / VW;                  // VW-steps in a chunk's 32 bytes
  constexpr int P = M == 1 ? STEPS : M == 2 ? (STEPS > 2 ? 2 : STEPS) : 1;
  const int64_t G = I / group, chunks = group / 64;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* qr = q + o * (I / 2);
    const float* sr = scale + o * G;
    vf total[M];
    for (int m = 0; m < M; ++m) total[m] = vzero();
    for (int64_t g = 0; g < G; ++g) {
      vf lo_sum[M][P], hi_sum[M][P];
      for (int m = 0; m < M; ++m)
        for (int p = 0; p < P; ++p) lo_sum[m][p] = hi_sum[m][p] = vzero();
      for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c) {
        const uint8_t* qc = qr + c * 32;
        if (c % 2 == 0) ahead(qc);
        for (int st = 0; st < STEPS; ++st) {
          vf lo, hi;
          vnibbles(qc + st * VW, lo, hi);
          for (int m = 0; m < M; ++m) {
            const float* xm = x + m * I + c * 64 + st * VW;
            lo_sum[m][st % P] = vfma(lo, vload(xm), lo_sum[m][st % P]);
            hi_sum[m][st % P] = vfma(hi, vload(xm + 32), hi_sum[m][st % P]);
          }
        }
      }
      const vf sg = vset(sr[g]);
      for (int m = 0; m < M; ++m) {
        vf v = lo_sum[m][0] + hi_sum[m][0];
        for (int p = 1; p < P; ++p) v = v + lo_sum[m][p] + hi_sum[m][p];
        total[m] = vfma(v, sg, total[m]);
      }
    }
    for (int m = 0; m < M; ++m) out(m, o, vsum(total[m]));
  }
}

// M (1 to MAX_ROWS) input rows: rows_i4 instantiated for that many.
template <typename Out>
static void rows_i4_any(int64_t M, const uint8_t* q, const float* scale, const float* x, int64_t I, int64_t group,
                        int64_t o0, int64_t o1, const Out& out) {
  for_rows(M, [&](auto m) { rows_i4<decltype(m)::value>(q, scale, x, I, group, o0, o1, out); });
}
