// Decode kernels for the CPU: a linear layer for a few rows (batch-1 decode) reading the weight once at the
// memory's speed, the routed experts of one MoE layer in one call, and the attention of one new token per row
// through its block table into a paged KV pool (below).
//
// y[m, o] = sum_i x[m, i] * w[o, i] (+ bias[o]) for m < 4 rows; w row-major [out, in], fp32 or bf16, x the same
// dtype. Built at first use by export/serve/linears.py (torch.utils.cpp_extension, the way DeepSpeed builds its
// CPU ops), with AVX-512 or AVX2 + FMA. Output rows are split between torch's intra-op threads
// (at::parallel_for), GROUP at a time, each thread's share in pieces that a thread done early takes over
// (`shared_work`). Each thread reads its weight rows one after another, one sequential stream,
// each loaded vector multiplied with every input row's (1-8 rows, in L1), so the weight streams from memory
// once. fp32 accumulation (bf16 weights
// widened by a shift, as oneDNN does; or with AVX512_BF16, bf16 pairs multiplied and summed into fp32 by
// VDPBF16PS), the bias added in fp32, one rounding to the output dtype, no temporary tensors.

// Only the headers used (not <torch/extension.h>, whose whole C++ API takes most of the build's time to parse):
// the tensor and its method operators, the ATen operators called by name, the dispatcher, pybind11 with torch's
// tensor type casters.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ops/from_blob.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#define VW 16
#define GROUP 4
typedef __m512 vf;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vf vload(const int8_t* p) {  // the int8 head screen's weights (export/serve/linears.py HeadScreen)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vset(float a) { return _mm512_set1_ps(a); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vmaxv(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vround(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// a bit per lane: v equals m, or v is NaN
static inline unsigned vmatch(vf v, vf m) {
  return _mm512_cmp_ps_mask(v, m, _CMP_EQ_OQ) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
}
static inline unsigned vge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }  // a bit per lane: a >= b
static inline vf vabs(vf v) { return _mm512_abs_ps(v); }
static inline vf vload_n(const float* p, int64_t n) {  // the first n (<= VW) floats from p, zeros after
  return n >= VW ? vload(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define GROUP 2
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vload(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
static inline vf vset(float a) { return _mm256_set1_ps(a); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vmaxv(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vround(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline unsigned vmatch(vf v, vf m) {
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v, m, _CMP_EQ_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
static inline unsigned vge(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
static inline vf vabs(vf v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
static inline vf vload_n(const float* p, int64_t n) {
  if (n >= VW) return vload(p);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
}
#else
#error "export/serve/csrc/gemv.cpp needs AVX-512 or AVX2 with FMA"
#endif

constexpr int64_t MAX_ROWS = 8;

// Row groups per thread's share: at least ~2 MB of weight. Waking a sleeping thread (OMP_WAIT_POLICY=PASSIVE)
// costs ~45 us, the time to read ~2 MB, so a smaller weight is read faster by one thread than split.
static int64_t grain(int64_t I, size_t elem) {
  return std::max<int64_t>(1, (int64_t(2) << 20) / (GROUP * I * int64_t(elem) + 1));
}

// Work units [0, n) between `threads` threads: each thread takes the units of its own share (contiguous, bounds
// first[t] .. first[t + 1]) in order, then units from the far end of whichever share has the most left. Under an
// even split, a thread the OS preempts (the server's HTTP thread, a client on the same cores) holds every other
// thread at the end for the rest of its whole share; here they finish it. A share stays one sequential stream until
// someone takes from its end. Each share's next and end are one 64-bit word, changed by compare-and-swap.
// Measured on the peer benchmark's Qwen3-MoE (AMD EPYC, 2 cores, our server and the client on them, 8 pieces a
// share against 1, two servers alternated 4 rounds): output tok/s +7% at 32 concurrent (paired 1.02-1.11x), +2.5%
// at 8 (0.97-1.07x), about even at 1 (0.83-1.23x: the memory's drift).
static int share_pieces() {  // units per thread's share for a split kernel (MOE_SHARE_PIECES; 1: static halves)
  static const int n = [] {
    const char* v = std::getenv("MOE_SHARE_PIECES");
    return v ? std::max(1, std::atoi(v)) : 8;
  }();
  return n;
}

template <typename F>
static void shared_work(const std::vector<int64_t>& first, F&& unit) {
  const int64_t threads = static_cast<int64_t>(first.size()) - 1;
  if (threads <= 1 || share_pieces() == 1) {
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t i = first[t]; i < first[t + 1]; ++i) unit(i);
    });
    return;
  }
  struct alignas(64) Share {
    std::atomic<uint64_t> v;  // next << 32 | end
  };
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t)
    shares[t].v.store(static_cast<uint64_t>(first[t]) << 32 | static_cast<uint64_t>(first[t + 1]));
  auto take = [](Share& s, bool front, int64_t& i) {
    uint64_t v = s.v.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t next = v >> 32, end = v & 0xFFFFFFFFu;
      if (next >= end) return false;
      const uint64_t w = front ? (next + 1) << 32 | end : next << 32 | (end - 1);
      if (s.v.compare_exchange_weak(v, w, std::memory_order_relaxed)) {
        i = static_cast<int64_t>(front ? next : end - 1);
        return true;
      }
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      int64_t i;
      while (take(shares[t], true, i)) unit(i);
      for (;;) {  // the share with the most units left, from its end
        int64_t best = -1, most = 0;
        for (int64_t o = 0; o < threads; ++o) {
          const uint64_t v = shares[o].v.load(std::memory_order_relaxed);
          const int64_t left = static_cast<int64_t>(v & 0xFFFFFFFFu) - static_cast<int64_t>(v >> 32);
          if (left > most) best = o, most = left;
        }
        if (best < 0 || !take(shares[best], false, i)) {
          if (best < 0) break;
          continue;
        }
        unit(i);
      }
    }
  });
}

// [0, n) in `threads` (at most the intra-op threads, at least one unit of `grain` each) even shares of
// share_pieces() pieces each, by shared_work: piece(b, e) for each piece's range.
template <typename F>
static void shared_range(int64_t n, int64_t grain, F&& piece) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / std::max<int64_t>(1, grain));
  if (threads <= 1 || at::in_parallel_region()) {
    piece(0, n);
    return;
  }
  const int64_t pieces = std::min<int64_t>(n, threads * share_pieces());
  std::vector<int64_t> first(threads + 1);
  for (int64_t t = 0; t <= threads; ++t) first[t] = pieces * t / threads;
  shared_work(first, [&](int64_t p) { piece(n * p / pieces, n * (p + 1) / pieces); });
}

// The weight 2 KB ahead of a read. Which hint depends on the CPU (export/serve/linears.py `prefetch_hint` chooses
// at build time). AMD (Zen 4): non-temporally, the default: the stream (hundreds of MB a token) would otherwise
// evict everything else a decode step touches from the caches (the KV cache, activations, the interpreter's own
// memory) on every step; with the hint the step's other work ran ~0.3-0.4 ms faster a token (4-8% of a step).
// Intel (Sapphire Rapids, MOE_PREFETCH_T0): into every cache level; a core there reads ~8.5 GB/s alone, and the
// NTA hint left the 2-core lm_head at 11.7 GB/s where T0 reads 14.2 (experts: 11.6 -> 12.8).
#if defined(MOE_PREFETCH_T0)
#define AHEAD_HINT _MM_HINT_T0
#else
#define AHEAD_HINT _MM_HINT_NTA
#endif
static inline void ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + 2048, AHEAD_HINT); }

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

// int8 weights' sums (export/serve/linears.py `quantize_int8`): times the output row's scale, plus the bias, rounded
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
// better than GROUP interleaved rows of a few KB each: in bf16 ~20% more GB/s when the memory is fast (70 GB/s
// where the grouped loop read 57).
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
// GROUP rows side by side instead (a weight vector of each, then all of x) ran at half this speed on an AMD EPYC
// under KVM (bf16: 8-10 against 14-17 GB/s, 2 threads): the hardware prefetcher does not follow GROUP streams.
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
// instruction, with no widening. The shift-and-FMA path above is compute-bound in bf16 (~25 GB/s a thread here,
// where fp32 reads at ~40); this one reads ~1.8x faster.
typedef c10::BFloat16 B16;

// One input row, bf16: row1's sequential stream with VDPBF16PS, U independent sums of 32 pairs each. U = 2 with the
// non-temporal prefetch (AMD): on an AMD EPYC (AVX512_BF16, 2 cores) it read 20-27% more GB/s than U = 4 for every
// weight shape of the peer benchmark's Qwen3-MoE (lm_head 24.4 -> 29.5 GB/s on 2 threads, 14.4 -> 17.3 on one;
// the variants alternated in one process, medians of 15); U = 1 about as fast, U = 8 between. Intel's (T0) build
// keeps 4, as it was measured there.
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
// The AMD (non-temporal) build keeps 2 sums for 2 rows too: 16-20% more GB/s than 4 on the AMD EPYC of row1_dp's
// note (lm_head 21.3 -> 24.8 GB/s, 2 threads, in-process A/B); at 4 and 8 rows the counts below were as fast as any.
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


// -- the attention of one new token per row (decode) ---------------------------------------------------------------
//
// exp(x) for x <= 0 (softmax's x - max), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r,
// times 2^n; ~1 ulp. Below -87 it returns exp(-87) (~1.6e-38) instead of a denormal or 0: nothing a softmax sum sees.
static inline vf vexp(vf x) {
  x = vmaxv(x, vset(-87.0f));
  const vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, r);  // p r^2 + r
  return vmul(vfma(p, vset(1.0f), vset(1.0f)) /* 1 + p r^2 + r */, vpow2(n));
}

static inline vf vload_f(const float* p) { return vload(p); }
static inline vf vload_f(const c10::BFloat16* p) { return vload(p); }

// Attention of `G` query heads that share one key/value head (grouped-query attention) over n positions: the
// queries q (G heads, D apart), keys at K + table[j / bs] * stride + (j % bs) * D (a paged pool's blocks of bs
// positions, `stride` elements apart, in the order of the row's block table), values likewise from V; outputs y (G
// heads, D apart). Each key and value is read once for the G heads; each head's sums run in the same order as for
// one head alone (d ascending in vectors, then the positions ascending), so a head's output does not depend on G;
// fp32 throughout (q, K, V widened on load), one rounding to the output dtype. `s`: room for G x (n + VW) scores.
//
// Three passes: the scores (with each head's largest), their exponentials and sums, the values' weighted sum. Where
// the head size is 2, 4 or 8 vectors of AVX-512 (D 32, 64, 128) the first and last run `scores_fixed` and
// `values_fixed`: the same sums in the same order (the outputs equal the generic passes' to the bit), without a
// horizontal sum per key and with the output in registers.
template <typename T, int G>
static void scores_any(const float (*qf)[512], const T* K, const int64_t* table, int64_t bs, int64_t stride,
                       int64_t n, int64_t D, float* s, int64_t sn, float* m) {
  const int64_t Dv = D / VW * VW;
  for (int h = 0; h < G; ++h) m[h] = -INFINITY;
  for (int64_t j0 = 0, blk = 0; j0 < n; j0 += bs, ++blk) {
    const T* kb = K + table[blk] * stride;
    const int64_t len = std::min(bs, n - j0);
    for (int64_t t = 0; t < len; ++t) {
      const T* k = kb + t * D;
      vf acc[G];
      for (int h = 0; h < G; ++h) acc[h] = vzero();
      for (int64_t d = 0; d < Dv; d += VW) {
        const vf kv = vload_f(k + d);
        for (int h = 0; h < G; ++h) acc[h] = vfma(kv, vload(qf[h] + d), acc[h]);
      }
      for (int h = 0; h < G; ++h) {
        float dot = vsum(acc[h]);
        for (int64_t d = Dv; d < D; ++d) dot += static_cast<float>(k[d]) * qf[h][d];
        s[h * sn + j0 + t] = dot;
        m[h] = std::max(m[h], dot);
      }
    }
  }
}

template <int G>
static void softmax_scores(float* s, int64_t sn, int64_t n, const float* m, float* inv) {
  for (int h = 0; h < G; ++h) {
    float* sh = s + h * sn;
    const int64_t nv = n / VW * VW;
    vf total = vzero();
    const vf mv = vset(m[h]);
    int64_t j = 0;
    for (; j < nv; j += VW) {
      vf e = vexp(vload(sh + j) - mv);
      vstore(sh + j, e);
      total = total + e;
    }
    float sum = vsum(total);
    if (j < n) {  // the last scores, fewer than a vector: padded with -inf's exp, 0
      float tail[VW];
      for (int64_t t = 0; t < VW; ++t) tail[t] = j + t < n ? sh[j + t] - m[h] : -INFINITY;
      vstore(tail, vexp(vload(tail)));
      for (int64_t t = 0; j + t < n; ++t) {
        sh[j + t] = tail[t];
        sum += tail[t];
      }
    }
    inv[h] = 1.0f / sum;
  }
}

template <typename T, int G>
static void values_any(const T* V, const int64_t* table, int64_t bs, int64_t stride, T* y, int64_t n, int64_t D,
                       const float* s, int64_t sn, const float* inv) {
  const int64_t Dv = D / VW * VW;
  alignas(64) float out[G][512];
  for (int h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; ++d) out[h][d] = 0.0f;
  for (int64_t j0 = 0, blk = 0; j0 < n; j0 += bs, ++blk) {
    const T* vb = V + table[blk] * stride;
    const int64_t len = std::min(bs, n - j0);
    for (int64_t t = 0; t < len; ++t) {
      const T* v = vb + t * D;
      vf p[G];
      for (int h = 0; h < G; ++h) p[h] = vset(s[h * sn + j0 + t]);
      for (int64_t d = 0; d < Dv; d += VW) {
        const vf vv = vload_f(v + d);
        for (int h = 0; h < G; ++h) vstore(out[h] + d, vfma(p[h], vv, vload(out[h] + d)));
      }
      for (int64_t d = Dv; d < D; ++d)
        for (int h = 0; h < G; ++h) out[h][d] += s[h * sn + j0 + t] * static_cast<float>(v[d]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; ++d) y[h * D + d] = static_cast<T>(out[h][d] * inv[h]);
}

#if defined(__AVX512F__)
// The sums of 16 vectors, one a lane: lane 4k + m is the sum of a[k + 4m]'s lanes, added in _mm512_reduce_add_ps's
// order (GCC's: the 256-bit halves, then the 128-bit halves, then elements (0 + 2) + (1 + 3)), so each equals
// vsum(a[k + 4m]) to the bit. ~45 instructions for 16 sums where vsum takes ~8 for one.
static inline vf vsum16(const float (*a)[16]) {
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {  // the 256-bit halves: [a.lo + a.hi | a'.lo + a'.hi]
    const vf x = vload(a[2 * i]), y = vload(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)));
  }
  for (int i = 0; i < 4; ++i)  // the 128-bit halves: 128-bit lane k the sums of a[4i + k]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int i = 0; i < 2; ++i)  // elements 0 + 2 and 1 + 3 of each
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)),  // (0 + 2) + (1 + 3)
                       _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)));
}

// scores_any for a head of DV vectors: each key's G partial-sum vectors are kept (key t of 16 in slot t / 4 +
// 4 (t % 4)) and every 16 keys' sums come out of one vsum16 a head, stored and maxed as a vector.
template <typename T, int G, int DV>
static void scores_fixed(const float (*qf)[512], const T* K, const int64_t* table, int64_t bs, int64_t stride,
                         int64_t n, float* s, int64_t sn, float* m) {
  constexpr int64_t D = DV * VW;
  alignas(64) float part[G][VW][VW];
  vf top[G];
  for (int h = 0; h < G; ++h) top[h] = vset(-INFINITY);
  const T* kb = K + table[0] * stride;
  for (int64_t j0 = 0, blk = 0, at = 0; j0 < n; j0 += VW) {
    const int64_t cnt = std::min<int64_t>(VW, n - j0);
    for (int64_t t = 0; t < VW; ++t) {
      const int64_t slot = t / 4 + 4 * (t % 4);
      if (t >= cnt) {
        for (int h = 0; h < G; ++h) vstore(part[h][slot], vzero());
        continue;
      }
      const T* k = kb + at * D;
      vf acc[G];
      for (int h = 0; h < G; ++h) acc[h] = vzero();
      for (int d = 0; d < DV; ++d) {
        const vf kv = vload_f(k + d * VW);
        for (int h = 0; h < G; ++h) acc[h] = vfma(kv, vload(qf[h] + d * VW), acc[h]);
      }
      for (int h = 0; h < G; ++h) vstore(part[h][slot], acc[h]);
      if (++at == bs && j0 + t + 1 < n) at = 0, kb = K + table[++blk] * stride;  // never past the row's blocks
    }
    const __mmask16 live = static_cast<__mmask16>((1u << cnt) - 1);
    for (int h = 0; h < G; ++h) {
      const vf sc = vsum16(part[h]);
      vstore(s + h * sn + j0, sc);
      top[h] = _mm512_mask_max_ps(top[h], live, top[h], sc);
    }
  }
  for (int h = 0; h < G; ++h) m[h] = _mm512_reduce_max_ps(top[h]);
}

// values_any for a head of DV vectors: the G heads' sums in registers, in passes of up to 16 vectors' worth.
template <typename T, int G, int DV>
static void values_fixed(const T* V, const int64_t* table, int64_t bs, int64_t stride, T* y, int64_t n,
                         const float* s, int64_t sn, const float* inv) {
  constexpr int64_t D = DV * VW;
  constexpr int P = G * DV <= 16 ? G : std::max(1, 16 / DV);  // heads a pass
  for (int h0 = 0; h0 < G; h0 += P) {
    const int np = std::min(P, G - h0);
    vf o[P][DV];
    for (int h = 0; h < P; ++h)
      for (int d = 0; d < DV; ++d) o[h][d] = vzero();
    const T* vb = V + table[0] * stride;
    for (int64_t j = 0, blk = 0, at = 0; j < n; ++j) {
      const T* v = vb + at * D;
      vf vv[DV];
      for (int d = 0; d < DV; ++d) vv[d] = vload_f(v + d * VW);
      for (int h = 0; h < P; ++h) {
        if (h >= np) break;
        const vf p = vset(s[(h0 + h) * sn + j]);
        for (int d = 0; d < DV; ++d) o[h][d] = vfma(p, vv[d], o[h][d]);
      }
      if (++at == bs && j + 1 < n) at = 0, vb = V + table[++blk] * stride;
    }
    for (int h = 0; h < np; ++h) {
      alignas(64) float out[D];
      for (int d = 0; d < DV; ++d) vstore(out + d * VW, o[h][d]);
      for (int64_t d = 0; d < D; ++d) y[(h0 + h) * D + d] = static_cast<T>(out[d] * inv[h0 + h]);
    }
  }
}

template <typename T, int G, int DV>
static void attend_fixed(const float (*qf)[512], const T* K, const T* V, const int64_t* table, int64_t bs,
                         int64_t stride, T* y, int64_t n, float* s, int64_t sn, float* m, float* inv) {
  scores_fixed<T, G, DV>(qf, K, table, bs, stride, n, s, sn, m);
  softmax_scores<G>(s, sn, n, m, inv);
  values_fixed<T, G, DV>(V, table, bs, stride, y, n, s, sn, inv);
}
#endif

template <typename T, int G>
static void attend_group(const T* q, const T* K, const T* V, const int64_t* table, int64_t bs, int64_t stride, T* y,
                         int64_t n, int64_t D, float scale, float* s) {
  const int64_t sn = n + VW;
  alignas(64) float qf[G][512];
  for (int h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; ++d) qf[h][d] = static_cast<float>(q[h * D + d]) * scale;
  float m[G], inv[G];
#if defined(__AVX512F__)
  switch (D) {
    case 32: return attend_fixed<T, G, 2>(qf, K, V, table, bs, stride, y, n, s, sn, m, inv);
    case 64: return attend_fixed<T, G, 4>(qf, K, V, table, bs, stride, y, n, s, sn, m, inv);
    case 128: return attend_fixed<T, G, 8>(qf, K, V, table, bs, stride, y, n, s, sn, m, inv);
  }
#endif
  scores_any<T, G>(qf, K, table, bs, stride, n, D, s, sn, m);
  softmax_scores<G>(s, sn, n, m, inv);
  values_any<T, G>(V, table, bs, stride, y, n, D, s, sn, inv);
}

// `heads` query heads (any number) of one key/value head, in passes of up to 8.
template <typename T>
static void attend_heads(const T* q, const T* K, const T* V, const int64_t* table, int64_t bs, int64_t stride, T* y,
                         int64_t n, int64_t D, float scale, float* s, int64_t heads) {
  for (int64_t h = 0; h < heads;) {
    const int64_t left = heads - h;
    const T* qh = q + h * D;
    T* yh = y + h * D;
    if (left >= 8) {
      attend_group<T, 8>(qh, K, V, table, bs, stride, yh, n, D, scale, s), h += 8;
    } else if (left >= 4) {
      attend_group<T, 4>(qh, K, V, table, bs, stride, yh, n, D, scale, s), h += 4;
    } else if (left >= 2) {
      attend_group<T, 2>(qh, K, V, table, bs, stride, yh, n, D, scale, s), h += 2;
    } else {
      attend_group<T, 1>(qh, K, V, table, bs, stride, yh, n, D, scale, s), h += 1;
    }
  }
}

// -- decode attention over a paged KV pool ---------------------------------------------------------------------- ------------------------------------------------------------------------------

