"""compressed-tensors checkpoints (llm-compressor, vLLM): the head's and the embedding's tensors.

A checkpoint is in this format when ``config.json`` ``quantization_config.quant_method`` is
``"compressed-tensors"``. Per quantized module ``<m>`` (``lm_head``, ``model.embed_tokens``) the
FP8 formats (``float-`` / ``naive-quantized``) store ``<m>.weight`` F8_E4M3 with a model-dtype
``weight_scale`` (and ``input_scale`` when static); ``nvfp4-pack-quantized`` stores
``<m>.weight_packed``, E4M3 block scales and float32 global scales (the reciprocals of
ModelOpt's). Which config group quantizes a module follows compressed-tensors' own matcher.
Where trtvocab dequantizes, it computes what the library's ``decompress`` computes, bit for bit
(:func:`decompress_fp8`, :func:`decompress_nvfp4`); where it runs quantized, the tensors become
the ModelOpt tensors of the FP8 / NVFP4 weight methods (docs/checkpoint_formats.md). The tensor
table, the matching rules and the exactness: the section "the format" below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from trtvocab.base.formats import Activation, Granularity, WeightFormat
from trtvocab.checkpoints.checkpoint import ST_DTYPES
from trtvocab.errors import CheckpointError, PatternError, QuantizationError
from trtvocab.quant import patterns
from trtvocab.quant.fp8 import FP8_DTYPE
from trtvocab.quant.nvfp4 import BLOCK, unpack_codes
from trtvocab.quant.scales import check_block_scales, check_row_scales, check_scale_range

if TYPE_CHECKING:
    from trtvocab.checkpoints.checkpoint import Checkpoint

# ---- the format -----------------------------------------------------------------------------------
# Per quantized module <m> (lm_head, model.embed_tokens):
#
#     format                      tensors                                  ModelOpt equivalent
#     float- / naive-quantized    <m>.weight        F8_E4M3 [V, H]         weight
#     (FP8)                       <m>.weight_scale  model dtype [1] | [V,1] weight_scale (fp32)
#                                 <m>.input_scale   model dtype [1]        input_scale (static only)
#     nvfp4-pack-quantized        <m>.weight_packed U8 [V, H/2]            weight (same bytes)
#     (NVFP4)                     <m>.weight_scale  F8_E4M3 [V, H/16]      weight_scale (same bytes)
#                                 <m>.weight_global_scale F32 [1]          1 / weight_scale_2
#                                 <m>.input_global_scale  F32 [1]          1 / input_scale (W4A4)
#
# Which group quantizes a module follows compressed-tensors' own matcher: a target matches by
# exact name, ``re:`` + ``re.match`` (anchored at the start only) or the module's class name
# (``Linear`` / ``Module`` for ``lm_head``, ``Embedding`` / ``Module`` for the embedding); exact
# names win over regexes, regexes over class names; ``ignore`` uses the same three rules. vLLM
# differs for the head: its ``ParallelLMHead`` matches a name or regex only (a class target
# ``Linear`` never quantizes it); the verdict of trtvocab.quant.config.resolve_lm_head_quant says so.
#
# Exactness (see docs/checkpoint_formats.md):
#
# * where trtvocab dequantizes, it computes what ``compressed_tensors``' ``decompress`` computes,
#   bit for bit: FP8 ``q.to(s.dtype) * s`` (one rounding to the scale's dtype), NVFP4
#   ``bf16(e2m1(q) * fp32(fp32(block_scale) / global_scale))`` (a division; always bf16; code 8
#   is ``-0.0``) -- decompress_fp8, decompress_nvfp4;
# * where it runs quantized, the tensors become the ModelOpt tensors of the FP8 / NVFP4 weight
#   methods: the FP8 bytes, the NVFP4 bytes and block scales unchanged; FP8 scales widened from
#   the model dtype to float32 (exact); the two NVFP4 global scales replaced by their float32
#   reciprocals (one rounding each, the form ModelOpt stores and vLLM's kernels use).


CT_METHOD = "compressed-tensors"
FP8_FORMATS = ("float-quantized", "naive-quantized")
NVFP4_FORMAT = "nvfp4-pack-quantized"
DENSE_FORMAT = "dense"
COMPRESSED = "compressed"
# HF module classes (with their MRO) the matcher sees for the two modules trtvocab reads.
HEAD_CLASSES = ("Linear", "Module")
EMBEDDING_CLASSES = ("Embedding", "Module")
# Tensors a compressed-tensors module may carry beside its weight (any of them next to dense
# weights means the file was saved uncompressed: never read as quantized bytes).
SCALE_KEYS = ("weight_scale", "weight_global_scale", "weight_zero_point", "input_scale", "input_global_scale",
              "input_zero_point", "weight_g_idx")
FLOAT_SCALE_DTYPES = ("BF16", "F16", "F32")
DEQUANT_CHUNK_ELEMENTS = 1 << 22
# E2M1 code -> value as compressed-tensors' unpack_fp4_from_uint8 decodes it: code 8 is -0.0.
_E2M1_SIGNED = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# ---- the stored config ----------------------------------------------------------------------------
class CTArgs(BaseModel):
    """One ``weights`` / ``input_activations`` entry of a config group (``QuantizationArgs`` as stored)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    num_bits: int = 8
    type: str = "int"
    symmetric: bool = True
    group_size: int | None = None
    strategy: str | None = None
    block_structure: list[int] | None = None
    dynamic: bool | str = False
    actorder: Any = None
    scale_dtype: str | None = None

    @property
    def resolved_strategy(self) -> str:
        """``strategy``, or what compressed-tensors infers when it is absent (group / tensor)."""
        if self.strategy is not None:
            return self.strategy
        return "group" if self.group_size is not None and self.group_size > 0 else "tensor"


