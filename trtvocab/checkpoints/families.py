"""Which family a checkpoint is, and so what its output layer and input embedding compute.

:func:`family_of` reads ``config.json`` (``model_type`` and the fields of :data:`RULES`) or a GGUF
file's metadata (``general.architecture`` and the keys of :data:`GGUF_RULES`) plus the checkpoint's
tensor names, and returns a :class:`~trtvocab.base.family.Family`. The rules follow transformers'
model classes (the same field name can mean opposite things: Granite divides by ``logits_scaling``,
HyperCLOVA X multiplies), checked by the conformance suite (``tools/model_zoo.py``; the table is
docs/model_families.md). Refused with :class:`~trtvocab.errors.ArchitectureError`, naming the model type
and the field or tensor: what is not modeled (a learned per-token logit scale, a normalized
embedding, a ``final_logits_bias``) and any model type not listed here whose config sets one of
:data:`TRANSFORM_FIELDS` to a non-neutral value. What a body applies itself stays with the body.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trtvocab.base.family import EmbeddingOps, Family, HeadOps
from trtvocab.errors import ArchitectureError

# Config fields whose meaning depends on the architecture: a model type this module does not list
# is refused when any of them holds a non-neutral value.
TRANSFORM_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap", "logit_scale",
                    "logits_scaling", "lm_head_multiplier", "scale_emb", "scale_embedding", "embed_scale",
                    "logit_softcapping", "final_logit_softcap", "output_multiplier", "logits_multiplier")
# The head's bias, by the head tensor's module (a tied head: the BERT family's prediction bias).
BIAS_NAMES = ("lm_head.bias", "cls.predictions.bias", "cls.predictions.decoder.bias", "pred_layer.proj.bias",
              "lm_loss.bias", "generator_lm_head.bias", "decoder.bias")
# Tensors of an output layer trtvocab does not model: refused when present (BART-style seq2seq heads).
UNMODELED_TENSORS = {"final_logits_bias": "a final_logits_bias buffer added to the logits (a seq2seq head)",
                     "lm_head.logit_scale": "a learned per-token logit scale"}
# Boolean switches among TRANSFORM_FIELDS: off (false) is neutral, on (true) is not.
SWITCH_FIELDS = ("scale_embedding",)
# Soft-cap fields: only absent (None) is neutral (a cap of 1 squashes every logit into (-1, 1)).
SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap", "logit_softcapping",
                  "final_logit_softcap", "attn_logit_softcapping")


def is_neutral(name: str, value: Any) -> bool:
    """Whether ``value`` of field ``name`` leaves the logits and the rows as they are, for a model type not
    listed: absent (None); a switch that is ``false``; a factor that is a number (not a bool) equal to 1.
    ``0``, ``-0.0``, ``false`` and ``true`` are values, not "absent" (``0 == False`` and ``True == 1`` in
    Python)."""
    if value is None:
        return True
    if name in SWITCH_FIELDS:
        return value is False
    if name in SOFTCAP_FIELDS or isinstance(value, bool):
        return False
    return isinstance(value, int | float) and value == 1


@dataclass(frozen=True)
class Rule:
    """How one model type's config fields map onto the ops (field names, not values)."""

    softcap: str | None = None  # final_logit_softcapping: c * tanh(z / c); None / absent: off
    scale: str | None = None  # multiply the logits by this field
    divisor: str | None = None  # divide the logits by this field
    embed_sqrt_hidden: bool = False  # rows * sqrt(H), rounded to the table's dtype
    embed_sqrt_if: str | None = None  # rows * sqrt(H) (a Python float) when this boolean field is true
    embed_field: str | None = None  # rows * this field, rounded to the table's dtype
    refuse_head: str | None = None  # why the head cannot be computed here
    refuse_embedding: str | None = None  # why the embedding cannot be computed here
    ignored: tuple[str, ...] = ()  # transform-looking fields this architecture's logits never use
    body: tuple[str, ...] = ()  # what the body applies itself


_GEMMA = Rule(softcap="final_logit_softcapping", embed_sqrt_hidden=True)
_COHERE = Rule(scale="logit_scale")
_GRANITE = Rule(divisor="logits_scaling", body=("embedding_multiplier (on inputs_embeds)",
                                                "residual_multiplier", "attention_multiplier"))