template <typename T>
static void paged_attention_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  at::Tensor& K, at::Tensor& V, const at::Tensor& tables,
                                  const std::vector<int64_t>& starts, at::Tensor& y, float scale, int64_t grain) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = K.size(1), bs = K.size(2);
  const int64_t W = tables.size(1), stride = Hkv * bs * D;  // elements from one block to the next
  T* Kp = K.data_ptr<T>();
  T* Vp = V.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = starts[b];
    const int64_t blk = tp[b * W + p / bs], off = p % bs;
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t at = blk * stride + (g * bs + off) * D;
      std::copy(kp + (b * Hkv + g) * D, kp + (b * Hkv + g + 1) * D, Kp + at);
      std::copy(vp + (b * Hkv + g) * D, vp + (b * Hkv + g + 1) * D, Vp + at);
    }
  }
  const T* qp = q.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t group = H / Hkv;
  at::parallel_for(0, B * Hkv, grain, [&](int64_t first, int64_t last) {  // a row's key/value head and its queries
    int64_t longest = 0;
    for (int64_t i = first; i < last; ++i) longest = std::max(longest, starts[i / Hkv] + 1);
    std::vector<float> s(std::min<int64_t>(group, 8) * (longest + VW));
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / Hkv, g = i % Hkv, h = g * group;
      attend_heads<T>(qp + (b * H + h) * D, Kp + g * bs * D, Vp + g * bs * D, tp + b * W, bs, stride,
                      yp + (b * H + h) * D, starts[b] + 1, D, scale, s.data(), group);
    }
  });
}

// One new token per row, over a paged pool. q [B, H, D]: each row's query (after RoPE); k, v [B, Hkv, D] its key and
// value; K, V [num_blocks, Hkv, bs, D]: one layer's pool of blocks of bs positions; tables [B, max_blocks] int64, row
// b's logical block i being physical block tables[b][i] (entries past the row's blocks are never read). Writes k, v
// at position starts[b] (block tables[b][starts[b] / bs], offset starts[b] % bs), then y[b, h] = softmax(q.K /
// sqrt(D)) . V over the row's starts[b] + 1 keys, query head h reading pool head h / (H / Hkv) (grouped-query
// attention). The rows' pool heads, each with its query heads (its keys and values read once for all of them), are
// split between torch's intra-op threads, a few hundred KB of keys and values each at least (fewer stay on the
// calling thread).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor K,
                              at::Tensor V, const at::Tensor& tables, const std::vector<int64_t>& starts) {
  RECORD_FUNCTION("moe_pipeline::paged_attention", std::vector<c10::IValue>({q, K}));
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && K.dim() == 4 && V.dim() == 4 && tables.dim() == 2,
              "paged_attention: q [B, H, D], k and v [B, Hkv, D], K and V [num_blocks, Hkv, block_size, D], "
              "tables [B, max_blocks]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), N = K.size(0), Hkv = K.size(1), bs = K.size(2);
  const int64_t W = tables.size(1);
  TORCH_CHECK(K.sizes() == V.sizes() && k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == Hkv &&
                  k.size(2) == D && K.size(3) == D && Hkv > 0 && H % Hkv == 0 && D > 0 && D <= 512 && bs > 0,
              "paged_attention: shapes do not match (q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", K ",
              K.sizes(), ", V ", V.sizes(), "; q heads a multiple of the pool's, head size 1-512, block size > 0)");
  TORCH_CHECK(tables.size(0) == B, "paged_attention: a block table row per query row (tables ", tables.sizes(),
              ", B = ", B, ")");
  TORCH_CHECK(int64_t(starts.size()) == B, "paged_attention: a start per query row (", starts.size(), " for ", B,
              " rows)");
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && k.scalar_type() == dt && v.scalar_type() == dt &&
                  K.scalar_type() == dt && V.scalar_type() == dt,
              "paged_attention: q, k, v, K, V fp32 or bf16, all alike");
  TORCH_CHECK(tables.scalar_type() == at::kLong, "paged_attention: int64 block tables, not ", tables.scalar_type());
  for (const at::Tensor* t : {&q, &k, &v, const_cast<const at::Tensor*>(&K), const_cast<const at::Tensor*>(&V),
                                 &tables})
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "paged_attention: contiguous CPU tensors");
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = starts[b];
    TORCH_CHECK(p >= 0 && p / bs < W, "paged_attention: row ", b, " position ", p, " outside its block table (",
                W, " blocks of ", bs, ")");
    for (int64_t i = 0; i <= p / bs; ++i)
      TORCH_CHECK(tp[b * W + i] >= 0 && tp[b * W + i] < N, "paged_attention: row ", b, " block ", i, " is ",
                  tp[b * W + i], ", outside the pool [0, ", N, ")");
  }
  at::Tensor y = at::empty({B, H, D}, q.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, starts[b] + 1);
  const int64_t per_head = longest * D * 2 * int64_t(q.element_size());  // bytes of keys and values a kv head holds
  const int64_t grain = std::max<int64_t>(1, (int64_t(256) << 10) / (per_head + 1));
  AT_DISPATCH_SWITCH(dt, "paged_attention", AT_DISPATCH_CASE(at::kFloat, [&] {
    paged_attention_typed<scalar_t>(q, k, v, K, V, tables, starts, y, scale, grain);
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    paged_attention_typed<scalar_t>(q, k, v, K, V, tables, starts, y, scale, grain);
  }));
  return y;
}

// -- bf16 linears for 2 to AMX_MAX_ROWS rows on CPUs with AMX (Intel Sapphire Rapids on) -------------------------
//
// VDPBF16PS above does 32 multiply-adds per 64 bytes of weight and row: at 8 rows and more the kernel is compute-
// bound (the bf16 lm_head at 8 rows read 8.3 GB/s where 1 row reads 13.7), and oneDNN's AMX GEMM reached 4-6 GB/s
// at 8-32 rows on a 2-core Sapphire Rapids. AMX's TDPBF16PS multiplies a 16 x 32 tile of rows by a 32 x 16 tile of
// the weight (8192 multiply-adds) in one instruction, so a weight streamed once serves 32 rows at the memory's
// speed. The weight is kept in a second copy packed for it (`amx_pack`: the tiles one after another in the order
// a thread reads them; it takes the place of oneDNN's packed copy). Each thread takes pairs of 16-output blocks:
// for every 32 rows, 4 accumulator tiles (2 row tiles x 2 output blocks) over the whole input, fp32 sums, the
// bias added in fp32, one rounding to bf16. A row's sums do not depend on how many rows come with it.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

constexpr int64_t AMX_MAX_ROWS = 256;  // more rows: oneDNN's GEMM (as fast or faster from ~512 rows here)

// Linux hands the AMX tile state to a process only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

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

// w [O, I] bf16 (I a multiple of 32) -> for each pair of 16-output blocks (O padded with zeros to 32), for each 32
// inputs, two 16 x 32 tiles: tile row p holds the block's 16 outputs' inputs 2p and 2p + 1, side by side.
at::Tensor amx_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(1) % 32 == 0,
              "amx_pack: a contiguous bf16 [out, in] weight, in a multiple of 32");
  const int64_t O = w.size(0), I = w.size(1), pairs = (O + 31) / 32, KB = I / 32;
  at::Tensor packed = at::zeros({pairs * KB * 1024}, w.options());
  const B16* src = w.data_ptr<B16>();
  B16* dst = packed.data_ptr<B16>();
  at::parallel_for(0, pairs, 1, [&](int64_t b, int64_t e) {
    for (int64_t np = b; np < e; ++np)
      for (int64_t kb = 0; kb < KB; ++kb)
        for (int64_t o = np * 32; o < std::min(O, np * 32 + 32); ++o) {
          B16* tile = dst + (np * KB + kb) * 1024 + ((o - np * 32) / 16) * 512 + (o % 16) * 2;
          const B16* in = src + o * I + kb * 32;
          for (int p = 0; p < 16; ++p) tile[p * 32] = in[2 * p], tile[p * 32 + 1] = in[2 * p + 1];
        }
  });
  return packed;
}

// Rows [m0, m0 + rows), rows <= 32, times one pair of output blocks (tiles at t, I / 32 pairs of them), into c.
static inline void amx_block(const B16* x, const B16* t, int64_t I, int rows, float (*c)[32]) {
  const bool two = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < I / 32; ++kb, t += 1024) {
    for (int l = 0; l < 32; ++l) _mm_prefetch(reinterpret_cast<const char*>(t) + 2048 + 64 * l, _MM_HINT_T0);
    _tile_loadd(4, x + kb * 32, I * 2);
    if (two) _tile_loadd(5, x + 16 * I + kb * 32, I * 2);
    _tile_loadd(6, t, 64);
    _tile_loadd(7, t + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, &c[0][0], 128);
  _tile_stored(1, &c[0][16], 128);
  if (two) {
    _tile_stored(2, &c[16][0], 128);
    _tile_stored(3, &c[16][16], 128);
  }
}

// x [M, I] (2 <= M <= AMX_MAX_ROWS) bf16 contiguous, packed = amx_pack(w) of w [O, I]; bias [O] bf16 or None.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t O,
                         const c10::optional<at::Tensor>& bias) {
  RECORD_FUNCTION("moe_pipeline::amx_linear", std::vector<c10::IValue>({x, packed}));
  TORCH_CHECK(amx_ready(), "amx_linear: the kernel did not give this process the AMX tile state");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) % 32 == 0 &&
                  x.size(0) >= 1 && x.size(0) <= AMX_MAX_ROWS,
              "amx_linear: x [1 to ", AMX_MAX_ROWS, " rows, in], contiguous bf16, in a multiple of 32");
  const int64_t M = x.size(0), I = x.size(1), pairs = (O + 31) / 32;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.numel() == pairs * I * 32,
              "amx_linear: packed is amx_pack of a [", O, ", ", I, "] weight");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == O,
                "amx_linear: a contiguous bf16 bias, one per output");
  at::Tensor y = at::empty({M, O}, x.options());
  const B16* xb = x.data_ptr<B16>();
  const B16* pb = packed.data_ptr<B16>();
  const B16* bb = has_bias ? bias->data_ptr<B16>() : nullptr;
  B16* yb = y.data_ptr<B16>();
  const TileConfig full = tile_config(32), tail = tile_config(M % 32);
  // at least ~2 MB of weight a thread, as `grain`
  at::parallel_for(0, pairs, std::max<int64_t>(1, (int64_t(2) << 20) / (I * 64)), [&](int64_t b, int64_t e) {
    alignas(64) float c[32][32];
    const TileConfig* loaded = nullptr;
    for (int64_t np = b; np < e; ++np) {
      const int64_t o0 = np * 32, on = std::min<int64_t>(32, O - o0);
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int rows = static_cast<int>(std::min<int64_t>(32, M - m0));
        const TileConfig* want = rows == 32 ? &full : &tail;
        if (want != loaded) {
          _tile_loadconfig(want);
          loaded = want;
        }
        amx_block(xb + m0 * I, pb + np * I * 32, I, rows, c);
        for (int m = 0; m < rows; ++m)
          for (int64_t o = 0; o < on; ++o)
            yb[(m0 + m) * O + o0 + o] = static_cast<B16>(bb ? c[m][o] + static_cast<float>(bb[o0 + o]) : c[m][o]);
      }
    }
    if (loaded) _tile_release();
  });
  return y;
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

#if defined(__AVX512VNNI__)
// -- int8 x int8 products (AVX512_VNNI) ---------------------------------------------------------------------------
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
// of x broadcast serve 64 outputs. On an AMD EPYC (Zen 4, 2 cores; VPDPBUSD and VDPBF16PS both one a cycle a core,
// 3.67 G/s measured) 32 rows of the Qwen3-MoE head's int8 pass take ~6 ms, ~2.2-2.5 G VPDPBUSD a second a core,
// where oneDNN's bf16 GEMM of the layer takes ~10.3 ms (half the multiply-adds an instruction).
constexpr int64_t VNNI_TILE = 64, VNNI_CHUNK = 1024, VNNI_MAX_ROWS = 64, VNNI_PASS = 6;

// q [O, I] int8 -> tiles of 64 outputs (O padded with zero rows) of I4 = I rounded up to 4 inputs (zeros):
// byte t * I4 * 64 + (i / 4) * 256 + j * 4 + i % 4 = q[64 t + j, i].
at::Tensor vnni_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.device().is_cpu(),
              "vnni_pack: q int8 [out, in], contiguous, on the CPU");
  const int64_t O = q.size(0), I = q.size(1), I4 = (I + 3) / 4 * 4, T = (O + VNNI_TILE - 1) / VNNI_TILE;
  at::Tensor out = at::zeros({T * I4 * VNNI_TILE}, q.options());
  const int8_t* src = q.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t j = 0; j < VNNI_TILE && t * VNNI_TILE + j < O; ++j) {
        const int8_t* row = src + (t * VNNI_TILE + j) * I;
        int8_t* tile = dst + t * I4 * VNNI_TILE;
        for (int64_t i = 0; i < I; ++i) tile[(i / 4) * 256 + j * 4 + i % 4] = row[i];
      }
  });
  return out;
}

// R rows of x (unsigned bytes, rows I4 apart) times a tile's 4-input steps [s0, s1) into acc [R][64] int32. No
// software prefetch: the hardware's follows a tile's one stream (with prefetchnta 2 KB ahead, as the bf16 kernels
// read, 1 / 8 / 32 rows took 0.81 / 2.34 / 7.17 ms against 0.72 / 2.16 / 6.78 without; AMD EPYC, alternated).
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

template <typename T>
static void w8a8_linear_typed(const at::Tensor& x, const W8A8& w, const T* bias, T* y) {
  const int64_t M = x.size(0), I = x.size(1);
  std::vector<uint8_t> xu(M * w.I4);
  std::vector<float> xs(M);
  int8_rows_of(x.data_ptr<T>(), M, I, w.I4, xu.data(), xs.data());
  shared_range(w.T, std::max<int64_t>(1, (int64_t(2) << 20) / (VNNI_TILE * w.I4) / std::max<int64_t>(1, M / 8)),
               [&](int64_t b, int64_t e) {
    std::vector<int32_t> acc(VNNI_MAX_ROWS * 64);
    for (int64_t t = b; t < e; ++t)
      w8a8_tile(w, t, xu.data(), xs.data(), M, acc.data(), [&](int64_t m, int64_t o, int64_t n, __m512 v) {
        if (bias) {
          alignas(64) float bf[16];
          for (int64_t i = 0; i < n; ++i) bf[i] = static_cast<float>(bias[o + i]);
          v = _mm512_add_ps(v, _mm512_load_ps(bf));
        }
        store_n(y + m * w.O + o, v, n);
      });
  });
}

// y = x @ w.T (+ bias) for a W8A8 weight (w8a8_of) and x [M, I] fp32 or bf16 (any rows), each row of x rounded to
// int8 (one scale a row) as vLLM's dynamic per-token W8A8: y[m, o] = sum(xq[m] q[o]) * scale[o] * s[m] (+ bias[o]),
// one rounding to x's dtype.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  RECORD_FUNCTION("moe_pipeline::w8a8_linear", std::vector<c10::IValue>({x, packed}));
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "w8a8_linear: x [rows, in] fp32 or bf16, contiguous, on the CPU");
  const W8A8 w = w8a8_of(packed, scale, x.size(1));
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == w.O,
                "w8a8_linear: a contiguous bias of x's dtype, one per output");
  at::Tensor y = at::empty({x.size(0), w.O}, x.options());
  if (x.size(0) == 0) return y;
  if (x.scalar_type() == at::kFloat)
    w8a8_linear_typed<float>(x, w, has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
  else
    w8a8_linear_typed<c10::BFloat16>(x, w, has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr,
                                     y.data_ptr<c10::BFloat16>());
  return y;
}

#endif

// -- the routed experts of one MoE layer, in one call -------------------------------------------------------------
//
// Decode batches give each expert a few rows: called one expert at a time from Python, a layer of 16 experts cost
// ~10 operators an expert (index, two linears, chunk, silu, mul, ...), each waking the thread pool, more than the
// weights' read. Here every expert's rows go through the few-row kernels above in two parallel passes (fc1 with the
// activation, then fc2), the work split between the threads by its cost (weight rows x row passes), so that every
// expert's weights are read once per 4 rows and no thread waits for an expert with more rows than the others.

constexpr int64_t BLOCK = 64;  // output rows of one task: 128 KB of a bf16 weight of 1024 columns

// Output rows [0, n) of M (<= MAX_ROWS) input rows x ([M, I], w's dtype) against w ([n, I]) into y ([M, O], stride
// O), each plus bias[o] if given. `scratch`: room for M * I floats where x must be widened for the kernel.
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

template <typename W>
static void block_rows(const W* w, const W* x, const W* bias, W* y, int64_t M, int64_t I, int64_t O, int64_t n,
                       float* scratch) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<W, c10::BFloat16>::value) {
    return rows_dp_any(M, w, x, bias, y, I, O, 0, n);
  }
#endif
  const float* xf = widened(x, M * I, scratch);
  rows_any(M, w, xf, I, 0, n, ToBiased<W>{bias, y, O});
}

#if defined(__AVX512BF16__)
template <typename Out>
static void rows_i8_dp_any(int64_t M, const int8_t* q, const B16* x, int64_t I, int64_t o0, int64_t o1,
                           const Out& out);
template <typename Out>
static void rows_i4_dp_any(int64_t M, const uint8_t* q, const float* scale, const B16* x, int64_t I, int64_t group,
                           int64_t o0, int64_t o1, const Out& out);
#endif
template <typename Out>
static void rows_i4_any(int64_t M, const uint8_t* q, const float* scale, const float* x, int64_t I, int64_t group,
                        int64_t o0, int64_t o1, const Out& out);

// block_rows on int4 weights (`int4_linear`'s layout): q the first output row's bytes, scale its group scales
template <typename W>
static void block_rows_i4(const uint8_t* q, const float* scale, int64_t group, const W* x, const W* bias, W* y,
                          int64_t M, int64_t I, int64_t O, int64_t n, float* scratch) {
  const ToBiased<W> out{bias, y, O};
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<W, c10::BFloat16>::value) {
    return rows_i4_dp_any(M, q, scale, x, I, group, 0, n, out);
  }
#endif
  const float* xf = widened(x, M * I, scratch);
  rows_i4_any(M, q, scale, xf, I, group, 0, n, out);
}

// block_rows on int8 weights q (w ~ scale[o] * q[o], export/serve/linears.py `quantize_int8`): int8_linear's kernels
template <typename W>
static void block_rows_i8(const int8_t* q, const float* scale, const W* x, const W* bias, W* y, int64_t M, int64_t I,
                          int64_t O, int64_t n, float* scratch) {
  const ToDequantized<W> out{scale, bias, y, O};
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<W, c10::BFloat16>::value) {
    return rows_i8_dp_any(M, q, x, I, 0, n, out);
  }
#endif
  const float* xf = widened(x, M * I, scratch);
  rows_any(M, q, xf, I, 0, n, out);
}

struct Task {
  int64_t expert, o0, o1, cost;
};

// Tasks split between the threads by cost, in order, each thread a contiguous run of about an equal share.
static void run_tasks(const std::vector<Task>& tasks, int64_t bytes_per_row, const std::function<void(const Task&)>& fn) {
  int64_t total = 0;
  for (const Task& t : tasks) total += t.cost;
  // under ~2 MB of weight reads in all, one thread (waking another costs as much as reading 2 MB)
  const int64_t threads = total * bytes_per_row < (int64_t(2) << 20) ? 1 : at::get_num_threads();
  if (threads <= 1) {
    for (const Task& t : tasks) fn(t);
    return;
  }
  std::vector<size_t> first(threads + 1, tasks.size());
  first[0] = 0;
  int64_t done = 0;
  size_t i = 0;
  for (int64_t th = 1; th < threads; ++th) {
    const int64_t until = total * th / threads;
    while (i < tasks.size() && done + tasks[i].cost / 2 < until) done += tasks[i++].cost;
    first[th] = i;
  }
  std::vector<int64_t> bounds(first.begin(), first.end());
  shared_work(bounds, [&](int64_t k) { fn(tasks[k]); });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// 16 floats rounded to bf16 (to nearest even, as c10::BFloat16) and widened back.
static inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// silu on 16 lanes: g / (1 + exp(-g)), exp as `vexp` (~1 ulp; -g clamped to [-87, 88], where silu is g or ~0).
static inline __m512 silu16(__m512 g) {
  const __m512 x = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.0f));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), vexp(x)));
}

// The SwiGLU epilogue of `rows` (<= 32) rows and `on` (<= 32) outputs of AMX sums g, up ([output][row]): bias, each
// rounding where F.linear, F.silu and the product round, 16 rows a vector; out[j * F + o] for row j, output o.
static void swiglu_rows(const float (*g)[32], const float (*up)[32], const B16* b, const B16* bu, int rows, int on,
                        int64_t F, B16* out) {
  alignas(64) uint16_t res[32];
  for (int o = 0; o < on; ++o) {
    const __m512 bg = _mm512_set1_ps(b ? static_cast<float>(b[o]) : 0.0f);
    const __m512 bv = _mm512_set1_ps(bu ? static_cast<float>(bu[o]) : 0.0f);
    for (int j0 = 0; j0 < rows; j0 += 16) {
      const __mmask16 m = rows - j0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (rows - j0)) - 1);
      const __m512 gv = round_bf16(_mm512_add_ps(_mm512_maskz_loadu_ps(m, &g[o][j0]), bg));
      const __m512 uv = round_bf16(_mm512_add_ps(_mm512_maskz_loadu_ps(m, &up[o][j0]), bv));
      _mm256_store_si256(reinterpret_cast<__m256i*>(res + j0),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(round_bf16(silu16(gv)), uv)));
    }
    uint16_t* col = reinterpret_cast<uint16_t*>(out + o);
    for (int j = 0; j < rows; ++j) col[j * F] = res[j];
  }
}

#endif

static inline float silu(float g) { return g / (1.0f + std::exp(-g)); }
static inline float gelu(float h) { return 0.5f * h * (1.0f + std::erf(h * 0.70710678118654752f)); }

