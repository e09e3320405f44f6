"""Tokenized data: the cache of token shards that training reads.

``prepare_data`` tokenizes both splits into token shards (``pipeline.shards``: each
document followed by the end-of-document id, memory-mapped at training time) under a
cache directory keyed by everything that affects the tokens (not ``seq_len``: packing
happens at read time, see ``PackedTokens`` and ``global_sample_ids`` in
``pipeline.data.sampling``). It streams: documents are read one at a time, tokenized in
``data.workers`` processes in order, and written part by part, so memory stays flat as
the corpus grows (one document at a time is held whole) and a killed preparation
resumes after its last finished part.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from pipeline.artifacts import atomic_write_text
from pipeline.data.sources import Document, Split, _resolve_sources, find_split, iter_documents
from pipeline.data.tokenizers import build_tokenizer, load_tokenizer, save_tokenizer, tokenizer_fingerprint
from pipeline.shards import SPLITS, PartWriter, TokenShards, default_workers, ordered_map, shard_name

if TYPE_CHECKING:
    from pipeline.recipe import DataSpec

# Bump when the on-disk format or the tokenization changes, so old caches are not reused.
FORMAT_VERSION = 2  # 2: token shards (pipeline/shards.py) instead of one train.bin/val.bin

# Documents per tokenizer batch of encode_documents: small enough for a smooth progress
# bar, large enough for the tokenizers library to spread a batch over all cores.
ENCODE_BATCH = 16
# A batch sent to a tokenizer worker process: this many characters or documents,
# whichever comes first (a longer document is a batch alone).
BATCH_CHARS = 1 << 20
BATCH_DOCS = 4096
# Tokens per part (pipeline/shards.py): 512 MiB shards at uint16; a killed preparation
# redoes at most one part.
SHARD_TOKENS = 1 << 28


@dataclass
class PreparedData:
    tokenizer: PreTrainedTokenizerFast
    train: TokenShards
    val: TokenShards
    eod_id: int
    vocab_size: int
    cache_dir: Path
    meta: dict[str, Any]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def encode_documents(
    tok: PreTrainedTokenizerFast,
    docs: Sequence[Document],
    eod_id: int,
    dtype: np.dtype,
    desc: str = "tokenizing",
) -> np.ndarray:
    """All documents' token ids, each document followed by ``eod_id``, as one flat array
    in memory (for small inputs; ``prepare_data`` streams into shards)."""
    backend = tok.backend_tokenizer  # the Rust tokenizer: parallel batch encoding
    eod = np.array([eod_id], dtype=dtype)
    parts: list[np.ndarray] = []
    with tqdm(total=len(docs), desc=desc, unit="doc") as bar:
        for start in range(0, len(docs), ENCODE_BATCH):
            batch = docs[start : start + ENCODE_BATCH]
            encodings = backend.encode_batch([d.text for d in batch], add_special_tokens=False)
            for enc in encodings:
                parts.extend((np.asarray(enc.ids, dtype=dtype), eod))
            bar.update(len(batch))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def cache_key_inputs(cfg: DataSpec) -> dict[str, Any]:
    """Everything that changes the token files. ``seq_len`` is deliberately absent:
    blocks are cut at read time, so a new ``seq_len`` reuses the cache; so are
    ``workers`` and the shard size, which change how the tokens are made and stored,
    not what they are."""
    inputs: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "sources": [s.fingerprint | {"kind": s.kind} for s in _resolve_sources(cfg)],
        "text_field": cfg.text_field,
        "validation_fraction": cfg.validation_fraction,
        "tokenizer": cfg.tokenizer,
    }
    if cfg.tokenizer == "bpe":
        inputs["vocab_size"] = cfg.vocab_size
    elif cfg.tokenizer != "gpt2":  # a checkpoint's: keyed by its files, wherever they are
        inputs["tokenizer"] = {"checkpoint": tokenizer_fingerprint(Path(cfg.tokenizer)), "special_tokens": True}
    return inputs


def cache_key(cfg: DataSpec) -> str:
    blob = json.dumps(cache_key_inputs(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# The tokenizer of this worker process, set by _start_worker: (tokenizer, eod id, dtype).
_WORKER: tuple[Tokenizer, int, np.dtype] | None = None


def _start_worker(tokenizer_file: str, eod_id: int, dtype: str, specials: bool = False,
                  single_thread: bool = True) -> None:
    global _WORKER
    if single_thread:  # one worker process per core already: no thread pool in each
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER = (Tokenizer.from_file(tokenizer_file), eod_id, np.dtype(dtype), specials)


def _encode_batch(job: tuple[list[str], list[bool]]) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens) of one batch, each document followed by EOD. `specials` (a checkpoint's
    tokenizer): each document as the tokenizer frames one (Llama's and Mixtral's BOS first), EOD not doubled."""
    assert _WORKER is not None, "_start_worker runs first"
    tok, eod_id, dtype, specials = _WORKER
    texts, held_out = job
    eod = np.array([eod_id], dtype=dtype)
    out: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for enc, val in zip(tok.encode_batch(texts, add_special_tokens=specials), held_out, strict=True):
        ids = np.asarray(enc.ids, dtype=dtype)
        out[val].extend((ids,) if specials and len(ids) and ids[-1] == eod_id else (ids, eod))
    return tuple(np.concatenate(out[v]) if out[v] else np.zeros(0, dtype) for v in (False, True))  # type: ignore[return-value]


