// An MoE layer's experts in one call (`expert_mlps`, gemv.h's kernels, AMX's for a prefill's rows, VNNI's for W8A8),
// and a whole MoE layer on one rank (`route`, `routed_experts`) or over the ranks (`expert_pairs`, `combine_pairs`).
#include <functional>

#include "amx.h"
#include "gemv.h"
#include "kernels.h"
#include "tiles.h"
#include "vnni.h"

// -- the routed experts of one MoE layer, in one call -------------------------------------------------------------
//
// Decode batches give each expert a few rows: called one expert at a time from Python, a layer of 16 experts cost
// ~10 operators an expert (index, two linears, chunk, silu, mul, ...), each waking the thread pool, more than the
// weights' read. Here every expert's rows go through the few-row kernels (gemv.h) in two parallel passes (fc1 with
// the activation, then fc2), the work split between the threads by its cost (weight rows x row passes), so that every
// expert's weights are read once per 4 rows and no thread waits for an expert with more rows than the others.

constexpr int64_t BLOCK = 64;  // output rows of one task: 128 KB of a bf16 weight of 1024 columns

// Output rows [0, n) of M (<= MAX_ROWS) input rows x ([M, I], w's dtype) against w ([n, I]) into y ([M, O], stride
// O), each plus bias[o] if given. `scratch`: room for M * I floats where x must be widened for the kernel.
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

// block_rows on int8 weights q (w ~ scale[o] * q[o], pipeline/quantize.py `quantize_int8`): int8_linear's kernels
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

// A thread's room for at least n floats (x widened for the kernels), kept between calls: a task's own vector,
// zeroed each time, cost as much as its expert's few rows on a decode batch's many small tasks
static float* thread_scratch(size_t n) {
  thread_local std::vector<float> room;
  if (room.size() < n) room.resize(n);
  return room.data();
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

// an expert's rows from which its fcs go through tiles.h's tiles (at 16 rows already faster than 2 passes of 8)
constexpr int64_t TILE_MIN_ROWS = 16;

#if defined(__AVX512BF16__)

// A tiled expert's weight: bf16 rows as they are, or int8 rows (one scale a row: w ~ scale[o] * q[o], as int8_linear
// takes them) widened to bf16 a tile's rows at a time into this thread's room (exact: |q| <= 127), the scale applied
// to the sums, as int8_linear applies it
struct TileWeight {
  const B16* w;
  const int8_t* q;
  const float* scale;
  int64_t K;                     // inputs a row
  const uint8_t* q4 = nullptr;   // int4 (`int4_linear`'s layout): two values a byte, scale [O, K / group]
  int64_t group = 0;
  // row o's K values as bf16: w's own, or q's (q4's: exact, -8..7) widened into room + slot * K
  const B16* row(int64_t o, int slot, B16* room) const {
    if (q4) {
      static const __m512i lut = [] {  // bf16 of -8..7, indexed by the nibble
        alignas(64) uint16_t table[32] = {};
        for (int v = 0; v < 16; ++v) table[v] = c10::BFloat16(static_cast<float>(v - 8)).x;
        return _mm512_load_si512(table);
      }();
      const __m256i low = _mm256_set1_epi8(0x0F);
      B16* dst = room + slot * K;
      for (int64_t c = 0; c < K / 64; ++c) {  // 64 inputs in 32 bytes: input j low, 32 + j high
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q4 + o * (K / 2) + c * 32));
        _mm512_storeu_si512(dst + c * 64, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(bytes, low)), lut));
        _mm512_storeu_si512(dst + c * 64 + 32, _mm512_permutexvar_epi16(
                                                   _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low)), lut));
      }
      return dst;
    }
    if (!q) return w + o * K;
    const int8_t* src = q + o * K;
    B16* dst = room + slot * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_cvtepi32_ps(
                                                                     _mm512_cvtepi8_epi32(_mm_loadu_si128(
                                                                         reinterpret_cast<const __m128i*>(src + k))))));
    for (; k < K; ++k) dst[k] = static_cast<B16>(static_cast<float>(src[k]));
    return dst;
  }
  float scale_of(int64_t o) const { return q ? scale[o] : 1.0f; }  // int4's scales go in `tile_total`
};

