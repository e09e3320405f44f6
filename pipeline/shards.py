"""Token shards: how a prepared split is stored on disk, written, and read back.

A split (``train`` or ``val``) is the concatenation, in part order, of its shard files
``{split}-{part:05d}.bin``: raw token ids (``uint16`` below 65,536 entries, else ``uint32``),
each document followed by the end-of-document id, as Megatron's indexed datasets store them.
A part covers a run of consecutive input documents; ``PartWriter`` appends to the part's
shard files under temporary names and commits the part by renaming them into place, then
writing ``part-{part:05d}.json`` (the part's document range and counts) last; the
part's document ids are in ``{split}-{part:05d}.ids``, one JSON string per line. A killed preparation so
loses at most the part it was writing: ``PartWriter.committed`` reads the parts already
done and the preparation goes on after the last of them.

``TokenShards`` memory-maps a split's shard files and reads any range of its token stream
as one array, across shard boundaries: what ``pipeline.data.PackedTokens`` cuts training
blocks from. Nothing here holds a whole split in memory.

``ordered_map`` runs the tokenizer in worker processes with a bounded number of batches in
flight, and yields results in input order, so the shards are the same for any worker count.

Not run directly: ``python -m pipeline.data`` prepares data through this module.
"""

from __future__ import annotations

import json
import operator
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import multiprocessing
import numpy as np

from pipeline.artifacts import atomic_write_text

SPLITS = ("train", "val")


def shard_name(split: str, part: int) -> str:
    return f"{split}-{part:05d}.bin"


def part_name(part: int) -> str:
    return f"part-{part:05d}.json"


def ids_name(split: str, part: int) -> str:
    return f"{split}-{part:05d}.ids"


# --------------------------------------------------------------------------- reading


class TokenShards:
    """A split's token stream over its memory-mapped shard files.

    ``len``, integer indexing and contiguous slices (``shards[a:b]``, a view when the range
    lies in one shard, else one new array) behave as on the flat array; ``chunks()`` walks
    the stream without loading it; ``np.asarray(shards)`` loads it whole (small data only).
    """

    def __init__(self, files: Sequence[Path], sizes: Sequence[int], dtype: np.dtype | str) -> None:
        self.dtype = np.dtype(dtype)
        kept = [(Path(f), int(n)) for f, n in zip(files, sizes, strict=True) if n > 0]
        self._maps: list[np.memmap] = []
        for path, n in kept:
            actual = path.stat().st_size if path.is_file() else -1
            if actual != n * self.dtype.itemsize:
                raise ValueError(
                    f"data cache {path} is damaged ({actual} bytes, expected "
                    f"{n * self.dtype.itemsize}); delete {path.parent} and run again"
                )
            self._maps.append(np.memmap(path, dtype=self.dtype, mode="r"))
        self._starts = np.cumsum([0] + [n for _, n in kept], dtype=np.int64)
        self.size = int(self._starts[-1])
        self.files = [p for p, _ in kept]

    def __len__(self) -> int:
        return self.size

    def _shard_of(self, i: int) -> int:
        return int(np.searchsorted(self._starts, i, side="right")) - 1

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step != 1:
                raise ValueError("token shards read contiguous ranges only (slice step 1)")
            return self._range(start, max(start, stop))
        i = operator.index(key)
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"token {key} out of range ({self.size} tokens)")
        s = self._shard_of(i)
        return self._maps[s][i - self._starts[s]]

    def _range(self, a: int, b: int) -> np.ndarray:
        if a >= b:
            return np.zeros(0, dtype=self.dtype)
        first, last = self._shard_of(a), self._shard_of(b - 1)
        pieces = [
            self._maps[s][max(a, self._starts[s]) - self._starts[s] : min(b, self._starts[s + 1]) - self._starts[s]]
            for s in range(first, last + 1)
        ]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def chunks(self, size: int = 1 << 24) -> Iterator[np.ndarray]:
        """The stream in pieces of at most ``size`` tokens, each a memory-mapped view."""
        for m in self._maps:
            for start in range(0, len(m), size):
                yield m[start : start + size]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.concatenate(self._maps) if self._maps else np.zeros(0, dtype=self.dtype)
        return out if dtype is None else out.astype(dtype)


# --------------------------------------------------------------------------- writing


