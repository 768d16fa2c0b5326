"""compressed-tensors checkpoints written by the compressed-tensors library itself (CPU, no hub).

A two-module model (``model.embed_tokens`` an ``nn.Embedding``, ``lm_head`` an ``nn.Linear``, as in
HF causal LMs) gets a ``QuantizationConfig`` through the library's ``apply_quantization_config``,
min/max calibration through its ``calculate_qparams`` / ``generate_gparam``, and is compressed by
``ModelCompressor.compress_model`` and described by ``ModelCompressor.update_config`` -- what
llm-compressor's ``oneshot`` + ``save_pretrained`` do. trtvocab writes nothing here.

:func:`library_decompress` is the reference every read is compared with: the library's own
``BaseCompressor.decompress`` of one module's stored tensors under its stored scheme.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

HEAD, EMBED = "lm_head", "model.embed_tokens"
INPUT_AMAX = 4.0  # the static activation amax the calibration stores (FP8 input_scale, NVFP4 input global scale)
# preset -> (library preset, edit): the library's presets, and weight-only / per-tensor-dynamic variants of them.
PRESETS = ("FP8", "FP8_DYNAMIC", "FP8_TENSOR_DYNAMIC", "FP8_W8A16_TENSOR", "FP8_W8A16_CHANNEL", "NVFP4", "NVFP4A16",
           "FP8_BLOCK")


def scheme(preset: str, targets: list[str]) -> QuantizationScheme:
    """A library scheme for ``preset`` (see :data:`PRESETS`)."""
    if preset == "FP8_W8A16_TENSOR":
        s = preset_name_to_scheme("FP8", targets)
        s.input_activations = None
        return s
    if preset == "FP8_W8A16_CHANNEL":
        s = preset_name_to_scheme("FP8_DYNAMIC", targets)
        s.input_activations = None
        return s
    if preset == "FP8_TENSOR_DYNAMIC":
        s = preset_name_to_scheme("FP8", targets)
        s.input_activations = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=True,
                                               symmetric=True)
        return s
    return preset_name_to_scheme(preset, targets)


class TwoModules(nn.Module):
    """``model.embed_tokens`` + ``lm_head``, the names and classes of an HF causal LM."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


def _calibrate(module: nn.Module) -> None:
    """Min/max calibration with the library's helpers (what llm-compressor's observers compute)."""
    w, args = module.weight.data, module.quantization_scheme.weights
    global_scale = None
    if args.strategy == QuantizationStrategy.TENSOR_GROUP:
        global_scale = generate_gparam(w.amin(), w.amax())
        module.weight_global_scale.data.copy_(global_scale)
        blocks = w.unflatten(-1, (-1, args.group_size))
        lo, hi = blocks.amin(-1), blocks.amax(-1)
    elif args.strategy == QuantizationStrategy.CHANNEL:
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == QuantizationStrategy.BLOCK:
        bh, bw = args.block_structure
        tiles = w.unflatten(0, (-1, bh)).unflatten(-1, (-1, bw))
        lo, hi = tiles.amin((1, 3)), tiles.amax((1, 3))
    else:
        lo, hi = w.amin()[None], w.amax()[None]
    scale = calculate_qparams(lo, hi, args, global_scale=global_scale)[0]
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "input_global_scale"):
        module.input_global_scale.data.fill_(448 * 6 / INPUT_AMAX)
    if hasattr(module, "input_scale"):
        module.input_scale.data.fill_(INPUT_AMAX / 448)
    module.quantization_status = QuantizationStatus.FROZEN


def write_ct(path: Path, vocab: int, hidden: int, *, head: str | None = None, embed: str | None = None,
             head_weight: torch.Tensor | None = None, embed_weight: torch.Tensor | None = None,
             dtype: torch.dtype = torch.bfloat16, head_targets: list[str] | None = None,
             embed_targets: list[str] | None = None, ignore: list[str] | None = None, tied: bool = False,
             save_compressed: bool = True, seed: int = 0, config: dict[str, Any] | None = None) -> Path:
    """Write ``path/model.safetensors`` + ``path/config.json`` through the library.

    ``head`` / ``embed``: a :data:`PRESETS` name or None (dense). ``tied``: config.json says
    ``tie_word_embeddings: true``; a dense head is then not stored (the tied embedding is the head).
    """
    torch.manual_seed(seed)
    model = TwoModules(vocab, hidden)
    with torch.no_grad():
        if head_weight is not None:
            model.lm_head.weight.copy_(head_weight)
        if embed_weight is not None:
            model.model.embed_tokens.weight.copy_(embed_weight)
    model.to(dtype)
    groups: dict[str, QuantizationScheme] = {}
    if embed is not None:
        groups["group_0"] = scheme(embed, embed_targets or ["re:.*embed_tokens$"])
    if head is not None:
        groups["group_1"] = scheme(head, head_targets or ["lm_head"])
    comp = None
    if groups:
        apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=ignore or []),
                                  show_progress=False)
        for module in (model.lm_head, model.model.embed_tokens):
            if getattr(module, "quantization_scheme", None) is not None:
                _calibrate(module)
        if save_compressed:
            comp = ModelCompressor.from_pretrained_model(model)
            comp.compress_model(model)
        else:
            comp = ModelCompressor.from_pretrained_model(model, quantization_format="dense")
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if tied and head is None:
        state = {k: v for k, v in state.items() if not k.startswith(HEAD + ".")}
    save_file(state, str(path / "model.safetensors"))
    cfg = {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "tie_word_embeddings": tied,
           **(config or {})}
    (path / "config.json").write_text(json.dumps(cfg))
    if comp is not None:
        comp.update_config(str(path))
    return path


