"""Seeded sampling on the shards vs all-gather-then-sample: bytes that cross ranks, time per step.

    .venv/bin/python benchmarks/sampling.py                 # V = 129280, B = 256, tp 4 (gloo)
    .venv/bin/python benchmarks/sampling.py --vocab 49152 --batch 64

Side by side in one launch, the same local logits on every rank, median of ``--repeats``:

* ``trtvocab.sampling.sample``: temperature + top-k 50 + top-p 0.9 + the Gumbel race; what
  crosses is the handshake row, the merged top-k candidates, the nucleus's sums and one
  ``(score, id)`` pair per row and rank;
* ``gather``: ``all_gather`` of the ``[B, V_local]`` float32 logits into ``[B, V]`` (what vLLM,
  SGLang and TensorRT-LLM do before drawing), then the same filters and draw on one device.

Bytes are counted at the collectives (every tensor handed to all_gather / all_reduce, as
each rank contributes it). The ideal byte ratio per row is about ``V / (2 tp)`` for greedy;
top-k and top-p move ``O(k)`` more per row. Run it alone: timings on 2 cores swing with
any parallel job.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _harness import add_json, recording


def _count_bytes(counter: list[int]) -> Any:
    real_gather, real_reduce = dist.all_gather, dist.all_reduce

    def gather(out: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter[0] += tensor.numel() * tensor.element_size()
        return real_gather(out, tensor, *args, **kwargs)

    def reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter[0] += tensor.numel() * tensor.element_size()
        return real_reduce(tensor, *args, **kwargs)

    dist.all_gather, dist.all_reduce = gather, reduce
    return real_gather, real_reduce


def _rank(rank: int, world: int, vocab: int, batch: int, repeats: int) -> dict[str, float]:
    from trtvocab import LMHead, Mapping
    from trtvocab.parallel import distributed as D
    from trtvocab.sampling import SamplingParams, sample

    head = LMHead(vocab, 8, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    full_head = LMHead(vocab, 8, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    gathered = torch.randn(batch, vocab, generator=gen) * 3
    local = gathered[:, head.vocab_start : head.vocab_end].contiguous()
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(batch)]
    counter = [0]
    real = _count_bytes(counter)
    out: dict[str, float] = {}
    try:
        for name in ("sample", "gather"):
            def step(name: str = name) -> torch.Tensor:
                if name == "sample":
                    return sample(local, head, params, step=1)
                full = D.all_gather_columns(local, [s.size for s in head.shards], None)
                return sample(full, full_head, params, step=1)

            ids = step()  # warm-up; also the result both must agree on
            counter[0] = 0
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            out[f"{name}_s"] = statistics.median(times)
            out[f"{name}_bytes"] = counter[0] / repeats
            out[f"{name}_ids"] = float(ids.sum())
    finally:
        dist.all_gather, dist.all_reduce = real
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    add_json(parser)
    args = parser.parse_args()
    with recording("sampling", args):

        from trtvocab.parallel.launch import run_ranks

        results = run_ranks(_rank, args.tp, args.vocab, args.batch, args.repeats, backend="gloo", timeout_s=600)
        r = {k: max(res[k] for res in results) for k in results[0]}
        assert r["sample_ids"] == r["gather_ids"], "the two paths drew different tokens"
        print(f"seeded sampling (T 0.8, top-k 50, top-p 0.9), gloo, tp {args.tp}, V = {args.vocab}, B = {args.batch}")
        for name in ("sample", "gather"):
            print(f"  {name:7s}: {r[f'{name}_bytes'] / 1e6:9.3f} MB into collectives per rank per step, "
                  f"{r[f'{name}_s'] * 1e3:8.2f} ms per step")
        print(f"  gather / sample: bytes {r['gather_bytes'] / r['sample_bytes']:.0f}x, "
              f"time {r['gather_s'] / r['sample_s']:.2f}x (same tokens drawn; ideal byte ratio per row "
              f"~ V / (2 tp) = {args.vocab / (2 * args.tp):.0f} for greedy)")


if __name__ == "__main__":
    main()
