"""The vdpbf16ps kernels (AVX-512 BF16, every batch, the tile kernel included): built only where the CPU has
them, taken only for x that fits their domain (``x_fits_bf16``), on by default on AMD only, and the same
bits as the FMA kernels for FP8, dense bf16 and NVFP4 heads, whole and in K-chunks.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator

import pytest
import torch

from tests.kernels.fused_reference import (
    BATCHES_1_9,
    F8,
    FINITE_FP8,
    every_nibble_rows,
    isa_runs_here,
    vector_paths,
)
from trtvocab import kernels
from trtvocab.kernels import compile as kcompile
from trtvocab.kernels import gemm, library
from trtvocab.quant import nvfp4


# ---- built, chosen and turned on where they belong -----------------------------------------------------------
def _has_dpbf16_kernels(lib: ctypes.CDLL) -> bool:
    """Whether this build compiled the vdpbf16ps kernels (its x check answers -1 where it has none)."""
    return lib.trtvocab_fused_x_fits_bf16(None, *[ctypes.c_int64(0)] * 3) != -1


def test_dpbf16_kernels_are_built_where_the_cpu_has_them():
    """The native build compiles them on a CPU with avx512_bf16 and avx512vbmi, the forced avx512
    (x86-64-v4) and avx2 builds never do; a build runs them only where it has them (and only where
    vdpbf16ps passed the library's check against two FMAs on this CPU: measured so on Zen 5, so a
    CPU that fails it runs the FMA kernels, which this test accepts)."""
    flags = kcompile.cpu_flags()
    for isa in ("native", "avx512", "avx2"):
        if isa_runs_here(isa) is not None:
            continue
        try:
            loaded = library.load_isa(isa)
        except Exception as exc:
            pytest.skip(f"{isa} build unavailable: {exc}")
        built = _has_dpbf16_kernels(loaded.lib)
        want = isa == "native" and loaded.isa == "avx512" and {"avx512_bf16", "avx512vbmi"} <= flags
        assert built == want, isa
        assert loaded.lib.trtvocab_fused_dpbf16() in ((0, 1) if built else (0,)), isa


def _x_cases(b: int, width: int, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """x [b, width] that qualifies for the vdpbf16ps kernels (bf16 values, 2**-100 <= |x| <= 2**100, signed
    zeros), and x that does not: one value not exact in bf16, one tiny, one huge, inf, NaN (at the last row)."""
    x = torch.randn(b, width, generator=gen).bfloat16().float()
    x[:, ::7] = 0.0
    x[:, 3::11] = -0.0
    edge = x.clone()
    edge[0, :4] = torch.tensor([2.0**-100, -(2.0**100), 2.0**-100 * 1.5, 2.0**99 * 1.9921875])
    small = torch.where(x == 0, x, x.sign() * x.abs().clamp(min=2.0**-8)) * 2.0**-92  # |x| >= 2**-100
    cases = [("fits", x), ("edge", edge), ("big", x * 2.0**95), ("small", small)]
    for name, value in (("non-bf16", 1.0 + 2.0**-12), ("tiny", 2.0**-101), ("huge", 2.0**101),
                        ("inf", math.inf), ("nan", math.nan)):
        y = x.clone()
        y[-1, width // 2] = value
        cases.append((name, y))
    return cases


def test_dpbf16_x_check_takes_exactly_the_x_that_fits():
    """x_fits_bf16 (the per-call choice of the vdpbf16ps kernels) accepts the qualifying cases, whatever
    the batch and width (a vector body and a scalar tail), and refuses every other one."""
    if isa_runs_here("native") is not None:
        pytest.skip(isa_runs_here("native"))
    try:
        lib = library.load_isa("native").lib
    except Exception as exc:
        pytest.skip(f"native build unavailable: {exc}")
    if not _has_dpbf16_kernels(lib):
        pytest.skip("no vdpbf16ps kernels in this build")
    gen = torch.Generator().manual_seed(3)
    for b, width in ((1, 8), (3, 40), (9, 1029)):
        for name, x in _x_cases(b, width, gen):
            x = x.contiguous()
            fits = lib.trtvocab_fused_x_fits_bf16(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(b),
                                                  ctypes.c_int64(x.stride(0)), ctypes.c_int64(width))
            assert fits == int(name in ("fits", "edge", "big", "small")), (name, b, width)


def test_dpbf16_kernels_run_by_default_on_amd_only():
    """Where the native build has the vdpbf16ps kernels and they match the FMAs, they run by default on AMD
    CPUs only (a Xeon measured vdpbf16ps at a quarter of its 512-bit FMA rate: the FMA kernels are faster), and
    trtvocab_fused_set_dpbf16 turns them on (1) and off (0) on any such CPU."""
    if isa_runs_here("native") is not None:
        pytest.skip(isa_runs_here("native"))
    lib = library.load_isa("native").lib
    if not _has_dpbf16_kernels(lib):
        assert [lib.trtvocab_fused_set_dpbf16(m) for m in (1, 0, -1)] == [0, 0, 0]
        pytest.skip("no vdpbf16ps kernels in this build")
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        amd = any(line.split(":", 1)[1].strip() == "AuthenticAMD" for line in f if line.startswith("vendor_id"))
    try:
        matches = lib.trtvocab_fused_set_dpbf16(1)
        assert lib.trtvocab_fused_set_dpbf16(0) == 0
        assert lib.trtvocab_fused_set_dpbf16(-1) == int(amd and matches == 1)
    finally:
        lib.trtvocab_fused_set_dpbf16(-1)


# ---- the FMA chain's bits, on every x and batch --------------------------------------------------------------
@pytest.fixture
def dpbf16_paths() -> Iterator[list[kernels.Loaded]]:
    """The vector builds, the native one first, its vdpbf16ps kernels turned on whatever this CPU's default
    (off on Intel: slower there, the same bits), and back to the default afterwards."""
    paths = vector_paths()
    if isa_runs_here("native") is None:
        paths = [library.load_isa("native"), *paths]
    if not any(p.lib.trtvocab_fused_set_dpbf16(1) for p in paths):
        pytest.skip("no build here runs the vdpbf16ps kernels (a CPU without avx512_bf16 / avx512vbmi)")
    try:
        yield paths
    finally:
        for p in paths:
            p.lib.trtvocab_fused_set_dpbf16(-1)


def _same_bits_or_nan(paths: list[kernels.Loaded], call, *args) -> None:
    """Every path gives the same bits (NaN logits: NaN on every path, any payload)."""
    first = call(paths[0], *args)
    for other in paths[1:]:
        got = call(other, *args)
        nan = torch.isnan(first)
        assert torch.equal(torch.isnan(got), nan), f"{other.isa}: NaN logits differ"
        assert torch.equal(got[~nan].view(torch.int32), first[~nan].view(torch.int32)), f"{other.isa} differs"


@pytest.mark.parametrize("hidden", [13, 24, 520, 1029])
def test_dpbf16_fp8_bitwise_every_x_and_batch(hidden, dpbf16_paths):
    """FP8 heads (every code, adversarial scales, a shard starting mid-pair, odd step counts) on the
    vdpbf16ps kernels and the FMA kernels: the same bits, for x that qualifies and x that does not."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 1)
    v = FINITE_FP8.numel() + 3
    codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
    codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
    scales = [torch.tensor(2e-3), torch.rand(v, generator=gen) * 1e-2 + 1e-4, torch.tensor(2.0**60)]
    for b in BATCHES_1_9:
        for _, x in _x_cases(b, hidden, gen):
            x8 = kernels.fp8_x(x)
            for scale in scales:
                for lo, hi in ((0, v), (3, v - 2)):
                    rows_scale = scale if scale.numel() == 1 else scale[lo:hi]
                    _same_bits_or_nan(paths, gemm.fp8_logits, x8, hidden, codes[lo:hi], rows_scale)


