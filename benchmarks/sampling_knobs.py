"""One decode step (head GEMM + sampler) with and without each serving knob: the step time each adds.

    .venv/bin/python benchmarks/sampling_knobs.py                  # tp 1 and 4 (gloo), V 49152, H 576, B 1 and 64
    .venv/bin/python benchmarks/sampling_knobs.py --tp 1 --batch 1 --steps 5

Per (tp, B): ``sampling.decode_output(x, head, params, state=...)`` with plain seeded sampling
(T 0.8) and then with one knob added (repetition / presence / frequency penalties with a 64-token
history, a 32-entry logit bias, a 1024-id allowed list, bad words, min tokens with stop ids, typical-p,
top-5 logprobs, prompt logprobs of the B rows, and a beam-search step: the head's logits then
``beam.beam_candidates`` of width 4, or 1 at B = 1): the median step time of each, side by side, and
the knob's cost as a ratio of plain's. (``n`` parallel samples are ``n`` times the rows, each its own
seed stream: the plain step at ``n * B`` rows; stop strings and ``ignore_eos`` cost nothing per step.) Each rank
runs one torch thread; steps interleave the variants so that a busy machine slows all alike. Run it
alone: on 2 cores any parallel job makes timings swing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _harness import add_json, recording

KNOBS: dict[str, dict[str, Any]] = {
    "plain": {},
    "penalties": {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {i * 97: 1.0 for i in range(32)}},
    "allowed_ids": {},  # 1024 ids spread over the vocab (set per run: it depends on --vocab)
    "bad_words": {"bad_words": [[5, 6], [7], [8, 9, 10]]},
    "min_tokens": {"min_tokens": 1000, "stop_token_ids": [2, 3]},
    "typical_p": {"typical_p": 0.9},
    "logprobs": {"logprobs": 5},
}

EXTRA = ("prompt_logprobs", "beam")  # not SamplingParams of a decode step: timed on their own calls


def _rank(rank: int, world: int, vocab: int, hidden: int, batches: list[int], steps: int) -> dict[str, Any]:
    from trtvocab import LMHead, Mapping
    from trtvocab.sampling import SamplingParams, TokenState, chunked, decode_output
    from trtvocab.sampling.beam import beam_candidates

    torch.set_num_threads(1)
    mapping = Mapping(world_size=world, rank=rank, tp_size=world) if world > 1 else None
    head = LMHead(vocab, hidden, dtype=torch.float32, mapping=mapping, gather_output=False)
    with torch.no_grad():
        head.weights.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        history = torch.randint(0, vocab, (batch, 64), generator=gen).tolist()
        state = TokenState.for_head(head, history, eos_token_ids=[1])
        knobs = {**KNOBS, "allowed_ids": {"allowed_token_ids": list(range(0, vocab, max(1, vocab // 1024)))}}
        params = {k: [SamplingParams(temperature=0.8, seed=i, **v) for i in range(batch)] for k, v in knobs.items()}
        times: dict[str, list[float]] = {k: [] for k in [*KNOBS, *EXTRA]}
        width = 4 if batch % 4 == 0 else 1
        beam_scores = torch.zeros(batch)
        for step in range(steps + 1):  # step 0: warm-up
            x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(step))
            for name in times:
                start = time.perf_counter()
                if name == "prompt_logprobs":
                    chunked.stream_prompt_logprobs(x, head, torch.zeros(batch, dtype=torch.int64), 5)
                elif name == "beam":
                    beam_candidates(head.local_logits(x), head, beam_scores, width)
                else:
                    decode_output(x, head, params[name], step=step, state=state)
                if step:
                    times[name].append(time.perf_counter() - start)
        for name, ts in times.items():
            out[f"{batch}/{name}"] = statistics.median(ts)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=20)
    add_json(parser)
    args = parser.parse_args()
    with recording("sampling_knobs", args):

        from trtvocab.parallel.launch import run_ranks

        print(f"decode step with each knob (head GEMM + sampler, T 0.8), V = {args.vocab}, H = {args.hidden}, "
              f"float32, {args.steps} steps, 1 torch thread per rank; ms per step (median), x plain")
        for tp in args.tp:
            results = run_ranks(_rank, tp, args.vocab, args.hidden, args.batch, args.steps, backend="gloo",
                                timeout_s=900) if tp > 1 else \
                [_rank(0, 1, args.vocab, args.hidden, args.batch, args.steps)]
            for batch in args.batch:
                plain = max(r[f"{batch}/plain"] for r in results)
                cells = []
                for name in [*KNOBS, *EXTRA]:
                    t = max(r[f"{batch}/{name}"] for r in results)
                    cells.append(f"{name} {t * 1e3:.2f}" + ("" if name == "plain" else f" ({t / plain:.2f}x)"))
                print(f"  tp {tp}, B = {batch}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
