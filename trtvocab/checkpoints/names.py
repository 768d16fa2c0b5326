"""The tensor names a head and an input embedding go by, and which of them is a tied head.

Both checkpoint formats (:mod:`trtvocab.checkpoints.checkpoint`, :mod:`trtvocab.checkpoints.gguf`,
which exposes its tensors under these HF names) answer ``lm_head_name()`` with these rules; every
other module asks ``lm_head_name()`` (or the gating verdict's ``tied``) instead of comparing names.
The names are those transformers' causal-LM classes save (checked by ``tools/model_zoo.py``); a name
is only known here once what its family computes around it is modeled
(:mod:`trtvocab.checkpoints.families`), so that finding a tensor never means computing it wrong.
"""

from __future__ import annotations

from typing import Any

from trtvocab.errors import CheckpointError

LM_HEAD_NAME = "lm_head.weight"
# compressed-tensors' NVFP4 head: packed codes under weight_packed, no lm_head.weight at all.
LM_HEAD_PACKED_NAME = "lm_head.weight_packed"
# Untied heads under other names (GPT-NeoX embed_out, RWKV / DeepSeek-V4 head, GIT / original Llama
# output, Reformer, RemBERT, Fuyu), looked for after lm_head.weight; each is the head when present.
HEAD_NAMES = (
    LM_HEAD_NAME, LM_HEAD_PACKED_NAME, "model.lm_head.weight", "language_model.lm_head.weight", "embed_out.weight",
    "head.weight", "output.weight", "lm_head.decoder.weight", "cls.predictions.decoder.weight",
)
EMBEDDING_NAMES = (
    "model.embed_tokens.weight",
    "embeddings.word_embeddings.weight",
    "transformer.wte.weight",
    "bert.embeddings.word_embeddings.weight",
    "model.embeddings.word_embeddings.weight",
    "transformer.word_embeddings.weight",  # BLOOM, Falcon
    "model.word_embeddings.weight",  # Bailing, Param2MoE, Sarvam-MoE
    "backbone.embeddings.weight",  # Mamba, Falcon-Mamba, Mamba2, Nemotron-H, xLSTM
    "transformer.tokens_embed.weight",  # OpenAI GPT
    "transformer.w.weight",  # CTRL
    "prophetnet.word_embeddings.weight",
    "model.embeddings.tok_embeddings.weight",  # ModernBERT decoder
    "cpmant.input_embedding.weight",
    "rwkv.embeddings.weight",
    "gpt_neox.embed_in.weight",
    "gpt_neox_japanese.embed_in.weight",
    "tok_embeddings.weight",  # original Llama names
    "transformer.embeddings.weight",  # XLM
    "transformer.word_embedding.weight",  # XLNet
)
# Suffixes found under a model-specific prefix (roberta., electra., model.decoder., language_model.model.):
# used when exactly one tensor ends with one of them (two, as in an encoder-decoder file, are refused).
EMBEDDING_SUFFIXES = (".embeddings.word_embeddings.weight", ".decoder.embed_tokens.weight",
                      ".model.embed_tokens.weight", "language_model.embed_tokens.weight", ".embed_tokens.weight")


def names_tied_head(tensor_name: str) -> bool:
    """Whether a head tensor the caller named is the tied input embedding: it is, unless it is one of
    :data:`HEAD_NAMES` or lies in an ``lm_head`` module (``lm_head.weight``, ``model.lm_head.weight``)."""
    return tensor_name not in HEAD_NAMES and not tensor_name.rsplit(".", 1)[0].endswith("lm_head")


def find_embedding(ckpt: Any) -> str | None:
    """The checkpoint's input-embedding tensor (``<module>.weight``, or compressed-tensors' NVFP4
    ``<module>.weight_packed``): a known name, else the one tensor with a known suffix; None when none.
    Two tensors with a suffix and no known name are refused, naming both."""
    for name in EMBEDDING_NAMES:
        for candidate in (name, name + "_packed"):
            if ckpt.has(candidate):
                return candidate
    for suffix in EMBEDDING_SUFFIXES:
        found = [n for n in ckpt.names() if n.endswith(suffix)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise CheckpointError(f"checkpoint {ckpt.path}: several input embeddings {found[:4]}; pass tensor_name= "
                                  "to name the one to use")
    return None