# *ScaledWordEmbedding: rows * sqrt(d_model) (a Python float) inside the module when scale_embedding.
_SCALED = Rule(embed_sqrt_if="scale_embedding")
_SCALED_IN_FORWARD = Rule(ignored=("scale_embedding",),
                          body=("the embedding rows times sqrt(d_model) when scale_embedding, in the forward",))
RULES: dict[str, Rule] = {
    "gemma": Rule(embed_sqrt_hidden=True),
    "gemma2": _GEMMA, "gemma3_text": _GEMMA, "gemma4_text": _GEMMA, "gemma4_unified_text": _GEMMA, "vaultgemma": _GEMMA,
    "gemma4": _GEMMA, "gemma4_unified": _GEMMA,
    # Gemma 3's multimodal class (Gemma3ForConditionalGeneration) does not soft-cap in transformers.
    "gemma3": Rule(embed_sqrt_hidden=True, ignored=("final_logit_softcapping",)),
    "beam": Rule(softcap="final_logit_softcapping"),
    "nanochat": Rule(softcap="final_logit_softcapping"),
    "recurrent_gemma": Rule(softcap="logits_soft_cap", body=("the embedding rows times sqrt(H) (its normalizer)",)),
    "xlstm": Rule(softcap="output_logit_soft_cap"),
    "cohere": _COHERE, "cohere2": _COHERE, "cohere2_moe": _COHERE, "cohere_compass": _COHERE,
    "cohere_compass_text": _COHERE, "aya_vision": _COHERE,
    "granite": _GRANITE, "granite_swa": _GRANITE, "granitemoe": _GRANITE, "granitemoe_swa": _GRANITE,
    "granitemoeshared": _GRANITE, "granitemoehybrid": _GRANITE,
    "hyperclovax": Rule(scale="logits_scaling", body=("embedding_multiplier (on inputs_embeds)",)),
    "falcon_h1": Rule(scale="lm_head_multiplier", body=("embedding_multiplier (on inputs_embeds)",)),
    "xglm": Rule(embed_sqrt_if="scale_embedding"),
    "minicpm3": Rule(embed_field="scale_emb", ignored=("logits_scaling",),
                     body=("hidden / (hidden_size / dim_model_base) before the head",)),
    "mpt": Rule(ignored=("logit_scale",)),  # transformers' MPT never applies its logit_scale
    "hrm_text": Rule(body=("embedding_scale (on the embedding rows, in the forward)",)),
    "afmoe": Rule(body=("mup_enabled: the embedding rows times sqrt(H), in the forward",)),
    "dory": Rule(refuse_head="a learned per-token logit scale (lm_head.logit_scale / initializer_range)"),
    "inkling_text": Rule(refuse_embedding="a normalized embedding (embed_tokens.embed_norm, an RMSNorm of the rows)"),
    "inkling2_text": Rule(refuse_head="a transform after lm_head", refuse_embedding="a normalized embedding"),
    "inkling2_loop_text": Rule(refuse_head="a transform after lm_head", refuse_embedding="a normalized embedding"),
    "musicgen": Rule(refuse_head="one head per codebook"), "musicgen_melody": Rule(refuse_head="one head per codebook"),
    **dict.fromkeys(("bart", "mbart", "plbart", "blenderbot", "bigbird_pegasus", "biogpt", "trocr"), _SCALED),
    **dict.fromkeys(("blenderbot-small", "marian", "pegasus", "mvp", "whisper"), _SCALED_IN_FORWARD),
    "ctrl": Rule(body=("the embedding rows times sqrt(d_model), in the forward",)),
}
# GGUF general.architecture (llama.cpp's names) -> the ops and the metadata keys llama.cpp writes.
GGUF_RULES: dict[str, Rule] = {
    "gemma": Rule(embed_sqrt_hidden=True),
    "gemma2": Rule(softcap="final_logit_softcapping", embed_sqrt_hidden=True),
    "gemma3": Rule(softcap="final_logit_softcapping", embed_sqrt_hidden=True),
    "command-r": Rule(scale="logit_scale"),
    "cohere2": Rule(scale="logit_scale"),
    # llama.cpp writes Granite's logits_scaling as <arch>.logit_scale and divides by it.
    "granite": Rule(divisor="logit_scale", body=("<arch>.embedding_scale (on the embedding rows)",)),
    "granitemoe": Rule(divisor="logit_scale", body=("<arch>.embedding_scale (on the embedding rows)",)),
    "granitehybrid": Rule(divisor="logit_scale", body=("<arch>.embedding_scale (on the embedding rows)",)),
    "gemma3n": Rule(refuse_head="Gemma 3n (per-layer embeddings, AltUp)",
                    refuse_embedding="Gemma 3n (per-layer embeddings, AltUp)"),
    "gemma-embedding": Rule(refuse_head="an embedding model (no LM head)", embed_sqrt_hidden=True),
}
# llama.cpp's architecture name -> transformers' model type of the same family (what a checkpoint written from
# a GGUF file names in its config.json, with the family's fields: hf_config_fields).
GGUF_TO_HF = {"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text", "command-r": "cohere",
              "cohere2": "cohere2", "granite": "granite", "granitemoe": "granitemoe",
              "granitehybrid": "granitemoehybrid", "phi2": "phi"}
