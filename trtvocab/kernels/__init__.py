"""Fused dequantize-multiply CPU kernels for the FP8, NVFP4 and dense bf16 / fp16 / float32 heads (a JIT-built
C++ extension, ``csrc/fused.cpp``, called through :mod:`ctypes` on torch's intra-op threads).

The design and the numerics contract (each logit one chain of 8 float32 lanes over H, so it is
bitwise the same at every batch size, row partition and tp size): docs/architecture.md, "Fused
kernels", and :mod:`trtvocab.kernels.gemm`. By job: :mod:`~trtvocab.kernels.compile` (instruction
set, flags, cache folder, lock, sha256 record, compiling, binding), :mod:`~trtvocab.kernels.gemm`
(input layouts, the logits calls), :mod:`~trtvocab.kernels.selfcheck` (the load-time decode
check), :mod:`~trtvocab.kernels.library` (this process's library), :mod:`~trtvocab.kernels.tree`
(the vocab tree's nodes), :mod:`~trtvocab.kernels.__main__` (``python -m trtvocab.kernels --build``).
"""

from __future__ import annotations

from trtvocab.kernels.compile import (
    ABI,
    CACHE_ENV_VAR,
    ENV_VAR,
    ISA_CPU_FLAGS,
    ISA_ENV_VAR,
    ISA_NAMES,
    ISAS,
    LOCK_NAME,
    LOCK_TIMEOUT_ENV_VAR,
    SOURCE,
    TORCH_BATON,
    TREE_SOURCE,
    Loaded,
    build_lock,
    build_name,
    build_root,
    cache_problem,
    cflags,
    cpu_flags,
    disabled_reason,
    lock_timeout,
    record_path,
    requested_isa,
    write_record,
)
from trtvocab.kernels.gemm import (
    DENSE_ENV_VAR,
    DENSE_KERNEL_DTYPES,
    DENSE_MAX_BATCH,
    FLOAT32_MAX_BATCH,
    LANES,
    NATIVE_DOT,
    NVFP4_GROUP,
    WIDE_MAX_BATCH,
    FusedInput,
    fp8_x,
    nvfp4_x,
)
from trtvocab.kernels.library import (
    available,
    dense_logits,
    dense_max_batch,
    disabled,
    fp8_logits,
    gguf_chain_probe,
    gguf_logits,
    gguf_usable,
    load,
    load_isa,
    mul_probe,
    nvfp4_logits,
    on_cpu,
    read_probe,
    unavailable_reason,
    usable,
)
from trtvocab.kernels.selfcheck import self_check
from trtvocab.kernels.tree import TREE_MAX_LOGITS, tree_available, tree_exp_check, tree_nodes

__all__ = ["ABI", "CACHE_ENV_VAR", "DENSE_ENV_VAR", "DENSE_KERNEL_DTYPES", "DENSE_MAX_BATCH", "ENV_VAR",
           "FLOAT32_MAX_BATCH", "ISAS", "ISA_CPU_FLAGS",
           "ISA_ENV_VAR", "ISA_NAMES", "LANES", "LOCK_NAME", "LOCK_TIMEOUT_ENV_VAR", "NATIVE_DOT",
           "NVFP4_GROUP", "SOURCE", "TORCH_BATON", "TREE_MAX_LOGITS", "TREE_SOURCE", "WIDE_MAX_BATCH",
           "FusedInput", "Loaded", "available",
           "build_lock", "build_name", "build_root", "cache_problem", "cflags", "cpu_flags", "dense_logits",
           "dense_max_batch", "disabled", "disabled_reason", "fp8_logits", "fp8_x", "gguf_chain_probe", "gguf_logits",
           "gguf_usable", "load", "load_isa", "lock_timeout", "mul_probe", "nvfp4_logits", "nvfp4_x", "on_cpu",
           "read_probe", "record_path", "requested_isa",
           "self_check", "tree_available", "tree_exp_check", "tree_nodes", "unavailable_reason", "usable",
           "write_record"]
