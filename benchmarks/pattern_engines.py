"""Which engine should answer a checkpoint's ``re:`` patterns: the measurement behind
``trtvocab/quant/patterns.py`` (docs/architecture.md, "What is written by hand, and why").

    python benchmarks/pattern_engines.py                 # the engines that are installed
    python benchmarks/pattern_engines.py --timeout 0.1 --json

Four engines, each on the same three sets:

- ``bounded``: trtvocab's matcher (``quant.patterns``: memoized end positions under a step budget);
- ``re``: Python's ``re.match`` (compressed-tensors' and vLLM's own call), run in a child process under
  ``--re-limit`` seconds per hostile pattern (it backtracks: exponential on the hostile ones);
- ``regex``: the ``regex`` package's ``match`` with ``timeout=`` (a backtracking engine with a deadline);
- ``re2``: ``google-re2`` (linear time; no lookarounds or back-references).

Sets: the hostile patterns of the tests (``tests/quant/test_hostile_patterns.py``: alternation and nested
repeats, 1200-deep groups, 70000 characters, a back-reference); the patterns real configs use
(compressed-tensors' own ``re:`` targets and the tests' REAL_PATTERNS) against module names, each answer
compared with ``re.match``; and 1500 random small patterns (the tests' differential generator). Printed per
engine: the hostile patterns' answers and times, agreement with ``re.match``, patterns refused, and the
median time of one match of a real pattern (compiled once).
"""

from __future__ import annotations

import argparse
import importlib
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from _harness import add_json, add_row, recording

HOSTILE = {
    "alternation (.|.|...24)*Z": "(" + "|".join(["."] * 24) + ")*Z",
    "alternation (.|...48)*Z": "(" + "|".join(["."] * 48) + ")*Z",
    "nested (a*)* x20 b": "(a*)*" * 20 + "b",
    "((a|aa)+)+c": "((a|aa)+)+c",
    "(.*)* x8 Z": "(.*)*" * 8 + "Z",
    "1200-deep groups": "(" * 1200 + "x" + ")" * 1200,
    "70000 characters": "a" * 70000,
    "back-reference": "(a)\\1|x",
}
HOSTILE_NAMES = ["lm_head", "a" * 30 + "lm_head"]
# compressed-tensors' own re: targets (its source) and what llm-compressor recipes write in `ignore`
PRESETS = [r".*(self_attn|attention)$", r".*lm_head", r".*lm_head$", r".*embed_tokens$", r"vision_tower.*",
           r"multi_modal_projector.*", r".*mlp\.gate$", r".*mlp\.shared_expert_gate$", r".*block_sparse_moe\.gate",
           r".*router", r".*self_attn\.(q|k|v)_proj$", r"^mtp\..*", r".*\.layers\.\d+\.mlp\.experts\.\d+\..*"]
REAL_PATTERNS = [r".*lm_head", r".*lm_head$", r"lm_hea", r"lm_head|", r".*", r".*self_attn.*",
                 r"model.layers.\d+.mlp.*", r".*mlp\.(gate|up|down)_proj$", r".*(q|k|v)_proj$", r"^lm_head$",
                 r"(?!.*lm_head).*", r".*(?<!lm_)head", r".*embed.*", r"[^.]+$", r"(?s).*head", r"lm_head\b",
                 r"(?:lm_){1,2}head", r".*layers\.(?!0\.).*", r"(?P<x>lm)_head", r".*?head", r"\Alm_head\Z",
                 r"(lm|model)(_head|\.embed_tokens)$", r"(?m)^lm", r"[\w.]*tokens", r".{7}", r".{8}", r"(?a)\w+$",
                 r"(?x) lm _ head", r"(?<=model\.)embed", r"(a|ab)(c|bcd)(d*)", r"x*", r"lm_head\n?$"]
NAMES = ["lm_head", "model.embed_tokens", "transformer.wte", "model.layers.0.mlp.gate_proj", "", "lm_head\n",
         "model.layers.1.self_attn.q_proj", "LM_HEAD", "model.layers.3.mlp.experts.7.down_proj", "mtp.0.proj",
         "vision_tower.blocks.0.attn", "model.layers.2.self_attn"]


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    """The tests' differential generator (anchors, \\b / \\B, lookarounds, nested and lazy repeats)."""
    atoms = ["a", "b", ".", "_", r"\.", "[ab]", "[^a]", r"\w", r"\d", "1", "^", "$", r"\b", r"\B"]
    k = rng.random()
    if depth > 3 or k < 0.35:
        return rng.choice(atoms)
    if k < 0.55:
        return "".join(random_pattern(rng, depth + 1) for _ in range(rng.randint(1, 3)))
    if k < 0.7:
        return "(" + "|".join(random_pattern(rng, depth + 1) for _ in range(rng.randint(1, 3))) + ")"
    if k < 0.8:
        return f"(?:{random_pattern(rng, depth + 1)})" + rng.choice(["*", "+", "?", "{0,2}", "{2}", "*?", "{1,}"])
    if k < 0.88:
        return rng.choice(["(?=", "(?!"]) + random_pattern(rng, depth + 1) + ")"
    if k < 0.93:
        return rng.choice(["(?<=", "(?<!"]) + rng.choice(["a", "ab", r"\.", "[ab]"]) + ")"
    return random_pattern(rng, depth + 1) + rng.choice(["*", "+", "?"])


