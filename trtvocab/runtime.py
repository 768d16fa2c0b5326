"""Run a built artifact: verify it, pick a backend, compute each rank's logits, gather.

Backends, in the order ``auto`` tries them::

    tensorrt      rank{r}/lm_head.plan on a CUDA GPU (engine built for this GPU)
    onnxruntime   rank{r}/lm_head.onnx on CPU (FP4 graphs: onnx.reference, see export)
    torch         rank{r}/weights.safetensors through the PyTorch LMHead (always there)

Every backend yields the same per-rank ``[B, V_local]`` float32 logits (within the
tolerance the build recorded); the gather across ranks is the head's own code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from trtvocab import artifacts
from trtvocab import distributed as D
from trtvocab.errors import ArtifactError, EngineUnavailableError, InputError
from trtvocab.lm_head import HEAD_DTYPES, LMHead
from trtvocab.logits import last_token_rows, shard_logits
from trtvocab.mapping import Mapping
from trtvocab.quant.config import QuantConfig

BACKENDS = ("auto", "tensorrt", "onnxruntime", "torch")
# Graphs onnxruntime CPU has no kernels for run on onnx.reference; recorded here for reporting.
RUNNERS_USED: set[str] = set()


def head_from_artifact(root: Path, manifest: dict[str, Any], rank: int, process_group: Any = None) -> LMHead:
    """The PyTorch fallback head of ``rank``, from its saved shard."""
    h, m = manifest["head"], manifest["mapping"]
    tp = m["tp_size"]
    qc = manifest["quant"]["config"]
    head = LMHead(
        h["vocab_size"], h["hidden_size"], dtype=HEAD_DTYPES[h["dtype"]],
        mapping=Mapping(world_size=tp, rank=rank, tp_size=tp, enable_attention_dp=m["enable_attention_dp"],
                        enable_lm_head_tp_in_adp=m["enable_lm_head_tp_in_adp"]),
        gather_output=True, quant_config=QuantConfig.model_validate(qc) if qc else None,
        vocab_layout=h["vocab_layout"], pad_to=h["pad_to"], process_group=process_group,
    )
    head.load_weights(load_file(str(artifacts.rank_dir(root, rank) / "weights.safetensors")))
    return head


def current_gpu() -> dict[str, Any] | None:
    """Name and compute capability of CUDA device 0, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}"}


def engine_mismatch(engine: dict[str, Any], gpu: dict[str, Any] | None, trt_version: str | None) -> str | None:
    """Why an engine built for ``engine['gpu']`` with ``engine['tensorrt_version']`` cannot run here.

    TensorRT engines are specific to the GPU model and the TensorRT version that built
    them; running one elsewhere fails or, worse, runs kernels tuned for another chip.
    """
    built_gpu, built_trt = engine.get("gpu") or {}, engine.get("tensorrt_version")
    if gpu is None:
        return "no CUDA GPU here"
    if built_gpu.get("name") != gpu.get("name") or built_gpu.get("compute_capability") != gpu.get(
        "compute_capability"
    ):
        return (f"engine was built for {built_gpu.get('name')} (CC {built_gpu.get('compute_capability')}), "
                f"this GPU is {gpu.get('name')} (CC {gpu.get('compute_capability')}); rebuild it here")
    if trt_version is not None and built_trt is not None and built_trt != trt_version:
        return f"engine was built with TensorRT {built_trt}, this is TensorRT {trt_version}; rebuild it"
    return None


def available_backends(manifest: dict[str, Any]) -> dict[str, str | None]:
    """backend -> None if usable, else why not."""
    out: dict[str, str | None] = {"torch": None}
    if not manifest["backends"].get("onnx"):
        out["onnxruntime"] = "the artifact has no ONNX graphs"
    else:
        try:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401

            out["onnxruntime"] = None
        except ImportError as exc:
            out["onnxruntime"] = f"onnxruntime is not installed ({exc.name})"
    if not manifest["backends"].get("tensorrt"):
        reasons = {e["engine"].get("reason") for e in manifest["ranks"] if not e["engine"]["built"]}
        out["tensorrt"] = "no engine in the artifact" + (f": {'; '.join(sorted(r for r in reasons if r))}"
                                                         if reasons else "")
    else:
        from trtvocab.export.tensorrt import tensorrt_available

        ok, reason = tensorrt_available()
        if ok:
            import tensorrt  # type: ignore[import-not-found]

            gpu = current_gpu()
            mismatches = [(e["files"].get("plan"), engine_mismatch(e["engine"], gpu, tensorrt.__version__))
                          for e in manifest["ranks"]]
            reason = "; ".join(f"{plan}: {why}" for plan, why in mismatches if why) or None
        out["tensorrt"] = reason if not ok or reason else None
    return out


def pick_backend(manifest: dict[str, Any], requested: str = "auto") -> tuple[str, dict[str, str | None]]:
    if requested not in BACKENDS:
        raise ArtifactError(f"--backend must be one of {BACKENDS}, got {requested!r}")
    usable = available_backends(manifest)
    if requested != "auto":
        if usable[requested] is not None:
            raise EngineUnavailableError(f"backend {requested} is not usable: {usable[requested]}")
        return requested, usable
    for name in ("tensorrt", "onnxruntime", "torch"):
        if usable[name] is None:
            return name, usable
    raise AssertionError("torch is always usable")


