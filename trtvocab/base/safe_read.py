"""Reading a file a user or a manifest names: it is never trusted to be what its name says.

:func:`open_regular`, the one opener of the files trtvocab reads, opens only a regular file
(``stat`` after following symlinks, before ``open``, and ``fstat`` of what was opened), so a
FIFO, a device (``/dev/zero``), a socket or a folder is refused with a typed error instead of
blocking or streaming forever; :func:`read_regular` and :func:`sha256_file` (``limit``) never
read more bytes than the caller says the file holds; JSON is parsed with unique keys where asked.
Safetensors headers: :mod:`trtvocab.base.safetensors_header`. Writing: :mod:`trtvocab.base.publish`.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import IO, Any

from trtvocab.errors import ArtifactError, TrtVocabError

ErrorType = type[TrtVocabError]


# ---- reading ---------------------------------------------------------------------------------------
def as_path(path: Any, what: str, expected: str, error: ErrorType = ArtifactError) -> Path:
    """``path`` as a :class:`Path`: a non-empty ``str`` or ``os.PathLike`` of one, without NUL.

    Anything else (None, an int that ``open`` would take as a file descriptor, bytes, ``""``
    that would name the current folder) raises ``error`` naming ``what`` and ``expected``.
    """
    raw: Any = path
    if isinstance(path, os.PathLike):
        try:
            raw = os.fspath(path)
        except TypeError:
            raw = None
    rule = f"must be a non-empty str or os.PathLike naming {expected}"
    if not isinstance(raw, str):
        raise error(f"{what} {rule}, got {type(path).__name__} {path!r:.80}")
    if not raw:
        raise error(f"{what} {rule}; it is empty (got str '')")
    if "\0" in raw:
        raise error(f"{what} {rule}; {raw!r:.200} contains a NUL character (got str)")
    return Path(raw)


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (for messages)."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | Path, what: str, error: ErrorType = ArtifactError, *,
                 buffering: int = -1) -> IO[bytes]:
    """Open ``path`` for binary reading only if it is a regular file (symlinks followed).

    Checked twice: ``stat`` before ``open`` (a FIFO is never opened, so nothing blocks), and
    ``fstat`` of the opened descriptor (opened non-blocking, so a file swapped for a FIFO
    in between cannot block either). Raises ``error`` naming ``what`` and the path.
    ``buffering``: as for :func:`open` (0: unbuffered, every read is one ``read`` call).
    This is the only opener of files trtvocab reads.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise error(f"{what} {path}: cannot stat ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {path}: is {file_kind(st.st_mode)}, expected a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{what} {path}: cannot open ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{what} {path}: is {file_kind(mode)}, expected a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, what: str, *, max_bytes: int, error: ErrorType = ArtifactError) -> bytes:
    """All bytes of a regular file of at most ``max_bytes`` (larger is refused before reading)."""
    with open_regular(path, what, error) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise error(f"{what} {path}: {size} bytes, more than the {max_bytes} allowed")
        chunks, left = [], max_bytes + 1  # in chunks: read(n) would allocate n bytes up front (64 GiB for a plan)
        while left > 0:
            chunk = fh.read(min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    if len(data) > max_bytes:
        raise error(f"{what} {path}: grew while being read (more than {max_bytes} bytes)")
    return data


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_json(raw: bytes, where: str, error: ErrorType = ArtifactError, *, unique_keys: bool = False) -> Any:
    """UTF-8 JSON parsed strictly; errors (``error``) name ``where`` and at most a position, never
    the bytes. ``unique_keys``: a key given twice in one object is refused."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not UTF-8 text (at byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys if unique_keys else None)
    except _DuplicateKey as exc:
        raise error(f"{where} holds the key {exc.args[0]!r:.100} twice") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where} is not JSON ({exc.msg} at character {exc.pos})") from None
    except RecursionError:
        raise error(f"{where} is not usable JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise error(f"{where} is not usable JSON ({exc!s:.120})") from None


def load_json_file(path: str | Path, what: str, *, max_bytes: int = 64 << 20,
                   error: ErrorType = ArtifactError) -> Any:
    """A JSON file parsed strictly: regular file, bounded size, UTF-8, nesting a parser survives."""
    return parse_json(read_regular(path, what, max_bytes=max_bytes, error=error), f"{what} {path}", error)


def sha256_file(path: str | Path, chunk: int = 1 << 22, *, limit: int | None = None, what: str = "file",
                error: ErrorType = ArtifactError) -> str:
    """sha256 of a regular file; with ``limit``, of at most its first ``limit + 1`` bytes
    (the caller compares the size: an endless or grown file is never hashed to its end)."""
    digest = hashlib.sha256()
    remaining = limit + 1 if limit is not None else None
    with open_regular(path, what, error) as fh:
        while remaining is None or remaining > 0:
            block = fh.read(chunk if remaining is None else min(chunk, remaining))
            if not block:
                break
            digest.update(block)
            if remaining is not None:
                remaining -= len(block)
    return digest.hexdigest()


def sha256_bytes(data: Any) -> str:
    """sha256 of bytes or any buffer (a TensorRT ``IHostMemory``, a memoryview)."""
    return hashlib.sha256(memoryview(data)).hexdigest()
