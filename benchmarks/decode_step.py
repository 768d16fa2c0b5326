"""One decode step of a vocab-split head -- head GEMM + seeded sampling -- before vs after paying
for the cross-rank handshake once: collectives per step and time per step, side by side.

    .venv/bin/python benchmarks/decode_step.py                     # tp 4 (gloo), V 129280, H 1024, B 1 and 64
    .venv/bin/python benchmarks/decode_step.py --hidden 4096 --batch 1

* ``before``: ``head(x)`` (gather_output=False) then ``sample(logits, head, params)``, with a
  handshake before every call (``head.handshake_every_call = True``, the old behaviour):
  the forward's handshake, the sampler's handshake, the race = 3 collectives;
* ``sample``: the same two calls with the agreement kept (the sampler's verdict rides on the
  race; the forward still handshakes, having no data collective of its own) = 2;
* ``decode``: ``trtvocab.sampling.decode(x, head, params)``, the fused step = 1 collective.

Every variant draws the same tokens (checked). Each rank runs one torch thread (4 ranks share
this machine's cores); steps interleave the variants so that a busy machine slows all alike.
Run it alone: on 2 cores any parallel job makes timings swing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _harness import add_json, recording


def _rank(rank: int, world: int, vocab: int, hidden: int, batches: list[int], steps: int) -> dict[str, Any]:
    from trtvocab import LMHead, Mapping
    from trtvocab.sampling import SamplingParams, decode, sample

    torch.set_num_threads(1)
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)
    gen = torch.Generator().manual_seed(rank)
    heads = {}
    for name in ("before", "sample", "decode"):
        head = LMHead(vocab, hidden, dtype=torch.float32, mapping=mapping, gather_output=False)
        heads[name] = head
    with torch.no_grad():
        heads["before"].weights.weight.normal_(0, 0.05, generator=gen)
        for name in ("sample", "decode"):
            heads[name].weights.weight.copy_(heads["before"].weights.weight)
    heads["before"].handshake_every_call = True

    calls = {"n": 0}
    real = {n: getattr(dist, n) for n in ("all_gather", "all_reduce", "all_to_all_single")}

    def counted(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return fn(*args, **kwargs)
        return wrapper

    for n, fn in real.items():
        setattr(dist, n, counted(fn))
    out: dict[str, Any] = {}
    try:
        for batch in batches:
            params = [SamplingParams(temperature=0.8, seed=i) for i in range(batch)]
            times: dict[str, list[float]] = {k: [] for k in heads}
            counts: dict[str, list[int]] = {k: [] for k in heads}
            tokens: dict[str, list[list[int]]] = {k: [] for k in heads}
            for step in range(steps + 1):  # step 0: warm-up (and the agreement's first handshake)
                x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(step))
                for name, head in heads.items():
                    dist.barrier()
                    calls["n"] = 0
                    start = time.perf_counter()
                    if name == "decode":
                        ids = decode(x, head, params, step=step)
                    else:
                        ids = sample(head(x), head, params, step=step)
                    elapsed = time.perf_counter() - start
                    tokens[name].append(ids.tolist())
                    if step:
                        times[name].append(elapsed)
                        counts[name].append(calls["n"])
            for name in heads:
                out[f"{batch}/{name}/s"] = statistics.median(times[name])
                out[f"{batch}/{name}/best"] = min(times[name])
                out[f"{batch}/{name}/collectives"] = statistics.mean(counts[name])
                out[f"{batch}/{name}/tokens"] = tokens[name]
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=30)
    add_json(parser)
    args = parser.parse_args()
    with recording("decode_step", args):

        from trtvocab.parallel.launch import run_ranks

        results = run_ranks(_rank, args.tp, args.vocab, args.hidden, args.batch, args.steps, backend="gloo",
                            timeout_s=900)
        print(f"decode step (head GEMM + seeded sampling, T 0.8), gloo, tp {args.tp}, V = {args.vocab}, "
              f"H = {args.hidden}, float32, {args.steps} steps, 1 torch thread per rank")
        for batch in args.batch:
            r0 = results[0]
            assert r0[f"{batch}/before/tokens"] == r0[f"{batch}/sample/tokens"] == r0[f"{batch}/decode/tokens"], \
                "the variants drew different tokens"
            assert all(r[f"{batch}/decode/tokens"] == r0[f"{batch}/decode/tokens"] for r in results)
            print(f"  B = {batch}")
            for name in ("before", "sample", "decode"):
                slowest = max(r[f"{batch}/{name}/s"] for r in results)
                best = max(r[f"{batch}/{name}/best"] for r in results)
                print(f"    {name:7s}: {r0[f'{batch}/{name}/collectives']:.0f} collectives per step, "
                      f"{slowest * 1e3:8.3f} ms per step (median; best {best * 1e3:.3f})")
            before = max(r[f"{batch}/before/s"] for r in results)
            after = max(r[f"{batch}/decode/s"] for r in results)
            print(f"    before / decode: {before / after:.2f}x faster steps (same tokens)")


if __name__ == "__main__":
    main()
