// Linears on quantised weights: weight-only int8 (one scale an output row) and int4 (one scale a group of a row),
// any rows (MAX_ROWS a pass over the weight), and W8A8 (int8 weights, x rounded to int8 a row at a time, VPDPBUSD).
#include "gemv.h"
#include "kernels.h"
#include "vnni.h"

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
// y = x @ (scale * q).T (+ bias) for int8 weights, one scale per output row (pipeline/quantize.py `quantize_int8`):
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
// x [N, I] fp32 or bf16 (MAX_ROWS rows a pass); q uint8 [O, I / 2] and scale fp32 [O, I / group] as gemv.h's int4
// kernels read them (pipeline/quantize.py `pack_int4`); bias [O] of x's dtype or None -> [N, O].
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

#if defined(__AVX512VNNI__)
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