class CTGroup(BaseModel):
    """One ``config_groups`` entry: targets, weight and activation args, and (since 0.11) its format."""

    model_config = ConfigDict(extra="allow", frozen=True)

    targets: list[str]
    weights: CTArgs | None = None
    input_activations: CTArgs | None = None
    output_activations: CTArgs | None = None
    format: str | None = None


class CTConfig(BaseModel):
    """``config.json`` ``quantization_config`` of a compressed-tensors checkpoint (unknown keys kept)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    quant_method: Literal["compressed-tensors"]
    format: str | None = None
    quantization_status: str | None = None
    config_groups: dict[str, CTGroup] = {}
    ignore: list[str] | None = None
    sparsity_config: dict[str, Any] | None = None
    transform_config: dict[str, Any] | None = None
    version: str | None = None


def is_compressed_tensors(section: dict[str, Any]) -> bool:
    return isinstance(section, dict) and section.get("quant_method") == CT_METHOD


def parse_config(section: dict[str, Any], where: str) -> CTConfig:
    try:
        return CTConfig.model_validate(section)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise QuantizationError(f"{where}: not a valid compressed-tensors quantization_config: {loc}: "
                                f"{first['msg']}") from None


# ---- matching (compressed-tensors' rules) ----------------------------------------------------------
def _shown(pattern: str) -> str:
    """A config entry as messages quote it (a long one cut to 80 characters)."""
    return repr(pattern) if len(pattern) <= 80 else f"{pattern[:80]!r}... ({len(pattern)} characters)"


def name_matches(pattern: str, module: str, where: str) -> bool:
    """Exact name, or ``re:`` + ``re.match``'s answer (anchored at the start only), computed by the bounded
    matcher of :mod:`trtvocab.quant.patterns` (a refused pattern: :class:`PatternError` naming the entry)."""
    if not pattern.startswith("re:"):
        return pattern == module
    try:
        return patterns.match(patterns.compile_pattern(pattern[3:]), module)
    except PatternError as exc:
        raise PatternError(f"{where} entry {_shown(pattern)}: {exc}") from None


def target_matches(pattern: str, module: str, classes: tuple[str, ...], where: str) -> bool:
    return name_matches(pattern, module, where) or (not pattern.startswith("re:") and pattern in classes)


def _strings(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantizationError(f"{where} must be a list of strings, got {value!r:.80}")
    return value


@dataclass(frozen=True)
class Match:
    """The config group that quantizes a module, and the target that selected it."""

    key: str
    group: CTGroup
    target: str
    by_class: bool

    @property
    def entry(self) -> str:
        return f"config_groups[{self.key!r}] (target {self.target!r})"


def ignored_by(cfg: CTConfig, module: str, classes: tuple[str, ...], where: str) -> str | None:
    for pattern in _strings(cfg.ignore, f"{where} ignore"):
        if target_matches(pattern, module, classes, f"{where} ignore"):
            return pattern
    return None


def match_group(cfg: CTConfig, module: str, classes: tuple[str, ...], where: str) -> Match | None:
    """The group compressed-tensors applies to ``module``: among matching targets, exact names first,
    then regexes, then class names (each sorted), a target's group being the last one that lists it."""
    owner: dict[str, str] = {}
    for key, group in cfg.config_groups.items():
        for target in group.targets:
            owner[target] = key
    by_name = sorted((t for t in owner if name_matches(t, module, f"{where} config_groups targets")),
                     key=lambda t: ("re:" in t, t))
    by_class = sorted(t for t in owner if not t.startswith("re:") and t in classes and t not in by_name)
    hits = by_name + by_class
    if not hits:
        return None
    target = hits[0]
    key = owner[target]
    return Match(key, cfg.config_groups[key], target, target not in by_name)


