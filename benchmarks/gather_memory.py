"""Peak transient memory of each gather mode of a split head (``LMHead(gather_output=..., gather_chunk_rows=...)``).

    .venv/bin/python benchmarks/gather_memory.py                  # gloo, tp 2, N = 1024, V = 262144 (Gemma 3)
    .venv/bin/python benchmarks/gather_memory.py --tp 3 --dtype float32 --chunks 16 256

Each rank runs ``LMHead.forward`` of a bf16 head (H = 16: the GEMM is not what is measured) on
``[N, H]`` rows, once per mode, in one launch of ``tp`` gloo processes. Per call, on every rank: the
RSS high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the call) minus
the RSS before it is the call's peak; minus what the call returns (the ``[N, V]`` logits on a rank
that receives them) and the ``[N, V_local]`` local logits the GEMM writes is the **transient**: what
the gather itself held at its peak (its padded send copy, the received pieces, gloo's own flat
buffer). glibc is told to map every allocation above 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so freed
buffers leave the process and each call's peak is its own. Printed per mode: the slowest rank's
time, the largest rank's transient, and the formula's bound ``(tp + 1) * R * w * bytes`` (R rows a
gather, w the widest shard; R = N unchunked) beside gloo's flat receive buffer ``tp * R * w * bytes``.
Before measuring, every mode's logits are checked bitwise against ``gather_output=True`` unchunked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from typing import Any

import torch

HIDDEN = 16


def _hwm() -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(r"VmHWM:\s+(\d+)", fh.read()).group(1)) * 1024


def _rss() -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(r"VmRSS:\s+(\d+)", fh.read()).group(1)) * 1024


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _rank(rank: int, world: int, vocab: int, rows: int, dtype_name: str, modes: list[tuple[Any, Any]]) -> list[dict]:
    import torch.distributed as dist

    from trtvocab import LMHead, Mapping

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    heads = []
    for mode, chunk in modes:
        head = LMHead(vocab, HIDDEN, dtype=dtype, mapping=mapping, gather_output=mode, gather_chunk_rows=chunk)
        gen = torch.Generator().manual_seed(1)  # every rank the same [V, H]; the head keeps its rows
        head.load_weights({"weight": torch.randn(vocab, HIDDEN, generator=gen).to(dtype)})
        heads.append(head)
    reference = heads[0](x)  # modes[0] is (True, None)
    local_bytes = rows * heads[0].local_vocab_size * torch.finfo(dtype).bits // 8
    out = []
    for (mode, chunk), head in zip(modes, heads, strict=True):
        y = head(x)  # agreed (the next call is steady) and checked
        same = (y is None) if (mode == "rank0" and rank != 0) else bool(
            torch.equal(y, reference if mode is not False else reference[:, head.vocab_start: head.vocab_end]))
        del y
        dist.barrier()
        before = _rss()
        _reset_hwm()
        start = time.perf_counter()
        y = head(x)
        seconds = time.perf_counter() - start
        peak = _hwm() - before
        returned = 0 if y is None else y.numel() * y.element_size()
        del y
        dist.barrier()
        out.append({"mode": mode, "chunk": chunk, "same": same, "seconds": seconds, "peak": peak,
                    "returned": returned, "local": local_bytes,
                    "transient": peak - returned - (local_bytes if mode is not False else 0),
                    "width": max(s.width for s in head.shards)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 64, 16])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)  # the ranks inherit it: freed buffers are unmapped
    from trtvocab.parallel.launch import run_ranks

    modes: list[tuple[Any, Any]] = [(True, None), *((True, c) for c in args.chunks), ("rank0", None),
                                    *(("rank0", c) for c in args.chunks), (False, None)]
    per_rank = run_ranks(_rank, args.tp, args.vocab, args.rows, args.dtype, modes, backend="gloo", timeout_s=300)
    size = torch.finfo(getattr(torch, args.dtype)).bits // 8
    rows = []
    for i, (mode, chunk) in enumerate(modes):
        recs = [r[i] for r in per_rank]
        r_rows = args.rows if chunk is None else min(chunk, args.rows)
        w = recs[0]["width"]
        rows.append({"mode": mode, "chunk_rows": chunk, "bitwise_same": all(r["same"] for r in recs),
                     "ms": 1e3 * max(r["seconds"] for r in recs),
                     "transient_bytes": max(r["transient"] for r in recs),
                     "transient_per_rank": [r["transient"] for r in recs],
                     "returned_bytes": [r["returned"] for r in recs],
                     "bound_bytes": 0 if mode is False else (args.tp + 1) * r_rows * w * size,
                     "gloo_flat_bytes": 0 if mode is False else args.tp * r_rows * w * size})
    if args.json:
        print(json.dumps({"tp": args.tp, "vocab": args.vocab, "rows": args.rows, "dtype": args.dtype,
                          "modes": rows}, indent=2))
        return
    mib = 2**20
    print(f"tp {args.tp}, N = {args.rows}, V = {args.vocab}, {args.dtype} logits ([N, V] = "
          f"{args.rows * args.vocab * size / mib:.0f} MiB, local [N, V/tp] = "
          f"{args.rows * args.vocab * size / args.tp / mib:.0f} MiB)")
    print(f"{'gather_output':>13} {'chunk':>6} {'bitwise':>7} {'ms':>8} {'transient MiB':>13} "
          f"{'(tp+1)Rw MiB':>12} {'gloo tpRw MiB':>13}")
    for r in rows:
        print(f"{r['mode']!r:>13} {r['chunk_rows']!s:>6} {r['bitwise_same']!s:>7} {r['ms']:8.1f} "
              f"{r['transient_bytes'] / mib:13.1f} {r['bound_bytes'] / mib:12.1f} {r['gloo_flat_bytes'] / mib:13.1f}")


if __name__ == "__main__":
    main()
