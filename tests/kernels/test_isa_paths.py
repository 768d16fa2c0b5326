"""Every path (ISA) of the fused kernels: each build of the library (``TRTVOCAB_KERNELS_ISA``: native, avx512,
avx2, portable) is the path it claims and runs the same checks -- every FP8 code and NVFP4 nibble at
batches 1..9 (the batch-2..8 kernels, the NVFP4 4-group decoder), adversarial values, uneven shards and
partitions; the vector paths (AVX-512, AVX2) give the same bits.
"""

from __future__ import annotations

import platform

import pytest
import torch

from tests.kernels.fused_reference import (
    BATCHES_1_9,
    DENSE_DTYPES,
    F8,
    FINITE_FP8,
    FP8,
    NVFP4,
    adversarial_cases,
    adversarial_tensors,
    batch_invariant,
    check,
    every_nibble_rows,
    exact_weight,
    fp8_tensors,
    make_head,
    nvfp4_tensors,
    same_on_every_path,
    tensors_for,
    vector_paths,
)
from trtvocab import Mapping, kernels
from trtvocab.kernels import compile as kcompile
from trtvocab.kernels import gemm, library
from trtvocab.quant import nvfp4


# Each build of the library runs the same checks (the `isa` fixture, tests/kernels/conftest.py); a path
# this machine cannot run is skipped with the reason. The chains are the same in every build; only the
# portable build may round a * b + c twice where the CPU has no FMA (still inside the same bounds).
def _native_path() -> str:
    """The path -march=native takes on this CPU."""
    flags = kcompile.cpu_flags()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "portable"
    for isa, name in (("avx512", "avx512"), ("avx2", "avx2+fma+f16c")):
        if kcompile.ISA_CPU_FLAGS[isa] <= flags:
            return name
    return "portable"


def test_isa_builds_are_the_paths_they_claim(isa):
    loaded = kernels.load()
    assert loaded is not None
    want = {"portable": "portable", "avx2": "avx2+fma+f16c", "avx512": "avx512"}.get(isa, _native_path())
    assert loaded.isa == want  # native on an AVX-512 CPU: the AVX-512 code; on an AVX2 one: the AVX2 code
    assert library.self_check(loaded) is None
    assert str(loaded.path) != str(library.load_isa("portable").path) or isa == "portable"


def test_isa_setting_is_validated(monkeypatch):
    monkeypatch.setenv(kcompile.ISA_ENV_VAR, "avx2")
    assert kcompile.requested_isa() == "avx2"
    assert kcompile.build_name() == kcompile.build_name("avx2") != kcompile.build_name("portable")
    assert len({kcompile.build_name(isa) for isa in library.ISAS}) == len(library.ISAS)
    monkeypatch.setenv(kcompile.ISA_ENV_VAR, "sse9")
    with pytest.raises(ValueError, match=kcompile.ISA_ENV_VAR):
        kcompile.requested_isa()
    monkeypatch.delenv(kcompile.ISA_ENV_VAR)
    assert kcompile.requested_isa() == "native"


# ---- every path, batches 1..9 --------------------------------------------------------------------------------
@pytest.mark.parametrize("hidden", [1, 13, 40, 520, 1029])
def test_fp8_every_code_batches_1_to_9(isa, hidden):
    gen = torch.Generator().manual_seed(hidden)
    v = FINITE_FP8.numel() + 3  # not a multiple of the tiles
    codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
    codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
    for per_row in (False, True):
        t = fp8_tensors(v, hidden, gen, codes=codes, per_row=per_row)
        head = make_head(FP8, "none", v, hidden, t, per_row=per_row)
        w64 = exact_weight(FP8, t)
        x = torch.randn(9, hidden, generator=gen).bfloat16()
        got = batch_invariant(head, x)
        for b in BATCHES_1_9:
            check(head, x[:b], w64, fused_path=True)
        assert got.shape[0] == 9
    eye = torch.eye(hidden)[: min(hidden, 9)]
    if hidden <= 9:  # one-hot rows read single codes back exactly at batch <= 9
        assert torch.equal(head.weights(eye.bfloat16()).double(), exact_weight(FP8, t).t().float().double())


@pytest.mark.parametrize("hidden", [16, 144, 512, 528, 784, 1040])
def test_nvfp4_every_nibble_batches_1_to_9(isa, hidden):
    """Widths that take the 4-group decoder (>= 32 blocks), its pairs and singles, and a partial group."""
    gen = torch.Generator().manual_seed(hidden)
    v, _, packed = every_nibble_rows(hidden, gen)
    t = nvfp4_tensors(v, hidden, gen, packed=packed, scale_codes=(0x01, 0x7F))
    w64 = exact_weight(NVFP4, t)
    for activation in ("none", "static"):
        head = make_head(NVFP4, activation, v, hidden, t)
        x = torch.randn(9, hidden, generator=gen).bfloat16()
        batch_invariant(head, x)
        for b in BATCHES_1_9:
            check(head, x[:b], w64, fused_path=True)
    for b in BATCHES_1_9:  # one-hot rows: every nibble under every block scale read back exactly
        cols = (torch.arange(b) * 37) % hidden
        eye = torch.zeros(b, hidden)
        eye[torch.arange(b), cols] = 1.0
        got = make_head(NVFP4, "none", v, hidden, t).weights(eye.bfloat16()).double()
        assert torch.equal(got, w64[:, cols].t().float().double())


