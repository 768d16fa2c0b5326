"""Building the fused kernels' library: the instruction set, the flags, the cache folder, its lock,
the sha256 record of the built library, and binding its C functions (:mod:`ctypes`).

The first use in a process compiles the C++ for this CPU (:mod:`trtvocab.kernels.__main__`,
which ``make setup`` calls, does it ahead of time); ``TRTVOCAB_KERNELS=0`` disables the kernels.
Any failure (no compiler, a failed build, a lock held past its timeout, a failed self-check) means
the torch path with one log line, never an error.

The flags, the cache folder's name and the paths: docs/architecture.md, "Fused kernels"; the
guarded cache (``flock``, size and sha256 checked before every ``dlopen``, the environment
variables): docs/threat_model.md, "The kernel cache".
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("trtvocab.kernels")

ENV_VAR = "TRTVOCAB_KERNELS"
CACHE_ENV_VAR = "TRTVOCAB_KERNELS_DIR"  # the build cache root (default: $TORCH_EXTENSIONS_DIR, torch's)
LOCK_TIMEOUT_ENV_VAR = "TRTVOCAB_KERNELS_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 300.0  # a live build of this library takes about a minute
LOCK_NAME = "trtvocab.lock"  # flock-ed by the process building in a build folder
TORCH_BATON = "lock"  # torch.utils.cpp_extension's O_EXCL baton (waited for forever by torch)
RECORD_SUFFIX = ".sha256.json"  # {"size", "sha256"} of the built library, written after the build
MAX_LIBRARY_BYTES = 1 << 30
CSRC = Path(__file__).resolve().parent / "csrc"  # every file under it is hashed into the build's name
SOURCE = CSRC / "fused.cpp"  # includes its headers (csrc/fused/*.h): one translation unit
# The vocab tree's (max, sum exp) nodes (trtvocab.sampling.treesum), built into the same library.
TREE_SOURCE = SOURCE.parent / "treesum.cpp"
# The GGUF block kernels (the types of trtvocab.quant.gguf_blocks.BLOCK_TYPES), built into the same library.
GGUF_SOURCE = SOURCE.parent / "gguf.cpp"
PROBES_SOURCE = SOURCE.parent / "probes.cpp"  # the machine probes (trtvocab.kernels.probes)
UNITS = (SOURCE, TREE_SOURCE, GGUF_SOURCE, PROBES_SOURCE)  # the library's translation units
ISA_NAMES = {3: "avx512", 2: "avx2+fma+f16c", 0: "portable"}  # trtvocab_fused_isa()

_P = ctypes.c_void_p
_I = ctypes.c_int64
_INT, _F32 = ctypes.c_int, ctypes.c_float

# The library's ABI: every exported C function as (symbol, argtypes, restype, the ABI that added it), from
# which bind() declares them. Adding a symbol or changing a signature bumps ABI (and trtvocab_fused_abi() in
# csrc/fused.cpp, and the build's name); ABI 3 is the oldest a base revision of kernel_ab.py may have.
# 4: csrc/probes.cpp, trtvocab_gguf_kind; trtvocab_gguf_set_path / _max_path gone (a path is forced by a build).
ABI = 4
OLDEST_ABI = 3
SYMBOLS: tuple[tuple[str, list[type], type, int], ...] = (
    ("trtvocab_fused_abi", [], _INT, 3),
    ("trtvocab_fused_isa", [], _INT, 3),
    ("trtvocab_fused_dpbf16", [], _INT, 3),
    ("trtvocab_fused_set_dpbf16", [_INT], _INT, 3),
    ("trtvocab_fused_x_fits_bf16", [_P, _I, _I, _I], _INT, 3),
    ("trtvocab_fp8_logits", [_P, _I, _I, _I, _P, _I, _I, _P, _I, _P, _I], _INT, 3),
    ("trtvocab_nvfp4_logits", [_P, _I, _I, _I, _P, _I, _I, _P, _I, _F32, _P, _I], _INT, 3),
    ("trtvocab_dense_logits", [_P, _I, _I, _I, _P, _I, _I, _INT, _P, _I], _INT, 3),
    ("trtvocab_gguf_logits", [_P, _I, _I, _I, _INT, _P, _I, _I, _P, _I], _INT, 3),
    ("trtvocab_gguf_kind", [ctypes.c_char_p, ctypes.POINTER(_I), ctypes.POINTER(_I)], _INT, 4),
    ("trtvocab_tree_isa", [], _INT, 3),
    ("trtvocab_tree_set_exp", [_INT], _INT, 3),
    ("trtvocab_tree_exp", [_P, _I, _P], _INT, 3),
    ("trtvocab_tree_nodes", [_P, _I, _I, _I, _I, _P, _P, _I], _INT, 3),
    ("trtvocab_read_probe", [_P, _I], ctypes.c_uint64, 3),
    ("trtvocab_mul_probe", [_I, _F32, _P], _I, 3),
    ("trtvocab_gguf_chain_probe", [_I, _F32, _P], _I, 3),
)


@dataclass(frozen=True)
class Loaded:
    """The built library of this process: its handle, file, lane implementation and build time."""

    lib: ctypes.CDLL
    path: str
    isa: str
    seconds: float  # build (or cache load) time



def disabled_reason() -> str | None:
    """Why the environment turns the kernels off (``TRTVOCAB_KERNELS=0``), else None."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("0", "false", "off", "no"):
        return f"{ENV_VAR}={os.environ[ENV_VAR]}"
    return None