// sums[r][n] over all K inputs of a tile (x: R blocks of pairs, J apart; w: its N rows as `TileWeight::row` gives
// them): one pass, or with int4 a pass a group, each group's sums times its row's scale added in fp32, as
// int4_linear adds them; `rows[n]`: the weight row of tile row n (int4's scales)
template <int R, int N>
static void tile_total(const TileWeight& tw, const int64_t (&rows)[N], const uint32_t* x, const B16* const (&w)[N],
                       int64_t J, float (*sums)[N][TILE_LANES]) {
  if (!tw.q4) return tile_sums<R, N>(x, w, J, 0, J, sums);
  const int64_t gp = tw.group / 2, G = tw.K / tw.group;  // pairs a group, groups a row
  alignas(64) float part[R][N][TILE_LANES];
  for (int64_t g = 0; g < G; ++g) {
    tile_sums<R, N>(x, w, J, g * gp, (g + 1) * gp, part);
    for (int n = 0; n < N; ++n) {
      const __m512 sg = _mm512_set1_ps(tw.scale[rows[n] * G + g]);
      for (int r = 0; r < R; ++r)
        _mm512_store_ps(sums[r][n], g ? _mm512_fmadd_ps(_mm512_load_ps(part[r][n]), sg, _mm512_load_ps(sums[r][n]))
                                      : _mm512_mul_ps(_mm512_load_ps(part[r][n]), sg));
    }
  }
}

// A thread's room for n bf16 values (a tile's int8 rows widened), kept between calls
static B16* tile_room(size_t n) {
  thread_local std::vector<B16> room;
  if (room.size() < n) room.resize(n);
  return room.data();
}

// fc1 of a tiled expert (M rows, packed as pairs at x) for its outputs [o0, o1) (multiples of 4): gate rows o and up
// rows F + o (swiglu: 4 of each a tile) or rows o (GeLU: 4 a tile), with the bias b, the activation rounded as
// expert_mlps_typed's passes round it, written as pairs of outputs into `act` (fc2's packed rows, F / 2 pairs).
static void tiled_fc1(const TileWeight& w, const B16* b, const uint32_t* x, int64_t M, int64_t C, int64_t F,
                      int64_t o0, int64_t o1, bool swiglu, uint32_t* act) {
  const int64_t J = C / 2, FJ = F / 2, blocks = (M + TILE_LANES - 1) / TILE_LANES;
  B16* room = w.q || w.q4 ? tile_room(8 * C) : nullptr;
  auto run = [&](auto n_c) {
    constexpr int N = decltype(n_c)::value;  // 8 (4 gate, 4 up) or 4
    for (int64_t o = o0; o < o1; o += 4) {
      const B16* wr[N];
      int64_t rows[N];
      for (int q = 0; q < 4; ++q) {
        wr[q] = w.row(rows[q] = o + q, q, room);
        if constexpr (N == 8) wr[4 + q] = w.row(rows[4 + q] = F + o + q, 4 + q, room);
      }
      for_block_groups(blocks, [&](int64_t rb, auto r_c) {
          constexpr int R = decltype(r_c)::value;
          alignas(64) float sums[R][N][TILE_LANES];
          tile_total<R, N>(w, rows, x + rb * J * TILE_LANES, wr, J, sums);
          for (int r = 0; r < R; ++r) {
            __m512 a[4];
            for (int q = 0; q < 4; ++q) {
              const float bg = b ? static_cast<float>(b[o + q]) : 0.0f;
              const __m512 g = vrounded<B16>(_mm512_add_ps(  // as int8_linear: the sum times the scale, then the bias
                  _mm512_mul_ps(_mm512_load_ps(sums[r][q]), _mm512_set1_ps(w.scale_of(o + q))), _mm512_set1_ps(bg)));
              if constexpr (N == 8) {  // F.silu(gate) * up, each rounded as F.linear, F.silu and the product round
                const float bu = b ? static_cast<float>(b[F + o + q]) : 0.0f;
                const __m512 u = vrounded<B16>(_mm512_add_ps(
                    _mm512_mul_ps(_mm512_load_ps(sums[r][4 + q]), _mm512_set1_ps(w.scale_of(F + o + q))),
                    _mm512_set1_ps(bu)));
                a[q] = _mm512_mul_ps(vrounded<B16>(vsilu(g)), u);
              } else {
                alignas(64) float f[16];
                _mm512_store_ps(f, g);
                for (float& v : f) v = gelu(v);
                a[q] = _mm512_load_ps(f);
              }
            }
            uint32_t* out = act + ((rb + r) * FJ + o / 2) * TILE_LANES;
            _mm512_storeu_si512(out, pair_of(a[0], a[1]));
            _mm512_storeu_si512(out + TILE_LANES, pair_of(a[2], a[3]));
          }
        });
    }
  };
  if (swiglu)
    run(std::integral_constant<int, 8>{});
  else
    run(std::integral_constant<int, 4>{});
}

