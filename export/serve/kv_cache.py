"""The paged KV cache of one serving rank: fixed-size blocks from a memory budget, a block table per sequence.

    from export.serve.kv_cache import PagedCache, plan_kv, pool_blocks
    plan_kv(cfg, heads, torch.bfloat16, torch.device("cpu"), max_batch=32)   # KVPlan: --kv-cache-memory's blocks
    blocks = pool_blocks(cfg, heads, block_size=16, dtype=torch.bfloat16, budget_bytes=1 << 30)
    cache = PagedCache(cfg, blocks, 16, heads, device="cpu", dtype=torch.bfloat16)
    cache.extend(seq=7, blocks=[3, 9])                  # the scheduler's decision (export/serve/step.py Row.blocks)
    model(tokens, cache=cache.select([7], starts=[20], counts=[1]), hidden_only=True)

Keys and values of every layer live in one pool per layer, [blocks, kv heads, block_size, head_dim]: the
block is the unit the scheduler (export/serve/scheduler.py) hands out, shares between prompts with a
common prefix, and takes back. Nothing is sized by max-batch x the model's context: the pool is what
`--kv-cache-memory` buys (`pool_blocks`), and a sequence holds the blocks its tokens fill.

It implements pipeline/model.py's cache protocol (`Cache`) with a length per row, so rows of
different lengths batch together: keys are written at each row's own positions (block, offset), each
query sees its row's keys up to its own position (an explicit mask), positions are per row. A decode
forward on the CPU (one new token a row) attends in csrc/attention.cpp's `paged_attention` kernel, which
writes the token's key and value and reads the row's keys in place through its block table; other
forwards (prefill, and every forward on CUDA) gather each row's blocks into a contiguous view and run
scaled_dot_product_attention.

Packed forwards (`select(..., packed=True)`, where the kernel is here: `packs`): the rows' new tokens one after
another as one sequence [1, sum(counts)], no padding, so decode tokens and prompt chunks share one forward (each
weight read once for both, as vLLM's chunked prefill does). Attention then takes one `paged_attention` call for
every row of up to `PagedCache.kernel_rows` new tokens (`serve --attention-kernel-rows`), each token a row of the kernel's own (its position, its
row's block table; the kernel writes all keys and values before it reads any), and each longer row's queries over
its own blocks in scaled_dot_product_attention.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from export.serve import kernels
from pipeline.model import Cache, ModelConfig

# what --kv-cache-memory defaults to, as vLLM's --gpu-memory-utilization and VLLM_CPU_KVCACHE_SPACE: on the CPU a
# quarter of the memory available at start-up (after the weights), shared by this machine's ranks; on a GPU 80% of
# its free memory (after the weights)
CPU_SHARE, GPU_SHARE = 0.25, 0.8


def block_bytes(cfg: ModelConfig, heads: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over every layer: keys and values of `block_size` tokens for `heads` kv heads."""
    return 2 * cfg.layers * heads * block_size * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def served_kv(model) -> tuple[int, torch.dtype, torch.device]:
    """(kv heads, dtype, device) of a model's KV cache on this rank: its query heads' share of the kv heads under
    tensor slicing, the dtype of its weights (the fp32 MoE gates aside)."""
    dtype = next(p for n, p in model.named_parameters() if not n.endswith("gate.wg.weight")).dtype
    heads = model.blocks[0].attn.num_heads * model.cfg.kv_heads // model.cfg.heads
    return heads, dtype, next(model.parameters()).device


