"""``trtvocab build``: recipe -> per-rank shard load -> weights + ONNX -> CPU check -> engine.

Ranks are built one after another in this process: building needs no collective
(each rank only reads its own rows), so there is nothing to synchronize.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from trtvocab.artifact import store as artifacts
from trtvocab.artifact.manifest import (
    BackendsRecord,
    EngineRecord,
    HeadRecord,
    Manifest,
    QuantRecord,
    RankEntry,
    RankFiles,
    VerifyRecord,
)
from trtvocab.artifact.recipe import BuildRecipe
from trtvocab.base import publish
from trtvocab.base.dtypes import head_dtype
from trtvocab.base.family import Family
from trtvocab.base.formats import Runtime, WeightFormat
from trtvocab.checkpoints.provenance import head_digest
from trtvocab.checkpoints.synthetic import SyntheticRows
from trtvocab.embedding import VocabParallelEmbedding
from trtvocab.errors import ArtifactError, ConfigError, EngineUnavailableError
from trtvocab.export.records import EngineBuild
from trtvocab.lm_head import LMHead
from trtvocab.logits import shard_logits
from trtvocab.quant.gguf_blocks import GGUFConfig

Progress = Callable[[int, str], None]  # (rank, stage) -> None


def make_head(recipe: BuildRecipe, rank: int) -> LMHead:
    """Rank ``rank``'s head of the recipe, with only its rows read."""
    mapping = recipe.mapping.for_rank(rank)
    lh = recipe.lm_head
    dtype = head_dtype(lh.dtype)
    syn = recipe.checkpoint.synthetic
    if syn is not None:
        head = LMHead(syn.vocab_size, syn.hidden_size, dtype=dtype, mapping=mapping, gather_output=lh.gather_output,
                      vocab_layout=lh.vocab_layout, pad_to=lh.pad_to, **lh.head_options())
        head.load_weights({"weight": SyntheticRows(syn.vocab_size, syn.hidden_size, syn.seed, syn.std)})
        return head
    path = recipe.checkpoint_path()
    return LMHead.from_checkpoint(
        path, mapping=mapping, gather_output=lh.gather_output, dtype=dtype, quant=recipe.quantization.mode,
        tensor_name=recipe.checkpoint.tensor, vocab_layout=lh.vocab_layout, pad_to=lh.pad_to,
        weight_only=recipe.quantization.weight_only, **lh.head_options(),
        gguf_blocks=lh.gguf_blocks,  # [lm_head] gguf_blocks (docs/architecture.md, "GGUF heads in their stored blocks")
    )


def make_embedding(recipe: BuildRecipe, rank: int, head: LMHead) -> VocabParallelEmbedding:
    """Rank ``rank``'s embedding shard (partial rows: the graph leaves the all-reduce outside).

    A tied head (the checkpoint's input embedding, or synthetic rows) shares its buffer;
    otherwise the checkpoint's embedding tensor is read, only this rank's rows.
    """
    tied = head.quant_decision is None or head.quant_decision.tied
    if tied and recipe.embedding.tensor is None and head.weight_format is WeightFormat.DENSE:
        # The head holds the one table (tie_weights goes the other way: the head takes the embedding's).
        return VocabParallelEmbedding.from_head(head, reduce_output=False)
    lh = recipe.lm_head
    return VocabParallelEmbedding.from_checkpoint(
        recipe.checkpoint_path(), mapping=recipe.mapping.for_rank(rank), dtype=head_dtype(lh.dtype),
        tensor_name=recipe.embedding.tensor, vocab_layout=lh.vocab_layout, pad_to=lh.pad_to, reduce_output=False,
        gguf_blocks=False)  # the embedding graph's table is dense: a GGUF table dequantized as without gguf_blocks


