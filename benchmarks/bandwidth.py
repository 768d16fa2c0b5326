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
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_MIB = 1024  # > 30x the L3 of the machines this runs on


def last_level_cache_bytes() -> int | None:
    """The largest cache this CPU reports (sysfs), None where it is not readable."""
    import glob

    best = None
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path, encoding="ascii").read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = value if best is None else max(best, value)
    return best


@dataclass
class Probe:
    """A read-only pass over ``buffer``; ``readers`` name -> call (each reads every byte once)."""

    buffer: torch.Tensor
    readers: dict[str, Callable[[], object]]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def make_probe(mib: int = DEFAULT_MIB) -> Probe:
    nbytes = max(256, (mib << 20) // 256 * 256)
    llc = last_level_cache_bytes()
    if llc is not None and nbytes < 4 * llc:
        nbytes = (4 * llc + 255) // 256 * 256
    buffer = torch.ones(nbytes // 8, dtype=torch.int64)  # written once: every page resident
    readers: dict[str, Callable[[], object]] = {}
    from trtvocab import kernels

    if kernels.available():
        readers["kernel"] = lambda: kernels.read_probe(buffer)
    readers["torch"] = lambda: buffer.sum()
    return Probe(buffer, readers)


def measure(probe: Probe, rounds: int = 5) -> dict[str, float]:
    """Best GB/s of each reader over ``rounds`` interleaved rounds (after one warm-up call each)."""
    for read in probe.readers.values():
        read()
    best = {name: 0.0 for name in probe.readers}
    for _ in range(rounds):
        for name, read in probe.readers.items():
            start = time.perf_counter()
            read()
            best[name] = max(best[name], probe.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def per_ns(count: Callable[[], int]) -> float:
    """What one call of ``count`` returns (the work it did: multiplies, weights) per ns of its wall time."""
    start = time.perf_counter()
    made = count()
    return made / ((time.perf_counter() - start) * 1e9)


def multiply_rate(steps: int = 1 << 21) -> float | None:
    """Float32 multiplies per ns of one call of the kernels' multiply probe (``steps`` rounds of its 16
    chains per thread); None where the kernels' library does not load. Call it per round, keep the best."""
    from trtvocab import kernels

    if not kernels.available():
        return None
    return per_ns(lambda: kernels.mul_probe(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=DEFAULT_MIB, help="buffer size in MiB (at least 4x the LLC)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    probe = make_probe(args.mib)
    llc = last_level_cache_bytes()
    print(f"read probe: {probe.nbytes / 2**20:.0f} MiB buffer (LLC {llc / 2**20 if llc else float('nan'):.0f} MiB), "
          f"{torch.get_num_threads()} threads, best of {args.rounds}")
    result = measure(probe, args.rounds)
    for name, gbs in result.items():
        print(f"  {name:<7} {gbs:6.2f} GB/s")
    print(f"limit   {max(result.values()):6.2f} GB/s")
    rates = [multiply_rate() for _ in range(args.rounds + 1)][1:]
    if rates[0] is not None:
        print(f"multiply probe: {max(r for r in rates if r is not None):.1f} float32 multiplies per ns, "
              f"{torch.get_num_threads()} threads, best of {args.rounds}")


if __name__ == "__main__":
    main()
