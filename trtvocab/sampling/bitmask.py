"""Structured output per shard: xgrammar's token bitmask applied to one rank's columns.

Layout (xgrammar's): ``int32 [B, W]``; token ``i`` is allowed iff bit ``i % 32`` of word
``i // 32`` is set, and ids ``>= 32 * W`` are not allowed. A rank owning columns
``[start, end)`` reads the bits of its own ids, whatever ``start % 32`` is; padding
columns (padded layout) stay ``-inf``. No collective: every rank holds the whole mask.
"""

from __future__ import annotations

from typing import Any

import torch

from trtvocab.errors import InputError
from trtvocab.parallel.sharding import Placement, VocabPlacement
from trtvocab.sampling.reductions import handshake


def bitmask_error(local_logits: Any, bitmask: Any, head: VocabPlacement) -> InputError | None:
    """Why ``bitmask`` cannot mask ``local_logits`` of ``head`` (None: it can)."""
    head = VocabPlacement.of(head)
    size, width = head.owned, head.local_width
    if not isinstance(local_logits, torch.Tensor) or local_logits.dim() != 2 \
            or local_logits.shape[1] not in (size, width):
        return InputError(f"apply_token_bitmask: local_logits must be [B, {size}] or [B, {width}] "
                          f"(this rank's columns), got {getattr(local_logits, 'shape', type(local_logits).__name__)}")
    if not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        got = f"{bitmask.dtype} {list(bitmask.shape)}" if isinstance(bitmask, torch.Tensor) else type(bitmask).__name__
        return InputError(f"apply_token_bitmask: bitmask must be an int32 [B, W] tensor (xgrammar's layout), got {got}")
    if bitmask.shape[0] != local_logits.shape[0]:
        return InputError(f"apply_token_bitmask: bitmask has {bitmask.shape[0]} rows, "
                          f"local_logits {local_logits.shape[0]}")
    return None


def allowed_columns(bitmask: torch.Tensor, start: int, width: int, owned: int) -> torch.Tensor:
    """Bool ``[B, width]``: which of columns ``start .. start + width`` the mask allows (padding: never)."""
    ids = torch.arange(start, start + width, device=bitmask.device)
    inside = (ids < bitmask.shape[1] * 32) & (torch.arange(width, device=bitmask.device) < owned)
    words = bitmask[:, (ids // 32).clamp(max=max(bitmask.shape[1] - 1, 0))] if bitmask.shape[1] else \
        torch.zeros(bitmask.shape[0], width, dtype=torch.int32, device=bitmask.device)
    bits = (words >> (ids % 32).to(torch.int32)) & 1
    return (bits != 0) & inside


def apply_bitmask_(local_logits: torch.Tensor, bitmask: torch.Tensor, head: VocabPlacement) -> torch.Tensor:
    """Set the columns the mask does not allow to ``-inf``, in place (validated input)."""
    head = VocabPlacement.of(head)
    shard = head.shard
    if head.added is not None:  # two segments: each column's token id (padding -1: never allowed)
        ids = head.local_token_ids(local_logits.device)
        if local_logits.shape[1] == head.owned:
            ids = ids[ids >= 0]
        keep = allowed_ids(bitmask.to(local_logits.device), ids)
    else:
        keep = allowed_columns(bitmask.to(local_logits.device), shard.start, local_logits.shape[1], shard.size)
    return local_logits.masked_fill_(~keep, float("-inf"))


def allowed_ids(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, n]``: which of the token ids ``ids [n]`` the mask allows (``-1``, padding: never)."""
    inside = (ids >= 0) & (ids < bitmask.shape[1] * 32)
    if not bitmask.shape[1]:
        return torch.zeros(bitmask.shape[0], ids.shape[0], dtype=torch.bool, device=bitmask.device)
    safe = ids.clamp(min=0)
    words = bitmask[:, (safe // 32).clamp(max=bitmask.shape[1] - 1)]
    bits = (words >> (safe % 32).to(torch.int32)) & 1
    return (bits != 0) & inside
def apply_token_bitmask(local_logits: torch.Tensor, bitmask: torch.Tensor, head: Placement) -> torch.Tensor:
    """Mask this rank's columns with xgrammar's ``int32 [B, W]`` bitmask, in place (returns them).

    Token ``i`` stays iff bit ``i % 32`` of word ``i // 32`` is set; ids ``>= 32 * W`` and
    padding columns become ``-inf``. Bad shapes or dtypes raise :class:`InputError` on every rank.
    ``head``: the head or its :class:`~trtvocab.parallel.sharding.VocabPlacement`.
    """
    head = VocabPlacement.of(head)
    error = bitmask_error(local_logits, bitmask, head)
    words = bitmask.shape[1] if error is None else 0
    handshake(head, local_logits, error, "bitmask", extra=words, argument=bitmask if error is None else None)
    return apply_bitmask_(local_logits, bitmask, head)