#if defined(__AVX512VNNI__)
// expert_mlps for W8A8 experts (w1[e], w2[e] as vnni_pack packs them, s1[e] [2, (2)F] and s2[e] [2, C] as w8a8_of
// takes them): each row of x rounded to int8 once, fc1 (gate and up) by tiles of 64 outputs, the activation rounded
// as the passes of expert_mlps_typed round it, each row of it rounded to int8 in turn, then fc2. With swiglu, F is
// a multiple of 64 (gate and up in tiles of their own).
template <typename T>
static void expert_mlps_w8a8(const at::Tensor& x, const std::vector<int64_t>& counts,
                             const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                             const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2, bool swiglu,
                             const std::vector<at::Tensor>& s1, const std::vector<at::Tensor>& s2, at::Tensor& y) {
  const bool bias = !b1.empty();
  const int64_t E = counts.size(), C = x.size(1), F = s1[0].size(1) / (swiglu ? 2 : 1);
  const int64_t C4 = (C + 3) / 4 * 4, F4 = (F + 3) / 4 * 4;
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  const int64_t P = start[E];
  std::vector<uint8_t> xu(P * C4), au(P * F4);
  std::vector<float> xs(P), as(P);
  int8_rows_of(x.data_ptr<T>(), P, C, C4, xu.data(), xs.data());
  at::Tensor act = at::empty({P, F}, x.options());
  T* ap = act.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  auto blocks = [](int64_t rows) { return (rows + VNNI_MAX_ROWS - 1) / VNNI_MAX_ROWS; };
  const int64_t tf = (F + VNNI_TILE - 1) / VNNI_TILE, tc = (C + VNNI_TILE - 1) / VNNI_TILE;
  std::vector<Task> tasks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t t = 0; t < tf && counts[e]; ++t) tasks.push_back({e, t, t + 1, blocks(counts[e]) * VNNI_TILE});
  // fc1 and the activation: tile t of gate (and of up: tile tf + t) into act[:, 64t : 64t + 64]
  run_tasks(tasks, (swiglu ? 2 : 1) * C, [&](const Task& task) {
    const int64_t e = task.expert, t = task.o0, r0 = start[e], M = counts[e];
    const W8A8 w = w8a8_of(w1[e], s1[e], C);
    const T* b = bias ? b1[e].data_ptr<T>() : nullptr;
    std::vector<int32_t> acc(VNNI_MAX_ROWS * 64);
    std::vector<float> g(M * VNNI_TILE), u(swiglu ? M * VNNI_TILE : 0);
    const int64_t o0 = t * VNNI_TILE, n = std::min(VNNI_TILE, F - o0);
    auto into = [&](float* dst, int64_t base) {  // dst [M][64]: the tile's outputs from `base`
      return [dst, base, b](int64_t m, int64_t o, int64_t k, __m512 v) {
        alignas(64) float f[16];
        _mm512_store_ps(f, v);
        for (int64_t i = 0; i < k; ++i) {  // the fc's output in T, with its bias, as F.linear rounds it
          const float bo = b ? static_cast<float>(b[o + i]) : 0.0f;
          dst[m * VNNI_TILE + (o + i - base)] = static_cast<float>(static_cast<T>(f[i] + bo));
        }
      };
    };
    w8a8_tile(w, t, xu.data() + r0 * C4, xs.data() + r0, M, acc.data(), into(g.data(), o0));
    if (swiglu) w8a8_tile(w, tf + t, xu.data() + r0 * C4, xs.data() + r0, M, acc.data(), into(u.data(), F + o0));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < n; ++o) {
        const float gv = g[m * VNNI_TILE + o];
        ap[(r0 + m) * F + o0 + o] = swiglu ? static_cast<T>(static_cast<float>(static_cast<T>(silu(gv))) *
                                                             u[m * VNNI_TILE + o])
                                           : static_cast<T>(gelu(gv));
      }
  });
  int8_rows_of(ap, P, F, F4, au.data(), as.data());
  tasks.clear();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t t = 0; t < tc && counts[e]; ++t) tasks.push_back({e, t, t + 1, blocks(counts[e]) * VNNI_TILE});
  // fc2: tile t of each expert's outputs
  run_tasks(tasks, F, [&](const Task& task) {
    const int64_t e = task.expert, t = task.o0, r0 = start[e], M = counts[e];
    const W8A8 w = w8a8_of(w2[e], s2[e], F);
    const T* b = bias ? b2[e].data_ptr<T>() : nullptr;
    std::vector<int32_t> acc(VNNI_MAX_ROWS * 64);
    w8a8_tile(w, t, au.data() + r0 * F4, as.data() + r0, M, acc.data(), [&](int64_t m, int64_t o, int64_t k, __m512 v) {
      alignas(64) float f[16];
      _mm512_store_ps(f, v);
      for (int64_t i = 0; i < k; ++i)
        yp[(r0 + m) * C + o + i] = static_cast<T>(f[i] + (b ? static_cast<float>(b[o + i]) : 0.0f));
    });
  });
}
#endif

template <typename T>
static void expert_mlps_typed(const at::Tensor& x, const std::vector<int64_t>& counts,
                              const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                              const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2,
                              bool swiglu, const std::vector<at::Tensor>& s1, const std::vector<at::Tensor>& s2,
                              at::Tensor& y) {
  // int8: w1, w2 int8 with one scale a row in s1, s2; int4: w1, w2 two values a byte, a scale a group (s1, s2 2-D);
  // W8A8: w1, w2 packed in tiles (1-D), s1, s2 [2, rows]
#if defined(__AVX512VNNI__)
  if (!s1.empty() && w1[0].dim() == 1) return expert_mlps_w8a8<T>(x, counts, w1, b1, w2, b2, swiglu, s1, s2, y);
#endif
  const bool bias = !b1.empty(), int4 = !s1.empty() && w1[0].scalar_type() == at::kByte;
  const bool int8 = !s1.empty() && !int4;
  const int64_t E = counts.size(), C = x.size(1), F = w2[0].size(1) * (int4 ? 2 : 1);  // experts, hidden, width
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  const T* xp = x.data_ptr<T>();
  at::Tensor act = at::empty({start[E], F}, x.options());  // the activation of each row, fc2's input
  T* ap = act.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  auto passes = [](int64_t rows) { return (rows + MAX_ROWS - 1) / MAX_ROWS; };
  // AMX (bf16, where this build and the process have it): the experts with more rows than one pass of MAX_ROWS,
  // their rows packed once per fc (`amx_pack_rows`), `chunk[e]` their first row chunk of 16 (-1: no AMX)
  std::vector<int64_t> chunk(E + 1, -1);
  int64_t chunks = 0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (std::is_same<T, B16>::value) {
    if (C % 32 == 0 && F % 32 == 0 && s1.empty() && amx_ready())
      for (int64_t e = 0; e < E; ++e)
        if (counts[e] > MAX_ROWS) chunk[e] = chunks, chunks += (counts[e] + 15) / 16;
  }
#endif
  at::Tensor packed = at::empty({chunks * std::max(C, F) * 16}, x.options());
  auto pack = [&](const T* rows, int64_t I) {  // each AMX expert's rows, in parallel
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (std::is_same<T, B16>::value) {
      at::parallel_for(0, E, 1, [&](int64_t b, int64_t e1) {
        for (int64_t e = b; e < e1; ++e)
          if (chunk[e] >= 0) amx_pack_rows(rows + start[e] * I, counts[e], I, packed.data_ptr<T>() + chunk[e] * I * 16);
      });
    }
#endif
  };
  // sums [output][row] of rows [r, r + rows) (rows <= 32) of AMX expert e, packed for a fc of I inputs, against the
  // n <= 32 weight rows at w (I apart); `release` once a thread's task is done
  auto amx_sums = [&](int64_t e, int64_t r, int rows, const T* w, int n, int64_t I, float (*c)[32]) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (std::is_same<T, B16>::value)
      amx_weight_rows(w, n, packed.data_ptr<B16>() + (chunk[e] + r / 16) * I * 16, rows > 16 ? 2 : 1, I, c);
#endif
  };
  auto release = [] {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    _tile_release();
#endif
  };
  // rows [o0, o0 + n) of expert e's weight W (I inputs; its scales S with int8) against M rows xr -> out (O apart)
  auto fc = [&](const std::vector<at::Tensor>& W, const std::vector<at::Tensor>& S, int64_t e, int64_t o0,
                const T* xr, const T* b, T* out, int64_t M, int64_t I, int64_t O, int64_t n, float* scratch) {
    if (int8)
      return block_rows_i8<T>(W[e].data_ptr<int8_t>() + o0 * I, S[e].data_ptr<float>() + o0, xr, b, out, M, I, O, n,
                              scratch);
    if (int4) {
      const int64_t G = S[e].size(1);
      return block_rows_i4<T>(W[e].data_ptr<uint8_t>() + o0 * (I / 2), S[e].data_ptr<float>() + o0 * G, I / G, xr, b,
                              out, M, I, O, n, scratch);
    }
    block_rows<T>(W[e].data_ptr<T>() + o0 * I, xr, b, out, M, I, O, n, scratch);
  };
  std::vector<Task> tasks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < F && counts[e]; o += BLOCK)
      tasks.push_back({e, o, std::min(F, o + BLOCK), passes(counts[e]) * (std::min(F, o + BLOCK) - o)});
  pack(xp, C);
  // fc1 and the activation: gate rows [o0, o1) and up rows F + [o0, o1) (swiglu), into act[:, o0:o1]
  run_tasks(tasks, (swiglu ? 2 : 1) * C * int64_t(sizeof(T)), [&](const Task& t) {
    const T* w = s1.empty() ? w1[t.expert].data_ptr<T>() : nullptr;
    const T* b = bias ? b1[t.expert].data_ptr<T>() : nullptr;
    const int64_t n = t.o1 - t.o0;
    if (chunk[t.expert] >= 0) {
      alignas(64) float g[32][32], up[32][32];
      for (int64_t r = 0; r < counts[t.expert]; r += 32) {
        const int rows = static_cast<int>(std::min<int64_t>(32, counts[t.expert] - r));
        for (int64_t o0 = t.o0; o0 < t.o1; o0 += 32) {
          const int on = static_cast<int>(std::min<int64_t>(32, t.o1 - o0));
          amx_sums(t.expert, r, rows, w + o0 * C, on, C, g);
          if (swiglu) amx_sums(t.expert, r, rows, w + (F + o0) * C, on, C, up);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
          if constexpr (std::is_same<T, B16>::value) {
            if (swiglu) {  // vectorised: ~3 M activations a layer in a prefill of 2048 tokens
              swiglu_rows(g, up, b ? b + o0 : nullptr, b ? b + F + o0 : nullptr, rows, on, F,
                          ap + (start[t.expert] + r) * F + o0);
              continue;
            }
          }
#endif
          for (int j = 0; j < rows; ++j)
            for (int o = 0; o < on; ++o) {  // rounded as the passes below round
              const T gt = static_cast<T>(g[o][j] + (b ? static_cast<float>(b[o0 + o]) : 0.0f));
              T* out = ap + (start[t.expert] + r + j) * F + o0 + o;
              if (swiglu) {
                const T ut = static_cast<T>(up[o][j] + (b ? static_cast<float>(b[F + o0 + o]) : 0.0f));
                *out = static_cast<T>(static_cast<float>(static_cast<T>(silu(static_cast<float>(gt)))) *
                                      static_cast<float>(ut));
              } else {
                *out = static_cast<T>(gelu(static_cast<float>(gt)));
              }
            }
        }
      }
      return release();
    }
    T g[MAX_ROWS * BLOCK], u[MAX_ROWS * BLOCK];
    std::vector<float> scratch(MAX_ROWS * C);
    for (int64_t r = start[t.expert]; r < start[t.expert + 1]; r += MAX_ROWS) {
      const int64_t M = std::min(MAX_ROWS, start[t.expert + 1] - r);
      fc(w1, s1, t.expert, t.o0, xp + r * C, b ? b + t.o0 : nullptr, g, M, C, BLOCK, n, scratch.data());
      if (swiglu)
        fc(w1, s1, t.expert, F + t.o0, xp + r * C, b ? b + F + t.o0 : nullptr, u, M, C, BLOCK, n, scratch.data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t o = 0; o < n; ++o) {
          T* out = ap + (r + m) * F + t.o0 + o;
          if (swiglu)  // as F.silu(gate) * up in this dtype: silu rounded, then the product rounded
            *out = static_cast<T>(static_cast<float>(static_cast<T>(silu(static_cast<float>(g[m * BLOCK + o])))) *
                                  static_cast<float>(u[m * BLOCK + o]));
          else
            *out = static_cast<T>(gelu(static_cast<float>(g[m * BLOCK + o])));
        }
    }
  });
  tasks.clear();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < C && counts[e]; o += BLOCK)
      tasks.push_back({e, o, std::min(C, o + BLOCK), passes(counts[e]) * (std::min(C, o + BLOCK) - o)});
  pack(ap, F);
  // fc2: output columns [o0, o1) of each of the expert's rows
  run_tasks(tasks, F * int64_t(sizeof(T)), [&](const Task& t) {
    const T* w = s1.empty() ? w2[t.expert].data_ptr<T>() : nullptr;
    const T* b = bias ? b2[t.expert].data_ptr<T>() : nullptr;
    if (chunk[t.expert] >= 0) {
      alignas(64) float c[32][32];
      for (int64_t r = 0; r < counts[t.expert]; r += 32) {
        const int rows = static_cast<int>(std::min<int64_t>(32, counts[t.expert] - r));
        for (int64_t o0 = t.o0; o0 < t.o1; o0 += 32) {
          const int on = static_cast<int>(std::min<int64_t>(32, t.o1 - o0));
          amx_sums(t.expert, r, rows, w + o0 * F, on, F, c);
          for (int j = 0; j < rows; ++j)
            for (int o = 0; o < on; ++o)
              yp[(start[t.expert] + r + j) * C + o0 + o] =
                  static_cast<T>(c[o][j] + (b ? static_cast<float>(b[o0 + o]) : 0.0f));
        }
      }
      return release();
    }
    std::vector<float> scratch(MAX_ROWS * F);
    for (int64_t r = start[t.expert]; r < start[t.expert + 1]; r += MAX_ROWS) {
      const int64_t M = std::min(MAX_ROWS, start[t.expert + 1] - r);
      fc(w2, s2, t.expert, t.o0, ap + r * F, b ? b + t.o0 : nullptr, yp + r * C + t.o0, M, F, C, t.o1 - t.o0,
         scratch.data());
    }
  });
}

// The routed experts' MLPs over their rows: x [P, C] holds counts[0] rows of the first listed expert, then counts[1]
// of the second, ...; expert i is w1[i] ([2F, C] swiglu as [gate; up], or [F, C]), b1[i] ([2F] or [F]), then the
// activation (silu(gate) * up, or exact GeLU), then w2[i] ([C, F]), b2[i] ([C]); biases for every expert or none
// (empty lists). y [P, C] in x's order. fp32 or bf16, all alike; rounded to it where F.linear, F.silu and the
// product round. int8 experts (s1, s2 given): w1[i], w2[i] int8 with one fp32 scale per row in s1[i], s2[i]
// (export/serve/linears.py `quantize_int8`), each fc as int8_linear computes it; biases in x's dtype.
at::Tensor expert_mlps(const at::Tensor& x, const std::vector<int64_t>& counts, const std::vector<at::Tensor>& w1,
                          const std::vector<at::Tensor>& b1, const std::vector<at::Tensor>& w2,
                          const std::vector<at::Tensor>& b2, bool swiglu, const std::vector<at::Tensor>& s1,
                          const std::vector<at::Tensor>& s2) {
  RECORD_FUNCTION("moe_pipeline::expert_mlps", std::vector<c10::IValue>({x}));
  const int64_t E = counts.size();
  TORCH_CHECK(E > 0 && int64_t(w1.size()) == E && int64_t(w2.size()) == E &&
                  (b1.empty() || int64_t(b1.size()) == E) && b1.size() == b2.size(),
              "expert_mlps: a count, w1 and w2 per expert (and b1, b2 for all or none)");
  const bool quant = !s1.empty(), int4 = quant && w1[0].scalar_type() == at::kByte;
  TORCH_CHECK(s1.size() == s2.size() && (!quant || int64_t(s1.size()) == E),
              "expert_mlps: int8 and int4 weights take s1 and s2, their scales, per expert each (or neither)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "expert_mlps: x [rows, hidden], contiguous CPU");
  const bool w8a8 = quant && w1[0].dim() == 1;
  const int64_t C = x.size(1), packs = int4 ? 2 : 1;
  const int64_t F = w8a8 ? s1[0].size(-1) / (swiglu ? 2 : 1) : w2[0].size(-1) * packs;
  int64_t rows = 0;
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "expert_mlps: fp32 or bf16, not ", dt);
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(counts[e] >= 0, "expert_mlps: negative count");
    rows += counts[e];
    if (w8a8) {  // W8A8 experts: their tiles and [2, rows] scales (w8a8_of checks both)
#if defined(__AVX512VNNI__)
      TORCH_CHECK(w1[e].dim() == 1 && w2[e].dim() == 1 && s1[e].dim() == 2 && s2[e].dim() == 2 &&
                      s1[e].size(1) == (swiglu ? 2 : 1) * F && s2[e].size(1) == C && (!swiglu || F % VNNI_TILE == 0),
                  "expert_mlps: expert ", e, ": W8A8 weights (tiles), scales [2, ", (swiglu ? 2 : 1) * F, "] and [2, ",
                  C, "]; swiglu experts of a multiple of ", VNNI_TILE, " columns");
      w8a8_of(w1[e], s1[e], C);
      w8a8_of(w2[e], s2[e], F);
      if (!b1.empty())
        TORCH_CHECK(b1[e].numel() == s1[e].size(1) && b2[e].numel() == C && b1[e].is_contiguous() &&
                        b2[e].is_contiguous() && b1[e].scalar_type() == dt && b2[e].scalar_type() == dt,
                    "expert_mlps: biases of the weights' sizes and dtype");
      continue;
#else
      TORCH_CHECK(false, "expert_mlps: W8A8 experts need this kernel's AVX512_VNNI build");
#endif
    }
    TORCH_CHECK(w1[e].dim() == 2 && w1[e].size(0) == (swiglu ? 2 : 1) * F && w1[e].size(1) * packs == C &&
                    w2[e].dim() == 2 && w2[e].size(0) == C && w2[e].size(1) * packs == F,
                "expert_mlps: expert ", e, ": w1 ", w1[e].sizes(), ", w2 ", w2[e].sizes(), " for hidden ", C);
    for (const at::Tensor* t : {&w1[e], &w2[e]})
      TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() &&
                      t->scalar_type() == (int4 ? at::kByte : quant ? at::kChar : dt),
                  quant ? "expert_mlps: contiguous CPU int8 (or packed int4) weights with s1, s2, alike"
                        : "expert_mlps: contiguous CPU weights of x's dtype (int8 ones with s1, s2)");
    if (quant && !int4)
      TORCH_CHECK(s1[e].scalar_type() == at::kFloat && s2[e].scalar_type() == at::kFloat && s1[e].is_contiguous() &&
                      s2[e].is_contiguous() && s1[e].numel() == w1[e].size(0) && s2[e].numel() == C,
                  "expert_mlps: expert ", e, ": s1 and s2 fp32, one scale per row of w1 and w2");
    if (int4)
      TORCH_CHECK(s1[e].scalar_type() == at::kFloat && s2[e].scalar_type() == at::kFloat && s1[e].is_contiguous() &&
                      s2[e].is_contiguous() && s1[e].dim() == 2 && s2[e].dim() == 2 &&
                      s1[e].size(0) == w1[e].size(0) && s2[e].size(0) == C && s1[e].size(1) > 0 &&
                      s2[e].size(1) > 0 && C % s1[e].size(1) == 0 && F % s2[e].size(1) == 0 &&
                      (C / s1[e].size(1)) % 64 == 0 && (F / s2[e].size(1)) % 64 == 0,
                  "expert_mlps: expert ", e, ": int4 scales [rows, groups] fp32, groups of a multiple of 64 inputs");
    if (!b1.empty())
      TORCH_CHECK(b1[e].numel() == w1[e].size(0) && b2[e].numel() == C && b1[e].is_contiguous() &&
                      b2[e].is_contiguous() && b1[e].scalar_type() == dt && b2[e].scalar_type() == dt,
                  "expert_mlps: biases of the weights' sizes and dtype");
  }
  TORCH_CHECK(rows == x.size(0), "expert_mlps: the counts add up to ", rows, " rows, x has ", x.size(0));
  at::Tensor y = at::empty({rows, C}, x.options());
  if (rows == 0) return y;
  if (dt == at::kFloat)
    expert_mlps_typed<float>(x, counts, w1, b1, w2, b2, swiglu, s1, s2, y);
  else
    expert_mlps_typed<c10::BFloat16>(x, counts, w1, b1, w2, b2, swiglu, s1, s2, y);
  return y;
}

// -- a whole MoE layer on one rank: routing, the experts, the weighted sum ----------------------------------------
//
// With every expert on this rank (1 rank), the layer's ~25 operators of routing and combining (router product in
// fp32, softmax, top-k, renormalisation, grouping, gather, index_select, products) cost more at batch 1 than its
// experts' read: here they are two calls, `route` and `routed_experts`.