MAX_SUBCONFIG_DEPTH = 64  # sparsity / transform configs nest a few levels; deeper is refused, not recursed


def _matched_elsewhere(section: Any, module: str, classes: tuple[str, ...], where: str) -> bool:
    """Whether a sparsity / transform sub-config (``targets`` + ``ignore`` lists, any depth up to
    :data:`MAX_SUBCONFIG_DEPTH`) reaches ``module``; walked with an explicit stack (no recursion)."""
    stack: list[tuple[Any, int]] = [(section, 0)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_SUBCONFIG_DEPTH:
            raise QuantizationError(f"{where}: nested more than {MAX_SUBCONFIG_DEPTH} levels deep (a sparsity / "
                                    "transform config nests a few)")
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in reversed(node))
            continue
        targets = node.get("targets")
        if isinstance(targets, list) and all(isinstance(t, str) for t in targets):
            ignore = _strings(node.get("ignore"), f"{where} ignore")
            if any(target_matches(t, module, classes, where) for t in targets) and not any(
                    target_matches(p, module, classes, where) for p in ignore):
                return True
        stack.extend((v, depth + 1) for k, v in reversed(list(node.items())) if k != "ignore")
    return False


# ---- what the header holds -------------------------------------------------------------------------
@dataclass(frozen=True)
class Stored:
    """A module's tensors as the safetensors header lists them (no data read)."""

    module: str
    weight: str | None  # the name of <m>.weight or <m>.weight_packed
    dtype: str | None
    present: frozenset[str]  # keys of SCALE_KEYS that exist

    @property
    def weight_format(self) -> WeightFormat | None:
        """FP8, NVFP4 or None (dense / absent), from the weight tensor's name and dtype."""
        if self.weight is None:
            return None
        if self.weight.endswith(".weight_packed"):
            return WeightFormat.NVFP4
        return WeightFormat.FP8 if self.dtype == "F8_E4M3" else None


def stored_module(ckpt: Checkpoint, module: str) -> Stored:
    plain, packed = f"{module}.weight", f"{module}.weight_packed"
    if ckpt.has(plain) and ckpt.has(packed):
        raise CheckpointError(f"{ckpt.info(plain).file}: holds both {plain} and {packed}; a compressed-tensors "
                              "module stores one of them")
    name = packed if ckpt.has(packed) else plain if ckpt.has(plain) else None
    dtype = ckpt.info(name).dtype if name is not None else None
    return Stored(module, name, dtype, frozenset(k for k in SCALE_KEYS if ckpt.has(f"{module}.{k}")))


def _file(ckpt: Checkpoint, name: str | None) -> str:
    if name is not None and ckpt.has(name):
        return str(ckpt.info(name).file)
    return str(ckpt.path)


# ---- the verdict for one module ---------------------------------------------------------------------
@dataclass(frozen=True)
class CTModule:
    """What a compressed-tensors module holds and how it may run.

    ``stored``: the format of the stored bytes (FP8 or NVFP4; None: dense). ``activation``: what the
    checkpoint asks for (before a caller's ``weight_only``); ``notice``: a warning to give when it loads
    (a mode trtvocab does not run).
    """

    module: str
    tensor_name: str
    stored: WeightFormat | None
    granularity: Granularity = Granularity.PER_TENSOR
    activation: Activation = Activation.NONE
    entry: str = ""
    reason: str = ""
    notice: str | None = None
    vllm_note: str | None = None


