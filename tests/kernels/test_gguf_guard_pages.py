"""The GGUF block kernels never read outside their operands: the hostile-input round 4 guard-page probes,
re-run on every build (ISA) of the kernels this CPU runs (each build runs its top tier; TRTVOCAB_KERNELS_ISA
forces a lower one).

Each probe places the rows of blocks, ``x`` or both so that they end exactly at a ``PROT_NONE`` page (and,
once more, so that they start right after one): a read one byte past an operand is a SIGSEGV. The probes
run in a child interpreter, so a fault fails the test instead of killing the run; every logit must equal
the torch chain (:func:`trtvocab.quant.gguf_blocks.chain_logits`) bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trtvocab.kernels import compile as kcompile
from trtvocab.kernels import library

pytestmark = pytest.mark.subprocess
ROOT = Path(__file__).resolve().parents[2]

PROBES = r'''
import ctypes, mmap, sys
import torch
from trtvocab.kernels import gemm, library
from trtvocab.quant import gguf_blocks as gb

isa = sys.argv[1]
loaded = library.load_isa(isa)
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
PAGE = mmap.PAGESIZE
keep = []


def guarded(nbytes, at_end):
    """A uint8 tensor of ``nbytes`` that ends exactly at (at_end) or starts right after a PROT_NONE page."""
    pages = (nbytes + PAGE - 1) // PAGE + 2
    m = mmap.mmap(-1, pages * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    guard = (pages - 1) * PAGE if at_end else 0
    assert libc.mprotect(base + guard, PAGE, 0) == 0, ctypes.get_errno()
    start = guard - nbytes if at_end else PAGE
    keep.append(m)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start)


def placed(t, at_end):
    raw = guarded(t.numel() * t.element_size(), at_end)
    raw.copy_(t.contiguous().view(-1).view(torch.uint8))
    return raw.view(t.dtype).reshape(t.shape)


g = torch.Generator().manual_seed(0)
probes = 0
for block_type, (values, size) in gb.BLOCKS.items():
    for rows in (1, 3, 33, 65):
        for nblocks in (1, 2, 3):
            hidden = values * nblocks
            raw = torch.randint(0, 256, (rows, nblocks, size), dtype=torch.uint8, generator=g)
            for _, at in gb.SCALES[block_type]:
                d = (torch.randn(rows, nblocks, generator=g) * 0.01).to(torch.float16)
                raw[..., at : at + 2] = d.view(torch.uint8).reshape(rows, nblocks, 2)
            raw = raw.reshape(rows, -1)
            w = gb.DEQUANTIZE[block_type](raw)
            for n in (1, 8, 9, 17):
                x = torch.randn(n, hidden, generator=g)
                want = gb.chain_logits(x, w).view(torch.int32)
                # the blocks, x, or both end at a guard page; both start right after one
                for at_end, which in ((True, "blocks"), (True, "x"), (True, "both"), (False, "both")):
                    b = placed(raw, at_end) if which != "x" else raw
                    xx = placed(x, at_end) if which != "blocks" else x
                    got = gemm.gguf_logits(loaded, xx, hidden, block_type, b)
                    assert torch.equal(got.view(torch.int32), want), (isa, block_type, rows, n, which)
                    probes += 1
                    keep.clear()
print(f"{probes} probes on {isa} ({loaded.isa})")
'''


@pytest.mark.parametrize("isa", list(kcompile.ISAS))
def test_gguf_kernels_read_nothing_past_their_operands(isa: str, fresh_python: Any) -> None:
    if kcompile.disabled_reason() is not None:
        pytest.skip(kcompile.disabled_reason())
    missing = kcompile.ISA_CPU_FLAGS.get(isa, set()) - kcompile.cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    try:
        library.load_isa(isa)  # built (or found in the cache) here: the child only loads it
    except Exception as exc:
        pytest.skip(f"{isa} build unavailable: {exc}")
    out = fresh_python(PROBES, isa, timeout=300, cwd=str(ROOT))
    assert " probes on " in out.stdout, out.stdout + out.stderr