def rank_logits(root: Path, manifest: dict[str, Any], rank: int, backend: str, hidden: torch.Tensor,
                seq_lens: torch.Tensor | None) -> torch.Tensor:
    """This rank's ``[B, V_local]`` (or ``[T, V_local]`` for context artifacts) float32 logits."""
    context = manifest["head"]["context_logits"]
    head_dtype = HEAD_DTYPES[manifest["head"]["dtype"]]
    hidden = hidden.to(head_dtype)
    lens = seq_lens if seq_lens is not None else torch.tensor([hidden.shape[0]], dtype=torch.int32)
    if backend == "torch":
        head = head_from_artifact(root, manifest, rank)
        return shard_logits(head, hidden, lens, return_context_logits=context)
    path = artifacts.rank_dir(root, rank)
    if backend == "onnxruntime":
        from trtvocab.export.reference_ops import run_onnx

        out, runner = run_onnx(path / "lm_head.onnx", hidden, None if context else lens.to(torch.int32),
                               return_backend=True)
        if runner != "onnxruntime":  # e.g. bf16 or FP4 graphs, which onnxruntime CPU cannot run
            RUNNERS_USED.add(f"onnx.{runner}")
        return torch.from_numpy(out)
    from trtvocab.export.tensorrt import EngineRunner

    runner = EngineRunner(path / "lm_head.plan", manifest["ranks"][rank]["engine"])
    return runner.run(hidden, None if context else lens.to(torch.int32)).float().cpu()


def _infer_rank(rank: int, world: int, root: str, backend: str, hidden: torch.Tensor,
                seq_lens: torch.Tensor | None) -> torch.Tensor | None:
    manifest = artifacts.read_manifest(Path(root), verify=False)  # verified once by the parent
    error: Exception | None = None
    local = torch.empty(0, 0)
    try:
        local = rank_logits(Path(root), manifest, rank, backend, hidden, seq_lens)
    except Exception as exc:  # every rank hears of it in the handshake instead of waiting
        error = exc
    sizes = [e["end"] - e["start"] for e in manifest["ranks"]]
    ok = D.agree([manifest["head"]["vocab_size"], local.shape[0]], error, None, local.device, what="infer")
    D.check_same(ok, [0, 1], ["vocab_size", "rows"], "infer")
    full = D.all_gather_columns(local, sizes, None)
    return (full, sorted(RUNNERS_USED)) if rank == 0 else None


def infer(root: str | Path, hidden: torch.Tensor, seq_lens: torch.Tensor | None = None,
          backend: str = "auto") -> tuple[torch.Tensor, str, dict[str, Any]]:
    """Gathered float32 logits ``[B, V]`` of every rank of the artifact; returns (logits, backend, manifest)."""
    root = Path(root)
    manifest = artifacts.read_manifest(root)
    if len(manifest["ranks"]) != manifest["mapping"]["tp_size"]:
        raise ArtifactError(f"{root}: holds ranks {manifest['ranks_built']} of tp {manifest['mapping']['tp_size']};"
                            " inference needs all of them")
    chosen, _ = pick_backend(manifest, backend)
    width = manifest["head"]["hidden_size"]
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != width:
        raise InputError(f"hidden_states: expected shape [T, {width}] for {root}, "
                         f"got {list(getattr(hidden, 'shape', [])) or type(hidden).__name__}")
    if hidden.shape[0] == 0 or not hidden.dtype.is_floating_point:
        raise InputError(f"hidden_states: expected a non-empty floating-point [T, {width}] tensor, "
                         f"got {list(hidden.shape)} {hidden.dtype}")
    if seq_lens is not None:
        last_token_rows(seq_lens, hidden.shape[0])  # validate before any process starts
    tp = manifest["mapping"]["tp_size"]
    RUNNERS_USED.clear()
    vocab = manifest["head"]["vocab_size"]
    if all(e["start"] == 0 and e["end"] == vocab for e in manifest["ranks"]):
        # Replicated head (attention DP without LM-head TP): every rank holds all of it and
        # serves its own requests, so one rank computes the answer; nothing to gather.
        if D.is_initialized() and D.group_rank() != 0:
            return None, chosen, manifest  # type: ignore[return-value]
        logits = rank_logits(root, manifest, 0, chosen, hidden, seq_lens)
        return logits, _label(chosen, sorted(RUNNERS_USED)), manifest
    if D.is_initialized():  # under torchrun: this process is one rank
        if D.group_size() != tp:
            raise ArtifactError(f"{root}: built for tp {tp}, but torchrun started {D.group_size()} processes")
        out = _infer_rank(D.group_rank(), tp, str(root), chosen, hidden, seq_lens)
        return (None if out is None else out[0]), _label(chosen, out[1] if out else []), manifest  # type: ignore
    if tp == 1:
        logits = rank_logits(root, manifest, 0, chosen, hidden, seq_lens)
        return logits, _label(chosen, sorted(RUNNERS_USED)), manifest
    from trtvocab.launch import run_ranks

    logits, runners = run_ranks(_infer_rank, tp, str(root), chosen, hidden, seq_lens)[0]
    return logits, _label(chosen, runners), manifest


def _label(backend: str, runners: list[str]) -> str:
    """``onnxruntime`` or, when a graph needed it, ``onnxruntime (ran on onnx.reference)``."""
    return f"{backend} (ran on {', '.join(runners)}: no onnxruntime CPU kernel)" if runners else backend