ISA_ENV_VAR = "TRTVOCAB_KERNELS_ISA"  # native (default) | avx512 | avx2 | portable: the build's -march
ISAS = ("native", "avx512", "avx2", "portable")
# The CPU flags (/proc/cpuinfo) each forced path needs to run; native needs none (it is this CPU's).
ISA_CPU_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"},
                 "avx2": {"avx2", "fma", "f16c"}, "portable": set(), "native": set()}
_X86 = ("x86_64", "amd64", "i686", "x86")


def requested_isa() -> str:
    """The build's instruction set (``$TRTVOCAB_KERNELS_ISA``): ``native`` (this CPU's features: the
    AVX-512 code where it has AVX-512 F + BW + VL + DQ, else the AVX2 code where it has AVX2 + FMA +
    F16C, else portable C++), ``avx512`` (``-march=x86-64-v4``), ``avx2`` (``-march=haswell``,
    what CI builds to keep the lowest vector path honest) or ``portable`` (baseline x86-64, no
    vector intrinsics)."""
    value = os.environ.get(ISA_ENV_VAR, "").strip().lower() or "native"
    if value not in ISAS:
        shown = repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} characters)"
        raise ValueError(f"{ISA_ENV_VAR} must be one of {', '.join(ISAS)}, got {shown}")
    return value


def isa_problem(isa: str) -> str | None:
    """Why a forced instruction set cannot run on this CPU (its :data:`ISA_CPU_FLAGS` missing from
    ``/proc/cpuinfo``), else None. A library built for it would die of SIGILL in the self-check, and
    every later process through the cached library: it is refused before building."""
    if platform.machine().lower() not in _X86:
        return None  # only x86 builds take a forced -march
    missing = sorted(ISA_CPU_FLAGS.get(isa, set()) - cpu_flags())
    if missing:
        return (f"{ISA_ENV_VAR}={isa} needs CPU flags this CPU lacks ({', '.join(missing)}); "
                "unset it or choose one this CPU runs")
    return None


def _arch_flags(isa: str = "native") -> list[str]:
    machine = platform.machine().lower()
    if machine in _X86:
        return {"native": ["-march=native"], "avx512": ["-march=x86-64-v4", "-mtune=generic"],
                "avx2": ["-march=haswell", "-mtune=generic"],
                "portable": ["-march=x86-64", "-mtune=generic"]}[isa]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"] if isa == "native" else []
    return []


