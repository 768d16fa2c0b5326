"""Which quantization the LM head runs with: the gating rule, for both checkpoint formats.

The head runs quantized exactly when the checkpoint *stores* it quantized (read from the
safetensors header: an ``F8_E4M3`` head with its ``weight_scale``, or a ``U8`` packed NVFP4 head
with its block and global scales) and its config *says* so (ModelOpt's ``hf_quant_config.json`` /
``quantization_config``, or a compressed-tensors ``config_groups`` target); a config and tensors
that disagree are refused (:class:`~trtvocab.errors.QuantizationError`) rather than guessed at.
It is forced dense when the head is the tied input embedding, under attention DP + LM-head TP,
with ``quant="none"``, or when it is excluded; a head stored quantized but forced dense is
dequantized exactly, with a warning. :func:`resolve_lm_head_quant` returns the verdict
(:class:`HeadQuantDecision`). The full rule: the section "the gating rule" below.
"""

from __future__ import annotations

import enum
import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from trtvocab.base.formats import Activation, CheckpointFormat, Granularity, WeightFormat
from trtvocab.checkpoints.checkpoint import open_checkpoint
from trtvocab.errors import QuantizationError
from trtvocab.quant import compressed_tensors as ct
from trtvocab.quant.nvfp4 import BLOCK

if TYPE_CHECKING:
    from trtvocab.checkpoints.checkpoint import Checkpoint
    from trtvocab.parallel.mapping import Mapping


# ---- the gating rule (the details behind resolve_lm_head_quant) -----------------------------------
# * **stored quantized** is read from the safetensors header (no tensor data): FP8 is an
#   ``F8_E4M3`` head with its ``weight_scale``; NVFP4 is a ``U8`` packed head with its E4M3 block
#   ``weight_scale`` and a global scale (``weight_scale_2`` in ModelOpt files,
#   ``weight_global_scale`` in compressed-tensors files, where the packed tensor is
#   ``lm_head.weight_packed``);
# * **the config says so**: ModelOpt (``hf_quant_config.json`` or a non-compressed-tensors
#   ``config.json`` ``quantization_config``) -- a per-layer entry (``MIXED_PRECISION``
#   ``quantized_layers``) names ``lm_head``, or a global ``quant_algo`` is set and the header holds
#   ``lm_head.weight_scale``; compressed-tensors (``quant_method: "compressed-tensors"``) -- a
#   ``config_groups`` target matches ``lm_head`` and no ``ignore`` entry does (exact name,
#   ``re:`` regex with ``re.match``, or class name ``Linear``: compressed-tensors' own matcher;
#   vLLM matches the head by name or regex only, see trtvocab.quant.compressed_tensors).
#
# Forced dense: the head is the tied input embedding, attention DP splits the head (LM-head TP
# in ADP), the user asks for ``quant="none"``, or (ModelOpt) ``lm_head`` matches
# ``exclude_modules`` / ``ignore`` (fnmatch). A head stored quantized but forced dense is
# dequantized exactly, with a warning: a stored scale is never ignored and quantized bytes are
# never read as dense values. ModelOpt heads dequantize in float32 (``q * s``, ModelOpt's
# ``QTensor.dequantize``); compressed-tensors heads as the library's ``decompress`` does (bit for
# bit). A stored ``lm_head`` is always the head, whatever ``tie_word_embeddings`` says: a
# quantized head is never replaced by the tied embedding.
#
# Disagreements refused (QuantizationError naming the file, the tensor and the config entry): a
# config entry that quantizes the head but no quantized tensors (or the wrong ones) in the
# header; ModelOpt: a global algo the stored bytes contradict (quantized bytes that no entry
# quantizes are dequantized exactly, with a warning, as ModelOpt's exports of an excluded head
# never hold them); compressed-tensors: quantized tensors that no config group covers (or that
# ``ignore`` names: the library could not decompress them either), a file saved uncompressed
# (``format: "dense"`` / ``quantization_status: "frozen"``: dense weights with scales beside them
# -- ``quant="none"`` loads the dense weights), scales of the wrong shape or dtype.