// fc2 of a tiled expert: outputs [o0, o1) of its M rows (their activation packed as pairs at act) into y ([M, C]),
// with the bias b, each rounded once
static void tiled_fc2(const TileWeight& w, const B16* b, const uint32_t* act, int64_t M, int64_t C, int64_t F,
                      int64_t o0, int64_t o1, B16* y) {
  const int64_t J = F / 2, blocks = (M + TILE_LANES - 1) / TILE_LANES;
  B16* room = w.q || w.q4 ? tile_room(TILE_OUTS * F) : nullptr;
  uint16_t* yb = reinterpret_cast<uint16_t*>(y);
  for (int64_t o = o0; o < o1; o += TILE_OUTS) {
    const int nv = static_cast<int>(std::min<int64_t>(TILE_OUTS, o1 - o));
    const B16* wr[TILE_OUTS];
    int64_t rows[TILE_OUTS];
    float bo[TILE_OUTS], so[TILE_OUTS];
    for (int n = 0; n < TILE_OUTS; ++n) {  // past the last output: its row again, the sums left unused
      rows[n] = o + std::min(n, nv - 1);
      wr[n] = n < nv ? w.row(rows[n], n, room) : wr[nv - 1];
      bo[n] = b && n < nv ? static_cast<float>(b[o + n]) : 0.0f;
      so[n] = w.scale_of(o + std::min(n, nv - 1));
    }
    for_block_groups(blocks, [&](int64_t rb, auto r_c) {
        constexpr int R = decltype(r_c)::value;
        alignas(64) float sums[R][TILE_OUTS][TILE_LANES];
        tile_total<R, TILE_OUTS>(w, rows, act + rb * J * TILE_LANES, wr, J, sums);
        for (int r = 0; r < R; ++r) {
          __m256i v[TILE_OUTS];
          for (int n = 0; n < TILE_OUTS; ++n)
            v[n] = (__m256i)_mm512_cvtneps_pbh(
                _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(sums[r][n]), _mm512_set1_ps(so[n])), _mm512_set1_ps(bo[n])));
          const int64_t row0 = (rb + r) * TILE_LANES;
          store_rows8(v, yb + row0 * C + o, C, std::min<int64_t>(TILE_LANES, M - row0), nv);
        }
      });
  }
}
#endif

#if !defined(__AVX512BF16__)

// Weight row o (bf16 w, int8 q or int4 q4 as int4_linear packs it: their scales applied to the sums) widened to
// fp32 into dst (K floats)
static inline void widen_row(const B16* w, const int8_t* q, int64_t o, int64_t K, float* dst,
                             const uint8_t* q4 = nullptr) {
  int64_t k = 0;
  if (q4) {  // 64 inputs in 32 bytes (`vnibbles`: input j in byte j's low nibble, 32 + j in its high one)
    const uint8_t* src = q4 + o * (K / 2);
    for (; k < K; k += 64)
      for (int j = 0; j < 32; j += VW) {
        vf lo, hi;
        vnibbles(src + k / 2 + j, lo, hi);
        vstore(dst + k + j, lo);
        vstore(dst + k + 32 + j, hi);
      }
    return;
  }
  if (q) {
    for (; k + VW <= K; k += VW) vstore(dst + k, vload(q + o * K + k));
    for (; k < K; ++k) dst[k] = static_cast<float>(q[o * K + k]);
  } else {
    for (; k + VW <= K; k += VW) vstore(dst + k, vload(w + o * K + k));
    for (; k < K; ++k) dst[k] = static_cast<float>(w[o * K + k]);
  }
}

