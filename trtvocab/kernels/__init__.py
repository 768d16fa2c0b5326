"""Fused dequantize-multiply CPU kernels for the FP8 and NVFP4 heads (a JIT-built C++ extension).

Why: the torch path (:meth:`QuantizedWeight.block_logits` over ``_plan``) decodes each chunk
of rows to a float32 temporary and hands it to the GEMM; the decode passes and the temporary's
round trip through memory cost more than the bytes the quantized format saves, so an FP8 /
NVFP4 head was ~6x slower than bf16 although it reads 2x / 3.5x fewer bytes. Here the codes
are decoded *inside* the multiply, in registers (batch 1 to 8: one pass over the weight, every
input row's chains in registers) or into an L1-sized tile that every input row reuses (batch >= 9).
The same library multiplies dense bf16 / fp16 heads (:func:`dense_logits`) where torch's GEMM has no
native dot products for that dtype (:func:`dense_max_batch`).

What (``trtvocab/kernels/csrc/fused.cpp``, called through :mod:`ctypes`; threads from
``at::parallel_for``, i.e. torch's intra-op pool and its OpenMP runtime, never a second one):

- **Chains.** Logit ``(n, v)`` is one chain of 8 float32 lanes over H in a fixed order,
  ``acc = fma(w_s, x_s, acc)`` for steps ``s = 0 .. S-1`` of 8 values (NVFP4: block-scaled,
  below), reduced by a fixed tree
  ``((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))``, then ``(sum * 256) * scale``. The tile, thread,
  batch and row range a logit is computed in never change its chain, so a logit is bitwise
  the same for any ``[start, end)`` partition of the rows (what a vocab-chunked caller
  streams), for batch 1 and batch N, and at every tp size and layout (the shard's rows are
  the same codes). This holds for the fused kernel only; the torch fallback is BLAS-shaped.
- **Exact decode.** FP8: an e4m3 byte sign-extended to int16 and shifted left by 7 is the fp16
  number ``q * 2**-8`` (bit 14 masked); F16C converts it to a normal float32, exactly, e4m3
  subnormals included (the portable build uses a 256-entry table of the same values). NVFP4:
  every ``e2m1`` value (``-0`` included) is an fp16 number whose low byte is zero, so a 16-entry
  ``vpshufb`` table maps 32 nibbles at a time to those high bytes, an unpack with zero makes the
  fp16 words and F16C widens them (batch 1 decodes 4 lane groups, 64 values, per 32-byte load;
  the older ``vpermps`` 8-value decoder serves the tails); block scales decode like FP8 codes.
  Dense: bf16 is the high half of a float32 (a 16-bit shift), fp16 goes through F16C. NaN codes
  never reach the kernel (refused at load).
- **NVFP4 chains are block-scaled**: a lane is one 16-block, whose 16 products
  ``e2m1_j * x_j`` are summed from zero, then added as ``acc = fma(block sum, e4m3(block scale)
  * 2**-8, acc)``: one multiply per block instead of one per weight.
- **Reassociation** (the only change in rounding against the torch path, which rounds each
  weight ``q * scale`` first): scales factor out of a dot product. FP8's scalar / per-row
  ``weight_scale`` and NVFP4's global ``weight_scale_2`` are applied once per logit,
  ``sum_i x_i q_i s = (sum_i x_i q_i) s``; NVFP4's block scale once per block,
  ``sum_{j in b} x_j e_j bs_b = (sum_{j in b} x_j e_j) bs_b``. Error against the exact dot
  product of the decoded weights, ``gamma(m) = m * 2**-24 / (1 - m * 2**-24)``:
  FP8 ``|err| <= gamma(ceil(H / 8) + 4) * sum_i |x_i w_i|`` (8 lanes of ``ceil(H / 8)`` FMAs,
  3 tree levels, 1 scale rounding); NVFP4 ``<= gamma(16 + G + 4) * sum_i |x_i w_i|`` with
  ``G = ceil(H / 128)`` lane groups (16 FMAs per block, G block FMAs per lane, tree, scale).
- **Layouts.** FP8 codes are read as stored (``[width, H]``); ``x`` is zero-padded to a
  multiple of 8 columns. NVFP4 reads the head's block-major bytes
  (:func:`~trtvocab.quant.nvfp4.to_block_major`): 8 consecutive bytes are byte ``k`` of 8
  consecutive blocks, so the lanes are blocks and each lane's block scale is one decoded
  e4m3 byte; ``x`` is permuted once per call into that step order (:func:`nvfp4_x`).
- **Batches.** B = 1: FP8 / dense run 8 weight rows' chains in registers; NVFP4 one row, four
  lane groups' chains interleaved. B = 2..8 (one pass over the weight): a decoded weight step is
  multiplied into the chains of all B input rows at once; FP8 / dense hold ``R * B <= 8`` chains
  in registers (R weight rows) and read ``x`` a K-chunk of 64 steps at a time for a tile of 32
  weight rows, whose chains wait in memory between chunks (a float32 store is exact); NVFP4 runs
  the batch-1 loop with all B rows' block sums in registers (4 groups per load at B <= 2, 2 at
  B = 3, 1 beyond). B >= 9: the tile kernel. Every logit's chain is the same in all of them.
- **Paths** (``$TRTVOCAB_KERNELS_ISA``, part of the build's name): ``native`` (``-march=native``:
  the AVX2 + FMA + F16C code on such a CPU, AVX-512 ones included, else portable C++), ``avx2``
  (``-march=haswell``) or ``portable`` (``-march=x86-64``: no intrinsics, FMA only where the
  compiler has a hardware ``fmaf``). :func:`load_isa` builds any of them in one process (the tests
  run every check on each path this CPU can execute).
- **Dense heads** (:func:`dense_logits`): the FP8 chain without a scale (``sum + 0``), then one
  rounding to the head dtype: the bf16 / fp16 logits of a batch up to :data:`DENSE_MAX_BATCH` are
  bitwise the same at every batch, split and tp size. ``$TRTVOCAB_DENSE_KERNEL``: ``auto`` (not
  for a dtype this CPU has native dot products for: ``avx512_bf16`` / ``amx_bf16``, ``avx512_fp16``
  / ``amx_fp16``, where torch's GEMM was measured faster), ``1`` or ``0``.
- **Activations** stay in torch (``quantize_input``: fake-quant e4m3, NVFP4 16-wide blocks, or
  none); only the weight decode and the multiply move here. Accumulation is float32.

Building: the first use in a process compiles the C++ with ``-O3 -march=native -fopenmp
-ffp-contract=off`` (``torch.utils.cpp_extension.load``, cached under torch's
extensions folder in a directory named by a hash of the source, the flags, torch's version and
this CPU's feature flags, so a cache shared between different CPUs never runs foreign code).
``python -m trtvocab.kernels --build`` does it ahead of time (``make setup`` calls it).
Off x86 or without AVX2/FMA/F16C the same chains run as portable C++ (correct, not tuned; an
AVX-512 machine runs the AVX2 code). A compiler without OpenMP (Apple clang) fails the build.
The cache is guarded (docs/threat_model.md, "The kernel cache"): the build folder is
``$TRTVOCAB_KERNELS_DIR/<name>`` (else ``$TORCH_EXTENSIONS_DIR``, else torch's default root);
builders take an ``flock`` on ``trtvocab.lock`` there, waited for at most
``$TRTVOCAB_KERNELS_LOCK_TIMEOUT_S`` (300 s) -- the kernel drops a dead owner's lock, so a build
killed by Ctrl-C or SIGKILL never blocks the next run, and torch's own ``lock`` baton left by such
a build is removed under it; the built library's size and sha256 are recorded beside it at build
time and checked (read through a non-blocking descriptor of a regular file) before every
``dlopen``: a FIFO, a truncated or a rewritten library is discarded and rebuilt, never opened.
``TRTVOCAB_KERNELS=0`` disables the kernels; no compiler, a failed build, a lock held past its
timeout or a failed self-check (every FP8 code and every FP4 nibble under every block scale, decoded by the
kernel and compared bit for bit with torch's) means the torch path, with one log line saying
why, never an error.
"""