def cflags(isa: str | None = None) -> list[str]:
    return ["-O3", *_arch_flags(isa or requested_isa()), "-fopenmp", "-ffp-contract=off"]


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``), empty where unreadable."""
    fingerprint = _cpu_fingerprint()
    return set(fingerprint.split()) if fingerprint else set()


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def source_files(root: Path | None = None) -> list[Path]:
    """Every file under ``csrc/`` (the translation units and the headers they include), in path order."""
    root = root or CSRC
    return sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def build_name(isa: str | None = None) -> str:
    """The extension's name: a hash of everything the built code depends on (every file under ``csrc/``,
    by relative path and content, so an edited, added or renamed header is a new build)."""
    digest = hashlib.sha256()
    sources = [part for path in source_files() for part in (path.relative_to(CSRC).as_posix().encode(),
                                                           path.read_bytes())]
    for part in (*sources, " ".join(cflags(isa)).encode(), torch.__version__.encode(),
                 _cpu_fingerprint().encode(), str(ABI).encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"trtvocab_fused_{digest.hexdigest()[:16]}"


def build_root() -> Path:
    """Where build folders live: ``$TRTVOCAB_KERNELS_DIR``, else ``$TORCH_EXTENSIONS_DIR``, else torch's default."""
    root = os.environ.get(CACHE_ENV_VAR) or os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils import cpp_extension

        root = cpp_extension.get_default_build_root()
    return Path(root)


def lock_timeout() -> float:
    """Seconds to wait for another live build of the same library (``$TRTVOCAB_KERNELS_LOCK_TIMEOUT_S``)."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{LOCK_TIMEOUT_ENV_VAR} must be a positive number of seconds, got {raw!r}")
    return value


def _open_nonblocking(path: Path, flags: int) -> int:
    """A descriptor of the regular file ``path`` (never a FIFO, device or symlink: opened with
    ``O_NONBLOCK | O_NOFOLLOW`` and ``fstat``-ed), else ``OSError``."""
    fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    os.set_blocking(fd, True)
    return fd


def _discard(path: Path) -> None:
    """Remove whatever ``path`` is (a file, FIFO, symlink or folder); absent is fine."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``build_dir/trtvocab.lock`` (waiting at most ``timeout``
    seconds, then ``TimeoutError``). The kernel releases the lock of a process that died, so a
    lock file left by a killed build is taken at once; anything but a regular file there is
    replaced."""
    path = build_dir / LOCK_NAME
    try:
        fd = _open_nonblocking(path, os.O_RDWR | os.O_CREAT)
    except OSError:
        _discard(path)  # a FIFO, symlink or folder in the lock's place
        fd = _open_nonblocking(path, os.O_RDWR | os.O_CREAT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    raise TimeoutError(f"{path} is held by a live process (pid {owner}) for more than {timeout:g} s "
                                       f"(set {LOCK_TIMEOUT_ENV_VAR} to wait longer)") from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _file_digest(path: Path, limit: int = MAX_LIBRARY_BYTES) -> tuple[int, str]:
    """``(size, sha256)`` of the regular file ``path`` (at most ``limit`` bytes; ``OSError`` otherwise)."""
    fd = _open_nonblocking(path, os.O_RDONLY)
    with os.fdopen(fd, "rb", buffering=0) as fh:
        h, size = hashlib.sha256(), 0
        while chunk := fh.read(1 << 20):
            size += len(chunk)
            if size > limit:
                raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
            h.update(chunk)
    return size, h.hexdigest()


def record_path(library: Path) -> Path:
    return library.with_name(library.name + RECORD_SUFFIX)


def write_record(library: Path) -> None:
    """Record the built library's size and sha256 beside it (temp file + rename)."""
    size, digest = _file_digest(library)
    target = record_path(library)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    _discard(tmp)
    tmp.write_text(json.dumps({"size": size, "sha256": digest}), encoding="utf-8")
    os.replace(tmp, target)


