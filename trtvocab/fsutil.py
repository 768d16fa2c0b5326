"""File helpers every writer shares: checksums and atomic publication.

Two ways to publish, both "old or new, never a half":

* :func:`atomic_write_bytes`: one file, via a temp file in the same folder, fsync, rename.
* :func:`staging`: a whole folder (an artifact, a quantized checkpoint), built in a private
  sibling and moved into place with one rename.

ONNX graphs with external data are published by ``trtvocab.export.onnx.save_model_atomic``
with the same pieces (a staging folder, :func:`fsync_file`, ``os.replace``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trtvocab.errors import ArtifactError


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: Any) -> str:
    """sha256 of bytes or any buffer (a TensorRT ``IHostMemory``, a memoryview)."""
    return hashlib.sha256(memoryview(data)).hexdigest()


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def staging(out: Path, *, force: bool, is_ours: Callable[[Path], bool]) -> Iterator[Path]:
    """Yield a private folder to build into; on success publish it as ``out`` atomically.

    An existing ``out`` is refused unless ``force``; then it is swapped out by rename and
    deleted only after the new folder is in place. ``force`` replaces only an empty folder
    or one that ``is_ours(out)`` recognizes as this tool's output: never a folder of
    something else that a mistyped ``--out`` points at. On failure the staging folder is
    removed and ``out`` is untouched. Every file is fsynced before the publishing rename.
    """
    out = Path(out)
    if out.exists() and not force:
        raise ArtifactError(f"{out} already exists; pass --force to replace it (atomically)")
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or is_ours(out))):
        raise ArtifactError(f"{out} exists and is not a folder this tool wrote; "
                            "refusing to replace it even with --force")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.with_name(f".{out.name}.building-{uuid.uuid4().hex[:8]}")
    stage.mkdir()
    try:
        yield stage
        for path in stage.rglob("*"):
            if path.is_file():
                fsync_file(path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    if out.exists():
        os.replace(out, old)
    os.replace(stage, out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)
