// `DecodeModel`: a whole decode forward, every layer, in one call of the other files' ops.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

// -- a whole decode forward in one call ---------------------------------------------------------------------------
//
// Between the kernels, a decode step of export/serve/decode.py's `Decoder` ran ~15 Python-level operations a layer
// (module calls, views, the residual adds, the routing's bookkeeping): a sixth of a batch-1 step of the peer
// benchmark's Qwen3-MoE package. `DecodeModel` holds every layer's tensors (the same tensors the
// modules hold) and runs the layers with the same kernels, the same torch operators and the same roundings, so the
// hidden states are the Python loop's to the bit. Per layer: an RMSNorm or LayerNorm before attention and MLP, one
// fused q/k/v weight (bias optional), qk-norm optional, RoPE or none, the paged pool, an out projection (bias
// optional); then a dense MLP, an MoE layer whose experts are all on this rank (with PR-MoE's residual MLP or
// Qwen2-MoE's shared expert, or neither), or the block's own MLP module called back in Python (experts on other
// ranks: its exchange's collectives run as the module runs them).

// One norm as the module holds it: RMSNorm (no bias) or LayerNorm (bias optional).
namespace {

struct DecodeNorm {
  at::Tensor w;
  c10::optional<at::Tensor> b;
  double eps = 0;
  bool layer = false;

  at::Tensor operator()(const at::Tensor& x) const {
    return layer ? at::layer_norm(x, {x.size(-1)}, w, b, eps) : rms_norm(x, w, eps);
  }
};

// oneDNN's linear on its packed weight (torch.ops.mkldnn._linear_pointwise, as ServingWeight.linear calls it).
static at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                                   const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         std::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<std::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
}

// export/serve/kernels/weights.py `bucket`: rows rounded up to one of 8 sizes per octave (up to 8 rows as they are).
static int64_t bucket(int64_t rows) {
  if (rows <= 8) return rows;
  const int64_t step = int64_t{1} << (64 - __builtin_clzll(static_cast<uint64_t>(rows)) - 4);
  return (rows + step - 1) / step * step;
}

// One served weight as ServingWeight holds it, and its `linear` for x [rows, in]: AMX from 2 rows where the weight has
// a copy packed for it, the kernel up to MAX_ROWS, then by `more` (ServingWeight.more,
// export/serve/kernels/weights.py's MORE_* codes): oneDNN on its packed copy (rows bucketed), the kernel MAX_ROWS rows
// at a time (bf16 without oneDNN's), or at::linear (a small weight); PLAIN: an nn.Linear the serving runtime left as it
// is (F.linear at every row count).
struct DecodeLinear {
  // INT8: w int8, packed its row scales; INT4: w two int4 a byte, packed its group scales [out, groups]; W8A8: w
  // its int8 tiles (vnni_pack), packed its scales and rows' sums [2, out]
  enum More : int64_t { ONEDNN = 0, CHUNKS = 1, ATEN = 2, PLAIN = 3, INT8 = 4, INT4 = 5, W8A8 = 6 };
  at::Tensor w, amx, packed;
  c10::optional<at::Tensor> b;
  int64_t more = ATEN;

  int64_t outputs() const { return more == W8A8 ? packed.size(1) : w.size(0); }

  at::Tensor operator()(const at::Tensor& x) const {
    const int64_t rows = x.size(0);
    if (more == PLAIN) return at::linear(x, w, b);
    if (more == INT8) return int8_linear(x, w, packed, b);
    if (more == INT4) return int4_linear(x, w, packed, b, x.size(1) / packed.size(1));
#if defined(__AVX512VNNI__)
    if (more == W8A8) return w8a8_linear(x, w, packed, b);
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx.defined() && rows > 1 && rows <= AMX_MAX_ROWS) return amx_linear(x, amx, w.size(0), b);
#endif
    if (rows <= MAX_ROWS) return ::linear(x, w, b);
    if (more == ATEN) return at::linear(x, w, b);
    if (more == CHUNKS) {
      std::vector<at::Tensor> parts;
      for (int64_t i = 0; i < rows; i += MAX_ROWS)
        parts.push_back(::linear(x.narrow(0, i, std::min(MAX_ROWS, rows - i)), w, b));
      return at::cat(parts);
    }
    const int64_t padded = bucket(rows);
    if (padded == rows) return onednn_linear(x, packed, b);
    at::Tensor flat = x.new_zeros({padded, x.size(1)});
    flat.narrow(0, 0, rows).copy_(x);
    return onednn_linear(flat, packed, b).narrow(0, 0, rows);
  }
};

