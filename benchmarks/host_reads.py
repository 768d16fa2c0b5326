"""The decode step shaped for a GPU: host reads per steady step, and eager vs compiled CPU time.

    .venv/bin/python benchmarks/host_reads.py                      # SmolLM2's head, Q8_0 blocks, B = 4
    .venv/bin/python benchmarks/host_reads.py --tp 1 --timing-batches 1 8 64 --rounds 7

On a GPU every host read of a device value (``bool(t.any())``, ``.item()``, ``.tolist()``, ``nonzero``, a
mask's size) drains the stream and keeps the step out of a CUDA graph. Counted here with
:class:`trtvocab.base.host_reads.HostReads` (a ``TorchFunctionMode`` that sees every tensor call), per
steady step (steps 0-1 warm, 2-5 counted), for each sampler knob, at tp 1, 2, 3 (gloo ranks), side by
side in one run:

* ``decode_output``: the per-call step (its arguments validated and agreed on every call, then the same
  pipeline: ``DecodeStep.for_rows``);
* ``DecodeStep``: the prepared step (``trtvocab.sampling.DecodeStep``), read once per step by ``read()``
  (that read is counted apart: the ids, when the caller asks for them).
(docs/generate.md has the counts of the step before the prepared one, measured at its revision.)

Then the step's CPU time (seeded top-k + min-p: a knob that traces as one graph at every tp) at tp 1 (and
``--tp`` > 1 on gloo ranks), eager against ``torch.compile(fullgraph=True)``,
interleaved rounds, best and median, and the compile time of the first call. The ids of both are checked
equal first.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from _harness import add_json, add_row, interleaved, recording
from common import model_file

from trtvocab import LMHead, Mapping
from trtvocab.base.host_reads import HostReads
from trtvocab.sampling import DecodeStep, SamplingParams, TokenState, decode_output

KNOBS = {
    "greedy": SamplingParams(temperature=0.0),
    "seeded top-k + top-p": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7),
    "seeded min-p": SamplingParams(temperature=1.0, min_p=0.1, seed=3),
    "typical-p": SamplingParams(temperature=1.0, typical_p=0.9, seed=3),
    "penalties + logit bias": SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.3, frequency_penalty=0.2,
                                             presence_penalty=0.1, logit_bias={5: 3.0, 17: -2.0}),
    "greedy + logprobs 5": SamplingParams(temperature=0.0, logprobs=5),
}
TIMED = SamplingParams(temperature=0.8, top_k=40, min_p=0.05, seed=7)
STEPS, WARM = 6, 2


def _head(path: str, rank: int, world: int) -> LMHead:
    mapping = None if world == 1 else Mapping(world_size=world, rank=rank, tp_size=world)
    return LMHead.from_checkpoint(path, mapping=mapping, gather_output=False)


def _hidden(head: LMHead, rows: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(rows, head.hidden_size, generator=g) * 3).to(head.dtype)


def count_reads(rank: int, world: int, path: str, rows: int) -> dict[str, Any]:
    """Host reads of the steady steps, per knob: decode_output, DecodeStep's call and its read()."""
    torch.set_num_threads(1 if world > 1 else torch.get_num_threads())
    head = _head(path, rank, world)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8]][:rows] + [[9]] * max(0, rows - 4)
    out: dict[str, Any] = {}
    for name, p in KNOBS.items():
        params = [p] * rows
        state_ref, state = TokenState.for_head(head, prompts), TokenState.for_head(head, prompts)
        step_fn = DecodeStep(head, params, state=state)
        before, after, reads, same = [], [], [], True
        for s in range(STEPS):
            x = _hidden(head, rows, s)
            with HostReads() as a:
                ref = decode_output(x, head, params, step=s, state=state_ref)
                state_ref.append(ref.token_ids)
            with HostReads() as b:
                step_fn(x)
            with HostReads() as c:
                ids = step_fn.read()
            same &= ids == ref.token_ids.tolist() or p.seed is None
            if s >= WARM:
                before.append(a.total)
                after.append(b.total)
                reads.append(c.total)
        out[name] = {"decode_output": max(before), "DecodeStep": max(after), "read": max(reads), "same_ids": same}
    return out


