"""Quantize a checkpoint's LM head with ModelOpt (ModelOpt's export format) or with the
compressed-tensors library (``checkpoint_format="compressed-tensors"``,
:mod:`trtvocab.quant.ct_export`), on the CPU.

Only the head is touched: wrapped as ``nn.Linear(H, V, bias=False)`` named ``lm_head``,
quantized with ``modelopt.torch.quantization``'s stock FP8 / NVFP4 presets (their ``*lm_head*``
exclusion switched back on), calibrated (max calibrator) on the given hidden states, and
exported with ModelOpt's per-layer export helpers. Without calibration data no activation
scale is written: FP8 then runs with dynamic per-tensor activations and NVFP4 as W4A16. Both
formats are written from the same dense head, with the same ``calib`` semantics, the head
untied when it is the tied embedding, and the same marker, tokenizer files and gate. The
tensors written and why it all runs on the CPU: the section "what is written" of
:mod:`trtvocab.quant.modelopt_export`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from trtvocab.base.dtypes import DTYPES
from trtvocab.base.family import Family
from trtvocab.base.formats import QUANTIZED_FORMATS, Activation, CheckpointFormat
from trtvocab.base.publish import check_destination, check_target, default_mode, staging, writing
from trtvocab.base.safe_read import load_json_file
from trtvocab.checkpoints.checkpoint import Checkpoint, open_checkpoint
from trtvocab.checkpoints.families import family_of, hf_config_fields
from trtvocab.checkpoints.hidden_file import load_hidden
from trtvocab.checkpoints.names import LM_HEAD_NAME
from trtvocab.errors import CheckpointError, QuantizationError, TrtVocabError
from trtvocab.quant.config import QuantAlgo, QuantConfig, stored_format
from trtvocab.quant.ct_export import calib_range, compress_head, import_compressed_tensors, modelopt_named
from trtvocab.quant.modelopt_export import (
    DEFAULT_BATCH_ROWS,
    ProgressFn,
    check_batch_rows,
    check_calib,
    hf_quant_config,
    modelopt_config,
    quantize_head,
)
from trtvocab.quant.writer import quantize_head_tensors
from trtvocab.version import __version__

# Files copied next to the quantized head so the output still decodes token ids.
TOKENIZER_COPY = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)
# The marker every output folder gets: ``force`` replaces only a folder whose marker parses
# as this (a foreign ModelOpt checkpoint has hf_quant_config.json too, and is never ours).
MARKER = "trtvocab_quantize.json"
MARKER_FORMAT = "trtvocab-quantized-checkpoint"
MARKER_VERSION = 1
# A gate sees the quantized tensors (lm_head.* names) and their QuantConfig before anything is
# written, and returns one line per missed threshold: any line and nothing is published.
GateFn = Callable[[dict[str, torch.Tensor], QuantConfig], list[str]]
SCALE_SEARCHES = ("max", "mse", "mse-act")


@dataclass(frozen=True)
class QuantizeResult:
    """What :func:`quantize_checkpoint` wrote, for the CLI and reports."""

    out: Path
    algo: QuantAlgo
    activation: Activation  # static: input_scale written; dynamic: FP8 without it; none: W4A16 / weight-only
    source_tensor: str
    tied: bool
    vocab_size: int
    hidden_size: int
    weight_amax: float
    input_amax: float | None
    calib_rows: int
    tensors: dict[str, tuple[str, list[int]]]  # name -> (dtype, shape) as written
    notes: list[str] = field(default_factory=list)
    scale_search: str = "max"  # NVFP4 block scales: "max" (ModelOpt's amax / 6), "mse" / "mse-act" (searched)
    published: bool = True  # False: a gate failed and nothing was written
    gate_failures: list[str] = field(default_factory=list)
    checkpoint_format: CheckpointFormat = CheckpointFormat.MODELOPT  # whose tensor names and conventions

    @property
    def label(self) -> str:
        """The label ``LMHead.from_checkpoint(out)`` runs with (``weight_only`` at load gives W8A16)."""
        return QuantConfig(quant_algo=self.algo, activation=self.activation).label


def parse_format(checkpoint_format: Any) -> str:
    """``checkpoint_format``: ``modelopt`` (the default) or ``compressed-tensors``; a QuantizationError
    otherwise."""
    if not isinstance(checkpoint_format, str) or checkpoint_format.strip().lower() not in QUANTIZED_FORMATS:
        raise QuantizationError(f"`checkpoint_format` must be one of {', '.join(QUANTIZED_FORMATS)}, "
                                f"got {checkpoint_format!r:.80}")
    return CheckpointFormat(checkpoint_format.strip().lower())


def parse_algo(algo: str | QuantAlgo) -> QuantAlgo:
    value = QuantAlgo.parse(algo, "`algo`")
    if value not in (QuantAlgo.FP8, QuantAlgo.NVFP4):
        raise QuantizationError(f"`algo` must be fp8 or nvfp4, got {algo!r}")
    return value


def is_quantized_output(path: Path) -> bool:
    """Whether ``path`` is a folder ``trtvocab quantize`` wrote: its :data:`MARKER` is a regular
    JSON file with ``"format": "trtvocab-quantized-checkpoint"``. The only test ``force`` trusts."""

    try:
        raw = load_json_file(Path(path) / MARKER, "quantize marker", max_bytes=1 << 20)
    except TrtVocabError:
        return False
    return isinstance(raw, dict) and raw.get("format") == MARKER_FORMAT


def read_head(ckpt: Checkpoint, tensor_name: str | None) -> tuple[str, bool, torch.Tensor]:
    """``(name, tied, weight [V, H])`` of the dense head; quantized bytes are refused."""
    name, tied = ckpt.lm_head_name(tensor_name)
    stored = stored_format(ckpt, name)
    if stored is not None:
        raise QuantizationError(
            f"{ckpt.path}: {name} is already stored as {stored.value}; quantize the dense checkpoint "
            "(re-quantizing quantized values would compound their error)"
        )
    weight = ckpt.read(name)
    if weight.dim() != 2 or weight.dtype not in DTYPES:
        raise CheckpointError(f"{name}: expected a dense float [V, H] tensor, got {weight.dtype} {list(weight.shape)}")
    return name, tied, weight


def _untied_config(ckpt: Checkpoint, family: Family, vocab: int, hidden: int) -> dict[str, Any]:
    """The source ``config.json`` with the head untied and no quantization_config (the writer adds its own);
    a GGUF source's ``family`` in transformers' terms (:func:`~trtvocab.checkpoints.families.hf_config_fields`)."""

    config = dict(ckpt.config)
    config.update(hf_config_fields(ckpt, family))
    config.pop("quantization_config", None)
    config.setdefault("vocab_size", vocab)
    config.setdefault("hidden_size", hidden)
    # The head is written as its own lm_head.*: the output declares it untied, as llm-compressor does
    # for a tied head it quantizes (a stored head is the head either way, by the gating rule).
    config["tie_word_embeddings"] = False
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
    return config


def _output_config(ckpt: Checkpoint, family: Family, hf_quant: dict[str, Any], vocab: int, hidden: int,
                   has_input_scale: bool) -> dict[str, Any]:
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    config = _untied_config(ckpt, family, vocab, hidden)
    quant = convert_hf_quant_config_format(hf_quant)
    if not has_input_scale:
        for group in quant.get("config_groups", {}).values():
            group.pop("input_activations", None)  # no static activation scale was written
    config["quantization_config"] = quant
    return config


def load_calibration(path: str | Path) -> torch.Tensor:

    hidden, _ = load_hidden(path)
    return hidden


def quantize_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    algo: str | QuantAlgo,
    calib: torch.Tensor | str | Path | None = None,
    weight_only: bool = False,
    tensor_name: str | None = None,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    force: bool = False,
    progress: ProgressFn | None = None,
    scale_search: str = "max",
    gate: GateFn | None = None,
    checkpoint_format: str = CheckpointFormat.MODELOPT,
) -> QuantizeResult:
    """Quantize the LM head of ``checkpoint`` into a new ModelOpt-format directory ``out``
    (``checkpoint_format="compressed-tensors"``: a compressed-tensors directory, written by that library).

    ``calib`` (a ``[T, H]`` tensor or a ``.safetensors`` with ``hidden_states``) gives
    the static activation scale (FP8 W8A8 / NVFP4 W4A4); without it, or with
    ``weight_only``, no ``input_scale`` is written. ``out`` is published atomically, with a
    :data:`MARKER` file (format name and version); ``force`` replaces only a folder holding
    such a marker (:func:`is_quantized_output`), never a foreign checkpoint.

    ``scale_search="mse"`` (NVFP4) replaces ModelOpt's ``amax / 6`` block scales with the
    per-block MSE search of :func:`trtvocab.quant.nvfp4.block_scales_mse` (same global scale,
    same tensors, same gating). ``gate`` judges the quantized tensors before anything is
    written; when it returns failure lines the result has ``published=False`` and ``out`` is
    left untouched.

    compressed-tensors: FP8 with ``calib`` is the library's ``FP8`` preset (static per-tensor
    ``input_scale``), without it FP8 with dynamic per-tensor activations, ``weight_only`` FP8
    W8A16 (``input_activations: null``); NVFP4 with ``calib`` is ``NVFP4`` (W4A4,
    ``input_global_scale``), otherwise ``NVFP4A16``. The group targets ``lm_head`` by name and
    ``ignore`` is empty; ``scale_search`` must be ``max`` (the library computes the block scales).
    """
    quant_algo = parse_algo(algo)
    fmt = parse_format(checkpoint_format)
    if fmt == CheckpointFormat.COMPRESSED_TENSORS and scale_search != "max":
        raise QuantizationError(f"`scale_search` {scale_search} is for `checkpoint_format` "
                                f"{CheckpointFormat.MODELOPT}: with `checkpoint_format` "
                                f"{CheckpointFormat.COMPRESSED_TENSORS} the compressed-tensors library computes the "
                                "block scales")
    if scale_search not in SCALE_SEARCHES:
        raise QuantizationError(f"`scale_search` must be one of {', '.join(SCALE_SEARCHES)}, got {scale_search!r}")
    if scale_search != "max" and quant_algo is not QuantAlgo.NVFP4:
        raise QuantizationError(f"`scale_search` {scale_search} is for `algo` nvfp4 (its per-block scales)")
    check_batch_rows(batch_rows)
    if weight_only and calib is not None and scale_search != "mse-act":
        raise QuantizationError("`weight_only` writes no activation scale: drop `calib` (or `weight_only`)")
    if scale_search == "mse-act" and calib is None:
        raise QuantizationError("`scale_search` mse-act weights the search by calibration activations: "
                                "give `calib` (with `weight_only` for W4A16)")
    if fmt == CheckpointFormat.COMPRESSED_TENSORS:

        import_compressed_tensors()  # before the work
    check_target(Path(out), force, is_quantized_output)  # before the work: never minutes of it for a refusal
    check_destination(Path(out), "`out`")
    ckpt = open_checkpoint(checkpoint)
    name, tied, weight = read_head(ckpt, tensor_name)
    vocab, hidden = weight.shape

    # The family (computed once): its bias goes with the head (float32, as stored); its scale / soft-cap go in
    # config.json (_untied_config).
    family = family_of(ckpt, head_tensor=name, hidden_size=hidden, need_embedding=False)
    extra = {"lm_head.bias": ckpt.read(family.bias_tensor).float()} if family.bias_tensor else {}
    if extra and fmt == CheckpointFormat.COMPRESSED_TENSORS:
        raise QuantizationError(f"`checkpoint_format` {CheckpointFormat.COMPRESSED_TENSORS}: the head has a bias "
                                f"({family.bias_tensor}); write it with `checkpoint_format` "
                                f"{CheckpointFormat.MODELOPT}")
    if isinstance(calib, (str, Path)):
        calib = load_calibration(calib)
    calib_rows = 0 if calib is None else int(calib.shape[0])
    if fmt == CheckpointFormat.COMPRESSED_TENSORS:
        return _quantize_ct(ckpt, family, checkpoint, Path(out), quant_algo, name, tied, weight,
                            None if weight_only or calib is None else calib, weight_only=weight_only,
                            calib_rows=calib_rows, batch_rows=batch_rows, force=force, progress=progress, gate=gate)
    column_weights = None
    if scale_search == "mse-act":
        assert calib is not None
        column_weights = check_calib(calib, hidden).to(weight.dtype).double().square().mean(0)
    tensors, weight_amax, input_amax = quantize_head(weight, quant_algo, None if weight_only else calib,
                                                    batch_rows=batch_rows, progress=progress)
    notes: list[str] = []
    if scale_search != "max":
        _search_nvfp4_scales(tensors, weight, column_weights)
        notes.append("NVFP4 block scales chosen by per-block MSE search (e4m3 codes around amax / 6"
                     + ("; squared error weighted by the calibration rows' E[h^2] per column" if column_weights
                        is not None else "") + "); weight_scale_2 and input_scale are ModelOpt's")
    if tied:
        notes.append(f"the head is the tied input embedding {name}: it is written as an untied lm_head.weight "
                     "and the output's config.json sets tie_word_embeddings=false, so the gating rule "
                     "quantizes it")
    has_input = "lm_head.input_scale" in tensors
    if quant_algo is QuantAlgo.FP8:
        activation = Activation.STATIC if has_input else Activation.DYNAMIC
        if not has_input:
            notes.append("no input_scale written: FP8 activations are quantized dynamically per tensor "
                         "(LMHead.from_checkpoint(..., weight_only=True) runs it as W8A16)")
    else:
        activation = Activation.STATIC if has_input else Activation.NONE
        if not has_input:
            notes.append("no input_scale written: NVFP4 runs as W4A16")
    hf_quant = hf_quant_config(quant_algo)
    out = Path(out)
    written = {k: (str(v.dtype).replace("torch.", ""), list(v.shape)) for k, v in tensors.items()}
    result = QuantizeResult(out=out, algo=quant_algo, activation=activation, source_tensor=name, tied=tied,
                            vocab_size=vocab, hidden_size=hidden, weight_amax=weight_amax, input_amax=input_amax,
                            calib_rows=calib_rows, tensors=written, notes=notes, scale_search=scale_search)
    if gate is not None:
        failures = gate(tensors, QuantConfig(quant_algo=quant_algo, activation=activation))
        if failures:
            return replace(result, published=False, gate_failures=list(failures))
    from safetensors.torch import save_file

    with writing(f"quantize `out` {out}", note=_untouched(out)), \
            staging(out, force=force, is_ours=is_quantized_output) as stage:

        marker = {"format": MARKER_FORMAT, "format_version": MARKER_VERSION, "trtvocab": __version__,
                  "algo": quant_algo.value, "source": str(checkpoint), "tensor": name, "scale_search": scale_search,
                  "checkpoint_format": CheckpointFormat.MODELOPT}
        (stage / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        producer = "trtvocab quantize (modelopt export" + ("; NVFP4 block scales by MSE search)"
                                                           if scale_search == "mse" else ")")
        metadata = {"format": "pt", "producer": producer}
        save_file({**tensors, **extra}, str(stage / "model.safetensors"), metadata=metadata)
        default_mode(stage / "model.safetensors")  # readable as config.json is (not safetensors' 0600)
        (stage / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n")
        config = _output_config(ckpt, family, hf_quant, vocab, hidden, has_input)
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for fname in TOKENIZER_COPY:
            src = ckpt.directory / fname
            if src.is_file():
                shutil.copy2(src, stage / fname)
    return result


def _untouched(out: Path) -> str:
    """What a failed write leaves (the note of a WriteError): staging removed its private folder."""
    return f"; nothing was published and {out} is as it was" if os.path.lexists(out) else "; nothing was published"


def _quantize_ct(ckpt: Checkpoint, family: Family, checkpoint: str | Path, out: Path, algo: QuantAlgo, name: str,
                 tied: bool, weight: torch.Tensor, calib: torch.Tensor | None, *, weight_only: bool, calib_rows: int,
                 batch_rows: int, force: bool, progress: ProgressFn | None, gate: GateFn | None) -> QuantizeResult:
    """The compressed-tensors branch of :func:`quantize_checkpoint` (``calib`` None: no static scale)."""

    vocab, hidden = weight.shape
    notes: list[str] = []
    if calib is not None:
        activation = Activation.STATIC
        rng = calib_range(check_calib(calib, hidden), weight.dtype, batch_rows, progress)
    else:
        rng = None
        activation = Activation.NONE if weight_only or algo is QuantAlgo.NVFP4 else Activation.DYNAMIC
    head = compress_head(weight, algo, activation, calib_range_=rng)
    scale_dtype = str(head.tensors["lm_head.weight_scale"].dtype).replace("torch.", "")
    if algo is QuantAlgo.FP8:
        notes.append(f"compressed-tensors FP8: weight_scale{' and input_scale' if rng is not None else ''} in the "
                     f"model dtype ({scale_dtype}), the weight divided by it in that dtype (ModelOpt: float32)")
        if activation is Activation.DYNAMIC:
            notes.append("no input_scale written: input_activations dynamic per tensor (trtvocab's and TensorRT-LLM's "
                         "dynamic mode; llm-compressor's FP8_DYNAMIC preset is per token)")
        elif activation is Activation.NONE:
            notes.append("input_activations: null (naive-quantized): FP8 W8A16")
    else:
        notes.append("compressed-tensors NVFP4: weight_global_scale = 448 * 6 / amax (ModelOpt's weight_scale_2 is "
                     "its reciprocal), block scales e4m3(global_scale * amax_block / 6)"
                     + ("; input_global_scale = 448 * 6 / activation amax" if rng is not None else
                        "; no input_global_scale: NVFP4A16 (W4A16)"))
    if tied:
        notes.append(f"the head is the tied input embedding {name}: it is written as an untied lm_head.* and the "
                     "output's config.json sets tie_word_embeddings=false (as llm-compressor does)")
    written = {k: (str(v.dtype).replace("torch.", ""), list(v.shape)) for k, v in head.tensors.items()}
    result = QuantizeResult(out=out, algo=algo, activation=activation, source_tensor=name, tied=tied,
                            vocab_size=vocab, hidden_size=hidden, weight_amax=head.weight_amax,
                            input_amax=head.input_amax, calib_rows=calib_rows, tensors=written, notes=notes,
                            checkpoint_format=CheckpointFormat.COMPRESSED_TENSORS)
    if gate is not None:
        failures = gate(modelopt_named(head.tensors, algo), QuantConfig(quant_algo=algo, activation=activation))
        if failures:
            return replace(result, published=False, gate_failures=list(failures))
    from safetensors.torch import save_file

    with writing(f"quantize `out` {out}", note=_untouched(out)), \
            staging(out, force=force, is_ours=is_quantized_output) as stage:

        marker = {"format": MARKER_FORMAT, "format_version": MARKER_VERSION, "trtvocab": __version__,
                  "algo": algo.value, "source": str(checkpoint), "tensor": name, "scale_search": "max",
                  "checkpoint_format": CheckpointFormat.COMPRESSED_TENSORS,
                  "compressed_tensors": head.library_version}
        (stage / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        metadata = {"format": "pt", "producer": f"trtvocab quantize (compressed-tensors {head.library_version})"}
        save_file(head.tensors, str(stage / "model.safetensors"), metadata=metadata)
        default_mode(stage / "model.safetensors")  # readable as config.json is (not safetensors' 0600)
        (stage / "config.json").write_text(json.dumps(_untied_config(ckpt, family, vocab, hidden), indent=2) + "\n")
        head.compressor.update_config(str(stage))  # the library writes quantization_config
        for fname in TOKENIZER_COPY:
            src = ckpt.directory / fname
            if src.is_file():
                shutil.copy2(src, stage / fname)
    return result


def _search_nvfp4_scales(tensors: dict[str, torch.Tensor], weight: torch.Tensor,
                         column_weights: torch.Tensor | None) -> None:
    """Replace ModelOpt's NVFP4 ``weight`` / ``weight_scale`` with the MSE-searched ones, in place.

    The global scale (``weight_scale_2``) is ModelOpt's; trtvocab's own numerics reproduce
    it bit for bit (tested), which is checked here again before anything is swapped.
    """

    searched = quantize_head_tensors(weight, QuantConfig(quant_algo=QuantAlgo.NVFP4, activation=Activation.NONE),
                                     scale_search="mse", column_weights=column_weights)
    if not torch.equal(searched["weight_scale_2"].reshape(()), tensors["lm_head.weight_scale_2"].reshape(())):
        raise QuantizationError("NVFP4 MSE scale search: the global scale differs from ModelOpt's "
                                f"({float(searched['weight_scale_2'])} vs {float(tensors['lm_head.weight_scale_2'])})")
    tensors["lm_head.weight"] = searched["weight"].contiguous()
    tensors["lm_head.weight_scale"] = searched["weight_scale"].contiguous()


__all__ = ["LM_HEAD_NAME", "GateFn", "QuantizeResult", "hf_quant_config", "modelopt_config",
           "parse_format", "quantize_checkpoint", "quantize_head", "read_head"]
