"""The fused kernels of a git revision against the working tree's, interleaved in one process.

    python benchmarks/kernel_ab.py                        # HEAD against the working tree, FP8 and NVFP4
    python benchmarks/kernel_ab.py --base 4372e13 --batches 1,3,4,8 --rounds 11
    python benchmarks/kernel_ab.py --formats nvfp4 --vocab 20000 --threads 1
    python benchmarks/kernel_ab.py --base b82d925 --formats fp8,nvfp4,bf16 --batches 1,4,9 --dpbf16 off,on
    TRTVOCAB_KERNELS_ISA=avx2 python benchmarks/kernel_ab.py --base b82d925   # the AVX2 builds of both
    python benchmarks/kernel_ab.py --base 4723066 --formats f32 --vocab 1536 --hidden 576 --threads 1 --clock cpu
    python benchmarks/kernel_ab.py --formats q6_k,q4_k,q8_0 --vocab 65536 --hidden 768 --threads 1 --clock cpu

For a kernel change, the only comparison this kind of machine allows: a VM's memory bandwidth
and clock move by 1.5x between hours (the probe of ``benchmarks/bandwidth.py`` read 50 and 78 GB/s
on one Zen 5 in one session), so timings taken in separate runs compare the hours, not the kernels.
The base revision's whole ``trtvocab/kernels/csrc`` tree (its translation units and the headers they
include, read with ``git archive``) is built with the same flags as the working tree's
(``$TRTVOCAB_KERNELS_ISA`` picks them for both) into its own folder (``--cache``, else a temporary
one), both libraries are loaded, and each round calls every batch on both, one after the other, on
the same random valid codes (weight values do not change the work). ``--dpbf16`` runs the table once
per vdpbf16ps mode (``trtvocab_fused_set_dpbf16``, set in both libraries), so an AVX-512 BF16 machine
compares its FMA kernels too. Printed per batch: best and median ms of each, new / base (best), the new
library's time over its own batch 1 (the decode goals), and whether both libraries
give the same bits (compared as int32 words); the exit status is 1 where any batch differs. The GGUF block
types (q8_0, q6_k, q4_0, q4_1, q5_0, q4_k: random blocks, fp16 scales 0.01) run the GGUF kernel; with one
thread, ``--clock cpu`` times the calling thread's CPU time (``time.thread_time``), which a shared machine's
neighbours disturb less than the wall clock.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import add_json, add_row, interleaved, recording
from common import random_tensors

from trtvocab import QuantAlgo
from trtvocab.kernels import compile as kcompile
from trtvocab.kernels import gemm, library
from trtvocab.quant import gguf_blocks, nvfp4

ROOT = Path(__file__).resolve().parent.parent
CSRC = "trtvocab/kernels/csrc"
DPBF16_MODES = {"default": -1, "off": 0, "on": 1}  # trtvocab_fused_set_dpbf16
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
DENSE = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}  # dense rows (trtvocab_dense_logits)


def build_revision(rev: str, folder: Path) -> kcompile.Loaded:
    """The kernel library of ``rev``'s ``csrc/`` tree (every file: the headers its sources include
    too), built with this tree's flags (``kcompile.cflags()``) in ``folder``."""
    from torch.utils import cpp_extension

    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, CSRC],
                             check=True, capture_output=True).stdout
    src = folder / "src"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not (member.isfile() or member.isdir()) or ".." in Path(member.name).parts:
                raise RuntimeError(f"{rev}:{member.name}: not a plain file of {CSRC}")
        tar.extractall(src)
    units = sorted((src / CSRC).glob("*.cpp"))  # fused.cpp, treesum.cpp, and gguf.cpp where it exists
    path = cpp_extension.load(name="trtvocab_ab_base", sources=[str(u) for u in units],
                              extra_cflags=kcompile.cflags(), extra_ldflags=["-fopenmp"],
                              build_directory=str(folder), is_python_module=False)
    return kcompile.bind(Path(path), older=True)  # a base of an older ABI binds the symbols it has


Call = Callable[[kcompile.Loaded], torch.Tensor]


