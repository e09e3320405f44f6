// y = x @ w.T (+ bias) for a few rows of x (batch-1 and small-batch decode), fp32 or bf16, reading the weight once
// at the memory's speed (gemv.h's kernels); and on CPUs with AMX, bf16 rows from 2 to AMX_MAX_ROWS on AMX tiles.
#include "amx.h"
#include "gemv.h"
#include "kernels.h"

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

// -- bf16 linears for 2 to AMX_MAX_ROWS rows on CPUs with AMX (Intel Sapphire Rapids on) -------------------------
//
// VDPBF16PS (gemv.h) does 32 multiply-adds per 64 bytes of weight and row: at 8 rows and more the kernel is
// compute-bound (8 rows read the weight at about 60% of one row's speed), and oneDNN's AMX GEMM read it slower still
// at 8-32 rows. AMX's TDPBF16PS multiplies a 16 x 32 tile of rows by a 32 x 16 tile of
// the weight (8192 multiply-adds) in one instruction, so a weight streamed once serves 32 rows at the memory's
// speed. The weight is kept in a second copy packed for it (`amx_pack`: the tiles one after another in the order
// a thread reads them; it takes the place of oneDNN's packed copy). Each thread takes pairs of 16-output blocks:
// for every 32 rows, 4 accumulator tiles (2 row tiles x 2 output blocks) over the whole input, fp32 sums, the
// bias added in fp32, one rounding to bf16. A row's sums do not depend on how many rows come with it.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands the AMX tile state to a process only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
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
#endif
