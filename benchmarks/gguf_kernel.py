"""The GGUF block kernel alone, one thread, in CPU time: a load-robust view of its throughput.

    python benchmarks/gguf_kernel.py                      # every stored block type
    python benchmarks/gguf_kernel.py --types Q8_0 --rows 1024 65536

On a shared machine wall-clock times mostly measure the neighbours; the calling thread's CPU time
(``time.thread_time_ns``, best of ``--reps``) counts only the cycles the kernel ran (still slowed by
what other tenants do to the caches and the memory bus). For each block type, head of ``rows`` x H
random blocks (H = 640; 768 for the K-quants) and batch B: ms, multiply-adds per ns, the stored GB/s.
``rows`` = 1024 fits in L2 (the compute bound: decode + the chain's separate multiply and add); 65536
streams from DRAM at B = 1. The first line calibrates: torch's float32 GEMM (FMA) at one thread, the
same machine's dot-product peak, which the chain (a rounded product, then a rounded sum: two float
ops per multiply-add) can reach at most half of per float pipe pair.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
from _harness import add_json, recording

from trtvocab import kernels
from trtvocab.kernels import gemm
from trtvocab.quant import gguf_blocks as gb


def best_cpu_ns(fn, reps: int) -> int:
    fn()
    best = 1 << 62
    for _ in range(reps):
        start = time.thread_time_ns()
        fn()
        best = min(best, time.thread_time_ns() - start)
    return max(best, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", default=list(gb.BLOCKS), choices=list(gb.BLOCKS))
    parser.add_argument("--rows", type=int, nargs="*", default=[1024, 65536])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8, 64])
    parser.add_argument("--reps", type=int, default=20)
    add_json(parser)
    args = parser.parse_args()
    with recording("gguf_kernel", args):
        loaded = kernels.load()
        if loaded is None:
            print(f"no GGUF kernel: {kernels.unavailable_reason()}")
            return
        torch.set_num_threads(1)
        load_before = os.getloadavg()[0]
        a, b = torch.randn(512, 640), torch.randn(640, 1024)
        fma = 512 * 640 * 1024 / best_cpu_ns(lambda: a @ b, args.reps)
        print(f"kernels {loaded.isa}, 1 thread, CPU time; torch sgemm {fma:.1f} FMA/ns")
        print(f"{'type':>5} {'rows':>6} {'B':>3} {'ms':>8} {'MAC/ns':>7} {'GB/s':>6}")
        for block_type in args.types:
            config = gb.GGUFConfig(block_type=block_type)
            hidden = 768 if config.block == 256 else 640
            for rows in args.rows:
                gen = torch.Generator().manual_seed(0)
                raw = torch.randint(0, 256, (rows, hidden // config.block, config.type_size), dtype=torch.uint8,
                                    generator=gen)
                for _, at in gb.BLOCK_TYPES[block_type].scales:
                    raw[..., at : at + 2] = torch.tensor([1e-2], dtype=torch.float16).view(torch.uint8)
                raw = raw.reshape(rows, -1).contiguous()
                for n in args.batches:
                    x = torch.randn(n, hidden)
                    out = torch.empty(n, rows)
                    call = functools.partial(gemm.gguf_logits, loaded, x, hidden, block_type, raw, out)
                    ns = best_cpu_ns(call, max(3, args.reps * 1024 // rows))
                    print(f"{block_type:>5} {rows:>6} {n:>3} {ns / 1e6:>8.3f} {n * rows * hidden / ns:>7.2f} "
                          f"{raw.numel() / ns:>6.2f}")
        print(f"load (1-minute average) before {load_before:.2f}, after {os.getloadavg()[0]:.2f} on {os.cpu_count()} "
              "cores")


if __name__ == "__main__":
    main()
