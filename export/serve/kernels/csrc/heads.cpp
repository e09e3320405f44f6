// The output layer's greedy rows: each row's argmax (`argmax_rows`), and the argmax or top-k candidates read from an
// int8 copy of the layer plus the exact rows its error bound cannot rule out (`screen_argmax`, `screen_topk`, and
// their int8 x int8 forms); a quantised layer's screened the same way (`screen_argmax_i4`, `screen_argmax_i8`).
#include "draws.h"
#include "gemv.h"
#include "kernels.h"
#include "vnni.h"

// -- greedy sampling -------------------------------------------------------------------------------------------
//
// The index of each row's largest value (the first of equal ones, as torch.argmax; in a row with a NaN, the first NaN
// or largest value before it), rows split between the threads: torch's argmax over a decode batch's bf16 logits took
// longer than the step's attention.
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



// -- the greedy head, screened ---------------------------------------------------------------------------------------
//
// The argmax of each row of x @ w.T (the output layer's, as `linear` writes it: one rounding to w's dtype; ties to
// the lowest index, as torch.argmax) from an int8 copy of w (q [O, I], w[o] ~ scale[o] * q[o], half the bytes of
// bf16) and exact arithmetic on a few rows: the int8 pass gives every output's approximate sum y[o]; err[o] bounds
// how far the exact sum can be from it per unit of |x|'s L1 norm (the quantisation's largest error on the row, and
// both sums' fp32 roundings: export/serve/kernels/heads.py `HeadScreen`). Any output whose interval [y - e, y + e]
// reaches the best lower end (with a margin for the rounding to w's dtype, which is monotone) is a candidate, and every
// candidate row is computed again through `linear`'s own kernel for M rows (the same instructions in the same
// order for each output row: the same bits), then compared. The true argmax is always a candidate: what this
// returns is `linear` + argmax's answer, exactly, reading ~half the bytes. Empty where it does not apply (x not
// finite, or candidates past `most` in all: the caller then runs the whole head).


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

// -- sampled rows, screened ----------------------------------------------------------------------------------------
//
// A sampled row's token, the one csrc/sampling.cpp `choose` draws from the whole layer's logits (temperature, min_p,
// top_p, the Gumbel-max draw of csrc/draws.h), from the screen's sums and bounds and the few exact logits they cannot
// do without. Every token's scaled logit a (as the sampler computes it: `linear`'s value times 1 / t) lies in
// [lo, hi]: the screen's bound, widened by the rounding to w's dtype (2^-7 relative, above its 2^-8), then times 1 / t
// (rounding is monotone, so bounds stay bounds). A token is computed exactly (`candidate_logits`: `linear`'s bits),
// after which its lo = hi = a, only where the bounds cannot decide:
//  - the maximum m (min_p's cut, top_p's weights): the tokens whose hi reaches the largest lo;
//  - the draw over the tokens with a >= cut and a > above: the largest lo + g over the tokens surely in is a floor,
//    and only a token maybe in whose hi + g reaches it can be drawn (a few: the largest Gumbel numbers of a row are
//    ~1 apart, the bounds' width a fraction of that);
//  - top_p: the weight exp(a - m) above the drawn token and the kept total, each between the sums over the tokens
//    surely and maybe counted of exp(lo - m) and exp(hi - m); decided where those intervals, widened by 1e-4 for the
//    sampler's own roundings, do not straddle top_p x total (undecided: the 64, then 512 tokens not yet exact whose
//    bounds' weights differ most, computed where they hold half the difference or more, and the test made again);
//    outside, the draw is made again above the token.
// A row they cannot decide (top_p on flat logits: the nucleus's edge then needs nearly every logit) is -1: the caller
// runs the whole head for it and samples it with the same numbers, drawing the token this would have.
namespace {
struct ScreenedDraw {
  int phase = 0;  // 0 the maximum, 1 the draw, 2 top_p's test, 3 drawn, 4 the whole head
  bool edited = false;  // the processors' tokens computed (first, before any bound is trusted)
  float m = 0, cut = -INFINITY, above = -INFINITY;
  int64_t token = -1;
  int redraws = 0, tightened = 0;
};
constexpr int SCREEN_REDRAWS = 2;  // top_p's redraws tried from the bounds; past them, the whole head
constexpr int SCREEN_TIGHTEN = 2;  // top_p undecided: the 64, then 512 heaviest tokens not yet exact, computed
constexpr int SCREEN_STAGES = 8;   // exact computations a call at most (each one `candidate_logits` for every row)
}  // namespace

