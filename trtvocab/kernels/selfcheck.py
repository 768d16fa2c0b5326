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


def _gguf_blocks(block: gguf_blocks.BlockType, g: torch.Generator) -> torch.Tensor:
    """Rows of 256 values (one K-quant block, eight 32-value ones) of ``block``'s type: 40 rows whose code bytes
    run through 0, 1, 2, ... (a Q8_0 row: every code once) under scales of every fp16 binade (2**-24 ..
    2**15, every scale field of the block), then 16 rows of random codes under random finite scales of both
    signs."""
    nblocks = 256 // block.values
    at = [a for _, a in block.scales]
    scale_bytes = torch.zeros(block.bytes, dtype=torch.bool)
    for a in at:
        scale_bytes[a : a + 2] = True
    sweep = torch.zeros(40, nblocks, block.bytes, dtype=torch.uint8)
    code_count = nblocks * int((~scale_bytes).sum())
    sweep[:, :, ~scale_bytes] = (torch.arange(code_count) % 256).to(torch.uint8).reshape(nblocks, -1)
    binades = (2.0 ** torch.arange(-24, 16, 1.0)).to(torch.float16).view(torch.uint8).reshape(40, 1, 2)
    rand = torch.randint(0, 256, (16, nblocks, block.bytes), dtype=torch.uint8, generator=g)
    for a in at:
        sweep[..., a : a + 2] = binades
        rand[..., a : a + 2] = (torch.randn(16, nblocks, generator=g) * 0.01).to(torch.float16).view(
            torch.uint8).reshape(16, nblocks, 2)
    return torch.cat([sweep, rand]).reshape(56, -1)


def _gguf_check(loaded: Loaded) -> str | None:
    """Every block type of the table (:func:`_gguf_blocks`) through the GGUF kernel (batch 1 and 3), against the
    torch chain bit for bit."""
    g = torch.Generator().manual_seed(0)
    for block in gguf_blocks.BLOCK_TYPES.values():
        raw = _gguf_blocks(block, g)
        for n in (1, 3):
            x = torch.randn(n, 256, generator=g)
            want = gguf_blocks.chain_logits(x, block.dequantize(raw))
            got = gemm.gguf_logits(loaded, x, 256, block.name, raw)
            if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                return f"GGUF {block.name} chain (batch {n})"
    return None
