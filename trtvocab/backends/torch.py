"""The PyTorch fallback backend: ``rank{r}/weights.safetensors`` through the real :class:`LMHead`.

Always available; every other backend is checked against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file

from trtvocab.artifact.manifest import Manifest
from trtvocab.backends.base import RankLogits
from trtvocab.base.dtypes import head_dtype
from trtvocab.base.formats import Runtime
from trtvocab.base.safe_read import open_regular
from trtvocab.lm_head import LMHead
from trtvocab.logits import shard_logits


def head_from_artifact(root: Path, manifest: Manifest, rank: int, process_group: Any = None) -> LMHead:
    """The PyTorch fallback head of ``rank``, from its saved shard."""
    h = manifest.head
    head = LMHead(
        h.vocab_size, h.hidden_size, dtype=head_dtype(h.dtype), mapping=manifest.mapping.for_rank(rank),
        gather_output=True, quant_config=manifest.quant.config, vocab_layout=h.vocab_layout, pad_to=h.pad_to,
        process_group=process_group, head_ops=h.family.head, **h.head_options(),
    )
    path = Path(root) / manifest.entry(rank).files.weights
    open_regular(path, "rank weights").close()  # never hand a FIFO or a device to the loader
    head.load_weights(load_file(str(path)))
    return head


class TorchBackend:
    """The saved shard in a PyTorch :class:`~trtvocab.lm_head.LMHead` (CPU)."""

    name: ClassVar[str] = "torch"

    def __init__(self, root: Path, manifest: Manifest, rank: int) -> None:
        self.head = head_from_artifact(root, manifest, rank)
        self.context = manifest.head.context_logits

    def rank_logits(self, hidden: torch.Tensor, seq_lens: torch.Tensor | None) -> RankLogits:
        logits = shard_logits(self.head, hidden, seq_lens, return_context_logits=self.context)
        return RankLogits(logits, Runtime.TORCH)
