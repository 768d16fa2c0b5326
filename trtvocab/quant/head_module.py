"""The LM head as the only module of a model: what both quantization toolchains calibrate and export.

ModelOpt matches its quantizers by module name and compressed-tensors its config groups by
name or class, so both are given an ``nn.Module`` whose one layer is ``lm_head``, an
``nn.Linear`` as in Hugging Face's models.
"""

from __future__ import annotations

import torch
from torch import nn


class HeadOnly(nn.Module):
    """A model whose only layer is ``lm_head`` (``nn.Linear(H, V)``, no bias, frozen).

    Args:
        weight: the head's ``[V, H]`` matrix (copied into the layer, in its dtype).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        vocab, hidden = weight.shape
        self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)
        self.lm_head.weight.requires_grad_(False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


__all__ = ["HeadOnly"]
