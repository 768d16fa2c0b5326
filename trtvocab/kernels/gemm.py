"""How the fused kernels multiply: the numerics contract, the inputs' layouts, and the calls into a
given build of the library.

Every call here takes a :class:`~trtvocab.kernels.compile.Loaded` first (``trtvocab.kernels.fp8_logits``
etc., in :mod:`trtvocab.kernels.library`, pass this process's library). The quantized heads decode
their codes inside the multiply, so the weight is read once per call in its stored bytes; the same
library multiplies dense bf16 / fp16 heads (:func:`dense_logits`) where torch's GEMM has no native
dot products for that dtype, and float32 heads at decode batches, where torch's sgemm is compute
bound (:func:`dense_max_batch`). Each logit is one fixed FMA chain, bitwise
the same for any row split, batch and tp size; :func:`nvfp4_x` lays ``x`` out in the block-major
step order of an NVFP4 head.

The chains, the exact decode, the reassociation and its error bound, the batch kernels, the
instruction-set paths (``$TRTVOCAB_KERNELS_ISA``) and the dense rule (``$TRTVOCAB_DENSE_KERNEL``):
docs/architecture.md, "Fused kernels".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trtvocab.kernels.compile import Loaded, cpu_flags
from trtvocab.quant import gguf_blocks

LANES = 8
NVFP4_GROUP = 8 * 16  # elements per NVFP4 lane group: 8 blocks of 16


@dataclass(frozen=True)
class FusedInput:
    """What :meth:`QuantizedWeight.prepare` returns when the kernel runs: ``x`` in the kernel's
    layout (float32 ``[N, S * 8]``, contiguous)."""

    x: torch.Tensor



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


def check_status(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"trtvocab fused kernel {what} failed (status {status})")


def fp8_logits(loaded: Loaded, x: torch.Tensor, hidden: int, codes: torch.Tensor, scale: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [N, >= H]`` (:func:`fp8_x`) times the e4m3 ``codes [rows, H]`` (rows contiguous) under
    ``scale`` (0-d, or ``[rows]`` / ``[rows, 1]``): float32 ``[N, rows]``."""
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
        status = loaded.lib.trtvocab_fp8_logits(x.data_ptr(), n, x.stride(0), hidden, codes.data_ptr(), rows,
                                                codes.stride(0), scale.data_ptr(), scale_stride, out.data_ptr(),
                                                out.stride(0))
        check_status(status, "fp8")
    return out


