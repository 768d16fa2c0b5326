"""The llama.cpp perplexity anchor: the same GGUF file, the same text, the same token ids and the same
windows as ``llama-perplexity``, scored by llama.cpp itself and by trtvocab's head.

    .venv/bin/python benchmarks/perplexity_anchor.py --model smollm2
    .venv/bin/python benchmarks/perplexity_anchor.py --model gemma3 --json out/anchor-gemma3.json
    .venv/bin/python benchmarks/perplexity_anchor.py --model smollm2 --ctx 128 --chunks 2 --no-kl   # quick
    .venv/bin/python benchmarks/perplexity_anchor.py --model anchor_files/SmolLM2-135M-Instruct.Q4_1.embd-q4_0.gguf

A ``.gguf`` path is any GGUF file transformers loads: e.g. SmolLM2 with its tied head requantized to Q4_0 /
Q4_1 / Q5_0 by llama.cpp's own quantizer (``llama-quantize --allow-requantize --token-embedding-type q4_0
SmolLM2-135M-Instruct.Q4_1.gguf OUT.gguf Q4_1``: the head requantized, every other tensor copied as it is;
docs/accuracy.md).

**llama.cpp** runs in its own venv (``--peer-python``, ``$TRTVOCAB_LLAMACPP_PYTHON``, default
``../llamacpp-venv/bin/python``; ``python3 -m venv ../llamacpp-venv && ../llamacpp-venv/bin/pip
install llama-cpp-python==0.3.36 numpy``) as a child process, ``benchmarks/llamacpp_peer.py``: trtvocab never
imports ``llama_cpp``. The child tokenizes the text file with the GGUF's own tokenizer exactly as
``llama-perplexity`` does and returns every id, so both sides score the same ids; transformers' tokenization
of the same text is compared with them and reported (equal, or where the first difference is).

**The windows** (``tools/perplexity/perplexity.cpp``, ``perplexity()``, restated): the whole text is
tokenized once, with the BOS in front where the vocabulary asks for one (Gemma; not SmolLM2). It is cut into
``n_chunk = n_ids // n_ctx`` whole chunks of ``n_ctx`` ids (``--ctx``, default 512 as in ``llama-perplexity``;
a shorter tail is not scored; at least two chunks are needed). Each chunk is evaluated from an empty cache,
and where the vocabulary adds a BOS the chunk's first id is overwritten by BOS (not inserted: the chunk stays
``n_ctx`` long). Only the second half is scored, so that every scored token has at least ``n_ctx / 2`` tokens
of context: the logits at positions ``n_ctx / 2 .. n_ctx - 2`` against the id one position later,
``n_ctx - 1 - n_ctx / 2`` tokens a chunk. PPL is ``exp`` of the mean negative log-likelihood over every
scored token of every chunk.

**trtvocab's side**: the same chunks (BOS overwrite included) go through the GGUF's transformer body
loaded by transformers in float32 (``hf_loader.load_causal_lm``, the weights dequantized from the file);
its final-norm hidden states at the scored positions go through three float32 heads:

- ``stored``: ``LMHead.from_checkpoint(gguf)``, the head in its stored blocks (Q8_0 in SmolLM2's and Gemma 3's
  files; the JSON's ``head_format`` / ``load_notes`` say which), fused kernel, float32 activations;
- ``float32``: ``LMHead.from_checkpoint(gguf, gguf_blocks=False)``, dequantized to float32 at load;
- ``transformers``: transformers' own ``lm_head`` of the loaded model (an independent float32 reference).

llama.cpp differs from trtvocab's side in its body too: it multiplies the same quantized weights with its
activations quantized to Q8 (``Q8_0`` / ``Q8_K``) and an fp16 KV cache, where transformers keeps float32
activations. The goals: ``stored`` within 1 % of ``float32`` (ratio of PPLs), and ``stored``
no worse than llama.cpp (ratio <= 1). ``--kl`` (default on) adds the KL of each trtvocab head against
llama.cpp's distribution over the full vocabulary (``trtvocab.accuracy.stats``, llama.cpp's formulas, exact
KLD), and of ``stored`` against ``float32``; the child then writes its scored logits (``[n_ctx/2 - 1, V]``
float32 a chunk) to a temporary folder.

``--llama-perplexity BIN`` also runs llama.cpp's own ``llama-perplexity`` program (built from the same source:
``cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-perplexity``) on the file and text with
``-c n_ctx -t threads`` (its defaults otherwise: it evaluates four chunks a decode) and reports its final
estimate beside the child's: a check that the child's windows are the tool's (``--chunks`` passes ``--chunks``).

Prints one table and, with ``--json``, writes every number (and the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, recording
from common import model_file, windows  # the one statement of the windows, shared with the child

LLAMACPP_PYTHON = str(Path(__file__).resolve().parents[2] / "llamacpp-venv" / "bin" / "python")  # beside the clone
PYTHON_ENV = "TRTVOCAB_LLAMACPP_PYTHON"
DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "alice_ch1_2.txt"
HEADS = ("stored", "float32", "transformers")


def peer_python() -> str:
    return os.environ.get(PYTHON_ENV, LLAMACPP_PYTHON)


def run_llamacpp(python: str, job: dict[str, Any], timeout: int) -> dict[str, Any]:
    """``benchmarks/llamacpp_peer.py`` under llama.cpp's interpreter; its JSON line."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # llama.cpp's venv sees none of this project
    done = subprocess.run([python, str(Path(__file__).with_name("llamacpp_peer.py")), json.dumps(job)],
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"llama.cpp peer failed (exit {done.returncode}):\n{tail}")
    return json.loads(lines[-1])


