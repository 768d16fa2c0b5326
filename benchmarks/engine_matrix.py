"""Every graph kind trtvocab exports x every TensorRT-RTX target: built or refused, engine vs ONNX bytes,
and the GEMM the builder's layer table says the engine runs (checked against the head's contract).

Ahead of time, on this machine (no GPU needed). Run alone: ``python benchmarks/engine_matrix.py``
(``--vocab/--hidden`` set the shard; ``--json``: the rows as one JSON line, benchmarks/_harness.py).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _harness import add_json, recording

from trtvocab import LMHead, VocabParallelEmbedding
from trtvocab.errors import EngineUnavailableError
from trtvocab.export.embedding import export_embedding_onnx
from trtvocab.export.onnx import export_onnx
from trtvocab.export.targets import RTX_TARGETS
from trtvocab.export.tensorrt import build_engine
from trtvocab.quant.config import QuantAlgo, QuantConfig
from trtvocab.quant.writer import quantize_head_tensors

PROFILE = {"min_tokens": 1, "opt_tokens": 16, "max_tokens": 256, "min_batch": 1, "opt_batch": 4, "max_batch": 64}


def kinds(v: int, h: int) -> dict[str, Callable[[Path], Path]]:
    w = torch.randn(v, h, generator=torch.Generator().manual_seed(0)) * h**-0.5

    def dense(dtype: torch.dtype, context: bool = False, **kw: object) -> Callable[[Path], Path]:
        def make(path: Path) -> Path:
            head = LMHead(v, h, dtype=dtype, **kw)  # type: ignore[arg-type]
            head.load_weights({"weight": w.to(dtype)})
            return Path(export_onnx(head, path, context_logits=context).path)
        return make

    def quant(algo: QuantAlgo, activation: str, granularity: str = "per_tensor",
              dequantize_fp4: bool = False) -> Callable[[Path], Path]:
        def make(path: Path) -> Path:
            qc = QuantConfig(quant_algo=algo, activation=activation, granularity=granularity)
            head = LMHead(v, h, dtype=torch.bfloat16, quant_config=qc)
            head.load_weights(quantize_head_tensors(w, qc, input_amax=4.0))
            return Path(export_onnx(head, path, dequantize_fp4=dequantize_fp4).path)
        return make

    def embedding(fp8: bool) -> Callable[[Path], Path]:
        def make(path: Path) -> Path:
            qc = QuantConfig(quant_algo=QuantAlgo.FP8, activation="none") if fp8 else None
            emb = VocabParallelEmbedding(v, h, dtype=torch.bfloat16, quant_config=qc, reduce_output=False)
            emb.load_weights({"weight": w.to(torch.bfloat16)} if not fp8 else quantize_head_tensors(w, qc))
            export_embedding_onnx(emb, path)
            return path
        return make

    fp8, fp4 = QuantAlgo.FP8, QuantAlgo.NVFP4
    return {
        "dense fp32": dense(torch.float32), "dense bf16": dense(torch.bfloat16), "dense fp16": dense(torch.float16),
        "dense bf16, context": dense(torch.bfloat16, context=True),
        "bf16 output_dtype=float32": dense(torch.bfloat16, output_dtype=torch.float32),
        "fp32 deterministic": dense(torch.float32, deterministic=True),
        "FP8 W8A8 static": quant(fp8, "static"), "FP8 W8A8 static per-row": quant(fp8, "static", "per_row"),
        "FP8 W8A8 dynamic": quant(fp8, "dynamic"), "FP8 W8A16": quant(fp8, "none"),
        "FP8 W8A16 per-row": quant(fp8, "none", "per_row"),
        "NVFP4 W4A4": quant(fp4, "static"), "NVFP4 W4A16": quant(fp4, "none"),
        "NVFP4 dequantize_fp4": quant(fp4, "none", dequantize_fp4=True),
        "embedding bf16": embedding(False), "embedding FP8": embedding(True),
    }


def _why(cell: str) -> str:
    """A refusal, as the datatype the target lacks."""
    reasons = (("bfloat16", "no bf16"), ("FP8", "no fp8"), ("FP4", "no fp4"), ("float32 GEMM", "no fp32 GEMM"))
    for text, short in reasons:
        if text in cell:
            return short
    return cell[:24]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=4099)
    parser.add_argument("--hidden", type=int, default=512)
    add_json(parser)
    args = parser.parse_args()
    with recording("engine_matrix", args) as record:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for name, make in kinds(args.vocab, args.hidden).items():
                graph = make(Path(tmp) / (name.replace(" ", "_").replace(",", "") + ".onnx"))
                cells: dict[str, str] = {}
                for target in [*RTX_TARGETS, "default"]:
                    started = time.monotonic()
                    try:
                        b = build_engine(graph, Path(tmp) / "x.plan", PROFILE, 1 << 30, compiler="tensorrt-rtx",
                                         targets=None if target == "default" else [target], contract="warn")
                    except EngineUnavailableError as exc:
                        cells[target] = "refused: " + str(exc).split(": ", 2)[-1].split(" compute")[0]
                        continue
                    c = b.compute
                    gemm = (f"{c.gemm.activation} x {c.gemm.weight}{'' if c.gemm.weight_resident else ' (per call)'}"
                            if c is not None and c.gemm is not None else f"table {c.table}" if c is not None else "?")
                    verdict = "ok" if c is not None and c.ok else "CONTRACT BROKEN"
                    cells[target] = f"{verdict}: {gemm}"
                    if target == "default":
                        rows.append({"graph": name, "targets": b.targets, "engine_bytes": b.bytes,
                                     "onnx_bytes": b.onnx_bytes, "weights_bytes": c.weights_bytes if c else None,
                                     "activation_bytes": c.activation_bytes if c else None, "gemm": gemm,
                                     "contract": verdict, "problems": c.problems if c else [],
                                     "build_s": round(time.monotonic() - started, 2), "cells": cells})
                if "default" in cells and cells["default"].startswith("refused"):
                    rows.append({"graph": name, "cells": cells})
        record.rows.extend(rows)
        print(f"shard {args.vocab} x {args.hidden}, TensorRT-RTX ahead of time (contract = warn)")
        print("| graph | " + " | ".join(RTX_TARGETS) + " | engine / ONNX bytes | weights | GEMM | contract |")
        print("|---" * (len(RTX_TARGETS) + 5) + "|")
        for r in rows:
            short = [("ok" if c.startswith("ok") else "BROKEN" if c.startswith("CONTRACT") else _why(c))
                     for t, c in r["cells"].items() if t != "default"]
            tail = (f"{r['engine_bytes']:,} / {r['onnx_bytes']:,} | {r['weights_bytes']:,} | {r['gemm']} | "
                    f"{r['contract']}" if "gemm" in r else "- | - | - | -")
            print(f"| {r['graph']} | " + " | ".join(short) + f" | {tail} |")


if __name__ == "__main__":
    main()