// A thread's room for n floats (a tile's weight rows widened), kept between calls
static float* f32_room(size_t n) {
  thread_local std::vector<float> room;
  if (room.size() < n) room.resize(n);
  return room.data();
}

// sums[r][n] over all K inputs of an fp32 tile (w: its N rows widened, [N][K]): one pass, or with int4 (scale
// [O, K / group]) a pass a group, each group's sums times its row's scale added in fp32 as int4_linear adds them;
// `rows[n]`: the weight row of tile row n
template <int R, int N>
static void tile_total_f32(const float* x, const float* w, int64_t K, const float* scale4, int64_t group,
                           const int64_t (&rows)[N], float (*sums)[N][VW]) {
  if (!scale4) return tile_sums_f32<R, N>(x, w, K, 0, K, sums);
  const int64_t G = K / group;
  alignas(64) float part[R][N][VW];
  for (int64_t g = 0; g < G; ++g) {
    tile_sums_f32<R, N>(x, w, K, g * group, (g + 1) * group, part);
    for (int n = 0; n < N; ++n) {
      const vf sg = vset(scale4[rows[n] * G + g]);
      for (int r = 0; r < R; ++r) vstore(sums[r][n], g ? vfma(vload(part[r][n]), sg, vload(sums[r][n])) : vmul(vload(part[r][n]), sg));
    }
  }
}

// fc1 of a tiled expert (M rows, packed by pack_rows_f32 at x) for its outputs [o0, o1): G gate rows (and G up rows,
// swiglu) a tile, widened into L1 once for all its row blocks; with the bias b (and int8's row scales), the
// activation rounded as expert_mlps_typed's passes round it, written into `act` (fc2's packed rows: F inputs).
static void tiled_fc1_f32(const B16* w, const int8_t* q, const float* scale, const B16* b, const float* x, int64_t M,
                          int64_t C, int64_t F, int64_t o0, int64_t o1, bool swiglu, float* act,
                          const uint8_t* q4 = nullptr, int64_t group = 0) {
  constexpr int N = TILE_F32_OUTS;
  const int G = swiglu ? N / 2 : N;
  const int64_t blocks = (M + VW - 1) / VW;
  float* room = f32_room(N * C);
  auto sc = [&](int64_t o) { return q ? scale[o] : 1.0f; };
  for (int64_t o = o0; o < o1; o += G) {
    const int gv = static_cast<int>(std::min<int64_t>(G, o1 - o));
    int64_t rows[N] = {};
    for (int i = 0; i < G; ++i) {  // past the last output: its rows again, the sums left unused
      widen_row(w, q, rows[i] = o + std::min(i, gv - 1), C, room + i * C, q4);
      if (swiglu) widen_row(w, q, rows[G + i] = F + o + std::min(i, gv - 1), C, room + (G + i) * C, q4);
    }
    for_block_groups_f32(blocks, [&](int64_t rb, auto r_c) {
      constexpr int R = decltype(r_c)::value;
      alignas(64) float sums[R][N][VW];
      tile_total_f32<R, N>(x + rb * C * VW, room, C, q4 ? scale : nullptr, group, rows, sums);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < gv; ++i) {  // as int8_linear: the sum times the scale, then the bias; rounded as F.linear
          const vf g = vrounded<B16>(vmul(vload(sums[r][i]), vset(sc(o + i))) + vset(b ? float(b[o + i]) : 0.0f));
          vf a;
          if (swiglu) {
            const vf u = vrounded<B16>(vmul(vload(sums[r][G + i]), vset(sc(F + o + i))) +
                                       vset(b ? float(b[F + o + i]) : 0.0f));
            a = vrounded<B16>(vmul(vrounded<B16>(vsilu(g)), u));
          } else {
            alignas(64) float f[VW];
            vstore(f, g);
            for (float& v : f) v = static_cast<float>(static_cast<B16>(gelu(v)));
            a = vload(f);
          }
          vstore(act + ((rb + r) * F + o + i) * VW, a);
        }
    });
  }
}

