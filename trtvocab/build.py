"""``trtvocab build``: recipe -> per-rank shard load -> weights + ONNX -> CPU check -> engine.

Ranks are built one after another in this process: building needs no collective
(each rank only reads its own rows), so there is nothing to synchronize.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from trtvocab import artifacts
from trtvocab.errors import ArtifactError, ConfigError, EngineUnavailableError
from trtvocab.lm_head import HEAD_DTYPES, LMHead
from trtvocab.logits import shard_logits
from trtvocab.mapping import Mapping
from trtvocab.recipe import BuildRecipe

Progress = Callable[[int, str], None]  # (rank, stage) -> None


def make_head(recipe: BuildRecipe, rank: int) -> LMHead:
    """Rank ``rank``'s head of the recipe, with only its rows read."""
    m = recipe.mapping
    mapping = Mapping(world_size=m.tp_size, rank=rank, tp_size=m.tp_size, enable_attention_dp=m.enable_attention_dp,
                      enable_lm_head_tp_in_adp=m.enable_lm_head_tp_in_adp)
    lh = recipe.lm_head
    dtype = HEAD_DTYPES[lh.dtype]
    syn = recipe.checkpoint.synthetic
    if syn is not None:
        from trtvocab.synthetic import SyntheticRows

        head = LMHead(syn.vocab_size, syn.hidden_size, dtype=dtype, mapping=mapping, gather_output=lh.gather_output,
                      vocab_layout=lh.vocab_layout, pad_to=lh.pad_to)
        head.load_weights({"weight": SyntheticRows(syn.vocab_size, syn.hidden_size, syn.seed, syn.std)})
        return head
    path = recipe.checkpoint_path()
    return LMHead.from_checkpoint(
        path, mapping=mapping, gather_output=lh.gather_output, dtype=dtype, quant=recipe.quantization.mode,
        tensor_name=recipe.checkpoint.tensor, vocab_layout=lh.vocab_layout, pad_to=lh.pad_to,
        weight_only=recipe.quantization.weight_only,
    )