def calls(fmt: str, batch: int, vocab: int, hidden: int, gen: torch.Generator) -> Call:
    """One decode call of ``fmt`` (fp8, nvfp4, bf16 / f16 / f32: dense rows; a GGUF block type)
    at ``batch`` rows on random valid codes (quantized_head's; GGUF: random blocks, fp16 scales 0.01), for
    a given library."""
    x = torch.randn(batch, hidden, generator=gen).bfloat16().float()
    if fmt.upper() in gguf_blocks.BLOCKS:
        block_type = fmt.upper()
        block, size = gguf_blocks.BLOCKS[block_type]
        raw = torch.randint(0, 256, (vocab, hidden // block, size), dtype=torch.uint8, generator=gen)
        for _, at in gguf_blocks.BLOCK_TYPES[block_type].scales:
            raw[..., at : at + 2] = torch.tensor([1e-2], dtype=torch.float16).view(torch.uint8)
        raw = raw.reshape(vocab, -1).contiguous()
        return lambda lib: gemm.gguf_logits(lib, x, hidden, block_type, raw)
    if fmt in DENSE:
        w = torch.randn(vocab, hidden, generator=gen).to(DENSE[fmt])
        xd = gemm.fp8_x(x)
        return lambda lib: gemm.dense_logits(lib, xd, hidden, w)
    t = random_tensors(QuantAlgo.FP8 if fmt == "fp8" else QuantAlgo.NVFP4, vocab, hidden, gen)
    if fmt == "fp8":
        xf = gemm.fp8_x(x)
        return lambda lib: gemm.fp8_logits(lib, xf, hidden, t["weight"], t["weight_scale"])
    packed, xn, global_scale = nvfp4.to_block_major(t["weight"]), gemm.nvfp4_x(x), float(t["weight_scale_2"])
    return lambda lib: gemm.nvfp4_logits(lib, xn, hidden, packed, t["weight_scale"], global_scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare against (default HEAD)")
    parser.add_argument("--formats", default="fp8,nvfp4")
    parser.add_argument("--batches", default="1,2,3,4,8")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dpbf16", default="default",
                        help="vdpbf16ps modes to run, comma-separated: default, off, on (default: default)")
    parser.add_argument("--cache", help="folder for the base build (kept and reused; default: a temporary one)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="wall (perf_counter) or cpu (the calling thread's CPU time: meaningful with --threads 1)")
    add_json(parser)
    args = parser.parse_args()
    with recording("kernel_ab", args):
        modes = args.dpbf16.split(",")
        if any(m not in DPBF16_MODES for m in modes):
            parser.error(f"--dpbf16: modes among {', '.join(DPBF16_MODES)}, got {args.dpbf16!r}")
        torch.set_num_threads(args.threads)
        new = library.require()
        with tempfile.TemporaryDirectory(prefix="trtvocab-ab-") as tmp:
            tag = "".join(c if c.isalnum() else "_" for c in args.base)
            folder = Path(args.cache) / f"{tag}-{kcompile.requested_isa()}" if args.cache else Path(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            base = build_revision(args.base, folder)
            print(f"base {args.base}: {base.path}\nnew  working tree: {new.path}\n"
                  f"isa {kcompile.requested_isa()} ({new.isa}), V = {args.vocab}, H = {args.hidden}, "
                  f"{args.threads} thread(s), {args.rounds} interleaved rounds, {args.clock} clock")
            differ = 0
            for mode in modes:
                on = {lib.lib.trtvocab_fused_set_dpbf16(DPBF16_MODES[mode]) for lib in (base, new)}
                print(f"\nvdpbf16ps {mode}: {'on' if on == {1} else ('off' if on == {0} else on)}")
                differ += compare(args, base, new)
        return 1 if differ else 0


def compare(args: argparse.Namespace, base: kcompile.Loaded, new: kcompile.Loaded) -> int:
    """The table of every format and batch, interleaved; the number of calls whose bits differ."""
    differ = 0
    gen = torch.Generator().manual_seed(0)
    clock = CLOCKS[args.clock]
    for fmt in args.formats.split(","):
        print(f"\n{fmt:6} {'B':>3} {'base ms':>9} {'(median)':>9} {'new ms':>9} {'(median)':>9} "
              f"{'new/base':>9} {'new/B1':>7}  same bits")
        new_b1 = None
        for batch in (int(b) for b in args.batches.split(",")):
            call = calls(fmt, batch, args.vocab, args.hidden, gen)
            same = torch.equal(call(base).view(torch.int32), call(new).view(torch.int32))
            differ += not same
            timed = interleaved({"base": lambda c=call: c(base), "new": lambda c=call: c(new)}, args.rounds, warmup=0,
                                clock=clock)  # the bits check above was the warm-up
            b, n = timed["base"].best * 1e3, timed["new"].best * 1e3
            new_b1 = n if batch == 1 else new_b1
            ratio_b1 = f"{n / new_b1:7.2f}" if new_b1 else f"{'':7}"
            print(f"{'':6} {batch:3} {b:9.3f} {timed['base'].median * 1e3:9.3f} {n:9.3f} "
                  f"{timed['new'].median * 1e3:9.3f} {n / b:9.2f} {ratio_b1}  {same}")
            add_row(format=fmt, batch=batch, base=timed["base"].ms(), new=timed["new"].ms(), new_over_base=n / b,
                    same_bits=same)
    return differ


if __name__ == "__main__":
    sys.exit(main())
