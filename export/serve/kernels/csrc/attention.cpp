// A decode token's attention: its q, k, v split into heads (qk-norm, RoPE; `qkv_heads`) and each new token's
// attention over a paged KV pool through its row's block table (`paged_attention`).
#include "kernels.h"
#include "norms.h"
#include "simd.h"

// -- the attention of one new token per row (decode) ---------------------------------------------------------------
//
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

// -- decode attention over a paged KV pool ---------------------------------------------------------------------

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