def _fp8_activation(group: CTGroup, stored: Stored, where: str, file: str) -> tuple[Activation, str | None]:
    act = group.input_activations
    if act is None:
        return Activation.NONE, None
    strategy = act.resolved_strategy
    if act.num_bits != 8 or act.type != "float":
        raise QuantizationError(f"{where}: input_activations {act.type}{act.num_bits} next to FP8 weights is not "
                                "supported for the head (FP8 activations only)")
    if act.dynamic is False:
        if strategy != "tensor":
            raise QuantizationError(f"{where}: static {strategy} input activations are not supported for the "
                                    "head (static per-tensor only)")
        if "input_scale" not in stored.present:
            raise QuantizationError(f"{file}: {where} asks for static input activations, but "
                                    f"{stored.module}.input_scale is missing")
        return Activation.STATIC, None
    if strategy == "tensor":
        return Activation.DYNAMIC, None
    return Activation.NONE, (f"{stored.module}: {where} quantizes activations dynamically per {strategy} "
                             f"(FP8_DYNAMIC); trtvocab's dynamic FP8 mode is per tensor, so this head loads "
                             "weight-only (W8A16): FP8 weights, activations kept in the head dtype")


def _nvfp4_activation(group: CTGroup, stored: Stored, where: str, file: str) -> tuple[Activation, str | None]:
    act = group.input_activations
    if act is None:
        return Activation.NONE, None
    if not (act.num_bits == 4 and act.type == "float" and act.resolved_strategy == "tensor_group"
            and act.group_size == BLOCK):
        raise QuantizationError(f"{where}: input_activations ({act.type}{act.num_bits} {act.resolved_strategy} "
                                f"g{act.group_size}) next to NVFP4 weights are not NVFP4 activations")
    if act.dynamic == "local" or act.dynamic is False:
        if "input_global_scale" not in stored.present:
            raise QuantizationError(f"{file}: {where} quantizes activations under a stored global scale, but "
                                    f"{stored.module}.input_global_scale is missing")
        return Activation.STATIC, None
    return Activation.NONE, (f"{stored.module}: {where} computes the activations' global scale dynamically; "
                             "trtvocab runs NVFP4 activations under a stored one only, so this head loads "
                             "weight-only (W4A16)")


def _check_scale_tensors(ckpt: Checkpoint, stored: Stored, weight_format: WeightFormat, granularity: Granularity,
                         where: str, file: str) -> None:
    """Shapes and dtypes of the scales (header only)."""
    m = stored.module
    weight = ckpt.info(stored.weight)  # type: ignore[arg-type]
    if len(weight.shape) != 2:
        wanted = "[V, H/2] (two FP4 codes a byte)" if weight_format is WeightFormat.NVFP4 else "[V, H]"
        raise QuantizationError(f"{file}: {stored.weight} must be 2-D {wanted} ({where}), got "
                                f"{weight.dtype} {list(weight.shape)}")
    vocab = weight.shape[0]
    scale = ckpt.info(f"{m}.weight_scale")
    numel = 1
    for d in scale.shape:
        numel *= d
    if weight_format is WeightFormat.FP8:
        if scale.dtype not in FLOAT_SCALE_DTYPES:
            raise QuantizationError(f"{file}: {m}.weight_scale is {scale.dtype}; {where} (FP8) stores it in the "
                                    f"model dtype, one of {list(FLOAT_SCALE_DTYPES)}")
        if granularity is Granularity.PER_TENSOR and numel != 1:
            raise QuantizationError(f"{file}: {m}.weight_scale has shape {list(scale.shape)}, but {where} is "
                                    "per-tensor FP8 (strategy 'tensor': shape [1])")
        if granularity is Granularity.PER_ROW and tuple(scale.shape) not in ((vocab, 1), (vocab,)):
            raise QuantizationError(f"{file}: {m}.weight_scale has shape {list(scale.shape)}, but {where} is "
                                    f"per-channel FP8 (strategy 'channel': shape [{vocab}, 1])")
        if "input_scale" in stored.present:
            info = ckpt.info(f"{m}.input_scale")
            if info.dtype not in FLOAT_SCALE_DTYPES or any(d != 1 for d in info.shape):
                raise QuantizationError(f"{file}: {m}.input_scale must be one float ([1]), got {info.dtype} "
                                        f"{list(info.shape)} ({where})")
        return
    cols = weight.shape[1] if len(weight.shape) == 2 else 0
    blocks = 2 * cols // BLOCK
    if scale.dtype != "F8_E4M3" or tuple(scale.shape) != (vocab, blocks):
        raise QuantizationError(f"{file}: {m}.weight_scale must be F8_E4M3 block scales [{vocab}, {blocks}] "
                                f"({where}, NVFP4 group 16), got {scale.dtype} {list(scale.shape)}")
    for key in ("weight_global_scale", "input_global_scale"):
        if key in stored.present:
            info = ckpt.info(f"{m}.{key}")
            if info.dtype != "F32" or any(d != 1 for d in info.shape):
                raise QuantizationError(f"{file}: {m}.{key} must be one F32 value ([1]), got {info.dtype} "
                                        f"{list(info.shape)} ({where})")