// x [S, C] (fp32 or bf16), wg [E, C] fp32: the router's probabilities softmax(x wg^T) in fp32 (pipeline/model.py
// `router_logits` + `route`, no capacity), each token's top k (the larger first, the lower expert first among equal
// ones) and their weights, divided by their sum with `renormalize`; and the tokens per expert.
// Returns (weights [S, k] fp32, experts [S, k] int64, counts [E] int64).
std::tuple<at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& x, const at::Tensor& wg,
                                                              int64_t k, bool renormalize) {
  RECORD_FUNCTION("moe_pipeline::route", std::vector<c10::IValue>({x, wg}));
  TORCH_CHECK(x.dim() == 2 && wg.dim() == 2 && x.size(1) == wg.size(1), "route: x [tokens, C], wg [experts, C]");
  TORCH_CHECK(x.is_contiguous() && wg.is_contiguous() && x.device().is_cpu() && wg.device().is_cpu() &&
                  wg.scalar_type() == at::kFloat && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "route: contiguous CPU x (fp32 or bf16) and fp32 wg");
  const int64_t S = x.size(0), C = x.size(1), E = wg.size(0);
  TORCH_CHECK(k >= 1 && k <= E, "route: top_k ", k, " of ", E, " experts");
  at::Tensor weights = at::empty({S, k}, wg.options());
  at::Tensor experts = at::empty({S, k}, wg.options().dtype(at::kLong));
  float* wp = weights.data_ptr<float>();
  int64_t* ep = experts.data_ptr<int64_t>();
  const float* g = wg.data_ptr<float>();
  const int64_t Cv = C / VW * VW;
  auto one = [&](const float* xr, int64_t s, float* p) {  // token s, x widened to fp32 in xr; p: room for E
    for (int64_t e = 0; e < E; ++e) {
      const float* gr = g + e * C;
      vf acc = vzero();
      int64_t c = 0;
      for (; c < Cv; c += VW) acc = vfma(vload(gr + c), vload(xr + c), acc);
      float dot = vsum(acc);
      for (; c < C; ++c) dot += gr[c] * xr[c];
      p[e] = dot;
    }
    float m = -INFINITY, total = 0.0f;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, p[e]);
    for (int64_t e = 0; e < E; ++e) total += (p[e] = std::exp(p[e] - m));
    for (int64_t e = 0; e < E; ++e) p[e] /= total;
    float chosen = 0.0f;
    for (int64_t j = 0; j < k; ++j) {  // k passes: k is 1-8
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= ep[s * k + i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      ep[s * k + j] = best;
      chosen += (wp[s * k + j] = p[best]);
    }
    if (renormalize) {
      const float d = std::max(chosen, std::numeric_limits<float>::epsilon());
      for (int64_t j = 0; j < k; ++j) wp[s * k + j] /= d;
    }
  };
  at::parallel_for(0, S, 64, [&](int64_t b, int64_t e) {
    std::vector<float> xr(C), p(E);
    for (int64_t s = b; s < e; ++s) {
      if (x.scalar_type() == at::kFloat) {
        const float* xs = x.data_ptr<float>() + s * C;
        std::copy(xs, xs + C, xr.begin());
      } else {
        const c10::BFloat16* xs = x.data_ptr<c10::BFloat16>() + s * C;
        for (int64_t c = 0; c < C; ++c) xr[c] = static_cast<float>(xs[c]);
      }
      one(xr.data(), s, p.data());
    }
  });
  at::Tensor counts = at::zeros({E}, experts.options());
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < S * k; ++i) ++cp[ep[i]];
  return {weights, experts, counts};
}

template <typename T>
static void combine(const T* y, const float* weights, const std::vector<int64_t>& pair_row, T* out, int64_t S,
                    int64_t k, int64_t C) {
  at::parallel_for(0, S, 64, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s) {
      T* o = out + s * C;
      for (int64_t j = 0; j < k; ++j) {
        const T* yr = y + pair_row[s * k + j] * C;
        const float w = static_cast<float>(static_cast<T>(weights[s * k + j]));  // the weight in the output dtype
        for (int64_t c = 0; c < C; ++c)  // as y0 * w0, then addcmul_: one rounding per choice
          o[c] = static_cast<T>((j ? static_cast<float>(o[c]) : 0.0f) + static_cast<float>(yr[c]) * w);
      }
    }
  });
}

// The (token, choice) pairs of the experts in `active` (ascending, with their w1, b1, w2, b2 as expert_mlps), each
// expert once over its pairs' tokens (in token order): x [S, C], experts and weights [S, k] as `route` gives them.
// Returns the experts' outputs [pairs, C] and each pair's row in it (pair i = token i / k's choice i % k), -1 for a
// pair whose expert is not in `active` (`partial`: another rank computes it; else that is an error).
static std::pair<at::Tensor, std::vector<int64_t>> run_pairs(
    const char* op, const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
    const std::vector<int64_t>& active, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
    const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2, bool swiglu, bool partial,
    const std::vector<at::Tensor>& s1, const std::vector<at::Tensor>& s2) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && experts.dim() == 2 && experts.size(0) == x.size(0) &&
                  experts.is_contiguous() && experts.scalar_type() == at::kLong && weights.sizes() == experts.sizes() &&
                  weights.is_contiguous() && weights.scalar_type() == at::kFloat,
              op, ": x [S, C], experts [S, k] int64 and weights [S, k] fp32, contiguous");
  const int64_t S = x.size(0), C = x.size(1), k = experts.size(1), A = active.size();
  TORCH_CHECK(A > 0, op, ": no active expert");
  const int64_t top = *std::max_element(active.begin(), active.end());
  std::vector<int64_t> slot(top + 1, -1);
  for (int64_t i = 0; i < A; ++i) {
    TORCH_CHECK(active[i] >= 0 && (i == 0 || active[i] > active[i - 1]), op, ": active experts ascending");
    slot[active[i]] = i;
  }
  const int64_t* ep = experts.data_ptr<int64_t>();
  auto slot_of = [&](int64_t e) { return e >= 0 && e <= top ? slot[e] : -1; };
  std::vector<int64_t> counts(A, 0);
  for (int64_t i = 0; i < S * k; ++i) {
    const int64_t sl = slot_of(ep[i]);
    TORCH_CHECK(sl >= 0 || partial, op, ": token ", i / k, " chose expert ", ep[i], ", not an active one");
    if (sl >= 0) ++counts[sl];
  }
  std::vector<int64_t> start(A + 1, 0), pair_row(S * k, -1);
  for (int64_t i = 0; i < A; ++i) start[i + 1] = start[i] + counts[i];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < S * k; ++i)
    if (slot_of(ep[i]) >= 0) pair_row[i] = fill[slot_of(ep[i])]++;  // token order within an expert
  at::Tensor rows = at::empty({start[A], C}, x.options());
  const int64_t bytes = C * x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* rp = static_cast<char*>(rows.data_ptr());
  for (int64_t i = 0; i < S * k; ++i)
    if (pair_row[i] >= 0) std::memcpy(rp + pair_row[i] * bytes, xp + (i / k) * bytes, bytes);
  return {expert_mlps(rows, counts, w1, b1, w2, b2, swiglu, s1, s2), pair_row};
}

static at::Tensor combined(const at::Tensor& y, const at::Tensor& weights, const std::vector<int64_t>& pair_row,
                              int64_t S, int64_t C) {
  const int64_t k = weights.size(1);
  at::Tensor out = at::empty({S, C}, y.options());
  if (y.scalar_type() == at::kFloat)
    combine<float>(y.data_ptr<float>(), weights.data_ptr<float>(), pair_row, out.data_ptr<float>(), S, k, C);
  else
    combine<c10::BFloat16>(y.data_ptr<c10::BFloat16>(), weights.data_ptr<float>(), pair_row,
                           out.data_ptr<c10::BFloat16>(), S, k, C);
  return out;
}

// Every token's experts and their weighted sum: x [S, C] the layer's tokens, experts and weights [S, k] as `route`
// gives them; `active`: the experts that received a token, in increasing order, with their w1, b1, w2, b2 (as
// expert_mlps). Each expert runs once over its tokens (in token order), then out[s] = sum_j weights[s, j] *
// y[s, j], the choices in order, rounded as `y0 * w0` and then `addcmul_` per further choice (the weights cast
// to the output dtype first), as export/serve/placement/exchange.py's PlacedMoE.
at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                             const std::vector<int64_t>& active, const std::vector<at::Tensor>& w1,
                             const std::vector<at::Tensor>& b1, const std::vector<at::Tensor>& w2,
                             const std::vector<at::Tensor>& b2, bool swiglu, const std::vector<at::Tensor>& s1,
                             const std::vector<at::Tensor>& s2) {
  RECORD_FUNCTION("moe_pipeline::routed_experts", std::vector<c10::IValue>({x}));
  auto [y, pair_row] = run_pairs("routed_experts", x, experts, weights, active, w1, b1, w2, b2, swiglu, false, s1, s2);
  return combined(y, weights, pair_row, x.size(0), x.size(1));
}

// Expert parallelism's half of routed_experts: the outputs of the pairs whose expert is in `active` (this rank's),
// y [S, k, C] with zeros where another rank's expert was chosen, so that a sum over the ranks (an all-reduce: x + 0
// = x, exact) is every pair's output; then `combine_pairs` on the sum is routed_experts' answer to the bit.
at::Tensor expert_pairs(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                           const std::vector<int64_t>& active, const std::vector<at::Tensor>& w1,
                           const std::vector<at::Tensor>& b1, const std::vector<at::Tensor>& w2,
                           const std::vector<at::Tensor>& b2, bool swiglu, const std::vector<at::Tensor>& s1,
                           const std::vector<at::Tensor>& s2) {
  RECORD_FUNCTION("moe_pipeline::expert_pairs", std::vector<c10::IValue>({x}));
  const int64_t S = x.size(0), C = x.size(1), k = experts.size(1);
  auto [y, pair_row] = run_pairs("expert_pairs", x, experts, weights, active, w1, b1, w2, b2, swiglu, true, s1, s2);
  at::Tensor out = at::zeros({S, k, C}, x.options());
  const int64_t bytes = C * x.element_size();
  const char* yp = static_cast<const char*>(y.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < S * k; ++i)
    if (pair_row[i] >= 0) std::memcpy(op + i * bytes, yp + pair_row[i] * bytes, bytes);
  return out;
}

// out[s] = sum_j weights[s, j] * y[s, j] over y [S, k, C] (fp32 or bf16), rounded as routed_experts rounds.
at::Tensor combine_pairs(const at::Tensor& y, const at::Tensor& weights) {
  RECORD_FUNCTION("moe_pipeline::combine_pairs", std::vector<c10::IValue>({y}));
  TORCH_CHECK(y.dim() == 3 && y.is_contiguous() && weights.dim() == 2 && weights.is_contiguous() &&
                  weights.scalar_type() == at::kFloat && weights.size(0) == y.size(0) && weights.size(1) == y.size(1) &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "combine_pairs: y [S, k, C] fp32 or bf16 and weights [S, k] fp32, contiguous");
  const int64_t S = y.size(0), k = y.size(1);
  std::vector<int64_t> pair_row(S * k);
  for (int64_t i = 0; i < S * k; ++i) pair_row[i] = i;
  return combined(y, weights, pair_row, S, y.size(2));
}

// -- RMSNorm ----------------------------------------------------------------------------------------------------
//
// pipeline/model.py's RMSNorm (the Hugging Face families'): each row of C values normalised in fp32 by
// 1 / sqrt(mean(x^2) + eps), rounded to x's dtype, then times the weight (rounded again). One call where the
// module's seven operators each woke the thread pool: five norms a layer in Qwen3-MoE (two of them per head).
template <typename T>
static void rms_norm_rows(const T* x, const T* w, T* y, int64_t C, float eps, int64_t r0, int64_t r1) {
  const int64_t Cv = C / VW * VW;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * C;
    T* yr = y + r * C;
    vf acc = vzero();
    int64_t i = 0;
    for (; i < Cv; i += VW) {
      const vf v = vload_f(xr + i);
      acc = vfma(v, v, acc);
    }
    float ss = vsum(acc);
    for (; i < C; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
    for (i = 0; i < C; ++i)
      yr[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(static_cast<float>(xr[i]) * inv)));
  }
}

// x [..., C] contiguous, weight [C], both fp32 or bf16 alike -> y of x's shape.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("moe_pipeline::rms_norm", std::vector<c10::IValue>({x}));
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: x [..., C], weight [C]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.device().is_cpu() && weight.device().is_cpu(),
              "rms_norm: contiguous CPU tensors");
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && weight.scalar_type() == dt,
              "rms_norm: x and weight fp32 or bf16, alike");
  at::Tensor y = at::empty_like(x);
  const int64_t C = x.size(-1), R = C ? x.numel() / C : 0;
  const int64_t grain = std::max<int64_t>(1, (int64_t(64) << 10) / (C * int64_t(x.element_size()) + 1));
  AT_DISPATCH_SWITCH(dt, "rms_norm", AT_DISPATCH_CASE(at::kFloat, [&] {
    at::parallel_for(0, R, grain, [&](int64_t b, int64_t e) {
      rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), C,
                              static_cast<float>(eps), b, e);
    });
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    at::parallel_for(0, R, grain, [&](int64_t b, int64_t e) {
      rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), C,
                              static_cast<float>(eps), b, e);
    });
  }));
  return y;
}

// -- a decode token's heads ---------------------------------------------------------------------------------------
//
// pipeline/model.py's Attention between its projections and its attention, for one new token per row: q, k, v [B,
// width] (the fused projection's three parts, each row `stride` elements from the next, or three tensors) into q
// [B, H, D], k and v [B, Hkv, D], contiguous for paged_attention; q and k normalised as its qk_norm does (q_w, k_w
// [D]: one RMSNorm per head, "head", Qwen3-MoE; [H D] and [Hkv D]: over the whole projection, "full", OLMoE; none:
// no norm) and rotated by cos, sin [B, D] (rotate-half RoPE; none: learned positions). Rounded to the dtype where
// the module's operators round: the norm as `rms_norm`, RoPE's two products and their sum one by one (no fused
// multiply-add: `kept` holds a product in a register as its own rounded value). One call where the module took
// ~25 operators a layer (the split, two norms, two RoPEs of six operators, the transposes and copies).
static inline float kept(float v) {
  asm volatile("" : "+x"(v));
  return v;
}

template <typename T>
static void heads_rope(T* x, int64_t heads, int64_t D, const T* cos, const T* sin) {
  const int64_t half = D / 2;
  T rot[512];
  for (int64_t h = 0; h < heads; ++h) {
    T* xh = x + h * D;
    for (int64_t d = 0; d < D; ++d) rot[d] = d < half ? static_cast<T>(-static_cast<float>(xh[d + half])) : xh[d - half];
    for (int64_t d = 0; d < D; ++d) {
      const T a = static_cast<T>(kept(static_cast<float>(xh[d]) * static_cast<float>(cos[d])));
      const T b = static_cast<T>(kept(static_cast<float>(rot[d]) * static_cast<float>(sin[d])));
      xh[d] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
    }
  }
}

template <typename T>
static void qkv_heads_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const T* qw,
                            const T* kw, int64_t qw_len, float eps, const T* cos, const T* sin, int64_t D,
                            at::Tensor& qo, at::Tensor& ko, at::Tensor& vo) {
  const int64_t B = q.size(0), Q = q.size(1), KV = k.size(1);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  T *qop = qo.data_ptr<T>(), *kop = ko.data_ptr<T>(), *vop = vo.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, (int64_t(64) << 10) / ((Q + 2 * KV) * int64_t(sizeof(T))));
  at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const T *qr = qp + b * q.stride(0), *kr = kp + b * k.stride(0), *vr = vp + b * v.stride(0);
      T *qy = qop + b * Q, *ky = kop + b * KV;
      if (qw == nullptr) {
        std::copy(qr, qr + Q, qy);
        std::copy(kr, kr + KV, ky);
      } else if (qw_len == D) {  // per head
        rms_norm_rows<T>(qr, qw, qy, D, eps, 0, Q / D);
        rms_norm_rows<T>(kr, kw, ky, D, eps, 0, KV / D);
      } else {  // over the whole projection
        rms_norm_rows<T>(qr, qw, qy, Q, eps, 0, 1);
        rms_norm_rows<T>(kr, kw, ky, KV, eps, 0, 1);
      }
      if (cos != nullptr) {
        heads_rope<T>(qy, Q / D, D, cos + b * D, sin + b * D);
        heads_rope<T>(ky, KV / D, D, cos + b * D, sin + b * D);
      }
      std::copy(vr, vr + KV, vop + b * KV);
    }
  });
}

std::vector<at::Tensor> qkv_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     int64_t D, const c10::optional<at::Tensor>& q_w,
                                     const c10::optional<at::Tensor>& k_w, double eps,
                                     const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin) {
  RECORD_FUNCTION("moe_pipeline::qkv_heads", std::vector<c10::IValue>({q}));
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && v.dim() == 2 && q.stride(1) == 1 && k.stride(1) == 1 &&
                  v.stride(1) == 1 && k.sizes() == v.sizes() && q.size(0) == k.size(0) && D > 0 && D <= 512 &&
                  D % 2 == 0 && q.size(1) % D == 0 && k.size(1) % D == 0,
              "qkv_heads: q [B, H D], k and v [B, Hkv D], rows of unit stride; an even head size D up to 512");
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && k.scalar_type() == dt && v.scalar_type() == dt &&
                  q.device().is_cpu(), "qkv_heads: q, k, v fp32 or bf16 alike, on the CPU");
  TORCH_CHECK(q_w.has_value() == k_w.has_value() && cos.has_value() == sin.has_value(),
              "qkv_heads: q_w with k_w, cos with sin");
  if (q_w.has_value()) {
    const bool head = q_w->numel() == D && k_w->numel() == D;
    const bool full = q_w->numel() == q.size(1) && k_w->numel() == k.size(1);
    TORCH_CHECK((head || full) && q_w->is_contiguous() && k_w->is_contiguous() && q_w->scalar_type() == dt &&
                    k_w->scalar_type() == dt,
                "qkv_heads: q_w, k_w [D] (a norm per head) or [H D], [Hkv D] (over the projection), contiguous, of "
                "q's dtype");
  }
  if (cos.has_value())
    TORCH_CHECK(cos->dim() == 2 && cos->size(0) == q.size(0) && cos->size(1) == D && cos->sizes() == sin->sizes() &&
                    cos->is_contiguous() && sin->is_contiguous() && cos->scalar_type() == dt &&
                    sin->scalar_type() == dt,
                "qkv_heads: cos, sin [B, D], contiguous, of q's dtype");
  const int64_t B = q.size(0);
  at::Tensor qo = at::empty({B, q.size(1) / D, D}, q.options());
  at::Tensor ko = at::empty({B, k.size(1) / D, D}, q.options());
  at::Tensor vo = at::empty({B, k.size(1) / D, D}, q.options());
  AT_DISPATCH_SWITCH(dt, "qkv_heads", AT_DISPATCH_CASE(at::kFloat, [&] {
    qkv_heads_typed<scalar_t>(q, k, v, q_w ? q_w->data_ptr<scalar_t>() : nullptr,
                              k_w ? k_w->data_ptr<scalar_t>() : nullptr, q_w ? q_w->numel() : 0,
                              static_cast<float>(eps), cos ? cos->data_ptr<scalar_t>() : nullptr,
                              sin ? sin->data_ptr<scalar_t>() : nullptr, D, qo, ko, vo);
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    qkv_heads_typed<scalar_t>(q, k, v, q_w ? q_w->data_ptr<scalar_t>() : nullptr,
                              k_w ? k_w->data_ptr<scalar_t>() : nullptr, q_w ? q_w->numel() : 0,
                              static_cast<float>(eps), cos ? cos->data_ptr<scalar_t>() : nullptr,
                              sin ? sin->data_ptr<scalar_t>() : nullptr, D, qo, ko, vo);
  }));
  return {qo, ko, vo};
}

// -- greedy sampling -------------------------------------------------------------------------------------------
//
// The index of each row's largest value (the first of equal ones, as torch.argmax; in a row with a NaN, the first NaN
// or largest value before it), rows split between the threads: torch's argmax over a decode batch's [32, 50304] bf16 logits took ~1.5 ms, more than the
// step's attention.
template <typename T>
static int64_t argmax_row(const T* x, int64_t V) {
  const int64_t Vv = V / VW * VW;
  vf best = vset(-INFINITY);
  for (int64_t i = 0; i < Vv; i += VW) best = vmaxv(best, vload_f(x + i));
  float m = -INFINITY;
  float lanes[VW];
  vstore(lanes, best);
  for (int j = 0; j < VW; ++j) m = std::max(m, lanes[j]);
  for (int64_t i = Vv; i < V; ++i) m = std::max(m, static_cast<float>(x[i]));
  const vf mv = vset(m);
  for (int64_t i = 0; i < Vv; i += VW)
    if (const unsigned hit = vmatch(vload_f(x + i), mv)) return i + __builtin_ctz(hit);
  for (int64_t i = Vv; i < V; ++i) {
    const float v = static_cast<float>(x[i]);
    if (v == m || std::isnan(v)) return i;
  }
  return 0;  // every value -inf
}

// x [n, V] contiguous, fp32 or bf16 -> [n] int64
at::Tensor argmax_rows(const at::Tensor& x) {
  RECORD_FUNCTION("moe_pipeline::argmax_rows", std::vector<c10::IValue>({x}));
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.is_contiguous() && x.device().is_cpu(),
              "argmax_rows: x [rows, V], contiguous on the CPU");
  const int64_t n = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({n}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  AT_DISPATCH_SWITCH(x.scalar_type(), "argmax_rows", AT_DISPATCH_CASE(at::kFloat, [&] {
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = argmax_row<scalar_t>(x.data_ptr<scalar_t>() + r * V, V);
    });
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) op[r] = argmax_row<scalar_t>(x.data_ptr<scalar_t>() + r * V, V);
    });
  }));
  return out;
}


