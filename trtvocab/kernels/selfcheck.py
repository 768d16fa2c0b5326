"""The load-time self-check of a build of the kernels: every FP8 code and every FP4 nibble under
every block scale, decoded by the kernel and compared bit for bit with torch's decode; the GGUF
block kernels' chain against the torch chain."""

from __future__ import annotations

import torch

from trtvocab.kernels import gemm
from trtvocab.kernels.compile import Loaded
from trtvocab.quant import gguf_blocks, nvfp4


def self_check(loaded: Loaded) -> str | None:
    """Decode every FP8 code and every FP4 nibble under every block scale through the kernel
    (batch 1 and batch 2, full lane groups and a partial one) and compare bit for bit with
    torch's decode. None: all equal."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    for hidden in (8, 13):  # one full step; a zero-padded tail step
        w = torch.zeros(codes.numel(), hidden, dtype=torch.uint8)
        w[torch.arange(codes.numel()), torch.arange(codes.numel()) % hidden] = codes
        want = codes.view(torch.float8_e4m3fn).float() * 0.75
        for n in (1, 2):
            got = gemm.fp8_logits(loaded, gemm.fp8_x(torch.ones(n, hidden)), hidden, w, torch.tensor(0.75))
            if not torch.equal(got, want.expand(n, -1)):
                return f"FP8 decode (H={hidden}, batch {n})"
    scale_codes = torch.arange(1, 0x7F, dtype=torch.uint8)  # every finite positive e4m3 scale
    nib = torch.arange(16, dtype=torch.uint8).repeat_interleave(scale_codes.numel())
    scl = scale_codes.repeat(16)
    for hidden in (128, 16):  # one full group of 8 blocks; a partial group
        rows = nib.numel()
        codes_el = torch.zeros(rows, hidden, dtype=torch.uint8)
        col = torch.arange(rows) % hidden
        codes_el[torch.arange(rows), col] = nib
        packed = codes_el[:, 0::2] | (codes_el[:, 1::2] << 4)
        bs = scl.reshape(-1, 1).expand(rows, hidden // 16).contiguous().view(torch.float8_e4m3fn)
        want = nvfp4.dequantize_nvfp4(packed, bs, torch.tensor(0.375)).sum(1) + 0.0
        for n in (1, 2):
            x = gemm.nvfp4_x(torch.ones(n, hidden))
            got = gemm.nvfp4_logits(loaded, x, hidden, nvfp4.to_block_major(packed), bs, 0.375)
            if not torch.equal(got, want.expand(n, -1)):
                return f"NVFP4 decode (H={hidden}, batch {n})"
    return _gguf_check(loaded)


def _gguf_check(loaded: Loaded) -> str | None:
    """Every Q8_0 code under scales of every fp16 binade, every Q6_K 6-bit code under signed sub-scales, and
    random Q4_0 / Q4_1 / Q5_0 / Q4_K blocks, through the GGUF kernel (batch 1 and 3), against the torch chain
    bit for bit."""
    q = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(torch.uint8).reshape(8, 32)
    d = (2.0 ** torch.arange(-24, 16, 1.0)).to(torch.float16).view(torch.uint8).reshape(-1, 1, 2)
    q8 = torch.cat([d.expand(-1, 8, 2), q.expand(d.shape[0], 8, 32)], 2).reshape(-1, 34)  # one block a row
    g = torch.Generator().manual_seed(0)
    q6 = torch.randint(0, 256, (16, 210), dtype=torch.uint8, generator=g)
    q6[:, 208:210] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    checks = [("Q8_0", q8), ("Q6_K", q6)]
    for block_type, scales_at in (("Q4_0", (0,)), ("Q4_1", (0, 2)), ("Q5_0", (0,)), ("Q4_K", (0, 2))):
        values, size = gguf_blocks.BLOCKS[block_type]
        raw = torch.randint(0, 256, (16, 256 // values, size), dtype=torch.uint8, generator=g)
        for at in scales_at:  # every code under finite scales of both signs
            raw[..., at : at + 2] = (torch.randn(16, 256 // values, generator=g) * 0.01).to(torch.float16).view(
                torch.uint8).reshape(16, -1, 2)
        checks.append((block_type, raw.reshape(16, -1)))
    for block_type, raw in checks:
        hidden = raw.shape[1] // gguf_blocks.BLOCKS[block_type][1] * gguf_blocks.BLOCKS[block_type][0]
        for n in (1, 3):
            x = torch.randn(n, hidden, generator=g)
            want = gguf_blocks.chain_logits(x, gguf_blocks.DEQUANTIZE[block_type](raw))
            got = gemm.gguf_logits(loaded, x, hidden, block_type, raw)
            if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                return f"GGUF {block_type} chain (batch {n})"
    return None

