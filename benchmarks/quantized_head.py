"""Resident bytes and decode throughput of FP8 / NVFP4 LM heads against bf16, side by side.

    python benchmarks/quantized_head.py            # V=129280, H=5120 (DeepSeek-V3 sized head)
    python benchmarks/quantized_head.py --small    # V=32000, H=2048, a quick run

Every head keeps its weights quantized in memory and dequantizes them per call in
chunks of ``trtvocab.weights.quantized.CHUNK_ELEMENTS`` float32 values, so the temporary
stays a few MiB. Timings interleave the heads round by round so that a busy machine
slows all of them alike (best-of and median are both printed); the ratios are the
result, the absolute numbers depend on the machine. Weight values do not change the work done,
so the quantized heads hold random valid codes instead of a (slow) quantized copy of
the bf16 matrix; accuracy is covered by the tests, not here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trtvocab import LMHead, QuantAlgo, QuantConfig
from trtvocab.weights import quantized as methods


def random_tensors(algo: QuantAlgo, vocab: int, hidden: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Valid checkpoint tensors: no NaN codes, positive scales."""
    if algo is QuantAlgo.FP8:
        codes = torch.randint(0, 256, (vocab, hidden), dtype=torch.uint8, generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn NaN
        return {"weight": codes.view(torch.float8_e4m3fn), "weight_scale": torch.tensor(2e-4)}
    packed = torch.randint(0, 256, (vocab, hidden // 2), dtype=torch.uint8, generator=gen)
    # Block scales 0x30..0x5f: e4m3 values 1 .. 240.
    scales = torch.randint(0x30, 0x60, (vocab, hidden // 16), dtype=torch.uint8, generator=gen)
    return {"weight": packed, "weight_scale": scales.view(torch.float8_e4m3fn), "weight_scale_2": torch.tensor(3e-5)}


def build_heads(vocab: int, hidden: int) -> dict[str, LMHead]:
    gen = torch.Generator().manual_seed(0)
    heads: dict[str, LMHead] = {}
    dense = LMHead(vocab, hidden, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weights.weight.uniform_(-0.04, 0.04, generator=gen)  # in place: no second full-size copy
    heads["bf16"] = dense
    variants = [
        ("FP8 W8A8 (dynamic)", QuantAlgo.FP8, "dynamic"),
        ("FP8 W8A16", QuantAlgo.FP8, "none"),
        ("NVFP4 W4A4", QuantAlgo.NVFP4, "static"),
        ("NVFP4 W4A16", QuantAlgo.NVFP4, "none"),
    ]
    stored = {algo: random_tensors(algo, vocab, hidden, gen) for algo in (QuantAlgo.FP8, QuantAlgo.NVFP4)}
    for name, algo, activation in variants:
        head = LMHead(vocab, hidden, dtype=torch.bfloat16, quant_config=QuantConfig(quant_algo=algo,
                                                                                   activation=activation))
        tensors = dict(stored[algo])
        if activation == "static":
            tensors["input_scale"] = torch.tensor(4.0 / (6 * 448))
        head.load_weights(tensors)
        heads[name] = head
    return heads


def time_call(head: LMHead, x: torch.Tensor) -> float:
    start = time.perf_counter()
    head(x)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="V=32000, H=2048: a quick run")
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per head and batch size")
    parser.add_argument("--chunk-elements", type=int, default=methods.CHUNK_ELEMENTS,
                        help="float32 values dequantized per GEMM chunk")
    args = parser.parse_args()
    vocab = args.vocab or (32000 if args.small else 129280)
    hidden = args.hidden or (2048 if args.small else 5120)
    rounds = args.rounds or (7 if args.small else 3)
    methods.CHUNK_ELEMENTS = args.chunk_elements

    print(f"LM head V={vocab} H={hidden}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"chunk {methods.CHUNK_ELEMENTS} float32 values")
    t0 = time.perf_counter()
    heads = build_heads(vocab, hidden)
    print(f"built heads in {time.perf_counter() - t0:.1f} s\n")

    base_bytes = heads["bf16"].resident_bytes()
    print(f"{'head':<20} {'resident bytes':>16} {'vs bf16':>8}")
    for name, head in heads.items():
        nbytes = head.resident_bytes()
        print(f"{name:<20} {nbytes:>16,} {nbytes / base_bytes:>8.3f}")

    for batch in (1, 8):
        x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(batch)).bfloat16()
        for head in heads.values():  # warm-up: allocator, thread pool, caches
            head(x)
        times: dict[str, list[float]] = {name: [] for name in heads}
        for _ in range(rounds):
            for name, head in heads.items():
                times[name].append(time_call(head, x))
        best_base, median_base = min(times["bf16"]), statistics.median(times["bf16"])
        print(f"\ndecode B={batch}: {rounds} interleaved rounds; best-of (robust to a busy machine) and median")
        print(f"{'head':<20} {'best ms':>9} {'median ms':>10} {'tokens/s':>10} {'speed vs bf16':>14} {'(median)':>9}")
        for name, ts in times.items():
            best, median = min(ts), statistics.median(ts)
            print(f"{name:<20} {best * 1e3:>9.1f} {median * 1e3:>10.1f} {batch / best:>10.1f} "
                  f"{best_base / best:>13.2f}x {median_base / median:>8.2f}x")

if __name__ == "__main__":
    main()
