"""The vLLM side of ``benchmarks/generate.py --peer vllm``: run by vLLM's own interpreter (its venv),
never imported by trtvocab.

    ../vllm-venv/bin/python benchmarks/vllm_peer.py '{"model": DIR, "prompt_ids": [[...], ...],
        "tokens": 32, "repeats": 1, "dtype": "float32"}'

Loads ``model`` (a Hugging Face folder) in ``vllm.LLM`` with as many sequences a step as there are
prompts, runs the prompts (token ids: the tokenization trtvocab used) together, greedy
(temperature 0, EOS ends a prompt), once as a warm-up of two tokens, then ``repeats`` timed
runs of ``tokens`` new tokens. Prints one JSON line: the engine's start-up seconds, the best
run's seconds, tokens/s, the count of new tokens and the ids themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from _harness import environment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="the job: one JSON object (above)")
    parser.add_argument("--json", action="store_true",
                        help="add the revision and the CPU (_harness.environment) to the one JSON line it prints")
    args = parser.parse_args()
    job = json.loads(args.job)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for 8 x 64 positions
    from vllm import LLM, SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in job["prompt_ids"]]
    longest = max(len(ids) for ids in job["prompt_ids"])
    start = time.perf_counter()
    llm = LLM(model=job["model"], tokenizer=job["model"], dtype=job["dtype"], seed=0,
              max_model_len=max(256, longest + job["tokens"] + 8), max_num_seqs=len(prompts),
              enforce_eager=bool(job.get("eager", False)))
    startup = time.perf_counter() - start
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
    greedy = SamplingParams(temperature=0.0, max_tokens=job["tokens"])
    best, ids = float("inf"), []
    for _ in range(max(1, job["repeats"])):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
        ids = [list(o.outputs[0].token_ids) for o in outs]
    count = sum(len(r) for r in ids)
    print(json.dumps({**(environment() if args.json else {}),
                      "startup_s": startup, "seconds": best, "tokens": count, "tokens_per_s": count / best,
                      "token_ids": ids, "dtype": str(llm.llm_engine.model_config.dtype)}), flush=True)


if __name__ == "__main__":
    main()
