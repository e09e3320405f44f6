// Decode kernels for the CPU: a linear layer for a few rows (batch-1 decode) reading the weight once at the
// memory's speed, and the attention of one new token per row over its KV-cache row or through its block table
// into a paged KV pool (below).
//
// y[m, o] = sum_i x[m, i] * w[o, i] (+ bias[o]) for m < 4 rows; w row-major [out, in], fp32 or bf16, x the same
// dtype. Built at first use by export/serve/linears.py (torch.utils.cpp_extension, the way DeepSpeed builds its
// CPU ops), with AVX-512 or AVX2 + FMA. Output rows are split between torch's intra-op threads
// (at::parallel_for). One input row: each thread reads its weight rows one after another, one sequential stream
// (row1). 2-4 input rows: GROUP weight rows at a time, each step loading a vector of every input row once and of
// GROUP weight rows, so the weight streams from memory once and x stays in L1. fp32 accumulation (bf16 weights
// widened by a shift, as oneDNN does; or with AVX512_BF16, bf16 pairs multiplied and summed into fp32 by
// VDPBF16PS), the bias added in fp32, one rounding to the output dtype, no temporary tensors.

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
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
#else
#error "export/serve/csrc/gemv.cpp needs AVX-512 or AVX2 with FMA"
#endif

constexpr int64_t MAX_ROWS = 4;

// Row groups per thread's share: at least ~2 MB of weight. Waking a sleeping thread (OMP_WAIT_POLICY=PASSIVE)
// costs ~45 us, the time to read ~2 MB, so a smaller weight is read faster by one thread than split.
static int64_t grain(int64_t I, size_t elem) {
  return std::max<int64_t>(1, (int64_t(2) << 20) / (GROUP * I * int64_t(elem) + 1));
}

// Output rows [o0, o1) of the M input rows x (fp32, [M, I]) against w ([O, I]) into y ([M, O], w's dtype), each
// plus bias[o] (w's dtype, or none) in fp32 before the one rounding.
template <typename W, int M>
static void rows(const W* w, const float* x, const W* bias, W* y, int64_t I, int64_t O, int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + GROUP <= o1; o += GROUP) {
    vf acc[M][GROUP];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < GROUP; ++r) acc[m][r] = vzero();
    int64_t i = 0;
    for (; i + VW <= I; i += VW) {
      vf xv[M];
      for (int m = 0; m < M; ++m) xv[m] = vload(x + m * I + i);
      for (int r = 0; r < GROUP; ++r) {
        vf wv = vload(w + (o + r) * I + i);
        for (int m = 0; m < M; ++m) acc[m][r] = vfma(wv, xv[m], acc[m][r]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < GROUP; ++r) {
        float s = vsum(acc[m][r]);
        for (int64_t j = i; j < I; ++j) s += static_cast<float>(w[(o + r) * I + j]) * x[m * I + j];
        y[m * O + o + r] = static_cast<W>(bias ? s + static_cast<float>(bias[o + r]) : s);
      }
  }
  for (; o < o1; ++o) {  // the last rows, fewer than GROUP
    vf acc[M];
    for (int m = 0; m < M; ++m) acc[m] = vzero();
    int64_t i = 0;
    for (; i + VW <= I; i += VW) {
      vf wv = vload(w + o * I + i);
      for (int m = 0; m < M; ++m) acc[m] = vfma(wv, vload(x + m * I + i), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = vsum(acc[m]);
      for (int64_t j = i; j < I; ++j) s += static_cast<float>(w[o * I + j]) * x[m * I + j];
      y[m * O + o] = static_cast<W>(bias ? s + static_cast<float>(bias[o]) : s);
    }
  }
}

// The weight 2 KB ahead of a read, prefetched non-temporally: the stream (hundreds of MB a token) would otherwise
// evict everything else a decode step touches from the caches (the KV cache, activations, the interpreter's own
// memory) on every step; with the hint the step's other work ran ~0.3-0.4 ms faster a token (4-8% of a step).
static inline void ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + 2048, _MM_HINT_NTA); }

