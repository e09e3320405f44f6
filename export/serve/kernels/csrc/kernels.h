// The serving kernels' C++ extension: what each file holds, the constants the ops share, and the ops one file calls
// in another (the Python bindings, `DecodeModel`). Built at first use by export/serve/kernels/extension.py
// (torch.utils.cpp_extension, the way DeepSpeed builds its CPU ops), once per instruction set: AVX-512 (with
// AVX512_BF16 and AVX512_VNNI where the CPU has them, and AMX's tiles), or AVX2 + FMA. Every kernel reads its weight
// once, one sequential stream a thread, split between torch's intra-op threads; fp32 sums, one rounding to the
// output's dtype, no temporary tensors.
//
//   simd.h          the vector helpers, the threads' work split, the prefetch hint (inline)
//   gemv.h          the few-row GEMV kernels on fp32, bf16, int8 and int4 weights (inline)
//   vnni.h, amx.h   int8 x int8 products (AVX512_VNNI) and AMX tiles (inline)
//   norms.h         RMSNorm over rows (inline)
//   linears.cpp     y = x @ w.T (+ bias) for 1 to MAX_ROWS rows (fp32, bf16), and 2 to AMX_MAX_ROWS rows on AMX
//   quantized.cpp   the same for int8 and int4 weights (any rows, MAX_ROWS a pass), and W8A8 (x rounded to int8)
//   attention.cpp   a decode token's q, k, v heads (qk-norm, RoPE) and its attention over a paged KV pool
//   moe.cpp         an MoE layer's experts over their rows in one call; a whole layer (routing, experts, sum)
//   norms.cpp       RMSNorm
//   heads.cpp       the greedy argmax, and the output layer's greedy and top-k rows screened through an int8 copy
//   transport.cpp   weights moved into a file mapping; a sum over one machine's ranks through shared memory
//   decode_model.cpp  a whole decode forward (every layer) in one call
//   bindings.cpp    the Python module
//   sampling.cpp    temperature, min_p, top_k, top_p and one draw per row
//   ops_dense.cpp, ops_model.cpp  the files above compiled as two translation units (ops_dense.cpp says why)
//
// Only the headers used (not <torch/extension.h>, whose whole C++ API takes most of a file's build time to parse):
// the tensor and its method operators, the ATen operators called by name; pybind11 with torch's tensor type casters
// in the two files that talk to Python.
#pragma once

#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

// Input rows of the few-row kernels: one pass over the weight serves up to this many (a decode batch's), each row's
// sums in registers.
constexpr int64_t MAX_ROWS = 8;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr int64_t AMX_MAX_ROWS = 256;  // more rows: oneDNN's GEMM (as fast or faster some hundreds of rows on)
#endif
#if defined(__AVX512VNNI__)  // int8 x int8 (vnni.h): outputs a tile, inputs a chunk, rows a call, rows a pass
constexpr int64_t VNNI_TILE = 64, VNNI_CHUNK = 1024, VNNI_MAX_ROWS = 64, VNNI_PASS = 6;
#endif

// linears.cpp
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
bool amx_ready();
at::Tensor amx_pack(const at::Tensor& w);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t O,
                         const c10::optional<at::Tensor>& bias);
#endif

// quantized.cpp
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias, int64_t group);
#if defined(__AVX512VNNI__)
at::Tensor vnni_pack(const at::Tensor& q);
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias);
#endif

// attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor K,
                              at::Tensor V, const at::Tensor& tables, const std::vector<int64_t>& starts);
std::vector<at::Tensor> qkv_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     int64_t D, const c10::optional<at::Tensor>& q_w,
                                     const c10::optional<at::Tensor>& k_w, double eps,
                                     const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin);

// moe.cpp
at::Tensor expert_mlps(const at::Tensor& x, const std::vector<int64_t>& counts, const std::vector<at::Tensor>& w1,
                          const std::vector<at::Tensor>& b1, const std::vector<at::Tensor>& w2,
                          const std::vector<at::Tensor>& b2, bool swiglu, const std::vector<at::Tensor>& s1,
                          const std::vector<at::Tensor>& s2);
