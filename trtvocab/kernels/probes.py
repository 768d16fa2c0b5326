"""The machine probes of the kernels' library (``csrc/probes.cpp``): what ``benchmarks/bandwidth.py`` and
``benchmarks/gguf_head.py`` measure against. Not part of the :mod:`trtvocab.kernels` facade: no head calls them.

Each takes a :class:`~trtvocab.kernels.compile.Loaded` or, left out, this process's library."""

from __future__ import annotations

import ctypes

import torch

from trtvocab.kernels.compile import Loaded
from trtvocab.kernels.library import require


def read_probe(buffer: torch.Tensor, loaded: Loaded | None = None) -> int:
    """Read all of the contiguous CPU ``buffer`` (its bytes, a multiple of 256) with the heads'
    threads and return a checksum: the kernel side of ``benchmarks/bandwidth.py``."""
    nbytes = buffer.numel() * buffer.element_size()
    if not buffer.is_contiguous() or buffer.device.type != "cpu" or nbytes % 256:
        raise ValueError("read_probe: a contiguous CPU buffer of a multiple of 256 bytes")
    return int((loaded or require()).lib.trtvocab_read_probe(buffer.data_ptr(), nbytes))


def mul_probe(steps: int, loaded: Loaded | None = None) -> int:
    """Run ``steps`` rounds of 16 independent float32 multiply chains per thread (the heads' threads, the
    widest vectors the library has) and return the multiplies made: the compute side of
    ``benchmarks/bandwidth.py``, the rate no float32 chain of multiplies can beat."""
    if steps < 1:
        raise ValueError(f"mul_probe: steps must be >= 1, got {steps}")
    sink = ctypes.c_float(0.0)
    made = int((loaded or require()).lib.trtvocab_mul_probe(steps, 1.0, ctypes.addressof(sink)))
    expected = made // steps // 16 * 136  # chain i of every lane ends at exactly i + 1 (m = 1)
    if sink.value != expected:
        raise RuntimeError(f"mul_probe: the chains summed to {sink.value}, not {expected}")
    return made


def gguf_chain_probe(rounds: int, loaded: Loaded | None = None) -> int:
    """Run the GGUF chain at B = 1 on codes and x already in L1 (no block format to unpack, no memory to wait
    for) ``rounds`` times per thread and return the weights multiplied: the pace of the kernels' decode of
    this chain with nothing to unpack (``benchmarks/gguf_head.py``'s ``chain`` line; docs/kernels.md, K19)."""
    if rounds < 1:
        raise ValueError(f"gguf_chain_probe: rounds must be >= 1, got {rounds}")
    sink = ctypes.c_float(1.0)
    made = int((loaded or require()).lib.trtvocab_gguf_chain_probe(rounds, 0.0, ctypes.addressof(sink)))
    if sink.value != 0.0:  # x = 0: every chain ends at exactly 0
        raise RuntimeError(f"gguf_chain_probe: the chains summed to {sink.value}, not 0")
    return made
