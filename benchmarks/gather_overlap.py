"""gather_output=True: chunked GEMM with async all-gathers (overlap) vs GEMM-then-gather (sequential).

    .venv/bin/python benchmarks/gather_overlap.py               # gloo, tp 4, B = 256, V = 129280
    .venv/bin/python benchmarks/gather_overlap.py --repeats 7 --bf16-hidden 4096

A split head with ``gather_output=True`` computes its ``[N, V_local]`` logits and then
all-gathers them (pad to the largest shard, trim: ``trtvocab.parallel.distributed.all_gather_columns``).
The candidate splits the local columns into ``k`` chunks and starts the all-gather of chunk
``j`` (``dist.all_gather(..., async_op=True)``) before computing chunk ``j + 1``, so that the
transfer can run behind the next GEMM. Side by side in one launch of ``tp`` gloo processes,
interleaved repetitions (the order rotates each repetition), the same weights and input:

* ``sequential``: ``x @ W.T`` over the whole shard, then ``all_gather_columns`` (the library path);
* ``overlap k``: ``k`` column chunks (boundaries on multiples of 64 columns of the largest
  shard's width, common to every rank); each chunk is padded to the chunk width where a rank
  owns fewer columns, gathered asynchronously, and copied into ``[N, V]`` at its token ids
  once its gather is done.

Per repetition the step time is the slowest rank's (every rank starts after a barrier);
printed: median and best over the repetitions, each variant's ratio to sequential, and the
median CPU time of a step summed over the ranks (``time.process_time``: gloo's threads
included). On a saturated CPU the wall time cannot drop below the CPU work / cores, so an
overlap that does not reduce the CPU work cannot win there; ``GEMM only`` (no gather) is
the floor.
Checks, before timing: every variant's ``[N, V]`` is bitwise equal to ``LMHead.forward``
(``gather_output=True``) on every rank, at the benchmark shape and at a small uneven vocab
(so the pad + trim of unequal shards is exercised), and a probe of whether a column-chunk
GEMM is bitwise equal to the same columns of the full-width GEMM, per chunk width and dtype.

Weights are random, each rank creates only its own shard. One torch thread per rank: on a
machine with fewer cores than ranks (2 cores, tp 4) the ranks oversubscribe the CPU, and
gloo's transfer thread competes with the GEMMs for the same cores; run it alone.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from _harness import add_json, recording

CHUNK_ALIGN = 64  # float32 column-chunk GEMMs were bitwise equal to the full GEMM from this width up


def chunk_bounds(width: int, chunks: int, align: int = CHUNK_ALIGN) -> list[tuple[int, int]]:
    """Split ``[0, width)`` into at most ``chunks`` pieces whose inner boundaries are multiples of ``align``."""
    units = -(-width // align)
    chunks = max(1, min(chunks, units))
    edges = [min(width, align * ((units // chunks) * j + min(units % chunks, j))) for j in range(chunks + 1)]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


def overlapped_gather_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    sizes: Sequence[int],
    starts: Sequence[int],
    rank: int,
    chunks: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``[N, V]`` logits of a column-split head: chunk ``j``'s all-gather runs while chunk ``j + 1`` is computed.

    ``weight``: this rank's ``[>= sizes[rank], H]`` rows; ``sizes`` / ``starts``: every rank's
    owned width and first token id. Equal, bit for bit, to ``x @ W.T`` followed by the
    pad-and-trim all-gather wherever a chunk GEMM is partition invariant (see the probe).
    """
    world, mine = len(sizes), sizes[rank]
    width = max(sizes)
    out = x.new_empty((x.shape[0], sum(sizes)))
    pending: list[tuple[int, int, torch.Tensor, torch.Tensor, dist.Work]] = []

    def place(a: int, b: int, buf: torch.Tensor) -> None:
        for r in range(world):
            n = min(b, sizes[r]) - a
            if n > 0:
                out[:, starts[r] + a : starts[r] + a + n] = buf[r, :, :n]

    for a, b in chunk_bounds(width, chunks):
        piece = x.new_empty((x.shape[0], b - a))
        own = min(b, mine) - a
        if own == b - a:
            torch.matmul(x, weight[a:b].t(), out=piece)
        else:  # the shorter shards' last chunk: owned columns, then zero padding (trimmed in place())
            piece.zero_()
            if own > 0:
                piece[:, :own] = x @ weight[a : a + own].t()
        buf = x.new_empty((world, x.shape[0], b - a))
        work = dist.all_gather(list(buf.unbind(0)), piece, group=group, async_op=True)
        pending.append((a, b, buf, piece, work))
        # Place the chunks whose gather already finished, without waiting for any.
        while len(pending) > 1 and pending[0][4].is_completed():
            a0, b0, buf0, _, work0 = pending.pop(0)
            work0.wait()
            place(a0, b0, buf0)
    for a, b, buf, _, work in pending:
        work.wait()
        place(a, b, buf)
    return out


