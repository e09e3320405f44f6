"""csrc/attention.cpp's paged_attention: one new token per row, its key and value written into its row's block of a
paged KV pool, attention over the row's keys gathered through its block table, against scaled_dot_product_attention in
fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from export.serve import kernels

BLOCKS, BS = 12, 4  # the pool: 12 blocks of 4 positions
STARTS = [0, 8, 11]  # tokens cached before the new one: the first token; a new block; the new token filling 3 blocks


def gemv(dtype: torch.dtype):
    if not kernels.available(dtype, torch.device("cpu")):
        pytest.skip(f"the CPU serving kernels are not available for {dtype} here")
    kernel = kernels.kernel()
    assert kernel is not None, "the GEMV kernel did not build on this machine (see the warning)"
    return kernel


def pool_and_tables(dtype, Hkv, D, gen):
    """A random pool and 3 rows' block tables: disjoint, shuffled physical blocks; unused entries -1 or garbage."""
    K = torch.randn(BLOCKS, Hkv, BS, D, generator=gen).to(dtype)
    V = torch.randn(BLOCKS, Hkv, BS, D, generator=gen).to(dtype)
    perm = torch.randperm(BLOCKS, generator=gen).tolist()
    width = max(STARTS) // BS + 2  # a spare entry past every row's blocks
    tables = torch.full((len(STARTS), width), -1, dtype=torch.int64)
    tables[1, :] = 10 ** 9  # never read past the used blocks
    for b, p in enumerate(STARTS):
        used = p // BS + 1
        tables[b, :used] = torch.tensor(perm[:used])
        perm = perm[used:]
    return K, V, tables