from __future__ import annotations

import argparse
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
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from trtvocab.quant import nvfp4

log = logging.getLogger(__name__)

ENV_VAR = "TRTVOCAB_KERNELS"
CACHE_ENV_VAR = "TRTVOCAB_KERNELS_DIR"  # the build cache root (default: $TORCH_EXTENSIONS_DIR, torch's)
LOCK_TIMEOUT_ENV_VAR = "TRTVOCAB_KERNELS_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 300.0  # a live build of this library takes about a minute
LOCK_NAME = "trtvocab.lock"  # flock-ed by the process building in a build folder
TORCH_BATON = "lock"  # torch.utils.cpp_extension's O_EXCL baton (waited for forever by torch)
RECORD_SUFFIX = ".sha256.json"  # {"size", "sha256"} of the built library, written after the build
MAX_LIBRARY_BYTES = 1 << 30
SOURCE = Path(__file__).resolve().parent / "csrc" / "fused.cpp"
# The vocab tree's (max, sum exp) nodes (trtvocab.sampling.treesum), built into the same library.
TREE_SOURCE = SOURCE.parent / "treesum.cpp"
ABI = 2  # trtvocab_fused_abi() of the source this module expects
LANES = 8
NVFP4_GROUP = 8 * 16  # elements per NVFP4 lane group: 8 blocks of 16
ISA_NAMES = {2: "avx2+fma+f16c", 0: "portable"}  # trtvocab_fused_isa()