// fc2 of a tiled expert: outputs [o0, o1) of its M rows (their activation packed at act) into y ([M, C]), with the
// bias b (and int8's row scales), each rounded once
static void tiled_fc2_f32(const B16* w, const int8_t* q, const float* scale, const B16* b, const float* act,
                          int64_t M, int64_t C, int64_t F, int64_t o0, int64_t o1, B16* y, const uint8_t* q4 = nullptr,
                          int64_t group = 0) {
  constexpr int N = TILE_F32_OUTS;
  const int64_t blocks = (M + VW - 1) / VW;
  float* room = f32_room(N * F);
  for (int64_t o = o0; o < o1; o += N) {
    const int nv = static_cast<int>(std::min<int64_t>(N, o1 - o));
    int64_t rows[N];
    for (int n = 0; n < N; ++n) widen_row(w, q, rows[n] = o + std::min(n, nv - 1), F, room + n * F, q4);
    for_block_groups_f32(blocks, [&](int64_t rb, auto r_c) {
      constexpr int R = decltype(r_c)::value;
      alignas(64) float sums[R][N][VW];
      tile_total_f32<R, N>(act + rb * F * VW, room, F, q4 ? scale : nullptr, group, rows, sums);
      for (int r = 0; r < R; ++r) {
        const int64_t row0 = (rb + r) * VW, rows = std::min<int64_t>(VW, M - row0);
        for (int n = 0; n < nv; ++n) {
          const float s = q ? scale[o + n] : 1.0f, bo = b ? static_cast<float>(b[o + n]) : 0.0f;
          for (int64_t l = 0; l < rows; ++l) {
            const float v = sums[r][n][l] * s;
            y[(row0 + l) * C + o + n] = static_cast<B16>(b ? v + bo : v);
          }
        }
      }
    });
  }
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
  // Tiles (tiles.h) for bf16 experts (int8 too) where AMX does not take them: VDPBF16PS on an AVX512_BF16 build,
  // fp32 FMAs on the others; the experts of TILE_MIN_ROWS rows or more, their rows packed for fc1 (`xpairs`: pairs of
  // 16 rows, or VW rows widened) and their activation written so for fc2 (`apairs`); `tblock[e]` their first block
  // (-1: not tiled)
  std::vector<int64_t> tblock(E + 1, -1);
  int64_t tblocks = 0;
#if defined(__AVX512BF16__)
  constexpr int64_t lanes = TILE_LANES;  // rows a block
  const bool tiles = C % 2 == 0 && F % 4 == 0;  // pairs, and fc1's outputs 4 a tile
#else
  constexpr int64_t lanes = VW;
  const bool tiles = C % 2 == 0;
#endif
  auto blocks_of = [&](int64_t e) { return (counts[e] + lanes - 1) / lanes; };
  if constexpr (std::is_same<T, B16>::value) {
    if (tiles)
      for (int64_t e = 0; e < E; ++e)
        if (chunk[e] < 0 && counts[e] >= TILE_MIN_ROWS) tblock[e] = tblocks, tblocks += blocks_of(e);
  }
  // the activation of each row not in tiles, fc2's input (none allocated where every expert is tiled)
  int64_t untiled = 0;
  for (int64_t e = 0; e < E; ++e) untiled += tblock[e] < 0 ? counts[e] : 0;
  at::Tensor act = at::empty({untiled ? start[E] : 0, F}, x.options());
  T* ap = act.data_ptr<T>();
  // kept between calls (grown, never shrunk): a prefill's new 40 MB a layer cost a page fault every 4 KB
  // (bf16 tiles: a word a pair of inputs; fp32 tiles: a word an input)
#if defined(__AVX512BF16__)
  const int64_t xwords = tblocks * lanes * (C / 2), awords = tblocks * lanes * (F / 2);
#else
  const int64_t xwords = tblocks * lanes * C, awords = tblocks * lanes * F;
#endif
  thread_local std::vector<uint32_t> xpairs, apairs;
  if (xpairs.size() < size_t(xwords)) xpairs.resize(xwords);
  if (apairs.size() < size_t(awords)) apairs.resize(awords);
  uint32_t* xq = xpairs.data();
  uint32_t* aq = apairs.data();
  if constexpr (std::is_same<T, B16>::value) {
    if (tblocks)
      at::parallel_for(0, E, 1, [&](int64_t b, int64_t e1) {
        for (int64_t e = b; e < e1; ++e)
          if (tblock[e] >= 0) {
#if defined(__AVX512BF16__)
            pack_pairs(xp + start[e] * C, counts[e], C, C, xq + tblock[e] * 16 * (C / 2));
#else
            pack_rows_f32(xp + start[e] * C, counts[e], C, C, reinterpret_cast<float*>(xq) + tblock[e] * VW * C);
#endif
          }
      });
  }
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
#if defined(__AVX512BF16__)
  auto tile_weight = [&](const std::vector<at::Tensor>& W, const std::vector<at::Tensor>& S, int64_t e, int64_t K) {
    if (int8) return TileWeight{nullptr, W[e].data_ptr<int8_t>(), S[e].data_ptr<float>(), K};
    if (int4) return TileWeight{nullptr, nullptr, S[e].data_ptr<float>(), K, W[e].data_ptr<uint8_t>(), K / S[e].size(1)};
    return TileWeight{reinterpret_cast<const B16*>(W[e].data_ptr()), nullptr, nullptr, K};
  };
#endif
  // a task's cost: its weight rows times the passes over them (a tiled expert's block of rows as two passes)
  auto cost = [&](int64_t e, int64_t n) { return n * (tblock[e] >= 0 ? 2 * blocks_of(e) : passes(counts[e])); };
  std::vector<Task> tasks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < F && counts[e]; o += BLOCK)
      tasks.push_back({e, o, std::min(F, o + BLOCK), cost(e, std::min(F, o + BLOCK) - o)});
  pack(xp, C);
  // fc1 and the activation: gate rows [o0, o1) and up rows F + [o0, o1) (swiglu), into act[:, o0:o1]
  run_tasks(tasks, (swiglu ? 2 : 1) * C * int64_t(sizeof(T)), [&](const Task& t) {
    const T* w = s1.empty() ? w1[t.expert].data_ptr<T>() : nullptr;
    const T* b = bias ? b1[t.expert].data_ptr<T>() : nullptr;
    const int64_t n = t.o1 - t.o0;
    if constexpr (std::is_same<T, B16>::value) {
      if (tblock[t.expert] >= 0) {
#if defined(__AVX512BF16__)
        return tiled_fc1(tile_weight(w1, s1, t.expert, C), b, xq + tblock[t.expert] * 16 * (C / 2), counts[t.expert], C,
                         F, t.o0, t.o1, swiglu, aq + tblock[t.expert] * 16 * (F / 2));
#else
        return tiled_fc1_f32(w, int8 ? w1[t.expert].data_ptr<int8_t>() : nullptr,
                             int8 || int4 ? s1[t.expert].data_ptr<float>() : nullptr, b,
                             reinterpret_cast<const float*>(xq) + tblock[t.expert] * VW * C, counts[t.expert], C, F,
                             t.o0, t.o1, swiglu, reinterpret_cast<float*>(aq) + tblock[t.expert] * VW * F,
                             int4 ? w1[t.expert].data_ptr<uint8_t>() : nullptr, int4 ? C / s1[t.expert].size(1) : 0);
#endif
      }
    }
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
    alignas(64) T g[MAX_ROWS * BLOCK], u[MAX_ROWS * BLOCK];
    float* scratch = thread_scratch(MAX_ROWS * C);
    for (int64_t r = start[t.expert]; r < start[t.expert + 1]; r += MAX_ROWS) {
      const int64_t M = std::min(MAX_ROWS, start[t.expert + 1] - r);
      fc(w1, s1, t.expert, t.o0, xp + r * C, b ? b + t.o0 : nullptr, g, M, C, BLOCK, n, scratch);
      if (swiglu)
        fc(w1, s1, t.expert, F + t.o0, xp + r * C, b ? b + F + t.o0 : nullptr, u, M, C, BLOCK, n, scratch);
      for (int64_t m = 0; m < M; ++m) {
        T* out = ap + (r + m) * F + t.o0;
        const T* gm = g + m * BLOCK;
        int64_t o = 0;
        if (swiglu)  // as F.silu(gate) * up in this dtype: silu rounded, then the product rounded; VW at a time
          for (; o + VW <= n; o += VW) vstore(out + o, vmul(vrounded<T>(vsilu(vload(gm + o))), vload(u + m * BLOCK + o)));
        for (; o < n; ++o)
          out[o] = swiglu ? static_cast<T>(static_cast<float>(static_cast<T>(silu(static_cast<float>(gm[o])))) *
                                           static_cast<float>(u[m * BLOCK + o]))
                          : static_cast<T>(gelu(static_cast<float>(gm[o])));
      }
    }
  });
  tasks.clear();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < C && counts[e]; o += BLOCK)
      tasks.push_back({e, o, std::min(C, o + BLOCK), cost(e, std::min(C, o + BLOCK) - o)});
  pack(ap, F);
  // fc2: output columns [o0, o1) of each of the expert's rows
  run_tasks(tasks, F * int64_t(sizeof(T)), [&](const Task& t) {
    const T* w = s1.empty() ? w2[t.expert].data_ptr<T>() : nullptr;
    const T* b = bias ? b2[t.expert].data_ptr<T>() : nullptr;
    if constexpr (std::is_same<T, B16>::value) {
      if (tblock[t.expert] >= 0) {
#if defined(__AVX512BF16__)
        return tiled_fc2(tile_weight(w2, s2, t.expert, F), b, aq + tblock[t.expert] * 16 * (F / 2), counts[t.expert],
                         C, F, t.o0, t.o1, yp + start[t.expert] * C);
#else
        return tiled_fc2_f32(w, int8 ? w2[t.expert].data_ptr<int8_t>() : nullptr,
                             int8 || int4 ? s2[t.expert].data_ptr<float>() : nullptr, b,
                             reinterpret_cast<const float*>(aq) + tblock[t.expert] * VW * F, counts[t.expert], C, F,
                             t.o0, t.o1, yp + start[t.expert] * C, int4 ? w2[t.expert].data_ptr<uint8_t>() : nullptr,
                             int4 ? F / s2[t.expert].size(1) : 0);
#endif
      }
    }
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
    float* scratch = thread_scratch(MAX_ROWS * F);
    for (int64_t r = start[t.expert]; r < start[t.expert + 1]; r += MAX_ROWS) {
      const int64_t M = std::min(MAX_ROWS, start[t.expert + 1] - r);
      fc(w2, s2, t.expert, t.o0, ap + r * F, b ? b + t.o0 : nullptr, yp + r * C + t.o0, M, F, C, t.o1 - t.o0,
         scratch);
    }
  });
}