def nvfp4_logits(loaded: Loaded, x: torch.Tensor, hidden: int, packed_block_major: torch.Tensor,
                 block_scales: torch.Tensor, global_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (:func:`nvfp4_x`) times block-major packed E2M1 ``[rows, H / 2]`` under e4m3
    ``block_scales [rows, H / 16]`` and ``global_scale``: float32 ``[N, rows]``."""
    n, rows = x.shape[0], packed_block_major.shape[0]
    bs = block_scales.view(torch.uint8)
    if (hidden % 16 or packed_block_major.shape[1] != hidden // 2 or bs.shape[1] != hidden // 16
            or bs.shape[0] != rows or x.shape[0] != n
            or packed_block_major.stride(1) != 1 or bs.stride(1) != 1 or x.stride(1) != 1
            or x.shape[1] != -(-hidden // NVFP4_GROUP) * NVFP4_GROUP or x.dtype != torch.float32):
        raise ValueError("nvfp4_logits: layout mismatch")
    out = _out(out, n, rows, x)
    if n and rows:
        status = loaded.lib.trtvocab_nvfp4_logits(x.data_ptr(), n, x.stride(0), hidden, packed_block_major.data_ptr(),
                                                  rows, packed_block_major.stride(0), bs.data_ptr(), bs.stride(0),
                                                  float(global_scale), out.data_ptr(), out.stride(0))
        check_status(status, "nvfp4")
    return out


def gguf_logits(loaded: Loaded, x: torch.Tensor, hidden: int, block_type: str, blocks: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x [N, H]`` (unit column stride) times GGUF ``blocks [rows, H / block * type_size]``
    (uint8, rows as stored): float32 ``[N, rows]`` in the chain of :mod:`trtvocab.quant.gguf_blocks`."""
    block = gguf_blocks.BLOCK_TYPES[block_type]
    n, rows = x.shape[0], blocks.shape[0]
    if (hidden % block.values or blocks.dtype != torch.uint8 or blocks.shape[1] != hidden // block.values * block.bytes
            or (rows and blocks.stride(1) != 1) or x.dtype != torch.float32 or x.shape[1] != hidden
            or x.stride(1) != 1):
        raise ValueError("gguf_logits: layout mismatch")
    out = _out(out, n, rows, x)
    if n and rows:
        check_status(loaded.lib.trtvocab_gguf_logits(x.data_ptr(), n, x.stride(0), hidden, block.kind,
                                                    blocks.data_ptr(), rows, blocks.stride(0), out.data_ptr(),
                                                    out.stride(0)), "gguf")
    return out


DENSE_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DENSE_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # trtvocab_dense_logits' kind
DENSE_ENV_VAR = "TRTVOCAB_DENSE_KERNEL"  # auto (default) | 1 (every dense head, any batch <= 64) | 0 (never)
DENSE_MAX_BATCH = 64  # larger batches go to torch's GEMM (compute bound there; not measured beyond)
# The batches of the AVX-512 one-pass kernels (larger ones: its tile kernel, slower than torch's GEMM with
# native bf16 dot products: Zen 5, 2 threads, bf16 B = 9 ~75 vs 50 ms, 16 ~90 vs 62, 64 ~290 vs 131).
WIDE_MAX_BATCH = 8
# CPU flags under which torch's half-precision GEMM has native dot products (oneDNN) and beat the
# AVX2 kernel at B >= 2 when measured (avx512_bf16, Zen 4: bf16 B = 8 5.2 ms vs 15.5 ms, one thread);
# the AVX-512 kernels beat it at B <= 8 (avx512_bf16, Zen 5, V = 129280, H = 5120, two threads, best
# of 5 interleaved: B = 1 56 vs 81 ms, 2: 69 vs 76, 4: 49 vs 77, 8: 38 vs 61).
NATIVE_DOT = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
# float32 heads: torch's GEMM (MKL / oneDNN sgemm) is native everywhere but, at a decode batch, far
# from the read bandwidth (compute bound in its small-M kernels), so the library's one pass wins up to
# these batches, by path (Zen 5, best of 5-7 interleaved; V x H = 49152 x 576, one thread / two:
# avx512 B = 1 3.9 vs 7.5 ms, 8: 4.7 vs 15.6, 16: 13.6 vs 18.3, 32: 28.6 vs 28.4 (even), 64: 99 vs 49;
# 129280 x 5120, two threads: B = 8 44 vs 343 ms, 16: 129 vs 400; the avx2 build B = 8 8.6 vs 12.7,
# B = 9 21 vs 14 with one thread). The portable build never.
FLOAT32_MAX_BATCH = {"avx512": 16, "avx2+fma+f16c": 8}


def native_dot(dtype: torch.dtype) -> bool:
    """Whether torch's GEMM has native dot products for ``dtype`` on this CPU."""
    return any(flag in cpu_flags() for flag in NATIVE_DOT.get(dtype, ()))


def dense_max_batch(dtype: torch.dtype, isa: str | None = None) -> int:
    """The largest batch a dense head of ``dtype`` multiplies in :func:`dense_logits` (0: never), for
    a library of path ``isa`` (:attr:`Loaded.isa`; :func:`trtvocab.kernels.dense_max_batch` passes
    this process's).

    ``auto``: bf16 / fp16 heads up to :data:`DENSE_MAX_BATCH` rows, unless this CPU has native dot
    products for that dtype: then the AVX-512 library up to :data:`WIDE_MAX_BATCH` rows (where it was
    measured faster than torch's GEMM; a larger batch is torch's, so such a head's bits are batch
    invariant up to 8 rows only), any other none (torch's GEMM is faster at B >= 2 and is kept at
    every B). float32 heads: up to :data:`FLOAT32_MAX_BATCH` rows of the library's path. ``1``: every
    dense head up to :data:`DENSE_MAX_BATCH` rows."""
    value = os.environ.get(DENSE_ENV_VAR, "").strip().lower() or "auto"
    if value in ("0", "false", "off", "no") or dtype not in DENSE_KERNEL_DTYPES:
        return 0
    if value in ("1", "true", "on", "yes"):
        return DENSE_MAX_BATCH
    if value != "auto":
        raise ValueError(f"{DENSE_ENV_VAR} must be auto, 1 or 0, got {value!r}")
    if dtype == torch.float32:
        return FLOAT32_MAX_BATCH.get(isa or "", 0)
    if native_dot(dtype):
        return WIDE_MAX_BATCH if isa == "avx512" else 0
    return DENSE_MAX_BATCH


def dense_logits(loaded: Loaded, x: torch.Tensor, hidden: int, weight: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [N, >= H]`` (:func:`fp8_x`: float32, zero-padded to a multiple of 8 columns) times the
    bf16 / fp16 / float32 ``weight [rows, H]`` (unit column stride): float32 ``[N, rows]``, each logit one
    chain of 8 float32 FMA lanes over H (the FP8 chain without a scale)."""
    if weight.dtype not in DENSE_KERNEL_DTYPES:
        raise ValueError(f"dense_logits: bf16, fp16 or float32 weights, got {weight.dtype}")
    n, rows = x.shape[0], weight.shape[0]
    if (weight.shape[1] != hidden or (rows and weight.stride(1) != 1) or x.stride(1) != 1
            or x.shape[1] < -(-hidden // 8) * 8 or x.dtype != torch.float32):
        raise ValueError("dense_logits: layout mismatch")
    out = _out(out, n, rows, x)
    if n and rows:
        check_status(loaded.lib.trtvocab_dense_logits(x.data_ptr(), n, x.stride(0), hidden, weight.data_ptr(), rows,
                                                     weight.stride(0), _DENSE_KIND[weight.dtype],
                                                     out.data_ptr(), out.stride(0)), "dense")
    return out
