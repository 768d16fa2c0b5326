"""Publishing a file or a folder, both "old or new, never a half", and the errors of a full or read-only disk.

:func:`atomic_write_bytes` (one file, via a temp file in the same folder, fsync, rename) and
:func:`staging` (a whole folder built in a private sibling and moved into place atomically; its
docstring says exactly what is guaranteed, and docs/threat_model.md the protocol: ``renameat2``
with ``RENAME_NOREPLACE``, private sibling names carrying host and pid, cleanup of stale ones, the
"ours" check before ``force``). :func:`writing` turns ENOSPC / EDQUOT / EROFS into one
:class:`~trtvocab.errors.WriteError` line. ONNX graphs with external data:
``trtvocab.export.onnx.save_model_atomic``, with the same pieces. Reading: :mod:`trtvocab.base.safe_read`.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trtvocab.errors import ArtifactError, WriteError


# ---- durability ------------------------------------------------------------------------------------
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


def default_mode(path: str | Path) -> None:
    """Give a file written through a private temp file (safetensors' ``save_file``: ``0600``) the mode
    ``open`` would have given it (``0666`` less the umask), like every other file of an output."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def fsync_tree(root: str | Path) -> None:
    """fsync every regular file, then every folder (deepest first), under ``root`` and ``root`` itself.
    Symlinks are not followed."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                fsync_file(path)
        fsync_dir(folder)


# ---- writing ---------------------------------------------------------------------------------------
# Why a write fails for lack of room or rights, not because of a bug: these become a WriteError naming
# the path (a raw OSError, or safetensors' "I/O error: No space left on device (os error 28)", otherwise).
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS})
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


def write_errno(exc: BaseException) -> int | None:
    """The errno of ``exc`` when it is a failed write of :data:`WRITE_ERRNOS` (an ``OSError``, or a
    library error whose text carries Rust's ``(os error N)``: safetensors' ``SafetensorError``), else None."""
    code: int | None = None
    if isinstance(exc, OSError):
        code = exc.errno
    else:
        m = _OS_ERROR_IN_TEXT.search(str(exc))
        code = int(m.group(1)) if m else None
    return code if code in WRITE_ERRNOS else None


def describe_errno(code: int) -> str:
    return f"{os.strerror(code)} ({errno.errorcode.get(code, str(code))})"


@contextmanager
def writing(target: str | Path, *, note: str = "") -> Iterator[None]:
    """Turn a failed write inside (:func:`write_errno`) into a :class:`WriteError` naming ``target``
    (and ``note``: what was left as it was). A :class:`WriteError` from inside gets ``target`` and
    ``note`` added when ``note`` is given; every other exception passes unchanged."""
    try:
        yield
    except WriteError as exc:
        if not note:
            raise
        raise WriteError(f"{target}: {exc}{note}") from None
    except Exception as exc:
        code = write_errno(exc)
        if code is None:
            raise
        raise WriteError(f"{target}: cannot write it: {describe_errno(code)}{note}") from None


def atomic_write_bytes(path: str | Path, data: Any) -> None:
    """Write ``data`` (bytes or any buffer) to ``path`` via a temp file in the same folder + fsync + rename.

    A reader sees the old file or the new one, never a partial one; on failure the temp
    file is removed and ``path`` is untouched. A full disk, a file-size limit (``EFBIG``), a
    quota or a read-only filesystem is a :class:`WriteError` naming ``path``.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with writing(path, note=f"; {path} is as it was"):
            with open(tmp, "wb") as fh:
                fh.write(memoryview(data))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


# ---- atomic folder publication ---------------------------------------------------------------------
_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_PRIVATE = re.compile(r"\.(?P<name>.+)\.(?P<kind>building|old)-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}")


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2(src, dst, flags)``: True if done, False where the call or the flag is
    unsupported (no such libc function, ENOSYS, EINVAL); other failures raise OSError."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst`` only if ``dst`` does not exist; FileExistsError otherwise.

    ``renameat2(RENAME_NOREPLACE)`` where the kernel and filesystem have it; else plain
    ``rename``, which also refuses a non-empty folder or a file as the target (it would
    replace only an *empty* folder, which holds nothing to lose; ``src`` is never empty).
    """
    try:
        if _renameat2(src, dst, _RENAME_NOREPLACE):
            return
        os.rename(src, dst)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(exc.errno, exc.strerror, str(dst)) from None
        raise


def _private(out: Path, kind: str) -> Path:
    """``.NAME.KIND-HOST-PID-RANDOM`` next to ``out``: whose it is, so a later run can tell it is stale."""
    return out.with_name(f".{out.name}.{kind}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's), or unknowable: keep the folder
    return True


def clean_stale(out: str | Path) -> list[Path]:
    """Remove the private folders of ``out`` that killed runs of this tool left; returns them.

    Only folders named ``.NAME.building-*`` / ``.NAME.old-*`` by :func:`staging` on this host
    whose process no longer runs are touched; a live build's folder, another host's, and
    anything not a plain folder are left alone. A stale ``.NAME.old-*`` (a run killed between
    the two renames of the fallback publication, below) is the previous ``out``: when
    ``out`` is missing it is renamed back, so the old artifact returns instead of vanishing.
    """
    out = Path(out)
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return []
    stale_old: list[Path] = []
    removed: list[Path] = []
    for entry in entries:
        m = _PRIVATE.fullmatch(entry.name)
        if m is None or m["name"] != out.name or m["host"] != _HOST or _pid_alive(int(m["pid"])):
            continue
        if entry.is_symlink() or not entry.is_dir():
            continue
        if m["kind"] == "old":
            stale_old.append(entry)
        else:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    if stale_old and not os.path.lexists(out):
        newest = max(stale_old, key=lambda p: p.stat().st_ctime)
        try:
            _rename_noreplace(newest, out)
            fsync_dir(out.parent)
            stale_old.remove(newest)
        except OSError:
            pass
    for entry in stale_old:
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _replaceable(path: Path, is_ours: Callable[[Path], bool]) -> bool:
    """An empty folder, or one ``is_ours`` recognizes (a crash in it counts as not ours)."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        return not any(path.iterdir()) or bool(is_ours(path))
    except Exception:
        return False


def check_target(out: Path, force: bool, is_ours: Callable[[Path], bool]) -> None:
    """Refuse ``out`` as a publication target (see :func:`staging`); callers may check early,
    before minutes of work, and :func:`staging` checks again."""
    if not os.path.lexists(out):
        return
    if not force:
        raise ArtifactError(f"{out} already exists; pass `force` to replace it (atomically)")
    if out.is_symlink():
        raise ArtifactError(f"{out} is a symbolic link; refusing to replace it even with `force` "
                            "(give the folder it points to)")
    if not _replaceable(out, is_ours):
        raise ArtifactError(f"{out} exists and is not a folder this tool wrote; "
                            "refusing to replace it even with `force`")


NAME_MAX = 255


def check_destination(out: Path, option: str = "`out`") -> None:
    """Refuse, before any work, an ``out`` that :func:`staging` could not build beside: a name too long
    for its private sibling (``.NAME.building-HOST-PID-RANDOM``), a parent that is a file, or a folder
    in which nothing can be created (``/proc``, read-only, immutable). A folder is created in the
    nearest existing parent and removed at once, the one way to know (root passes ``access``)."""
    out = Path(out)
    private = _private(out, "building").name
    if len(os.fsencode(private)) > NAME_MAX:
        room = NAME_MAX - (len(os.fsencode(private)) - len(os.fsencode(out.name)))
        raise ArtifactError(f"{option} {out}: the name has {len(os.fsencode(out.name))} bytes; at most {room} fit "
                            f"(its private build folder beside it adds {NAME_MAX - room})")
    parent = out.parent.absolute()
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ArtifactError(f"{option} {out}: {parent} is not a folder")
    probe = parent / f".{out.name[:40]}.probe-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
    except OSError as exc:
        raise ArtifactError(f"{option} {out}: cannot create folders in {parent}: "
                            f"{describe_errno(exc.errno) if exc.errno else exc}") from None
    probe.rmdir()


def _publish(stage: Path, out: Path, force: bool, is_ours: Callable[[Path], bool]) -> None:
    appeared = ArtifactError(f"{out} appeared while this run was building (another run published it first); "
                             "nothing was replaced")
    for _ in range(3):  # a concurrent run may publish between our checks: look again
        if not os.path.lexists(out):
            try:
                _rename_noreplace(stage, out)
            except FileExistsError:
                if not force:
                    raise appeared from None
                continue
            fsync_dir(out.parent)
            return
        if not force:
            raise appeared
        check_target(out, force, is_ours)
        if _renameat2(stage, out, _RENAME_EXCHANGE):
            # One atomic swap: `out` was the old folder until this instant, the new one after.
            # What `stage` now holds is deleted only if it is still ours (it may have been
            # swapped for a foreign folder after the check above): otherwise swap back.
            if not _replaceable(stage, is_ours):
                _renameat2(stage, out, _RENAME_EXCHANGE)
                raise ArtifactError(f"{out} was replaced by a folder this tool did not write while publishing; "
                                    "left it as it is")
            fsync_dir(out.parent)
            shutil.rmtree(stage, ignore_errors=True)
            return
        # No atomic exchange here (another OS or filesystem): two renames. A crash between them
        # leaves `out` missing and the old folder as `.NAME.old-*`; clean_stale (run at the
        # start of the next publication into `out`) renames it back.
        old = _private(out, "old")
        os.rename(out, old)
        if not _replaceable(old, is_ours):
            os.rename(old, out)
            raise ArtifactError(f"{out} was replaced by a folder this tool did not write while publishing; "
                                "left it as it is")
        try:
            _rename_noreplace(stage, out)
        except BaseException:
            os.rename(old, out)
            raise
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    raise ArtifactError(f"{out}: other runs keep publishing into it; nothing was replaced")


@contextmanager
def staging(out: Path, *, force: bool, is_ours: Callable[[Path], bool]) -> Iterator[Path]:
    """Yield a private folder to build into; on success publish it as ``out`` atomically.

    What is guaranteed:

    * ``out`` is never a mix or a half: the new folder is built beside it
      (``.NAME.building-HOST-PID-RANDOM``), every file and folder in it is fsynced, and it
      appears as ``out`` with one rename; the parent folder is fsynced after it.
    * Without ``force`` an existing ``out`` is refused, and so is one that appears while
      this run builds (a concurrent run published first): the publishing rename never
      replaces an existing folder (``renameat2(RENAME_NOREPLACE)``; plain ``rename`` where
      that is missing, which refuses every non-empty target). Of two concurrent runs
      exactly one publishes; the other raises :class:`ArtifactError`.
    * ``force`` replaces only an empty folder or one that ``is_ours(out)`` recognizes as
      this tool's output (the caller checks a marker that parses as ours), never a symlink,
      a file, or a folder of something else that a mistyped ``out`` points at. The check
      is repeated on what was swapped out before it is deleted.
    * Old or new, never nothing: on Linux the old folder and the new one trade places with
      one ``renameat2(RENAME_EXCHANGE)``. Where that is unsupported, two renames are used,
      and a crash between them leaves ``out`` missing with the old folder as
      ``.NAME.old-*``, which the next publication into ``out`` renames back first.
    * Stale private folders of killed runs (this host, dead pid) are removed at the start
      (:func:`clean_stale`). On failure the staging folder is removed and ``out`` is untouched.
    """
    out = Path(out)
    clean_stale(out)
    check_target(out, force, is_ours)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = _private(out, "building")
    stage.mkdir()
    try:
        yield stage
        fsync_tree(stage)
        _publish(stage, out, force, is_ours)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