_P = ctypes.c_void_p
_I = ctypes.c_int64


@dataclass(frozen=True)
class Loaded:
    """The built library of this process: its handle, file, lane implementation and build time."""

    lib: ctypes.CDLL
    path: str
    isa: str
    seconds: float  # build (or cache load) time


@dataclass(frozen=True)
class FusedInput:
    """What :meth:`QuantizedWeight.prepare` returns when the kernel runs: ``x`` in the kernel's
    layout (float32 ``[N, S * 8]``, contiguous)."""

    x: torch.Tensor


_lock = threading.Lock()
_loaded: Loaded | None = None
_failure: str | None = None  # why the kernels cannot load in this process (set once, logged once)


def disabled_reason() -> str | None:
    """Why the environment turns the kernels off (``TRTVOCAB_KERNELS=0``), else None."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("0", "false", "off", "no"):
        return f"{ENV_VAR}={os.environ[ENV_VAR]}"
    return None


ISA_ENV_VAR = "TRTVOCAB_KERNELS_ISA"  # native (default) | avx2 | portable: the -march the library is built with
ISAS = ("native", "avx2", "portable")
_X86 = ("x86_64", "amd64", "i686", "x86")


def requested_isa() -> str:
    """The build's instruction set (``$TRTVOCAB_KERNELS_ISA``): ``native`` (this CPU's features:
    the AVX2 code where it has AVX2 + FMA + F16C, else portable C++), ``avx2`` (``-march=haswell``,
    what CI builds to keep the lowest vector path honest) or ``portable`` (baseline x86-64, no
    vector intrinsics)."""
    value = os.environ.get(ISA_ENV_VAR, "").strip().lower() or "native"
    if value not in ISAS:
        raise ValueError(f"{ISA_ENV_VAR} must be one of {', '.join(ISAS)}, got {value!r}")
    return value


def _arch_flags(isa: str = "native") -> list[str]:
    machine = platform.machine().lower()
    if machine in _X86:
        return {"native": ["-march=native"], "avx2": ["-march=haswell", "-mtune=generic"],
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


def build_name(isa: str | None = None) -> str:
    """The extension's name: a hash of everything the built code depends on."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), TREE_SOURCE.read_bytes(), " ".join(cflags(isa)).encode(),
                 torch.__version__.encode(),
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
        path = Path(cpp_extension.load(name=name, sources=[str(SOURCE), str(TREE_SOURCE)], extra_cflags=cflags(isa),
                                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                                       is_python_module=False, verbose=verbose))
        write_record(path)
        problem = cache_problem(path)
        if problem is not None:
            raise RuntimeError(f"the freshly built library fails its own record: {problem}")
        return path