def free_memory(device: torch.device, ranks: int = 1) -> tuple[int, str]:
    """(bytes the KV cache may take by default, how that was decided) on `device`, for one of this machine's
    `ranks` ranks."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_SHARE), f"{GPU_SHARE:.0%} of the GPU's free memory"
    available = _mem_available()
    share = f"{CPU_SHARE:.0%} of the memory available ({available / 2**30:.1f} GiB)" + \
        (f" over {ranks} ranks" if ranks > 1 else "")
    return int(available * CPU_SHARE / ranks), share


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def pool_blocks(cfg: ModelConfig, heads: int, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """Blocks a budget of `budget_bytes` holds on one rank."""
    return budget_bytes // block_bytes(cfg, heads, block_size, dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """How the KV cache was sized: blocks per rank of `block_size` tokens, the sequence length it serves, and why."""

    blocks: int
    block_size: int
    max_model_len: int
    bytes_per_rank: int
    budget: str  # where the budget came from
    lowered: str | None = None  # why max_model_len is below what was asked, if it is

    def describe(self) -> str:
        text = (f"KV cache: {self.blocks} blocks of {self.block_size} tokens per rank "
                f"({self.bytes_per_rank / 2**30:.2f} GiB, {self.blocks * self.block_size} tokens; {self.budget}); "
                f"max model length {self.max_model_len}")
        return text + (f" ({self.lowered})" if self.lowered else "")

    def with_blocks(self, blocks: int) -> "KVPlan":
        """This plan for a pool of `blocks` (the fewest any rank has: every rank's pool alike, so the scheduler hands
        out the same block ids on each)."""
        return _fit(dataclasses.replace(self, blocks=blocks, bytes_per_rank=blocks * self.bytes_per_rank // self.blocks))


def plan_kv(cfg: ModelConfig, heads: int, dtype: torch.dtype, device: torch.device, max_batch: int,
            kv_cache_memory: float | None = None, max_model_len: int | None = None, block_size: int = 16,
            local_ranks: int = 1) -> KVPlan:
    """Blocks per rank for `--kv-cache-memory` GiB (None: `kv_cache.free_memory`'s share for one of `local_ranks`
    ranks on this machine, at most what `max_batch` sequences of the model length fill), and the model length it
    serves: `--max-model-len` (None: the model's context), lowered with a reason when the pool cannot hold one such
    sequence."""
    asked = max_model_len or cfg.seq_len
    if asked > cfg.seq_len:
        raise ValueError(f"--max-model-len {asked}: the model's context is {cfg.seq_len} tokens; give at most that")
    per_block = block_bytes(cfg, heads, block_size, dtype)
    if kv_cache_memory is not None:
        budget, why = int(kv_cache_memory * 2**30), f"--kv-cache-memory {kv_cache_memory:g}"
        blocks = pool_blocks(cfg, heads, block_size, dtype, budget)
    else:
        budget, why = free_memory(device, local_ranks)
        blocks = min(pool_blocks(cfg, heads, block_size, dtype, budget), max_batch * _cdiv(asked, block_size))
        why = f"default: {why}, at most --max-batch {max_batch} sequences of {asked} tokens"
    if blocks < 1:
        raise ValueError(f"--kv-cache-memory: {budget / 2**20:.1f} MiB holds no KV block ({per_block / 2**20:.2f} MiB "
                         f"for {block_size} tokens over {cfg.layers} layers); give more memory or a smaller --block-size")
    return _fit(KVPlan(blocks, block_size, asked, blocks * per_block, why))


def _fit(plan: KVPlan) -> KVPlan:
    """`plan` with max_model_len lowered to what its pool holds, if the pool cannot hold one sequence of it."""
    room = plan.blocks * plan.block_size
    if room >= plan.max_model_len:
        return plan
    return dataclasses.replace(plan, max_model_len=room, lowered=f"lowered from {plan.max_model_len}: the KV cache "
                               f"holds {room} tokens; give --kv-cache-memory more to serve longer sequences")


class PagedCache(Cache):
    """Per-layer pools [blocks, heads, block_size, head_dim] and each sequence's block table. A forward runs some
    sequences (`select`): row b is sequence seqs[b], with starts[b] tokens cached and counts[b] new ones (a padded
    batch when the counts differ: batched prefill)."""

    def __init__(self, cfg: ModelConfig, blocks: int, block_size: int, heads: int, device=None,
                 dtype=torch.float32):
        # a packed forward's rows of at most this many new tokens attend in the kernel (each token a row of its own:
        # no Python a row), longer ones in scaled_dot_product_attention, a row at a time: a prompt chunk of up to this
        # many tokens is cheaper through the kernel than through SDPA's gather of its blocks (--attention-kernel-rows)
        self.kernel_rows = kernels.options.current().attention_kernel_rows
        shape = (blocks, heads, block_size, cfg.head_dim)  # heads: this rank's (a 1/tp slice under tensor slicing)
        # zeros, not empty: a gathered block a mask hides still enters the attention product (0 x NaN is NaN)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.blocks, self.block_size, self.device = blocks, block_size, device
        self.max_len = cfg.seq_len
        self.tables: dict[int, list[int]] = {}  # sequence -> its blocks, in order
        cpu = torch.device(device if device is not None else "cpu").type == "cpu"
        kernel = kernels.kernel() if cpu and kernels.available(dtype, torch.device("cpu")) else None
        self._kernel = kernel if kernel is not None and hasattr(kernel, "paged_attention") else None
        self.select([], [], [])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # -- the scheduler's block tables (export/serve/step.py) --------------------------------------------------------

    def extend(self, seq: int, blocks: list[int]) -> None:
        self.tables.setdefault(seq, []).extend(blocks)

    def drop(self, seq: int) -> None:
        self.tables.pop(seq, None)

    @property
    def packs(self) -> bool:
        """Whether this cache runs packed forwards (`select(..., packed=True)`): the attention kernel is here."""
        return self._kernel is not None

    def select(self, seqs: list[int], starts: list[int], counts: list[int], packed: bool = False) -> "PagedCache":
        """The rows of the next forward, in the order of its batch: their sequences, tokens cached, new tokens.
        `packed`: the forward's input is the rows' new tokens one after another, [1, sum(counts)] (see the module)."""
        if packed and not self.packs:
            raise ValueError("a packed forward needs the CPU attention kernel (csrc/attention.cpp paged_attention)")
        self.seqs, self._start, self.counts = list(seqs), list(starts), list(counts)
        self._packed = packed
        self._padded = len(set(self.counts)) > 1 and not packed
        self._pos: dict[int, torch.Tensor] = {}
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        end = max((s + n for s, n in zip(self._start, self.counts)), default=0)
        width = max(_cdiv(end, self.block_size), 1)
        table = []
        for seq, s, n in zip(self.seqs, self._start, self.counts):
            blocks = self.tables.get(seq, [])
            if len(blocks) * self.block_size < s + n:
                raise ValueError(f"KV cache: sequence {seq} has {len(blocks)} blocks of {self.block_size}, "
                                 f"{s + n} tokens needed")
            table.append(blocks[:width] + [0] * (width - len(blocks[:width])))  # past a row's end: masked
        self._table = torch.tensor(table, dtype=torch.long).view(len(table), width)  # [B, blocks]
        self._table_dev = self._table.to(self.device) if self.device is not None else self._table
        if packed:
            self._plan_packed()
        return self

    def _plan_packed(self) -> None:
        """A packed forward's plan: each token's position and slot, the tokens of the short rows (for the kernel) and
        the longer rows (token offset, cached tokens, new tokens, table row)."""
        offsets = [0]
        for n in self.counts:
            offsets.append(offsets[-1] + n)
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(self._start, self.counts)]) if self.counts else \
            torch.zeros(0, dtype=torch.long)
        counts = torch.tensor(self.counts, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(self.counts)), counts)  # each token's row
        blocks = self._table[rows, pos // self.block_size]
        self._packed_pos = pos[None].to(self.device) if self.device is not None else pos[None]
        self._packed_slots = blocks, pos % self.block_size
        # rows of up to kernel_rows new tokens attend in the kernel, each token as a row of its own: its position its
        # start, its row's block table (the kernel writes every token's key and value before it reads any)
        self._kernel_tokens = (counts[rows] <= self.kernel_rows).nonzero().squeeze(1)  # indices in the packed forward
        self._kernel_table = self._table[rows[self._kernel_tokens]]
        self._kernel_starts = pos[self._kernel_tokens].tolist()
        self._long = [(offsets[b], s, n, b) for b, (s, n) in enumerate(zip(self._start, self.counts))
                      if n > self.kernel_rows]

    # -- pipeline.model.Cache -------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """For the model's context check and the keys read: the longest row before this forward, or with a padded
        or packed batch, the longest row after it less the forward's T (so that length + T is that row's end; packed,
        it may be negative)."""
        if self._padded or self._packed:  # T: the longest row's count, or packed, every row's
            T = sum(self.counts) if self._packed else max(self.counts)
            return max(s + n for s, n in zip(self._start, self.counts)) - T
        return max(self._start, default=0)

    def advance(self, T: int) -> None:  # after a forward: every row is its count longer
        self._start = [s + n for s, n in zip(self._start, self.counts)]
        self._pos, self._slots = {}, {}
        self._padded = self._packed = False

    def _offsets(self, T: int) -> torch.Tensor:
        """[B, T]: each new token's position in its row (padding included, past its row's end)."""
        start = torch.tensor(self._start, dtype=torch.long, device=self.device)
        return start[:, None] + torch.arange(T, device=self.device)

    def positions(self, T: int) -> torch.Tensor:
        if self._packed:
            return self._packed_pos  # [1, T]
        if T not in self._pos:
            pos = torch.tensor(self._start, dtype=torch.long, device=self.device)[:, None] if T == 1 else \
                self._offsets(T)  # a decode step's: each row's next position (one op where _offsets takes three)
            self._pos[T] = pos.clamp_max(self.max_len - 1) if self._padded else pos  # padding stays in range
        return self._pos[T]

    def token_mask(self, T: int) -> torch.Tensor | None:
        if not self._padded:
            return None
        counts = torch.tensor(self.counts, device=self.device)
        return torch.arange(T, device=self.device)[None, :] < counts[:, None]  # [B, T]

    def _where(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) [n] of each real new token, rows in order, tokens in order."""
        if T not in self._slots:
            pos = self._offsets(T)  # [B, T]
            if self._padded:
                real = self.token_mask(T)
                pos = pos.clamp_max(self._table.shape[1] * self.block_size - 1)
            blocks = self._table_dev.gather(1, pos // self.block_size)  # [B, T]
            offsets = pos % self.block_size
            if self._padded:
                blocks, offsets = blocks[real], offsets[real]
            self._slots[T] = blocks.reshape(-1), offsets.reshape(-1)
        return self._slots[T]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, T, D = k.shape
        end = self.length + T
        K, V = self.k[layer], self.v[layer]
        blocks, offsets = self._where(T)
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, T, H, D]
        if self._padded:  # only the real tokens are written: padding must not overwrite a row's keys
            real = self.token_mask(T)
            kt, vt = kt[real], vt[real]  # [n, H, D]
        else:
            kt, vt = kt.reshape(B * T, H, D), vt.reshape(B * T, H, D)
        K[blocks, :, offsets] = kt  # at (block, :, offset, :)
        V[blocks, :, offsets] = vt
        # each row's blocks side by side: [B, n, H, bs, D] -> [B, H, n * bs, D], cut at the longest row's end
        n = _cdiv(end, self.block_size)
        table = self._table_dev[:, :n]
        keys = K[table].transpose(1, 2).reshape(B, H, n * self.block_size, D)[:, :, :end]
        values = V[table].transpose(1, 2).reshape(B, H, n * self.block_size, D)[:, :, :end]
        return keys, values

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        B, H, T, D = q.shape
        K = self.k[layer]
        if self._packed:
            return self._attend_packed(layer, q, k, v)
        if self._kernel is None or T != 1 or self._padded or B == 0 or q.dtype != K.dtype:
            return None
        y = self._kernel.paged_attention(q.reshape(B, H, D).contiguous(), k.reshape(B, -1, D).contiguous(),
                                         v.reshape(B, -1, D).contiguous(), K, self.v[layer], self._table, self._start)
        return y.view(B, H, 1, D)

    def _attend_packed(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A packed forward's attention (q [1, H, N, D], k and v [1, Hkv, N, D]): the one-token rows in one kernel
        call (which writes their keys and values), then each longer row: its keys and values written at its slots,
        its queries over its own blocks, causal after its cached tokens."""
        K, V = self.k[layer], self.v[layer]
        H, Hkv, D = q.shape[1], k.shape[1], q.shape[3]
        y = torch.empty_like(q)
        if len(self._kernel_starts):
            idx = self._kernel_tokens
            one = self._kernel.paged_attention(q[0, :, idx].transpose(0, 1).contiguous(),
                                               k[0, :, idx].transpose(0, 1).contiguous(),
                                               v[0, :, idx].transpose(0, 1).contiguous(), K, V, self._kernel_table,
                                               self._kernel_starts)  # [tokens, H, D]
            y[0, :, idx] = one.transpose(0, 1)
        blocks, offsets = self._packed_slots
        for off, start, n, b in self._long:
            end = start + n
            K[blocks[off:off + n], :, offsets[off:off + n]] = k[0, :, off:off + n].transpose(0, 1)
            V[blocks[off:off + n], :, offsets[off:off + n]] = v[0, :, off:off + n].transpose(0, 1)
            table = self._table_dev[b, :_cdiv(end, self.block_size)]
            keys = K[table].transpose(0, 1).reshape(Hkv, -1, D)[None, :, :end]  # [1, Hkv, end, D]
            values = V[table].transpose(0, 1).reshape(Hkv, -1, D)[None, :, :end]
            mask = None if start == 0 else \
                torch.ones(n, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
            y[:, :, off:off + n] = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, off:off + n], keys, values, attn_mask=mask, is_causal=start == 0, enable_gqa=H != Hkv)
        return y

    def attention_mask(self, T: int) -> torch.Tensor | None:
        """[B, 1, T, keys]: query t of a row sees that row's keys at positions <= its own. None for one row: the
        model's causal masking is then exact."""
        if len(self.seqs) == 1:
            return None
        keys = torch.arange(self.length + T, device=self.device)
        return (keys[None, None, :] <= self.positions(T)[:, :, None])[:, None]
