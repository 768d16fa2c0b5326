"""The physical limit of a CPU decode step: how fast this machine reads memory, measured like a head reads it.

    python benchmarks/bandwidth.py                 # 1 GiB buffer, torch's thread count
    python benchmarks/bandwidth.py --mib 2048 --rounds 10

A STREAM-like *read*: a buffer several times larger than the last-level cache is read once per
call, with the threads the heads use (torch's intra-op pool: ``torch.get_num_threads()``).
Two readers, best of the rounds for each:

- ``kernel``: ``trtvocab.kernels.read_probe`` (the fused kernels' library, the same
  ``at::parallel_for`` as the heads, 8 independent 32-byte integer accumulators per thread);
- ``torch``: ``int64`` sum over the same buffer (the peers' view of the same memory).

The larger of the two is the limit the head benchmarks divide by (``benchmarks/quantized_head.py``
measures it interleaved with the heads, round by round, so a busy machine lowers both alike).

The other limit is arithmetic: ``multiply_rate`` times ``trtvocab.kernels.mul_probe`` (16 independent
float32 multiply chains per thread on the widest vectors the kernels' library has, the same threads),
the most float32 multiplies per ns these cores make. A head whose float32 chain multiplies every weight
``B + 1`` times (one product per x row, one to dequantize) cannot beat ``weights * (B + 1)`` over it,
whatever the memory does (``benchmarks/gguf_head.py`` prints that floor beside the read one).
"""

from __future__ import annotations

import argparse

import torch
from _harness import add_json, add_row, recording
from common import DEFAULT_MIB, last_level_cache_bytes, make_probe, measure, multiply_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=DEFAULT_MIB, help="buffer size in MiB (at least 4x the LLC)")
    parser.add_argument("--rounds", type=int, default=5)
    add_json(parser)
    args = parser.parse_args()
    with recording("bandwidth", args):
        if args.rounds < 1:
            parser.error(f"--rounds: at least 1, got {args.rounds}")
        probe = make_probe(args.mib)
        llc = last_level_cache_bytes()
        print(f"read probe: {probe.nbytes / 2**20:.0f} MiB buffer "
              f"(LLC {llc / 2**20 if llc else float('nan'):.0f} MiB), "
              f"{torch.get_num_threads()} threads, best of {args.rounds}")
        result = measure(probe, args.rounds)
        for name, gbs in result.items():
            print(f"  {name:<7} {gbs:6.2f} GB/s")
            add_row(reader=name, gb_s=gbs)
        print(f"limit   {max(result.values()):6.2f} GB/s")
        rates = [multiply_rate() for _ in range(args.rounds + 1)][1:]
        if rates[0] is not None:
            print(f"multiply probe: {max(r for r in rates if r is not None):.1f} float32 multiplies per ns, "
                  f"{torch.get_num_threads()} threads, best of {args.rounds}")


if __name__ == "__main__":
    main()
