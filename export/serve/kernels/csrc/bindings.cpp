// The extension's Python module: every op of the other files.
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

void bind_decode_model(py::module_& m);  // decode_model.cpp (its class is local to that file)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adopt_storage", &adopt_storage, "a tensor's storage takes bytes of a mapping's storage as its memory");
  m.def("local_reduce_attach", &local_reduce_attach, "this rank's view of the ranks' shared region for local_reduce_");
  // the kernels run without the GIL, as torch's operators do: while a rank computes, or waits for the others (the
  // step results' gather, a prefill forward's exchange), its process's other threads (the server's HTTP thread) run
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("local_gather", &local_gather, "every rank's bytes through local_reduce_'s slots: (lengths, bytes a rank)",
        nogil);
  m.def("local_reduce_", &local_reduce_, "a tensor summed over the ranks of one machine in place (yielding waits)",
        nogil);
  m.def("linear", &linear, "y = x @ w.T (+ bias) for 1-8 rows of x, fp32 or bf16", nogil);
  m.def("paged_attention", &paged_attention,
        "one new token per row: store its key and value in its row's block of a paged KV pool, attend over the "
        "row's keys through its block table", nogil);
  const auto none = std::vector<at::Tensor>();  // s1, s2: the int8 weights' scales, or none
  m.def("expert_mlps", &expert_mlps,
        "the routed experts of one MoE layer over their rows (grouped by expert), in two parallel passes",
        py::arg("x"), py::arg("counts"), py::arg("w1"), py::arg("b1"), py::arg("w2"), py::arg("b2"), py::arg("swiglu"),
        py::arg_v("s1", none, "[]"), py::arg_v("s2", none, "[]"), nogil);
  m.def("route", &route, "an MoE layer's top-k routing: (weights, experts, tokens per expert)", nogil);
  m.def("routed_experts", &routed_experts, "every token's routed experts and their weighted sum", py::arg("x"),
        py::arg("experts"), py::arg("weights"), py::arg("active"), py::arg("w1"), py::arg("b1"), py::arg("w2"),
        py::arg("b2"), py::arg("swiglu"), py::arg_v("s1", none, "[]"), py::arg_v("s2", none, "[]"), nogil);
  m.def("expert_pairs", &expert_pairs, "the (token, choice) outputs of some of the experts, zeros for the others",
        py::arg("x"), py::arg("experts"), py::arg("weights"), py::arg("active"), py::arg("w1"), py::arg("b1"),
        py::arg("w2"), py::arg("b2"), py::arg("swiglu"), py::arg_v("s1", none, "[]"), py::arg_v("s2", none, "[]"),
        nogil);
  m.def("combine_pairs", &combine_pairs, "each token's choices' outputs weighted and summed, as routed_experts", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, as pipeline/model.py's", nogil);
  m.def("argmax_rows", &argmax_rows, "each row's argmax, as torch.argmax(x, -1)", nogil);
  m.def("sample_rows", &sample_rows, "each asked row's token after temperature, min_p, top_k, top_p and one "
        "counter-based draw (csrc/sampling.cpp)", nogil);
  m.def("gumbel_rows", &gumbel_rows, "the draws' Gumbel numbers [n, V] of (seed, counter) [n] (csrc/draws.h)", nogil);
  m.def("screen_sample", &screen_sample,
        "each sampled row's token from an int8 copy of w and the exact logits its bounds need, -1 where they cannot "
        "decide (csrc/heads.cpp)", nogil);
  m.def("int8_linear", &int8_linear, "y = x @ (scale * q).T (+ bias) for int8 weights q, one scale a row", nogil);
  m.def("int4_linear", &int4_linear, "y = x @ w.T (+ bias) for int4 weights, two a byte, one scale a group of a row",
        nogil);
  m.def("screen_argmax", &screen_argmax,
        "each row's argmax of x @ w.T as linear writes it, from an int8 copy of w and the candidates' exact rows", nogil);
  m.def("screen_topk", &screen_topk,
        "each row's candidates for its top k of x @ w.T (edited tokens always) and their logits as linear writes them",
        nogil);
  m.def("qkv_heads", &qkv_heads,
        "a decode token's q, k, v split into heads, q and k normalised (qk_norm) and rotated (RoPE), as pipeline/model.py",
        nogil);
  m.attr("MAX_ROWS") = MAX_ROWS;
  // whether this build multiplies bf16 as it is (VDPBF16PS); without, the kernels widen bf16 to fp32
#if defined(__AVX512BF16__)
  m.attr("BF16_PRODUCTS") = true;
#else
  m.attr("BF16_PRODUCTS") = false;
#endif
#if defined(__AVX512VNNI__)
  m.def("vnni_pack", &vnni_pack, "an int8 [out, in] weight in tiles of 64 outputs for screen_argmax_vnni");
  m.def("screen_argmax_i4", &screen_argmax_i4,
        "the greedy argmax of an int4 layer's rows (int4_linear's), screened in int4 x int8 (VPDPBUSD)", nogil);
  m.def("screen_argmax_i8", &screen_argmax_i8,
        "the greedy argmax of an int8 layer's rows (int8_linear's), screened in int8 x int8 (VPDPBUSD)", nogil);
  m.def("screen_argmax_vnni", &screen_argmax_vnni,
        "screen_argmax for up to VNNI_MAX_ROWS rows, its int8 pass on x rounded to int8 too (VPDPBUSD)", nogil);
  m.def("screen_topk_vnni", &screen_topk_vnni, "screen_topk for up to VNNI_MAX_ROWS rows, as screen_argmax_vnni",
        nogil);
  m.def("screen_sample_vnni", &screen_sample_vnni, "screen_sample for up to VNNI_MAX_ROWS rows, as screen_argmax_vnni",
        nogil);
  m.attr("VNNI_MAX_ROWS") = VNNI_MAX_ROWS;
  m.def("w8a8_linear", &w8a8_linear,
        "y = x @ w.T (+ bias) for a W8A8 weight (vnni_pack's tiles, scales and rows' sums [2, out]), x rounded to int8 "
        "a row at a time", nogil);
#endif
  bind_decode_model(m);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.def("amx_ready", &amx_ready, "whether this process may use AMX (Linux gave it the tile state)");
  m.def("amx_pack", &amx_pack, "a bf16 [out, in] weight packed into AMX tiles, for amx_linear");
  m.def("amx_linear", &amx_linear, "y = x @ w.T (+ bias) for 1 to AMX_MAX_ROWS bf16 rows, w as amx_pack packed it",
        nogil);
  m.attr("AMX_MAX_ROWS") = AMX_MAX_ROWS;
#endif
}