def cache_problem(library: Path) -> str | None:
    """Why the cached ``library`` must not be ``dlopen``-ed (None: it matches its build record).

    Checked without ever opening a non-regular file: the library and its record are
    ``lstat``-ed, then read through a non-blocking descriptor that is ``fstat``-ed again."""
    try:
        st = os.lstat(library)
    except FileNotFoundError:
        return "not built yet"
    if not stat.S_ISREG(st.st_mode):
        return f"{library} is not a regular file"
    record = record_path(library)
    try:
        fd = _open_nonblocking(record, os.O_RDONLY)
        with os.fdopen(fd, "rb", buffering=0) as fh:
            data = json.loads(fh.read(4096).decode("utf-8"))
        size, digest = data["size"], data["sha256"]
        if not isinstance(size, int) or not isinstance(digest, str):
            raise ValueError("bad field types")
    except FileNotFoundError:
        return f"{library} has no build record ({record.name})"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{record} is unreadable ({exc})"
    if st.st_size != size:
        return f"{library} has {st.st_size} bytes, {size} were recorded at build (truncated or replaced)"
    try:
        got_size, got = _file_digest(library, limit=size)
    except OSError as exc:
        return f"{library} is unreadable ({exc})"
    if (got_size, got) != (size, digest):
        return f"{library} sha256 {got[:16]}... differs from the one recorded at build ({digest[:16]}...)"
    return None



def _library(verbose: bool, isa: str | None = None) -> Path:
    """The verified library of this build, building (or rebuilding) it under the build lock."""
    from torch.utils import cpp_extension

    name = build_name(isa)
    build_dir = build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{name}.so"
    with build_lock(build_dir, lock_timeout()):
        problem = cache_problem(library)
        if problem is None:
            return library
        if os.path.lexists(library):
            log.info("trtvocab fused kernels: rebuilding (%s)", problem)
        for stale in (library, record_path(library), build_dir / TORCH_BATON):
            _discard(stale)  # torch's baton: whoever left it died (builders hold our lock first)
        with os.scandir(build_dir) as entries:  # nothing but files and folders reaches ninja or the linker
            for entry in entries:
                if not (entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False)):
                    _discard(Path(entry.path))
        sources = [str(unit) for unit in UNITS]
        path = Path(cpp_extension.load(name=name, sources=sources, extra_cflags=cflags(isa),
                                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                                       is_python_module=False, verbose=verbose))
        write_record(path)
        problem = cache_problem(path)
        if problem is not None:
            raise RuntimeError(f"the freshly built library fails its own record: {problem}")
        return path



def bind(path: Path, seconds: float = 0.0, *, older: bool = False) -> Loaded:
    """``dlopen`` the built library at ``path`` and declare its C functions' signatures (:data:`SYMBOLS`).

    Its ``trtvocab_fused_abi()`` must be :data:`ABI`; ``older`` (``benchmarks/kernel_ab.py``'s base revision)
    also takes one from :data:`OLDEST_ABI` on and binds the symbols it has (``since`` at most its ABI)."""
    lib = ctypes.CDLL(str(path))
    lib.trtvocab_fused_abi.restype = ctypes.c_int
    abi = lib.trtvocab_fused_abi()
    if abi != ABI and not (older and OLDEST_ABI <= abi < ABI):
        raise RuntimeError(f"{path}: kernel ABI {abi}, expected {ABI}")
    for name, argtypes, restype, since in SYMBOLS:
        if since <= abi:
            function = getattr(lib, name)  # AttributeError: a library that breaks its ABI's promise
            function.argtypes, function.restype = argtypes, restype
    isa = ISA_NAMES.get(lib.trtvocab_fused_isa(), "unknown")
    return Loaded(lib=lib, path=str(path), isa=isa, seconds=seconds)


def build_library(verbose: bool = False, isa: str | None = None) -> Loaded:
    """Build (or find in the cache) and bind the library for ``isa``; not self-checked. A forced
    instruction set this CPU lacks is a RuntimeError before anything is built or loaded."""
    start = time.perf_counter()
    problem = isa_problem(isa or requested_isa())
    if problem is not None:
        raise RuntimeError(problem)
    path = _library(verbose, isa)
    return bind(path, time.perf_counter() - start)
