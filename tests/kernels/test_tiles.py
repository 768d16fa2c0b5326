"""Batch >= 9: the AVX-512 tile kernel, against batch 1 (another kernel) on every path and against the AVX2
tile kernel, for FP8, dense and NVFP4 heads.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.fused_reference import (
    DENSE_DTYPES,
    F8,
    FINITE_FP8,
    every_nibble_rows,
    same_on_every_path,
    vector_paths,
)
from trtvocab import kernels
from trtvocab.kernels import gemm
from trtvocab.quant import nvfp4

# The batches are the remainders of its register blocks: 8 x rows per block (4 row pairs, the last block's odd row
# paired with zeros), 6 weight rows per micro kernel, 24 per tile, 128 x rows per pass. The row ranges start
# mid-micro-kernel and mid-tile and end short of the last tile.
BATCHES_TILED = (9, 10, 17, 33, 64, 65, 130)
TILED_RANGES = ((0, None), (5, None), (7, -3), (25, -1))


def _alone(call, x: torch.Tensor, *args) -> torch.Tensor:
    """``call`` (a :mod:`trtvocab.kernels` call) on each row of ``x`` alone: batch 1, another kernel."""
    return torch.cat([call(x[i : i + 1], *args) for i in range(x.shape[0])])


def _tiled_x(b: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """bf16-valued float32 rows: normal, huge (1e4), tiny (1e-4) and one zero row (its logits must be +0)."""
    x = torch.randn(b, hidden, generator=gen)
    x[1::3] *= 1e4
    x[2::5] *= 1e-4
    x[3] = 0.0
    return x.bfloat16().float()


def _check_tiled(call, x: torch.Tensor, w: torch.Tensor, *args) -> None:
    """Every tiled batch and row range equals the rows computed alone (batch invariance); a zero x row
    gives +0 logits."""
    for lo, hi in TILED_RANGES:
        rows = w[lo:hi]
        extra = [a[lo:hi] if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == w.shape[0] else a
                 for a in args]
        want = _alone(call, x, rows, *extra)
        for b in BATCHES_TILED:
            got = call(x[:b], rows, *extra)
            assert torch.equal(got.view(torch.int32), want[:b].view(torch.int32)), f"B={b} rows [{lo}, {hi})"
        assert torch.equal(want[3].view(torch.int32), torch.zeros_like(want[3]).view(torch.int32))


@pytest.mark.parametrize("hidden", [13, 1029])
def test_fp8_and_dense_tiled_batches_equal_batch_1(isa, hidden):
    gen = torch.Generator().manual_seed(hidden)
    v = FINITE_FP8.numel() + 5
    codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
    codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
    x = kernels.fp8_x(_tiled_x(max(BATCHES_TILED), hidden, gen))
    for scale in (torch.rand(v, generator=gen) * 1e-2 + 1e-4, torch.tensor(2.0**60), torch.tensor(2.0**-60)):
        _check_tiled(lambda xx, w, s: kernels.fp8_logits(xx, hidden, w, s), x, codes, scale)
    for dtype in DENSE_DTYPES:
        w = (torch.randn(v, hidden, generator=gen) * 0.05).to(dtype)
        _check_tiled(lambda xx, ww: kernels.dense_logits(xx, hidden, ww), x, w)
    # one-hot rows read every code back exactly at a tiled batch
    b = 17
    eye = torch.zeros(b, hidden)
    cols = torch.arange(b) % hidden
    eye[torch.arange(b), cols] = 1.0
    got = kernels.fp8_logits(kernels.fp8_x(eye), hidden, codes, torch.tensor(0.75))
    assert torch.equal(got, codes.view(F8).float()[:, cols].t() * 0.75)


@pytest.mark.parametrize("hidden", [16, 144, 528, 1040])
def test_nvfp4_tiled_batches_equal_batch_1(isa, hidden):
    """A partial lane group (16, 144, 528) and an odd count of full groups (1040: 8 full + 1 partial)."""
    gen = torch.Generator().manual_seed(hidden)
    v, codes, packed = every_nibble_rows(hidden, gen)
    packed = nvfp4.to_block_major(packed)
    x = kernels.nvfp4_x(_tiled_x(max(BATCHES_TILED), hidden, gen))
    for scale_codes, global_scale in (((0x01, 0x7F), 1e-3), ((0x7E, 0x7F), 6.0 * 448), ((0x01, 0x08), 1.0)):
        bs = torch.randint(*scale_codes, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8)
        _check_tiled(lambda xx, p, s, g: kernels.nvfp4_logits(xx, hidden, p, s, g), x, packed, bs, global_scale)
    # one-hot rows: every nibble under every block scale read back exactly at a tiled batch
    bs = (torch.arange(v * (hidden // 16)) % 0x7E + 1).to(torch.uint8).reshape(v, hidden // 16).view(F8)
    b = 33
    cols = (torch.arange(b) * 37) % hidden
    eye = torch.zeros(b, hidden)
    eye[torch.arange(b), cols] = 1.0
    got = kernels.nvfp4_logits(kernels.nvfp4_x(eye), hidden, packed, bs, 0.375)
    want = nvfp4.dequantize_nvfp4(codes[:, 0::2] | (codes[:, 1::2] << 4), bs, torch.tensor(0.375))
    assert torch.equal(got, want[:, cols].t() + 0.0)


def test_tiled_batches_bitwise_across_paths():
    paths = vector_paths()
    gen = torch.Generator().manual_seed(21)
    for hidden in (13, 520, 1029):
        v = FINITE_FP8.numel() + 5
        codes = FINITE_FP8[torch.randint(0, FINITE_FP8.numel(), (v, hidden), generator=gen)]
        codes[torch.arange(FINITE_FP8.numel()), torch.arange(FINITE_FP8.numel()) % hidden] = FINITE_FP8
        scale = torch.rand(v, generator=gen) * 1e-2 + 1e-4
        dense = [(torch.randn(v, hidden, generator=gen) * 0.05).to(dt) for dt in DENSE_DTYPES]
        x = kernels.fp8_x(_tiled_x(max(BATCHES_TILED), hidden, gen))
        for b in BATCHES_TILED:
            for lo, hi in TILED_RANGES:
                same_on_every_path(paths, gemm.fp8_logits, x[:b], hidden, codes[lo:hi], scale[lo:hi])
                for w in dense:
                    same_on_every_path(paths, gemm.dense_logits, x[:b], hidden, w[lo:hi])
    for hidden in (16, 528, 1040, 5120):
        v = 16 * 16 + 5
        packed = nvfp4.to_block_major(torch.randint(0, 256, (v, hidden // 2), dtype=torch.uint8, generator=gen))
        bs = torch.randint(0x01, 0x7F, (v, hidden // 16), dtype=torch.uint8, generator=gen).view(F8)
        x = kernels.nvfp4_x(_tiled_x(max(BATCHES_TILED), hidden, gen) * 100)
        for b in BATCHES_TILED:
            for lo, hi in TILED_RANGES:
                same_on_every_path(paths, gemm.nvfp4_logits, x[:b], hidden, packed[lo:hi], bs[lo:hi], 1e-3)