// x [M, I] (1 <= M <= MAX_ROWS), w [O, I], both contiguous, fp32 or bf16 alike; bias [O] of that dtype or None.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  RECORD_FUNCTION("moe_pipeline::gemv", std::vector<c10::IValue>({x, w}));  // seen by torch.profiler
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [M, in] and w [out, in]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "gemv: 1 to ", MAX_ROWS, " rows, not ", x.size(0));
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "gemv: fp32 or bf16, x and w alike");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "gemv: contiguous CPU tensors");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == w.scalar_type() && bias->is_contiguous() && bias->numel() == w.size(0),
                "gemv: a contiguous bias of the weight's dtype, one per output");
  const int64_t M = x.size(0), I = w.size(1), O = w.size(0);
  at::Tensor y = at::empty({M, O}, x.options());
  if (w.scalar_type() == at::kFloat) {
    run<float>(M, w.data_ptr<float>(), x.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr,
               y.data_ptr<float>(), I, O);
  } else {
    using B = c10::BFloat16;
#if defined(__AVX512BF16__)
    const B* xb = x.data_ptr<B>();
    const B* wb = w.data_ptr<B>();
    const B* bb = has_bias ? bias->data_ptr<B>() : nullptr;
    B* yb = y.data_ptr<B>();
    const int64_t groups = (O + GROUP - 1) / GROUP;
    shared_range(groups, grain(I, sizeof(B)), [&](int64_t b, int64_t e) {
      const int64_t o0 = b * GROUP, o1 = std::min(O, e * GROUP);
      rows_dp_any(M, wb, xb, bb, yb, I, O, o0, o1);
    });
#else
    std::vector<float> xf(M * I);  // the bf16 rows widened once (a few KB)
    const B* xb = x.data_ptr<B>();
    for (int64_t k = 0; k < M * I; ++k) xf[k] = static_cast<float>(xb[k]);
    run<B>(M, w.data_ptr<B>(), xf.data(), has_bias ? bias->data_ptr<B>() : nullptr, y.data_ptr<B>(), I, O);
#endif
  }
  return y;
}

// -- the greedy head, screened ---------------------------------------------------------------------------------------
//
// The argmax of each row of x @ w.T (the output layer's, as `linear` writes it: one rounding to w's dtype; ties to
// the lowest index, as torch.argmax) from an int8 copy of w (q [O, I], w[o] ~ scale[o] * q[o], half the bytes of
// bf16) and exact arithmetic on a few rows: the int8 pass gives every output's approximate sum y[o]; err[o] bounds
// how far the exact sum can be from it per unit of |x|'s L1 norm (the quantisation's largest error on the row, and
// both sums' fp32 roundings: export/serve/linears.py `HeadScreen`). Any output whose interval [y - e, y + e] reaches
// the best lower end (with a margin for the rounding to w's dtype, which is monotone) is a candidate, and every
// candidate row is computed again through `linear`'s own kernel for M rows (the same instructions in the same
// order for each output row: the same bits), then compared. The true argmax is always a candidate: what this
// returns is `linear` + argmax's answer, exactly, reading ~half the bytes. Empty where it does not apply (x not
// finite, or candidates past `most` in all: the caller then runs the whole head).

#if defined(__AVX512BF16__)
// bf16 rows with AVX512_BF16: each 32 int8 widened once to bf16 (exact: |q| <= 127 has 7 significant bits), then
// one VDPBF16PS per input row (x as the caller's bf16), where `rows` on int8 spends two FMAs a row. That path
// is compute-bound past one row on an AMD EPYC (2 cores, the Qwen3-MoE head: 8 rows 7.2 ms against the bf16
// layer's 6.3). This one, with 4 sums for one row and 2 for two (1 sum: 1.8 / 2.1 ms), took 1.6 / 1.8 / 2.7 /
// 3.9 ms at 1 / 2 / 4 / 8 rows where the whole bf16 layer and its argmax took 3.1 / 3.2 / 3.8 / 5.5, same run.
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

#if defined(__AVX512BF16__)
// One row's sum as rows_dp<M> (row1_dp for one row) computes it for each of its rows: U sums of 32 pairs, U by the
// pass's row count; the same instructions in the same order, so the same bits as that row in a `linear` of M rows.
static float dp_row_of(int64_t M, const B16* wr, const B16* x, int64_t I) {  // as a row of a pass of M rows
  if (M <= 2) return dp_row<DP_SUMS, false>(wr, x, I);
  if (M <= 4) return dp_row<2, false>(wr, x, I);
  return dp_row<1, false>(wr, x, I);
}
#endif

// The screens' second half: approximate sums y [M, O] (fp32) and, for row m, row_bound(m) giving bound(o, v, n), a
// bound on |exact - y| for the first n (VW but at the end) outputs from o (v their y; the tiny floor added here) ->
// each row's argmax of `linear`'s exact rows, or an empty tensor. Each row's candidates (rows in parallel), in fp32
// with margins far above its roundings (2^-24 relative): `best` the largest y - e; a candidate's y + e, rounded to
// w's dtype (bf16: 8 significant bits; monotone), can tie or pass best's rounding only within 2^-6 of either. Then
// each candidate is computed again as `linear` computes it, MAX_ROWS rows of x a pass (the same instructions in the
// same order: the same bits): bf16 with AVX512_BF16, each row's own candidates (`dp_row_of`); else the union of the
// candidates' rows of w gathered and run through `linear` itself. Ties go to the lowest index.
template <typename RowBound>
static bool screen_candidates(int64_t M, const float* y, int64_t O, int64_t most, RowBound row_bound,
                              std::vector<std::vector<int64_t>>& cands) {
  std::vector<char> failed(M, 0);
  const float tiny = 1e-30f;
  at::parallel_for(0, M, M > 4 ? 2 : M, [&](int64_t r0, int64_t r1) {
    alignas(64) float lanes[VW];
    for (int64_t m = r0; m < r1; ++m) {
      const float* ym = y + m * O;
      const auto bound = row_bound(m);
      const vf vt = vset(tiny);
      vf vbest = vset(-std::numeric_limits<float>::infinity());
      int64_t o = 0;
      for (; o + VW <= O; o += VW) {
        const vf v = vload(ym + o);
        vbest = vmaxv(vbest, v - (bound(o, v, VW) + vt));
      }
      const int64_t left = O - o;
      if (left > 0) {  // the last partial vector: its other lanes -inf
        const vf v = vload_n(ym + o, left);
        vstore(lanes, v - (bound(o, v, left) + vt));
        for (int64_t j = left; j < VW; ++j) lanes[j] = -std::numeric_limits<float>::infinity();
        vbest = vmaxv(vbest, vload(lanes));
      }
      vstore(lanes, vbest);
      const float best = *std::max_element(lanes, lanes + VW);
      if (!std::isfinite(best)) {
        failed[m] = 1;
        continue;
      }
      const float floor = best - 0x1p-6f * 1.001f * std::fabs(best) - tiny;  // hi + 2^-6 |hi| >= floor: a candidate
      const vf vfloor = vset(floor), vm = vset(0x1p-6f);
      auto& c = cands[m];
      for (o = 0; o + VW <= O; o += VW) {
        const vf v = vload(ym + o);
        const vf hi = v + (bound(o, v, VW) + vt);
        for (unsigned bits = vge(vfma(vabs(hi), vm, hi), vfloor); bits; bits &= bits - 1)
          c.push_back(o + __builtin_ctz(bits));
      }
      if (left > 0) {
        const vf v = vload_n(ym + o, left);
        const vf hi = v + (bound(o, v, left) + vt);
        for (unsigned bits = vge(vfma(vabs(hi), vm, hi), vfloor) & ((1u << left) - 1); bits; bits &= bits - 1)
          c.push_back(o + __builtin_ctz(bits));
      }
      if (static_cast<int64_t>(c.size()) > most) failed[m] = 1;  // past `most` alone: no need to go on
    }
  });
  int64_t total = 0;
  for (int64_t m = 0; m < M; ++m) {
    if (failed[m]) return false;
    total += static_cast<int64_t>(cands[m].size());
  }
  return total <= most;
}

// Each row's candidates' logits (cands[m], outputs of row m of x) as `linear` writes them for x's M rows, widened to
// fp32 -> vals[m], in cands[m]'s order; false where one is NaN. MAX_ROWS rows of x a pass, the same instructions in
// the same order (the same bits): bf16 with AVX512_BF16, each row's own candidates (`dp_row_of`); else the union
// of the candidates' rows of w gathered and run through `linear` itself.
static bool candidate_logits(const at::Tensor& x, const at::Tensor& w, const std::vector<std::vector<int64_t>>& cands,
                             std::vector<std::vector<float>>& vals) {
  const int64_t M = x.size(0), I = w.size(1);
  for (int64_t m = 0; m < M; ++m) vals[m].resize(cands[m].size());
  std::vector<char> nan(M, 0);
#if defined(__AVX512BF16__)
  if (w.scalar_type() == at::kBFloat16) {
    const B16* wb = w.data_ptr<B16>();
    const B16* xb = x.data_ptr<B16>();
    at::parallel_for(0, M, M > 4 ? 2 : M, [&](int64_t r0, int64_t r1) {
      for (int64_t m = r0; m < r1; ++m) {
        const int64_t pass = std::min(MAX_ROWS, M - m / MAX_ROWS * MAX_ROWS);
        for (size_t j = 0; j < cands[m].size(); ++j) {  // rounded to bf16 as linear writes it
          vals[m][j] = static_cast<float>(static_cast<B16>(dp_row_of(pass, wb + cands[m][j] * I, xb + m * I, I)));
          if (std::isnan(vals[m][j])) nan[m] = 1;
        }
      }
    });
    return std::find(nan.begin(), nan.end(), 1) == nan.end();
  }
#endif
  std::vector<int64_t> all;
  for (const auto& c : cands) all.insert(all.end(), c.begin(), c.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  const int64_t K = static_cast<int64_t>(all.size());
  at::Tensor sub = at::empty({K, I}, w.options());
  const size_t row = static_cast<size_t>(I) * w.element_size();
  for (int64_t k = 0; k < K; ++k)
    std::memcpy(static_cast<char*>(sub.data_ptr()) + k * row, static_cast<const char*>(w.data_ptr()) + all[k] * row,
                row);
  std::vector<at::Tensor> parts;
  for (int64_t r = 0; r < M; r += MAX_ROWS)
    parts.push_back(::linear(x.narrow(0, r, std::min(MAX_ROWS, M - r)), sub, c10::optional<at::Tensor>()));
  const at::Tensor exact = (parts.size() == 1 ? parts[0] : at::cat(parts)).to(at::kFloat);  // [M, K], exact widening
  const float* ex = exact.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (size_t j = 0; j < cands[m].size(); ++j) {
      vals[m][j] = ex[m * K + (std::lower_bound(all.begin(), all.end(), cands[m][j]) - all.begin())];
      if (std::isnan(vals[m][j])) return false;
    }
  return true;
}

template <typename RowBound>
static at::Tensor screened(const at::Tensor& x, const at::Tensor& w, const float* y, int64_t O, int64_t most,
                           RowBound row_bound) {
  const int64_t M = x.size(0);
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kLong));
  std::vector<std::vector<int64_t>> cands(M);
  if (!screen_candidates(M, y, O, most, row_bound, cands)) return none;
  std::vector<std::vector<float>> vals(M);
  if (!candidate_logits(x, w, cands, vals)) return none;
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {  // candidates ascending: ties to the lowest index
    float top = -std::numeric_limits<float>::infinity();
    int64_t pick = -1;
    for (size_t j = 0; j < cands[m].size(); ++j)
      if (pick < 0 || vals[m][j] > top) top = vals[m][j], pick = cands[m][j];
    op[m] = pick;
  }
  return out;
}

// The screens' second half for rows that sample among their k largest logits (top_k; greedy rows whose logits a
// processor edits: k = 1): each row's candidates, every token that can be among its ks[m] largest logits as `linear`
// writes them once the processors have edited them, and those tokens' logits as `linear` writes them. foff [M + 1],
// ftok: each row's edited tokens (ascending; logit_bias, penalties, a banned token), left out of the k-th largest
// lower end (an edit can lower them) and always computed (an edit can raise them). tau, the k-th largest y - e of the
// other tokens, is at most the k-th largest edited exact logit (k unedited tokens reach it), so every token of the
// edited top k is edited or has y + e >= tau (with screened's margins for the rounding to w's dtype): sampling from
// these logits, every other one -inf, is sampling from the whole layer's, exactly. -> {offsets [M + 1], tokens [C]
// int64 (each row's ascending), logits [C] fp32 (w's dtype's values, widened)}, or {} where a row has fewer than k
// unedited tokens, a row's candidates pass `most`, or a logit is NaN (the caller then runs the whole head).
template <typename RowBound>
static std::vector<at::Tensor> screened_topk(const at::Tensor& x, const at::Tensor& w, const float* y, int64_t O,
                                             int64_t most, RowBound row_bound, const at::Tensor& ks,
                                             const at::Tensor& foff, const at::Tensor& ftok) {
  const int64_t M = x.size(0);
  TORCH_CHECK(ks.scalar_type() == at::kLong && ks.numel() == M && foff.scalar_type() == at::kLong &&
                  foff.numel() == M + 1 && ftok.scalar_type() == at::kLong && ks.is_contiguous() &&
                  foff.is_contiguous() && ftok.is_contiguous(),
              "screen_topk: ks int64 [M], foff int64 [M + 1], ftok int64");
  const int64_t *kp = ks.data_ptr<int64_t>(), *fo = foff.data_ptr<int64_t>(), *ft = ftok.data_ptr<int64_t>();
  TORCH_CHECK(fo[0] == 0 && fo[M] == ftok.numel(), "screen_topk: foff runs from 0 to ftok's length");
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(kp[m] >= 1 && fo[m] <= fo[m + 1], "screen_topk: each k >= 1, foff ascending");
    for (int64_t j = fo[m]; j < fo[m + 1]; ++j)
      TORCH_CHECK(ft[j] >= 0 && ft[j] < O && (j == fo[m] || ft[j] > ft[j - 1]),
                  "screen_topk: each row's edited tokens ascending, in [0, out)");
  }
  std::vector<std::vector<int64_t>> cands(M);
  std::vector<char> failed(M, 0);
  const float tiny = 1e-30f;
  at::parallel_for(0, M, M > 4 ? 2 : M, [&](int64_t r0, int64_t r1) {
    alignas(64) float lanes[VW];
    std::vector<float> heap;  // the k largest lower ends so far, least first
    for (int64_t m = r0; m < r1; ++m) {
      const float* ym = y + m * O;
      const auto bound = row_bound(m);
      const int64_t *f0 = ft + fo[m], *f1 = ft + fo[m + 1];
      const size_t k = static_cast<size_t>(kp[m]);
      if (k + (f1 - f0) > static_cast<size_t>(most)) {  // k alone past `most`: the whole head
        failed[m] = 1;
        continue;
      }
      heap.clear();
      const vf vt = vset(tiny);
      for (int64_t o = 0; o < O; o += VW) {
        const int64_t n = std::min<int64_t>(VW, O - o);
        const vf v = vload_n(ym + o, n);
        const vf lo = v - (bound(o, v, n) + vt);
        const unsigned live = n == VW ? ~0u : (1u << n) - 1;
        if (heap.size() == k && !(vge(lo, vset(heap.front())) & live)) continue;  // none above the k-th: skipped
        vstore(lanes, lo);
        for (int64_t j = 0; j < n; ++j) {
          if (std::binary_search(f0, f1, o + j)) continue;
          if (heap.size() < k) {
            heap.push_back(lanes[j]);
            std::push_heap(heap.begin(), heap.end(), std::greater<float>());
          } else if (lanes[j] > heap.front()) {
            std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
            heap.back() = lanes[j];
            std::push_heap(heap.begin(), heap.end(), std::greater<float>());
          }
        }
      }
      const float tau = heap.size() == k ? heap.front() : -std::numeric_limits<float>::infinity();
      if (!std::isfinite(tau)) {
        failed[m] = 1;
        continue;
      }
      const float floor = tau - 0x1p-6f * 1.001f * std::fabs(tau) - tiny;  // as screened's, below the k-th
      const vf vfloor = vset(floor), vm = vset(0x1p-6f);
      auto& c = cands[m];
      for (int64_t o = 0; o < O; o += VW) {
        const int64_t n = std::min<int64_t>(VW, O - o);
        const vf v = vload_n(ym + o, n);
        const vf hi = v + (bound(o, v, n) + vt);
        const unsigned live = n == VW ? ~0u : (1u << n) - 1;
        for (unsigned bits = vge(vfma(vabs(hi), vm, hi), vfloor) & live; bits; bits &= bits - 1)
          if (!std::binary_search(f0, f1, o + __builtin_ctz(bits))) c.push_back(o + __builtin_ctz(bits));
        if (static_cast<int64_t>(c.size()) > most) break;
      }
      const size_t own = c.size();
      c.insert(c.end(), f0, f1);
      std::inplace_merge(c.begin(), c.begin() + own, c.end());
      if (static_cast<int64_t>(c.size()) > most) failed[m] = 1;
    }
  });
  for (int64_t m = 0; m < M; ++m)
    if (failed[m]) return {};
  std::vector<std::vector<float>> vals(M);
  if (!candidate_logits(x, w, cands, vals)) return {};
  at::Tensor offsets = at::empty({M + 1}, x.options().dtype(at::kLong));
  int64_t* op = offsets.data_ptr<int64_t>();
  op[0] = 0;
  for (int64_t m = 0; m < M; ++m) op[m + 1] = op[m] + static_cast<int64_t>(cands[m].size());
  at::Tensor tokens = at::empty({op[M]}, x.options().dtype(at::kLong));
  at::Tensor logits = at::empty({op[M]}, x.options().dtype(at::kFloat));
  for (int64_t m = 0; m < M; ++m) {
    std::copy(cands[m].begin(), cands[m].end(), tokens.data_ptr<int64_t>() + op[m]);
    std::copy(vals[m].begin(), vals[m].end(), logits.data_ptr<float>() + op[m]);
  }
  return {offsets, tokens, logits};
}

// screen_argmax's checks and int8 pass: done(y, row_bound) with the approximate sums y [M, O] and each row's bound
// (as `screened` takes them), or `none` where x is not finite.
template <typename R, typename Done>
static R screen_pass(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q, const at::Tensor& scale,
                     const at::Tensor& err, R none, Done done) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(0) >= 1 && x.size(0) <= MAX_ROWS &&
                  x.scalar_type() == w.scalar_type() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && x.is_contiguous() &&
                  w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "screen_argmax: x [M <= ", MAX_ROWS, ", in] and w [out, in] as linear takes them");
  const int64_t M = x.size(0), I = w.size(1), O = w.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.size(0) == O && q.size(1) == I &&
                  scale.scalar_type() == at::kFloat && err.scalar_type() == at::kFloat && scale.numel() == O &&
                  err.numel() == O && scale.is_contiguous() && err.is_contiguous(),
              "screen_argmax: q int8 [out, in], scale and err fp32 [out]");
  std::vector<float> xf(M * I);
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(xf.data(), x.data_ptr<float>(), sizeof(float) * M * I);
  } else {
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    for (int64_t k = 0; k < M * I; ++k) xf[k] = static_cast<float>(xb[k]);
  }
  std::vector<double> norm(M, 0.0);  // |x|'s L1 norm per row, in double (exact enough: rounded up below)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = 0; i < I; ++i) norm[m] += std::fabs(static_cast<double>(xf[m * I + i]));
    if (!std::isfinite(norm[m])) return none;
    norm[m] *= 1.0 + 1e-9;
  }
  std::vector<float> y(M * O);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* ep = err.data_ptr<float>();
  const int64_t groups = (O + GROUP - 1) / GROUP;
  shared_range(groups, grain(I, 1), [&](int64_t b, int64_t e) {
    const int64_t o0 = b * GROUP, o1 = std::min(O, e * GROUP);
    const ToScaled out{sp, y.data(), O};
#if defined(__AVX512BF16__)
    if (x.scalar_type() == at::kBFloat16) {
      const B16* xb = x.data_ptr<B16>();
      return rows_i8_dp_any(M, qp, xb, I, o0, o1, out);
    }
#endif
    rows_any(M, qp, xf.data(), I, o0, o1, out);
  });
  const float* errp = ep;
  return done(y.data(), [&](int64_t m) {
    const float n1 = std::nextafter(static_cast<float>(norm[m]), std::numeric_limits<float>::infinity()) *
                     (1.0f + 0x1p-20f);
    return [n1, errp](int64_t o, vf v, int64_t n) {
      return vfma(vload_n(errp + o, n), vset(n1), vmul(vabs(v), vset(0x1p-21f)));
    };
  });
}

// x [M, I] (1 <= M <= MAX_ROWS) and w [O, I] as `linear` takes them (no bias); q int8 [O, I]; scale, err fp32 [O];
// `most`: the candidates (all rows together) past which it gives up -> [M] int64, or an empty tensor.
at::Tensor screen_argmax(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q, const at::Tensor& scale,
                         const at::Tensor& err, int64_t most) {
  RECORD_FUNCTION("moe_pipeline::screen_argmax", std::vector<c10::IValue>({x, q}));
  return screen_pass(x, w, q, scale, err, at::empty({0}, x.options().dtype(at::kLong)), [&](const float* y, auto bound) {
    return screened(x, w, y, w.size(0), most, bound);
  });
}

// screen_argmax's pass, then each row's candidates for its top ks[m] and their exact logits (`screened_topk`):
// ks int64 [M], foff int64 [M + 1] and ftok int64 (each row's edited tokens, ascending); `most`: a row's candidates
// past which it gives up -> {offsets, tokens, logits}, or {}.
std::vector<at::Tensor> screen_topk(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q,
                                    const at::Tensor& scale, const at::Tensor& err, int64_t most, const at::Tensor& ks,
                                    const at::Tensor& foff, const at::Tensor& ftok) {
  RECORD_FUNCTION("moe_pipeline::screen_topk", std::vector<c10::IValue>({x, q}));
  return screen_pass(x, w, q, scale, err, std::vector<at::Tensor>{}, [&](const float* y, auto bound) {
    return screened_topk(x, w, y, w.size(0), most, bound, ks, foff, ftok);
  });
}