// A processed logit as export/serve/sampling.py `Edits` makes it: each op rounded to fp32 as numpy rounds it (the
// product is stored before the subtraction: never contracted into one fused multiply-add)
static inline float processed(float v, float bias, float rep, float sub) {
  v = v + bias;
  volatile float scaled = v > 0 ? v / rep : v * rep;
  return scaled - sub;
}

// The tokens of one row that may be the largest a + g over a >= cut, a > above (`known`: computed, skipped), with
// the floor (the largest lo + g of the tokens surely in) -> best.
static void draw_candidates(const float* lo, const float* hi, const float* g, const uint8_t* known, int64_t O,
                            float cut, float above, std::vector<int64_t>& out, float& best) {
  const float over = std::nextafter(above, INFINITY);  // a > above iff a >= over
  constexpr int L = 16;  // lanes: a float reduction the compiler vectorizes (it keeps a single sum's order)
  float lanes[L];
  for (int j = 0; j < L; ++j) lanes[j] = -INFINITY;
  int64_t o = 0;
  for (; o + L <= O; o += L)
    for (int j = 0; j < L; ++j) {
      const float v = lo[o + j] >= cut && lo[o + j] >= over ? lo[o + j] + g[o + j] : -INFINITY;
      lanes[j] = v > lanes[j] ? v : lanes[j];
    }
  float b = -INFINITY;
  for (int j = 0; j < L; ++j) b = std::max(b, lanes[j]);
  for (; o < O; ++o) b = std::max(b, lo[o] >= cut && lo[o] >= over ? lo[o] + g[o] : -INFINITY);
  best = b;
  const vf vb = vset(b), vc = vset(cut), va = vset(over);
  for (o = 0; o + VW <= O; o += VW) {
    const vf h = vload(hi + o);
    for (unsigned bits = vge(h + vload(g + o), vb) & vge(h, vc) & vge(h, va); bits; bits &= bits - 1)
      if (!known[o + __builtin_ctz(bits)]) out.push_back(o + __builtin_ctz(bits));
  }
  for (; o < O; ++o)
    if (hi[o] + g[o] >= b && hi[o] >= cut && hi[o] >= over && !known[o]) out.push_back(o);
}

// top_p's test of a drawn token at a (exact) with maximum m: 1 inside the nucleus, -1 outside, 0 undecided. Also
// each token's gap, the difference of its bounds' kept weights (0 once exact), into gaps [O], their sum and largest
// (what a tightening computes first).
static int nucleus_test(const float* lo, const float* hi, int64_t O, float m, float cut, float a, float top_p,
                        float* gaps, double& gap, float& widest) {
  constexpr int L = 16;  // lanes (vectorized), summed in double a block
  double z_lo = 0, z_hi = 0, h_lo = 0, h_hi = 0;
  float top[L] = {0};
  for (int64_t b = 0; b < O; b += 256) {
    const int64_t e = std::min(O, b + 256);
    float zl[L] = {0}, zh[L] = {0}, hl[L] = {0}, hh[L] = {0};
    int64_t o = b;
    auto one = [&](int64_t i, int j) {  // token i into lane j
      const float l = lo[i], h = hi[i];
      const float wl = draws::exp_clamped(l - m), wh = draws::exp_clamped(h - m);
      const float kl = l >= cut ? wl : 0.0f, kh = h >= cut ? wh : 0.0f;
      zl[j] += kl;
      zh[j] += kh;
      hl[j] += l > a ? wl : 0.0f;
      hh[j] += h > a ? wh : 0.0f;
      gaps[i] = kh - kl;
      top[j] = kh - kl > top[j] ? kh - kl : top[j];
    };
    for (; o + L <= e; o += L)
      for (int j = 0; j < L; ++j) one(o + j, j);
    for (int j = 0; e - o > j; ++j) one(o + j, j);
    for (int j = 0; j < L; ++j) z_lo += zl[j], z_hi += zh[j], h_lo += hl[j], h_hi += hh[j];
  }
  widest = 0;
  for (int j = 0; j < L; ++j) widest = std::max(widest, top[j]);
  gap = z_hi - z_lo;
  const double p = top_p, slack = 1e-4;
  if (h_hi * (1 + slack) < p * z_lo * (1 - slack)) return 1;
  if (h_lo * (1 - slack) > p * z_hi * (1 + slack)) return -1;
  return 0;
}

