"""Packing and sampling: training blocks cut from a prepared token stream at read time.

``PackedTokens`` cuts a split into ``seq_len`` blocks (so a new ``seq_len`` reuses the
cache), ``global_sample_ids`` orders the blocks epoch by epoch from a seed alone, and
``unigram_entropy`` is the loss a model that ignores context would reach.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from pipeline.shards import TokenShards


class PackedTokens:
    """A token stream cut into ``seq_len`` blocks for next-token prediction.

    Block ``i`` reads ``tokens[i*T : i*T + T + 1]``: inputs are the first ``T``,
    labels the last ``T``. Documents run across block boundaries (packing); the
    remainder after the last whole block is dropped.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, eod_id: int, name: str = "data") -> None:
        if seq_len < 1:
            raise ValueError(f"data.seq_len={seq_len} must be positive")
        self.tokens = tokens
        self.seq_len = seq_len
        self.eod_id = eod_id
        self.num_blocks = max(0, (len(tokens) - 1) // seq_len)
        if self.num_blocks == 0:
            raise ValueError(
                f"data.seq_len={seq_len} is too long for the {name} split: it has "
                f"{len(tokens)} tokens and one block needs {seq_len + 1}; lower "
                "data.seq_len or add more text (or raise data.validation_fraction)"
            )

    def __len__(self) -> int:
        return self.num_blocks

    def batch(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """``input_ids``, ``labels`` (int64) and ``loss_mask`` (float32), each [B, T]."""
        T = self.seq_len
        rows = []
        for i in block_ids:
            i = int(i)
            if not 0 <= i < self.num_blocks:
                raise IndexError(f"block {i} out of range (0..{self.num_blocks - 1})")
            rows.append(np.asarray(self.tokens[i * T : i * T + T + 1], dtype=np.int64))
        if rows:
            window = torch.from_numpy(np.stack(rows))
        else:
            window = torch.zeros(0, T + 1, dtype=torch.int64)
        input_ids, labels = window[:, :-1], window[:, 1:]
        # As Megatron's eod_mask_loss: after EOD the next document is unrelated, so
        # predicting its first token from the previous document is not scored.
        loss_mask = (input_ids != self.eod_id).to(torch.float32)
        return {
            "input_ids": input_ids.contiguous(),
            "labels": labels.contiguous(),
            "loss_mask": loss_mask,
        }


@functools.lru_cache(maxsize=2)  # the current epoch and the next: a step reads a few ids, not a new permutation
def _epoch_order(num_blocks: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(num_blocks)
    order.flags.writeable = False
    return order


def global_sample_ids(num_blocks: int, seed: int, start: int, count: int) -> np.ndarray:
    """Block ids of global samples ``start .. start+count-1``.

    Sample ``s`` is position ``s % num_blocks`` of epoch ``s // num_blocks``, whose order
    is a permutation from ``np.random.default_rng([seed, epoch])``. Depending only on
    these arguments, a resumed job continues from its global sample index alone.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks={num_blocks} must be positive")
    if start < 0 or count < 0:
        raise ValueError(f"start={start} and count={count} must not be negative")
    out: list[np.ndarray] = []
    s, end = start, start + count
    while s < end:
        epoch, offset = divmod(s, num_blocks)
        take = min(num_blocks - offset, end - s)
        out.append(_epoch_order(num_blocks, seed, epoch)[offset : offset + take])
        s += take
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)


def unigram_entropy(tokens: np.ndarray | TokenShards, eod_id: int | None = None) -> float:
    """Entropy (nats) of the token frequencies in ``tokens``, without ``eod_id`` if given:
    the loss of a model that ignores context, which a trained LM must beat. Counted a
    chunk at a time, so a split of any size is read without loading it."""
    step = 1 << 22  # 32 MiB as int64
    if isinstance(tokens, TokenShards):
        chunks: Iterable[np.ndarray] = tokens.chunks(step)
    else:
        flat = np.asarray(tokens).reshape(-1)
        chunks = (flat[i : i + step] for i in range(0, flat.size, step))
    counts = np.zeros(0, dtype=np.int64)
    for chunk in chunks:
        c = np.bincount(np.asarray(chunk).astype(np.int64, copy=False))
        if c.size > counts.size:
            c[: counts.size] += counts
            counts = c
        else:
            counts[: c.size] += c
    if eod_id is not None and eod_id < counts.size:
        counts[eod_id] = 0
    counts = counts[counts > 0]
    if counts.size == 0:
        raise ValueError("unigram_entropy: no tokens")
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())