@dataclass
class _Batch:
    """What the main process keeps of a batch sent to a worker."""

    doc_end: int  # index (in the document stream) after its last document
    ids: dict[str, list[str]]
    characters: dict[str, int]


def _batches(docs: Iterator[Document], split: Split, skip: int,
             batch_chars: int) -> Iterator[tuple[_Batch, tuple[list[str], list[bool]]]]:
    """Consecutive documents after the first ``skip``, in batches of about ``batch_chars``."""
    index = 0
    texts: list[str] = []
    flags: list[bool] = []
    meta = _Batch(0, {"train": [], "val": []}, {"train": 0, "val": 0})
    for doc in docs:
        index += 1
        if index <= skip:
            continue
        val = split.held_out(doc.id)
        name = "val" if val else "train"
        texts.append(doc.text)
        flags.append(val)
        meta.ids[name].append(doc.id)
        meta.characters[name] += len(doc.text)
        if sum(meta.characters.values()) >= batch_chars or len(texts) >= BATCH_DOCS:
            meta.doc_end = index
            yield meta, (texts, flags)
            texts, flags = [], []
            meta = _Batch(0, {"train": [], "val": []}, {"train": 0, "val": 0})
    if texts:
        meta.doc_end = index
        yield meta, (texts, flags)


def _prepare_tokenizer(cfg: DataSpec, split: Split, work: Path) -> PreTrainedTokenizerFast:
    directory = work / "tokenizer"
    if (directory / "tokenizer.json").is_file():  # a resumed run: trained (and renamed into place) already
        return load_tokenizer(directory)
    train_docs = (d for d in iter_documents(cfg) if not split.held_out(d.id))
    tok = build_tokenizer(cfg, train_docs)
    tmp = work / "tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_tokenizer(tok, tmp)
    os.replace(tmp, directory)
    return tok


