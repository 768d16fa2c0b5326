"""The llama.cpp side of ``benchmarks/perplexity_anchor.py``: run by the interpreter of a venv that holds
llama.cpp's Python binding (``llama-cpp-python``), never imported by trtvocab.

    ../llamacpp-venv/bin/python benchmarks/llamacpp_peer.py '{"model": FILE.gguf, "text_file": TXT,
        "n_ctx": 512, "chunks": null, "threads": 2, "flash_attn": true, "logits_dir": null}'

Tokenizes the text the way ``llama-perplexity`` does (the whole file at once, the vocabulary's own BOS
rule) and scores it in its windows (``common.windows``), one chunk per decode with every position's
logits kept. Prints one JSON line: the binding's version, llama.cpp's system info, the BOS rule, every
token id of the text, the chunk count, the negative log-likelihood of every scored token (float64,
from llama.cpp's float32 logits) and the seconds the decodes took. With ``logits_dir`` it also writes
each chunk's scored rows of float32 logits there as ``chunk<i>.npy`` (``[n_ctx - 1 - n_ctx // 2, V]``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from _harness import environment
from common import windows


def row_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``logsumexp(row) - row[target]`` per row, in float64 (rows of 32 at a time)."""
    out = np.empty(len(targets), dtype=np.float64)
    for lo in range(0, len(targets), 32):
        x = logits[lo:lo + 32].astype(np.float64)
        top = x.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))
        out[lo:lo + 32] = lse - x[np.arange(len(x)), targets[lo:lo + 32]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="the job: one JSON object (above)")
    parser.add_argument("--json", action="store_true",
                        help="add the revision and the CPU (_harness.environment) to the one JSON line it prints")
    args = parser.parse_args()
    job = json.loads(args.job)
    import llama_cpp
    from llama_cpp import Llama

    n_ctx = int(job["n_ctx"])
    llm = Llama(model_path=job["model"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=int(job["threads"]), n_threads_batch=int(job["threads"]),
                flash_attn=bool(job.get("flash_attn", True)), verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    bos = int(llama_cpp.llama_vocab_bos(vocab))
    with open(job["text_file"], "rb") as fh:
        text = fh.read()
    # common_tokenize(ctx, text, add_special=true, parse_special=false), as llama-perplexity calls it
    ids = llm.tokenize(text, add_bos=True, special=False)
    n_chunk, first = windows(len(ids), n_ctx, job.get("chunks"))
    if n_chunk < 1 or len(ids) < 2 * n_ctx:
        raise SystemExit(f"the text tokenizes to {len(ids)} ids; llama-perplexity needs at least 2 * n_ctx = "
                         f"{2 * n_ctx}")
    logits_dir = job.get("logits_dir")
    nll: list[float] = []
    seconds = 0.0
    for i in range(n_chunk):
        chunk = list(ids[i * n_ctx:(i + 1) * n_ctx])
        if add_bos:
            chunk[0] = bos
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(chunk)
        seconds += time.perf_counter() - t0
        scored = np.array(llm.scores[first:n_ctx - 1], dtype=np.float32)  # a copy: the next eval overwrites
        targets = np.array(chunk[first + 1:n_ctx], dtype=np.int64)
        nll.extend(row_nll(scored, targets).tolist())
        if logits_dir:
            path = os.path.join(logits_dir, f"chunk{i}.npy")
            np.save(path + ".tmp.npy", scored)
            os.replace(path + ".tmp.npy", path)
    print(json.dumps({**(environment() if args.json else {}),
                      "version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode(),
                      "add_bos": add_bos, "bos": bos, "n_vocab": int(llm.n_vocab()), "token_ids": list(ids),
                      "n_ctx": n_ctx, "n_chunk": n_chunk, "first": first, "nll": nll, "seconds": seconds,
                      "threads": int(job["threads"]), "flash_attn": bool(job.get("flash_attn", True))}),
          flush=True)


if __name__ == "__main__":
    main()
