"""The deterministic head's cost: ``LMHead(deterministic=True)`` vs the default head, side by side.

    .venv/bin/python benchmarks/deterministic.py                    # SmolLM2's shape: V 49152, H 576
    .venv/bin/python benchmarks/deterministic.py --vocab 129280 --hidden 5120

One process, one thread per core, bf16 and float32 heads, B = 1 and B = 64, median of
``--repeats`` calls each, the two heads alternating so that drift hits both alike. Goal:
the deterministic head within 1.5x of the default at B = 1 and B = 64. Also
printed: whether the default head itself gave a row the same bits alone and in the batch
(on MKL/CPU it does not for float32), which is what the deterministic mode pays for.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _harness import add_json, recording


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=15)
    add_json(parser)
    args = parser.parse_args()
    with recording("deterministic", args):

        from trtvocab import LMHead

        gen = torch.Generator().manual_seed(0)
        w = torch.randn(args.vocab, args.hidden, generator=gen) * 0.05
        print(f"LMHead V = {args.vocab}, H = {args.hidden}, {torch.get_num_threads()} threads")
        for dtype in (torch.bfloat16, torch.float32):
            heads = {}
            for det in (False, True):
                heads[det] = LMHead(args.vocab, args.hidden, dtype=dtype, deterministic=det)
                heads[det].load_weights({"weight": w.to(dtype)})
            for batch in (1, 64):
                x = torch.randn(batch, args.hidden, generator=gen).to(dtype)
                times: dict[bool, list[float]] = {False: [], True: []}
                with torch.no_grad():
                    for det in (False, True):
                        heads[det](x)  # warm-up
                    for _ in range(args.repeats):
                        for det in (False, True):
                            start = time.perf_counter()
                            heads[det](x)
                            times[det].append(time.perf_counter() - start)
                    default, det = (statistics.median(times[k]) for k in (False, True))
                    alone_same = bool(torch.equal(heads[False](x[:1]), heads[False](x)[:1])) if batch > 1 else True
                print(f"  {str(dtype).removeprefix('torch.'):8s} B = {batch:3d}: default {default * 1e3:7.2f} ms, "
                      f"deterministic {det * 1e3:7.2f} ms, ratio {det / default:5.2f}x"
                      + ("" if batch == 1 else f"  (default head: row alone == in batch: {alone_same})"))


if __name__ == "__main__":
    main()