#if defined(__AVX512VNNI__)
// -- the greedy head screened in int8 x int8 (AVX512_VNNI) ----------------------------------------------------------
//
// screen_argmax's int8 pass multiplies bf16 (or fp32) inputs: VDPBF16PS does 32 multiply-adds an instruction, and
// past a few rows it is compute-bound (the Qwen3-MoE head at 8 rows 3.9 ms against 1.6 at 1). Here each row of x is
// also rounded to int8, one scale a row (s = max |x| / 127, as vLLM's dynamic per-token W8A8), and VPDPBUSD adds 64
// products of unsigned by signed bytes an instruction: x + 128 (unsigned) times q, less 128 times the output row's
// sum of q (`colsum`). The int32 sums are exact; y = sum * scale[o] * s. The bound grows by the inputs' rounding,
// e = x - s xq: |exact - y| <= min(err1[o] |x|_1, err2[o] |x|_2) + min(top[o] |e|_1, norm[o] |e|_2) (+ y's own
// roundings), err1 the weights' rounding per unit of |x|_1 (screen_argmax's err), err2 the same per unit of |x|_2
// (Cauchy-Schwarz: |d[o]|_2 with the sums' roundings), top = scale max |q[o]|, norm = scale |q[o]|_2. The candidates
// are then those of `screened`, exactly as screen_argmax's: the same tokens.
//
// x [M <= VNNI_MAX_ROWS, I] and w [O, I] as `linear` takes them (no bias); packed, scale: the int8 copy as a W8A8
// weight holds it (`w8a8_of`: vnni_pack's tiles, the row scales and sums [2, O]); err1, err2, top, norm fp32 [O]
// (above; export/serve/linears.py `HeadScreen`); `most` as screen_argmax's -> [M] int64, or an empty tensor.
template <typename R, typename Done>
static R screen_pass_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor& err1, const at::Tensor& err2, const at::Tensor& top,
                          const at::Tensor& norm, R none, Done done) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(0) >= 1 &&
                  x.size(0) <= VNNI_MAX_ROWS && x.scalar_type() == w.scalar_type() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) && x.is_contiguous() &&
                  w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "screen_argmax_vnni: x [M <= ", VNNI_MAX_ROWS, ", in] and w [out, in] as linear takes them");
  const int64_t M = x.size(0), I = w.size(1), O = w.size(0);
  const W8A8 q = w8a8_of(packed, scale, I);  // the int8 copy as a W8A8 weight's tiles and [2, out] scales
  TORCH_CHECK(q.O == O, "screen_argmax_vnni: the int8 copy has ", q.O, " outputs, w ", O);
  for (const at::Tensor* a : {&err1, &err2, &top, &norm})
    TORCH_CHECK(a->scalar_type() == at::kFloat && a->numel() == O && a->is_contiguous(),
                "screen_argmax_vnni: err1, err2, top, norm fp32 [out]");
  // each row rounded to int8 as W8A8's linears round it; then the row's |x|_1, |x|_2, |e|_1, |e|_2 in double
  // (e = x - s xq, exact there), rounded up
  std::vector<uint8_t> xu(M * q.I4);
  std::vector<float> xs(M), n1(M), n2(M), e1(M), e2(M);
  if (x.scalar_type() == at::kFloat)
    int8_rows_of(x.data_ptr<float>(), M, I, q.I4, xu.data(), xs.data());
  else
    int8_rows_of(x.data_ptr<c10::BFloat16>(), M, I, q.I4, xu.data(), xs.data());
  const at::Tensor xf_t = x.to(at::kFloat);
  const float* xf = xf_t.data_ptr<float>();
  auto up = [](double v) {
    return std::nextafter(static_cast<float>(v * (1.0 + 1e-9)), std::numeric_limits<float>::infinity()) *
           (1.0f + 0x1p-20f);
  };
  for (int64_t m = 0; m < M; ++m) {
    if (!std::isfinite(xs[m])) return none;
    double a1 = 0, a2 = 0, b1 = 0, b2 = 0;
    for (int64_t i = 0; i < I; ++i) {
      const double v = xf[m * I + i], d = v - static_cast<double>(xs[m]) * (int(xu[m * q.I4 + i]) - 128);
      a1 += std::fabs(v), a2 += v * v, b1 += std::fabs(d), b2 += d * d;
    }
    n1[m] = up(a1), n2[m] = up(std::sqrt(a2)), e1[m] = up(b1), e2[m] = up(std::sqrt(b2));
    if (!std::isfinite(n1[m]) || !std::isfinite(n2[m])) return none;
  }
  std::vector<float> y(M * O);
  shared_range(q.T, std::max<int64_t>(1, (int64_t(2) << 20) / (VNNI_TILE * q.I4)), [&](int64_t b, int64_t e) {
    std::vector<int32_t> acc(VNNI_MAX_ROWS * 64);
    for (int64_t t = b; t < e; ++t)
      w8a8_tile(q, t, xu.data(), xs.data(), M, acc.data(), [&](int64_t m, int64_t o, int64_t n, __m512 v) {
        _mm512_mask_storeu_ps(y.data() + m * O + o, static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1), v);
      });
  });
  const float *p1 = err1.data_ptr<float>(), *p2 = err2.data_ptr<float>(), *pt = top.data_ptr<float>(),
              *pn = norm.data_ptr<float>();
  return done(y.data(), [&](int64_t m) {
    const vf a1 = vset(n1[m]), a2 = vset(n2[m]), b1 = vset(e1[m]), b2 = vset(e2[m]), r = vset(0x1p-21f);
    return [=](int64_t o, vf v, int64_t n) {
      const vf weights = _mm512_min_ps(vmul(vload_n(p1 + o, n), a1), vmul(vload_n(p2 + o, n), a2));
      const vf inputs = _mm512_min_ps(vmul(vload_n(pt + o, n), b1), vmul(vload_n(pn + o, n), b2));
      return vfma(vabs(v), r, weights + inputs);
    };
  });
}

at::Tensor screen_argmax_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                              const at::Tensor& scale, const at::Tensor& err1, const at::Tensor& err2,
                              const at::Tensor& top, const at::Tensor& norm, int64_t most) {
  RECORD_FUNCTION("moe_pipeline::screen_argmax_vnni", std::vector<c10::IValue>({x, packed}));
  return screen_pass_vnni(x, w, packed, scale, err1, err2, top, norm, at::empty({0}, x.options().dtype(at::kLong)),
                          [&](const float* y, auto bound) { return screened(x, w, y, w.size(0), most, bound); });
}

// screen_argmax_vnni's pass, then screen_topk's candidates and exact logits.
std::vector<at::Tensor> screen_topk_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                                         const at::Tensor& scale, const at::Tensor& err1, const at::Tensor& err2,
                                         const at::Tensor& top, const at::Tensor& norm, int64_t most,
                                         const at::Tensor& ks, const at::Tensor& foff, const at::Tensor& ftok) {
  RECORD_FUNCTION("moe_pipeline::screen_topk_vnni", std::vector<c10::IValue>({x, packed}));
  return screen_pass_vnni(x, w, packed, scale, err1, err2, top, norm, std::vector<at::Tensor>{},
                          [&](const float* y, auto bound) {
                            return screened_topk(x, w, y, w.size(0), most, bound, ks, foff, ftok);
                          });
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t group);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias);

// -- a quantised output layer screened in int4 or int8 x int8 (AVX512_VNNI) -----------------------------------------
//
// Under --quantize-head int4 the greedy head's logits are int4_linear's, whose one-row pass is compute-bound
// (VDPBF16PS: 32 products an instruction, each nibble made bf16 first; ~29 GB/s of int4 on the Qwen3-MoE head where
// int8 reads ~35). Here each row of x is rounded to int8 (one scale a row, as screen_argmax_vnni's) and VPDPBUSD adds
// 64 products of the weights' nibbles as they are stored (q + 8, unsigned) by signed bytes of x an instruction: per
// group of 128 inputs (one 64-byte load: the low nibbles are inputs 0-31 and 64-95, the high ones 32-63 and 96-127,
// x permuted to match once a call) sum (q + 8) xq less 8 sum xq (each lane started at its share of that), exact in
// int32, times the group's scale; the row's groups summed, times the row's s. The weights are exact here:
// |exact - y| <= min(top[o] |e|_1, norm[o] |e|_2) for the inputs' rounding e = x - s xq (top = max |w[o]|, norm =
// |w[o]|_2 of the dequantised row), plus both sides' fp32 roundings, at most round[o] (|x|_1 + |e|_1) (the caller's
// bound: export/serve/linears.py `QuantizedHeadScreen`). The candidates as screen_argmax's; then int4_linear itself
// on the union of their rows: the whole layer's bits. An int8 head (`screen_argmax_i8`) alike, its weights' bytes
// as they are against x + 128.
//
// x [M <= VNNI_MAX_ROWS, I] (MAX_ROWS a pass) fp32 or bf16; q uint8 [O, I / 2] and scale fp32 [O, I / group] as
// int4_linear takes them (group a multiple of 128); top, norm, round fp32 [O]; `most` as screen_argmax's -> [M]
// int64, or an empty tensor.

// screen_argmax_i4's pass over output rows [o0, o1) for M rows of x: xw the rows rounded to int8 in the loads' order,
// start [M, G, 16] each group's int32 lanes' start (-8 times the sum of the xq that lane's VPDPBUSDs take: the
// nibbles' offset taken out in the lanes), xs each row's scale -> y [M, O] (fp32)
template <int M>
static void rows_i4_vnni(const uint8_t* q, const float* scale, const int8_t* xw, const int32_t* start, const float* xs,
                         int64_t I, int64_t group, int64_t o0, int64_t o1, float* y, int64_t O) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t G = I / group, per = group / 128;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* qr = q + o * (I / 2);
    const float* sr = scale + o * G;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512i sums[M];
      for (int m = 0; m < M; ++m) sums[m] = _mm512_loadu_si512(start + (m * G + g) * 16);
      for (int64_t b = g * per; b < (g + 1) * per; ++b) {
        ahead(qr + b * 64);
        const __m512i w = _mm512_loadu_si512(qr + b * 64);
        const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        for (int m = 0; m < M; ++m) {
          const int8_t* xm = xw + m * I + b * 128;
          sums[m] = _mm512_dpbusd_epi32(sums[m], lo, _mm512_loadu_si512(xm));
          sums[m] = _mm512_dpbusd_epi32(sums[m], hi, _mm512_loadu_si512(xm + 64));
        }
      }
      const __m512 sg = _mm512_set1_ps(sr[g]);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m]), sg, acc[m]);
    }
    for (int m = 0; m < M; ++m) y[m * O + o] = _mm512_reduce_add_ps(acc[m]) * xs[m];
  }
}

// Rows of x [M, I] (fp32 or bf16) rounded to int8 for the quantised heads' screens: q [M, I] (s = max |x| / 127,
// ties to even), s [M], and in double, rounded up: |x|_1, and |e|_1, |e|_2 of e = x - s q. `ok` false for a row that
// is not finite.
struct RoundedRows {
  std::vector<int8_t> q;
  std::vector<float> s, n1, e1, e2;
  bool ok = true;
};

static RoundedRows rounded_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), I = x.size(1);
  const at::Tensor xf_t = x.to(at::kFloat).contiguous();
  const float* xf = xf_t.data_ptr<float>();
  RoundedRows r{std::vector<int8_t>(M * I), std::vector<float>(M), std::vector<float>(M), std::vector<float>(M),
                std::vector<float>(M)};
  auto up = [](double v) {
    return std::nextafter(static_cast<float>(v * (1.0 + 1e-9)), std::numeric_limits<float>::infinity()) *
           (1.0f + 0x1p-20f);
  };
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xf + m * I;
    float amax = 0.0f;
    for (int64_t i = 0; i < I; ++i) amax = std::max(amax, std::fabs(row[i]));
    if (!std::isfinite(amax)) {
      r.ok = false;
      return r;
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    double a1 = 0, b1 = 0, b2 = 0;
    for (int64_t i = 0; i < I; ++i) {
      const int v = static_cast<int>(std::max(-127.0f, std::min(127.0f, std::nearbyint(row[i] / s))));
      r.q[m * I + i] = static_cast<int8_t>(v);
      const double d = static_cast<double>(row[i]) - static_cast<double>(s) * v;
      a1 += std::fabs(static_cast<double>(row[i])), b1 += std::fabs(d), b2 += d * d;
    }
    r.s[m] = s, r.n1[m] = up(a1), r.e1[m] = up(b1), r.e2[m] = up(std::sqrt(b2));
    if (!std::isfinite(r.n1[m])) r.ok = false;
  }
  return r;
}

// The quantised heads' screens' second half: approximate sums y [M, O] from x rounded to int8 (`rows`), each output
// row's top, norm, round [O] (see screen_argmax_i4) -> the candidates (`screen_candidates`), then exact(rows [K],
// int64) -> the layer's own logits [M, K] of those rows (fp32 or bf16), each row's argmax among its candidates (ties
// to the lowest index, as argmax_rows), or an empty tensor.
template <typename Exact>
static at::Tensor screened_quantised(const at::Tensor& x, const RoundedRows& rows, const float* y, int64_t O,
                                     const at::Tensor& top, const at::Tensor& norm, const at::Tensor& round,
                                     int64_t most, Exact exact) {
  const int64_t M = x.size(0);
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kLong));
  const float *pt = top.data_ptr<float>(), *pn = norm.data_ptr<float>(), *pr = round.data_ptr<float>();
  std::vector<std::vector<int64_t>> cands(M);
  if (!screen_candidates(M, y, O, most, [&](int64_t m) {
        const vf b1 = vset(rows.e1[m]), b2 = vset(rows.e2[m]), sum = vset(rows.n1[m] + rows.e1[m]), r = vset(0x1p-21f);
        return [=](int64_t o, vf v, int64_t n) {
          const vf inputs = _mm512_min_ps(vmul(vload_n(pt + o, n), b1), vmul(vload_n(pn + o, n), b2));
          return vfma(vabs(v), r, vfma(vload_n(pr + o, n), sum, inputs));
        };
      }, cands))
    return none;
  std::vector<int64_t> all;
  for (const auto& c : cands) all.insert(all.end(), c.begin(), c.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  const at::Tensor rows_at = at::from_blob(all.data(), {static_cast<int64_t>(all.size())}, at::kLong).clone();
  const at::Tensor ex_t = exact(rows_at).to(at::kFloat).contiguous();
  const float* ex = ex_t.data_ptr<float>();
  const int64_t K = static_cast<int64_t>(all.size());
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    float best = -std::numeric_limits<float>::infinity();
    int64_t pick = -1;
    for (int64_t o : cands[m]) {  // ascending: ties go to the lowest index, as argmax_rows
      const float v = ex[m * K + (std::lower_bound(all.begin(), all.end(), o) - all.begin())];
      if (std::isnan(v)) return none;
      if (pick < 0 || v > best) best = v, pick = o;
    }
    op[m] = pick;
  }
  return out;
}

static void check_screen_bounds(const at::Tensor& top, const at::Tensor& norm, const at::Tensor& round, int64_t O) {
  for (const at::Tensor* a : {&top, &norm, &round})
    TORCH_CHECK(a->scalar_type() == at::kFloat && a->numel() == O && a->is_contiguous() && a->device().is_cpu(),
                "screen: top, norm, round fp32 [out]");
}

at::Tensor screen_argmax_i4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& top,
                            const at::Tensor& norm, const at::Tensor& round, int64_t group, int64_t most) {
  RECORD_FUNCTION("moe_pipeline::screen_argmax_i4", std::vector<c10::IValue>({x, q}));
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(0) >= 1 && x.size(0) <= VNNI_MAX_ROWS &&
                  q.size(1) * 2 == x.size(1) && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.is_contiguous() && x.device().is_cpu(),
              "screen_argmax_i4: x [M <= ", VNNI_MAX_ROWS, ", in] fp32 or bf16 and q [out, in / 2]");
  const int64_t M = x.size(0), I = x.size(1), O = q.size(0);
  TORCH_CHECK(group > 0 && group % 128 == 0 && I % group == 0, "screen_argmax_i4: groups of a multiple of 128 inputs "
              "that divide the row (", I, "), not ", group);
  const int64_t G = I / group;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == O && scale.size(1) == G &&
                  q.device().is_cpu() && scale.device().is_cpu(),
              "screen_argmax_i4: q uint8 [out, in / 2] and scale fp32 [out, in / group]");
  check_screen_bounds(top, norm, round, O);
  const RoundedRows rows = rounded_rows(x);
  if (!rows.ok) return at::empty({0}, x.options().dtype(at::kLong));
  // each row in the loads' order (xw: a 128-input block's low nibbles are its inputs 0-31 and 64-95, the high ones
  // 32-63 and 96-127), and each group's lanes' start: lane k of a VPDPBUSD takes bytes 4k-4k+3 of each of its loads
  std::vector<int8_t> xw(M * I);
  std::vector<int32_t> start(M * G * 16, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) {
      const int64_t j = i % 128, at = i - j + (j < 32 ? j : j < 64 ? 64 + (j - 32) : j < 96 ? 32 + (j - 64) : j);
      xw[m * I + at] = rows.q[m * I + i];
      start[(m * G + i / group) * 16 + (at % 64) / 4] -= 8 * rows.q[m * I + i];
    }
  std::vector<float> y(M * O);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS)  // MAX_ROWS rows of x a pass over the weight
    shared_range((O + GROUP - 1) / GROUP, grain(I / 2, 1), [&](int64_t b0, int64_t b1) {
      for_rows(std::min(MAX_ROWS, M - r0), [&](auto m) {
        rows_i4_vnni<decltype(m)::value>(qp, sp, xw.data() + r0 * I, start.data() + r0 * G * 16, rows.s.data() + r0, I,
                                         group, b0 * GROUP, std::min(O, b1 * GROUP), y.data() + r0 * O, O);
      });
    });
  return screened_quantised(x, rows, y.data(), O, top, norm, round, most, [&](const at::Tensor& rows_at) {
    return int4_linear(x, q.index_select(0, rows_at), scale.index_select(0, rows_at), c10::optional<at::Tensor>(),
                       group);  // the layer's own kernel: its bits
  });
}

// screen_argmax_i4's pass for an int8 weight (one scale a row): VPDPBUSD on x rounded to int8 and offset by 128
// (unsigned) against the weight's bytes as they are, less 128 times the row's sum of q (`rowsum`), in int32 (exact),
// times the row's scale and x's s -> y [M, O]. The rest as screen_argmax_i4's; the candidates through int8_linear.
template <int M>
static void rows_i8_vnni(const int8_t* q, const int32_t* rowsum, const float* scale, const uint8_t* xu, const float* xs,
                         int64_t I, int64_t o0, int64_t o1, float* y, int64_t O) {
  const int64_t tail = I % 64;
  const __mmask64 mask = tail ? (~0ULL >> (64 - tail)) : 0;
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* qr = q + o * I;
    __m512i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= I; i += 64) {
      ahead(qr + i);
      const __m512i w = _mm512_loadu_si512(qr + i);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(xu + m * I + i), w);
    }
    if (tail) {  // the weights past the row's end read as 0
      const __m512i w = _mm512_maskz_loadu_epi8(mask, qr + i);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_maskz_loadu_epi8(mask, xu + m * I + i), w);
    }
    for (int m = 0; m < M; ++m) {
      const int64_t sum =
          static_cast<int64_t>(_mm512_reduce_add_epi32(acc[m])) - 128 * static_cast<int64_t>(rowsum[o]);
      y[m * O + o] = static_cast<float>(sum) * scale[o] * xs[m];
    }
  }
}

// x [M <= VNNI_MAX_ROWS, I] fp32 or bf16; q int8 [O, I], scale fp32 [O] as int8_linear takes them, rowsum int32
// [O] (each row's sum of q); top, norm, round fp32 [O] (export/serve/linears.py `QuantizedHeadScreen`) -> [M] int64
// or an empty tensor.
at::Tensor screen_argmax_i8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& rowsum,
                            const at::Tensor& top, const at::Tensor& norm, const at::Tensor& round, int64_t most) {
  RECORD_FUNCTION("moe_pipeline::screen_argmax_i8", std::vector<c10::IValue>({x, q}));
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(0) >= 1 && x.size(0) <= VNNI_MAX_ROWS && q.size(1) == x.size(1) &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous() &&
                  x.device().is_cpu(),
              "screen_argmax_i8: x [M <= ", VNNI_MAX_ROWS, ", in] fp32 or bf16 and q [out, in]");
  const int64_t M = x.size(0), I = x.size(1), O = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.device().is_cpu() &&
                  scale.scalar_type() == at::kFloat && scale.numel() == O && scale.is_contiguous() &&
                  rowsum.scalar_type() == at::kInt && rowsum.numel() == O && rowsum.is_contiguous(),
              "screen_argmax_i8: q int8 [out, in], scale fp32 [out], rowsum int32 [out]");
  check_screen_bounds(top, norm, round, O);
  const RoundedRows rows = rounded_rows(x);
  if (!rows.ok) return at::empty({0}, x.options().dtype(at::kLong));
  std::vector<uint8_t> xu(M * I);
  for (int64_t k = 0; k < M * I; ++k) xu[k] = static_cast<uint8_t>(rows.q[k] + 128);
  std::vector<float> y(M * O);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int32_t* rp = rowsum.data_ptr<int32_t>();
  for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS)  // MAX_ROWS rows of x a pass over the weight
    shared_range((O + GROUP - 1) / GROUP, grain(I, 1), [&](int64_t b0, int64_t b1) {
      for_rows(std::min(MAX_ROWS, M - r0), [&](auto m) {
        rows_i8_vnni<decltype(m)::value>(qp, rp, sp, xu.data() + r0 * I, rows.s.data() + r0, I, b0 * GROUP,
                                         std::min(O, b1 * GROUP), y.data() + r0 * O, O);
      });
    });
  return screened_quantised(x, rows, y.data(), O, top, norm, round, most, [&](const at::Tensor& rows_at) {
    return int8_linear(x, q.index_select(0, rows_at), scale.index_select(0, rows_at),
                       c10::optional<at::Tensor>());  // the layer's own kernel: its bits
  });
}
#endif