GGUF_TRANSFORM_KEYS = ("final_logit_softcapping", "logit_scale", "embedding_scale", "attn_logit_softcapping")


# The range a config's scale, divisor, soft-cap or embedding scale may take (real ones: 0.03 .. 100): file
# content is untrusted, and a factor of 1e30 would turn every logit into inf.
FACTOR_RANGE = (2.0**-24, 2.0**24)


def _number(value: Any, where: str, arch: str) -> float:
    lo, hi = FACTOR_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise ArchitectureError(f"{where}: {arch}: expected a number in [2^-24, 2^24], got {value!r:.80}")
    return float(value)


def _is_gguf(ckpt: Any) -> bool:
    return hasattr(ckpt, "metadata") and hasattr(ckpt, "array_lengths")


def _fields(ckpt: Any) -> tuple[str, str, dict[str, Any], str]:
    """``(architecture, where, fields, prefix)``: the config's fields (a GGUF file: its ``<arch>.*``
    metadata without the prefix) and how a message names their source."""
    if _is_gguf(ckpt):
        arch = str(ckpt.config.get("model_type", ""))
        prefix = f"{arch}."
        fields = {k[len(prefix):]: v for k, v in ckpt.metadata.items() if arch and k.startswith(prefix)}
        return arch, f"{ckpt.path} (GGUF metadata)", fields, prefix
    config = getattr(ckpt, "config", {}) or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    merged = {**text, **{k: v for k, v in config.items() if k != "text_config"}}
    arch = config.get("model_type", "")
    directory = getattr(ckpt, "directory", getattr(ckpt, "path", "?"))
    return (arch if isinstance(arch, str) else ""), f"{directory}/config.json", merged, ""


def _bias_tensor(ckpt: Any, head_tensor: str | None) -> str | None:
    if head_tensor is None:
        return None
    module = head_tensor.rsplit(".", 1)[0]
    candidates = [f"{module}.bias"] if module.endswith("lm_head") else [f"{module}.bias", *BIAS_NAMES]
    return next((name for name in candidates if ckpt.has(name)), None)