def _bf16_rows_at_the_domain_edges(v: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 weights [v, hidden]: random rows, and rows whose logit shows whether a weight outside the vdpbf16ps
    domain was read as the FMAs read it: a lone subnormal, a lone tiny normal, rows of 2**-30 (products
    below 2**-124 against tiny x), a lone huge weight (products past 2**102 against big x), a zero row."""
    w = torch.randn(v, hidden, generator=gen) * 0.05
    w[1] = 0.0
    w[1, hidden // 2] = 1e-40  # subnormal in bf16: vdpbf16ps reads it as zero
    w[2] = 0.0
    w[2, -1] = -(2.0**-126)
    w[3] = 2.0**-30 * torch.where(torch.rand(hidden, generator=gen) < 0.5, -1.0, 1.0)
    w[4] = 0.0
    w[4, 0] = 2.0**120
    w[5] = 0.0
    w[6, :: 5] = 0.0
    return w.bfloat16()


@pytest.mark.parametrize("hidden", [13, 24, 520, 1029])
def test_dpbf16_dense_bf16_bitwise_every_x_and_batch(hidden, dpbf16_paths):
    """Dense bf16 heads at batch 1..9 on the vdpbf16ps kernels (batch <= 8; each pass checks the weights it read
    against the domain this x allows, and reruns on FMAs where one is outside) and the FMA kernels: the same
    bits, for x that qualifies, x that does not, tiny x against tiny weights and big x against a huge weight,
    whole and from a row mid-pair."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 5)
    v = 23
    w = _bf16_rows_at_the_domain_edges(v, hidden, gen)
    for b in BATCHES_1_9:
        cases = _x_cases(b, hidden, gen)
        x = cases[0][1]
        cases.append(("tiny", x.sign() * 2.0**-99))
        big = x * 2.0**20
        big[:, 0] = 2.0**-10
        cases.append(("big vs huge", big))
        for _, xc in cases:
            x8 = kernels.fp8_x(xc)
            _same_bits_or_nan(paths, gemm.dense_logits, x8, hidden, w)
            _same_bits_or_nan(paths, gemm.dense_logits, x8, hidden, w[3:])


def test_dpbf16_pairs_kernels_chunked_passes(dpbf16_paths):
    """Where x's bf16 pairs outgrow a quarter of L2 (256 KiB: B = 8 past H = 16384 for dense bf16, 8192 for FP8,
    whose pairs are laid out twice) the FP8 / dense bf16 vdpbf16ps kernels read K-chunks of 64 steps for a
    tile's rows (an odd last chunk included): the same bits as the FMA kernels."""
    paths = dpbf16_paths
    hidden = 16404  # 2051 steps: the last chunk is a full pair and a partial step
    gen = torch.Generator().manual_seed(6)
    w = _bf16_rows_at_the_domain_edges(9, hidden, gen)
    codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (9, hidden), generator=gen)]
    for b in (7, 8):
        for name, x in _x_cases(b, hidden, gen):
            if name in ("fits", "edge", "nan"):
                x8 = kernels.fp8_x(x)
                _same_bits_or_nan(paths, gemm.dense_logits, x8, hidden, w)
                _same_bits_or_nan(paths, gemm.fp8_logits, x8, hidden, codes, torch.tensor(2e-3))