// y [N, O] of a quantised weight's linear over x [N, I] (fp32 or bf16), MAX_ROWS rows a pass, each pass's output
// rows split between the threads as `linear`'s are (sized as a bf16 weight of as many weights: the quantised sums
// are compute-bound sooner): rows(M, x as fp32, x as bf16 or null, bias or null, y, o0, o1) writes a pass's outputs
// [o0, o1). bf16 x: given as it is where the build has AVX512_BF16, else widened to fp32 once a pass.
template <typename Rows>
static at::Tensor in_passes(const at::Tensor& x, int64_t O, const c10::optional<at::Tensor>& bias, Rows rows) {
  using B = c10::BFloat16;
  const int64_t N = x.size(0), I = x.size(1), groups = (O + GROUP - 1) / GROUP;
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor y = at::empty({N, O}, x.options());
  for (int64_t r0 = 0; r0 < N; r0 += MAX_ROWS) {
    const int64_t M = std::min(MAX_ROWS, N - r0);
    auto split = [&](const float* xf, const B* xb, const auto* bp, auto* yp) {
      shared_range(groups, grain(I, 2), [&](int64_t b, int64_t e) {
        rows(M, xf, xb, bp, yp, b * GROUP, std::min(O, e * GROUP));
      });
    };
    if (x.scalar_type() == at::kFloat) {
      split(x.data_ptr<float>() + r0 * I, nullptr, has_bias ? bias->data_ptr<float>() : nullptr,
            y.data_ptr<float>() + r0 * O);
      continue;
    }
    const B* xb = x.data_ptr<B>() + r0 * I;
    const B* bp = has_bias ? bias->data_ptr<B>() : nullptr;
#if defined(__AVX512BF16__)
    split(nullptr, xb, bp, y.data_ptr<B>() + r0 * O);
#else
    std::vector<float> xf(M * I);  // the bf16 rows widened once (a few KB)
    split(widened(xb, M * I, xf.data()), nullptr, bp, y.data_ptr<B>() + r0 * O);
#endif
  }
  return y;
}

// -- int8 weights (weight-only quantisation) -------------------------------------------------------------------------
//
// y = x @ (scale * q).T (+ bias) for int8 weights, one scale per output row (export/serve/linears.py `quantize_int8`):
// the weight read at 1 byte, half of bf16's. x [M, I] fp32 or bf16 (any M: MAX_ROWS rows a pass over the weight), q
// int8 [O, I], scale fp32 [O], bias [O] of x's dtype or None -> [M, O] in x's dtype, each output rounded once. bf16 x
// on AVX512_BF16: the screen's VDPBF16PS pass (`rows_i8_dp`: int8 widened to bf16 exactly); otherwise the few-row
// kernel's FMAs on int8 widened to fp32, x in fp32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  RECORD_FUNCTION("moe_pipeline::int8_linear", std::vector<c10::IValue>({x, q}));
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1) && x.size(0) >= 1,
              "int8_linear: x [M, in] and q [out, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int8_linear: x fp32 or bf16");
  TORCH_CHECK(q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat && scale.numel() == q.size(0),
              "int8_linear: q int8 [out, in] and scale fp32 [out]");
  TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scale.is_contiguous() && x.device().is_cpu() &&
                  q.device().is_cpu() && scale.device().is_cpu(),
              "int8_linear: contiguous CPU tensors");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == q.size(0),
                "int8_linear: a contiguous bias of x's dtype, one per output");
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t O = q.size(0), I = q.size(1);
  return in_passes(x, O, bias, [&](int64_t M, const float* xf, const c10::BFloat16* xb, const auto* bp, auto* yp,
                                   int64_t o0, int64_t o1) {
    const ToDequantized<std::remove_const_t<std::remove_pointer_t<decltype(bp)>>> out{sp, bp, yp, O};
#if defined(__AVX512BF16__)
    if (xb != nullptr) return rows_i8_dp_any(M, qp, xb, I, o0, o1, out);
#endif
    rows_any(M, qp, xf, I, o0, o1, out);
  });
}

// -- int4 weights in groups (weight-only quantisation) ---------------------------------------------------------------
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

// Any CPU: x in fp32, each group's 64-input chunks unpacked to floats, FMAs, the group's sum times its scale.
template <typename Out>
static void rows_i4_any(int64_t M, const uint8_t* q, const float* scale, const float* x, int64_t I, int64_t group,
                        int64_t o0, int64_t o1, const Out& out) {
  const int64_t G = I / group;
  alignas(64) float w[64];
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* qr = q + o * (I / 2);
    float total[MAX_ROWS] = {};
    for (int64_t g = 0; g < G; ++g) {
      vf sums[MAX_ROWS];
      for (int64_t m = 0; m < M; ++m) sums[m] = vzero();
      for (int64_t c = g * group / 64; c < (g + 1) * group / 64; ++c) {
        for (int j = 0; j < 32; ++j) {
          w[j] = static_cast<float>((qr[c * 32 + j] & 0x0F) - 8);
          w[32 + j] = static_cast<float>((qr[c * 32 + j] >> 4) - 8);
        }
        for (int i = 0; i < 64; i += VW)
          for (int64_t m = 0; m < M; ++m) sums[m] = vfma(vload(w + i), vload(x + m * I + c * 64 + i), sums[m]);
      }
      for (int64_t m = 0; m < M; ++m) total[m] += vsum(sums[m]) * scale[o * G + g];
    }
    for (int64_t m = 0; m < M; ++m) out(m, o, total[m]);
  }
}

// x [N, I] fp32 or bf16 (MAX_ROWS rows a pass), q and scale as above, bias [O] of x's dtype or None -> [N, O].
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t group) {
  RECORD_FUNCTION("moe_pipeline::int4_linear", std::vector<c10::IValue>({x, q}));
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(0) >= 1 && q.size(1) * 2 == x.size(1),
              "int4_linear: x [M, in] and q [out, in / 2] (two int4 a byte)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int4_linear: x fp32 or bf16");
  const int64_t I = x.size(1), O = q.size(0);
  TORCH_CHECK(group > 0 && group % 64 == 0 && I % group == 0,
              "int4_linear: groups of a multiple of 64 inputs that divide the row (", I, "), not ", group);
  TORCH_CHECK(q.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat && scale.dim() == 2 &&
                  scale.size(0) == O && scale.size(1) == I / group,
              "int4_linear: q uint8 [out, in / 2] and scale fp32 [out, in / group]");
  TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scale.is_contiguous() && x.device().is_cpu() &&
                  q.device().is_cpu() && scale.device().is_cpu(),
              "int4_linear: contiguous CPU tensors");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == O,
                "int4_linear: a contiguous bias of x's dtype, one per output");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  return in_passes(x, O, bias, [&](int64_t M, const float* xf, const c10::BFloat16* xb, const auto* bp, auto* yp,
                                   int64_t o0, int64_t o1) {
    const ToBiased<std::remove_const_t<std::remove_pointer_t<decltype(bp)>>> out{bp, yp, O};
#if defined(__AVX512BF16__)
    if (xb != nullptr) return rows_i4_dp_any(M, qp, sp, xb, I, group, o0, o1, out);
#endif
    rows_i4_any(M, qp, sp, xf, I, group, o0, o1, out);
  });
}

// -- weights moved into a file mapping ---------------------------------------------------------------------------
//
// The storage under `owner` (every tensor on it: views, detached copies, the kernels' references) takes the `nbytes`
// at `offset` in `mapping`'s storage as its memory, holding the mapping alive; its own memory is freed. The caller
// has copied the bytes there first (export/serve/linears.py `map_weights`: why).
void adopt_storage(const at::Tensor& owner, const at::Tensor& mapping, int64_t offset) {
  c10::StorageImpl* own = owner.storage().unsafeGetStorageImpl();
  const c10::Storage& from = mapping.storage();
  TORCH_CHECK(owner.device().is_cpu() && mapping.device().is_cpu() && offset >= 0 &&
                  offset + static_cast<int64_t>(own->nbytes()) <= static_cast<int64_t>(from.nbytes()),
              "adopt_storage: CPU storages, the owner's bytes inside the mapping");
  auto* hold = new c10::Storage(from);
  void* at = static_cast<char*>(from.mutable_data()) + offset;
  at::DataPtr ptr(at, hold, [](void* ctx) { delete static_cast<c10::Storage*>(ctx); }, owner.device());
  at::DataPtr old = own->set_data_ptr(std::move(ptr));  // freed here
}

// -- a sum over the ranks of one machine through shared memory -------------------------------------------------
//
// DeepSpeed's shared-memory all-reduce (deepspeed::inference_all_reduce_) waits for the other ranks by spinning,
// however long they take. Where the ranks share a few cores with the server's other threads and its clients, a rank
// that arrives first then holds a core the rank it waits for needs: 2 ranks of expert-parallel serving on 2 cores
// under 32 clients (py-spy) spent ~30% of the follower's busy time spinning in the prefill forwards' exchanges and
// ~20% in the step results' gather, for rank 0. This one spins ~50 us, then yields the core between looks
// (sched_yield). Every rank maps one region (export/serve/linears.py `attach_local_reduce`): a counter a rank, then
// two slots a rank. A call writes this rank's tensor (a slot's bytes at a time) into its slot of the call's parity,
// raises its counter to the call's number, waits for every other counter to reach it, then sums the slots in rank
// order (the same bits on every rank; bf16 and fp16 through torch's add, as many roundings as ranks less one). A rank
// writes a slot again two calls later, when every other rank has started the call between, so has read it.
struct LocalReduce {
  uint8_t* base = nullptr;
  int64_t rank = 0, world = 0, slot = 0, seq = 0;
  at::Tensor region;  // keeps the mapping alive
  int64_t* counter(int64_t r) const { return reinterpret_cast<int64_t*>(base + r * 64); }
  uint8_t* buffer(int64_t parity, int64_t r) const { return base + world * 64 + (parity * world + r) * slot; }
};
static LocalReduce g_local;

// region: uint8 [world * 64 + 2 * world * slot_bytes], zeros where no call has run, mapped by every rank alike
void local_reduce_attach(at::Tensor region, int64_t rank, int64_t world, int64_t slot_bytes) {
  TORCH_CHECK(world >= 2 && rank >= 0 && rank < world && slot_bytes > 0 && slot_bytes % 64 == 0,
              "local_reduce_attach: this rank of world >= 2, slots of a multiple of 64 bytes");
  TORCH_CHECK(region.scalar_type() == at::kByte && region.is_contiguous() && region.device().is_cpu() &&
                  region.numel() == world * 64 + 2 * world * slot_bytes,
              "local_reduce_attach: a contiguous uint8 region of world * 64 + 2 * world * slot_bytes bytes");
  g_local = LocalReduce{region.data_ptr<uint8_t>(), rank, world, slot_bytes, 0, region};
  g_local.seq = __atomic_load_n(g_local.counter(rank), __ATOMIC_ACQUIRE);
}

bool local_reduce_attached() { return g_local.base != nullptr; }

static void wait_for_rank(const int64_t* c, int64_t seq) {
  const auto t0 = std::chrono::steady_clock::now();
  bool yielding = false;
  for (int64_t i = 1; __atomic_load_n(c, __ATOMIC_ACQUIRE) < seq; ++i) {
    if (yielding) {
      sched_yield();
    } else {
      _mm_pause();
      if (i % 256 == 0) yielding = std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(50);
    }
  }
}

// This rank's slot of call `seq` is written: say so, then wait until every other rank has written its own.
static void arrive(const LocalReduce& g, int64_t seq) {
  __atomic_store_n(g.counter(g.rank), seq, __ATOMIC_RELEASE);
  for (int64_t r = 0; r < g.world; ++r)
    if (r != g.rank) wait_for_rank(g.counter(r), seq);
}

// t summed over the ranks in place (every rank calls it, in the same order, with the same shape and dtype)
void local_reduce_(at::Tensor t) {
  TORCH_CHECK(g_local.base != nullptr, "local_reduce_: local_reduce_attach first");
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "local_reduce_: a contiguous CPU tensor");
  LocalReduce& g = g_local;
  const int64_t es = t.element_size(), per = g.slot / es, total = t.numel();
  at::Tensor flat = t.view({-1});
  for (int64_t off = 0; off < total; off += per) {
    const int64_t n = std::min(per, total - off);
    at::Tensor part = flat.narrow(0, off, n);
    const int64_t seq = ++g.seq, parity = seq & 1;
    std::memcpy(g.buffer(parity, g.rank), part.data_ptr(), n * es);
    arrive(g, seq);
    auto slot = [&](int64_t r) { return at::from_blob(g.buffer(parity, r), {n}, t.options()); };
    part.copy_(slot(0));
    for (int64_t r = 1; r < g.world; ++r) part.add_(slot(r));
  }
}

// Every rank's bytes (`t` uint8, this rank's), through local_reduce_'s slots and counters: one wait for the other
// ranks and no sum. A rank's bytes past its slot's first slot - 8 do not travel, only their length: the caller sees
// the lengths (all ranks the same) and gathers those otherwise. Returns each rank's length and its bytes (this rank's
// own included; empty where they did not fit).
std::tuple<std::vector<int64_t>, std::vector<at::Tensor>> local_gather(const at::Tensor& t) {
  TORCH_CHECK(g_local.base != nullptr, "local_gather: local_reduce_attach first");
  TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 1 && t.is_contiguous() && t.device().is_cpu(),
              "local_gather: a contiguous 1-D uint8 CPU tensor");
  LocalReduce& g = g_local;
  const int64_t n = t.numel(), room = g.slot - 8, seq = ++g.seq, parity = seq & 1;
  uint8_t* mine = g.buffer(parity, g.rank);
  std::memcpy(mine, &n, 8);
  if (n <= room) std::memcpy(mine + 8, t.data_ptr<uint8_t>(), n);
  arrive(g, seq);
  std::vector<int64_t> lengths(g.world);
  std::vector<at::Tensor> rows(g.world);
  for (int64_t r = 0; r < g.world; ++r) {
    const uint8_t* slot = g.buffer(parity, r);
    std::memcpy(&lengths[r], slot, 8);
    const int64_t m = lengths[r] <= room ? lengths[r] : 0;
    rows[r] = at::empty({m}, t.options());
    std::memcpy(rows[r].data_ptr<uint8_t>(), slot + 8, m);
  }
  return {lengths, rows};
}

// -- a whole decode forward in one call ---------------------------------------------------------------------------
//
// Between the kernels above, a decode step of export/serve/decode.py's `Decoder` ran ~15 Python-level operations a
// layer (module calls, views, the residual adds, the routing's bookkeeping): ~2.5 ms of a ~14 ms batch-1 step of the
// peer benchmark's Qwen3-MoE package on 2 cores. `DecodeModel` holds every layer's tensors (the same tensors the
// modules hold) and runs the layers with the same kernels, the same torch operators and the same roundings, so the
// hidden states are the Python loop's to the bit. Per layer: an RMSNorm or LayerNorm before attention and MLP, one
// fused q/k/v weight (bias optional), qk-norm optional, RoPE or none, the paged pool, an out projection (bias
// optional); then a dense MLP, an MoE layer whose experts are all on this rank (with PR-MoE's residual MLP or
// Qwen2-MoE's shared expert, or neither), or the block's own MLP module called back in Python (experts on other
// ranks: its exchange's collectives run as the module runs them).

// One norm as the module holds it: RMSNorm (no bias) or LayerNorm (bias optional).
struct DecodeNorm {
  at::Tensor w;
  c10::optional<at::Tensor> b;
  double eps = 0;
  bool layer = false;

  at::Tensor operator()(const at::Tensor& x) const {
    return layer ? at::layer_norm(x, {x.size(-1)}, w, b, eps) : rms_norm(x, w, eps);
  }
};

// oneDNN's linear on its packed weight (torch.ops.mkldnn._linear_pointwise, as ServingWeight.linear calls it).
static at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                                   const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         std::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<std::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
}

// export/serve/linears.py `bucket`: rows rounded up to one of 8 sizes per octave (up to 8 rows as they are).
static int64_t bucket(int64_t rows) {
  if (rows <= 8) return rows;
  const int64_t step = int64_t{1} << (64 - __builtin_clzll(static_cast<uint64_t>(rows)) - 4);
  return (rows + step - 1) / step * step;
}

// One served weight as ServingWeight holds it, and its `linear` for x [rows, in]: AMX from 2 rows where the weight
// has a copy packed for it, the kernel up to MAX_ROWS, then by `more` (ServingWeight.more, export/serve/linears.py's
// MORE_* codes): oneDNN on its packed copy (rows bucketed), the kernel MAX_ROWS rows at a time (bf16 without oneDNN's),
// or at::linear (a small weight); PLAIN: an nn.Linear the serving runtime left as it is (F.linear at every row count).
struct DecodeLinear {
  // INT8: w int8, packed its row scales; INT4: w two int4 a byte, packed its group scales [out, groups]; W8A8: w
  // its int8 tiles (vnni_pack), packed its scales and rows' sums [2, out]
  enum More : int64_t { ONEDNN = 0, CHUNKS = 1, ATEN = 2, PLAIN = 3, INT8 = 4, INT4 = 5, W8A8 = 6 };
  at::Tensor w, amx, packed;
  c10::optional<at::Tensor> b;
  int64_t more = ATEN;

  int64_t outputs() const { return more == W8A8 ? packed.size(1) : w.size(0); }

  at::Tensor operator()(const at::Tensor& x) const {
    const int64_t rows = x.size(0);
    if (more == PLAIN) return at::linear(x, w, b);
    if (more == INT8) return int8_linear(x, w, packed, b);
    if (more == INT4) return int4_linear(x, w, packed, b, x.size(1) / packed.size(1));
#if defined(__AVX512VNNI__)
    if (more == W8A8) return w8a8_linear(x, w, packed, b);
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx.defined() && rows > 1 && rows <= AMX_MAX_ROWS) return amx_linear(x, amx, w.size(0), b);
#endif
    if (rows <= MAX_ROWS) return ::linear(x, w, b);
    if (more == ATEN) return at::linear(x, w, b);
    if (more == CHUNKS) {
      std::vector<at::Tensor> parts;
      for (int64_t i = 0; i < rows; i += MAX_ROWS)
        parts.push_back(::linear(x.narrow(0, i, std::min(MAX_ROWS, rows - i)), w, b));
      return at::cat(parts);
    }
    const int64_t padded = bucket(rows);
    if (padded == rows) return onednn_linear(x, packed, b);
    at::Tensor flat = x.new_zeros({padded, x.size(1)});
    flat.narrow(0, 0, rows).copy_(x);
    return onednn_linear(flat, packed, b).narrow(0, 0, rows);
  }
};

struct DecodeLayer {
  DecodeNorm n1, n2;
  DecodeLinear qkv, out, fc1, fc2;
  c10::optional<at::Tensor> q_norm, k_norm;
  double qk_eps = 0;
  at::Tensor K, V;
  enum { NONE, DENSE, EXPERTS, GATHERED, MODULE } mlp = NONE;
  at::Tensor wg;                           // EXPERTS: the router, every expert's tensors by index
  std::vector<at::Tensor> w1, b1, w2, b2;  // (b1, b2 empty without biases); GATHERED: this rank's experts only
  std::vector<at::Tensor> s1, s2;          // int8 experts: w1, w2 int8 and their row scales (else empty)
  std::vector<int64_t> slot;               // GATHERED: each expert's place in w1.. (-1: not held here)
  py::object split;                        // GATHERED: None (each expert has one holder), or the replicas' split
  bool residual = false, shared = false;      // EXPERTS: PR-MoE's residual MLP and its coefficient, Qwen2-MoE's
  DecodeLinear rfc1, rfc2, coefficient;       // shared expert and its gate
  DecodeLinear sfc1, sfc2, shared_gate;
  py::object module;                          // MODULE (and GATHERED without the ranks' tokens): h [B, C] ->
                                              // (out [B, C], tokens per expert or None)
};

static DecodeNorm decode_norm(const py::tuple& t) {  // (weight, bias or None, eps, layer_norm)
  TORCH_CHECK(t.size() == 4, "DecodeModel: a norm is (weight, bias or None, eps, is_layer_norm)");
  return {t[0].cast<at::Tensor>(), t[1].cast<c10::optional<at::Tensor>>(), t[2].cast<double>(),
          t[3].cast<bool>()};
}

static DecodeLinear decode_linear(const py::tuple& t) {  // (weight, amx or None, packed, more, bias or None)
  TORCH_CHECK(t.size() == 5, "DecodeModel: a linear is (weight, amx or None, packed, more, bias or None)");
  DecodeLinear l{t[0].cast<at::Tensor>(), t[1].cast<c10::optional<at::Tensor>>().value_or(at::Tensor()),
                 t[2].cast<at::Tensor>(), t[4].cast<c10::optional<at::Tensor>>(), t[3].cast<int64_t>()};
  TORCH_CHECK(l.more >= DecodeLinear::ONEDNN && l.more <= DecodeLinear::W8A8, "DecodeModel: `more` is 0 to 6");
  return l;
}

class DecodeModel {
 public:
  DecodeModel(int64_t head_dim, int64_t q_size, int64_t kv_size, int64_t top_k, bool renormalize, bool swiglu)
      : D_(head_dim), qs_(q_size), kvs_(kv_size), k_(top_k), renormalize_(renormalize), swiglu_(swiglu) {}