def family_of(ckpt: Any, *, head_tensor: str | None = None, hidden_size: int | None = None,
              need_head: bool = True, need_embedding: bool = True) -> Family:
    """The family of an opened checkpoint (headers only).

    ``head_tensor``: the tensor holding the head (its module's ``bias`` is the head's bias);
    ``hidden_size``: H, for ``sqrt(H)`` scales (default: the config's). ``need_head`` /
    ``need_embedding``: which end the caller loads; only a refusal of an end it loads raises.
    Raises :class:`~trtvocab.errors.ArchitectureError` naming the model type and the field.
    """
    arch, where, fields, prefix = _fields(ckpt)
    gguf_file = _is_gguf(ckpt)
    rule = (GGUF_RULES if gguf_file else RULES).get(arch)
    if rule is None:
        scanned = GGUF_TRANSFORM_KEYS if gguf_file else TRANSFORM_FIELDS
        for name in scanned:
            if not is_neutral(name, fields.get(name)):
                raise ArchitectureError(
                    f"{where}: model type {arch or '(none)'!r} sets {prefix}{name} = {fields[name]!r:.80}, and "
                    "trtvocab does not know what this architecture does with it (it changes the logits or the "
                    "embedding rows in some families); refused rather than computed wrong. Known families: "
                    "docs/model_families.md")
        rule = Rule()
    if need_head:
        for tensor, what in UNMODELED_TENSORS.items():
            if ckpt.has(tensor):
                raise ArchitectureError(f"{where}: model type {arch!r}: the checkpoint holds {tensor} ({what}), "
                                        "which trtvocab does not model; refused rather than computed wrong")
    if need_head and rule.refuse_head:
        raise ArchitectureError(f"{where}: model type {arch!r}: its output layer has {rule.refuse_head}, "
                                "which trtvocab does not model; refused rather than computed wrong")
    if need_embedding and rule.refuse_embedding:
        raise ArchitectureError(f"{where}: model type {arch!r}: its input embedding is {rule.refuse_embedding}, "
                                "which trtvocab does not model; refused rather than computed wrong")
    source: list[str] = []

    def value(name: str | None) -> float | None:
        # Absent only when None: 0, -0.0, false and true go through the number check (and are refused).
        if name is None or fields.get(name) is None:
            return None
        got = _number(fields[name], f"{where} {prefix}{name}", arch)
        source.append(f"{prefix}{name} = {got:g}")
        return got

    softcap = value(rule.softcap)
    scale = value(rule.scale) or 1.0
    divisor = value(rule.divisor) or 1.0
    bias = _bias_tensor(ckpt, head_tensor)
    if bias is not None:
        source.append(f"bias {bias}")
    head = HeadOps(bias=bias is not None, scale=scale, divisor=divisor, softcap=softcap)
    hidden = hidden_size if hidden_size is not None else fields.get("hidden_size", fields.get("d_model"))
    embedding = EmbeddingOps()
    switch = fields.get(rule.embed_sqrt_if) if rule.embed_sqrt_if else None
    if switch is not None and not isinstance(switch, bool):
        raise ArchitectureError(f"{where} {prefix}{rule.embed_sqrt_if}: {arch}: expected true or false, "
                                f"got {switch!r:.80}")
    if rule.embed_sqrt_hidden or switch is True:
        if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
            raise ArchitectureError(f"{where}: model type {arch!r} scales its embedding by sqrt(hidden size), "
                                    "but the hidden size is unknown")
        embedding = EmbeddingOps(scale=math.sqrt(hidden), round_scale=rule.embed_sqrt_hidden)
        source.append(f"embedding * sqrt({hidden})")
    elif rule.embed_field is not None:
        factor = value(rule.embed_field)
        if factor is not None:
            embedding = EmbeddingOps(scale=factor)
    return Family(architecture=arch, head=head, embedding=embedding, bias_tensor=bias, source=tuple(source),
                  body=rule.body)


def hf_config_fields(ckpt: Any, family: Family) -> dict[str, Any]:
    """The ``config.json`` fields that make a checkpoint written from ``ckpt``'s head read back as the
    same family: nothing for an HF checkpoint (its config is copied); for a GGUF file, transformers'
    model type and the family's fields under that type's names (``final_logit_softcapping``,
    ``logit_scale``, ``logits_scaling``). An op the type has no field for is refused."""
    if not _is_gguf(ckpt):
        return {}
    hf_type = GGUF_TO_HF.get(family.architecture, family.architecture)
    rule = RULES.get(hf_type, Rule())
    out: dict[str, Any] = {"model_type": hf_type} if hf_type else {}
    ops = family.head
    for what, value, name, neutral in (("soft-capping", ops.softcap, rule.softcap, None),
                                       ("a logit scale", ops.scale, rule.scale, 1.0),
                                       ("a logit divisor", ops.divisor, rule.divisor, 1.0)):
        if value == neutral:
            continue
        if name is None:
            raise ArchitectureError(f"{ckpt.path}: model type {family.architecture!r} has {what} ({value:g}) that "
                                    f"transformers' {hf_type!r} config cannot express")
        out[name] = value
    return out
