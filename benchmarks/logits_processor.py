"""Last-token-only vs all-token logits: time and peak memory, measured side by side.

    .venv/bin/python benchmarks/logits_processor.py            # T=8192 B=32 V=32000 H=1024 bf16
    .venv/bin/python benchmarks/logits_processor.py --small    # T=1024 B=32 V=8000 H=512

Each mode runs in its own fresh subprocess (one after the other, so they never share
the cores), on identical seeded weights and hidden states:

* ``last``: ``LogitsProcessor()(hidden [T, H], head, seq_lens)`` -> ``[B, V]`` float32
* ``all``:  the same with ``return_context_logits=True`` -> ``[T, V]`` float32

Time: median wall time of ``--repeats`` calls (10x that for ``last``) after one warm-up
call (default allocator).
Memory: a second subprocess per mode, started with ``MALLOC_MMAP_THRESHOLD_=65536`` so
that every allocation of 64 KiB or more gets fresh pages from the kernel and gives them
back on free (no allocator cache hides a reused buffer). Its peak resident set *during
one call* minus its resident set just before it (Linux VmHWM, reset through
/proc/self/clear_refs) is then the call's peak live memory, to page granularity: GEMM
output in the head dtype, the float32 copy, temporaries -- with the weights and hidden
states already resident and not counted.

The FLOP ratio is exactly T / B (the GEMM has T or B rows). The time ratio is smaller
on a CPU: the B-row GEMM cannot reach peak FLOP/s, it is bound by reading the V x H
weight once, while the T-row GEMM is compute bound.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from _harness import add_json, recording

FULL = {"tokens": 8192, "batch": 32, "vocab": 32000, "hidden": 1024}
SMALL = {"tokens": 1024, "batch": 32, "vocab": 8000, "hidden": 512}


def _hwm_bytes() -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(r"VmHWM:\s+(\d+)", fh.read()).group(1)) * 1024


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(r"VmRSS:\s+(\d+)", fh.read()).group(1)) * 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def worker(mode: str, tokens: int, batch: int, vocab: int, hidden: int, dtype_name: str, repeats: int) -> dict:
    import torch

    from trtvocab import LMHead, LogitsProcessor

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator().manual_seed(0)
    head = LMHead(vocab, hidden, dtype=dtype)
    head.load_weights({"weight": (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype)})
    states = torch.randn(tokens, hidden, generator=gen).to(dtype)
    if tokens % batch:
        raise SystemExit("tokens must be a multiple of batch (equal sequence lengths)")
    seq_lens = torch.full((batch,), tokens // batch)
    proc = LogitsProcessor()

    def call() -> torch.Tensor:
        return proc(states, head, seq_lens, return_context_logits=(mode == "all"))

    with torch.inference_mode():
        out = call()  # warm-up (oneDNN kernel selection, allocator)
        shape = list(out.shape)
        del out
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = call()
            times.append(time.perf_counter() - start)
            del out
        before = _rss_bytes()
        exact = _reset_hwm()
        out = call()
        peak = _hwm_bytes() - before
        out_bytes = out.numel() * out.element_size()
        del out
    return {"mode": mode, "shape": shape, "median_s": statistics.median(times), "times_s": times,
            "peak_extra_bytes": peak, "output_bytes": out_bytes, "hwm_reset": exact,
            "threads": torch.get_num_threads()}


def _run(cmd: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode:
        raise SystemExit(f"worker failed: {' '.join(cmd)}\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help=f"use {SMALL} instead of {FULL}")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of the all-token mode (last: 10x)")
    parser.add_argument("--worker", choices=["last", "all"], help=argparse.SUPPRESS)
    add_json(parser)
    args = parser.parse_args()
    with recording("logits_processor", args):
        size = dict(SMALL if args.small else FULL)
        for key in size:
            if getattr(args, key) is not None:
                size[key] = getattr(args, key)
        if args.worker:
            print(json.dumps(worker(args.worker, size["tokens"], size["batch"], size["vocab"], size["hidden"],
                                    args.dtype, args.repeats)))
            return

        print(f"LogitsProcessor benchmark: T={size['tokens']} B={size['batch']} V={size['vocab']} "
              f"H={size['hidden']} {args.dtype}, {args.repeats} (all) / {args.repeats * 10} (last) timed calls "
              "after 1 warm-up, fresh subprocesses per mode")
        results = {}
        started = time.perf_counter()
        for mode in ("last", "all"):
            def cmd(repeats: int, mode: str = mode) -> list[str]:
                return [sys.executable, __file__, "--worker", mode, "--dtype", args.dtype, f"--repeats={repeats}",
                        *[f"--{k}={v}" for k, v in size.items()]]

            # the cheap mode gets more repeats: its few milliseconds are noisier
            timed = _run(cmd(args.repeats * (10 if mode == "last" else 1)), dict(os.environ))
            # the same call in a process whose allocator takes fresh pages for every tensor
            measured = _run(cmd(1), {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)})
            results[mode] = {**timed, "peak_extra_bytes": measured["peak_extra_bytes"],
                             "hwm_reset": measured["hwm_reset"]}
        last, full = results["last"], results["all"]
        mib = 2**20
        print(f"\n{'mode':<6}{'logits':>16}{'median time':>14}{'peak extra RSS':>17}{'float32 logits':>16}")
        for r in (last, full):
            print(f"{r['mode']:<6}{r['shape']!s:>16}{r['median_s'] * 1e3:>11.1f} ms"
                  f"{r['peak_extra_bytes'] / mib:>13.1f} MiB{r['output_bytes'] / mib:>12.1f} MiB")
        ideal = size["tokens"] / size["batch"]
        print(f"\ntime ratio   all / last = {full['median_s'] / last['median_s']:.1f}x   "
              f"(ideal = FLOP ratio T/B = {ideal:.0f}x)")
        print(f"memory ratio all / last = {full['peak_extra_bytes'] / max(last['peak_extra_bytes'], 4096):.1f}x   "
              f"(float32 logits alone: {full['output_bytes'] / last['output_bytes']:.0f}x)")
        print("\nWhat is measured: wall time of LogitsProcessor.forward (row selection + head GEMM + float32 cast);"
              "\nmemory = peak RSS during one call minus RSS just before it (weights and inputs already resident),"
              "\nin a separate run with MALLOC_MMAP_THRESHOLD_=65536 (fresh pages per tensor, no allocator cache);"
              + ("\nVmHWM reset via /proc/self/clear_refs." if full["hwm_reset"]
                 else "\nVmHWM could NOT be reset: the memory numbers are over-estimates.")
              + "\nThe last-token GEMM ([B, H] x [H, V]) is bound by reading the weight once, so on a CPU its time does"
              "\nnot shrink by the full T/B; the all-token GEMM is compute bound.")
        print(f"(threads per worker: {last['threads']}; total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
