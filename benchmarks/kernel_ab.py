"""The fused kernels of a git revision against the working tree's, interleaved in one process.

    python benchmarks/kernel_ab.py                        # HEAD against the working tree, FP8 and NVFP4
    python benchmarks/kernel_ab.py --base 4372e13 --batches 1,3,4,8 --rounds 11
    python benchmarks/kernel_ab.py --formats nvfp4 --vocab 20000 --threads 1

For a kernel change, the only comparison this kind of machine allows: a VM's memory bandwidth
and clock move by 1.5x between hours (the probe of ``benchmarks/bandwidth.py`` read 50 and 78 GB/s
on one Zen 5 in one session), so timings taken in separate runs compare the hours, not the kernels.
The base revision's ``trtvocab/kernels/csrc`` sources (read with ``git show``) are built with the
same flags as the working tree's into a temporary folder, both libraries are loaded, and each round
calls every batch on both, one after the other, on the same random valid codes (weight values do not
change the work). Printed per batch: best and median ms of each, new / base (best), the new
library's time over its own batch 1 (the decode goals of issue 21), and whether both libraries
give the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized_head import random_tensors

from trtvocab import QuantAlgo
from trtvocab.kernels import compile as kcompile
from trtvocab.kernels import gemm, library
from trtvocab.quant import nvfp4

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("fused.cpp", "treesum.cpp")


def build_revision(rev: str, folder: Path) -> kcompile.Loaded:
    """The kernel library of ``rev``'s sources, built with this tree's flags in ``folder``."""
    from torch.utils import cpp_extension

    names = []
    for name in (*SOURCES, "gguf.cpp"):  # gguf.cpp: where the revision has it
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:trtvocab/kernels/csrc/{name}"],
                               check=name in SOURCES, capture_output=True)
        if shown.returncode == 0:
            (folder / name).write_bytes(shown.stdout)
            names.append(name)
    lib = "trtvocab_ab_base"
    path = cpp_extension.load(name=lib, sources=[str(folder / n) for n in names], extra_cflags=kcompile.cflags(),
                              extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False)
    return kcompile.bind(Path(path))


Call = Callable[[kcompile.Loaded], torch.Tensor]


def calls(fmt: str, batch: int, vocab: int, hidden: int, gen: torch.Generator) -> Call:
    """One decode call of ``fmt`` at ``batch`` rows on random valid codes (quantized_head's), for a given library."""
    x = torch.randn(batch, hidden, generator=gen).bfloat16().float()
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new = library.require()
    with tempfile.TemporaryDirectory(prefix="trtvocab-ab-") as tmp:
        base = build_revision(args.base, Path(tmp))
        print(f"base {args.base}: {base.path}\nnew  working tree: {new.path}\n"
              f"V = {args.vocab}, H = {args.hidden}, {args.threads} thread(s), {args.rounds} interleaved rounds")
        gen = torch.Generator().manual_seed(0)
        for fmt in args.formats.split(","):
            print(f"\n{fmt:6} {'B':>3} {'base ms':>9} {'(median)':>9} {'new ms':>9} {'(median)':>9} "
                  f"{'new/base':>9} {'new/B1':>7}  same bits")
            new_b1 = None
            for batch in (int(b) for b in args.batches.split(",")):
                call = calls(fmt, batch, args.vocab, args.hidden, gen)
                same = torch.equal(call(base).view(torch.int32), call(new).view(torch.int32))
                times: dict[str, list[float]] = {"base": [], "new": []}
                for _ in range(args.rounds):
                    for name, lib in (("base", base), ("new", new)):
                        start = time.perf_counter()
                        call(lib)
                        times[name].append(time.perf_counter() - start)
                b, n = (min(times[k]) * 1e3 for k in ("base", "new"))
                new_b1 = n if batch == 1 else new_b1
                ratio_b1 = f"{n / new_b1:7.2f}" if new_b1 else f"{'':7}"
                print(f"{'':6} {batch:3} {b:9.2f} {statistics.median(times['base']) * 1e3:9.2f} {n:9.2f} "
                      f"{statistics.median(times['new']) * 1e3:9.2f} {n / b:9.2f} {ratio_b1}  {same}")


if __name__ == "__main__":
    sys.exit(main())
