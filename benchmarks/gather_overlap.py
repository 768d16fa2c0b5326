"""gather_output=True: LMHead.forward with overlap_chunks=k (column chunks, each chunk's all-gather running
while the next chunk's GEMM is computed) against overlap_chunks=1 (the GEMM, then one all-gather).

    .venv/bin/python benchmarks/gather_overlap.py                       # SmolLM2 and Gemma 3, tp 2-4, B 1-256
    .venv/bin/python benchmarks/gather_overlap.py --models gemma3 --tp 2 --batch 256 --repeats 7

Each model's real head, loaded as ``generate`` loads it (``LMHead.from_checkpoint``: float32, a GGUF head in
its stored blocks), split over ``tp`` gloo ranks on this machine, once per chunk count (the same shard).
For every batch B, side by side in one launch, interleaved repetitions (the order rotates each
repetition, every call starts after a barrier):

* ``k=1``: the GEMM over the whole shard, then the pad-and-trim all-gather (the path without overlap);
* ``k=2 / 4 / 8``: ``LMHead(overlap_chunks=k)``: chunks cut on the weight format's GEMM tiles;
* ``default``: ``LMHead()`` (``overlap_chunks=None``: the chunk count ``default_overlap_chunks`` picks, printed);
* ``GEMM``: ``local_logits`` alone (no gather): the floor, and with ``k=1`` the GEMM-to-gather ratio
  (the article's rule of thumb: overlap pays when the gather is a large share of the step and each chunk's
  GEMM is long enough to hide the previous chunk's transfer).

A step's time is the slowest rank's. Printed per model and tp: the median and best ``k=1`` step, its gather
share, and each k's median and best time over ``k=1``. Before timing, every k's logits are checked bitwise
equal to ``k=1``'s on every rank (steady calls: the handshake's verdict riding on the first chunk).
Torch threads per rank: the cores over the ranks (at least one); with more ranks than cores the ranks and
gloo's transfer threads share the cores, which is what a CPU run of ``generate --tp`` does too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _harness import add_json, add_row, recording
from common import model_file


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from trtvocab import LMHead, Mapping

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)
    heads = {k: LMHead.from_checkpoint(cfg["path"], mapping=mapping, dtype=torch.float32, overlap_chunks=k)
             for k in (1, *cfg["chunks"])}
    default = LMHead.from_checkpoint(cfg["path"], mapping=mapping, dtype=torch.float32)  # overlap_chunks=None
    base = heads[1]
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "label": base.label, "vocab": base.vocab_size,
                           "hidden": base.hidden_size, "checks": {}, "times": {}}
    for batch in cfg["batch"]:
        x = torch.randn(batch, base.hidden_size, generator=torch.Generator().manual_seed(batch))
        ref = [base(x), base(x)]  # the first call's handshake, then a steady one
        out["checks"][batch] = {k: all(torch.equal(h(x).view(torch.int32), r.view(torch.int32)) for r in ref)
                                for k, h in heads.items()}
        variants = {f"k={k}": (lambda h=h, x=x: h(x)) for k, h in heads.items()}
        out.setdefault("default k", {})[batch] = default.overlap_for(batch)
        if default.overlap_for(batch) > 1:  # otherwise it is the k=1 path itself (printed as such)
            variants["default"] = lambda x=x: default(x)
        variants["GEMM"] = lambda x=x: base.local_logits(x)
        names = list(variants)
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(cfg["repeats"]):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                dist.barrier()
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)
        out["times"][batch] = times
    dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], help="smollm2 | gemma3 | a .gguf")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    add_json(parser)
    args = parser.parse_args()
    with recording("gather_overlap", args):
        from trtvocab.parallel.launch import run_ranks

        for model in args.models:
            path = str(model_file(model))
            for tp in args.tp:
                cfg = {"path": path, "chunks": args.chunks, "batch": args.batch, "repeats": args.repeats}
                load = os.getloadavg()[0]
                results = run_ranks(_rank, tp, cfg, backend="gloo", timeout_s=1800)
                r0 = results[0]
                print(f"{model} ({r0['label']}, V = {r0['vocab']}, H = {r0['hidden']}), gloo tp {tp}, "
                      f"{r0['threads']} torch thread(s) per rank on {os.cpu_count()} cores, {args.repeats} interleaved "
                      f"repetitions, 1-min load {load:.1f} before / {os.getloadavg()[0]:.1f} after")
                ks = [*(f"k={k}" for k in args.chunks), "default"]
                print(f"  {'B':>4s} {'k=1 med':>9s} {'best':>8s} {'gather':>7s} "
                      + " ".join(f"{k + ' med/1':>11s} {'best/1':>7s}" for k in ks) + "  default k  bitwise")
                for batch in args.batch:
                    names = list(r0["times"][batch])
                    steps = {n: [max(res["times"][batch][n][i] for res in results) for i in range(args.repeats)]
                             for n in names}
                    med = {n: statistics.median(s) for n, s in steps.items()}
                    best = {n: min(s) for n, s in steps.items()}
                    share = max(0.0, 1 - med["GEMM"] / med["k=1"])
                    same = all(all(res["checks"][batch].values()) for res in results)
                    print(f"  {batch:4d} {med['k=1'] * 1e3:9.2f} {best['k=1'] * 1e3:8.2f} {share:7.0%} "
                          + " ".join(f"{med[k] / med['k=1']:10.3f}x {best[k] / best['k=1']:6.3f}x" if k in med
                                     else f"{'(k=1 path)':>19s}" for k in ks)
                          + f"  {r0['default k'][batch]:9d}  {'yes' if same else 'NO'}")
                    for k in (k for k in ["k=1", *ks, "GEMM"] if k in med):
                        add_row(model=model, tp=tp, batch=batch, variant=k, median_ms=med[k] * 1e3,
                                best_ms=best[k] * 1e3, bitwise=same)


if __name__ == "__main__":
    main()