def resolve_module(ckpt: Checkpoint, cfg: CTConfig, module: str, classes: tuple[str, ...], where: str, *,
                   allow_uncompressed: bool = False) -> CTModule:
    """What a compressed-tensors checkpoint stores for ``module``, refusing a config and tensors that
    disagree (:class:`QuantizationError` naming the file, the tensor and the config entry).

    ``allow_uncompressed``: a module saved uncompressed (``format: dense``, status ``frozen``:
    dense weights with scales beside them) loads dense (its scales unused) instead of being refused.
    """
    stored = stored_module(ckpt, module)
    file = _file(ckpt, stored.weight)
    if stored.weight is None:
        raise CheckpointError(f"checkpoint {ckpt.path}: no {module}.weight or {module}.weight_packed")
    for key, section in (("sparsity_config", cfg.sparsity_config), ("transform_config", cfg.transform_config)):
        if section and _matched_elsewhere(section, module, classes, f"{where} {key}"):
            raise QuantizationError(f"{where}: {key} applies to {module} (sparsity / rotation transforms are not "
                                    "supported for the head or the embedding)")
    ignored = ignored_by(cfg, module, classes, where)
    match = None if ignored is not None else match_group(cfg, module, classes, where)
    if match is None or match.group.weights is None:
        why = (f"{where} ignore entry {ignored!r} matches {module}" if ignored is not None
               else f"no {where} config group quantizes {module}'s weights" if match is not None
               else f"no {where} config_groups target matches {module}")
        if stored.weight_format is not None or stored.present:
            held = sorted([stored.weight.rsplit('.', 1)[1] + f" {stored.dtype}", *stored.present])
            raise QuantizationError(f"{file}: {module} holds quantized tensors ({', '.join(held)}) but {why}; "
                                    "the config and the tensors disagree")
        return CTModule(module, stored.weight, None, reason=why)
    entry = f"{where} {match.entry}"
    group, args = match.group, match.group.weights
    fmt = group.format or cfg.format
    status = cfg.quantization_status
    uncompressed = fmt == DENSE_FORMAT or (status is not None and status != COMPRESSED)
    if uncompressed:
        detail = (f"{entry} quantizes {module}, but the checkpoint was saved uncompressed (format {fmt!r}, "
                  f"quantization_status {status!r}: save_pretrained(save_compressed=False)): {stored.weight} is "
                  f"{stored.dtype}")
        if stored.weight_format is not None or not allow_uncompressed:
            raise QuantizationError(
                f"{file}: {detail} with {sorted(f'{module}.{k}' for k in stored.present) or 'no scales'} beside "
                "it; its values are not the quantized model's and are never read as quantized bytes. Save it "
                "compressed (save_compressed=True), or pass quant='none' to load the dense weights as they are")
        return CTModule(module, stored.weight, None, entry=entry, reason=detail + "; loaded dense (quant='none'), "
                        "its scales unused", notice=f"{detail}; loading the dense weights, the scales beside them "
                        "are not applied (quant='none')")
    if "weight_zero_point" in stored.present:
        raise QuantizationError(f"{file}: {entry}: {module}.weight_zero_point is stored: zero-point (asymmetric) "
                                "weights are not supported for the head or the embedding (symmetric FP8 E4M3 and "
                                "NVFP4 only)")
    if args.type != "float" or not args.symmetric:
        raise QuantizationError(f"{file}: {entry}: {args.type}{args.num_bits} "
                                f"{'symmetric' if args.symmetric else 'asymmetric'} weights are not supported for "
                                "the head or the embedding (FP8 E4M3 and NVFP4 only)")
    strategy = args.resolved_strategy
    if args.num_bits == 8:
        weight_format = WeightFormat.FP8
        if strategy not in ("tensor", "channel"):
            raise QuantizationError(f"{file}: {entry}: FP8 strategy {strategy!r} is not supported (per-tensor "
                                    "'tensor' and per-row 'channel' only; block / group scales are refused)")
        if fmt not in FP8_FORMATS:
            raise QuantizationError(f"{file}: {entry} has FP8 weights but format {fmt!r}; expected one of "
                                    f"{list(FP8_FORMATS)}")
        granularity = Granularity.PER_ROW if strategy == "channel" else Granularity.PER_TENSOR
    elif args.num_bits == 4 and strategy == "tensor_group" and args.group_size == BLOCK:
        weight_format, granularity = WeightFormat.NVFP4, Granularity.PER_TENSOR
        if fmt != NVFP4_FORMAT:
            raise QuantizationError(f"{file}: {entry} has NVFP4 weights but format {fmt!r}; expected "
                                    f"{NVFP4_FORMAT!r}")
        if args.scale_dtype not in (None, "torch.float8_e4m3fn", "float8_e4m3fn"):
            raise QuantizationError(f"{file}: {entry}: NVFP4 scale_dtype {args.scale_dtype!r} is not E4M3")
    else:
        raise QuantizationError(f"{file}: {entry}: float{args.num_bits} {strategy} g{args.group_size} weights "
                                "are not supported (FP8 'tensor'/'channel', NVFP4 'tensor_group' g16 only; MXFP4 "
                                "/ MXFP8 are refused)")
    nvfp4 = weight_format is WeightFormat.NVFP4
    expected = f"{module}.weight_packed" if nvfp4 else f"{module}.weight"
    needed = ("weight_scale", "weight_global_scale") if nvfp4 else ("weight_scale",)
    if stored.weight_format is not weight_format:
        found = f"{stored.weight} is {stored.dtype}"
        raise QuantizationError(f"{file}: {entry} quantizes {module} as {weight_format}, so {expected} "
                                f"({'U8' if nvfp4 else 'F8_E4M3'}) must be stored; {found}")
    for key in needed:
        if key not in stored.present:
            raise QuantizationError(f"{file}: {entry} quantizes {module} as {weight_format}, but {module}.{key} is "
                                    "missing")
    if ckpt.has(f"{module}.weight_scale_2"):
        raise QuantizationError(f"{file}: {entry} quantizes {module} as compressed-tensors {weight_format}, but "
                                f"{module}.weight_scale_2 (ModelOpt's global scale) is stored beside its "
                                f"{'weight_global_scale' if nvfp4 else 'weight_scale'}; one module has "
                                "one quantization format")
    _check_scale_tensors(ckpt, stored, weight_format, granularity, entry, file)
    activation, notice = (_nvfp4_activation if nvfp4 else _fp8_activation)(group, stored, entry, file)
    vllm_note = None
    if match.by_class and "Linear" in classes:
        vllm_note = (f"vLLM would not quantize this head: class target {match.target!r} does not match its "
                     "ParallelLMHead (vLLM quantizes a head only when a target names it, e.g. 'lm_head')")
    reason = f"{entry} quantizes {module} as {weight_format} ({fmt})"
    return CTModule(module, expected, weight_format, granularity, activation, entry, reason, notice, vllm_note)