def verification_input(head: LMHead, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A small packed batch (3 sequences, 7 tokens) at the scale of real hidden states."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(7, head.hidden_size, generator=gen).to(head.dtype)
    return hidden, torch.tensor([3, 1, 3], dtype=torch.int32)


def verify_export(head: LMHead, onnx_path: Path, context: bool) -> dict[str, Any]:
    """Run the exported graph on CPU and compare it with the fallback, column for column."""
    from trtvocab.export.reference_ops import run_onnx

    hidden, seq_lens = verification_input(head)
    want = shard_logits(head, hidden, seq_lens, return_context_logits=context)
    got, backend = run_onnx(onnx_path, hidden, None if context else seq_lens, return_backend=True)
    got = torch.from_numpy(got)
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    # Same arithmetic in both, so the only differences are float32 summation order and,
    # for half-precision dense heads, the one rounding of the GEMM output: allow one ulp
    # of the output format (half), or a few float32 ulps growing with sqrt(H) (float32).
    out_dtype = torch.float32 if head.format_name != "dense" else head.dtype
    ulp = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[out_dtype]
    ulps = 1.0 if out_dtype != torch.float32 else 4 + head.hidden_size**0.5 / 4
    tol = ulps * ulp * max(scale, 2.0**-10)
    return {"backend": backend, "max_abs_err": err, "tolerance": tol, "ok": bool(err <= tol),
            "argmax_equal": bool(torch.equal(got.argmax(-1), want.argmax(-1)))}


def build_rank(
    recipe: BuildRecipe, rank: int, root: Path, progress: Progress
) -> tuple[dict[str, Any], tuple[int, int]]:
    """Build one rank into ``root``; returns its manifest entry and the head's ``(V, H)``
    (not the head: each rank's weights are freed before the next rank loads)."""
    out = artifacts.rank_dir(root, rank)
    out.mkdir(parents=True, exist_ok=True)
    progress(rank, "load shard")
    head = make_head(recipe, rank)
    entry: dict[str, Any] = {
        "rank": rank, "start": head.vocab_start, "end": head.vocab_end, "width": head.shard.width,
        "format": head.format_name, "resident_bytes": head.resident_bytes(),
        "files": {"weights": f"rank{rank}/weights.safetensors"},
    }
    progress(rank, "save weights")
    tensors = {k: v.contiguous() for k, v in head.weights.export_tensors().items()}
    save_file(tensors, str(out / "weights.safetensors"),
              metadata={"rank": str(rank), "start": str(head.vocab_start), "end": str(head.vocab_end)})
    if recipe.output.onnx:
        from trtvocab.export.onnx import export_onnx

        progress(rank, "export onnx")
        onnx_path = out / "lm_head.onnx"
        export_onnx(head, onnx_path, context_logits=recipe.lm_head.context_logits)
        entry["files"]["onnx"] = f"rank{rank}/lm_head.onnx"
        if recipe.output.verify:
            progress(rank, "verify onnx")
            entry["verify"] = v = verify_export(head, onnx_path, recipe.lm_head.context_logits)
            if not v["ok"]:
                # Never publish a graph known to disagree with the fallback: the build fails
                # inside the staging folder, so any previous artifact stays as it was.
                raise ArtifactError(f"rank {rank}: {onnx_path.name} disagrees with the PyTorch fallback on "
                                    f"{v['backend']}: max |err| {v['max_abs_err']:.3g} > tolerance "
                                    f"{v['tolerance']:.3g}; nothing was written")
        progress(rank, "build engine")
        entry["engine"] = build_engine_for(recipe, head, onnx_path, out / "lm_head.plan")
        if entry["engine"]["built"]:
            entry["files"]["plan"] = f"rank{rank}/lm_head.plan"
    else:
        entry["engine"] = {"built": False, "reason": "ONNX export disabled in [output]"}
    entry["quant"] = describe_quant(head)
    return entry, (head.vocab_size, head.hidden_size)


def build_engine_for(recipe: BuildRecipe, head: LMHead, onnx_path: Path, plan_path: Path) -> dict[str, Any]:
    from trtvocab.export import tensorrt as trt_export

    ok, reason = trt_export.tensorrt_available()
    if not ok:
        if recipe.engine.require:
            raise EngineUnavailableError(f"engine required but cannot be built: {reason}")
        return {"built": False, "reason": reason}
    try:
        p = recipe.profile
        info = trt_export.build_engine(
            onnx_path, plan_path,
            profile={"min_tokens": p.min_tokens, "opt_tokens": p.opt_tokens, "max_tokens": p.max_tokens,
                     "min_batch": p.min_batch, "opt_batch": p.opt_batch, "max_batch": p.max_batch},
            workspace_bytes=recipe.engine.workspace_mib << 20,
            timing_cache_path=Path(recipe.engine.timing_cache) if recipe.engine.timing_cache else None,
            weight_format=head.format_name, dequantize_fp4=recipe.quantization.dequantize_fp4,
        )
    except EngineUnavailableError as exc:
        if recipe.engine.require:
            raise
        return {"built": False, "reason": str(exc)}
    meta = info.model_dump() if hasattr(info, "model_dump") else dict(info)
    # Paths inside the staging folder are stale once the artifact is published: record them
    # relative to the rank folder. The GPU goes under "gpu", which the runtime checks.
    for key in ("plan_path", "onnx_path"):
        if meta.get(key):
            meta[key] = Path(meta[key]).name
    meta["gpu"] = {"name": meta.get("device"), "compute_capability": meta.get("compute_capability")}
    return {"built": True, **meta}


def describe_quant(head: LMHead) -> dict[str, Any]:
    d = head.quant_decision
    qc = head.quant_config
    return {
        "format": head.format_name,
        "label": qc.label if qc is not None else str(head.dtype).replace("torch.", ""),
        "config": qc.model_dump(mode="json") if qc is not None else None,
        "stored": d.stored.value if d is not None and d.stored is not None else None,
        "dequantized": bool(d.dequantize) if d is not None else False,
        "reason": d.reason if d is not None else "synthetic weights",
    }


def build(recipe: BuildRecipe, out: Path | None = None, *, ranks: Sequence[int] | None = None, force: bool = False,
          progress: Progress | None = None) -> tuple[Path, dict[str, Any]]:
    """Build the recipe's artifact into ``out`` (default: the recipe's ``[output] dir``)."""
    tp = recipe.mapping.tp_size
    ranks = list(range(tp)) if ranks is None else sorted(set(ranks))
    bad = [r for r in ranks if not 0 <= r < tp]
    if bad:
        raise ConfigError(f"--ranks {bad} out of range for tp_size {tp}")
    out = Path(out or recipe.output.dir)
    progress = progress or (lambda rank, stage: None)
    started = datetime.datetime.now(datetime.timezone.utc)
    with artifacts.staging(out, force=force) as stage:
        built = [build_rank(recipe, r, stage, progress) for r in ranks]
        entries = [entry for entry, _ in built]
        first, (vocab, hidden) = built[0]
        manifest = {
            "created": started.isoformat(timespec="seconds"),
            "versions": artifacts.versions(),
            "recipe": recipe.model_dump(mode="json"),
            "recipe_file": recipe.source,
            "checkpoint": str(recipe.checkpoint_path()) if recipe.checkpoint.synthetic is None else "synthetic",
            "head": {"vocab_size": vocab, "hidden_size": hidden,
                     **recipe.lm_head.model_dump(mode="json"), "tensor": recipe.checkpoint.tensor},
            "mapping": recipe.mapping.model_dump(mode="json"),
            "quant": first["quant"],
            "profiles": recipe.profile.model_dump(mode="json"),
            "ranks": entries,
            "ranks_built": ranks,
            "backends": {
                "torch": True,
                "onnx": recipe.output.onnx,
                "tensorrt": all(e["engine"]["built"] for e in entries),
            },
        }
        manifest = artifacts.write_manifest(stage, manifest)
    return out, manifest