def run_llama_perplexity(binary: str, path: Path, text_file: Path, n_ctx: int, chunks: int | None, threads: int,
                         timeout: int) -> dict[str, Any]:
    """llama.cpp's ``llama-perplexity`` on the same file and text: its final estimate and its ±."""
    cmd = [binary, "-m", str(path), "-f", str(text_file), "-c", str(n_ctx), "-t", str(threads)]
    if chunks is not None:
        cmd += ["--chunks", str(chunks)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"llama-perplexity failed (exit {done.returncode}):\n{tail}")
    return {"ppl": float(found.group(1)), "ppl_pm": float(found.group(2)), "command": " ".join(cmd)}


def tokenization_check(tok: Any, text: str, ids: list[int]) -> dict[str, Any]:
    """transformers' ids of ``text`` (its special-token rule) against llama.cpp's."""
    hf = list(tok(text).input_ids)
    diff = next((i for i, (a, b) in enumerate(zip(hf, ids, strict=False)) if a != b), None)
    if diff is None and len(hf) != len(ids):
        diff = min(len(hf), len(ids))
    return {"transformers_ids": len(hf), "llamacpp_ids": len(ids), "equal": diff is None,
            "first_difference": diff,
            "around": None if diff is None else {"transformers": hf[max(0, diff - 2):diff + 3],
                                                 "llamacpp": ids[max(0, diff - 2):diff + 3]}}