def _build_cache(cfg: DataSpec, key_inputs: dict[str, Any], key: str, work: Path,
                 workers: int, shard_tokens: int) -> None:
    """Tokenize everything into ``work``, resuming what a killed run left there; the
    steps (split, tokenizer, parts) each write their result under a temporary name."""
    split_file = work / "split.json"
    if split_file.is_file():
        split = Split(**json.loads(split_file.read_text(encoding="utf-8")))
    else:
        split = find_split(cfg, work / "digests.tmp")
        atomic_write_text(split_file, json.dumps(asdict(split)))
    tok = _prepare_tokenizer(cfg, split, work)
    eod_id = tok.eos_token_id  # EOD_TOKEN in ours; a checkpoint's end-of-sequence token
    dtype = token_dtype(len(tok))
    writer = PartWriter(work, dtype, shard_tokens)
    done = writer.doc_start
    # a part ends after a batch, so a batch is not larger than a part
    jobs = _batches(iter_documents(cfg), split, skip=done, batch_chars=min(BATCH_CHARS, shard_tokens))
    specials = cfg.tokenizer not in ("gpt2", "bpe")  # a checkpoint's: documents framed as its pretraining saw them
    init = (str(work / "tokenizer" / "tokenizer.json"), eod_id, dtype.name, specials)
    try:
        with tqdm(total=split.documents, initial=done, desc="tokenizing", unit="doc") as bar:
            for batch, tokens in ordered_map(_encode_batch, jobs, workers, _start_worker, init):
                for name, part in zip(SPLITS, tokens):
                    writer.add(name, part, batch.ids[name], batch.characters[name])
                writer.maybe_commit(batch.doc_end)
                bar.update(batch.doc_end - done)
                done = batch.doc_end
        if done != split.documents:
            raise ValueError(
                f"data.train: the corpus changed while it was prepared ({done} documents now, "
                f"{split.documents} when it was indexed); run again"
            )
        parts = writer.finish(done)
    finally:
        writer.close()
    splits: dict[str, Any] = {}
    for name in SPLITS:
        counts = [p["splits"][name] for p in parts]
        splits[name] = {
            "tokens": sum(c["tokens"] for c in counts),
            "documents": sum(c["documents"] for c in counts),
            "characters": sum(c["characters"] for c in counts),
            "shard_tokens": [c["tokens"] for c in counts],  # one entry per part
        }
    if (splits["val"]["documents"], splits["train"]["documents"]) != (split.validation, split.documents - split.validation):
        raise ValueError(f"data cache {work}: the parts do not add up to the split {split}; delete it and run again")
    meta = {
        "key": key,
        "key_inputs": key_inputs,
        "vocab_size": len(tok),
        "eod_id": eod_id,
        "dtype": dtype.name,
        "split": asdict(split),
        "splits": splits,
    }
    # meta.json last: its presence marks a complete cache.
    atomic_write_text(work / "meta.json", json.dumps(meta, indent=1))


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock`` (every process preparing this cache waits here)."""
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_data(cfg: DataSpec, cache_root: Path, *, shard_tokens: int = SHARD_TOKENS) -> PreparedData:
    """Tokenized train/val token streams for ``cfg``, from the cache when possible.

    A missing cache is built in ``.{key}.partial`` beside it, under a lock (another
    process waits, then reads the finished cache), and renamed into place when complete;
    a killed build is resumed by the next call. ``data.workers`` processes tokenize.
    """
    cache_root = Path(cache_root)
    key_inputs = cache_key_inputs(cfg)
    key = cache_key(cfg)
    cache_dir = cache_root / key[:16]
    if not (cache_dir / "meta.json").is_file():
        cache_root.mkdir(parents=True, exist_ok=True)
        lock = cache_root / f".{key[:16]}.lock"
        with _exclusive(lock):
            if not (cache_dir / "meta.json").is_file():
                if cache_dir.exists():
                    raise ValueError(f"data cache {cache_dir} is incomplete (no meta.json); delete it and run again")
                work = cache_root / f".{key[:16]}.partial"
                work.mkdir(exist_ok=True)
                work.chmod(0o755)  # the cache is meant to be shared
                workers = default_workers() if cfg.workers is None else cfg.workers
                _build_cache(cfg, key_inputs, key, work, workers, shard_tokens)
                os.rename(work, cache_dir)
            # whoever holds the lock with the cache complete removes it: a process still
            # waiting on the old file then finds the cache complete too
            lock.unlink(missing_ok=True)
    meta = json.loads((cache_dir / "meta.json").read_text(encoding="utf-8"))
    tok = load_tokenizer(cache_dir / "tokenizer", seq_len=cfg.seq_len)
    shards = {name: TokenShards([cache_dir / shard_name(name, i) for i in range(len(meta["splits"][name]["shard_tokens"]))],
                                meta["splits"][name]["shard_tokens"], meta["dtype"])
              for name in SPLITS}
    return PreparedData(
        tokenizer=tok,
        train=shards["train"],
        val=shards["val"],
        eod_id=int(meta["eod_id"]),
        vocab_size=len(tok),
        cache_dir=cache_dir,
        meta=meta,
    )
