"""Which checkpoint an artifact was built from: a digest of the head's stored bytes.

``head_digest(path)`` is the sha256 of the head tensor as the checkpoint stores it (the
``lm_head`` matrix, or the tied input embedding, and every ``lm_head.*`` scale beside it):
its name, stored type, shape and raw bytes, read once, in order. A build records it in
the manifest (``checkpoint_sha256``); ``generate`` with an ``artifact`` computes it
for its model and refuses an artifact of another head, even one of the same shape (a
synthetic artifact, or another fine-tune, would decode garbage silently).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtvocab.base.safe_read import open_regular
from trtvocab.checkpoints.checkpoint import TensorInfo, open_checkpoint
from trtvocab.errors import CheckpointError

if TYPE_CHECKING:
    from trtvocab.checkpoints.gguf import GGUFTensorInfo

CHUNK = 8 << 20


def _feed(h: Any, info: TensorInfo | GGUFTensorInfo) -> None:
    stored = str(getattr(info, "ggml_type", info.dtype))  # GGUF: the block type, not what a read returns
    h.update(f"{info.name}|{stored}|{list(info.shape)}|".encode())
    with open_regular(info.file, "checkpoint file", CheckpointError) as fh:
        fh.seek(info.offset)
        left = info.nbytes
        while left:
            chunk = fh.read(min(CHUNK, left))
            if not chunk:
                raise CheckpointError(f"{info.file}: {info.name} is truncated (wanted {info.nbytes} bytes at "
                                      f"{info.offset})")
            h.update(chunk)
            left -= len(chunk)


def head_digest(path: str | Path, tensor_name: str | None = None) -> str:
    """sha256 of the head tensor (and its ``lm_head.*`` scales) as stored in the checkpoint at ``path``."""
    ckpt = open_checkpoint(path)
    name, _ = ckpt.lm_head_name(tensor_name)
    h = hashlib.sha256()
    _feed(h, ckpt.info(name))
    prefix = name.rsplit(".", 1)[0] + "."
    for other in sorted(n for n in ckpt.names() if n.startswith(prefix) and n != name):
        _feed(h, ckpt.info(other))
    return h.hexdigest()


__all__ = ["head_digest"]