def nll_rows(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    """Per-row ``logsumexp - logit[target]`` in float64."""
    out = []
    for lo in range(0, logits.shape[0], 32):
        lp = torch.log_softmax(logits[lo:lo + 32].double(), dim=-1)
        out.append(-lp.gather(-1, targets[lo:lo + 32, None]).squeeze(-1))
    return torch.cat(out).numpy()


def paired_ratio(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """``PPL(a) / PPL(b)`` on the same tokens and llama.cpp's ± of it (one standard error of the mean
    per-token difference of ln p, scaled by the ratio)."""
    from trtvocab.accuracy.stats import mean_and_uncertainty

    mean, pm = mean_and_uncertainty(a - b)
    return math.exp(mean), math.exp(mean) * pm


def anchor(path: Path, text_file: Path, *, n_ctx: int, chunks: int | None, threads: int, python: str,
           kl: bool, flash_attn: bool, timeout: int, llama_perplexity: str | None = None) -> dict[str, Any]:
    from trtvocab import LMHead
    from trtvocab.accuracy.stats import TokenRows, llamacpp_stats, mean_and_uncertainty, token_rows
    from trtvocab.checkpoints.hf_loader import load_causal_lm

    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    text = text_file.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="llamacpp-anchor.") as work:
        job = {"model": str(path), "text_file": str(text_file), "n_ctx": n_ctx, "chunks": chunks, "threads": threads,
               "flash_attn": flash_attn, "logits_dir": work if kl else None}
        t0 = time.perf_counter()
        peer = run_llamacpp(python, job, timeout)
        peer_wall = time.perf_counter() - t0
        ids = [int(i) for i in peer["token_ids"]]
        n_chunk, first = windows(len(ids), n_ctx, chunks)
        assert (n_chunk, first) == (peer["n_chunk"], peer["first"])

        tok, net = load_causal_lm(path, dtype=torch.float32)
        tokens = tokenization_check(tok, text, ids)
        body = net.base_model
        heads = {"stored": LMHead.from_checkpoint(path, dtype=torch.float32),
                 "float32": LMHead.from_checkpoint(path, dtype=torch.float32, gguf_blocks=False)}
        notes = {name: getattr(h, "load_note", "") for name, h in heads.items()}
        formats = {name: str(h.weight_format) for name, h in heads.items()}
        nll: dict[str, list[np.ndarray]] = {name: [] for name in HEADS}
        kl_parts: dict[str, list[TokenRows]] = {"stored_vs_llamacpp": [], "float32_vs_llamacpp": [],
                                                "stored_vs_float32": []}
        seconds = {"body": 0.0, **{name: 0.0 for name in HEADS}}
        with torch.no_grad():
            for c in range(n_chunk):
                chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
                if peer["add_bos"]:
                    chunk[0] = peer["bos"]
                t = time.perf_counter()
                hidden = body(input_ids=torch.tensor([chunk])).last_hidden_state[0, first:n_ctx - 1].float()
                seconds["body"] += time.perf_counter() - t
                targets = torch.tensor(chunk[first + 1:n_ctx], dtype=torch.int64)
                logits = {}
                for name in HEADS:
                    t = time.perf_counter()
                    logits[name] = (net.lm_head(hidden) if name == "transformers" else heads[name](hidden)).float()
                    seconds[name] += time.perf_counter() - t
                    nll[name].append(nll_rows(logits[name], targets))
                if kl:
                    base = torch.from_numpy(np.load(os.path.join(work, f"chunk{c}.npy"), allow_pickle=False))
                    for lo in range(0, len(targets), 32):
                        sl = slice(lo, lo + 32)
                        lb = torch.log_softmax(base[sl].double(), -1)
                        ls = torch.log_softmax(logits["stored"][sl].double(), -1)
                        lf = torch.log_softmax(logits["float32"][sl].double(), -1)
                        kl_parts["stored_vs_llamacpp"].append(token_rows(lb, ls, targets[sl]))
                        kl_parts["float32_vs_llamacpp"].append(token_rows(lb, lf, targets[sl]))
                        kl_parts["stored_vs_float32"].append(token_rows(lf, ls, targets[sl]))
                    os.remove(os.path.join(work, f"chunk{c}.npy"))
    ll = np.asarray(peer["nll"], dtype=np.float64)
    ours = {name: np.concatenate(parts) for name, parts in nll.items()}
    assert all(len(v) == len(ll) for v in ours.values())

    def ppl(x: np.ndarray) -> dict[str, float]:
        mean, pm = mean_and_uncertainty(x)
        return {"ppl": math.exp(mean), "ppl_pm": math.exp(mean) * pm}

    result: dict[str, Any] = {
        "model": str(path), "text": str(text_file), "text_bytes": len(text.encode()), "n_ctx": n_ctx,
        "n_chunk": n_chunk, "scored_tokens": len(ll), "add_bos": peer["add_bos"], "tokenization": tokens,
        "llamacpp": {"version": peer["version"], "system_info": peer["system_info"], "threads": peer["threads"],
                     "flash_attn": peer["flash_attn"], "decode_s": peer["seconds"], "wall_s": peer_wall, **ppl(ll)},
        "trtvocab": {name: ppl(ours[name]) for name in HEADS},
        "head_format": formats, "load_notes": notes, "seconds": seconds, "threads": threads,
    }
    ratios = {}
    for name, (a, b) in {"stored/float32": ("stored", "float32"), "stored/transformers": ("stored", "transformers"),
                         "float32/transformers": ("float32", "transformers")}.items():
        ratios[name] = paired_ratio(ours[a], ours[b])
    for name in HEADS:
        ratios[f"{name}/llamacpp"] = paired_ratio(ours[name], ll)
    result["ratios"] = {k: {"ratio": r, "pm": pm} for k, (r, pm) in ratios.items()}
    if kl:
        result["kl"] = {}
        for name, parts in kl_parts.items():
            s = llamacpp_stats(TokenRows.concat(parts), bootstrap=0)
            result["kl"][name] = {k: getattr(s, k) for k in ("n", "kld_mean", "kld_mean_pm", "kld_p99", "kld_max",
                                                             "same_top", "same_top_pm", "ppl_q", "ppl_base")}
    result["goals"] = {"stored_within_1pct_of_float32": abs(ratios["stored/float32"][0] - 1.0) <= 0.01,
                       "stored_not_worse_than_llamacpp": ratios["stored/llamacpp"][0] <= 1.0}
    if llama_perplexity:
        result["llama_perplexity"] = run_llama_perplexity(llama_perplexity, path, text_file, n_ctx, chunks, threads,
                                                          timeout)
    result["load_average"] = {"before": load_before[0], "after": os.getloadavg()[0], "cores": os.cpu_count()}
    return result


def show(r: dict[str, Any]) -> None:
    tk = r["tokenization"]
    bos = "overwrites each chunk's first id" if r["add_bos"] else "none"
    print(f"{r['model']}\n  text {r['text']} ({r['text_bytes']} bytes, {tk['llamacpp_ids']} ids), n_ctx {r['n_ctx']}, "
          f"{r['n_chunk']} chunks, {r['scored_tokens']} scored tokens, BOS {bos}")
    print(f"  tokenization: llama.cpp's ids used on both sides; transformers' "
          f"{'are equal' if tk['equal'] else 'differ from position ' + str(tk['first_difference'])}")
    lc = r["llamacpp"]
    print(f"  llama.cpp {lc['version']} ({lc['threads']} threads, flash_attn {lc['flash_attn']}): "
          f"PPL {lc['ppl']:.4f} ± {lc['ppl_pm']:.4f}")
    if "llama_perplexity" in r:
        lp = r["llama_perplexity"]
        print(f"  llama-perplexity (the program, same file and text): PPL {lp['ppl']:.4f} ± {lp['ppl_pm']:.4f}")
    for name in HEADS:
        t = r["trtvocab"][name]
        fmt = r["head_format"].get(name, "transformers lm_head")
        vs = r["ratios"][name + "/llamacpp"]
        print(f"  trtvocab {name:<13} ({fmt}): PPL {t['ppl']:.4f} ± {t['ppl_pm']:.4f}   "
              f"/ llama.cpp {vs['ratio']:.5f} ± {vs['pm']:.5f}")
    sf = r["ratios"]["stored/float32"]
    print(f"  stored / float32: 1 {sf['ratio'] - 1:+.2e} ± {sf['pm']:.1e} (goal within 1 %: "
          f"{'met' if r['goals']['stored_within_1pct_of_float32'] else 'NOT met'}); stored / llama.cpp <= 1: "
          f"{'met' if r['goals']['stored_not_worse_than_llamacpp'] else 'NOT met'}")
    for name, k in r.get("kl", {}).items():
        print(f"  KL {name:<21} mean {k['kld_mean']:.6f} ± {k['kld_mean_pm']:.6f}, p99 {k['kld_p99']:.5f}, "
              f"max {k['kld_max']:.4f}, same top {k['same_top'] * 100:.2f} %")
    s = r["seconds"]
    la = r["load_average"]
    print(f"  seconds: llama.cpp decodes {lc['decode_s']:.1f}; trtvocab body {s['body']:.1f}, heads "
          + ", ".join(f"{n} {s[n]:.1f}" for n in HEADS)
          + f"; load average {la['before']:.2f} -> {la['after']:.2f} on {la['cores']} cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, gemma3 (trtvocab models) or a .gguf path")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="UTF-8 text file (default: %(default)s)")
    parser.add_argument("--ctx", type=int, default=512, help="llama-perplexity's n_ctx (default 512)")
    parser.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: all)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's and torch's threads")
    parser.add_argument("--peer-python", default=peer_python(), help=f"llama.cpp's interpreter (${PYTHON_ENV})")
    parser.add_argument("--no-kl", dest="kl", action="store_false", help="PPL only (no logits file, no KL)")
    parser.add_argument("--no-flash-attn", dest="flash_attn", action="store_false",
                        help="llama.cpp without flash attention (llama-perplexity's 'auto' turns it on on a CPU)")
    parser.add_argument("--llama-perplexity", metavar="BIN", help="also run this llama-perplexity program")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds for the llama.cpp child")
    parser.add_argument("--json", type=Path,
                        help="write every number here (and print the run's one JSON line: benchmarks/_harness.py)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of the .jsonl files (--json)")
    args = parser.parse_args()
    with recording("perplexity_anchor", args):
        if args.ctx < 4 or args.ctx % 2:
            raise SystemExit("--ctx: an even number >= 4")
        if not Path(args.peer_python).is_file():
            raise SystemExit(f"no llama.cpp interpreter at {args.peer_python} (python3 -m venv ../llamacpp-venv && "
                             f"../llamacpp-venv/bin/pip install llama-cpp-python==0.3.36 numpy; or --peer-python)")
        result = anchor(model_file(args.model), args.text, n_ctx=args.ctx, chunks=args.chunks, threads=args.threads,
                        python=args.peer_python, kl=args.kl, flash_attn=args.flash_attn, timeout=args.timeout,
                        llama_perplexity=args.llama_perplexity)
        show(result)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_suffix(args.json.suffix + ".tmp")
            tmp.write_text(json.dumps(result, indent=1))
            os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