// One input row (batch-1 decode): output rows one after another, each read start to end with U independent sums,
// so a thread's share of the weight is one sequential stream. The hardware prefetcher follows one stream far
// better than GROUP interleaved rows of a few KB each: in bf16 ~20% more GB/s when the memory is fast (70 GB/s
// where the grouped loop read 57).
template <typename W>
static void row1(const W* w, const float* x, const W* bias, W* y, int64_t I, int64_t o0, int64_t o1) {
  constexpr int U = 4;
  for (int64_t o = o0; o < o1; ++o) {
    const W* wr = w + o * I;
    vf acc[U];
    for (int u = 0; u < U; ++u) acc[u] = vzero();
    int64_t i = 0;
    for (; i + U * VW <= I; i += U * VW)
      for (int u = 0; u < U; ++u) {
        if (sizeof(W) == 4 || u % 2 == 0) ahead(wr + i + u * VW);  // a line per 64 bytes
        acc[u] = vfma(vload(wr + i + u * VW), vload(x + i + u * VW), acc[u]);
      }
    for (; i + VW <= I; i += VW) acc[0] = vfma(vload(wr + i), vload(x + i), acc[0]);
    float s = vsum(acc[0] + acc[1] + acc[2] + acc[3]);
    for (; i < I; ++i) s += static_cast<float>(wr[i]) * x[i];
    y[o] = static_cast<W>(bias ? s + static_cast<float>(bias[o]) : s);
  }
}

#if defined(__AVX512BF16__)
// bf16 weight and x as they are: VDPBF16PS multiplies 32 bf16 pairs and adds them into 16 fp32 sums in one
// instruction, with no widening. The shift-and-FMA path above is compute-bound in bf16 (~25 GB/s a thread here,
// where fp32 reads at ~40); this one reads ~1.8x faster. G output rows at a time, U independent sums per row
// for one or two input rows (more would spill the 32 vector registers).
typedef c10::BFloat16 B16;
template <int M, int U, int G>
static int64_t rows_dp(const B16* w, const B16* x, const B16* bias, B16* y, int64_t I, int64_t O, int64_t o0,
                       int64_t o1) {
  int64_t o = o0;
  for (; o + G <= o1; o += G) {
    __m512 acc[M][G][U];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < G; ++r)
        for (int u = 0; u < U; ++u) acc[m][r][u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 * U <= I; i += 32 * U) {
      __m512bh xv[M][U];
      for (int m = 0; m < M; ++m)
        for (int u = 0; u < U; ++u) xv[m][u] = (__m512bh)_mm512_loadu_si512(x + m * I + i + 32 * u);
      for (int r = 0; r < G; ++r)
        for (int u = 0; u < U; ++u) {
          __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (o + r) * I + i + 32 * u);
          for (int m = 0; m < M; ++m) acc[m][r][u] = _mm512_dpbf16_ps(acc[m][r][u], wv, xv[m][u]);
        }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < G; ++r) {
        __m512 v = acc[m][r][0];
        for (int u = 1; u < U; ++u) v = _mm512_add_ps(v, acc[m][r][u]);
        float s = _mm512_reduce_add_ps(v);
        for (int64_t j = i; j < I; ++j) s += static_cast<float>(w[(o + r) * I + j]) * static_cast<float>(x[m * I + j]);
        y[m * O + o + r] = static_cast<B16>(bias ? s + static_cast<float>(bias[o + r]) : s);
      }
  }
  return o;  // the first row not done (fewer than G were left)
}

// One input row, bf16: row1's sequential stream with VDPBF16PS, U independent sums of 32 pairs each.
static void row1_dp(const B16* w, const B16* x, const B16* bias, B16* y, int64_t I, int64_t o0, int64_t o1) {
  constexpr int U = 4;
  for (int64_t o = o0; o < o1; ++o) {
    const B16* wr = w + o * I;
    __m512 acc[U];
    for (int u = 0; u < U; ++u) acc[u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 * U <= I; i += 32 * U)
      for (int u = 0; u < U; ++u) {
        ahead(wr + i + 32 * u);
        acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_loadu_si512(wr + i + 32 * u),
                                  (__m512bh)_mm512_loadu_si512(x + i + 32 * u));
      }
    for (; i + 32 <= I; i += 32)
      acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512(wr + i), (__m512bh)_mm512_loadu_si512(x + i));
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    for (; i < I; ++i) s += static_cast<float>(wr[i]) * static_cast<float>(x[i]);
    y[o] = static_cast<B16>(bias ? s + static_cast<float>(bias[o]) : s);
  }
}

