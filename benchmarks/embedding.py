"""The embedding all-reduce as bytes: FP8 tables vs bf16 tables, and the lookup vs ``F.embedding``.

    .venv/bin/python benchmarks/embedding.py                     # gloo, tp 4, T = 8192, H = 2048
    .venv/bin/python benchmarks/embedding.py --tokens 2048 --vocab 32000

Part 1, side by side in one launch of ``tp`` gloo processes (one thread each), the same
ids, the same vocabulary split, median of ``--repeats`` forwards each:

* ``bf16``: a bf16 table; looked-up rows are summed as int32 words of their bytes
  (2 bytes per element cross);
* ``fp8``: the same table as float8_e4m3fn with a per-tensor scale; looked-up rows are
  summed as bytes (1 byte per element) and dequantized once, after the reduce.

Printed: bytes each rank contributes to the all-reduce, time per forward, and the ratios.
Part 2 (one process): a replicated ``VocabParallelEmbedding`` lookup against
``torch.nn.functional.embedding`` on the same full table (the masking is the extra work).
Run it alone: on 2 cores any parallel job swings the timings.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _harness import add_json, recording


def _rank(rank: int, world: int, vocab: int, hidden: int, tokens: int, repeats: int) -> dict[str, float]:
    from trtvocab import Mapping, QuantAlgo, QuantConfig, VocabParallelEmbedding
    from trtvocab.quant import fp8

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=gen) * 0.02
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)
    dense = VocabParallelEmbedding(vocab, hidden, dtype=torch.bfloat16, mapping=mapping)
    dense.load_weights({"weight": w.bfloat16()})
    q, s = fp8.quantize_fp8(w)
    quant = VocabParallelEmbedding(vocab, hidden, dtype=torch.bfloat16, mapping=mapping,
                                   quant_config=QuantConfig(quant_algo=QuantAlgo.FP8, activation="none"))
    quant.load_weights({"weight": q, "weight_scale": s})
    out: dict[str, float] = {}
    for name, emb in (("bf16", dense), ("fp8", quant)):
        emb(ids)  # warm-up (and the first handshake's connection set-up)
        times = []
        for _ in range(repeats):
            torch.distributed.barrier()
            start = time.perf_counter()
            emb(ids)
            times.append(time.perf_counter() - start)
        out[f"{name}_s"] = statistics.median(times)
        out[f"{name}_bytes"] = tokens * hidden * emb.weights.weight.element_size()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=7)
    add_json(parser)
    args = parser.parse_args()
    with recording("embedding", args):

        from trtvocab import VocabParallelEmbedding
        from trtvocab.parallel.launch import run_ranks

        results = run_ranks(_rank, args.tp, args.vocab, args.hidden, args.tokens, args.repeats, backend="gloo")
        r = {k: max(res[k] for res in results) for k in results[0]}  # the slowest rank sets the step
        print(f"all-reduce of looked-up rows, gloo, tp {args.tp}, T = {args.tokens}, H = {args.hidden}, "
              f"V = {args.vocab}")
        print(f"  bf16 table: {r['bf16_bytes'] / 1e6:8.1f} MB per rank into the all-reduce, "
                  f"{r['bf16_s'] * 1e3:8.2f} ms")
        print(f"  fp8 table : {r['fp8_bytes'] / 1e6:8.1f} MB per rank into the all-reduce, {r['fp8_s'] * 1e3:8.2f} ms")
        print(f"  fp8 / bf16: bytes {r['fp8_bytes'] / r['bf16_bytes']:.2f}x, time {r['fp8_s'] / r['bf16_s']:.2f}x")

        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(1)
        w = torch.randn(args.vocab, args.hidden, generator=gen).bfloat16()
        ids = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
        emb = VocabParallelEmbedding(args.vocab, args.hidden, dtype=torch.bfloat16)
        emb.load_weights({"weight": w})
        timings: dict[str, list[float]] = {"F.embedding": [], "VocabParallelEmbedding": []}
        for _ in range(args.repeats):
            contenders = (("F.embedding", lambda: F.embedding(ids, w)), ("VocabParallelEmbedding", lambda: emb(ids)))
            for name, fn in contenders:
                start = time.perf_counter()
                fn()
                timings[name].append(time.perf_counter() - start)
        base, ours = (statistics.median(timings[k]) for k in ("F.embedding", "VocabParallelEmbedding"))
        print(f"replicated lookup, 1 thread, T = {args.tokens}: F.embedding {base * 1e3:.2f} ms, "
              f"VocabParallelEmbedding {ours * 1e3:.2f} ms ({ours / base:.2f}x: the mask of ids outside [0, V))")


if __name__ == "__main__":
    main()
