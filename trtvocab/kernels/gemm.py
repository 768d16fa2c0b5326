"""How the fused kernels multiply (the numerics contract), the inputs' layouts, and the calls into
a given build of the library (:class:`~trtvocab.kernels.build.Loaded`, the first argument of every
call here; ``trtvocab.kernels.fp8_logits`` etc., :mod:`trtvocab.kernels.runtime`, pass this
process's library).

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
  B = 3, 1 beyond). B >= 9: the tile kernel. Every logit's chain is the same in all of them
  (the AVX-512 kernels of B = 1..8 below included).
- **Paths** (chosen at build time from the CPU's features; ``$TRTVOCAB_KERNELS_ISA`` forces a
  lower one, part of the build's name): ``native`` (``-march=native``: the AVX-512 code on a CPU
  with AVX-512 F + BW + VL + DQ, else the AVX2 + FMA + F16C code, else portable C++), ``avx512``
  (``-march=x86-64-v4``), ``avx2`` (``-march=haswell``) or ``portable`` (``-march=x86-64``: no
  intrinsics, FMA only where the compiler has a hardware ``fmaf``). :func:`load_isa` builds any of
  them in one process (the tests run every check on each path this CPU can execute, and compare
  the vector paths with each other bit for bit).
- **AVX-512** (batch 1..8; larger batches run the AVX2 tile kernel): the chains above, unchanged,
  two per zmm register: FP8 / dense hold the chains of two weight rows (row pairs; an odd last row
  is paired with itself), and so does NVFP4 at B = 2..8 (one step of ``x`` broadcast to both
  halves and shared by several row pairs); NVFP4 at B = 1 holds two lane groups of one row (each
  group's block sums from zero, then added to the row's 8-lane total in group order, as on AVX2).
  Every logit is bitwise the AVX2 path's. The next rows' lines are prefetched while a pass runs
  (an NVFP4 row's 8 runs are 5 lines each at H = 5120: too short for the hardware prefetchers).
  Decode: FP8 as above, two steps of a row pair per 16-byte load of each row; NVFP4
  by one ``vpermps`` over the 16 e2m1 values (sign included) per 16 nibbles; bf16 by a 16-bit
  shift of the zero-extended words; fp16 by F16C. ``x`` is re-laid out once per call so that the
  B rows of a step lie side by side (no L1 set conflicts between rows ``4 H`` bytes apart).
  ``vdpbf16ps`` (AVX512-BF16) is not used: it rounds a pair of products together (and flushes
  subnormals), which is not this fp32 FMA chain, so it would break the bitwise contract and the
  error bound.
- **Dense heads** (:func:`dense_logits`): the FP8 chain without a scale (``sum + 0``), then one
  rounding to the head dtype: the bf16 / fp16 logits of a batch up to :data:`DENSE_MAX_BATCH` are
  bitwise the same at every batch, split and tp size. ``$TRTVOCAB_DENSE_KERNEL``: ``auto`` (for a
  dtype this CPU has native dot products for, ``avx512_bf16`` / ``amx_bf16``, ``avx512_fp16`` /
  ``amx_fp16``, where torch's GEMM was measured faster than the AVX2 kernels: the AVX-512 kernels up
  to batch 8 only, else torch's GEMM), ``1`` or ``0``.
- **Activations** stay in torch (``quantize_input``: fake-quant e4m3, NVFP4 16-wide blocks, or
  none); only the weight decode and the multiply move here. Accumulation is float32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trtvocab.kernels.build import Loaded, cpu_flags

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


DENSE_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
DENSE_ENV_VAR = "TRTVOCAB_DENSE_KERNEL"  # auto (default) | 1 (every dense bf16 / fp16 head) | 0 (never)
DENSE_MAX_BATCH = 64  # larger batches go to torch's GEMM (compute bound there; not measured beyond)
WIDE_MAX_BATCH = 8  # the batches the AVX-512 kernels run (larger ones: the AVX2 tile kernel)
# CPU flags under which torch's half-precision GEMM has native dot products (oneDNN) and beat the
# AVX2 kernel at B >= 2 when measured (avx512_bf16, Zen 4: bf16 B = 8 5.2 ms vs 15.5 ms, one thread);
# the AVX-512 kernels beat it at B <= 8 (avx512_bf16, Zen 5, V = 129280, H = 5120, two threads, best
# of 5 interleaved: B = 1 56 vs 81 ms, 2: 69 vs 76, 4: 49 vs 77, 8: 38 vs 61).
NATIVE_DOT = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


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
    every B)."""
    value = os.environ.get(DENSE_ENV_VAR, "").strip().lower() or "auto"
    if value in ("0", "false", "off", "no") or dtype not in DENSE_KERNEL_DTYPES:
        return 0
    if value in ("1", "true", "on", "yes"):
        return DENSE_MAX_BATCH
    if value != "auto":
        raise ValueError(f"{DENSE_ENV_VAR} must be auto, 1 or 0, got {value!r}")
    if native_dot(dtype):
        return WIDE_MAX_BATCH if isa == "avx512" else 0
    return DENSE_MAX_BATCH


def dense_logits(loaded: Loaded, x: torch.Tensor, hidden: int, weight: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [N, >= H]`` (:func:`fp8_x`: float32, zero-padded to a multiple of 8 columns) times the
    bf16 / fp16 ``weight [rows, H]`` (unit column stride): float32 ``[N, rows]``, each logit one
    chain of 8 float32 FMA lanes over H (the FP8 chain without a scale)."""
    if weight.dtype not in DENSE_KERNEL_DTYPES:
        raise ValueError(f"dense_logits: bf16 or fp16 weights, got {weight.dtype}")
    n, rows = x.shape[0], weight.shape[0]
    if (weight.shape[1] != hidden or (rows and weight.stride(1) != 1) or x.stride(1) != 1
            or x.shape[1] < -(-hidden // 8) * 8 or x.dtype != torch.float32):
        raise ValueError("dense_logits: layout mismatch")
    out = _out(out, n, rows, x)
    if n and rows:
        check_status(loaded.lib.trtvocab_dense_logits(x.data_ptr(), n, x.stride(0), hidden, weight.data_ptr(), rows,
                                                     weight.stride(0), int(weight.dtype == torch.float16),
                                                     out.data_ptr(), out.stride(0)), "dense")
    return out


def read_probe(loaded: Loaded, buffer: torch.Tensor) -> int:
    """Read all of the contiguous CPU ``buffer`` (its bytes, a multiple of 256) with the heads'
    threads and return a checksum: the kernel side of ``benchmarks/bandwidth.py``."""
    nbytes = buffer.numel() * buffer.element_size()
    if not buffer.is_contiguous() or buffer.device.type != "cpu" or nbytes % 256:
        raise ValueError("read_probe: a contiguous CPU buffer of a multiple of 256 bytes")
    return int(loaded.lib.trtvocab_read_probe(buffer.data_ptr(), nbytes))