def _build(verbose: bool = False, isa: str | None = None) -> Loaded:
    start = time.perf_counter()
    path = _library(verbose, isa)
    lib = ctypes.CDLL(str(path))
    if lib.trtvocab_fused_abi() != ABI:
        raise RuntimeError(f"{path}: kernel ABI {lib.trtvocab_fused_abi()}, expected {ABI}")
    lib.trtvocab_fp8_logits.argtypes = [_P, _I, _I, _I, _P, _I, _I, _P, _I, _P, _I]
    lib.trtvocab_fp8_logits.restype = ctypes.c_int
    lib.trtvocab_nvfp4_logits.argtypes = [_P, _I, _I, _I, _P, _I, _I, _P, _I, ctypes.c_float, _P, _I]
    lib.trtvocab_nvfp4_logits.restype = ctypes.c_int
    lib.trtvocab_dense_logits.argtypes = [_P, _I, _I, _I, _P, _I, _I, ctypes.c_int, _P, _I]
    lib.trtvocab_dense_logits.restype = ctypes.c_int
    lib.trtvocab_read_probe.argtypes = [_P, _I]
    lib.trtvocab_read_probe.restype = ctypes.c_uint64
    lib.trtvocab_tree_set_exp.argtypes = [ctypes.c_int]
    lib.trtvocab_tree_set_exp.restype = ctypes.c_int
    lib.trtvocab_tree_exp.argtypes = [_P, _I, _P]
    lib.trtvocab_tree_exp.restype = ctypes.c_int
    lib.trtvocab_tree_nodes.argtypes = [_P, _I, _I, _I, _I, _P, _P, _I]
    lib.trtvocab_tree_nodes.restype = ctypes.c_int
    isa = ISA_NAMES.get(lib.trtvocab_fused_isa(), "unknown")
    loaded = Loaded(lib=lib, path=str(path), isa=isa, seconds=time.perf_counter() - start)
    problem = self_check(loaded)
    if problem:
        raise RuntimeError(f"self-check failed: {problem}")
    return loaded


_by_isa: dict[str, Loaded] = {}


def load_isa(isa: str) -> Loaded:
    """The library built for ``isa`` (one of :data:`ISAS`), self-checked; for tests and benchmarks that
    compare paths in one process (swap it in as ``_loaded``). Errors are raised, not logged."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    with _lock:
        if isa not in _by_isa:
            _by_isa[isa] = _build(False, isa)
    return _by_isa[isa]


def load(verbose: bool = False) -> Loaded | None:
    """The built kernels, building them on first use; None (the torch path) when disabled or
    when they cannot be built here (the reason is logged once: :func:`unavailable_reason`)."""
    global _loaded, _failure
    if disabled_reason() is not None:
        return None
    if _loaded is not None or _failure is not None:
        return _loaded
    with _lock:
        if _loaded is None and _failure is None:
            try:
                _loaded = _build(verbose)
                log.info("trtvocab fused kernels: %s (%s, %.1f s)", _loaded.path, _loaded.isa, _loaded.seconds)
            except Exception as exc:  # no compiler, no ninja, a compile error, a failed self-check
                _failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                log.warning("trtvocab fused CPU kernels unavailable, using the torch path (%s)", _failure)
    return _loaded


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the torch path inside this block (sets ``TRTVOCAB_KERNELS=0``, then restores it)."""
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    """Why :func:`load` returns None (None when the kernels are available)."""
    if disabled_reason() is not None:
        return disabled_reason()
    load()
    return _failure


def usable(x: torch.Tensor, *buffers: torch.Tensor) -> bool:
    """Whether the kernel can run this call: loaded, CPU tensors, no autograd through ``x``."""
    if x.device.type != "cpu" or any(b.device.type != "cpu" for b in buffers):
        return False
    if x.requires_grad and torch.is_grad_enabled():
        return False
    return available()