struct DecodeLayer {
  DecodeNorm n1, n2;
  DecodeLinear qkv, out, fc1, fc2;
  c10::optional<at::Tensor> q_norm, k_norm;
  double qk_eps = 0;
  at::Tensor K, V;
  enum { NONE, DENSE, EXPERTS, GATHERED, MODULE } mlp = NONE;
  at::Tensor wg;                           // EXPERTS: the router, every expert's tensors by index
  std::vector<at::Tensor> w1, b1, w2, b2;  // (b1, b2 empty without biases); GATHERED: this rank's experts only
  std::vector<at::Tensor> s1, s2;          // int8 experts: w1, w2 int8 and their row scales (else empty)
  std::vector<int64_t> slot;               // GATHERED: each expert's place in w1.. (-1: not held here)
  py::object split;                        // GATHERED: None (each expert has one holder), or the replicas' split
  bool residual = false, shared = false;      // EXPERTS: PR-MoE's residual MLP and its coefficient, Qwen2-MoE's
  DecodeLinear rfc1, rfc2, coefficient;       // shared expert and its gate
  DecodeLinear sfc1, sfc2, shared_gate;
  py::object module;                          // MODULE (and GATHERED without the ranks' tokens): h [B, C] ->
                                              // (out [B, C], tokens per expert or None)
};

static DecodeNorm decode_norm(const py::tuple& t) {  // (weight, bias or None, eps, layer_norm)
  TORCH_CHECK(t.size() == 4, "DecodeModel: a norm is (weight, bias or None, eps, is_layer_norm)");
  return {t[0].cast<at::Tensor>(), t[1].cast<c10::optional<at::Tensor>>(), t[2].cast<double>(),
          t[3].cast<bool>()};
}

static DecodeLinear decode_linear(const py::tuple& t) {  // (weight, amx or None, packed, more, bias or None)
  TORCH_CHECK(t.size() == 5, "DecodeModel: a linear is (weight, amx or None, packed, more, bias or None)");
  DecodeLinear l{t[0].cast<at::Tensor>(), t[1].cast<c10::optional<at::Tensor>>().value_or(at::Tensor()),
                 t[2].cast<at::Tensor>(), t[4].cast<c10::optional<at::Tensor>>(), t[3].cast<int64_t>()};
  TORCH_CHECK(l.more >= DecodeLinear::ONEDNN && l.more <= DecodeLinear::W8A8, "DecodeModel: `more` is 0 to 6");
  return l;
}

class DecodeModel {
 public:
  DecodeModel(int64_t head_dim, int64_t q_size, int64_t kv_size, int64_t top_k, bool renormalize, bool swiglu)
      : D_(head_dim), qs_(q_size), kvs_(kv_size), k_(top_k), renormalize_(renormalize), swiglu_(swiglu) {}

  // A layer's attention half: its two norms and two linears as tuples (`decode_norm`, `decode_linear`), the q/k
  // norms, and its pool; then `add_experts`, `add_mlp` or `add_module` for its MLP half.
  void add_attention(py::tuple ln1, py::tuple qkv, c10::optional<at::Tensor> q_norm,
                     c10::optional<at::Tensor> k_norm, double qk_eps, py::tuple out, py::tuple ln2, at::Tensor K,
                     at::Tensor V) {
    DecodeLayer L;
    L.n1 = decode_norm(ln1), L.qkv = decode_linear(qkv), L.out = decode_linear(out), L.n2 = decode_norm(ln2);
    TORCH_CHECK(L.qkv.outputs() == qs_ + 2 * kvs_, "DecodeModel.add_attention: a q/k/v weight of ", qs_ + 2 * kvs_,
                " outputs");
    L.q_norm = q_norm, L.k_norm = k_norm, L.qk_eps = qk_eps, L.K = K, L.V = V;
    layers_.push_back(std::move(L));
  }