# ---- exact dequantization (compressed-tensors' decompress) -------------------------------------------
def decompress_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.to(s.dtype) * s`` as compressed-tensors computes it: the exact product rounded once to the
    scale's dtype (``[rows, H]`` e4m3 codes, a ``[1]`` / ``[rows, 1]`` / ``[rows]`` scale)."""
    s = scale.reshape(-1, 1) if scale.dim() == 1 and scale.numel() == q.shape[0] and q.shape[0] != 1 else scale
    return (q.float() * s.float()).to(scale.dtype)


def decompress_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """``bf16(e2m1(q) * fp32(fp32(block_scale) / global_scale))``: compressed-tensors' NVFP4 decompress
    (a division per block, code 8 = -0.0, always bfloat16); ``[rows, H/2]`` uint8 -> ``[rows, H]``."""
    table = torch.tensor(_E2M1_SIGNED, dtype=torch.float32, device=packed.device)
    values = table[unpack_codes(packed).long()]
    scale = block_scales.float() / global_scale.float().reshape(())
    rows, hidden = values.shape
    return (values.view(rows, hidden // BLOCK, BLOCK) * scale.unsqueeze(-1)).view(rows, hidden).to(torch.bfloat16)


class DecompressedRows:
    """A lazy ``[V, H]`` reader whose rows are compressed-tensors' ``decompress`` of the stored ones.

    ``reader[a:b]`` reads rows ``a..b`` of the stored tensors only (packed codes and block scales, or
    FP8 codes and per-row scales) and decompresses them in chunks; the safetensors slice interface
    (``get_shape`` / ``get_dtype``), so a dense weight loads it like any lazy tensor.
    """

    def __init__(self, ckpt: Checkpoint, module: str, stored: WeightFormat, hidden: int) -> None:
        self.module, self.stored, self.hidden = module, stored, hidden
        if stored is WeightFormat.NVFP4:
            self.codes = ckpt.get_slice(f"{module}.weight_packed")
            self.scales = ckpt.get_slice(f"{module}.weight_scale")
            self.global_scale = ckpt.read(f"{module}.weight_global_scale").float().reshape(())
            self.dtype = torch.bfloat16
            reciprocal(self.global_scale, f"{module}.weight_global_scale")  # the quantized path's rule
        else:
            self.codes = ckpt.get_slice(f"{module}.weight")
            info = ckpt.info(f"{module}.weight_scale")
            self.per_row = Granularity.of_scale(info.shape) is Granularity.PER_ROW
            self.scales = ckpt.get_slice(f"{module}.weight_scale") if self.per_row else \
                ckpt.read(f"{module}.weight_scale")
            self.dtype = ST_DTYPES[info.dtype]
        self.vocab = self.codes.get_shape()[0]

    def get_shape(self) -> list[int]:
        return [self.vocab, self.hidden]

    def get_dtype(self) -> str:
        return {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[self.dtype]

    def __getitem__(self, index: Any) -> torch.Tensor:
        if index is Ellipsis:
            index = slice(None)
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise CheckpointError(f"{self.module}: only contiguous row slices can be read lazily")
        start, stop, _ = index.indices(self.vocab)
        stop = max(start, stop)
        out = torch.empty(stop - start, self.hidden, dtype=self.dtype)
        step = max(1, DEQUANT_CHUNK_ELEMENTS // max(1, self.hidden))
        for lo in range(start, stop, step):
            hi = min(lo + step, stop)
            out[lo - start : hi - start] = self._rows(lo, hi)
        return out

    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        codes = self.codes[lo:hi]
        if self.stored is WeightFormat.NVFP4:
            scales = self.scales[lo:hi]
            check_block_scales(scales, f"{self.module}.weight_scale")  # the quantized path's rule
            return decompress_nvfp4(codes, scales, self.global_scale)
        if codes.dtype != FP8_DTYPE:
            raise CheckpointError(f"{self.module}.weight: expected float8_e4m3fn codes, got {codes.dtype}")
        scale = self.scales[lo:hi] if self.per_row else self.scales
        check_row_scales(scale, f"{self.module}.weight_scale")  # the quantized path's rule
        return decompress_fp8(codes, scale)


# ---- the quantized run: ModelOpt-named tensors -------------------------------------------------------
class Float32Rows:
    """A lazy per-row scale reader (``[V, 1]`` / ``[V]`` in the model dtype) that hands out float32 rows
    (the widening is exact); the safetensors slice interface."""

    def __init__(self, source: Any, name: str) -> None:
        self.source, self.name = source, name

    def get_shape(self) -> list[int]:
        return list(self.source.get_shape())

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.source[index].float()


def _positive_scalar(value: torch.Tensor, name: str) -> torch.Tensor:
    scalar = value.float().reshape(())
    if not bool(torch.isfinite(scalar)) or not bool(scalar > 0):
        raise QuantizationError(f"{name}: must be finite and > 0, got {scalar.item()}")
    return scalar


def reciprocal(value: torch.Tensor, name: str) -> torch.Tensor:
    """``fp32(1 / value)``: a compressed-tensors global scale as ModelOpt's ``weight_scale_2`` / ``input_scale``
    (the error names the stored tensor, ``name``, also when only its reciprocal is out of range)."""
    out = torch.ones((), dtype=torch.float32) / _positive_scalar(value, name)
    check_scale_range(out, f"{name} = {value.float().reshape(()).item():g} (its reciprocal, the ModelOpt scale)")
    return out


def modelopt_tensors(ckpt: Checkpoint, module: str, stored: WeightFormat, granularity: Granularity) -> dict[str, Any]:
    """The module's tensors under the names (and scale conventions) of the FP8 / NVFP4 weight methods:
    lazy row readers for the per-row tensors, scalars read (what is exact: the section "the format")."""
    out: dict[str, Any] = {}
    if stored is WeightFormat.NVFP4:
        out["weight"] = ckpt.get_slice(f"{module}.weight_packed")
        out["weight_scale"] = ckpt.get_slice(f"{module}.weight_scale")
        out["weight_scale_2"] = reciprocal(ckpt.read(f"{module}.weight_global_scale"),
                                           f"{module}.weight_global_scale")
        if ckpt.has(f"{module}.input_global_scale"):
            out["input_scale"] = reciprocal(ckpt.read(f"{module}.input_global_scale"),
                                            f"{module}.input_global_scale")
        return out
    out["weight"] = ckpt.get_slice(f"{module}.weight")
    scale_name = f"{module}.weight_scale"
    if granularity is Granularity.PER_ROW:
        out["weight_scale"] = Float32Rows(ckpt.get_slice(scale_name), scale_name)
    else:
        out["weight_scale"] = _positive_scalar(ckpt.read(scale_name), scale_name)
    if ckpt.has(f"{module}.input_scale"):
        out["input_scale"] = _positive_scalar(ckpt.read(f"{module}.input_scale"), f"{module}.input_scale")
    return out


def head_tensors(ckpt: Checkpoint, tensor_name: str, stored: WeightFormat | None, *, dequantize: bool,
                 granularity: Granularity, static: bool, hidden: int) -> dict[str, Any]:
    """What ``load_weights`` of the head takes for a compressed-tensors verdict (lazy; one shard is read):
    the stored dense tensor, :class:`DecompressedRows` (``dequantize``), or the ModelOpt-named tensors
    (``static``: with the activation scale)."""
    module = tensor_name.rsplit(".", 1)[0]
    if stored is None:
        return {"weight": ckpt.get_slice(tensor_name)}
    if dequantize:
        return {"weight": DecompressedRows(ckpt, module, stored, hidden)}
    tensors = modelopt_tensors(ckpt, module, stored, granularity)
    if not static:
        tensors.pop("input_scale", None)
    return tensors


# ---- the embedding ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddingTensors:
    """A compressed-tensors embedding as :class:`~trtvocab.embedding.VocabParallelEmbedding` loads it:
    ``weight_format`` FP8 (an FP8 table with ``granularity``) or None (a dense table, NVFP4 decompressed)."""

    tensor_name: str
    vocab_size: int
    hidden_size: int
    tensors: dict[str, Any]
    weight_format: WeightFormat | None
    granularity: Granularity
    notice: str | None


def embedding_tensors(ckpt: Checkpoint, section: dict[str, Any], where: str, name: str) -> EmbeddingTensors:
    """An embedding of a compressed-tensors checkpoint: FP8 (per tensor or per row) stays an FP8 table
    (scales widened to float32, exact; the lookup's ``bf16(fp32(q * s))`` is ``decompress``'s value);
    NVFP4 is decompressed exactly into a dense table (the embedding holds no FP4 tables), with a notice."""
    cfg = parse_config(section, where)
    module = name.rsplit(".", 1)[0]
    info = resolve_module(ckpt, cfg, module, EMBEDDING_CLASSES, where)
    weight = ckpt.info(info.tensor_name)
    if len(weight.shape) != 2:
        raise CheckpointError(f"{info.tensor_name}: expected a 2-D [V, H] table, got {list(weight.shape)}")
    vocab, cols = weight.shape
    if info.stored is None:
        return EmbeddingTensors(info.tensor_name, vocab, cols, {"weight": ckpt.get_slice(info.tensor_name)}, None,
                                info.granularity, info.notice)
    if info.stored is WeightFormat.NVFP4:
        hidden = 2 * cols
        notice = (f"{info.tensor_name}: an NVFP4 embedding ({info.entry}) is decompressed exactly as "
                  "compressed-tensors' decompress does (bfloat16 rows) into a dense table: trtvocab's embedding "
                  "holds FP8 or dense tables only")
        return EmbeddingTensors(info.tensor_name, vocab, hidden,
                                {"weight": DecompressedRows(ckpt, module, WeightFormat.NVFP4, hidden)}, None,
                                info.granularity, notice)
    tensors = modelopt_tensors(ckpt, module, WeightFormat.FP8, info.granularity)
    tensors.pop("input_scale", None)  # the lookup quantizes no activations
    return EmbeddingTensors(info.tensor_name, vocab, cols, tensors, WeightFormat.FP8, info.granularity, None)


__all__ = [
    "CTArgs", "CTConfig", "CTGroup", "CTModule", "DecompressedRows", "EmbeddingTensors",
    "Float32Rows", "decompress_fp8", "decompress_nvfp4", "embedding_tensors", "head_tensors",
    "is_compressed_tensors", "match_group", "modelopt_tensors", "parse_config", "resolve_module",
]
