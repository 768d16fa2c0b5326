"""The load-time self-check of a build of the kernels: every FP8 code and every FP4 nibble under
every block scale, decoded by the kernel and compared bit for bit with torch's decode."""

from __future__ import annotations

import torch

from trtvocab.kernels import gemm
from trtvocab.kernels.build import Loaded
from trtvocab.quant import nvfp4


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
    return None