  void add_experts(at::Tensor wg, std::vector<at::Tensor> w1, std::vector<at::Tensor> b1,
                   std::vector<at::Tensor> w2, std::vector<at::Tensor> b2, std::vector<at::Tensor> s1,
                   std::vector<at::Tensor> s2) {
    TORCH_CHECK(!layers_.empty() && static_cast<int64_t>(w1.size()) == wg.size(0) && w2.size() == w1.size() &&
                    (b1.empty() || b1.size() == w1.size()) && b2.size() == b1.size(),
                "DecodeModel.add_experts: after add_attention, one w1, w2 (b1, b2) per expert of the router");
    DecodeLayer& L = last("add_experts");
    TORCH_CHECK(s1.size() == s2.size() && (s1.empty() || s1.size() == w1.size()),
                "DecodeModel.add_experts: int8 experts' scales s1, s2 for every expert, or none");
    L.mlp = DecodeLayer::EXPERTS, L.wg = wg, L.w1 = std::move(w1), L.b1 = std::move(b1), L.w2 = std::move(w2);
    L.b2 = std::move(b2), L.s1 = std::move(s1), L.s2 = std::move(s2);
  }

  // An expert-parallel MoE layer between the ranks of one machine, as export/serve/placement/exchange.py's
  // `Exchange.run_gathered` runs it (there in Python, here without it): every rank's tokens gathered by one
  // all-reduce of a table in which each rank writes its rows (exact: x + 0 = x), routed alike on every rank, this
  // rank's pairs computed, the pairs' outputs summed over the ranks by a second all-reduce, and this rank's tokens'
  // choices combined. The all-reduce is DeepSpeed's shared-memory one (torch.ops.deepspeed.inference_all_reduce_, as
  // pipeline/dist.py's fast_all_reduce_ calls it), called through the dispatcher. `module`: the layer as PlacedMoE
  // runs it, called back for a forward that is not given every rank's tokens. The experts held here: `hold`.
  void add_gathered(at::Tensor wg, int64_t rank, py::object module) {
    TORCH_CHECK(rank >= 0, "DecodeModel.add_gathered: this rank");
    DecodeLayer& L = last("add_gathered");
    L.mlp = DecodeLayer::GATHERED, L.wg = wg, L.module = std::move(module), L.slot.assign(wg.size(0), -1);
    L.split = py::none();
    rank_ = rank;
  }

