"""The measuring probes of the kernel library (``trtvocab/kernels/probes.py``) on every path: the read probe
reads every byte, the multiply and GGUF chain probes count (and check) the work their chains did.
"""

from __future__ import annotations

import pytest
import torch

from trtvocab.kernels import library, probes


def test_read_probe_reads_every_byte(isa):
    buf = torch.arange(1 << 16, dtype=torch.int64)
    assert probes.read_probe(buf) == int(buf.sum()) % (1 << 64)
    with pytest.raises(ValueError):
        probes.read_probe(torch.zeros(3, dtype=torch.uint8))


def test_mul_probe_counts_the_multiplies_its_chains_made(isa):
    # 16 chains a thread on the widest vectors of the build: AVX-512 16 lanes, AVX2 8, portable 1; the
    # chains' sum (every lane exactly 1.0) is checked inside, so a dropped chain raises.
    lanes = {"avx512": 16, "avx2+fma+f16c": 8, "portable": 1}[library.require().isa]
    assert probes.mul_probe(1000) == 1000 * 16 * lanes * torch.get_num_threads()
    with pytest.raises(ValueError, match="steps"):
        probes.mul_probe(0)


def test_gguf_chain_probe_counts_the_weights_its_chains_multiplied(isa):
    # 4 rows of 768 codes a thread, x = 0 (every chain exactly 0: checked inside)
    assert probes.gguf_chain_probe(10) == 10 * 4 * 768 * torch.get_num_threads()
    with pytest.raises(ValueError, match="rounds"):
        probes.gguf_chain_probe(0)
    # x = 1: every product is a multiple of 2^-6 and every sum exact, so the chains' total is the float64
    # sum of the probe's own codes times scales (the C++ file's pattern), once per round and thread
    import ctypes

    q = [[(i * 7 + r) % 64 - 32 for i in range(768)] for r in range(4)]
    scale = [[0.015625 * (1 + (s + r) % 7) for s in range(96)] for r in range(4)]
    one_round = sum(scale[r][i // 8] * q[r][i] for r in range(4) for i in range(768))
    sink = ctypes.c_float(0.0)
    made = library.require().lib.trtvocab_gguf_chain_probe(7, 1.0, ctypes.addressof(sink))
    assert made == 7 * 4 * 768 * torch.get_num_threads()
    assert sink.value == one_round * 7 * torch.get_num_threads()