def step_time(rank: int, world: int, path: str, batches: list[int], rounds: int) -> dict[str, Any]:
    """Best / median ms of an eager and a compiled step per batch, and the compile's seconds."""
    if world > 1:
        torch.set_num_threads(1)
    head = _head(path, rank, world)
    out: dict[str, Any] = {}
    for rows in batches:
        params = [TIMED] * rows
        eager, compiled_fn = DecodeStep(head, params), DecodeStep(head, params)
        compiled_fn.seed_keys = eager.seed_keys  # the same fresh seeds: the same ids
        compiled = torch.compile(compiled_fn, fullgraph=True)
        x = _hidden(head, rows, 0)
        started = time.perf_counter()
        compiled(x)
        compile_s = time.perf_counter() - started
        compiled_fn.read()
        eager(x)
        eager.read()
        same = eager(x).tolist() == compiled(x).tolist()
        timings = interleaved({"eager": lambda e=eager, x=x: e(x), "compiled": lambda c=compiled, x=x: c(x)}, rounds,
                              warmup=1)
        out[rows] = {"eager": timings["eager"].ms(), "compiled": timings["compiled"].ms(), "compile_s": compile_s,
                     "same_ids": same}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | a .gguf path")
    parser.add_argument("--rows", type=int, default=4, help="batch of the host-read count")
    parser.add_argument("--tps", type=int, nargs="+", default=[1, 2, 3], help="tp sizes of the host-read count")
    parser.add_argument("--tp", type=int, default=2, help="the split tp of the timing (1: tp 1 only)")
    parser.add_argument("--timing-batches", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--rounds", type=int, default=5)
    add_json(parser)
    args = parser.parse_args()
    with recording("host_reads", args):
        path = str(model_file(args.model))
        from trtvocab.parallel.launch import run_ranks

        counts = {tp: count_reads(0, 1, path, args.rows) if tp == 1 else
                  run_ranks(count_reads, tp, path, args.rows, timeout_s=900)[0] for tp in args.tps}
        print(f"host reads per steady step ({args.model}, B = {args.rows}; decode_output per call, DecodeStep's call, "
              "then its one read())")
        print(f"{'knob':<24}" + "".join(f"{'tp ' + str(tp) + ' per call':>16}{'prepared':>9}{'read':>6}"
                                        for tp in args.tps))
        for name in KNOBS:
            line = f"{name:<24}"
            for tp in args.tps:
                c = counts[tp][name]
                line += f"{c['decode_output']:>16}{c['DecodeStep']:>9}{c['read']:>6}"
                add_row(knob=name, tp=tp, **c)
                if not c["same_ids"]:
                    raise SystemExit(f"{name} tp {tp}: DecodeStep's ids differ from decode_output's")
            print(line)
        if args.timing_batches:
            tps = [1] + ([args.tp] if args.tp > 1 else [])
            for tp in tps:
                res = step_time(0, 1, path, args.timing_batches, args.rounds) if tp == 1 else \
                    run_ranks(step_time, tp, path, args.timing_batches, args.rounds, timeout_s=1800)[0]
                print(f"\nstep CPU time, tp {tp} (seeded top-k + min-p; ms best / median of {args.rounds} "
                      f"interleaved rounds; rank 0)")
                print(f"{'B':>4}{'eager':>16}{'compiled':>16}{'compiled/eager':>16}{'compile s':>11}")
                for rows, r in res.items():
                    e, c = r["eager"], r["compiled"]
                    print(f"{rows:>4}{e['best_ms']:>8.2f}/{e['median_ms']:<7.2f}{c['best_ms']:>8.2f}/{c['median_ms']:<7.2f}"
                          f"{c['best_ms'] / e['best_ms']:>16.2f}{r['compile_s']:>11.1f}")
                    add_row(tp=tp, rows=rows, eager_ms=e, compiled_ms=c, compile_s=r["compile_s"])
                    if not r["same_ids"]:
                        raise SystemExit(f"tp {tp} B {rows}: compiled ids differ from eager")


if __name__ == "__main__":
    main()
