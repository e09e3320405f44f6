"""Small file helpers shared by the stages: atomic writes (temporary name, then rename) and checksums."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