  // The experts GATHERED layer `layer` (its index among all layers) computes here: `experts` (increasing) with their
  // w1, w2 (b1, b2); `split`: None when every expert has one holder (a pair is this rank's when its expert is held
  // here), else a callable (experts [S, k], tokens per expert [E]) -> experts [S, k] with -1 for the pairs another
  // holder computes (a replicated expert's pairs split between its holders: Exchange._my_pairs).
  void hold(int64_t layer, std::vector<int64_t> experts, std::vector<at::Tensor> w1, std::vector<at::Tensor> b1,
            std::vector<at::Tensor> w2, std::vector<at::Tensor> b2, std::vector<at::Tensor> s1,
            std::vector<at::Tensor> s2, py::object split) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) &&
                    layers_[layer].mlp == DecodeLayer::GATHERED, "DecodeModel.hold: layer ", layer, " is not gathered");
    DecodeLayer& L = layers_[layer];
    TORCH_CHECK(w1.size() == experts.size() && w2.size() == w1.size() && (b1.empty() || b1.size() == w1.size()) &&
                    b2.size() == b1.size() && s1.size() == s2.size() && (s1.empty() || s1.size() == w1.size()),
                "DecodeModel.hold: one w1, w2 (b1, b2; s1, s2 for int8 ones) per expert held");
    std::vector<int64_t> slot(L.wg.size(0), -1);
    for (size_t i = 0; i < experts.size(); ++i) {
      TORCH_CHECK(experts[i] >= 0 && experts[i] < L.wg.size(0) && (i == 0 || experts[i] > experts[i - 1]),
                  "DecodeModel.hold: experts of the router, increasing");
      slot[experts[i]] = static_cast<int64_t>(i);
    }
    L.slot = std::move(slot), L.w1 = std::move(w1), L.b1 = std::move(b1), L.w2 = std::move(w2);
    L.b2 = std::move(b2), L.s1 = std::move(s1), L.s2 = std::move(s2), L.split = std::move(split);
  }

  // After add_experts: PR-MoE's residual MLP, out = experts * c0 + mlp * c1 with (c0, c1) = softmax(coefficient(h))
  // (pipeline/model.py `mix_residual`).
  void add_residual(py::tuple fc1, py::tuple fc2, py::tuple coefficient) {
    DecodeLayer& L = experts_layer("add_residual");
    L.residual = true, L.rfc1 = decode_linear(fc1), L.rfc2 = decode_linear(fc2), L.coefficient = decode_linear(coefficient);
  }

  // After add_experts (and add_residual): Qwen2-MoE's shared expert, out + sigmoid(gate(h)) * shared(h)
  // (pipeline/model.py `add_shared`).
  void add_shared(py::tuple fc1, py::tuple fc2, py::tuple gate) {
    DecodeLayer& L = experts_layer("add_shared");
    L.shared = true, L.sfc1 = decode_linear(fc1), L.sfc2 = decode_linear(fc2), L.shared_gate = decode_linear(gate);
  }

  void add_mlp(py::tuple fc1, py::tuple fc2) {
    DecodeLayer& L = last("add_mlp");
    L.mlp = DecodeLayer::DENSE, L.fc1 = decode_linear(fc1), L.fc2 = decode_linear(fc2);
  }

  void add_module(py::object module) {
    DecodeLayer& L = last("add_module");
    L.mlp = DecodeLayer::MODULE, L.module = std::move(module);
  }

  // x [B, C] the rows' embeddings; cos, sin [B, D] (RoPE) or None; the pool's block tables and starts as
  // paged_attention takes them; `tokens`: every rank's rows in this forward (the step says them), for the GATHERED
  // layers, or empty (they call their module back). Returns (hidden [B, C] before the final norm, tokens per expert
  // [E] of each MoE layer, seconds computing experts in the MoE layers run here, seconds in their all-reduces, the
  // experts they ran on this rank, how many MoE layers ran here as EXPERTS, how many as GATHERED).
  std::tuple<at::Tensor, std::vector<at::Tensor>, double, double, int64_t, int64_t, int64_t> forward(
      at::Tensor x, const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
      const at::Tensor& tables, const std::vector<int64_t>& starts, const std::vector<int64_t>& tokens) {
    const int64_t B = x.size(0);
    std::vector<at::Tensor> counts;
    double expert_s = 0, exchange_s = 0;
    int64_t ran = 0, here = 0, gathered = 0;
    py::gil_scoped_release nogil;  // the server's HTTP thread runs meanwhile; a module called back takes it again
    for (const DecodeLayer& L : layers_) {
      TORCH_CHECK(L.mlp != DecodeLayer::NONE, "DecodeModel.forward: a layer without its MLP half");
      at::Tensor y = L.qkv(L.n1(x));
      auto heads = qkv_heads(y.narrow(1, 0, qs_), y.narrow(1, qs_, kvs_), y.narrow(1, qs_ + kvs_, kvs_), D_,
                             L.q_norm, L.k_norm, L.q_norm ? L.qk_eps : 0.0, cos, sin);
      at::Tensor a = paged_attention(heads[0], heads[1], heads[2], L.K, L.V, tables, starts);
      x = x.add(L.out(a.view({B, -1})));
      at::Tensor h = L.n2(x);
      if (L.mlp == DecodeLayer::DENSE) {
        x = x.add(mlp(h, L.fc1, L.fc2));
        continue;
      }
      if (L.mlp == DecodeLayer::MODULE || (L.mlp == DecodeLayer::GATHERED && tokens.empty())) {
        py::gil_scoped_acquire gil;
        py::tuple r = L.module(h);
        x = x.add(r[0].cast<at::Tensor>());
        if (!r[1].is_none()) counts.push_back(r[1].cast<at::Tensor>());
        continue;
      }
      at::Tensor out, n;
      if (L.mlp == DecodeLayer::GATHERED) {
        std::tie(out, n) = gathered_experts(L, h, tokens, expert_s, exchange_s, ran);
        ++gathered;
      } else {
        const auto t0 = std::chrono::steady_clock::now();
        at::Tensor mix, experts;
        std::tie(mix, experts, n) = route(h, L.wg, k_, renormalize_);
        const int64_t* np = n.data_ptr<int64_t>();
        const Picked p = pick(L, n.numel(), [&](int64_t e) { return np[e] ? e : int64_t{-1}; });
        out = routed_experts(h, experts, mix, p.active, p.w1, p.b1, p.w2, p.b2, swiglu_, p.s1, p.s2);
        expert_s += seconds_since(t0);
        ran += static_cast<int64_t>(p.active.size());
        ++here;
      }
      if (L.residual) {
        at::Tensor c = L.coefficient(h).softmax(-1);
        out = out.mul(c.narrow(-1, 0, 1)).add(mlp(h, L.rfc1, L.rfc2).mul(c.narrow(-1, 1, 1)));
      }
      if (L.shared) out = out.add(at::sigmoid(L.shared_gate(h)).mul(mlp(h, L.sfc1, L.sfc2)));
      x = x.add(out);
      counts.push_back(n);
    }
    return {x, counts, expert_s, exchange_s, ran, here, gathered};
  }

 private:
  // Some of a layer's experts, in increasing order, with their tensors (as routed_experts and expert_pairs take them)
  struct Picked {
    std::vector<int64_t> active;
    std::vector<at::Tensor> w1, b1, w2, b2, s1, s2;
  };

  // The experts e of E for which `at(e)` gives their place in L's w1.. (-1: not this call's)
  template <typename At>
  static Picked pick(const DecodeLayer& L, int64_t E, At at) {
    Picked p;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t i = at(e);
      if (i < 0) continue;
      p.active.push_back(e);
      p.w1.push_back(L.w1[i]);
      p.w2.push_back(L.w2[i]);
      if (!L.b1.empty()) {
        p.b1.push_back(L.b1[i]);
        p.b2.push_back(L.b2[i]);
      }
      if (!L.s1.empty()) {
        p.s1.push_back(L.s1[i]);
        p.s2.push_back(L.s2[i]);
      }
    }
    return p;
  }

  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // t summed over the ranks in place (every rank calls it, in the same order): `local_reduce_` where attached, else
  // DeepSpeed's shared-memory all-reduce
  static void all_reduce(at::Tensor& t) {
    if (local_reduce_attached()) return local_reduce_(t);
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("deepspeed::inference_all_reduce_", "")
                         .typed<at::Tensor&(at::Tensor&)>();
    op.call(t);
  }

  // A GATHERED layer over this rank's rows h [S, C] (see add_gathered): (output [S, C], tokens per expert [E]).
  std::pair<at::Tensor, at::Tensor> gathered_experts(const DecodeLayer& L, const at::Tensor& h,
                                                     const std::vector<int64_t>& tokens, double& expert_s,
                                                     double& exchange_s, int64_t& ran) const {
    const int64_t S = h.size(0), C = h.size(1);
    TORCH_CHECK(rank_ < static_cast<int64_t>(tokens.size()) && tokens[rank_] == S, "DecodeModel.forward: ", S,
                " rows on rank ", rank_, ", the step's tokens say otherwise");
    int64_t total = 0, off = 0;
    for (size_t r = 0; r < tokens.size(); ++r) {
      if (static_cast<int64_t>(r) < rank_) off += tokens[r];
      total += tokens[r];
    }
    auto t0 = std::chrono::steady_clock::now();
    at::Tensor every = at::zeros({total, C}, h.options());
    every.narrow(0, off, S).copy_(h);
    all_reduce(every);
    exchange_s += seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    auto [mix, experts, n] = route(every, L.wg, k_, renormalize_);
    at::Tensor mine;  // this rank's pairs: their expert; the others' -1
    if (L.split.is_none()) {
      mine = experts.clone();
      int64_t* mp = mine.data_ptr<int64_t>();
      for (int64_t i = 0; i < mine.numel(); ++i)
        if (L.slot[mp[i]] < 0) mp[i] = -1;
    } else {
      py::gil_scoped_acquire gil;
      mine = L.split(experts, n).cast<at::Tensor>().contiguous();
      TORCH_CHECK(mine.sizes() == experts.sizes() && mine.scalar_type() == at::kLong,
                  "DecodeModel: a split gives experts [S, k] int64");
    }
    std::vector<bool> used(n.numel(), false);
    const int64_t* mp = mine.data_ptr<int64_t>();
    for (int64_t i = 0; i < mine.numel(); ++i)
      if (mp[i] >= 0) {
        TORCH_CHECK(mp[i] < n.numel() && L.slot[mp[i]] >= 0, "DecodeModel: a split gave expert ", mp[i],
                    ", not held here");
        used[mp[i]] = true;
      }
    const Picked p = pick(L, n.numel(), [&](int64_t e) { return used[e] ? L.slot[e] : int64_t{-1}; });
    at::Tensor pairs = p.active.empty() ? at::zeros({total, k_, C}, h.options())
                                        : expert_pairs(every, mine, mix, p.active, p.w1, p.b1, p.w2, p.b2, swiglu_, p.s1, p.s2);
    expert_s += seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    all_reduce(pairs);
    exchange_s += seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    at::Tensor out = combine_pairs(pairs.narrow(0, off, S).contiguous(), mix.narrow(0, off, S).contiguous());
    expert_s += seconds_since(t0);
    ran += static_cast<int64_t>(p.active.size());
    return {out, n};
  }

  // pipeline/model.py's MLP
  at::Tensor mlp(const at::Tensor& h, const DecodeLinear& fc1, const DecodeLinear& fc2) const {
    at::Tensor u = fc1(h);
    if (swiglu_) {
      auto parts = u.chunk(2, -1);
      u = at::silu(parts[0]).mul(parts[1]);
    } else {
      u = at::gelu(u);
    }
    return fc2(u);
  }

  DecodeLayer& experts_layer(const char* what) {
    TORCH_CHECK(!layers_.empty() && (layers_.back().mlp == DecodeLayer::EXPERTS ||
                                     layers_.back().mlp == DecodeLayer::GATHERED),
                "DecodeModel.", what, ": after add_experts or add_gathered");
    return layers_.back();
  }

  DecodeLayer& last(const char* what) {
    TORCH_CHECK(!layers_.empty() && layers_.back().mlp == DecodeLayer::NONE, "DecodeModel.", what,
                ": once, after add_attention");
    return layers_.back();
  }

  int64_t D_, qs_, kvs_, k_;
  int64_t rank_ = 0;  // this rank (GATHERED layers)
  bool renormalize_, swiglu_;
  std::vector<DecodeLayer> layers_;
};

}  // namespace

void bind_decode_model(py::module_& m) {
  py::class_<DecodeModel>(m, "DecodeModel", py::module_local(),  // one per ISA build in a process
                          "a whole decode forward of a model's layers in one call")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, bool, bool>())
      .def("add_attention", &DecodeModel::add_attention)
      .def("add_experts", &DecodeModel::add_experts)
      .def("add_gathered", &DecodeModel::add_gathered)
      .def("hold", &DecodeModel::hold)
      .def("add_mlp", &DecodeModel::add_mlp)
      .def("add_residual", &DecodeModel::add_residual)
      .def("add_shared", &DecodeModel::add_shared)
      .def("add_module", &DecodeModel::add_module)
      .def("forward", &DecodeModel::forward);
}
