// pipeline/model.py's RMSNorm over rows, inline: `rms_norm` (norms.cpp) and a decode token's qk-norm (attention.cpp).
#pragma once

#include <cmath>

#include "simd.h"

// pipeline/model.py's RMSNorm (the Hugging Face families'): each row of C values normalised in fp32 by
// 1 / sqrt(mean(x^2) + eps), rounded to x's dtype, then times the weight (rounded again). One call where the
// module's seven operators each woke the thread pool: five norms a layer in Qwen3-MoE (two of them per head).
template <typename T>
static void rms_norm_rows(const T* x, const T* w, T* y, int64_t C, float eps, int64_t r0, int64_t r1) {
  const int64_t Cv = C / VW * VW;
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * C;
    T* yr = y + r * C;
    vf acc = vzero();
    int64_t i = 0;
    for (; i < Cv; i += VW) {
      const vf v = vload_f(xr + i);
      acc = vfma(v, v, acc);
    }
    float ss = vsum(acc);
    for (; i < C; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
    for (i = 0; i < C; ++i)
      yr[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(static_cast<float>(xr[i]) * inv)));
  }
}