def _make_head(vocab: int, hidden: int, dtype: torch.dtype, rank: int, world: int):
    from trtvocab import LMHead, Mapping

    head = LMHead(vocab, hidden, dtype=dtype, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    gen = torch.Generator().manual_seed(1000 + rank)
    shard = (torch.randn(head.local_vocab_size, hidden, generator=gen) * 0.02).to(dtype)  # this rank's rows only
    head.load_weights({"weight": shard})
    del shard
    return head


def _variants(head, chunk_counts: Sequence[int]):
    from trtvocab.parallel import distributed as D

    sizes = [s.size for s in head.shards]
    starts = [s.start for s in head.shards]
    rank = head.mapping.tp_rank
    weight = head.weights.weight

    def sequential(x: torch.Tensor) -> torch.Tensor:
        return D.all_gather_columns(x @ weight[: sizes[rank]].t(), sizes, None)

    out = {"sequential": sequential}
    for k in chunk_counts:
        out[f"overlap {k}"] = lambda x, k=k: overlapped_gather_logits(x, weight, sizes, starts, rank, k)
    return out


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def _check(head, x: torch.Tensor, chunk_counts: Sequence[int]) -> dict[str, bool]:
    reference = head(x)  # LMHead.forward, gather_output=True
    return {name: _bitwise_equal(fn(x), reference) for name, fn in _variants(head, chunk_counts).items()}


def _rank(rank: int, world: int, cfg: dict) -> dict:
    torch.set_num_threads(1)
    chunk_counts = cfg["chunks"]
    out: dict = {"threads": torch.get_num_threads(), "checks": {}, "times": {}, "cpu": {}}
    # Uneven shards (pad + trim) at a small shape, both dtypes, including more chunks than 64-column units.
    for dtype in (torch.float32, torch.bfloat16):
        small = _make_head(cfg["small_vocab"], 256, dtype, rank, world)
        x = (torch.randn(17, 256, generator=torch.Generator().manual_seed(7)) * 0.5).to(dtype)
        out["checks"][f"V={cfg['small_vocab']} H=256 {dtype}"] = _check(small, x, [*chunk_counts, 3, 100])
    for dtype, hidden in ((torch.float32, cfg["hidden"]), (torch.bfloat16, cfg["bf16_hidden"])):
        head = _make_head(cfg["vocab"], hidden, dtype, rank, world)
        x = torch.randn(cfg["batch"], hidden, generator=torch.Generator().manual_seed(7)).to(dtype)
        label = f"{str(dtype).removeprefix('torch.')} H={hidden}"
        out["checks"][f"V={cfg['vocab']} {label}"] = _check(head, x, chunk_counts)  # also the warm-up
        variants = _variants(head, chunk_counts)
        weight, size = head.weights.weight, head.local_vocab_size
        variants["GEMM only"] = lambda x, w=weight, n=size: x @ w[:n].t()  # no gather: the floor
        names = list(variants)
        times: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(cfg["repeats"]):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()  # process: gloo's threads too
                variants[name](x)
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - cpu_start)
        out["times"][label] = times
        out["cpu"][label] = cpu
        del head, variants
    return out


