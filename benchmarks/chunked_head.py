"""Vocab-chunked head (trtvocab.sampling.chunked) against the materialized path, side by side.

    python benchmarks/chunked_head.py            # B=1024, V=129280, H=1024, bf16, tp 1
    python benchmarks/chunked_head.py --small    # B=256, V=32768, H=512: a quick run

For greedy, top-k, logsumexp, logprobs (4 ids per row; one pass, bitwise) and seeded sample (top-k 50; top-p 0.9),
each path runs in a fresh subprocess that reports its peak extra RSS (VmHWM reset through
/proc/self/clear_refs, minus the RSS before the call) and its best-of-N time; the ratios
chunked / materialized are printed in one table. bf16 GEMMs are slow on CPUs without native
bf16 (the full shape takes minutes per call there): use --small for a quick look.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _harness import add_json, recording

CHILD = """
import json, re, sys, time, torch
from trtvocab import LMHead, sampling
from trtvocab.sampling import SamplingParams, chunked

def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
B, V, H, op, mode, rounds, budget = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                     sys.argv[5], int(sys.argv[6]), int(sys.argv[7]))
head = LMHead(V, H, dtype=torch.bfloat16, logits_budget_bytes=budget)
with torch.no_grad():
    head.weights.weight.uniform_(-0.04, 0.04, generator=torch.Generator().manual_seed(0))
x = torch.randn(B, H, generator=torch.Generator().manual_seed(1))
# "sample top-p": peaked logits (std ~ 4, as an LM's: the nucleus is a few dozen tokens);
# "sample top-p flat": the other ops' flat logits (std ~ 0.5: the nucleus is most of the vocab).
x = (x * 8 if op == "sample top-p" else x).bfloat16()
params = SamplingParams(temperature=0.8, top_k=50, seed=3)
nucleus = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
ids = torch.randint(0, V, (B, 4), generator=torch.Generator().manual_seed(2))
def call(x):
    if mode == "materialized":
        local = head.local_logits(x)
        f = {"greedy": lambda: sampling.greedy(local, head), "topk": lambda: sampling.topk(local, head, 50),
             "logsumexp": lambda: sampling.logsumexp(local, head),
             "logprobs": lambda: sampling.logprobs(local, head, ids[: x.shape[0]]),
             "sample": lambda: sampling.sample(local, head, params),
             "sample top-p": lambda: sampling.sample(local, head, nucleus),
             "sample top-p flat": lambda: sampling.sample(local, head, nucleus)}[op]
        return f()
    return {"greedy": lambda: chunked.stream_greedy(x, head), "topk": lambda: chunked.stream_topk(x, head, 50),
            "logsumexp": lambda: chunked.stream_logsumexp(x, head),
            "logprobs": lambda: chunked.stream_logprobs(x, head, ids[: x.shape[0]]),
            "sample": lambda: chunked.stream_sample(x, head, params),
            "sample top-p": lambda: chunked.stream_sample(x, head, nucleus),
            "sample top-p flat": lambda: chunked.stream_sample(x, head, nucleus)}[op]()
call(x[:2])
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
times = []
for _ in range(rounds):
    t = time.perf_counter(); call(x); times.append(time.perf_counter() - t)
print(json.dumps({"peak": status("VmHWM") - base, "time": min(times)}))
"""


def run(args: argparse.Namespace, op: str, mode: str) -> dict:
    cmd = [sys.executable, "-c", CHILD, str(args.batch), str(args.vocab), str(args.hidden), op, mode,
           str(args.rounds), str(args.budget)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="B=256, V=32768, H=512")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ops", default="greedy,topk,logsumexp,logprobs,sample,sample top-p,sample top-p flat")
    parser.add_argument("--budget-fraction", type=float, default=1 / 16,
                        help="the head's logits budget as a fraction of the float32 [B, V] logits")
    add_json(parser)
    args = parser.parse_args()
    with recording("chunked_head", args):
        args.batch = args.batch or (256 if args.small else 1024)
        args.vocab = args.vocab or (32768 if args.small else 129280)
        args.hidden = args.hidden or (512 if args.small else 1024)
        logits = args.batch * args.vocab * 4
        args.budget = max(1 << 20, int(logits * args.budget_fraction))  # a chunk's float32 logits
        print(f"B={args.batch} V={args.vocab} H={args.hidden} bf16 tp 1; float32 logits {logits / 2**20:.0f} MiB, "
              f"budget {args.budget / 2**20:.1f} MiB; best of {args.rounds}")
        print(f"{'op':18} {'mat. peak MiB':>14} {'chunk peak MiB':>15} {'peak ratio':>11} {'mat. s':>8} {'chunk s':>8} "
              f"{'time ratio':>11}")
        for op in args.ops.split(","):
            m, c = run(args, op, "materialized"), run(args, op, "chunked")
            print(f"{op:18} {m['peak'] / 2**20:14.1f} {c['peak'] / 2**20:15.1f} {c['peak'] / max(1, m['peak']):11.3f} "
                  f"{m['time']:8.3f} {c['time']:8.3f} {c['time'] / m['time']:11.2f}", flush=True)


if __name__ == "__main__":
    main()