def _block_major_rows(hidden: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``every_nibble_rows`` in block-major order, with random e4m3 block scales 0x01..0x7E."""
    v, _, packed = every_nibble_rows(hidden, gen)
    bs = torch.randint(0x01, 0x7F, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8)
    return nvfp4.to_block_major(packed), bs


@pytest.mark.parametrize("hidden", [16, 256, 528, 1040])
def test_dpbf16_nvfp4_bitwise_every_x_and_batch(hidden, dpbf16_paths):
    """NVFP4 heads (every nibble, the smallest and largest block scales, a partial group, a shard) on the
    vdpbf16ps kernels and the FMA kernels: the same bits, for x that qualifies and x that does not."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 2)
    v, _, packed = every_nibble_rows(hidden, gen)
    packed = nvfp4.to_block_major(packed)
    for scale_codes, global_scale in (((0x01, 0x7F), 1e-3), ((0x7E, 0x7F), 6.0 * 448), ((0x01, 0x08), 1.0)):
        bs = torch.randint(*scale_codes, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8)
        for b in BATCHES_1_9:
            for _, x in _x_cases(b, hidden, gen):
                xn = kernels.nvfp4_x(x)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed, bs, global_scale)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed[5:], bs[5:], global_scale)


@pytest.mark.parametrize("hidden", [2816, 4240, 5120])
def test_dpbf16_nvfp4_chunked_passes(hidden, dpbf16_paths):
    """The vdpbf16ps row-pair kernel (B = 5..8, and 3-4 where x's pairs outgrow L1) runs K-chunks of as many lane
    groups as keep x's pairs (two copies, N * 512 bytes a group) in L1 less 16 KiB, for a tile's rows: on a 48 KiB
    L1D 8 groups at B = 8, 12 at B = 5 (4 and 6 on 32 KiB). The same bits as the FMA kernels. 2816 (22 groups): a
    short last chunk; 4240 (33 and a partial group): a last chunk of one group at B = 8, of an odd number (the
    single-group tail) at B = 5; 5120: the head's H."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 3)
    packed, bs = _block_major_rows(hidden, gen)
    for b in (5, 8):
        for name, x in _x_cases(b, hidden, gen):
            if name in ("fits", "edge", "nan"):
                xn = kernels.nvfp4_x(x)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed, bs, 1e-3)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed[3:], bs[3:], 1e-3)


@pytest.mark.parametrize("hidden", [6400, 12816])
def test_dpbf16_nvfp4_block_lanes_chunked_passes(hidden, dpbf16_paths):
    """Batch 2 runs the block-lanes vdpbf16ps kernel, which reads x's pairs whole while they fit in L1 (its size
    less 8 KiB) and in K-chunks of pairs for a tile's rows beyond: 6400 (25 pairs) is chunked at B = 2 on a 32 KiB
    L1D, 12816 (50 pairs and a partial group) on 48 KiB, with a short last chunk run one pair at a time. Batch 1
    runs row runs (three chunks of a row at 12816). Batches 3 and 4 run it only while x's pairs fit whole (B = 3 at
    6400 on a 48 KiB L1D: 37.5 KiB) and the row pairs otherwise (B = 4 here, B = 3 at 12816 and on 32 KiB). The
    same bits as the FMA kernels."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 4)
    packed, bs = _block_major_rows(hidden, gen)
    for b in (1, 2, 3, 4):
        for name, x in _x_cases(b, hidden, gen):
            if name in ("fits", "edge", "nan"):
                xn = kernels.nvfp4_x(x)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed, bs, 1e-3)
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed[3:], bs[3:], 1e-3)