class PartWriter:
    """Writes parts into ``directory``, each committed whole (see the module docstring).

    ``add`` appends a batch's tokens for one split to the open part; ``maybe_commit``
    commits it once it holds ``shard_tokens`` tokens (so a shard is about that size);
    ``finish`` commits the last, partial one.
    """

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int) -> None:
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens={shard_tokens} must be positive")
        self.directory = Path(directory)
        self.dtype = np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.parts = committed_parts(self.directory)
        for stale in self.directory.glob("*.tmp"):  # the part a killed run was writing
            stale.unlink()
        self.doc_start = self.parts[-1]["doc_end"] if self.parts else 0
        self._open: dict[str, Any] = {}
        self._counts = self._empty()

    @staticmethod
    def _empty() -> dict[str, dict[str, Any]]:
        return {s: {"tokens": 0, "documents": 0, "characters": 0} for s in SPLITS}

    def _file(self, name: str) -> Any:
        f = self._open.get(name)
        if f is None:
            f = self._open[name] = open(self.directory / (name + ".tmp"), "wb")
        return f

    @property
    def part(self) -> int:
        return len(self.parts)

    def add(self, split: str, tokens: np.ndarray, ids: Sequence[str], characters: int) -> None:
        if tokens.size:
            self._file(shard_name(split, self.part)).write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        if ids:
            self._file(ids_name(split, self.part)).write(
                "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in ids).encode("utf-8"))
        c = self._counts[split]
        c["tokens"] += int(tokens.size)
        c["documents"] += len(ids)
        c["characters"] += characters

    def maybe_commit(self, doc_end: int) -> None:
        if sum(c["tokens"] for c in self._counts.values()) >= self.shard_tokens:
            self._commit(doc_end)

    def finish(self, doc_end: int) -> list[dict[str, Any]]:
        if doc_end > self.doc_start or not self.parts:
            self._commit(doc_end)
        return self.parts

    def _commit(self, doc_end: int) -> None:
        for name, f in self._open.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(self.directory / (name + ".tmp"), self.directory / name)
        self._open = {}
        record = {"part": self.part, "doc_start": self.doc_start, "doc_end": doc_end, "splits": self._counts}
        atomic_write_text(self.directory / part_name(self.part), json.dumps(record, indent=1))
        self.parts.append(record)
        self.doc_start = doc_end
        self._counts = self._empty()

    def close(self) -> None:
        """Drop the uncommitted part (after an error): its files are removed at the next start."""
        for f in self._open.values():
            f.close()
        self._open = {}


def committed_parts(directory: Path) -> list[dict[str, Any]]:
    """The parts committed in ``directory``, in order (a gap ends the list)."""
    parts: list[dict[str, Any]] = []
    while (Path(directory) / part_name(len(parts))).is_file():
        parts.append(json.loads((Path(directory) / part_name(len(parts))).read_text(encoding="utf-8")))
    return parts


def document_ids(directory: Path, split: str) -> Iterator[str]:
    """The ids of ``split``'s documents in stream order, read from the committed parts."""
    for p in committed_parts(directory):
        path = Path(directory) / ids_name(split, p["part"])
        if p["splits"][split]["documents"]:
            with path.open(encoding="utf-8") as f:
                yield from (json.loads(line) for line in f)


# --------------------------------------------------------------------------- workers

J = TypeVar("J")
M = TypeVar("M")
R = TypeVar("R")


def default_workers() -> int:
    """The CPU cores this process may use, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def ordered_map(fn: Callable[[J], R], jobs: Iterable[tuple[M, J]], workers: int,
                initializer: Callable[..., None], initargs: tuple = ()) -> Iterator[tuple[M, R]]:
    """``(meta, fn(job))`` for each ``(meta, job)``, in input order.

    ``workers > 1`` runs ``fn`` in that many worker processes (forked where the platform
    can, so they start at once) with at most ``2 * workers`` jobs in flight: the input is
    read only as fast as results are taken, so memory stays bounded. ``workers <= 1``
    runs in this process.
    """
    if workers <= 1:
        initializer(*initargs, single_thread=False)
        for meta, job in jobs:
            yield meta, fn(job)
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                             initializer=initializer, initargs=initargs) as pool:
        pending: deque = deque()
        for meta, job in jobs:
            pending.append((meta, pool.submit(fn, job)))
            if len(pending) >= 2 * workers:
                meta0, future = pending.popleft()
                yield meta0, future.result()
        while pending:
            meta0, future = pending.popleft()
            yield meta0, future.result()
