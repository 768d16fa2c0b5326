"""File helpers every writer shares: checksums and atomic writes (temp file + rename)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_bytes(path: str | Path, data: Any) -> None:
    """Write ``data`` (bytes or any buffer) to ``path`` via a temp file in the same folder + fsync + rename.

    A reader sees the old file or the new one, never a partial one; on failure the temp
    file is removed and ``path`` is untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(memoryview(data))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
