// Sampling a step's rows on the CPU: temperature, min_p, top_k, top_p and one draw per row, each row in one thread
// with its row in cache, no sort of the vocabulary (export/serve/sampling.py says what each setting means and holds
// the reference in tensor ops; this is its fast path, built into the same extension as the other kernels: kernels.h).
//
// A row of V logits s (divided by its temperature) is read once into a float buffer with its maximum m. min_p keeps
// s >= m + log(min_p); top_k keeps s >= its k-th largest (a size-k heap over the row); both are thresholds on s, so
// applying them in vLLM's order (min_p, then top_k) keeps s >= the larger one. The kept tokens get weights
// w = exp(s - m), summed per block of BLOCK tokens. A draw is the inverse CDF at u x the total: a walk over the block
// sums, then inside one block. top_p is exact rejection (FlashInfer's sorting-free top-p): a token is inside the
// nucleus iff the weight of the tokens heavier than it is below top_p x the total; when the draw is outside, so is
// every token as light, and the next draw is from the tokens heavier than it alone. u is splitmix64 of (the request's
// seed, the tokens it sampled before, the attempt): the draw depends on the row alone, never on its batch.

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

namespace {

constexpr float GREEDY_BELOW = 1e-5f;  // export/serve/request.py GREEDY_BELOW
constexpr int64_t BLOCK = 256;         // tokens a block sum covers: the draw walks V / BLOCK sums, then one block
constexpr int L = 16;                  // lanes of the loops below (one AVX-512 vector, two AVX2 ones)

uint64_t splitmix(uint64_t seed, uint64_t counter, uint64_t attempt) {  // as sampling.py `uniforms`
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + counter * 0xD1B54A32D192ED03ull + attempt * 0x8CB92BA72F3D8DD7ull +
               0x632BE59BD9B4E019ull;  // so that (0, 0, 0) does not hash to 0
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double uniform(uint64_t seed, uint64_t counter, uint64_t attempt) {
  return static_cast<double>(splitmix(seed, counter, attempt) >> 11) * 0x1.0p-53;
}

// exp(x) for x <= 0 (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n from the exponent bits), relative
// error ~1e-7, in plain arithmetic the compiler vectorizes; 0 below -87 (and for -inf: a masked token weighs nothing).
inline float exp_neg(float x0) {
  const float keep = static_cast<float>(x0 >= -87.0f);  // 0 or 1: arithmetic, not a branch (vectorized)
  const float x = std::max(x0, -87.0f);
  const float magic = 12582912.0f;  // 1.5 x 2^23: adding and subtracting it rounds to the nearest integer
  const float n = (x * 1.44269504088896341f + magic) - magic;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale * keep;
}

float row_max(const float* s, int64_t V) {
  float lanes[L];
  for (int j = 0; j < L; ++j) lanes[j] = -INFINITY;
  const int64_t Vv = V / L * L;
  for (int64_t i = 0; i < Vv; i += L)
    for (int j = 0; j < L; ++j) lanes[j] = s[i + j] > lanes[j] ? s[i + j] : lanes[j];
  float m = -INFINITY;
  for (int j = 0; j < L; ++j) m = std::max(m, lanes[j]);
  for (int64_t i = Vv; i < V; ++i) m = std::max(m, s[i]);
  return m;
}

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
  return row_max(s, V);
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

// w = s >= cut ? exp(s - m) : 0 over [0, V) in place; the block sums of w; returns the total. Sums in L lanes (a
// float sum in one accumulator is not vectorized: the compiler keeps its order).
double weigh(float* s, int64_t V, float m, float cut, std::vector<double>& blocks) {
  double total = 0;
  for (int64_t b = 0, nb = (V + BLOCK - 1) / BLOCK; b < nb; ++b) {
    const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK), hv = lo + (hi - lo) / L * L;
    float lanes[L] = {0};
    for (int64_t i = lo; i < hv; i += L)
      for (int j = 0; j < L; ++j) {
        const float v = s[i + j];
        const float w = exp_neg(v - m) * static_cast<float>(v >= cut);
        s[i + j] = w;
        lanes[j] += w;
      }
    double acc = 0;
    for (int j = 0; j < L; ++j) acc += lanes[j];
    for (int64_t i = hv; i < hi; ++i) {
      const float w = s[i] >= cut ? exp_neg(s[i] - m) : 0.0f;
      s[i] = w;
      acc += w;
    }
    blocks[b] = acc;
    total += acc;
  }
  return total;
}

// the block sums of w restricted to w > floor; returns the total
double reweigh(const float* w, int64_t V, float floor, std::vector<double>& blocks) {
  double total = 0;
  for (int64_t b = 0, nb = (V + BLOCK - 1) / BLOCK; b < nb; ++b) {
    const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK), hv = lo + (hi - lo) / L * L;
    float lanes[L] = {0};
    for (int64_t i = lo; i < hv; i += L)
      for (int j = 0; j < L; ++j) lanes[j] += w[i + j] > floor ? w[i + j] : 0.0f;
    double acc = 0;
    for (int j = 0; j < L; ++j) acc += lanes[j];
    for (int64_t i = hv; i < hi; ++i) acc += w[i] > floor ? w[i] : 0.0f;
    blocks[b] = acc;
    total += acc;
  }
  return total;
}