// The routed experts' MLPs over their rows: x [P, C] holds counts[0] rows of the first listed expert, then counts[1]
// of the second, ...; expert i is w1[i] ([2F, C] swiglu as [gate; up], or [F, C]), b1[i] ([2F] or [F]), then the
// activation (silu(gate) * up, or exact GeLU), then w2[i] ([C, F]), b2[i] ([C]); biases for every expert or none
// (empty lists). y [P, C] in x's order. fp32 or bf16, all alike; rounded to it where F.linear, F.silu and the
// product round. int8 experts (s1, s2 given): w1[i], w2[i] int8 with one fp32 scale per row in s1[i], s2[i]
// (pipeline/quantize.py `quantize_int8`), each fc as int8_linear computes it; biases in x's dtype.
// expert_mlps into `out` ([rows, C] of x's dtype) where given
static at::Tensor expert_mlps_into(const at::Tensor& x, const std::vector<int64_t>& counts,
                                   const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                                   const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2, bool swiglu,
                                   const std::vector<at::Tensor>& s1, const std::vector<at::Tensor>& s2,
                                   const at::Tensor* out) {
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
  at::Tensor y = out ? *out : at::empty({rows, C}, x.options());
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == dt && y.is_contiguous(), "expert_mlps: out as x");
  if (rows == 0) return y;
  if (dt == at::kFloat)
    expert_mlps_typed<float>(x, counts, w1, b1, w2, b2, swiglu, s1, s2, y);
  else
    expert_mlps_typed<c10::BFloat16>(x, counts, w1, b1, w2, b2, swiglu, s1, s2, y);
  return y;
}

