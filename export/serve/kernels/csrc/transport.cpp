// Moving serving memory: a storage taking its bytes from a file mapping (`adopt_storage`), and a sum over the ranks
// of one machine through a shared-memory region (`local_reduce_`, `local_gather`).
#include <sched.h>

#include "kernels.h"

// -- weights moved into a file mapping ---------------------------------------------------------------------------
//
// The storage under `owner` (every tensor on it: views, detached copies, the kernels' references) takes the `nbytes`
// at `offset` in `mapping`'s storage as its memory, holding the mapping alive; its own memory is freed. The caller
// has copied the bytes there first (export/serve/kernels/mapping.py `map_weights`: why).
void adopt_storage(const at::Tensor& owner, const at::Tensor& mapping, int64_t offset) {
  c10::StorageImpl* own = owner.storage().unsafeGetStorageImpl();
  const c10::Storage& from = mapping.storage();
  TORCH_CHECK(owner.device().is_cpu() && mapping.device().is_cpu() && offset >= 0 &&
                  offset + static_cast<int64_t>(own->nbytes()) <= static_cast<int64_t>(from.nbytes()),
              "adopt_storage: CPU storages, the owner's bytes inside the mapping");
  auto* hold = new c10::Storage(from);
  void* at = static_cast<char*>(from.mutable_data()) + offset;
  at::DataPtr ptr(at, hold, [](void* ctx) { delete static_cast<c10::Storage*>(ctx); }, owner.device());
  at::DataPtr old = own->set_data_ptr(std::move(ptr));  // freed here
}

// -- a sum over the ranks of one machine through shared memory -------------------------------------------------
//
// DeepSpeed's shared-memory all-reduce (deepspeed::inference_all_reduce_) waits for the other ranks by spinning,
// however long they take. Where the ranks share a few cores with the server's other threads and its clients, a rank
// that arrives first then holds a core the rank it waits for needs (2 ranks of expert-parallel serving on 2 cores under
// 32 clients spent half of the follower's busy time spinning, py-spy showed). This one spins ~50 us, then yields the
// core between looks (sched_yield). Every rank maps one region (export/serve/transport.py
// `attach_local_reduce`): a counter a rank, then two slots a rank. A call writes this rank's tensor (a slot's bytes at
// a time) into its slot of the call's parity, raises its counter to the call's number, waits for every other counter to
// reach it, then sums the slots in rank order (the same bits on every rank; bf16 and fp16 through torch's add, as many
// roundings as ranks less one). A rank writes a slot again two calls later, when every other rank has started the call
// between, so has read it.
struct LocalReduce {
  uint8_t* base = nullptr;
  int64_t rank = 0, world = 0, slot = 0, seq = 0;
  at::Tensor region;  // keeps the mapping alive
  int64_t* counter(int64_t r) const { return reinterpret_cast<int64_t*>(base + r * 64); }
  uint8_t* buffer(int64_t parity, int64_t r) const { return base + world * 64 + (parity * world + r) * slot; }
};
static LocalReduce g_local;

// region: uint8 [world * 64 + 2 * world * slot_bytes], zeros where no call has run, mapped by every rank alike
void local_reduce_attach(at::Tensor region, int64_t rank, int64_t world, int64_t slot_bytes) {
  TORCH_CHECK(world >= 2 && rank >= 0 && rank < world && slot_bytes > 0 && slot_bytes % 64 == 0,
              "local_reduce_attach: this rank of world >= 2, slots of a multiple of 64 bytes");
  TORCH_CHECK(region.scalar_type() == at::kByte && region.is_contiguous() && region.device().is_cpu() &&
                  region.numel() == world * 64 + 2 * world * slot_bytes,
              "local_reduce_attach: a contiguous uint8 region of world * 64 + 2 * world * slot_bytes bytes");
  g_local = LocalReduce{region.data_ptr<uint8_t>(), rank, world, slot_bytes, 0, region};
  g_local.seq = __atomic_load_n(g_local.counter(rank), __ATOMIC_ACQUIRE);
}

bool local_reduce_attached() { return g_local.base != nullptr; }

static void wait_for_rank(const int64_t* c, int64_t seq) {
  const auto t0 = std::chrono::steady_clock::now();
  bool yielding = false;
  for (int64_t i = 1; __atomic_load_n(c, __ATOMIC_ACQUIRE) < seq; ++i) {
    if (yielding) {
      sched_yield();
    } else {
      _mm_pause();
      if (i % 256 == 0) yielding = std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(50);
    }
  }
}

// This rank's slot of call `seq` is written: say so, then wait until every other rank has written its own.
static void arrive(const LocalReduce& g, int64_t seq) {
  __atomic_store_n(g.counter(g.rank), seq, __ATOMIC_RELEASE);
  for (int64_t r = 0; r < g.world; ++r)
    if (r != g.rank) wait_for_rank(g.counter(r), seq);
}

// t summed over the ranks in place (every rank calls it, in the same order, with the same shape and dtype)
void local_reduce_(at::Tensor t) {
  TORCH_CHECK(g_local.base != nullptr, "local_reduce_: local_reduce_attach first");
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "local_reduce_: a contiguous CPU tensor");
  LocalReduce& g = g_local;
  const int64_t es = t.element_size(), per = g.slot / es, total = t.numel();
  at::Tensor flat = t.view({-1});
  for (int64_t off = 0; off < total; off += per) {
    const int64_t n = std::min(per, total - off);
    at::Tensor part = flat.narrow(0, off, n);
    const int64_t seq = ++g.seq, parity = seq & 1;
    std::memcpy(g.buffer(parity, g.rank), part.data_ptr(), n * es);
    arrive(g, seq);
    auto slot = [&](int64_t r) { return at::from_blob(g.buffer(parity, r), {n}, t.options()); };
    part.copy_(slot(0));
    for (int64_t r = 1; r < g.world; ++r) part.add_(slot(r));
  }
}

// Every rank's bytes (`t` uint8, this rank's), through local_reduce_'s slots and counters: one wait for the other
// ranks and no sum. A rank's bytes past its slot's first slot - 8 do not travel, only their length: the caller sees
// the lengths (all ranks the same) and gathers those otherwise. Returns each rank's length and its bytes (this rank's
// own included; empty where they did not fit).
std::tuple<std::vector<int64_t>, std::vector<at::Tensor>> local_gather(const at::Tensor& t) {
  TORCH_CHECK(g_local.base != nullptr, "local_gather: local_reduce_attach first");
  TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 1 && t.is_contiguous() && t.device().is_cpu(),
              "local_gather: a contiguous 1-D uint8 CPU tensor");
  LocalReduce& g = g_local;
  const int64_t n = t.numel(), room = g.slot - 8, seq = ++g.seq, parity = seq & 1;
  uint8_t* mine = g.buffer(parity, g.rank);
  std::memcpy(mine, &n, 8);
  if (n <= room) std::memcpy(mine + 8, t.data_ptr<uint8_t>(), n);
  arrive(g, seq);
  std::vector<int64_t> lengths(g.world);
  std::vector<at::Tensor> rows(g.world);
  for (int64_t r = 0; r < g.world; ++r) {
    const uint8_t* slot = g.buffer(parity, r);
    std::memcpy(&lengths[r], slot, 8);
    const int64_t m = lengths[r] <= room ? lengths[r] : 0;
    rows[r] = at::empty({m}, t.options());
    std::memcpy(rows[r].data_ptr<uint8_t>(), slot + 8, m);
  }
  return {lengths, rows};
}