# ---- input layouts ----------------------------------------------------------------------------------
def fp8_x(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x [N, H]`` zero-padded to ``[N, 8 * ceil(H / 8)]``, contiguous."""
    pad = -x.shape[1] % LANES
    x = x.float()
    return torch.nn.functional.pad(x, (0, pad)).contiguous() if pad else x.contiguous()


def nvfp4_x(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x [N, H]`` (element order) in the NVFP4 kernel's step order ``[N, 128 * ceil(H / 128)]``.

    Element ``16 b + 2 k + h`` (block ``b = 8 g + l``) goes to ``128 g + 16 k + 8 h + l``; lanes past
    the last block are zero.
    """
    n, hidden = x.shape
    blocks = hidden // 16
    groups = -(-blocks // LANES)
    xb = x.float().reshape(n, blocks, 8, 2)
    if groups * LANES != blocks:
        xb = torch.nn.functional.pad(xb, (0, 0, 0, 0, 0, groups * LANES - blocks))
    return xb.reshape(n, groups, LANES, 8, 2).permute(0, 1, 3, 4, 2).reshape(n, groups * NVFP4_GROUP).contiguous()


# ---- calls ------------------------------------------------------------------------------------------
def _out(out: torch.Tensor | None, n: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(n, rows, dtype=torch.float32, device=like.device)
    if out.dtype != torch.float32 or tuple(out.shape) != (n, rows) or (rows > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be float32 [{n}, {rows}] with unit column stride, got {out.dtype} "
                         f"{list(out.shape)} strides {out.stride()}")
    return out


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"trtvocab fused kernel {what} failed (status {status})")


def fp8_logits(x: torch.Tensor, hidden: int, codes: torch.Tensor, scale: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [N, >= H]`` (:func:`fp8_x`) times the e4m3 ``codes [rows, H]`` (rows contiguous) under
    ``scale`` (0-d, or ``[rows]`` / ``[rows, 1]``): float32 ``[N, rows]``."""
    loaded = load()
    if loaded is None:
        raise RuntimeError(f"fused kernels unavailable: {unavailable_reason()}")
    n, rows = x.shape[0], codes.shape[0]
    codes = codes.view(torch.uint8)
    if codes.shape[1] != hidden or codes.stride(1) != 1 or x.stride(1) != 1 or x.shape[1] < -(-hidden // 8) * 8:
        raise ValueError("fp8_logits: layout mismatch")
    if x.dtype != torch.float32 or scale.dtype != torch.float32:
        raise ValueError("fp8_logits: x and scale must be float32")
    if scale.numel() == 1:
        scale_stride = 0
    elif scale.numel() == rows:
        scale = scale.reshape(rows)
        scale_stride = scale.stride(0)
    else:
        raise ValueError(f"fp8_logits: {scale.numel()} scales for {rows} rows")
    out = _out(out, n, rows, x)
    if n and rows:
        _check(loaded.lib.trtvocab_fp8_logits(x.data_ptr(), n, x.stride(0), hidden, codes.data_ptr(), rows,
                                              codes.stride(0), scale.data_ptr(), scale_stride, out.data_ptr(),
                                              out.stride(0)), "fp8")
    return out


def nvfp4_logits(x: torch.Tensor, hidden: int, packed_block_major: torch.Tensor, block_scales: torch.Tensor,
                 global_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (:func:`nvfp4_x`) times block-major packed E2M1 ``[rows, H / 2]`` under e4m3
    ``block_scales [rows, H / 16]`` and ``global_scale``: float32 ``[N, rows]``."""
    loaded = load()
    if loaded is None:
        raise RuntimeError(f"fused kernels unavailable: {unavailable_reason()}")
    n, rows = x.shape[0], packed_block_major.shape[0]
    bs = block_scales.view(torch.uint8)
    if (hidden % 16 or packed_block_major.shape[1] != hidden // 2 or bs.shape[1] != hidden // 16
            or bs.shape[0] != rows or x.shape[0] != n
            or packed_block_major.stride(1) != 1 or bs.stride(1) != 1 or x.stride(1) != 1
            or x.shape[1] != -(-hidden // NVFP4_GROUP) * NVFP4_GROUP or x.dtype != torch.float32):
        raise ValueError("nvfp4_logits: layout mismatch")
    out = _out(out, n, rows, x)
    if n and rows:
        _check(loaded.lib.trtvocab_nvfp4_logits(x.data_ptr(), n, x.stride(0), hidden, packed_block_major.data_ptr(),
                                                rows, packed_block_major.stride(0), bs.data_ptr(), bs.stride(0),
                                                float(global_scale), out.data_ptr(), out.stride(0)), "nvfp4")
    return out


DENSE_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
DENSE_ENV_VAR = "TRTVOCAB_DENSE_KERNEL"  # auto (default) | 1 (every dense bf16 / fp16 head) | 0 (never)
DENSE_MAX_BATCH = 64  # larger batches go to torch's GEMM (compute bound there; not measured beyond)
# CPU flags under which torch's half-precision GEMM has native dot products (oneDNN) and beat the
# kernel at B >= 2 when measured (avx512_bf16, Zen 4: bf16 B = 8 5.2 ms vs 15.5 ms, one thread).
NATIVE_DOT = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def dense_max_batch(dtype: torch.dtype) -> int:
    """The largest batch a dense head of ``dtype`` multiplies in :func:`dense_logits` (0: never).

    ``auto``: bf16 / fp16 heads up to :data:`DENSE_MAX_BATCH` rows, unless this CPU has native dot
    products for that dtype (then torch's GEMM is faster at B >= 2 and is kept at every B, so the
    head's bits do not depend on B through a switch of kernels)."""
    value = os.environ.get(DENSE_ENV_VAR, "").strip().lower() or "auto"
    if value in ("0", "false", "off", "no") or dtype not in DENSE_KERNEL_DTYPES:
        return 0
    if value in ("1", "true", "on", "yes"):
        return DENSE_MAX_BATCH
    if value != "auto":
        raise ValueError(f"{DENSE_ENV_VAR} must be auto, 1 or 0, got {value!r}")
    if any(flag in cpu_flags() for flag in NATIVE_DOT[dtype]):
        return 0
    return DENSE_MAX_BATCH



def dense_logits(x: torch.Tensor, hidden: int, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [N, >= H]`` (:func:`fp8_x`: float32, zero-padded to a multiple of 8 columns) times the
    bf16 / fp16 ``weight [rows, H]`` (unit column stride): float32 ``[N, rows]``, each logit one
    chain of 8 float32 FMA lanes over H (the FP8 chain without a scale)."""
    loaded = load()
    if loaded is None:
        raise RuntimeError(f"fused kernels unavailable: {unavailable_reason()}")
    if weight.dtype not in DENSE_KERNEL_DTYPES:
        raise ValueError(f"dense_logits: bf16 or fp16 weights, got {weight.dtype}")
    n, rows = x.shape[0], weight.shape[0]
    if (weight.shape[1] != hidden or (rows and weight.stride(1) != 1) or x.stride(1) != 1
            or x.shape[1] < -(-hidden // 8) * 8 or x.dtype != torch.float32):
        raise ValueError("dense_logits: layout mismatch")
    out = _out(out, n, rows, x)
    if n and rows:
        _check(loaded.lib.trtvocab_dense_logits(x.data_ptr(), n, x.stride(0), hidden, weight.data_ptr(), rows,
                                                weight.stride(0), int(weight.dtype == torch.float16),
                                                out.data_ptr(), out.stride(0)), "dense")
    return out


def read_probe(buffer: torch.Tensor) -> int:
    """Read all of the contiguous CPU ``buffer`` (its bytes, a multiple of 256) with the heads'
    threads and return a checksum: the kernel side of ``benchmarks/bandwidth.py``."""
    loaded = load()
    if loaded is None:
        raise RuntimeError(f"fused kernels unavailable: {unavailable_reason()}")
    nbytes = buffer.numel() * buffer.element_size()
    if not buffer.is_contiguous() or buffer.device.type != "cpu" or nbytes % 256:
        raise ValueError("read_probe: a contiguous CPU buffer of a multiple of 256 bytes")
    return int(loaded.lib.trtvocab_read_probe(buffer.data_ptr(), nbytes))


# ---- the vocab tree (trtvocab.sampling.treesum) -------------------------------------------------------
_tree_failure: str | None = None  # why the tree kernel is not used (checked once per process)
_tree_checked = False
TREE_MAX_LOGITS = (1 << 21) - 1  # longer ranges may hold a node of more blocks than the kernel buffers
EXP_SAMPLE = 1 << 22  # non-positive float32 values the load-time exp check compares (plus the edges)


def _tree_exp(d: torch.Tensor) -> torch.Tensor:
    loaded = load()
    assert loaded is not None
    d = d.contiguous()
    out = torch.empty_like(d)
    _check(loaded.lib.trtvocab_tree_exp(d.data_ptr(), d.numel(), out.data_ptr()), "tree exp")
    return out


def _exp_mismatch(d: torch.Tensor) -> int:
    """How many of ``d`` the kernel's exp and ``torch.exp(nan_to_num(d, nan=0))`` disagree on (bits)."""
    want = torch.exp(torch.nan_to_num(d, nan=0.0, posinf=float("inf"), neginf=float("-inf")))
    return int((_tree_exp(d).view(torch.int32) != want.view(torch.int32)).sum())


def tree_exp_check(exhaustive: bool = False) -> str | None:
    """Compare the tree kernel's exp with torch's, bit for bit, on what the tree feeds it (``min -
    max <= 0``): a spread sample of every binade and the edges, or (``exhaustive``, ~1e9 values,
    what ``--build`` runs) every float32 in ``[-104, 0]``, below which both give 0. None: equal."""
    edges = torch.tensor([0.0, -0.0, float("-inf"), float("nan"), -87.33654, -88.72284, -103.27893, -103.97208,
                          -104.0, -1e-45, -1e-38, -1.0, -0.5, -2.0**-24])
    bad = _exp_mismatch(edges)
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x42D00000, (EXP_SAMPLE,), generator=gen, dtype=torch.int64) | 0x80000000
    bad += _exp_mismatch(bits.to(torch.uint32).view(torch.int32).view(torch.float32))
    if exhaustive:
        step = 1 << 26
        for lo in range(0, 0x42D00001, step):
            bits = torch.arange(lo, min(lo + step, 0x42D00001), dtype=torch.int64) | 0x80000000
            bad += _exp_mismatch(bits.to(torch.uint32).view(torch.int32).view(torch.float32))
    return None if bad == 0 else f"exp differs from torch.exp on {bad} value(s)"


EXP_NAMES = {1: "MKL vmsExp", 0: "Sleef_expf8_u10"}  # tried in this order


def _choose_exp(loaded: Loaded) -> str | None:
    """Set the tree kernel's exp to the first one that matches torch.exp; None, or why none does."""
    if loaded.lib.trtvocab_tree_isa() != 1:
        return "this build has no tree kernel (needs AVX2 + FMA)"
    why = []
    for mode, name in EXP_NAMES.items():
        if loaded.lib.trtvocab_tree_set_exp(mode) != 0:
            why.append(f"{name}: not in this torch build")
            continue
        problem = tree_exp_check()
        if problem is None:
            return None
        why.append(f"{name}: {problem}")
    loaded.lib.trtvocab_tree_set_exp(-1)  # refuses: the kernel stays off
    return "; ".join(why)


def tree_available() -> bool:
    """Whether :func:`tree_nodes` runs here: the library loaded, its build has the tree kernel
    (AVX2 + FMA), and its exp matched torch's (checked once per process; on a mismatch the torch
    path is used, with one log line)."""
    global _tree_failure, _tree_checked
    loaded = load()
    if loaded is None:
        return False
    if not _tree_checked:
        with _lock:
            if not _tree_checked:
                _tree_failure = _choose_exp(loaded)
                if _tree_failure:
                    log.warning("trtvocab tree kernel unavailable, using the torch path (%s)", _tree_failure)
                _tree_checked = True
    return _tree_failure is None


def tree_nodes(x: torch.Tensor, first_id: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, s)`` float32 ``[B, count]``: the vocab tree's nodes ``aligned_nodes(first_id, first_id
    + n)`` (``count`` of them) of the float32 logits ``x [B, n]`` (unit column stride)."""
    loaded = load()
    if loaded is None or x.dtype != torch.float32 or x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError("tree_nodes: float32 [B, n] logits with unit column stride, kernels loaded")
    rows, n = x.shape
    m = torch.empty(rows, count, dtype=torch.float32)
    s = torch.empty(rows, count, dtype=torch.float32)
    if rows and n:
        _check(loaded.lib.trtvocab_tree_nodes(x.data_ptr(), rows, x.stride(0), n, first_id, m.data_ptr(),
                                              s.data_ptr(), count), "tree nodes")
    return m, s


# ---- self-check -------------------------------------------------------------------------------------
def self_check(loaded: Loaded) -> str | None:
    """Decode every FP8 code and every FP4 nibble under every block scale through the kernel
    (batch 1 and batch 2, full lane groups and a partial one) and compare bit for bit with
    torch's decode. None: all equal."""
    global _loaded
    previous = _loaded
    _loaded = loaded  # the calls below go to the library being checked
    try:
        codes = torch.arange(256, dtype=torch.uint8)
        codes = codes[(codes & 0x7F) != 0x7F]
        for hidden in (8, 13):  # one full step; a zero-padded tail step
            w = torch.zeros(codes.numel(), hidden, dtype=torch.uint8)
            w[torch.arange(codes.numel()), torch.arange(codes.numel()) % hidden] = codes
            want = codes.view(torch.float8_e4m3fn).float() * 0.75
            for n in (1, 2):
                got = fp8_logits(fp8_x(torch.ones(n, hidden)), hidden, w, torch.tensor(0.75))
                if not torch.equal(got, want.expand(n, -1)):
                    return f"FP8 decode (H={hidden}, batch {n})"
        scale_codes = torch.arange(1, 0x7F, dtype=torch.uint8)  # every finite positive e4m3 scale
        nib = torch.arange(16, dtype=torch.uint8).repeat_interleave(scale_codes.numel())
        scl = scale_codes.repeat(16)
        for hidden in (128, 16):  # one full group of 8 blocks; a partial group
            rows = nib.numel()
            codes_el = torch.zeros(rows, hidden, dtype=torch.uint8)
            col = torch.arange(rows) % hidden
            codes_el[torch.arange(rows), col] = nib
            packed = codes_el[:, 0::2] | (codes_el[:, 1::2] << 4)
            bs = scl.reshape(-1, 1).expand(rows, hidden // 16).contiguous().view(torch.float8_e4m3fn)
            want = nvfp4.dequantize_nvfp4(packed, bs, torch.tensor(0.375)).sum(1) + 0.0
            for n in (1, 2):
                got = nvfp4_logits(nvfp4_x(torch.ones(n, hidden)), hidden, nvfp4.to_block_major(packed), bs, 0.375)
                if not torch.equal(got, want.expand(n, -1)):
                    return f"NVFP4 decode (H={hidden}, batch {n})"
        return None
    finally:
        _loaded = previous


# ---- command line -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trtvocab.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build (or find in the cache) and self-check the kernels")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 0
    if disabled_reason() is not None:
        print(f"trtvocab fused kernels: disabled ({disabled_reason()}); the torch path is used")
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    loaded = load(verbose=args.verbose)
    if loaded is None:
        # Not an error for `make setup`: the heads fall back to torch, and say so once.
        print(f"trtvocab fused kernels: unavailable ({unavailable_reason()}); the torch path is used")
        return 0
    print(f"trtvocab fused kernels: {loaded.path} ({loaded.isa}, {loaded.seconds:.1f} s, self-check passed)")
    if tree_available():
        start = time.perf_counter()
        problem = tree_exp_check(exhaustive=True)
        verdict = f"differs ({problem}): the torch path is used" if problem else "matches torch.exp on [-104, 0]"
        print(f"trtvocab tree kernel: exp {verdict} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