// The screens' second half for sampled rows (above): temperature, top_p, min_p fp32 [M], seed, counter int64 [M]
// (the draw's hash, as sample_rows takes them); the processors' transforms (export/serve/sampling.py `Edits`): row
// m's tokens ftok[foff[m]:foff[m + 1]] (ascending), each logit v becoming processed(v, bias, rep, sub), computed
// exactly before anything else; `most`: a row's exact logits a stage at most -> tokens [M] int64, -1 where a row
// needs the whole head; or an empty tensor where a logit is NaN.
template <typename RowBound>
static at::Tensor screened_sample(const at::Tensor& x, const at::Tensor& w, const float* y, int64_t O, int64_t most,
                                  RowBound row_bound, const at::Tensor& temperature, const at::Tensor& top_p,
                                  const at::Tensor& min_p, const at::Tensor& seed, const at::Tensor& counter,
                                  const at::Tensor& foff, const at::Tensor& ftok, const at::Tensor& fbias,
                                  const at::Tensor& frep, const at::Tensor& fsub) {
  const int64_t M = x.size(0);
  TORCH_CHECK(foff.scalar_type() == at::kLong && foff.numel() == M + 1 && foff.is_contiguous() &&
                  ftok.scalar_type() == at::kLong && ftok.is_contiguous(),
              "screen_sample: foff int64 [M + 1], ftok int64 [E]");
  for (const at::Tensor* t : {&fbias, &frep, &fsub})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == ftok.numel() && t->is_contiguous(),
                "screen_sample: fbias, frep, fsub fp32 [E]");
  const int64_t *fo = foff.data_ptr<int64_t>(), *ft = ftok.data_ptr<int64_t>();
  const float *fb = fbias.data_ptr<float>(), *fr = frep.data_ptr<float>(), *fs = fsub.data_ptr<float>();
  TORCH_CHECK(fo[0] == 0 && fo[M] == ftok.numel(), "screen_sample: foff runs from 0 to ftok's length");
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = fo[m]; j < fo[m + 1]; ++j)
      TORCH_CHECK(ft[j] >= 0 && ft[j] < O && (j == fo[m] || ft[j] > ft[j - 1]),
                  "screen_sample: each row's edited tokens ascending, in [0, out)");
  for (const at::Tensor* t : {&temperature, &top_p, &min_p})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == M && t->is_contiguous(), "screen_sample: fp32 [M]");
  for (const at::Tensor* t : {&seed, &counter})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == M && t->is_contiguous(), "screen_sample: int64 [M]");
  const float *tp = temperature.data_ptr<float>(), *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  const int64_t *sp = seed.data_ptr<int64_t>(), *cp = counter.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(tp[m] >= draws::GREEDY_BELOW && pp[m] > 0 && pp[m] <= 1 && mp[m] >= 0 && mp[m] <= 1,
                "screen_sample: a sampled row (temperature >= ", draws::GREEDY_BELOW,
                ", 0 < top_p <= 1, min_p in [0, 1])");
  thread_local std::vector<float> room;  // kept between calls: a step's rows' worth
  thread_local std::vector<uint8_t> known;
  room.resize(static_cast<size_t>(4 * M * O));
  known.assign(static_cast<size_t>(M * O), 0);
  // lo, hi, g and top_p's gaps of every row (the workers see this thread's buffers through these pointers)
  float *LO = room.data(), *HI = LO + M * O, *G = HI + M * O, *GAP = G + M * O;
  uint8_t* KN = known.data();
  const float tiny = 1e-30f;
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    alignas(64) float l[VW], h[VW];
    for (int64_t m = r0; m < r1; ++m) {
      const float inv_t = 1.0f / tp[m];
      const auto bound = row_bound(m);
      const vf vt = vset(tiny), vr = vset(0x1p-7f);
      float *lo = LO + m * O, *hi = HI + m * O;
      const vf vi = vset(inv_t);
      for (int64_t o = 0; o < O; o += VW) {
        const int64_t n = std::min<int64_t>(VW, O - o);
        const vf v = vload_n(y + m * O + o, n), e = bound(o, v, n) + vt;
        const vf vl = v - e, vh = v + e;
        const vf sl = vmul(vl - vabs(vl) * vr, vi), sh = vmul(vh + vabs(vh) * vr, vi);  // as the sampler scales
        if (n == VW) {
          vstore(lo + o, sl);
          vstore(hi + o, sh);
        } else {
          vstore(l, sl);
          vstore(h, sh);
          std::copy(l, l + n, lo + o);
          std::copy(h, h + n, hi + o);
        }
      }
      draws::gumbel_row(static_cast<uint64_t>(sp[m]), static_cast<uint64_t>(cp[m]), O, G + m * O);
    }
  });
  std::vector<ScreenedDraw> st(M);
  std::vector<std::vector<int64_t>> need(M);
  // a row's steps until it needs exact logits (need[m] filled) or is decided
  auto advance = [&](int64_t m) {
    ScreenedDraw& d = st[m];
    const float *lo = LO + m * O, *hi = HI + m * O, *g = G + m * O;
    const uint8_t* kn = KN + m * O;
    auto& want = need[m];
    if (!d.edited) {  // the processors' tokens first: their bounds do not hold once edited
      d.edited = true;
      want.assign(ft + fo[m], ft + fo[m + 1]);
      if (static_cast<int64_t>(want.size()) > most) d.phase = 4;
      if (!want.empty()) return;
    }
    while (d.phase < 3) {
      if (d.phase == 0) {
        if (mp[m] <= 0 && pp[m] >= 1) {  // neither needs the maximum
          d.phase = 1;
          continue;
        }
        const float top = draws::row_max(lo, O);
        const vf vtop = vset(top);
        int64_t o = 0;
        for (; o + VW <= O; o += VW)
          for (unsigned bits = vge(vload(hi + o), vtop); bits; bits &= bits - 1)
            if (!kn[o + __builtin_ctz(bits)]) want.push_back(o + __builtin_ctz(bits));
        for (; o < O; ++o)
          if (hi[o] >= top && !kn[o]) want.push_back(o);
        if (!want.empty()) {  // the draw's candidates without a cut too, in the same stage (usually the answer)
          float best;
          draw_candidates(lo, hi, g, kn, O, -INFINITY, -INFINITY, want, best);
          std::sort(want.begin(), want.end());
          want.erase(std::unique(want.begin(), want.end()), want.end());
          if (static_cast<int64_t>(want.size()) > most) d.phase = 4;
          return;
        }
        d.m = top;  // every token that may reach the largest lo is exact: top is the maximum
        if (mp[m] > 0) d.cut = d.m + std::log(mp[m]);
        d.phase = 1;
      } else if (d.phase == 1) {
        float best;
        draw_candidates(lo, hi, g, kn, O, d.cut, d.above, want, best);
        if (static_cast<int64_t>(want.size()) > most) {
          d.phase = 4;
          return;
        }
        if (!want.empty()) return;
        d.token = -1;
        for (int64_t o = 0; o < O && d.token < 0; ++o)  // the first largest: every token that can reach it is exact
          if (kn[o] && lo[o] >= d.cut && lo[o] > d.above && lo[o] + g[o] == best) d.token = o;
        if (d.token < 0) {
          d.phase = 4;
          return;
        }
        d.phase = pp[m] >= 1.0f ? 3 : 2;
      } else {
        float* gaps = GAP + m * O;
        double gap;
        float widest;
        const int verdict = nucleus_test(lo, hi, O, d.m, d.cut, lo[d.token], pp[m], gaps, gap, widest);
        if (verdict > 0) {
          d.phase = 3;
        } else if (verdict < 0 && d.redraws < SCREEN_REDRAWS) {
          ++d.redraws;
          d.above = lo[d.token];
          d.phase = 1;
        } else if (verdict == 0 && d.tightened < SCREEN_TIGHTEN) {
          // the sums' intervals are widest where the weight is: the tokens not yet exact whose bounds' weights differ
          // most, computed, where they hold most of the difference (on flat logits they never do: the whole head)
          const size_t k = static_cast<size_t>(std::min<int64_t>(most, int64_t(64) << (3 * d.tightened)));
          ++d.tightened;
          if (!(static_cast<double>(widest) * k >= 0.5 * gap)) {  // k tokens cannot hold half of it
            d.phase = 4;
            return;
          }
          std::vector<std::pair<float, int64_t>> open;
          const float least = static_cast<float>(0.5 * gap / (4.0 * k));  // below it, k of them hold little
          for (int64_t o = 0; o < O; ++o)
            if (gaps[o] > least && !kn[o]) open.emplace_back(gaps[o], o);
          const size_t kk = std::min(k, open.size());
          if (kk > 0) std::nth_element(open.begin(), open.begin() + (kk - 1), open.end(), std::greater<>());
          double held = 0;
          for (size_t j = 0; j < kk; ++j) held += open[j].first;
          if (kk == 0 || held < 0.5 * gap) {
            d.phase = 4;
            return;
          }
          for (size_t j = 0; j < kk; ++j) want.push_back(open[j].second);
          std::sort(want.begin(), want.end());
          return;
        } else {
          d.phase = 4;
          return;
        }
      }
    }
  };
  for (int stage = 0; stage <= SCREEN_STAGES; ++stage) {
    at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t m = r0; m < r1; ++m)
        if (st[m].phase < 3) advance(m);
    });
    bool any = false;
    for (int64_t m = 0; m < M; ++m) {
      if (st[m].phase == 4) need[m].clear();
      any = any || !need[m].empty();
    }
    if (!any || stage == SCREEN_STAGES) break;
    std::vector<std::vector<float>> vals(M);
    if (!candidate_logits(x, w, need, vals)) return at::empty({0}, x.options().dtype(at::kLong));
    for (int64_t m = 0; m < M; ++m) {
      const float inv_t = 1.0f / tp[m];
      const int64_t *e0 = ft + fo[m], *e1 = ft + fo[m + 1];
      for (size_t j = 0; j < need[m].size(); ++j) {
        const int64_t o = need[m][j];
        float v = vals[m][j];
        const int64_t* at = std::lower_bound(e0, e1, o);
        if (at != e1 && *at == o) v = processed(v, fb[at - ft], fr[at - ft], fs[at - ft]);
        v *= inv_t;  // as the sampler scales it
        LO[m * O + o] = HI[m * O + o] = v == v ? v : -INFINITY;
        KN[m * O + o] = 1;
      }
      need[m].clear();
    }
  }
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  for (int64_t m = 0; m < M; ++m) out.data_ptr<int64_t>()[m] = st[m].phase == 3 ? st[m].token : -1;
  return out;
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

