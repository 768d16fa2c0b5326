"""The tensor names a head and an input embedding go by, and which of them is a tied head.

Both checkpoint formats (:mod:`trtvocab.checkpoints.checkpoint`, :mod:`trtvocab.checkpoints.gguf`,
which exposes its tensors under these HF names) answer ``lm_head_name()`` with these rules; every
other module asks ``lm_head_name()`` (or the gating verdict's ``tied``) instead of comparing names.
"""

from __future__ import annotations

LM_HEAD_NAME = "lm_head.weight"
# compressed-tensors' NVFP4 head: packed codes under weight_packed, no lm_head.weight at all.
LM_HEAD_PACKED_NAME = "lm_head.weight_packed"
EMBEDDING_NAMES = (
    "model.embed_tokens.weight",
    "embeddings.word_embeddings.weight",
    "transformer.wte.weight",
    "bert.embeddings.word_embeddings.weight",
    "model.embeddings.word_embeddings.weight",
)


def names_tied_head(tensor_name: str) -> bool:
    """Whether a head tensor the caller named is the tied input embedding: it is, unless it lies in
    an ``lm_head`` module (``lm_head.weight``, ``lm_head.weight_packed``, ``model.lm_head.weight``)."""
    return not tensor_name.rsplit(".", 1)[0].endswith("lm_head")
