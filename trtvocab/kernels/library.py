"""This process's build of the kernels: built (or found in the cache) and self-checked on first
use, or the reason it is not used (logged once); and the calls of :mod:`trtvocab.kernels.gemm` on it."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

from trtvocab.kernels import gemm
from trtvocab.kernels.compile import ENV_VAR, ISAS, Loaded, build_library, disabled_reason, log
from trtvocab.kernels.selfcheck import self_check
from trtvocab.quant import gguf_blocks

_lock = threading.Lock()
_loaded: Loaded | None = None
_failure: str | None = None  # why the kernels cannot load in this process (set once, logged once)


def _build(verbose: bool = False, isa: str | None = None) -> Loaded:
    loaded = build_library(verbose, isa)
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


def on_cpu(*tensors: torch.Tensor) -> bool:
    """Whether every tensor lives on the CPU (the kernels' first condition; it loads nothing)."""
    return all(t.device.type == "cpu" for t in tensors)


def usable(x: torch.Tensor, *buffers: torch.Tensor) -> bool:
    """Whether the kernel can run this call: loaded, CPU tensors, no autograd through ``x``."""
    if not on_cpu(x, *buffers):
        return False
    if x.requires_grad and torch.is_grad_enabled():
        return False
    return available()



def require() -> Loaded:
    """This process's library, else ``RuntimeError`` saying why there is none."""
    loaded = load()
    if loaded is None:
        raise RuntimeError(f"fused kernels unavailable: {unavailable_reason()}")
    return loaded


# ---- the calls, on this process's library (gemm's, with their documentation) -------------------------
# Each head kernel is also an op of torch's dispatcher (``torch.ops.trtvocab.head_*``) with a fake kernel, so
# that ``torch.compile`` puts the call in its graph (a ctypes call is a graph break): a call without ``out``
# goes through the op. docs/generate.md, "How one step runs".
_OPS = torch.library.Library("trtvocab", "FRAGMENT")
_OPS.define("head_dense(Tensor x, int hidden, Tensor weight) -> Tensor")
_OPS.define("head_fp8(Tensor x, int hidden, Tensor codes, Tensor scale) -> Tensor")
_OPS.define("head_nvfp4(Tensor x, int hidden, Tensor packed, Tensor block_scales, float global_scale) -> Tensor")
_OPS.define("head_gguf(Tensor x, int hidden, int kind, Tensor blocks) -> Tensor")
_GGUF_TYPE = {t.kind: t.name for t in gguf_blocks.BLOCK_TYPES.values()}
_OPS.impl("head_dense", lambda x, hidden, weight: gemm.dense_logits(require(), x, hidden, weight), "CPU")
_OPS.impl("head_fp8", lambda x, hidden, codes, scale: gemm.fp8_logits(require(), x, hidden, codes, scale), "CPU")
_OPS.impl("head_nvfp4", lambda x, hidden, packed, block_scales, global_scale: gemm.nvfp4_logits(
    require(), x, hidden, packed, block_scales, global_scale), "CPU")
_OPS.impl("head_gguf", lambda x, hidden, kind, blocks: gemm.gguf_logits(require(), x, hidden, _GGUF_TYPE[kind],
                                                                        blocks), "CPU")


def _fake_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], rows), dtype=torch.float32)


torch.library.register_fake("trtvocab::head_dense")(lambda x, hidden, weight: _fake_rows(x, weight.shape[0]))
torch.library.register_fake("trtvocab::head_fp8")(lambda x, hidden, codes, scale: _fake_rows(x, codes.shape[0]))
torch.library.register_fake("trtvocab::head_nvfp4")(
    lambda x, hidden, packed, block_scales, global_scale: _fake_rows(x, packed.shape[0]))
torch.library.register_fake("trtvocab::head_gguf")(lambda x, hidden, kind, blocks: _fake_rows(x, blocks.shape[0]))


def fp8_logits(x: torch.Tensor, hidden: int, codes: torch.Tensor, scale: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`trtvocab.kernels.gemm.fp8_logits` on this process's library."""
    if out is None:
        return torch.ops.trtvocab.head_fp8(x, hidden, codes, scale)
    return gemm.fp8_logits(require(), x, hidden, codes, scale, out)


def nvfp4_logits(x: torch.Tensor, hidden: int, packed_block_major: torch.Tensor, block_scales: torch.Tensor,
                 global_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`trtvocab.kernels.gemm.nvfp4_logits` on this process's library."""
    if out is None:
        return torch.ops.trtvocab.head_nvfp4(x, hidden, packed_block_major, block_scales, float(global_scale))
    return gemm.nvfp4_logits(require(), x, hidden, packed_block_major, block_scales, global_scale, out)


def gguf_logits(x: torch.Tensor, hidden: int, block_type: str, blocks: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`trtvocab.kernels.gemm.gguf_logits` on this process's library."""
    if out is None:
        return torch.ops.trtvocab.head_gguf(x, hidden, gguf_blocks.BLOCK_TYPES[block_type].kind, blocks)
    return gemm.gguf_logits(require(), x, hidden, block_type, blocks, out)


def dense_logits(x: torch.Tensor, hidden: int, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`trtvocab.kernels.gemm.dense_logits` on this process's library."""
    if out is None:
        return torch.ops.trtvocab.head_dense(x, hidden, weight)
    return gemm.dense_logits(require(), x, hidden, weight, out)


def dense_max_batch(dtype: torch.dtype) -> int:
    """:func:`trtvocab.kernels.gemm.dense_max_batch` for this process's library (loaded only where
    the answer depends on its path: a float32 head, or a CPU with native dot products for ``dtype``)."""
    if gemm.dense_max_batch(dtype, "avx512") == 0:
        return 0
    loaded = load() if dtype == torch.float32 or gemm.native_dot(dtype) else None
    return gemm.dense_max_batch(dtype, loaded.isa if loaded is not None else None)