at::Tensor expert_mlps(const at::Tensor& x, const std::vector<int64_t>& counts, const std::vector<at::Tensor>& w1,
                          const std::vector<at::Tensor>& b1, const std::vector<at::Tensor>& w2,
                          const std::vector<at::Tensor>& b2, bool swiglu, const std::vector<at::Tensor>& s1,
                          const std::vector<at::Tensor>& s2) {
  return expert_mlps_into(x, counts, w1, b1, w2, b2, swiglu, s1, s2, nullptr);
}

// A [rows, cols] tensor of `options` in room kept by this thread between calls (slot 0 or 1; grown, never shrunk):
// a layer's intermediates, which a prefill of 2048 tokens would otherwise fault in 4 KB at a time (32 MB each)
static at::Tensor kept_room(int slot, int64_t rows, int64_t cols, const at::TensorOptions& options) {
  thread_local at::Tensor room[2];
  at::Tensor& t = room[slot];
  if (!t.defined() || t.numel() < rows * cols || t.scalar_type() != options.dtype().toScalarType())
    t = at::empty({std::max<int64_t>(1, rows * cols)}, options);
  return t.narrow(0, 0, rows * cols).view({rows, cols});
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
    int64_t e = 0;
    for (; e + 4 <= E; e += 4) {  // 4 experts a pass: 4 independent sums, each x load serving 4 rows of wg
      const float *g0 = g + e * C, *g1 = g0 + C, *g2 = g1 + C, *g3 = g2 + C;
      vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
      int64_t c = 0;
      for (; c < Cv; c += VW) {
        const vf xv = vload(xr + c);
        a0 = vfma(vload(g0 + c), xv, a0);
        a1 = vfma(vload(g1 + c), xv, a1);
        a2 = vfma(vload(g2 + c), xv, a2);
        a3 = vfma(vload(g3 + c), xv, a3);
      }
      float d0 = vsum(a0), d1 = vsum(a1), d2 = vsum(a2), d3 = vsum(a3);
      for (; c < C; ++c) d0 += g0[c] * xr[c], d1 += g1[c] * xr[c], d2 += g2[c] * xr[c], d3 += g3[c] * xr[c];
      p[e] = d0, p[e + 1] = d1, p[e + 2] = d2, p[e + 3] = d3;
    }
    for (; e < E; ++e) {
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
  // a token costs E x C multiply-adds (64 x 1024: ~1 us): a decode batch's tokens split between the threads
  at::parallel_for(0, S, 4, [&](int64_t b, int64_t e) {
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
        const vf wv = vset(w);
        int64_t c = 0;
        for (; c + VW <= C; c += VW)  // as y0 * w0, then addcmul_: one rounding per choice
          vstore(o + c, vfma(vload(yr + c), wv, j ? vload(o + c) : vzero()));
        for (; c < C; ++c)
          o[c] = static_cast<T>(std::fma(static_cast<float>(yr[c]), w, j ? static_cast<float>(o[c]) : 0.0f));
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
  at::Tensor rows = kept_room(0, start[A], C, x.options());
  const int64_t bytes = C * x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* rp = static_cast<char*>(rows.data_ptr());
  at::parallel_for(0, S * k, 2048, [&](int64_t b, int64_t e) {  // a prefill's 16384 pairs: 32 MB at hidden 1024
    for (int64_t i = b; i < e; ++i)
      if (pair_row[i] >= 0) std::memcpy(rp + pair_row[i] * bytes, xp + (i / k) * bytes, bytes);
  });
  const at::Tensor y = kept_room(1, start[A], C, x.options());
  return {expert_mlps_into(rows, counts, w1, b1, w2, b2, swiglu, s1, s2, &y), pair_row};
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