def head_checkpoint(root: Path, name: str, preset: str = "FP8_W8A16_TENSOR", vocab: int = 64,
                    hidden: int = 32) -> Path:
    """``root / name``: only the head quantized, with ``preset`` (seed 2): what the hostile tests edit."""
    return write_ct(root / name, vocab, hidden, head=preset, embed=None, seed=2)


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def edit_config(path: Path, edit: Any) -> None:
    """``edit(quantization_config)`` in place (for hand-made disagreements)."""
    cfg = read_config(path)
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def module_tensors(path: Path, module: str) -> dict[str, torch.Tensor]:
    """``module``'s stored tensors, prefix stripped."""
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        return {k[len(module) + 1:]: fh.get_tensor(k) for k in fh.keys() if k.startswith(module + ".")}


def rewrite_tensors(path: Path, edit: Any) -> None:
    """``edit(tensors)`` -> the tensors written back (for hand-made disagreements)."""
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    save_file({k: v.contiguous() for k, v in edit(tensors).items()}, str(path / "model.safetensors"))


def stored_scheme(path: Path, module: str, classes: tuple[str, ...]) -> QuantizationScheme:
    """The scheme of the config group whose targets name ``module`` (exact, regex or class)."""
    import re

    qc = read_config(path)["quantization_config"]
    for group in qc["config_groups"].values():
        for target in group["targets"]:
            hit = re.match(target[3:], module) if target.startswith("re:") else target in (module, *classes)
            if hit:
                sch = QuantizationScheme.model_validate(group)
                if sch.format is None:
                    sch.format = qc["format"]
                return sch
    raise KeyError(module)


def library_decompress(path: Path, module: str, classes: tuple[str, ...]) -> torch.Tensor:
    """compressed-tensors' own ``decompress`` of ``module``'s stored tensors: the reference."""
    sch = stored_scheme(path, module, classes)
    compressor = BaseCompressor.get_value_from_registry(sch.format)
    return compressor.decompress(module_tensors(path, module), sch)["weight"]


def modelopt_twin(ct_path: Path, out: Path, algo: str) -> Path:
    """A ModelOpt-format checkpoint holding the same head bytes as ``ct_path``'s (its conventions:
    ``weight``, fp32 scales, ``weight_scale_2 = 1 / weight_global_scale``, ``input_scale =
    1 / input_global_scale``), with an ``hf_quant_config.json``."""
    t = module_tensors(ct_path, HEAD)
    one = torch.ones((), dtype=torch.float32)
    if algo == "NVFP4":
        tensors = {"weight": t["weight_packed"], "weight_scale": t["weight_scale"],
                   "weight_scale_2": one / t["weight_global_scale"].float().reshape(())}
        if "input_global_scale" in t:
            tensors["input_scale"] = one / t["input_global_scale"].float().reshape(())
    else:
        scale = t["weight_scale"].float()
        tensors = {"weight": t["weight"],
                   "weight_scale": scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1)}
        if "input_scale" in t:
            tensors["input_scale"] = t["input_scale"].float().reshape(())
    out.mkdir(parents=True, exist_ok=True)
    vocab = tensors["weight"].shape[0]
    hidden = tensors["weight"].shape[1] * (2 if algo == "NVFP4" else 1)
    save_file({**{f"{HEAD}.{k}": v.contiguous() for k, v in tensors.items()},
               f"{EMBED}.weight": torch.zeros(vocab, hidden, dtype=torch.bfloat16)}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    (out / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": algo, "group_size": 16,
                                                            "exclude_modules": []}}))
    return out