def _probe(hidden: int, bf16_hidden: int, batch: int) -> list[str]:
    """Is ``x @ W[a:a+w].T`` bitwise equal to ``(x @ W.T)[:, a:a+w]``? One thread, as in the ranks."""
    torch.set_num_threads(1)
    lines = []
    for dtype, h in ((torch.float32, hidden), (torch.bfloat16, bf16_hidden)):
        gen = torch.Generator().manual_seed(3)
        w = torch.randn(4096, h, generator=gen).to(dtype)
        x = torch.randn(batch, h, generator=gen).to(dtype)
        full = x @ w.t()
        verdicts = []
        for width in (1, 8, 16, 32, 48, 63, 64, 65, 128, 1000, 2048):
            same = all(_bitwise_equal(x @ w[a : a + width].t(), full[:, a : a + width].contiguous())
                       for a in (0, 64, 1))
            verdicts.append(f"{width}:{'=' if same else 'DIFF'}")
        lines.append(f"  {str(dtype).removeprefix('torch.'):8s} H={h}: " + " ".join(verdicts))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--hidden", type=int, default=4096, help="float32 head")
    parser.add_argument("--bf16-hidden", type=int, default=1024,
                        help="bf16 head (4096 takes ~14 s per forward on 2 Zen 3 cores without native bf16)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small-vocab", type=int, default=1003, help="uneven vocab of the pad + trim check")
    add_json(parser)
    args = parser.parse_args()
    with recording("gather_overlap", args):

        from trtvocab.parallel.launch import run_ranks

        print("column-chunk GEMM vs the same columns of the full GEMM (chunk width: = bitwise equal, offsets 0/64/1):")
        for line in _probe(args.hidden, args.bf16_hidden, args.batch):
            print(line)
        cfg = {"vocab": args.vocab, "hidden": args.hidden, "bf16_hidden": args.bf16_hidden, "batch": args.batch,
               "chunks": args.chunks, "repeats": args.repeats, "small_vocab": args.small_vocab}
        load_before = os.getloadavg()[0]
        results = run_ranks(_rank, args.tp, cfg, backend="gloo", timeout_s=1800)
        load_after = os.getloadavg()[0]
        print(f"gloo, tp {args.tp}, B = {args.batch}, V = {args.vocab}, {results[0]['threads']} torch thread per rank "
              f"on {os.cpu_count()} cores, {args.repeats} interleaved repetitions "
              f"(1-min load average {load_before:.1f} before, {load_after:.1f} after: other jobs swing the timings)")
        print("bitwise equal to LMHead.forward (gather_output=True) on every rank:")
        for what in results[0]["checks"]:
            verdict = {name: all(res["checks"][what][name] for res in results) for name in results[0]["checks"][what]}
            print(f"  {what:28s} " + "  ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in verdict.items()))
        for label, times in results[0]["times"].items():
            names = list(times)
            steps = {n: [max(res["times"][label][n][i] for res in results) for i in range(args.repeats)] for n in names}
            work = {n: statistics.median([sum(res["cpu"][label][n][i] for res in results) for i in range(args.repeats)])
                    for n in names}
            med = {n: statistics.median(s) for n, s in steps.items()}
            best = {n: min(s) for n, s in steps.items()}
            gather = best["sequential"] - best["GEMM only"]
            print(f"{label}: step = slowest rank, ms (the gather's share of the best sequential step: "
                  f"{gather * 1e3:.1f} ms, {gather / best['sequential']:.1%}; the most any overlap can save)")
            print(f"  {'variant':12s} {'median':>9s} {'best':>9s} {'median/seq':>11s} {'best/seq':>9s} "
                  f"{'CPU ms, all ranks':>18s} {'CPU/seq':>8s}")
            for n in names:
                print(f"  {n:12s} {med[n] * 1e3:9.1f} {best[n] * 1e3:9.1f} {med[n] / med['sequential']:10.3f}x "
                      f"{best[n] / best['sequential']:8.3f}x {work[n] * 1e3:18.1f} "
                      f"{work[n] / work['sequential']:7.3f}x")


if __name__ == "__main__":
    main()