class QuantAlgo(str, enum.Enum):
    """The ``quant_algo`` names ModelOpt writes; only FP8 and NVFP4 run an LM head."""

    FP8 = "FP8"
    NVFP4 = "NVFP4"
    # Names ModelOpt writes for other layers; valid in a config, not runnable for the head.
    FP8_PER_CHANNEL_PER_TOKEN = "FP8_PER_CHANNEL_PER_TOKEN"
    FP8_BLOCK_SCALES = "FP8_BLOCK_SCALES"
    W4A16_AWQ = "W4A16_AWQ"
    W4A8_AWQ = "W4A8_AWQ"
    W8A16 = "W8A16"
    W4A16 = "W4A16"
    INT8_SQ = "INT8_SQ"
    NVFP4_AWQ = "NVFP4_AWQ"
    W4A8_NVFP4_FP8 = "W4A8_NVFP4_FP8"
    W4A8_MXFP4_FP8 = "W4A8_MXFP4_FP8"
    MXFP4 = "MXFP4"
    MXFP8 = "MXFP8"
    MIXED_PRECISION = "MIXED_PRECISION"

    @classmethod
    def parse(cls, value: Any, where: str) -> QuantAlgo | None:
        if value is None:
            return None
        try:
            if not isinstance(value, str):
                raise ValueError(value)
            return cls(value.upper())
        except ValueError:
            raise QuantizationError(
                f"{where}: unknown quant_algo {value!r}; known: {[a.value for a in cls]}"
            ) from None

    @property
    def weight_format(self) -> WeightFormat:
        """The format of a head quantized with this algo (FP8 or NVFP4); a QuantizationError for the others."""
        if self not in HEAD_ALGOS:
            raise QuantizationError(f"quant_algo {self.value} is not supported for the LM head; "
                                    f"supported: {[a.value for a in HEAD_ALGOS]}")
        return WeightFormat(self.value)

    @classmethod
    def of_format(cls, weight_format: WeightFormat) -> QuantAlgo:
        """The algo that runs a head stored as ``weight_format`` (FP8 or NVFP4)."""
        if weight_format not in (WeightFormat.FP8, WeightFormat.NVFP4):
            raise QuantizationError(f"a head stored as {weight_format} has no quant_algo (FP8 or NVFP4 only)")
        return cls(weight_format.value)


HEAD_ALGOS = (QuantAlgo.FP8, QuantAlgo.NVFP4)


