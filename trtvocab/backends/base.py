"""The one interface every backend implements: one rank's logits from packed hidden states."""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Protocol

import torch

from trtvocab.base.formats import Runtime


class RankLogits(NamedTuple):
    """One rank's float32 ``[B, V_local]`` (or ``[T, V_local]``, context artifacts) logits,
    and a truthful name of what computed them (a :class:`~trtvocab.base.formats.Runtime`)."""

    logits: torch.Tensor
    ran_on: Runtime


class RankBackend(Protocol):
    """A per-rank runner of an artifact, built as ``Backend(root, manifest, rank)``.

    ``rank_logits(hidden [T, H], seq_lens [B] | None)`` computes this rank's columns of the
    rows the LogitsProcessor would select (each sequence's last row; all rows for a
    context-logits artifact), with no collective: gathering across ranks is the runtime's.
    """

    name: ClassVar[str]

    def rank_logits(self, hidden: torch.Tensor, seq_lens: torch.Tensor | None) -> RankLogits: ...
