"""Checkpoints of 64 tokens that the hostile tests of ``weights/``, ``checkpoints/`` and ``pipeline/`` write:
a GGUF file whose tied head is stored in blocks (one scale of one token's block set to any fp16 bits), and a
dense HF folder with any ``config.json`` fields."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from tests.weights.test_gguf_blocks import random_blocks

Q = gguf.GGMLQuantizationType
V = 64
HIDDEN = {"Q8_0": 64, "Q6_K": 256, "Q4_0": 64, "Q4_1": 64, "Q5_0": 64, "Q4_K": 256}
BAD_TOKEN = 40  # rank 1's shard at tp 2 ([32, 64))


def write_blocks_gguf(path: Path, block_type: str, *, bad: tuple[int, int] | None = None, arch: str = "llama",
                      tokens: int = V, rows: int = V, meta: dict[str, Any] | None = None,
                      bias: np.ndarray | None = None) -> Path:
    """A GGUF file whose tied head ``token_embd.weight [rows, H]`` is stored as ``block_type``; ``bad``:
    ``(byte offset of a scale in the block, fp16 bits)`` written into token :data:`BAD_TOKEN`'s block 0."""
    hidden = HIDDEN[block_type]
    raw = random_blocks(block_type, rows, hidden)
    if bad is not None:
        at, bits = bad
        raw[BAD_TOKEN, at : at + 2] = np.frombuffer(struct.pack("<H", bits), np.uint8)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.embedding_length", hidden)
    writer.add_uint32(f"{arch}.block_count", 1)
    writer.add_uint32(f"{arch}.context_length", 128)
    for key, value in (meta or {}).items():
        getattr(writer, f"add_{value[0]}")(f"{arch}.{key}", value[1])
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    writer.add_tensor("token_embd.weight", raw, raw_dtype=Q[block_type])
    if bias is not None:
        writer.add_tensor("output.weight", raw, raw_dtype=Q[block_type])
        writer.add_tensor("output.bias", bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dense_checkpoint(root: Path, **config: Any) -> Path:
    """An HF folder: an untied float32 head and embedding [64, 32], ``config.json`` a llama one with ``config``."""
    root.mkdir(parents=True, exist_ok=True)
    w = torch.randn(V, 32, generator=torch.Generator().manual_seed(0))
    save_file({"lm_head.weight": w, "model.embed_tokens.weight": w.clone()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": V, "hidden_size": 32,
                                                  "tie_word_embeddings": False, **config}))
    return root
