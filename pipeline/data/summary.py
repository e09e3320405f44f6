"""``python -m pipeline.data``: a summary of a corpus, documents, characters and tokens
per split, from the data cache (prepared on the way; a temporary one by default)."""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.data.cache import SHARD_TOKENS, prepare_data
from pipeline.data.sampling import unigram_entropy
from pipeline.shards import SPLITS, document_ids

if TYPE_CHECKING:
    from pipeline.recipe import DataSpec


def _summary(cfg: DataSpec, cache_root: Path | None, shard_tokens: int = SHARD_TOKENS) -> str:
    started = time.perf_counter()

    def summarize(root: Path) -> tuple[dict[str, Any], int, dict[str, float], list[str]]:
        data = prepare_data(cfg, root, shard_tokens=shard_tokens)
        entropy = {s: unigram_entropy(getattr(data, s), data.eod_id) for s in SPLITS}
        held_out = list(itertools.islice(document_ids(data.cache_dir, "val"), 13))
        return data.meta, data.vocab_size, entropy, held_out

    if cache_root is None:
        with tempfile.TemporaryDirectory(prefix="moe-data-") as tmp:
            meta, vocab, entropy, val_ids = summarize(Path(tmp))  # the memory maps close on return
    else:
        meta, vocab, entropy, val_ids = summarize(cache_root)
    elapsed = time.perf_counter() - started
    lines = [
        f"corpus {cfg.train!r}, tokenizer {cfg.tokenizer} (vocab {vocab:,}), "
        f"validation_fraction {cfg.validation_fraction}, {elapsed:.1f} s",
        f"{'split':<6}{'documents':>11}{'characters':>14}{'tokens':>13}"
        f"{'chars/tok':>11}{'unigram H':>11}",
    ]
    for name in ("train", "val"):
        s = meta["splits"][name]
        lines.append(
            f"{name:<6}{s['documents']:>11,}{s['characters']:>14,}{s['tokens']:>13,}"
            f"{s['characters'] / s['tokens']:>11.2f}{entropy[name]:>11.3f}"
        )
    lines.append(f"held out: {', '.join(val_ids[:12])}{' …' if len(val_ids) > 12 else ''}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.data",
        description="Summarize a corpus: documents, characters and tokens per split.",
    )
    parser.add_argument("train", nargs="*", default=["bundled"],
                        help="'bundled' (default), 'hf:NAME[:CONFIG]', "
                             "or .txt/.jsonl/.parquet files or globs")
    # defaults come from the recipe schema (DataSpec): one place
    parser.add_argument("--tokenizer", choices=["gpt2", "bpe"], default=None)
    parser.add_argument("--vocab-size", type=int, default=None, help="for --tokenizer bpe")
    parser.add_argument("--validation-fraction", type=float, default=None)
    parser.add_argument("--text-field", default=None)
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenizer processes (0: this one; default: the cores, at most 16)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="keep the tokenized data here (default: a temporary directory)")
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS,
                        help=f"tokens per shard file (default {SHARD_TOKENS:,})")
    args = parser.parse_args(argv)
    from pipeline.recipe import DataSpec

    given = {"text_field": args.text_field, "validation_fraction": args.validation_fraction,
             "tokenizer": args.tokenizer, "vocab_size": args.vocab_size, "workers": args.workers}
    try:
        cfg = DataSpec(train=args.train[0] if len(args.train) == 1 else list(args.train),
                       **{k: v for k, v in given.items() if v is not None})
        print(_summary(cfg, args.cache_dir, args.shard_tokens))
    except ValueError as err:  # pydantic's ValidationError is a ValueError too
        parser.exit(2, f"error: {err}\n")
    return 0
