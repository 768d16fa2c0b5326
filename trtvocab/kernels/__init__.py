"""Fused dequantize-multiply CPU kernels for the FP8, NVFP4 and dense bf16 / fp16 / float32 heads (a JIT-built
C++ extension, ``csrc/fused.cpp``, called through :mod:`ctypes` on torch's intra-op threads).

The design and the numerics contract (each logit one chain of 8 float32 lanes over H, so it is
bitwise the same at every batch size, row partition and tp size): docs/architecture.md, "Fused
kernels", and :mod:`trtvocab.kernels.gemm`. By job: :mod:`~trtvocab.kernels.compile` (instruction
set, flags, cache folder, lock, sha256 record, compiling, binding), :mod:`~trtvocab.kernels.gemm`
(input layouts, the logits calls), :mod:`~trtvocab.kernels.selfcheck` (the load-time decode
check), :mod:`~trtvocab.kernels.library` (this process's library), :mod:`~trtvocab.kernels.tree`
(the vocab tree's nodes, which :mod:`trtvocab.sampling.treesum` calls directly),
:mod:`~trtvocab.kernels.probes` (the machine probes), :mod:`~trtvocab.kernels.__main__`
(``python -m trtvocab.kernels``: build ahead of time and self-check).
"""

from __future__ import annotations

from trtvocab.kernels.compile import Loaded
from trtvocab.kernels.gemm import FusedInput, fp8_x, nvfp4_x
from trtvocab.kernels.library import (
    available,
    dense_logits,
    dense_max_batch,
    fp8_logits,
    gguf_logits,
    load,
    nvfp4_logits,
    unavailable_reason,
    usable,
)

# What the heads and the sampler call. Building, the cache, the instruction sets and their environment variables:
# trtvocab.kernels.compile; a library per ISA, on_cpu, disabled: trtvocab.kernels.library; the machine probes:
# trtvocab.kernels.probes; the self-check: trtvocab.kernels.selfcheck.
__all__ = ["FusedInput", "Loaded", "available", "dense_logits", "dense_max_batch", "fp8_logits", "fp8_x", "gguf_logits",
           "load", "nvfp4_logits", "nvfp4_x", "unavailable_reason", "usable"]
