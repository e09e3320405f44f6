// Sampling a step's rows on the CPU: temperature, min_p, top_k, top_p and one draw per row, each row in one thread
// with its row in cache, no sort of the vocabulary (export/serve/sampling.py says what each setting means and holds
// the reference in tensor ops; this is its fast path, built into the same extension as the other kernels: kernels.h).
//
// A row of V logits a (divided by its temperature) is read once into a float buffer with its maximum m. min_p keeps
// a >= m + log(min_p); top_k keeps a >= its k-th largest (a size-k heap over the row); both are thresholds on a, so
// applying them in vLLM's order (min_p, then top_k) keeps a >= the larger one. The draw is the Gumbel-max trick
// (csrc/draws.h): the kept token with the largest a + g[t]. top_p is exact rejection (as FlashInfer's sorting-free
// top-p): a token is inside the nucleus iff the weight exp(a - m) of the tokens above it is below top_p x the kept
// total; when the drawn one is outside, so is every token as low, and the draw is made again over the tokens above it
// alone (their own a + g: the largest of them is a draw from them). The same choice, token for token, is what
// csrc/heads.cpp `screen_sample` makes from the output layer's int8 copy and bounds: both are defined here.

#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <queue>
#include <vector>

#include "draws.h"

namespace {

constexpr int L = 16;  // lanes of the loops below (one AVX-512 vector, two AVX2 ones)
constexpr int REDRAWS = 64;  // top_p: draws past the first at most (each from tokens strictly above the last)

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {  // a bf16's bits are a float's top half
  uint16_t h;
  std::memcpy(&h, &v, sizeof h);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// s = x / t (a NaN read as -inf); returns max(s)
template <typename T>
float load_scaled(const T* __restrict x, float* __restrict s, int64_t V, float inv_t) {
  for (int64_t i = 0; i < V; ++i) {
    const float v = widen(x[i]) * inv_t;
    s[i] = v == v ? v : -INFINITY;
  }
  return draws::row_max(s, V);
}

float kth_largest(const float* s, int64_t V, int64_t k, std::vector<float>& scratch) {
  if (k * 8 > V) {  // many: a selection over a copy
    scratch.assign(s, s + V);
    std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
    return scratch[k - 1];
  }
  // few: a min-heap of the k largest so far; almost every value fails the comparison with its top, which is made
  // for a block of 64 at once
  std::priority_queue<float, std::vector<float>, std::greater<float>> heap(std::greater<float>(),
                                                                          std::vector<float>(s, s + k));
  constexpr int64_t B = 64;
  int64_t i = k;
  for (; i < V && i % B; ++i)
    if (s[i] > heap.top()) {
      heap.pop();
      heap.push(s[i]);
    }
  for (; i + B <= V; i += B) {
    const float top = heap.top();
    int above = 0;
    for (int64_t j = i; j < i + B; ++j) above |= s[j] > top;  // one vector compare a 16 values
    if (!above) continue;
    for (int64_t j = i; j < i + B; ++j)
      if (s[j] > heap.top()) {
        heap.pop();
        heap.push(s[j]);
      }
  }
  for (; i < V; ++i)
    if (s[i] > heap.top()) {
      heap.pop();
      heap.push(s[i]);
    }
  return heap.top();
}

// The drawn token: the first largest s + g over the tokens with s >= cut and s > above (some must be)
int64_t pick(const float* __restrict s, const float* __restrict g, int64_t V, float cut, float above) {
  float lanes[L];
  for (int j = 0; j < L; ++j) lanes[j] = -INFINITY;
  const int64_t Vv = V / L * L;
  for (int64_t i = 0; i < Vv; i += L)
    for (int j = 0; j < L; ++j) {
      const float v = s[i + j] >= cut && s[i + j] > above ? s[i + j] + g[i + j] : -INFINITY;
      lanes[j] = v > lanes[j] ? v : lanes[j];
    }
  float best = -INFINITY;
  for (int j = 0; j < L; ++j) best = std::max(best, lanes[j]);
  for (int64_t i = Vv; i < V; ++i)
    if (s[i] >= cut && s[i] > above) best = std::max(best, s[i] + g[i]);
  for (int64_t i = 0; i < V; ++i)
    if (s[i] >= cut && s[i] > above && s[i] + g[i] == best) return i;
  return -1;
}

// sum of w over the tokens with s > above (w = 0 where cut)
double heavier(const float* s, const float* w, int64_t V, float above) {
  double total = 0;
  for (int64_t b = 0; b < V; b += 256) {  // float lanes a block, summed in double
    const int64_t e = std::min(V, b + 256);
    float lanes[L] = {0};
    int64_t i = b;
    for (; i + L <= e; i += L)
      for (int j = 0; j < L; ++j) lanes[j] += s[i + j] > above ? w[i + j] : 0.0f;
    double acc = 0;
    for (int j = 0; j < L; ++j) acc += lanes[j];
    for (; i < e; ++i) acc += s[i] > above ? w[i] : 0.0f;
    total += acc;
  }
  return total;
}

// csrc/draws.h's choice on a row's scaled logits s [V] (edited, masked: -inf where a token may not be drawn) with
// max m > -inf: the kept tokens' Gumbel-max, then top_p's redraws. g: the row's Gumbel numbers; w: room for V floats.
int64_t choose(const float* s, const float* g, float* w, int64_t V, float m, float cut, float top_p) {
  int64_t token = pick(s, g, V, cut, -INFINITY);
  if (top_p >= 1.0f || token < 0) return token;
  for (int64_t i = 0; i < V; ++i) w[i] = s[i] >= cut ? draws::exp_clamped(s[i] - m) : 0.0f;
  const double total = heavier(s, w, V, -INFINITY);
  for (int redraw = 0; redraw < REDRAWS; ++redraw) {
    if (heavier(s, w, V, s[token]) < static_cast<double>(top_p) * total) return token;
    const int64_t next = pick(s, g, V, cut, s[token]);
    if (next < 0) return token;  // rounding: nothing above
    token = next;
  }
  return token;
}

struct Edits {  // a row's processed logits (sampling.py `_edits`: bias, a banned token, penalties) and allowed tokens
  const int64_t* tokens = nullptr;
  const float* values = nullptr;
  int64_t count = 0;
  const int32_t* allowed = nullptr;  // a bitmask, bit t of word t / 32 set where token t may be sampled; or none
};

struct Room {  // a thread's buffers for one row at a time
  std::vector<float> s, g, w, scratch;
  explicit Room(int64_t V) : s(V), g(V), w(V) {}
};

template <typename T>
int64_t sample_row(const T* x, int64_t V, float temperature, int64_t top_k, float top_p, float min_p, uint64_t seed,
                   uint64_t counter, const Edits& edits, Room& room) {
  const bool greedy = temperature < draws::GREEDY_BELOW;
  const float inv_t = greedy ? 1.0f : 1.0f / temperature;
  float* s = room.s.data();
  float m = load_scaled<T>(x, s, V, inv_t);
  if (edits.count || edits.allowed) {
    for (int64_t e = 0; e < edits.count; ++e) {
      const float v = edits.values[e] * inv_t;
      s[edits.tokens[e]] = v == v ? v : -INFINITY;
    }
    if (edits.allowed)
      for (int64_t i = 0; i < V; ++i)
        if (!((static_cast<uint32_t>(edits.allowed[i >> 5]) >> (i & 31)) & 1u)) s[i] = -INFINITY;
    m = draws::row_max(s, V);
  }
  if (greedy || m == -INFINITY) {  // the first largest (torch.argmax's); every token banned: token 0
    for (int64_t i = 0; i < V; ++i)
      if (s[i] == m) return i;
    return 0;
  }
  float cut = -INFINITY;
  if (min_p > 0) cut = m + std::log(min_p);
  if (top_k > 0 && top_k < V) cut = std::max(cut, kth_largest(s, V, top_k, room.scratch));
  int64_t kept = V;
  if (cut > -INFINITY) {
    kept = 0;
    for (int64_t i = 0; i < V; ++i) kept += s[i] >= cut;
  }
  if (kept * 16 < V) {  // few kept (top_k, min_p): their numbers alone (pick reads no other)
    const uint64_t key = draws::row_key(seed, counter);
    float* g = room.g.data();
    for (int64_t i = 0; i < V; ++i)
      if (s[i] >= cut) g[i] = draws::gumbel(key, i);
  } else {
    draws::gumbel_row(seed, counter, V, room.g.data());
  }
  const int64_t token = choose(s, room.g.data(), room.w.data(), V, m, cut, top_p);
  return token < 0 ? 0 : token;
}

}  // namespace

// logits [R, V] contiguous fp32 or bf16; rows [n] int64 (which rows to sample); per sampled row: temperature,
// top_p, min_p [n] fp32, top_k [n] int64 (<= 0: off), seed and counter [n] int64 (the draw's hash); the rows' edited
// logits: row j's are tokens[offsets[j]:offsets[j + 1]] (int64) set to values (fp32) before anything else;
// allowed [n, ceil(V / 32)] int32 bitmasks or an empty tensor (every token allowed) -> tokens [n]
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                       const at::Tensor& seed, const at::Tensor& counter, const at::Tensor& offsets,
                       const at::Tensor& tokens, const at::Tensor& values, const at::Tensor& allowed) {
  RECORD_FUNCTION("moe_pipeline::sample_rows", std::vector<c10::IValue>({logits}));
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.is_contiguous() && logits.device().is_cpu(),
              "sample_rows: logits [rows, V], contiguous on the CPU");
  const int64_t n = rows.numel(), V = logits.size(1), R = logits.size(0);
  for (const at::Tensor* t : {&rows, &top_k, &seed, &counter})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == n && t->is_contiguous(), "sample_rows: int64 [n]");
  for (const at::Tensor* t : {&temperature, &top_p, &min_p})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == n && t->is_contiguous(), "sample_rows: fp32 [n]");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.numel() == n + 1 && offsets.is_contiguous() &&
                  tokens.scalar_type() == at::kLong && values.scalar_type() == at::kFloat &&
                  tokens.numel() == values.numel() && tokens.is_contiguous() && values.is_contiguous(),
              "sample_rows: offsets [n + 1] int64, tokens [E] int64, values [E] fp32");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* et = tokens.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[n] == tokens.numel(), "sample_rows: offsets from 0 to the edits' count");
  for (int64_t e = 0; e < tokens.numel(); ++e) TORCH_CHECK(et[e] >= 0 && et[e] < V, "sample_rows: edited token ", et[e]);
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(off[j] <= off[j + 1], "sample_rows: offsets must not decrease");
  const int64_t W = (V + 31) / 32;
  const bool masked = allowed.numel() > 0;
  if (masked)
    TORCH_CHECK(allowed.scalar_type() == at::kInt && allowed.dim() == 2 && allowed.size(0) == n &&
                    allowed.size(1) == W && allowed.is_contiguous(),
                "sample_rows: allowed [n, ceil(V / 32)] int32 bitmasks");
  const float* ev = values.data_ptr<float>();
  const int32_t* ap = masked ? allowed.data_ptr<int32_t>() : nullptr;
  auto edits_of = [&](int64_t j) {
    return Edits{et + off[j], ev + off[j], off[j + 1] - off[j], ap ? ap + j * W : nullptr};
  };
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(rp[j] >= 0 && rp[j] < R, "sample_rows: row ", rp[j], " out of range");
  at::Tensor out = at::empty({n}, rows.options());
  int64_t* op = out.data_ptr<int64_t>();
  const float *tp = temperature.data_ptr<float>(), *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  const int64_t *kp = top_k.data_ptr<int64_t>(), *sp = seed.data_ptr<int64_t>(), *cp = counter.data_ptr<int64_t>();
  AT_DISPATCH_SWITCH(logits.scalar_type(), "sample_rows", AT_DISPATCH_CASE(at::kFloat, [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      Room room(V);
      for (int64_t j = b; j < e; ++j)
        op[j] = sample_row<scalar_t>(base + rp[j] * V, V, tp[j], kp[j], pp[j], mp[j], static_cast<uint64_t>(sp[j]),
                                     static_cast<uint64_t>(cp[j]), edits_of(j), room);
    });
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      Room room(V);
      for (int64_t j = b; j < e; ++j)
        op[j] = sample_row<scalar_t>(base + rp[j] * V, V, tp[j], kp[j], pp[j], mp[j], static_cast<uint64_t>(sp[j]),
                                     static_cast<uint64_t>(cp[j]), edits_of(j), room);
    });
  }));
  return out;
}

// seed, counter [n] int64 -> the draws' Gumbel numbers [n, V] fp32 (csrc/draws.h `gumbel_row`; tests hold
// export/serve/sampling.py `gumbel_noise` to it)
at::Tensor gumbel_rows(const at::Tensor& seed, const at::Tensor& counter, int64_t V) {
  TORCH_CHECK(seed.scalar_type() == at::kLong && counter.scalar_type() == at::kLong &&
                  seed.numel() == counter.numel() && seed.is_contiguous() && counter.is_contiguous() && V > 0,
              "gumbel_rows: seed, counter int64 [n], V > 0");
  const int64_t n = seed.numel();
  at::Tensor out = at::empty({n, V}, seed.options().dtype(at::kFloat));
  const int64_t *sp = seed.data_ptr<int64_t>(), *cp = counter.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j)
      draws::gumbel_row(static_cast<uint64_t>(sp[j]), static_cast<uint64_t>(cp[j]), V, op + j * V);
  });
  return out;
}