@pytest.mark.parametrize("hidden", [4240, 5376, 6400])
def test_dpbf16_nvfp4_row_runs_pending_chunks(hidden, dpbf16_paths):
    """Batch 1 runs the row-runs vdpbf16ps kernel: each row in chunks of at most 20 block pairs (5376: 21 pairs,
    chunks of 11 and 10; 6400: 25, chunks of 13 and 12; 4240: one chunk of 16, then a full and a partial group
    in the 8-lane tail), each chunk's block sums scaled and added while the next chunk runs, the last one of a
    thread's rows at the end. Shards of 1, 2, 3 and 40 rows (40: two ranges of 20 rows where torch has two
    threads): the same bits as the FMA kernels."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 5)
    packed, bs = _block_major_rows(hidden, gen)
    for name, x in _x_cases(1, hidden, gen):
        if name in ("fits", "edge"):
            xn = kernels.nvfp4_x(x)
            for start, rows in ((0, 1), (7, 2), (100, 3), (3, 40)):
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed[start : start + rows],
                                  bs[start : start + rows], 1e-3)


# ---- batch >= 9: the vdpbf16ps tile kernel -------------------------------------------------------------------
@pytest.mark.parametrize("hidden", [13, 24, 1029, 528, 5120])
def test_dpbf16_tiled_batches_bitwise(hidden, dpbf16_paths):
    """Batches >= 9 on the vdpbf16ps tile kernel (tile and x packed into bf16 step pairs) and on the FMA tile
    kernels: the same bits, for x that qualifies and x that does not, every FP8 code under adversarial
    scales at an odd step count (13: 2 steps, 24: 3, 1029: 129: the last step paired with a zero step) and
    NVFP4 (528: a partial lane group; 5120: the head's H) with the smallest and largest block scales."""
    paths = dpbf16_paths
    gen = torch.Generator().manual_seed(hidden + 5)
    if hidden % 16:
        v = FINITE_FP8.numel() + 5
        codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
        codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
        scales = [torch.rand(v, generator=gen)[3:] * 1e-2 + 1e-4, torch.tensor(2.0**60)]
        for b in (9, 17, 64):
            for _, x in _x_cases(b, hidden, gen):
                for scale in scales:
                    _same_bits_or_nan(paths, gemm.fp8_logits, kernels.fp8_x(x), hidden, codes[3:], scale)
        return
    v, _, packed = every_nibble_rows(hidden, gen)
    packed = nvfp4.to_block_major(packed)
    block_scales = [(torch.randint(*codes, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8), g)
                    for codes, g in (((0x01, 0x7F), 1e-3), ((0x7E, 0x7F), 6.0 * 448))]
    for b in (9, 17, 64):
        for _, x in _x_cases(b, hidden, gen):
            xn = kernels.nvfp4_x(x)
            for bs, global_scale in block_scales:
                _same_bits_or_nan(paths, gemm.nvfp4_logits, xn, hidden, packed[5:], bs[5:], global_scale)
