"""GGUF heads in their stored blocks against the same heads dequantized, side by side, with the bandwidth probe.

    python benchmarks/gguf_head.py                    # Gemma 3 270M's and SmolLM2's tied Q8_0 heads
    python benchmarks/gguf_head.py --q6k              # plus a Q6_K head of random blocks, 262144 x 768
    python benchmarks/gguf_head.py --random Q4_0 Q4_K # heads of random blocks (262144 x 640; K-quants x 768)
    python benchmarks/gguf_head.py --rounds 3 --models smollm2

For each head and batch B in (1, 2, 4, 8, 64): best and median ms of the stored-block head (the fused
kernel; the torch chain where it does not build), its best time over the first batch's (``/ B=1``), its
GB/s over the stored bytes and the fraction of the read probe (``benchmarks/bandwidth.py``, same rounds),
and the float32- and bf16-dequantized heads' times over it (> 1: the blocks are faster). ``floor ms`` is
the larger of two measured limits: the stored bytes at the read probe, and ``weights * (B + 1)`` float32
multiplies (the chain's product per x row and its dequantizing one: activations stay float, as llama.cpp's
Q8 activations do not) at the multiply probe (``bandwidth.multiply_rate``, same rounds); ``floor / B=1`` is
that floor over the first batch's floor, and ``floor / ms1`` over the first batch's measured best: the
least ``/ B=1`` a kernel of this chain could reach here with that first batch as it ran. A third
limit is printed under each head's table: ``chain``, B = 1's weights at the rate of
``trtvocab.kernels.gguf_chain_probe`` (the chain's decode, product and sum with codes and x in L1: no block
format to unpack, no memory to wait for: the pace of the B = 1 tile's decode, not a bound on every
decode), the GB/s of these blocks at that pace, and that over the probe. Variants
interleave round by round, so a busy machine slows all alike;
the line ``load`` prints the 1-minute load average before and after: numbers under load are labelled so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import add_json, add_row, fraction, recording
from common import make_probe, multiply_rate, per_ns

from trtvocab import LMHead, kernels
from trtvocab.kernels import probes
from trtvocab.quant.gguf_blocks import GGUFConfig

BATCHES = (1, 2, 4, 8, 64)
SCALES_AT = {"Q8_0": (0,), "Q6_K": (208,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2)}


def model_path(name: str) -> str | None:
    from trtvocab.checkpoints.real_models import model_path as find
    from trtvocab.errors import TrtVocabError

    try:
        path = Path(find(name))
    except TrtVocabError:
        return None
    return str(path) if path.is_file() else None


def heads(args: argparse.Namespace) -> list[tuple[str, dict[str, LMHead]]]:
    out = []
    for name in args.models:
        path = model_path(name)
        if path is None:
            print(f"{name}: model not installed, skipped")
            continue
        variants = {"blocks": LMHead.from_checkpoint(path, dtype=torch.float32),
                    "float32": LMHead.from_checkpoint(path, dtype=torch.float32, gguf_blocks=False)}
        if not args.no_bf16:
            variants["bf16"] = LMHead.from_checkpoint(path, dtype=torch.bfloat16, gguf_blocks=False)
        out.append((f"{name} {variants['blocks'].label} {variants['blocks'].vocab_size}x"
                    f"{variants['blocks'].hidden_size}", variants))
    for block_type in [*(["Q6_K"] if args.q6k else []), *args.random]:
        config = GGUFConfig(block_type=block_type)
        vocab, hidden = 262144, 768 if config.block == 256 else 640
        gen = torch.Generator().manual_seed(0)
        raw = torch.randint(0, 256, (vocab, hidden // config.block, config.type_size), dtype=torch.uint8,
                            generator=gen)
        for at in SCALES_AT[block_type]:  # finite fp16 scales (random bytes could be inf / nan)
            raw[..., at : at + 2] = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8)
        blocks = LMHead(vocab, hidden, dtype=torch.float32, quant_config=config)
        blocks.load_weights({"weight": raw.reshape(vocab, -1)})
        dense = LMHead(vocab, hidden, dtype=torch.float32)
        dense.load_weights({"weight": blocks.weights.dense_weight()})
        variants = {"blocks": blocks, "float32": dense}
        if not args.no_bf16:
            bf = LMHead(vocab, hidden, dtype=torch.bfloat16)
            bf.load_weights({"weight": dense.weight.to(torch.bfloat16)})
            variants["bf16"] = bf
        out.append((f"random GGUF {block_type} {vocab}x{hidden}", variants))
    return out


def chain_rate(rounds: int = 8192) -> float | None:
    """Weights per ns of one call of the kernels' GGUF chain probe; None without the GGUF kernels."""
    loaded = kernels.load()
    if loaded is None or not hasattr(loaded.lib, "trtvocab_gguf_chain_probe"):
        return None
    return per_ns(lambda: probes.gguf_chain_probe(rounds))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["gemma3", "smollm2"])
    parser.add_argument("--q6k", action="store_true", help="same as --random Q6_K")
    parser.add_argument("--random", nargs="*", default=[], choices=list(SCALES_AT),
                        help="heads of random blocks of these types")
    parser.add_argument("--no-bf16", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    add_json(parser)
    args = parser.parse_args()
    with recording("gguf_head", args):
        load_before = os.getloadavg()[0]
        loaded = kernels.load()
        print(f"threads {torch.get_num_threads()}, kernels: {loaded.isa if loaded else kernels.unavailable_reason()}, "
              f"cores {os.cpu_count()}")
        probe = make_probe()
        reader = probe.readers.get("kernel", probe.readers["torch"])
        multiply_rate()  # warm-up: the probe's threads started
        for title, variants in heads(args):
            stored = variants["blocks"].resident_bytes()
            print(f"\n{title}: stored {stored / 1e6:.1f} MB, "
                  f"float32 {variants['float32'].resident_bytes() / 1e6:.1f} MB")
            print(f"{'B':>3} {'blocks ms':>10} {'median':>8} {'/ B=1':>6} {'GB/s':>6} {'probe':>6} {'of probe':>8} "
                  f"{'mul/ns':>7} {'floor ms':>9} {'floor / B=1':>11} {'floor / ms1':>11} "
                  + " ".join(f"{k + ' x':>10}" for k in variants if k != "blocks"))
            first = 0.0  # the first batch's best time (B = 1 by default): the ''/ B=1'' column
            first_floor = 0.0
            chain_line = ""
            weights = variants["blocks"].vocab_size * variants["blocks"].hidden_size
            for b in args.batches:
                x = torch.randn(b, variants["blocks"].hidden_size)
                calls = {k: (lambda h=h, xx=x.to(h.dtype): h.column_logits(xx)) for k, h in variants.items()}
                for call in calls.values():
                    call()
                times: dict[str, list[float]] = {k: [] for k in calls}
                probe_gbs = 0.0
                mul_per_ns = 0.0
                chain_per_ns = 0.0
                for _ in range(args.rounds):
                    for k, call in calls.items():
                        times[k].append(timed(call))
                    probe_gbs = max(probe_gbs, probe.nbytes / (timed(reader) / 1e3) / 1e9)
                    mul_per_ns = max(mul_per_ns, multiply_rate() or 0.0)
                    if b == 1:  # the chain line is B = 1's
                        chain_per_ns = max(chain_per_ns, chain_rate() or 0.0)
                best = {k: min(v) for k, v in times.items()}
                gbs = stored / (best["blocks"] / 1e3) / 1e9
                first = first or best["blocks"]
                floor = max(stored / probe_gbs / 1e6, weights * (b + 1) / mul_per_ns / 1e6 if mul_per_ns else 0.0)
                first_floor = first_floor or floor
                if b == 1 and chain_per_ns:
                    chain_ms = weights / chain_per_ns / 1e6
                    chain_line = (f"chain: B = 1's weights at the chain probe's {chain_per_ns:.1f} per ns "
                                  f"(codes in L1, "
                                  f"nothing to unpack) {chain_ms:.2f} ms: {stored / chain_ms / 1e6:.1f} GB/s of these "
                                  f"blocks, {stored / chain_ms / 1e6 / probe_gbs:.2f} of the probe, at the tile's pace")
                print(f"{b:>3} {best['blocks']:>10.2f} {statistics.median(times['blocks']):>8.2f} "
                      f"{best['blocks'] / first:>6.2f} {gbs:>6.1f} "
                      f"{probe_gbs:>6.1f} {gbs / probe_gbs:>8.2f} "
                      f"{mul_per_ns:>7.1f} {floor:>9.2f} {floor / first_floor:>11.2f} {floor / first:>11.2f} "
                      + " ".join(f"{best[k] / best['blocks']:>10.2f}" for k in calls if k != "blocks"))
                add_row(head=title, batch=b, best_ms=best["blocks"], median_ms=statistics.median(times["blocks"]),
                        gb_s=gbs, probe_gb_s=probe_gbs, of_probe=fraction(stored, best["blocks"] / 1e3, probe_gbs),
                        mul_per_ns=mul_per_ns, floor_ms=floor,
                        **{f"{k}_over_blocks": best[k] / best["blocks"] for k in calls if k != "blocks"})
            if chain_line:
                print(chain_line)
        print(f"\nload (1-minute average) before {load_before:.2f}, after {os.getloadavg()[0]:.2f} on "
              f"{os.cpu_count()} cores: numbers measured under that load")


if __name__ == "__main__":
    main()