@pytest.mark.parametrize(("name", "algo", "spec"), adversarial_cases(), ids=[c[0] for c in adversarial_cases()])
def test_adversarial_values_every_path_and_batch(isa, name, algo, spec):
    v, h = 41, 528  # the NVFP4 4-group decoder and a pair; FP8 tail-free
    gen = torch.Generator().manual_seed(7)
    t = adversarial_tensors(algo, spec, v, h, gen)
    w64 = exact_weight(algo, t)
    head = make_head(algo, "none", v, h, t)
    for b in (1, 2, 3, 5, 8, 9):
        for x in (torch.zeros(b, h), torch.full((b, h), 448.0), torch.randn(b, h, generator=gen) * 1e4):
            got = check(head, x.bfloat16(), w64, fused_path=True)
            if not bool(x.any()) or not bool(w64.any()):
                assert torch.equal(got, torch.zeros_like(got)) and not bool(torch.signbit(got).any())


@pytest.mark.parametrize("algo", [FP8, NVFP4])
def test_uneven_shards_and_partitions_every_batch(isa, algo):
    v, h = 203, 528
    t = tensors_for(algo, v, h, seed=11, per_row=algo is FP8)
    w64 = exact_weight(algo, t)
    single = make_head(algo, "none", v, h, t, per_row=algo is FP8)
    x = torch.randn(9, h, generator=torch.Generator().manual_seed(12)).bfloat16()
    for b in BATCHES_1_9:
        full = check(single, x[:b], w64, fused_path=True)
        for rank in range(3):
            mapping = Mapping(world_size=3, rank=rank, tp_size=3)
            head = make_head(algo, "none", v, h, t, per_row=algo is FP8, mapping=mapping, layout="uneven")
            assert torch.equal(check(head, x[:b], w64, fused_path=True), full[:, head.shard.start : head.shard.end])
        prepared = single.weights.prepare(x[:b])
        pieces = torch.cat([single.weights.block_logits(prepared, lo, min(v, lo + 29)) for lo in range(0, v, 29)], 1)
        assert torch.equal(pieces.double(), full)


# ---- the vector paths give the same bits ---------------------------------------------------------------------
@pytest.mark.parametrize("hidden", [13, 520, 1029])
def test_fp8_and_dense_bitwise_across_paths(hidden):
    paths = vector_paths()
    gen = torch.Generator().manual_seed(hidden)
    v = FINITE_FP8.numel() + 3  # odd: the AVX-512 row pairs end with a row paired with itself
    codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
    codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
    scales = [torch.tensor(2e-3), torch.rand(v, generator=gen) * 1e-2 + 1e-4, torch.tensor(2.0**60)]
    dense = {dt: (torch.randn(v, hidden, generator=gen) * 0.05).to(dt) for dt in DENSE_DTYPES}
    for b in BATCHES_1_9:
        x = kernels.fp8_x(torch.randn(b, hidden, generator=gen).bfloat16().float())
        for scale in scales:
            for lo, hi in ((0, v), (3, v - 2)):  # a shard starting mid-pair
                rows_scale = scale if scale.numel() == 1 else scale[lo:hi]
                same_on_every_path(paths, gemm.fp8_logits, x, hidden, codes[lo:hi], rows_scale)
        for w in dense.values():
            same_on_every_path(paths, gemm.dense_logits, x, hidden, w)


def test_dense_float32_whole_rows_and_chunks_bitwise_across_paths():
    """The AVX-512 kernel runs float32 rows whole while x (B rows of H float32) fits in 256 KiB, else in
    K-chunks: at H = 8200, B = 7 runs whole, B = 8 in chunks (and a tail step); every path, the same bits."""
    paths = vector_paths()
    gen = torch.Generator().manual_seed(8200)
    hidden, v = 8200 + 3, 37
    w = torch.randn(v, hidden, generator=gen) * 0.05
    for b in (7, 8):
        x = kernels.fp8_x(torch.randn(b, hidden, generator=gen))
        same_on_every_path(paths, gemm.dense_logits, x, hidden, w)
        same_on_every_path(paths, gemm.dense_logits, x, hidden, w[3:])


@pytest.mark.parametrize("hidden", [16, 144, 256, 528, 784, 1040, 5120])
def test_nvfp4_bitwise_across_paths(hidden):
    """Widths with no full pair of lane groups, an odd group after the pairs, a partial group, and the head's H."""
    paths = vector_paths()
    gen = torch.Generator().manual_seed(hidden)
    v, _, packed = every_nibble_rows(hidden, gen)
    packed = nvfp4.to_block_major(packed)
    for scale_codes, global_scale in (((0x01, 0x7F), 1e-3), ((0x7E, 0x7F), 6.0 * 448), ((0x01, 0x08), 1.0)):
        bs = torch.randint(*scale_codes, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8)
        for b in BATCHES_1_9:
            x = kernels.nvfp4_x(torch.randn(b, hidden, generator=gen).bfloat16().float() * 100)
            same_on_every_path(paths, gemm.nvfp4_logits, x, hidden, packed, bs, global_scale)
            same_on_every_path(paths, gemm.nvfp4_logits, x, hidden, packed[5:], bs[5:], global_scale)