def reference(q, k, v, K, V, tables, starts, bs=BS):
    """Each row's keys and values gathered through its table from the pool (blocks of `bs` positions) as it was, the
    new ones appended, SDPA in fp32 (query heads grouped onto the kv heads)."""
    B, H, D = q.shape
    Hkv = K.shape[1]
    out = []
    for b, p in enumerate(starts):
        blocks = tables[b, :p // bs + 1]
        keys = K[blocks].float().permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :p]  # [Hkv, p, D]
        vals = V[blocks].float().permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :p]
        keys = torch.cat([keys, k[b].float()[:, None]], dim=1).repeat_interleave(H // Hkv, dim=0)
        vals = torch.cat([vals, v[b].float()[:, None]], dim=1).repeat_interleave(H // Hkv, dim=0)
        out.append(F.scaled_dot_product_attention(q[b].float()[:, None], keys, vals)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("H, Hkv", [(4, 2), (2, 2)])
@pytest.mark.parametrize("D", [64, 40])  # 40: a tail of the head past the vector width (8 or 16)
def test_paged_attention_equals_sdpa_over_the_gathered_blocks(dtype, tol, H, Hkv, D):
    check_case(gemv(dtype), dtype, tol, H, Hkv, D)


def check_case(kernel, dtype, tol, H, Hkv, D):
    """`kernel`'s paged_attention (any build of csrc/attention.cpp) against SDPA on one random pool."""
    gen = torch.Generator().manual_seed(H * 1000 + D + (dtype == torch.bfloat16))
    K, V, tables = pool_and_tables(dtype, Hkv, D, gen)
    B = len(STARTS)
    q, k, v = (torch.randn(B, h, D, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
    K2, V2 = K.clone(), V.clone()

    y = kernel.paged_attention(q, k, v, K2, V2, tables, STARTS)

    assert y.dtype == dtype and y.shape == (B, H, D)
    torch.testing.assert_close(y.float(), reference(q, k, v, K, V, tables, STARTS), atol=tol, rtol=tol)
    expect_K, expect_V = K.clone(), V.clone()
    for b, p in enumerate(STARTS):  # the new key and value at the row's position, nothing else changed
        blk, off = tables[b, p // BS].item(), p % BS
        assert torch.equal(K2[blk, :, off], k[b]) and torch.equal(V2[blk, :, off], v[b])
        expect_K[blk, :, off], expect_V[blk, :, off] = k[b], v[b]
    assert torch.equal(K2, expect_K) and torch.equal(V2, expect_V)


def test_paged_attention_refuses_a_bad_table_and_writes_nothing():
    kernel = gemv(torch.float32)
    gen = torch.Generator().manual_seed(1)
    K, V, tables = pool_and_tables(torch.float32, 2, 16, gen)
    q, k, v = (torch.randn(len(STARTS), h, 16, generator=gen) for h in (4, 2, 2))
    K2, V2 = K.clone(), V.clone()
    for bad, match in [(BLOCKS, "row 2 block 1 is 12, outside the pool"), (-1, "row 2 block 1 is -1, outside the pool")]:
        t = tables.clone()
        t[2, 1] = bad
        with pytest.raises(RuntimeError, match=match):
            kernel.paged_attention(q, k, v, K2, V2, t, STARTS)
    with pytest.raises(RuntimeError, match="outside its block table"):  # position 12 needs a 4th block: 3 wide
        kernel.paged_attention(q, k, v, K2, V2, tables[:, :3].contiguous(), [0, 8, 12])
    with pytest.raises(RuntimeError, match="int64 block tables"):
        kernel.paged_attention(q, k, v, K2, V2, tables.int(), STARTS)
    with pytest.raises(RuntimeError, match="a block table row per query row"):
        kernel.paged_attention(q, k, v, K2, V2, tables[:2], STARTS)
    with pytest.raises(RuntimeError, match="fp32 or bf16, all alike"):
        kernel.paged_attention(q.bfloat16(), k, v, K2, V2, tables, STARTS)
    with pytest.raises(RuntimeError, match="contiguous CPU"):
        kernel.paged_attention(q, k, v, K2, V2, tables.t().contiguous().t(), STARTS)
    assert torch.equal(K2, K) and torch.equal(V2, V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_paged_attention_heads_of_whole_vectors_equal_the_generic_passes_to_the_bit(dtype, D):
    """Heads of 32, 64 or 128 run AVX-512's fixed-size passes (csrc/attention.cpp `scores_fixed`, `values_fixed`); the
    same heads padded with zeros to f^2 times the size (256 or 512) run the generic ones, whose sums the zeros leave
    as they are, the queries times f for the scale 1 / sqrt(D) f times smaller (powers of 2: no rounding). Query
    heads a key head 1, 3 (passes of 2 and 1), 4 and 8; 1 to 70 positions over blocks of 16 and of 5 (keys crossing
    blocks inside a run of 16)."""
    kernel = gemv(dtype)
    gen = torch.Generator().manual_seed(D)
    starts = [0, 4, 15, 16, 17, 33, 47, 69]
    for H, Hkv in [(4, 4), (6, 2), (16, 4), (16, 2)]:
        for bs in (16, 5):
            B, width = len(starts), max(starts) // bs + 2
            blocks = sum(p // bs + 1 for p in starts) + 2
            K, V = (torch.randn(blocks, Hkv, bs, D, generator=gen).to(dtype) for _ in range(2))
            tables = torch.full((B, width), 10 ** 9, dtype=torch.int64)  # entries past a row's blocks: never read
            perm = torch.randperm(blocks, generator=gen).tolist()
            for b, p in enumerate(starts):
                tables[b, :p // bs + 1] = torch.tensor(perm[:p // bs + 1])
                perm = perm[p // bs + 1:]
            q, k, v = (torch.randn(B, h, D, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
            f = 4 if D == 32 else 2
            pad = lambda t: F.pad(t, (0, D * f * f - D))  # noqa: E731
            y = kernel.paged_attention(q, k, v, K.clone(), V.clone(), tables, starts)
            y_pad = kernel.paged_attention(pad(q * f), pad(k), pad(v), pad(K), pad(V), tables, starts)
            assert torch.equal(y, y_pad[..., :D]), (H, Hkv, bs)
            torch.testing.assert_close(y.float(), reference(q, k, v, K, V, tables, starts, bs), atol=2e-2,
                                       rtol=2e-2)
