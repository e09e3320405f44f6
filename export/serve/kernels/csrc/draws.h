// A sampled row's random numbers and the arithmetic its choice needs, shared by the sampler (csrc/sampling.cpp, on a
// row's logits) and the screened sampler (csrc/heads.cpp `screen_sample`, on an int8 copy of the output layer and
// the few exact logits its bounds cannot rule out), so that both choose the same token from the same logits.
//
// A draw is the Gumbel-max trick (vLLM's sampler draws exponentials q and takes argmax p / q: the same thing): the
// token is argmax over the kept tokens of a + g[t], a the logit over the temperature, g[t] a Gumbel number made by a
// counter-based hash of (the request's seed, the tokens it sampled before, t). It depends on the row alone, never on
// its batch, and on each token's own logit alone: a token whose upper bound plus its g cannot reach another's lower
// bound plus its g cannot be drawn, which is what lets the screen draw without every logit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace draws {

constexpr float GREEDY_BELOW = 1e-5f;  // export/serve/request.py GREEDY_BELOW

// A row's key: splitmix64 of (seed, counter), as export/serve/sampling.py `_row_keys` computes it
inline uint64_t row_key(uint64_t seed, uint64_t counter) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + counter * 0xD1B54A32D192ED03ull +
               0x632BE59BD9B4E019ull;  // so that (0, 0) does not hash to 0
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// max of v [V] (-inf for none), in lanes: a float reduction the compiler vectorizes (it keeps one sum's order)
inline float row_max(const float* v, int64_t V) {
  constexpr int L = 16;
  float lanes[L];
  for (int j = 0; j < L; ++j) lanes[j] = -INFINITY;
  const int64_t Vv = V / L * L;
  for (int64_t i = 0; i < Vv; i += L)
    for (int j = 0; j < L; ++j) lanes[j] = v[i + j] > lanes[j] ? v[i + j] : lanes[j];
  float m = -INFINITY;
  for (int j = 0; j < L; ++j) m = std::max(m, lanes[j]);
  for (int64_t i = Vv; i < V; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x in [-87, 88] (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n from the exponent bits),
// relative error ~1e-7, in plain arithmetic the compiler vectorizes; 0 below -87 (and for -inf).
inline float exp_clamped(float x0) {
  const float keep = static_cast<float>(x0 >= -87.0f);  // 0 or 1: arithmetic, not a branch (vectorized)
  const float x = std::min(std::max(x0, -87.0f), 88.0f);
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

// ln(x) for normal x > 0 (Cephes' logf: x = f 2^e with f in [sqrt(1/2), sqrt(2)), a degree-8 polynomial in f - 1),
// relative error ~1e-7, in plain arithmetic the compiler vectorizes.
inline float log_positive(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  float e = static_cast<float>(((bits >> 23) & 0xFF) - 126);  // x = f 2^e, f in [1/2, 1)
  bits = (bits & 0x807FFFFF) | 0x3F000000;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  const float low = static_cast<float>(f < 0.707106781186547524f);  // then f 2 in [sqrt(1/2), 1), e - 1
  e -= low;
  f = f + f * low - 1.0f;
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return f + y + 0.693359375f * e;
}

// A token's Gumbel number: -ln(-ln(u)), u = (2 k + 1) / 2^24 in (0, 1), k the top 23 bits of murmur3's 32-bit
// finalizer of (the row's key's high half) xor (its low half + t x 0x9E3779B9): one hash a row, then 32-bit
// arithmetic a token (a bijection of t: no two tokens of a row share a number before the rounding to 23 bits).
// export/serve/sampling.py `gumbel_noise` is the same in numpy and tensor ops.

inline float gumbel(uint64_t key, int64_t t) {
  uint32_t x = static_cast<uint32_t>(key >> 32) ^ (static_cast<uint32_t>(key) + static_cast<uint32_t>(t) * 0x9E3779B9u);
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  const float u = static_cast<float>(static_cast<int32_t>((x >> 9) * 2 + 1)) * 0x1p-24f;
  return -log_positive(-log_positive(u));
}

// g[t] for t in [0, V): the row's numbers
inline void gumbel_row(uint64_t seed, uint64_t counter, int64_t V, float* __restrict g) {
  const uint64_t key = row_key(seed, counter);
  for (int64_t t = 0; t < V; ++t) g[t] = gumbel(key, t);
}

}  // namespace draws
