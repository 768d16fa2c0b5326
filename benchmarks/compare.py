"""Throughput and peak memory of ``trtvocab compare`` on synthetic heads.

For each head shape, T rows of random hidden states and random next-token ids are
compared, bf16 baseline against FP8 (per-tensor, per-row) and NVFP4 (plain, MSE search)
variants: every number of the report, llama.cpp's teacher-forced block included. Printed:
rows/s of the whole compare (heads, GEMMs, float64 statistics; quantizing the variants
timed apart), and the process's peak RSS next to what holding ``[T, V]`` float64 for every
variant at once would take (compare holds two float32 ``[T, V]`` logit tensors at a time).

Run: ``.venv/bin/python benchmarks/compare.py`` (49152 x 576, T = 4096: about four minutes on
two CPU cores, 76 variant-rows/s, peak RSS 4.8 GiB); ``--large`` adds 129280 x 5120
(DeepSeek-V3's head; needs ~12 GB and many minutes on a CPU); ``--tokens``, ``--shapes VxH,...``.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from _harness import add_json, recording

from trtvocab.accuracy.compare import MemoryHead, Variant, compare_heads, parse_sim_spec, simulate_source
from trtvocab.accuracy.stats import llamacpp_stats

VARIANTS = ["fp8", "fp8-row", "nvfp4", "nvfp4-mse"]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run(vocab: int, hidden: int, tokens: int, variants: list[str]) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).bfloat16()
    states = torch.randn(tokens, hidden, generator=gen) * 2.0
    next_ids = torch.randint(0, vocab, (tokens,), generator=gen)
    base = Variant(name="bf16", head=MemoryHead({"weight": weight}, None, (vocab, hidden)))
    t0 = time.perf_counter()
    sources = [base] + [simulate_source(weight, parse_sim_spec(v), None) for v in variants]
    t_quant = time.perf_counter() - t0
    t0 = time.perf_counter()
    metrics, sizes, labels, _ = compare_heads(sources, states, None, dtype=torch.bfloat16, next_ids=next_ids)
    stats = [llamacpp_stats(m.tokens, bootstrap=1000) for m in metrics]
    t_cmp = time.perf_counter() - t0
    rows = tokens * len(variants)
    all_f64 = len(variants) * tokens * vocab * 8
    print(f"{vocab} x {hidden}, T={tokens}: quantize {t_quant:.1f}s; compare {t_cmp:.1f}s = "
          f"{rows / t_cmp:,.0f} variant-rows/s ({tokens / t_cmp:,.0f} rows/s through the baseline and all "
          f"{len(variants)} variants); peak RSS {peak_rss_bytes() / 2**30:.2f} GiB (all [T, V] float64 at once "
          f"would be {all_f64 / 2**30:.2f} GiB)")
    for label, v, m, s, size in zip(labels[1:], variants, metrics, stats, sizes[1:], strict=True):
        print(f"  {v:10s} {label:22s} {size / 2**20:8.1f} MiB  KLD {s.kld_mean:.3e}  same top {s.same_top:.4f}  "
              f"EAR {s.ear:.4f}  top-1 {m.top1_agreement:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--shapes", default="49152x576", help="comma-separated VxH")
    parser.add_argument("--large", action="store_true", help="also 129280 x 5120")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    add_json(parser)
    args = parser.parse_args()
    with recording("compare", args):
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
        if args.large:
            shapes.append((129280, 5120))
        torch.manual_seed(0)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        for vocab, hidden in shapes:
            run(vocab, hidden, args.tokens, args.variants.split(","))


if __name__ == "__main__":
    main()