class QuantConfig(BaseModel):
    """How the head's weights (and activations) are quantized.

    Args:
        quant_algo: ``FP8`` or ``NVFP4`` (other ModelOpt names parse, but no head runs them).
        activation: :class:`~trtvocab.base.formats.Activation`; ``static`` uses the checkpoint's
            ``input_scale`` (W8A8 / W4A4), ``dynamic`` computes the FP8 activation scale per
            tensor at run time (FP8 without ``input_scale``, as TensorRT-LLM does), ``none``
            keeps activations in the head dtype (W8A16 with ``weight_only``, or NVFP4
            without ``input_scale`` = W4A16).
        group_size: NVFP4 block size along H (16, the only one TensorRT runs).
        granularity: FP8 weight scale ``per_tensor`` (ModelOpt's format) or ``per_row`` (one
            scale per vocab row, an option beyond the checkpoint formats).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    quant_algo: QuantAlgo
    activation: Activation = Activation.STATIC
    group_size: int = BLOCK
    granularity: Granularity = Granularity.PER_TENSOR

    @property
    def weight_format(self) -> WeightFormat:
        """The weight format a head with this config stores (FP8 or NVFP4)."""
        return self.quant_algo.weight_format

    @property
    def label(self) -> str:
        if self.quant_algo is QuantAlgo.FP8:
            mode = {Activation.STATIC: "W8A8", Activation.DYNAMIC: "W8A8-dyn", Activation.NONE: "W8A16"}
            return f"FP8 {mode[self.activation]}" + (" per-row" if self.granularity is Granularity.PER_ROW else "")
        mode4 = "W4A4" if self.activation is Activation.STATIC else "W4A16"
        return f"NVFP4 {mode4}"


class HeadQuantDecision(BaseModel):
    """What :func:`resolve_lm_head_quant` decided and why."""

    model_config = ConfigDict(frozen=True)

    config: QuantConfig | None  # the quantization the head runs with (None = dense)
    stored: WeightFormat | None  # the format of the stored bytes: FP8 or NVFP4 (None = dense)
    dequantize: bool  # stored quantized but running dense: dequantize exactly
    reason: str
    tensor_name: str = "lm_head.weight"  # the stored [V, H] tensor (lm_head.weight_packed for compressed-tensors NVFP4)
    tied: bool = False  # the head is the tied input embedding
    checkpoint_format: CheckpointFormat = CheckpointFormat.MODELOPT  # whose tensor names and scale conventions
    notice: str | None = None  # a warning to give when the head loads (e.g. a mode loaded weight-only)

    @property
    def warning(self) -> str | None:
        if not self.dequantize or self.stored is None:
            return None
        if self.checkpoint_format is CheckpointFormat.COMPRESSED_TENSORS:
            how = ("bfloat16(e2m1(q) * fp32(block_scale / global_scale))" if self.stored is WeightFormat.NVFP4
                   else "q * weight_scale rounded once to the scale's dtype")
            return (f"{self.tensor_name} is stored as {self.stored.value} but the head runs dense ({self.reason}): "
                    f"dequantizing it exactly as compressed-tensors' decompress does ({how}), then casting to the "
                    "head's dtype")
        return (f"{self.tensor_name} is stored as {self.stored.value} but the head runs dense "
                f"({self.reason}): dequantizing it exactly in float32, then rounding to the head's dtype")


def _quant_section(ckpt: Checkpoint) -> tuple[dict[str, Any], str]:
    """The ``quantization`` dict and where it came from ({} when the model is not quantized)."""
    if ckpt.hf_quant_config is not None:
        section = ckpt.hf_quant_config.get("quantization", ckpt.hf_quant_config)
        return (section if isinstance(section, dict) else {}), "hf_quant_config.json"
    section = ckpt.config.get("quantization_config")
    if isinstance(section, dict):
        return section, "config.json quantization_config"
    return {}, ""


def _patterns(section: dict[str, Any], key: str, where: str) -> list[str]:
    """``section[key]`` as a list of strings (absent / null: empty). A string is refused, not
    iterated by character: ``"lm_head"`` would otherwise exclude nothing."""
    value = section.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantizationError(f"{where}: {key} must be a list of module-name patterns (strings), "
                                f"got {type(value).__name__} {value!r:.80}")
    return value


def _group_size(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 16:
        raise QuantizationError(f"{where}: group_size must be an int in [1, 65536], got {value!r:.80}")
    return value


def _excluded(patterns: list[str], module: str) -> str | None:
    for pattern in patterns:
        if fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module + ".weight", pattern):
            return pattern
    return None


def stored_format(ckpt: Checkpoint, tensor_name: str) -> WeightFormat | None:
    """The format of the stored head bytes, from the header: FP8 E4M3, packed uint8 FP4, or dense."""
    info = ckpt.info(tensor_name)
    module = tensor_name.rsplit(".", 1)[0]
    if info.dtype == "F8_E4M3":
        return WeightFormat.FP8
    if info.dtype == "U8":
        # ModelOpt's global scale is weight_scale_2, compressed-tensors' its reciprocal weight_global_scale.
        if not ckpt.has(f"{module}.weight_scale_2") and not ckpt.has(f"{module}.weight_global_scale"):
            raise QuantizationError(
                f"{tensor_name} is uint8 (packed FP4) but {module}.weight_scale_2 is missing (ModelOpt's global "
                f"scale; compressed-tensors files store {module}.weight_global_scale instead)"
            )
        return WeightFormat.NVFP4
    return None


def _refuse_unrecognised_ct(ckpt: Checkpoint, module: str, section: Any) -> None:
    """A head stored with compressed-tensors-only tensors (``weight_packed``, ``weight_global_scale``,
    ``input_global_scale``, ``weight_zero_point``, an FP8 weight whose ``weight_scale`` is in the model
    dtype) under a config that is not ``quant_method: "compressed-tensors"`` (null, missing, another
    case, a list) is refused naming ``quant_method``, not read by the ModelOpt rules."""
    if ckpt.hf_quant_config is not None:
        return
    names = [f"{module}.{k}" for k in ("weight_packed", "weight_global_scale", "input_global_scale",
                                        "weight_zero_point") if ckpt.has(f"{module}.{k}")]
    weight, scale = f"{module}.weight", f"{module}.weight_scale"
    if ckpt.has(weight) and ckpt.has(scale) and ckpt.info(weight).dtype == "F8_E4M3" and \
            ckpt.info(scale).dtype in ("BF16", "F16"):
        names.append(f"{scale} ({ckpt.info(scale).dtype}, compressed-tensors' model-dtype FP8 scale)")
    if not names:
        return
    if not isinstance(section, dict):
        said = "config.json has no quantization_config" if section is None and \
            "quantization_config" not in ckpt.config else f"quantization_config is {section!r:.80}"
    else:
        said = (f"quantization_config.quant_method is {section['quant_method']!r:.80}" if "quant_method" in section
                else "quantization_config has no quant_method")
    where = ckpt.path / "config.json" if Path(ckpt.path).is_dir() else ckpt.path
    raise QuantizationError(f"{where}: {said}, but {', '.join(names)} are compressed-tensors "
                            f"tensors (expected quant_method {ct.CT_METHOD!r}); the config does not describe the "
                            "stored head")


def resolve_lm_head_quant(
    ckpt: Checkpoint | str | Path,
    *,
    mapping: Mapping | None = None,
    tensor_name: str | None = None,
    quant: str = "auto",
    weight_only: bool = False,
) -> HeadQuantDecision:
    """Apply the gating rule to a checkpoint (a :class:`Checkpoint` or its path; header probes only)."""
    if not hasattr(ckpt, "hf_quant_config"):
        ckpt = open_checkpoint(ckpt)  # type: ignore[arg-type]
    if quant not in ("auto", "none"):
        raise QuantizationError(f"quant must be 'auto' or 'none', got {quant!r}")
    name, tied = ckpt.lm_head_name(tensor_name)
    module = name.rsplit(".", 1)[0]
    section, source = _quant_section(ckpt)
    where = f"{ckpt.path} {source}".strip()
    ct_section = ckpt.config.get("quantization_config")
    if ct.is_compressed_tensors(ct_section):
        # compressed-tensors (llm-compressor / vLLM): its own names, matcher and scale conventions.
        forced = (f"the head is the tied input embedding {name}" if tied
                  else "attention DP with LM-head TP runs the head dense"
                  if mapping is not None and mapping.enable_attention_dp and mapping.lm_head_is_split else None)
        return _resolve_ct(ckpt, ct_section, f"{ckpt.path / 'config.json'} quantization_config", name=name, tied=tied,
                          forced_dense=forced, quant=quant, weight_only=weight_only)
    _refuse_unrecognised_ct(ckpt, module, ct_section)
    global_algo = QuantAlgo.parse(section.get("quant_algo"), where)
    patterns = _patterns(section, "exclude_modules", where) + _patterns(section, "ignore", where)
    layers = section.get("quantized_layers") or {}
    if not isinstance(layers, dict):
        raise QuantizationError(f"{where}: quantized_layers must be an object of module name -> entry, "
                                f"got {type(layers).__name__}")
    stored = stored_format(ckpt, name)
    has_scale = ckpt.has(f"{module}.weight_scale")
    has_input_scale = ckpt.has(f"{module}.input_scale")
    if stored is not None and not has_scale:
        raise QuantizationError(f"{name} is stored as {stored.value} but {module}.weight_scale is missing")

    def dense(reason: str) -> HeadQuantDecision:
        return HeadQuantDecision(config=None, stored=stored, dequantize=stored is not None,
                                 reason=reason, tensor_name=name, tied=tied)

    # Forced dense, strongest reason first.
    if quant == "none":
        return dense("quant='none' requested")
    if tied:
        return dense(f"the head is the tied input embedding {name}")
    if mapping is not None and mapping.enable_attention_dp and mapping.lm_head_is_split:
        return dense("attention DP with LM-head TP runs the head dense")
    matched = _excluded(patterns, module)
    if matched is not None:
        return dense(f"{module} matches exclude pattern {matched!r}")

    wanted: QuantAlgo | None = None
    why = ""
    entry = layers.get(module) if isinstance(layers, dict) else None
    if entry is not None:
        wanted = QuantAlgo.parse(entry.get("quant_algo") if isinstance(entry, dict) else entry,
                                 f"{where} quantized_layers[{module!r}]")
        why = f"quantized_layers names {module} as {wanted.value}"
    elif global_algo is not None and global_algo is not QuantAlgo.MIXED_PRECISION and has_scale:
        wanted, why = global_algo, f"global quant_algo {global_algo.value} and {module}.weight_scale present"
    if wanted is None and stored is not None:
        # Quantized bytes that no config entry asks to run quantized: by the rule the head
        # runs dense, so its stored scales are applied exactly (never ignored).
        return dense(f"{name} is stored as {stored.value} but no config entry quantizes {module}")
    if wanted is None:
        if global_algo is None:
            return dense("checkpoint is not quantized")
        return dense(f"global quant_algo {global_algo.value} but no {module}.weight_scale in the header")
    if wanted not in HEAD_ALGOS:
        raise QuantizationError(f"{where}: {why}, but {wanted.value} is not supported for the LM head "
                                f"(supported: {[a.value for a in HEAD_ALGOS]})")
    if stored is None:
        raise QuantizationError(f"{why}, but {name} is stored dense with no scales; "
                                "write a quantized checkpoint with `trtvocab quantize`")
    if stored is not wanted.weight_format:
        raise QuantizationError(f"{why}, but {name} is stored as {stored.value}")
    if wanted is QuantAlgo.FP8:
        activation = Activation.NONE if weight_only else (Activation.STATIC if has_input_scale else Activation.DYNAMIC)
    else:
        activation = Activation.NONE if weight_only or not has_input_scale else Activation.STATIC
    group = (_group_size(section.get("group_size"), where)
             or (_group_size(entry.get("group_size"), f"{where} quantized_layers[{module!r}]")
                 if isinstance(entry, dict) else None)
             or BLOCK)
    # An FP8 weight_scale with one value per vocab row (header shape) is the per-row variant.
    granularity = (Granularity.of_scale(ckpt.info(f"{module}.weight_scale").shape) if wanted is QuantAlgo.FP8
                   else Granularity.PER_TENSOR)
    return HeadQuantDecision(
        config=QuantConfig(quant_algo=wanted, activation=activation, group_size=group, granularity=granularity),
        stored=stored, dequantize=False, reason=why, tensor_name=name, tied=tied,
    )


def _resolve_ct(ckpt: Checkpoint, section: dict[str, Any], where: str, *, name: str, tied: bool,
                forced_dense: str | None, quant: str, weight_only: bool) -> HeadQuantDecision:
    """The verdict for a compressed-tensors checkpoint: the module's config and tensors must agree
    (:func:`trtvocab.quant.compressed_tensors.resolve_module` refuses otherwise); then the same
    forced-dense reasons as for ModelOpt. ``forced_dense``: tied / attention DP, or None."""
    if ckpt.hf_quant_config is not None:
        raise QuantizationError(f"{ckpt.path}: config.json says quant_method {ct.CT_METHOD!r} but "
                                "hf_quant_config.json (ModelOpt) is there too; one checkpoint has one quantization "
                                "format")
    cfg = ct.parse_config(section, where)
    classes = ct.EMBEDDING_CLASSES if tied else ct.HEAD_CLASSES
    info = ct.resolve_module(ckpt, cfg, name.rsplit(".", 1)[0], classes, where, allow_uncompressed=quant == "none")
    stored = info.stored

    def dense(reason: str, notice: str | None = None) -> HeadQuantDecision:
        return HeadQuantDecision(config=None, stored=stored, dequantize=stored is not None, reason=reason,
                                 tensor_name=info.tensor_name, tied=tied,
                                 checkpoint_format=CheckpointFormat.COMPRESSED_TENSORS, notice=notice)

    if stored is None:
        return dense(info.reason or "the head is stored dense", info.notice)
    if quant == "none":
        return dense("quant='none' requested")
    if forced_dense is not None:
        return dense(forced_dense)
    config = QuantConfig(quant_algo=QuantAlgo.of_format(stored),
                         activation=Activation.NONE if weight_only else info.activation,
                         group_size=BLOCK, granularity=info.granularity)
    return HeadQuantDecision(config=config, stored=stored, dequantize=False,
                             reason=info.reason + (f"; {info.vllm_note}" if info.vllm_note else ""),
                             tensor_name=info.tensor_name, tied=tied,
                             checkpoint_format=CheckpointFormat.COMPRESSED_TENSORS,
                             notice=None if weight_only else info.notice)