std::tuple<at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& x, const at::Tensor& wg,
                                                              int64_t k, bool renormalize);
at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                             const std::vector<int64_t>& active, const std::vector<at::Tensor>& w1,
                             const std::vector<at::Tensor>& b1, const std::vector<at::Tensor>& w2,
                             const std::vector<at::Tensor>& b2, bool swiglu, const std::vector<at::Tensor>& s1,
                             const std::vector<at::Tensor>& s2);
at::Tensor expert_pairs(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                           const std::vector<int64_t>& active, const std::vector<at::Tensor>& w1,
                           const std::vector<at::Tensor>& b1, const std::vector<at::Tensor>& w2,
                           const std::vector<at::Tensor>& b2, bool swiglu, const std::vector<at::Tensor>& s1,
                           const std::vector<at::Tensor>& s2);
at::Tensor combine_pairs(const at::Tensor& y, const at::Tensor& weights);

// norms.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// heads.cpp
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor screen_argmax(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q, const at::Tensor& scale,
                         const at::Tensor& err, int64_t most);
std::vector<at::Tensor> screen_topk(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q,
                                    const at::Tensor& scale, const at::Tensor& err, int64_t most, const at::Tensor& ks,
                                    const at::Tensor& foff, const at::Tensor& ftok);
at::Tensor screen_sample(const at::Tensor& x, const at::Tensor& w, const at::Tensor& q, const at::Tensor& scale,
                         const at::Tensor& err, int64_t most, const at::Tensor& temperature, const at::Tensor& top_p,
                         const at::Tensor& min_p, const at::Tensor& seed, const at::Tensor& counter,
                         const at::Tensor& foff, const at::Tensor& ftok, const at::Tensor& fbias,
                         const at::Tensor& frep, const at::Tensor& fsub);
#if defined(__AVX512VNNI__)
at::Tensor screen_sample_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                              const at::Tensor& scale, const at::Tensor& err1, const at::Tensor& err2,
                              const at::Tensor& top, const at::Tensor& norm, int64_t most,
                              const at::Tensor& temperature, const at::Tensor& top_p, const at::Tensor& min_p,
                              const at::Tensor& seed, const at::Tensor& counter, const at::Tensor& foff,
                              const at::Tensor& ftok, const at::Tensor& fbias, const at::Tensor& frep,
                              const at::Tensor& fsub);
at::Tensor screen_argmax_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                              const at::Tensor& scale, const at::Tensor& err1, const at::Tensor& err2,
                              const at::Tensor& top, const at::Tensor& norm, int64_t most);
std::vector<at::Tensor> screen_topk_vnni(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                                         const at::Tensor& scale, const at::Tensor& err1, const at::Tensor& err2,
                                         const at::Tensor& top, const at::Tensor& norm, int64_t most,
                                         const at::Tensor& ks, const at::Tensor& foff, const at::Tensor& ftok);
at::Tensor screen_argmax_i4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& top,
                            const at::Tensor& norm, const at::Tensor& round, int64_t group, int64_t most);
at::Tensor screen_argmax_i8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& rowsum,
                            const at::Tensor& top, const at::Tensor& norm, const at::Tensor& round, int64_t most);
#endif

// transport.cpp
void adopt_storage(const at::Tensor& owner, const at::Tensor& mapping, int64_t offset);
void local_reduce_attach(at::Tensor region, int64_t rank, int64_t world, int64_t slot_bytes);
bool local_reduce_attached();
void local_reduce_(at::Tensor t);
std::tuple<std::vector<int64_t>, std::vector<at::Tensor>> local_gather(const at::Tensor& t);

// sampling.cpp
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                       const at::Tensor& seed, const at::Tensor& counter, const at::Tensor& offsets,
                       const at::Tensor& tokens, const at::Tensor& values, const at::Tensor& allowed);
at::Tensor gumbel_rows(const at::Tensor& seed, const at::Tensor& counter, int64_t V);