  // A layer's attention half: its two norms and two linears as tuples (`decode_norm`, `decode_linear`), the q/k
  // norms, and its pool; then `add_experts`, `add_mlp` or `add_module` for its MLP half.
  void add_attention(py::tuple ln1, py::tuple qkv, c10::optional<at::Tensor> q_norm,
                     c10::optional<at::Tensor> k_norm, double qk_eps, py::tuple out, py::tuple ln2, at::Tensor K,
                     at::Tensor V) {
    DecodeLayer L;
    L.n1 = decode_norm(ln1), L.qkv = decode_linear(qkv), L.out = decode_linear(out), L.n2 = decode_norm(ln2);
    TORCH_CHECK(L.qkv.outputs() == qs_ + 2 * kvs_, "DecodeModel.add_attention: a q/k/v weight of ", qs_ + 2 * kvs_,
                " outputs");
    L.q_norm = q_norm, L.k_norm = k_norm, L.qk_eps = qk_eps, L.K = K, L.V = V;
    layers_.push_back(std::move(L));
  }

  void add_experts(at::Tensor wg, std::vector<at::Tensor> w1, std::vector<at::Tensor> b1,
                   std::vector<at::Tensor> w2, std::vector<at::Tensor> b2, std::vector<at::Tensor> s1,
                   std::vector<at::Tensor> s2) {
    TORCH_CHECK(!layers_.empty() && static_cast<int64_t>(w1.size()) == wg.size(0) && w2.size() == w1.size() &&
                    (b1.empty() || b1.size() == w1.size()) && b2.size() == b1.size(),
                "DecodeModel.add_experts: after add_attention, one w1, w2 (b1, b2) per expert of the router");
    DecodeLayer& L = last("add_experts");
    TORCH_CHECK(s1.size() == s2.size() && (s1.empty() || s1.size() == w1.size()),
                "DecodeModel.add_experts: int8 experts' scales s1, s2 for every expert, or none");
    L.mlp = DecodeLayer::EXPERTS, L.wg = wg, L.w1 = std::move(w1), L.b1 = std::move(b1), L.w2 = std::move(w2);
    L.b2 = std::move(b2), L.s1 = std::move(s1), L.s2 = std::move(s2);
  }

  // An expert-parallel MoE layer between the ranks of one machine, as export/serve/placement/exchange.py's
  // `Exchange.run_gathered` runs it (there in Python, here without it): every rank's tokens gathered by one
  // all-reduce of a table in which each rank writes its rows (exact: x + 0 = x), routed alike on every rank, this
  // rank's pairs computed, the pairs' outputs summed over the ranks by a second all-reduce, and this rank's tokens'
  // choices combined. The all-reduce is DeepSpeed's shared-memory one (torch.ops.deepspeed.inference_all_reduce_, as
  // pipeline/dist.py's fast_all_reduce_ calls it), called through the dispatcher. `module`: the layer as PlacedMoE
  // runs it, called back for a forward that is not given every rank's tokens. The experts held here: `hold`.
  void add_gathered(at::Tensor wg, int64_t rank, py::object module) {
    TORCH_CHECK(rank >= 0, "DecodeModel.add_gathered: this rank");
    DecodeLayer& L = last("add_gathered");
    L.mlp = DecodeLayer::GATHERED, L.wg = wg, L.module = std::move(module), L.slot.assign(wg.size(0), -1);
    L.split = py::none();
    rank_ = rank;
  }

  // The experts GATHERED layer `layer` (its index among all layers) computes here: `experts` (increasing) with their
  // w1, w2 (b1, b2); `split`: None when every expert has one holder (a pair is this rank's when its expert is held
  // here), else a callable (experts [S, k], tokens per expert [E]) -> experts [S, k] with -1 for the pairs another
  // holder computes (a replicated expert's pairs split between its holders: Exchange._my_pairs).
  void hold(int64_t layer, std::vector<int64_t> experts, std::vector<at::Tensor> w1, std::vector<at::Tensor> b1,
            std::vector<at::Tensor> w2, std::vector<at::Tensor> b2, std::vector<at::Tensor> s1,
            std::vector<at::Tensor> s2, py::object split) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) &&
                    layers_[layer].mlp == DecodeLayer::GATHERED, "DecodeModel.hold: layer ", layer, " is not gathered");
    DecodeLayer& L = layers_[layer];
    TORCH_CHECK(w1.size() == experts.size() && w2.size() == w1.size() && (b1.empty() || b1.size() == w1.size()) &&
                    b2.size() == b1.size() && s1.size() == s2.size() && (s1.empty() || s1.size() == w1.size()),
                "DecodeModel.hold: one w1, w2 (b1, b2; s1, s2 for int8 ones) per expert held");
    std::vector<int64_t> slot(L.wg.size(0), -1);
    for (size_t i = 0; i < experts.size(); ++i) {
      TORCH_CHECK(experts[i] >= 0 && experts[i] < L.wg.size(0) && (i == 0 || experts[i] > experts[i - 1]),
                  "DecodeModel.hold: experts of the router, increasing");
      slot[experts[i]] = static_cast<int64_t>(i);
    }
    L.slot = std::move(slot), L.w1 = std::move(w1), L.b1 = std::move(b1), L.w2 = std::move(w2);
    L.b2 = std::move(b2), L.s1 = std::move(s1), L.s2 = std::move(s2), L.split = std::move(split);
  }

  // After add_experts: PR-MoE's residual MLP, out = experts * c0 + mlp * c1 with (c0, c1) = softmax(coefficient(h))
  // (pipeline/model.py `mix_residual`).
  void add_residual(py::tuple fc1, py::tuple fc2, py::tuple coefficient) {
    DecodeLayer& L = experts_layer("add_residual");
    L.residual = true, L.rfc1 = decode_linear(fc1), L.rfc2 = decode_linear(fc2), L.coefficient = decode_linear(coefficient);
  }

  // After add_experts (and add_residual): Qwen2-MoE's shared expert, out + sigmoid(gate(h)) * shared(h)
  // (pipeline/model.py `add_shared`).
  void add_shared(py::tuple fc1, py::tuple fc2, py::tuple gate) {
    DecodeLayer& L = experts_layer("add_shared");
    L.shared = true, L.sfc1 = decode_linear(fc1), L.sfc2 = decode_linear(fc2), L.shared_gate = decode_linear(gate);
  }

  void add_mlp(py::tuple fc1, py::tuple fc2) {
    DecodeLayer& L = last("add_mlp");
    L.mlp = DecodeLayer::DENSE, L.fc1 = decode_linear(fc1), L.fc2 = decode_linear(fc2);
  }

  void add_module(py::object module) {
    DecodeLayer& L = last("add_module");
    L.mlp = DecodeLayer::MODULE, L.module = std::move(module);
  }

  // x [B, C] the rows' embeddings; cos, sin [B, D] (RoPE) or None; the pool's block tables and starts as
  // paged_attention takes them; `tokens`: every rank's rows in this forward (the step says them), for the GATHERED
  // layers, or empty (they call their module back). Returns (hidden [B, C] before the final norm, tokens per expert
  // [E] of each MoE layer, seconds computing experts in the MoE layers run here, seconds in their all-reduces, the
  // experts they ran on this rank, how many MoE layers ran here as EXPERTS, how many as GATHERED).
  std::tuple<at::Tensor, std::vector<at::Tensor>, double, double, int64_t, int64_t, int64_t> forward(
      at::Tensor x, const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
      const at::Tensor& tables, const std::vector<int64_t>& starts, const std::vector<int64_t>& tokens) {
    const int64_t B = x.size(0);
    std::vector<at::Tensor> counts;
    double expert_s = 0, exchange_s = 0;
    int64_t ran = 0, here = 0, gathered = 0;
    py::gil_scoped_release nogil;  // the server's HTTP thread runs meanwhile; a module called back takes it again
    for (const DecodeLayer& L : layers_) {
      TORCH_CHECK(L.mlp != DecodeLayer::NONE, "DecodeModel.forward: a layer without its MLP half");
      at::Tensor y = L.qkv(L.n1(x));
      auto heads = qkv_heads(y.narrow(1, 0, qs_), y.narrow(1, qs_, kvs_), y.narrow(1, qs_ + kvs_, kvs_), D_,
                             L.q_norm, L.k_norm, L.q_norm ? L.qk_eps : 0.0, cos, sin);
      at::Tensor a = paged_attention(heads[0], heads[1], heads[2], L.K, L.V, tables, starts);
      x = x.add(L.out(a.view({B, -1})));
      at::Tensor h = L.n2(x);
      if (L.mlp == DecodeLayer::DENSE) {
        x = x.add(mlp(h, L.fc1, L.fc2));
        continue;
      }
      if (L.mlp == DecodeLayer::MODULE || (L.mlp == DecodeLayer::GATHERED && tokens.empty())) {
        py::gil_scoped_acquire gil;
        py::tuple r = L.module(h);
        x = x.add(r[0].cast<at::Tensor>());
        if (!r[1].is_none()) counts.push_back(r[1].cast<at::Tensor>());
        continue;
      }
      at::Tensor out, n;
      if (L.mlp == DecodeLayer::GATHERED) {
        std::tie(out, n) = gathered_experts(L, h, tokens, expert_s, exchange_s, ran);
        ++gathered;
      } else {
        const auto t0 = std::chrono::steady_clock::now();
        at::Tensor mix, experts;
        std::tie(mix, experts, n) = route(h, L.wg, k_, renormalize_);
        const int64_t* np = n.data_ptr<int64_t>();
        const Picked p = pick(L, n.numel(), [&](int64_t e) { return np[e] ? e : int64_t{-1}; });
        out = routed_experts(h, experts, mix, p.active, p.w1, p.b1, p.w2, p.b2, swiglu_, p.s1, p.s2);
        expert_s += seconds_since(t0);
        ran += static_cast<int64_t>(p.active.size());
        ++here;
      }
      if (L.residual) {
        at::Tensor c = L.coefficient(h).softmax(-1);
        out = out.mul(c.narrow(-1, 0, 1)).add(mlp(h, L.rfc1, L.rfc2).mul(c.narrow(-1, 1, 1)));
      }
      if (L.shared) out = out.add(at::sigmoid(L.shared_gate(h)).mul(mlp(h, L.sfc1, L.sfc2)));
      x = x.add(out);
      counts.push_back(n);
    }
    return {x, counts, expert_s, exchange_s, ran, here, gathered};
  }

 private:
  // Some of a layer's experts, in increasing order, with their tensors (as routed_experts and expert_pairs take them)
  struct Picked {
    std::vector<int64_t> active;
    std::vector<at::Tensor> w1, b1, w2, b2, s1, s2;
  };

  // The experts e of E for which `at(e)` gives their place in L's w1.. (-1: not this call's)
  template <typename At>
  static Picked pick(const DecodeLayer& L, int64_t E, At at) {
    Picked p;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t i = at(e);
      if (i < 0) continue;
      p.active.push_back(e);
      p.w1.push_back(L.w1[i]);
      p.w2.push_back(L.w2[i]);
      if (!L.b1.empty()) {
        p.b1.push_back(L.b1[i]);
        p.b2.push_back(L.b2[i]);
      }
      if (!L.s1.empty()) {
        p.s1.push_back(L.s1[i]);
        p.s2.push_back(L.s2[i]);
      }
    }
    return p;
  }

  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // t summed over the ranks in place (every rank calls it, in the same order): `local_reduce_` where attached, else
  // DeepSpeed's shared-memory all-reduce
  static void all_reduce(at::Tensor& t) {
    if (local_reduce_attached()) return local_reduce_(t);
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("deepspeed::inference_all_reduce_", "")
                         .typed<at::Tensor&(at::Tensor&)>();
    op.call(t);
  }

  // A GATHERED layer over this rank's rows h [S, C] (see add_gathered): (output [S, C], tokens per expert [E]).
  std::pair<at::Tensor, at::Tensor> gathered_experts(const DecodeLayer& L, const at::Tensor& h,
                                                     const std::vector<int64_t>& tokens, double& expert_s,
                                                     double& exchange_s, int64_t& ran) const {
    const int64_t S = h.size(0), C = h.size(1);
    TORCH_CHECK(rank_ < static_cast<int64_t>(tokens.size()) && tokens[rank_] == S, "DecodeModel.forward: ", S,
                " rows on rank ", rank_, ", the step's tokens say otherwise");
    int64_t total = 0, off = 0;
    for (size_t r = 0; r < tokens.size(); ++r) {
      if (static_cast<int64_t>(r) < rank_) off += tokens[r];
      total += tokens[r];
    }
    auto t0 = std::chrono::steady_clock::now();
    at::Tensor every = at::zeros({total, C}, h.options());
    every.narrow(0, off, S).copy_(h);
    all_reduce(every);
    exchange_s += seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    auto [mix, experts, n] = route(every, L.wg, k_, renormalize_);
    at::Tensor mine;  // this rank's pairs: their expert; the others' -1
    if (L.split.is_none()) {
      mine = experts.clone();
      int64_t* mp = mine.data_ptr<int64_t>();
      for (int64_t i = 0; i < mine.numel(); ++i)
        if (L.slot[mp[i]] < 0) mp[i] = -1;
    } else {
      py::gil_scoped_acquire gil;
      mine = L.split(experts, n).cast<at::Tensor>().contiguous();
      TORCH_CHECK(mine.sizes() == experts.sizes() && mine.scalar_type() == at::kLong,
                  "DecodeModel: a split gives experts [S, k] int64");
    }
    std::vector<bool> used(n.numel(), false);
    const int64_t* mp = mine.data_ptr<int64_t>();
    for (int64_t i = 0; i < mine.numel(); ++i)
      if (mp[i] >= 0) {
        TORCH_CHECK(mp[i] < n.numel() && L.slot[mp[i]] >= 0, "DecodeModel: a split gave expert ", mp[i],
                    ", not held here");
        used[mp[i]] = true;
      }
    const Picked p = pick(L, n.numel(), [&](int64_t e) { return used[e] ? L.slot[e] : int64_t{-1}; });
    at::Tensor pairs = p.active.empty() ? at::zeros({total, k_, C}, h.options())
                                        : expert_pairs(every, mine, mix, p.active, p.w1, p.b1, p.w2, p.b2, swiglu_, p.s1, p.s2);
    expert_s += seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    all_reduce(pairs);
    exchange_s += seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    at::Tensor out = combine_pairs(pairs.narrow(0, off, S).contiguous(), mix.narrow(0, off, S).contiguous());
    expert_s += seconds_since(t0);
    ran += static_cast<int64_t>(p.active.size());
    return {out, n};
  }

  // pipeline/model.py's MLP
  at::Tensor mlp(const at::Tensor& h, const DecodeLinear& fc1, const DecodeLinear& fc2) const {
    at::Tensor u = fc1(h);
    if (swiglu_) {
      auto parts = u.chunk(2, -1);
      u = at::silu(parts[0]).mul(parts[1]);
    } else {
      u = at::gelu(u);
    }
    return fc2(u);
  }

  DecodeLayer& experts_layer(const char* what) {
    TORCH_CHECK(!layers_.empty() && (layers_.back().mlp == DecodeLayer::EXPERTS ||
                                     layers_.back().mlp == DecodeLayer::GATHERED),
                "DecodeModel.", what, ": after add_experts or add_gathered");
    return layers_.back();
  }

  DecodeLayer& last(const char* what) {
    TORCH_CHECK(!layers_.empty() && layers_.back().mlp == DecodeLayer::NONE, "DecodeModel.", what,
                ": once, after add_attention");
    return layers_.back();
  }

  int64_t D_, qs_, kvs_, k_;
  int64_t rank_ = 0;  // this rank (GATHERED layers)
  bool renormalize_, swiglu_;
  std::vector<DecodeLayer> layers_;
};

// csrc/sampling.cpp
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                       const at::Tensor& seed, const at::Tensor& counter, const at::Tensor& offsets,
                       const at::Tensor& tokens, const at::Tensor& values, const at::Tensor& allowed);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adopt_storage", &adopt_storage, "a tensor's storage takes bytes of a mapping's storage as its memory");
  m.def("local_reduce_attach", &local_reduce_attach, "this rank's view of the ranks' shared region for local_reduce_");
  // the kernels run without the GIL, as torch's operators do: while a rank computes, or waits for the others (the
  // step results' gather, a prefill forward's exchange), its process's other threads (the server's HTTP thread) run
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("local_gather", &local_gather, "every rank's bytes through local_reduce_'s slots: (lengths, bytes a rank)",
        nogil);
  m.def("local_reduce_", &local_reduce_, "a tensor summed over the ranks of one machine in place (yielding waits)",
        nogil);
  m.def("linear", &linear, "y = x @ w.T (+ bias) for 1-8 rows of x, fp32 or bf16", nogil);
  m.def("paged_attention", &paged_attention,
        "one new token per row: store its key and value in its row's block of a paged KV pool, attend over the "
        "row's keys through its block table", nogil);
  const auto none = std::vector<at::Tensor>();  // s1, s2: the int8 weights' scales, or none
  m.def("expert_mlps", &expert_mlps,
        "the routed experts of one MoE layer over their rows (grouped by expert), in two parallel passes",
        py::arg("x"), py::arg("counts"), py::arg("w1"), py::arg("b1"), py::arg("w2"), py::arg("b2"), py::arg("swiglu"),
        py::arg_v("s1", none, "[]"), py::arg_v("s2", none, "[]"), nogil);
  m.def("route", &route, "an MoE layer's top-k routing: (weights, experts, tokens per expert)", nogil);
  m.def("routed_experts", &routed_experts, "every token's routed experts and their weighted sum", py::arg("x"),
        py::arg("experts"), py::arg("weights"), py::arg("active"), py::arg("w1"), py::arg("b1"), py::arg("w2"),
        py::arg("b2"), py::arg("swiglu"), py::arg_v("s1", none, "[]"), py::arg_v("s2", none, "[]"), nogil);
  m.def("expert_pairs", &expert_pairs, "the (token, choice) outputs of some of the experts, zeros for the others",
        py::arg("x"), py::arg("experts"), py::arg("weights"), py::arg("active"), py::arg("w1"), py::arg("b1"),
        py::arg("w2"), py::arg("b2"), py::arg("swiglu"), py::arg_v("s1", none, "[]"), py::arg_v("s2", none, "[]"),
        nogil);
  m.def("combine_pairs", &combine_pairs, "each token's choices' outputs weighted and summed, as routed_experts", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, as pipeline/model.py's", nogil);
  m.def("argmax_rows", &argmax_rows, "each row's argmax, as torch.argmax(x, -1)", nogil);
  m.def("sample_rows", &sample_rows, "each asked row's token after temperature, min_p, top_k, top_p and one "
        "counter-based draw (csrc/sampling.cpp)", nogil);
  m.def("int8_linear", &int8_linear, "y = x @ (scale * q).T (+ bias) for int8 weights q, one scale a row", nogil);
  m.def("int4_linear", &int4_linear, "y = x @ w.T (+ bias) for int4 weights, two a byte, one scale a group of a row",
        nogil);
  m.def("screen_argmax", &screen_argmax,
        "each row's argmax of x @ w.T as linear writes it, from an int8 copy of w and the candidates' exact rows", nogil);
  m.def("screen_topk", &screen_topk,
        "each row's candidates for its top k of x @ w.T (edited tokens always) and their logits as linear writes them",
        nogil);
  m.def("qkv_heads", &qkv_heads,
        "a decode token's q, k, v split into heads, q and k normalised (qk_norm) and rotated (RoPE), as pipeline/model.py",
        nogil);
  m.attr("MAX_ROWS") = MAX_ROWS;
#if defined(__AVX512VNNI__)
  m.def("vnni_pack", &vnni_pack, "an int8 [out, in] weight in tiles of 64 outputs for screen_argmax_vnni");
  m.def("screen_argmax_i4", &screen_argmax_i4,
        "the greedy argmax of an int4 layer's rows (int4_linear's), screened in int4 x int8 (VPDPBUSD)", nogil);
  m.def("screen_argmax_i8", &screen_argmax_i8,
        "the greedy argmax of an int8 layer's rows (int8_linear's), screened in int8 x int8 (VPDPBUSD)", nogil);
  m.def("screen_argmax_vnni", &screen_argmax_vnni,
        "screen_argmax for up to VNNI_MAX_ROWS rows, its int8 pass on x rounded to int8 too (VPDPBUSD)", nogil);
  m.def("screen_topk_vnni", &screen_topk_vnni, "screen_topk for up to VNNI_MAX_ROWS rows, as screen_argmax_vnni",
        nogil);
  m.attr("VNNI_MAX_ROWS") = VNNI_MAX_ROWS;
  m.def("w8a8_linear", &w8a8_linear,
        "y = x @ w.T (+ bias) for a W8A8 weight (vnni_pack's tiles, scales and rows' sums [2, out]), x rounded to int8 "
        "a row at a time", nogil);
#endif
  py::class_<DecodeModel>(m, "DecodeModel", py::module_local(),  // one per ISA build in a process
                          "a whole decode forward of a model's layers in one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, bool, bool>())
      .def("add_attention", &DecodeModel::add_attention)
      .def("add_experts", &DecodeModel::add_experts)
      .def("add_gathered", &DecodeModel::add_gathered)
      .def("hold", &DecodeModel::hold)
      .def("add_mlp", &DecodeModel::add_mlp)
      .def("add_residual", &DecodeModel::add_residual)
      .def("add_shared", &DecodeModel::add_shared)
      .def("add_module", &DecodeModel::add_module)
      .def("forward", &DecodeModel::forward);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.def("amx_ready", &amx_ready, "whether this process may use AMX (Linux gave it the tile state)");
  m.def("amx_pack", &amx_pack, "a bf16 [out, in] weight packed into AMX tiles, for amx_linear");
  m.def("amx_linear", &amx_linear, "y = x @ w.T (+ bias) for 1 to AMX_MAX_ROWS bf16 rows, w as amx_pack packed it",
        nogil);
  m.attr("AMX_MAX_ROWS") = AMX_MAX_ROWS;
#endif
}