Engine = tuple[Callable[[str], Any], Callable[[Any, str], bool]]  # (compile, match); either raises: refused


def engines(timeout: float) -> dict[str, Engine]:
    from trtvocab.quant import patterns

    out: dict[str, Engine] = {"bounded": (patterns.compile_pattern, patterns.match),
                              "re": (re.compile, lambda c, s: c.match(s) is not None)}
    try:
        regex = importlib.import_module("regex")
        out["regex"] = (lambda p: regex.compile(p, regex.VERSION0),
                        lambda c, s: c.match(s, timeout=timeout) is not None)
    except ImportError:
        print("regex: not installed (pip install regex)")
    try:
        re2 = importlib.import_module("re2")
        options = re2.Options()
        out["re2"] = (lambda p: re2.compile(p, options), lambda c, s: c.match(s) is not None)
    except ImportError:
        print("re2: not installed (pip install google-re2)")
    return out


def hostile_re(pattern: str, name: str, limit: float) -> str:
    """``re.match`` in a child process: its answer and time, or that it ran past ``limit`` seconds."""
    code = ("import re, sys, time; p, s = sys.argv[1], sys.argv[2]; t = time.perf_counter()\n"
            "try:\n r = re.match(p, s) is not None\nexcept Exception as e:\n r = type(e).__name__\n"
            "print(r, f'{time.perf_counter() - t:.4f}')")
    try:
        done = subprocess.run([sys.executable, "-c", code, pattern, name], capture_output=True, text=True,
                              timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        return f"> {limit:g} s"
    answer, seconds = done.stdout.split() if done.returncode == 0 else ("error", "0")
    return f"{answer} {float(seconds) * 1e3:.2f} ms"


def attempt(engine: Engine, pattern: str, name: str) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        answer = str(engine[1](engine[0](pattern), name))
    except Exception as exc:  # what each engine raises differs: a refusal either way
        answer = f"refused ({type(exc).__name__})"
    return answer, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=0.1, help="regex's timeout= per match, seconds")
    parser.add_argument("--re-limit", type=float, default=5.0, help="seconds before a child running re.match is "
                        "stopped (hostile patterns)")
    parser.add_argument("--random", type=int, default=1500, help="random patterns in the differential set")
    add_json(parser)
    args = parser.parse_args()
    with recording("pattern_engines", args):
        table = engines(args.timeout)
        shown = [n[:12] + ("..." if len(n) > 12 else "") for n in HOSTILE_NAMES]
        print("hostile patterns (answer, time) against", shown)
        for label, pattern in HOSTILE.items():
            for name in HOSTILE_NAMES:
                cells = {}
                for key, engine in table.items():
                    if key == "re":
                        cells[key] = hostile_re(pattern, name, args.re_limit)
                        continue
                    answer, seconds = attempt(engine, pattern, name)
                    cells[key] = f"{answer} {seconds * 1e3:.2f} ms"
                print(f"  {label:<28} {len(name):>3} chars: " + " | ".join(f"{k} {v}" for k, v in cells.items()))
                add_row(set="hostile", pattern=label, name_chars=len(name), **cells)

        rng = random.Random(37)
        randoms = [random_pattern(rng) for _ in range(args.random)]
        sets = {"presets": (PRESETS, NAMES), "real": (REAL_PATTERNS, NAMES),
                "random": (randoms, ["", "a", "b", "ab", "ba", "a.b", "a_1", "lm_head", "aab", "b.a.", "1a", "a\n"])}
        print("\nagreement with re.match (pairs agreeing / pairs answered; patterns refused)")
        for set_name, (pats, names) in sets.items():
            for key, (compile_, match) in table.items():
                agree = answered = refused = 0
                for pattern in pats:
                    try:
                        reference = re.compile(pattern)
                    except re.error:
                        continue
                    try:
                        compiled = compile_(pattern)
                    except Exception:  # refused at compile
                        refused += 1
                        continue
                    for name in names:
                        try:
                            got = match(compiled, name)
                        except Exception:
                            refused += 1
                            break
                        answered += 1
                        agree += got == (reference.match(name) is not None)
                print(f"  {set_name:<8} {key:<8} {agree:>6} / {answered:<6} refused {refused}")
                add_row(set=set_name, engine=key, agree=agree, answered=answered, refused=refused)

        print("\none match of a real pattern, compiled once (median of every pattern x name, 20 rounds)")
        for key, (compile_, match) in table.items():
            times = []
            for pattern in PRESETS + REAL_PATTERNS:
                try:
                    compiled = compile_(pattern)
                except Exception:
                    continue
                for name in NAMES:
                    start = time.perf_counter()
                    for _ in range(20):
                        match(compiled, name)
                    times.append((time.perf_counter() - start) / 20)
            print(f"  {key:<8} {statistics.median(times) * 1e6:8.2f} us (max {max(times) * 1e6:.1f} us)")
            add_row(set="timing", engine=key, median_us=statistics.median(times) * 1e6, max_us=max(times) * 1e6)


if __name__ == "__main__":
    main()