def verify_embedding_export(emb: VocabParallelEmbedding, onnx_path: Path) -> VerifyRecord:
    """The exported lookup on onnxruntime against the module's partial rows, bitwise (the same
    gathers and the same one multiply)."""
    from trtvocab.backends.onnx_embedding import run_embedding_onnx

    gen = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.tensor([-1, 0, emb.vocab_start, emb.vocab_end - 1, emb.vocab_end, emb.vocab_size,
                                   emb.vocab_size + 5]), torch.randint(0, emb.vocab_size, (57,), generator=gen)])
    rows, scales = emb.local_rows(ids)
    want = emb.embedding_ops.apply(emb.dequantize_rows(rows, scales))
    got = run_embedding_onnx(onnx_path, ids)
    err = float((got.float() - want.float()).abs().max())
    equal = bool(torch.equal(got, want))
    return VerifyRecord(backend=Runtime.ONNXRUNTIME, max_abs_err=err, tolerance=0.0, ok=equal, argmax_equal=equal)


def verification_input(head: LMHead, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A small packed batch (3 sequences, 7 tokens) at the scale of real hidden states."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(7, head.hidden_size, generator=gen).to(head.dtype)
    return hidden, torch.tensor([3, 1, 3], dtype=torch.int32)


def verify_export(head: LMHead, onnx_path: Path, context: bool) -> VerifyRecord:
    """Run the exported graph on CPU and compare it with the fallback, column for column."""
    import onnx

    from trtvocab.backends.onnx import run_onnx
    from trtvocab.export.onnx import GraphSpec, gemm_rounding

    hidden, seq_lens = verification_input(head)
    want = shard_logits(head, hidden, seq_lens, return_context_logits=context)
    run = run_onnx(onnx_path, hidden, None if context else seq_lens)
    got = torch.from_numpy(run.logits)
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    # Same arithmetic in both, so the only differences are float32 summation order (a few
    # float32 ulps growing with sqrt(H)) and, where the graph's GEMM runs in the head dtype
    # (gemm_rounding: dense half heads, output_dtype=float32 heads, FP8 W8A16 and NVFP4
    # W4A16), the one rounding of its output to that dtype, which the fallback's float32
    # result may not have: one ulp of that dtype on top. A GGUF Q8_0 / Q4_0 / Q4_1 graph dequantizes
    # to gguf's exact float32 weights and multiplies in float32: summation order only.
    spec = GraphSpec.from_model(onnx.load(str(onnx_path), load_external_data=False))
    rounding = gemm_rounding(spec)
    f32_ulps = (4 + head.hidden_size**0.5 / 4) * 2.0**-23
    half_ulp = {None: 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}[rounding]
    tol = (half_ulp + f32_ulps) * max(scale, 2.0**-10)
    return VerifyRecord(backend=run.runner, max_abs_err=err, tolerance=tol, ok=bool(err <= tol),
                        argmax_equal=bool(torch.equal(got.argmax(-1), want.argmax(-1))))


def _build_embedding(recipe: BuildRecipe, rank: int, head: LMHead, out: Path, files: RankFiles,
                     progress: Progress) -> tuple[RankFiles, VerifyRecord, EngineRecord]:
    """The rank's embedding graph (checked on onnxruntime against the module) and engine, into ``out``."""
    from trtvocab.export.embedding import export_embedding_onnx

    progress(rank, "export embedding")
    emb = make_embedding(recipe, rank, head)
    emb_path = out / "embedding.onnx"
    export_embedding_onnx(emb, emb_path)
    files = files.model_copy(update={"embedding_onnx": f"rank{rank}/embedding.onnx"})
    verify = verify_embedding_export(emb, emb_path)
    if not verify.ok:
        raise ArtifactError(f"rank {rank}: embedding.onnx disagrees with the PyTorch module on onnxruntime: "
                            f"max |err| {verify.max_abs_err:.3g}; nothing was written")
    progress(rank, "build embedding engine")
    engine = build_engine_for(recipe, emb_path, out / "embedding.plan")
    if engine.built:
        files = files.model_copy(update={"embedding_plan": f"rank{rank}/embedding.plan"})
    return files, verify, engine


def build_rank(
    recipe: BuildRecipe, rank: int, root: Path, progress: Progress
) -> tuple[RankEntry, tuple[int, int, Family]]:
    """Build one rank into ``root``; returns its manifest entry and the head's ``(V, H, family)``
    (not the head: each rank's weights are freed before the next rank loads)."""
    out = artifacts.rank_dir(root, rank)
    out.mkdir(parents=True, exist_ok=True)
    progress(rank, "load shard")
    head = make_head(recipe, rank)
    progress(rank, "save weights")
    tensors = {k: v.contiguous() for k, v in head.weights.export_tensors().items()}
    if head.head_ops.bias:
        tensors["bias"] = head.bias.contiguous()
    with publish.writing(f"rank{rank}/weights.safetensors"):
        save_file(tensors, str(out / "weights.safetensors"),
                  metadata={"rank": str(rank), "start": str(head.vocab_start), "end": str(head.vocab_end)})
        publish.default_mode(out / "weights.safetensors")  # readable as the manifest and graphs are (not 0600)
    files = RankFiles(weights=f"rank{rank}/weights.safetensors")
    verify: VerifyRecord | None = None
    if recipe.output.onnx:
        from trtvocab.export.onnx import export_onnx

        progress(rank, "export onnx")
        onnx_path = out / "lm_head.onnx"
        export_onnx(head, onnx_path, context_logits=recipe.lm_head.context_logits)
        files = files.model_copy(update={"onnx": f"rank{rank}/lm_head.onnx"})
        if recipe.output.verify:
            progress(rank, "verify onnx")
            verify = verify_export(head, onnx_path, recipe.lm_head.context_logits)
            if not verify.ok:
                # Never publish a graph known to disagree with the fallback: the build fails
                # inside the staging folder, so any previous artifact stays as it was.
                raise ArtifactError(f"rank {rank}: {onnx_path.name} disagrees with the PyTorch fallback on "
                                    f"{verify.backend}: max |err| {verify.max_abs_err:.3g} > tolerance "
                                    f"{verify.tolerance:.3g}; nothing was written")
        progress(rank, "build engine")
        engine = build_engine_for(recipe, onnx_path, out / "lm_head.plan", head.weight_format)
        if engine.built:
            files = files.model_copy(update={"plan": f"rank{rank}/lm_head.plan"})
    else:
        engine = EngineRecord(built=False, reason="ONNX export disabled in [output]")
    embedding_verify: VerifyRecord | None = None
    embedding_engine: EngineRecord | None = None
    if recipe.embedding.export:
        files, embedding_verify, embedding_engine = _build_embedding(recipe, rank, head, out, files, progress)
    entry = RankEntry(rank=rank, start=head.vocab_start, end=head.vocab_end, width=head.shard.width,
                      weight_format=head.weight_format, resident_bytes=head.resident_bytes(), files=files,
                      verify=verify, engine=engine, quant=describe_quant(head), embedding_verify=embedding_verify,
                      embedding_engine=embedding_engine)
    family = head.family or Family(head=head.head_ops)
    return entry, (head.vocab_size, head.hidden_size, family)


def build_engine_for(recipe: BuildRecipe, onnx_path: Path, plan_path: Path,
                     weight_format: WeightFormat | None = None) -> EngineRecord:
    """The engine stage of one graph: built with the recipe's ``[engine]`` compiler and targets, or
    skipped with the one-line reason (an error instead when ``[engine] require`` is set)."""
    from trtvocab.export import tensorrt as trt_export

    eng = recipe.engine
    ok, reason = trt_export.tensorrt_available(eng.compiler)
    if not ok:
        if eng.require:
            raise EngineUnavailableError(f"engine required but cannot be built: {reason}")
        return EngineRecord(built=False, reason=reason)
    try:
        info: EngineBuild = trt_export.build_engine(
            onnx_path, plan_path, profile=recipe.profile, workspace_bytes=eng.workspace_mib << 20,
            timing_cache_path=Path(eng.timing_cache) if eng.timing_cache else None, compiler=eng.compiler,
            targets=eng.targets, weight_format=weight_format, dequantize_fp4=recipe.quantization.dequantize_fp4,
            contract=eng.contract,
        )
    except EngineUnavailableError as exc:
        if eng.require:
            raise
        # Name the graph as the artifact will (rank{r}/lm_head.onnx), not by its staging path.
        return EngineRecord(built=False, reason=str(exc).replace(f"{onnx_path.parent.parent}/", ""))
    # Paths inside the staging folder are stale once the artifact is published: record them
    # relative to the rank folder.
    info = info.model_copy(update={"plan_path": Path(info.plan_path).name, "onnx_path": Path(info.onnx_path).name})
    return EngineRecord(built=True, build=info)


def describe_quant(head: LMHead) -> QuantRecord:
    d = head.quant_decision
    qc = head.quant_config
    stored = d.stored.value if d is not None and d.stored is not None else None
    if isinstance(qc, GGUFConfig):
        stored = f"GGUF {qc.block_type}"  # kept in its stored blocks
    return QuantRecord(
        weight_format=head.weight_format,
        label=head.label,
        config=qc,
        stored=stored,
        dequantized=bool(d.dequantize) if d is not None else False,
        reason=d.reason if d is not None else "synthetic weights",
    )


def build(recipe: BuildRecipe, out: Path | None = None, *, ranks: Sequence[int] | None = None, force: bool = False,
          progress: Progress | None = None) -> tuple[Path, Manifest]:
    """Build the recipe's artifact into ``out`` (default: the recipe's ``[output] dir``)."""
    tp = recipe.mapping.tp_size
    ranks = list(range(tp)) if ranks is None else sorted(set(ranks))
    bad = [r for r in ranks if not 0 <= r < tp]
    if bad:
        raise ConfigError(f"`ranks` {bad} out of range for tp_size {tp}")
    if recipe.engine.require and not recipe.output.onnx:  # engines are built from the ONNX graphs
        raise EngineUnavailableError("engine required ([engine] require / `require_engine`) but [output] onnx = "
                                     "false: an engine is built from the ONNX graph, so none can be; set "
                                     "[output] onnx = true or drop the requirement (nothing was written)")
    out = Path(out or recipe.output.dir)
    progress = progress or (lambda rank, stage: None)
    started = datetime.datetime.now(datetime.UTC)
    existed = os.path.lexists(out)
    # A full disk or a file-size limit anywhere below (weights, graphs, plans, the manifest, fsync) is a
    # WriteError naming the artifact and the file; staging removed its private folder, `out` is as it was.
    untouched = f"; nothing was published and {out} is as it was" if existed else "; nothing was published"
    with publish.writing(f"build `out` {out}", note=untouched), artifacts.staging(out, force=force) as stage:
        built = [build_rank(recipe, r, stage, progress) for r in ranks]
        entries = [entry for entry, _ in built]
        vocab, hidden, family = built[0][1]
        manifest = Manifest(
            format=artifacts.FORMAT, format_version=artifacts.FORMAT_VERSION,
            created=started.isoformat(timespec="seconds"), versions=artifacts.versions(), recipe=recipe,
            recipe_file=recipe.source,
            checkpoint=str(recipe.checkpoint_path()) if recipe.checkpoint.synthetic is None else "synthetic",
            checkpoint_sha256=None if recipe.checkpoint.synthetic is not None
            else head_digest(recipe.checkpoint_path(), recipe.checkpoint.tensor),
            head=HeadRecord(vocab_size=vocab, hidden_size=hidden, tensor=recipe.checkpoint.tensor, family=family,
                            **recipe.lm_head.model_dump()),
            mapping=recipe.mapping, quant=entries[0].quant, profile=recipe.profile, ranks=entries,
            ranks_built=ranks,
            backends=BackendsRecord(onnx=recipe.output.onnx, tensorrt=all(e.engine.built for e in entries)),
        )
        manifest = artifacts.write_manifest(stage, manifest)
    return out, manifest