template <int M>
static void rows_bf16(const B16* w, const B16* x, const B16* bias, B16* y, int64_t I, int64_t O, int64_t o0,
                      int64_t o1) {
  constexpr int U = M <= 2 ? 2 : 1;
  const int64_t o = rows_dp<M, U, GROUP>(w, x, bias, y, I, O, o0, o1);
  rows_dp<M, U, 1>(w, x, bias, y, I, O, o, o1);
}
#endif

template <typename W>
static void run(int64_t M, const W* w, const float* x, const W* bias, W* y, int64_t I, int64_t O) {
  const int64_t groups = (O + GROUP - 1) / GROUP;
  at::parallel_for(0, groups, grain(I, sizeof(W)), [&](int64_t b, int64_t e) {
    const int64_t o0 = b * GROUP, o1 = std::min(O, e * GROUP);
    switch (M) {
      case 1: return row1<W>(w, x, bias, y, I, o0, o1);
      case 2: return rows<W, 2>(w, x, bias, y, I, O, o0, o1);
      case 3: return rows<W, 3>(w, x, bias, y, I, O, o0, o1);
      default: return rows<W, 4>(w, x, bias, y, I, O, o0, o1);
    }
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

// One query head of one row: y[D] = softmax(scale q.K[j] for j < n) . V, fp32 throughout (q, K, V widened on load),
// one rounding to the output dtype. The keys are walked block by block: key (and value) j is the D values at
// K + table[j / bs] * stride + (j % bs) * D: a paged pool's blocks of bs positions, `stride` elements apart, in the
// order of the row's block table.
// `s`: room for n scores (rounded up to a whole vector).
template <typename T>
static void attend_one(const T* q, const T* K, const T* V, const int64_t* table, int64_t bs, int64_t stride, T* y,
                       int64_t n, int64_t D, float scale, float* s) {
  const int64_t Dv = D / VW * VW;
  float qf[512];
  for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(q[d]) * scale;
  float m = -INFINITY;
  for (int64_t j0 = 0, blk = 0; j0 < n; j0 += bs, ++blk) {
    const T* kb = K + table[blk] * stride;
    const int64_t len = std::min(bs, n - j0);
    for (int64_t t = 0; t < len; ++t) {
      const T* k = kb + t * D;
      vf acc = vzero();
      int64_t d = 0;
      for (; d < Dv; d += VW) acc = vfma(vload_f(k + d), vload(qf + d), acc);
      float dot = vsum(acc);
      for (; d < D; ++d) dot += static_cast<float>(k[d]) * qf[d];
      s[j0 + t] = dot;
      m = std::max(m, dot);
    }
  }
  const int64_t nv = n / VW * VW;
  vf total = vzero();
  const vf mv = vset(m);
  int64_t j = 0;
  for (; j < nv; j += VW) {
    vf e = vexp(vload(s + j) - mv);
    vstore(s + j, e);
    total = total + e;
  }
  float sum = vsum(total);
  if (j < n) {  // the last scores, fewer than a vector: padded with -inf's exp, 0
    float tail[VW];
    for (int64_t t = 0; t < VW; ++t) tail[t] = j + t < n ? s[j + t] - m : -INFINITY;
    vstore(tail, vexp(vload(tail)));
    for (int64_t t = 0; j + t < n; ++t) {
      s[j + t] = tail[t];
      sum += tail[t];
    }
  }
  float out[512];
  for (int64_t d = 0; d < Dv; d += VW) vstore(out + d, vzero());
  for (int64_t d = Dv; d < D; ++d) out[d] = 0.0f;
  for (int64_t j0 = 0, blk = 0; j0 < n; j0 += bs, ++blk) {
    const T* vb = V + table[blk] * stride;
    const int64_t len = std::min(bs, n - j0);
    for (int64_t t = 0; t < len; ++t) {
      const T* v = vb + t * D;
      const float w = s[j0 + t];
      const vf p = vset(w);
      int64_t d = 0;
      for (; d < Dv; d += VW) vstore(out + d, vfma(p, vload_f(v + d), vload(out + d)));
      for (; d < D; ++d) out[d] += w * static_cast<float>(v[d]);
    }
  }
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < D; ++d) y[d] = static_cast<T>(out[d] * inv);
}

// -- decode attention over a paged KV pool ---------------------------------------------------------------------- ------------------------------------------------------------------------------

template <typename T>
static void paged_attention_typed(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  torch::Tensor& K, torch::Tensor& V, const torch::Tensor& tables,
                                  const std::vector<int64_t>& starts, torch::Tensor& y, float scale, int64_t grain) {
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
  at::parallel_for(0, B * H, grain, [&](int64_t first, int64_t last) {
    int64_t longest = 0;
    for (int64_t i = first; i < last; ++i) longest = std::max(longest, starts[i / H] + 1);
    std::vector<float> s(longest + VW);
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / H, h = i % H, g = h / group;
      attend_one<T>(qp + i * D, Kp + g * bs * D, Vp + g * bs * D, tp + b * W, bs, stride, yp + i * D, starts[b] + 1,
                    D, scale, s.data());
    }
  });
}

// One new token per row, over a paged pool. q [B, H, D]: each row's query (after RoPE); k, v [B, Hkv, D] its key and
// value; K, V [num_blocks, Hkv, bs, D]: one layer's pool of blocks of bs positions; tables [B, max_blocks] int64, row
// b's logical block i being physical block tables[b][i] (entries past the row's blocks are never read). Writes k, v
// at position starts[b] (block tables[b][starts[b] / bs], offset starts[b] % bs), then y[b, h] = softmax(q.K /
// sqrt(D)) . V over the row's starts[b] + 1 keys, query head h reading pool head h / (H / Hkv) (grouped-query
// attention). Heads are split between torch's intra-op threads, a few hundred KB of keys and values each at least
// (fewer stay on the calling thread).
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor K,
                              torch::Tensor V, const torch::Tensor& tables, const std::vector<int64_t>& starts) {
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
  for (const torch::Tensor* t : {&q, &k, &v, const_cast<const torch::Tensor*>(&K), const_cast<const torch::Tensor*>(&V),
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
  torch::Tensor y = torch::empty({B, H, D}, q.options());
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, starts[b] + 1);
  const int64_t per_head = longest * D * 2 * int64_t(q.element_size());  // bytes of keys and values a head reads
  const int64_t grain = std::max<int64_t>(1, (int64_t(256) << 10) / (per_head + 1));
  AT_DISPATCH_SWITCH(dt, "paged_attention", AT_DISPATCH_CASE(at::kFloat, [&] {
    paged_attention_typed<scalar_t>(q, k, v, K, V, tables, starts, y, scale, grain);
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    paged_attention_typed<scalar_t>(q, k, v, K, V, tables, starts, y, scale, grain);
  }));
  return y;
}

// x [M, I] (1 <= M <= MAX_ROWS), w [O, I], both contiguous, fp32 or bf16 alike; bias [O] of that dtype or None.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
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
  torch::Tensor y = torch::empty({M, O}, x.options());
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
    at::parallel_for(0, groups, grain(I, sizeof(B)), [&](int64_t b, int64_t e) {
      const int64_t o0 = b * GROUP, o1 = std::min(O, e * GROUP);
      switch (M) {
        case 1: return row1_dp(wb, xb, bb, yb, I, o0, o1);
        case 2: return rows_bf16<2>(wb, xb, bb, yb, I, O, o0, o1);
        case 3: return rows_bf16<3>(wb, xb, bb, yb, I, O, o0, o1);
        default: return rows_bf16<4>(wb, xb, bb, yb, I, O, o0, o1);
      }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ w.T (+ bias) for 1-4 rows of x, fp32 or bf16");
  m.def("paged_attention", &paged_attention,
        "one new token per row: store its key and value in its row's block of a paged KV pool, attend over the "
        "row's keys through its block table");
  m.attr("MAX_ROWS") = MAX_ROWS;
}