// the token at u x total of the weights w > floor (the last such token if rounding runs past the end)
int64_t draw(const float* w, int64_t V, float floor, const std::vector<double>& blocks, double total, double u) {
  const double target = u * total;
  double run = 0;
  int64_t last = -1;
  for (int64_t b = 0, nb = (V + BLOCK - 1) / BLOCK; b < nb; ++b) {
    if (blocks[b] <= 0) continue;
    const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
    if (run + blocks[b] <= target) {
      run += blocks[b];
      for (int64_t i = hi - 1; i >= lo; --i)
        if (w[i] > floor) { last = i; break; }
      continue;
    }
    for (int64_t i = lo; i < hi; ++i) {
      if (w[i] <= floor) continue;
      run += w[i];
      last = i;
      if (run > target) return i;
    }
  }
  return last;
}

double heavier(const float* w, int64_t V, float than) {  // the weight of the tokens heavier than `than`
  float lanes[L] = {0};
  const int64_t Vv = V / L * L;
  for (int64_t i = 0; i < Vv; i += L)
    for (int j = 0; j < L; ++j) lanes[j] += w[i + j] > than ? w[i + j] : 0.0f;
  double acc = 0;
  for (int j = 0; j < L; ++j) acc += lanes[j];
  for (int64_t i = Vv; i < V; ++i) acc += w[i] > than ? w[i] : 0.0f;
  return acc;
}

struct Edits {  // a row's processed logits (sampling.py `_edits`: bias, a banned token, penalties) and allowed tokens
  const int64_t* tokens = nullptr;
  const float* values = nullptr;
  int64_t count = 0;
  const int32_t* allowed = nullptr;  // a bitmask, bit t of word t / 32 set where token t may be sampled; or none
};

template <typename T>
int64_t sample_row(const T* x, int64_t V, float temperature, int64_t top_k, float top_p, float min_p, uint64_t seed,
                   uint64_t counter, const Edits& edits, std::vector<float>& s, std::vector<float>& scratch,
                   std::vector<double>& blocks) {
  const bool greedy = temperature < GREEDY_BELOW;
  const float inv_t = greedy ? 1.0f : 1.0f / temperature;
  float m = load_scaled<T>(x, s.data(), V, inv_t);
  if (edits.count || edits.allowed) {
    for (int64_t e = 0; e < edits.count; ++e) {
      const float v = edits.values[e] * inv_t;
      s[edits.tokens[e]] = v == v ? v : -INFINITY;
    }
    if (edits.allowed)
      for (int64_t i = 0; i < V; ++i)
        if (!((static_cast<uint32_t>(edits.allowed[i >> 5]) >> (i & 31)) & 1u)) s[i] = -INFINITY;
    m = row_max(s.data(), V);
  }
  if (greedy || m == -INFINITY) {  // the first largest (torch.argmax's); every token banned: token 0
    for (int64_t i = 0; i < V; ++i)
      if (s[i] == m) return i;
    return 0;
  }
  float cut = -INFINITY;
  if (min_p > 0) cut = m + std::log(min_p);
  if (top_k > 0 && top_k < V) cut = std::max(cut, kth_largest(s.data(), V, top_k, scratch));
  double total = weigh(s.data(), V, m, cut, blocks);
  float floor = 0.0f;  // weights above it are candidates (a cut token weighs 0)
  int64_t token = draw(s.data(), V, floor, blocks, total, uniform(seed, counter, 0));
  if (top_p >= 1.0f) return token;
  const double full = total;
  for (uint64_t attempt = 1; attempt < 64; ++attempt) {
    const double above = heavier(s.data(), V, s[token]);
    if (above < static_cast<double>(top_p) * full) return token;
    floor = s[token];
    total = reweigh(s.data(), V, floor, blocks);
    if (total <= 0) return token;  // rounding: nothing heavier
    token = draw(s.data(), V, floor, blocks, total, uniform(seed, counter, attempt));
  }
  return token;
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
      std::vector<float> s(V), scratch;
      std::vector<double> blocks((V + BLOCK - 1) / BLOCK);
      for (int64_t j = b; j < e; ++j)
        op[j] = sample_row<scalar_t>(base + rp[j] * V, V, tp[j], kp[j], pp[j], mp[j], static_cast<uint64_t>(sp[j]),
                                     static_cast<uint64_t>(cp[j]), edits_of(j), s, scratch, blocks);
    });
  }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      std::vector<float> s(V), scratch;
      std::vector<double> blocks((V + BLOCK - 1) / BLOCK);
      for (int64_t j = b; j < e; ++j)
        op[j] = sample_row<scalar_t>(base + rp[j] * V, V, tp[j], kp[j], pp[j], mp[j], static_cast<uint64_t>(sp[j]),
                                     static_cast<uint64_t>(cp[j]), edits_of(j), s, scratch, blocks);
    });
  }));
  return out;
}