// screen_argmax's pass, then each sampled row's token (`screened_sample`), -1 where it needs the whole head
at::Tensor screen_sample(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q, const at::Tensor& scale,
                         const at::Tensor& err, int64_t most, const at::Tensor& temperature, const at::Tensor& top_p,
                         const at::Tensor& min_p, const at::Tensor& seed, const at::Tensor& counter,
                         const at::Tensor& foff, const at::Tensor& ftok, const at::Tensor& fbias,
                         const at::Tensor& frep, const at::Tensor& fsub) {
  RECORD_FUNCTION("moe_pipeline::screen_sample", std::vector<c10::IValue>({x, q}));
  const at::Tensor none = at::empty({0}, x.options().dtype(at::kLong));
  return screen_pass(x, w, q, scale, err, none, [&](const float* y, auto bound) {
    return screened_sample(x, w, y, w.size(0), most, bound, temperature, top_p, min_p, seed, counter, foff, ftok,
                           fbias, frep, fsub);
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
// past a few rows it is compute-bound (8 rows take more than twice one row's time). Here each row of x is
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
// (above; export/serve/kernels/heads.py `HeadScreen`); `most` as screen_argmax's -> [M] int64, or an empty tensor.
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

// screen_argmax_vnni's pass, then screen_sample's draws.
at::Tensor screen_sample_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                              const at::Tensor& scale, const at::Tensor& err1, const at::Tensor& err2,
                              const at::Tensor& top, const at::Tensor& norm, int64_t most,
                              const at::Tensor& temperature, const at::Tensor& top_p, const at::Tensor& min_p,
                              const at::Tensor& seed, const at::Tensor& counter, const at::Tensor& foff,
                              const at::Tensor& ftok, const at::Tensor& fbias, const at::Tensor& frep,
                              const at::Tensor& fsub) {
  RECORD_FUNCTION("moe_pipeline::screen_sample_vnni", std::vector<c10::IValue>({x, packed}));
  return screen_pass_vnni(x, w, packed, scale, err1, err2, top, norm, at::empty({0}, x.options().dtype(at::kLong)),
                          [&](const float* y, auto bound) {
                            return screened_sample(x, w, y, w.size(0), most, bound, temperature, top_p, min_p, seed,
                                                   counter, foff, ftok, fbias, frep, fsub);
                          });
}

// -- a quantised output layer screened in int4 or int8 x int8 (AVX512_VNNI) -----------------------------------------
//
// Under --quantize-head int4 the greedy head's logits are int4_linear's, whose one-row pass is compute-bound
// (VDPBF16PS: 32 products an instruction, each nibble made bf16 first: it reads int4 slower than int8 is read).
// Here each row of x is rounded to int8 (one scale a row, as screen_argmax_vnni's) and VPDPBUSD adds
// 64 products of the weights' nibbles as they are stored (q + 8, unsigned) by signed bytes of x an instruction: per
// group of 128 inputs (one 64-byte load: the low nibbles are inputs 0-31 and 64-95, the high ones 32-63 and 96-127,
// x permuted to match once a call) sum (q + 8) xq less 8 sum xq (each lane started at its share of that), exact in
// int32, times the group's scale; the row's groups summed, times the row's s. The weights are exact here:
// |exact - y| <= min(top[o] |e|_1, norm[o] |e|_2) for the inputs' rounding e = x - s xq (top = max |w[o]|, norm =
// |w[o]|_2 of the dequantised row), plus both sides' fp32 roundings, at most round[o] (|x|_1 + |e|_1) (the caller's
// bound: export/serve/kernels/heads.py `QuantizedHeadScreen`). The candidates as screen_argmax's; then int4_linear
// itself on the union of their rows: the whole layer's bits. An int8 head (`screen_argmax_i8`) alike, its weights'
// bytes as they are against x + 128.
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
// [O] (each row's sum of q); top, norm, round fp32 [O] (export/serve/kernels/heads.py `QuantizedHeadScreen`) ->
// [M] int64 or an empty tensor.
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
