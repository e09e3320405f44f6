// SIMD helpers shared by every kernel: the vector type of the build (AVX-512 or AVX2 + FMA) and its operations, the
// work split between torch's intra-op threads (`shared_range`, `shared_work`), the weight's prefetch hint, exp.
// Everything here is inline (static or a template): the kernels' inner loops call these per vector, so each
// translation unit keeps its own copy for the compiler to inline, as when they were one file.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

typedef c10::BFloat16 B16;

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
static inline vf vload(const int8_t* p) {  // the int8 head screen's weights (export/serve/kernels/heads.py HeadScreen)
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
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vminv(vf a, vf b) { return _mm512_min_ps(a, b); }
// each lane's bf16 bits (in its low half) as c10::BFloat16 rounds: to nearest even, a NaN to the quiet NaN 0x7FC0
static inline __m512i vbf16_bits(vf v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
static inline void vstore(c10::BFloat16* p, vf v) {  // VW floats rounded to bf16, stored
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(vbf16_bits(v)));
}
static inline vf vround_bf16(vf v) { return _mm512_castsi512_ps(_mm512_slli_epi32(vbf16_bits(v), 16)); }
// VW packed int4 values (pipeline/quantize.py `pack_int4`: a byte's low nibble and its high one, each the value + 8)
// from VW bytes at p: (low nibbles - 8, high nibbles - 8) as floats, exact
static inline void vnibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i f = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
  lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, f), eight));
  hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight));
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
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vminv(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline __m256i vbf16_bits(vf v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
static inline void vstore(c10::BFloat16* p, vf v) {
  const __m256i r = vbf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
static inline vf vround_bf16(vf v) { return _mm256_castsi256_ps(_mm256_slli_epi32(vbf16_bits(v), 16)); }
static inline void vnibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i f = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, f), eight));
  hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
}
#else
#error "export/serve/kernels/csrc needs AVX-512 or AVX2 with FMA"
#endif

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
// Against static halves, with our server and its client on the same 2 cores: more output tok/s at 8 and 32
// concurrent requests, about even at 1 (docs/serving.md, "CPU kernels").
// units per thread's share for a split kernel: enough that a thread finishing early finds pieces left to take, few
// enough that a piece still streams a long run of the weight
static constexpr int SHARE_PIECES = 8;
static int share_pieces() { return SHARE_PIECES; }

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

// The weight 2 KB ahead of a read. Which hint depends on the CPU (export/serve/kernels/extension.py `prefetch_hint`
// chooses at build time). AMD (Zen 4): non-temporally, the default: the stream (hundreds of MB a token) would otherwise
// evict everything else a decode step touches from the caches (the KV cache, activations, the interpreter's own
// memory) on every step; with the hint the step's other work ran faster. Intel (Sapphire Rapids, MOE_PREFETCH_T0):
// into every cache level; a core there reads the memory slowly alone, and the NTA hint read the weights slower
// than T0 (export/serve/kernels/extension.py `prefetch_hint`).
#if defined(MOE_PREFETCH_T0)
#define AHEAD_HINT _MM_HINT_T0
#else
#define AHEAD_HINT _MM_HINT_NTA
#endif
static inline void ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + 2048, AHEAD_HINT); }

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

// silu(g) = g / (1 + exp(-g)) on VW lanes, exp as `vexp` (~1 ulp; -g clamped to [-87, 88], where silu is g or ~0)
static inline vf vsilu(vf g) { return vdiv(g, vfma(vexp(vminv(vzero() - g, vset(88.0f))), vset(1.0f), vset(1.0f))); }

// v rounded to T (bf16: to nearest even, as c10::BFloat16; fp32: itself), back as floats, in registers
template <typename T>
static inline vf vrounded(vf v) {
  if constexpr (std::is_same<T, float>::value) {
    return v;
  } else {
    return vround_bf16(v);
  }
}

static inline vf vload_f(const float* p) { return vload(p); }
static inline vf vload_f(const c10::BFloat16* p) { return vload(p); }
