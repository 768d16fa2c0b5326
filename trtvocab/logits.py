"""Last-token-only logits: pick each sequence's last row *before* the GEMM.

Hidden states arrive packed, ``[T, H]`` for a batch of ``B`` sequences of
lengths ``seq_lens``. Generation needs one row per sequence, so computing all
``T`` rows would waste ``T / B`` of the head's FLOPs and logits memory::

    seq_lens = [3, 1, 2]     rows: a a a | b | c c
    last rows = cumsum - 1 = [2, 3, 5]   -> logits [3, V]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trtvocab.errors import InputError
from trtvocab.inputs import hidden_states_error, last_token_rows

__all__ = ["LogitsProcessor", "last_token_rows", "shard_logits"]


class LogitsProcessor(nn.Module):
    """Selects rows, runs the head, returns float32 logits (no arguments; stateless).

    ``forward(hidden_states [T, H], lm_head, seq_lens=None, *, return_context_logits=False)``:
    by default only each sequence's last row (``cumsum(seq_lens) - 1``; ``seq_lens=None``
    means one sequence, the last row) goes through the head; ``return_context_logits``
    sends all ``T`` rows.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        lm_head: nn.Module,
        seq_lens: Any = None,
        *,
        return_context_logits: bool = False,
    ) -> torch.Tensor:
        # Under attention DP a rank may have no requests this step, yet its head must still
        # join the others' collectives: it passes an empty [0, H] batch through.
        mapping = getattr(lm_head, "mapping", None)
        idle_ok = bool(getattr(mapping, "enable_attention_dp", False))
        try:
            selected = self._select(hidden_states, seq_lens, return_context_logits, idle_ok)
        except InputError as error:
            # The ranks of a split head are about to meet in its handshake: a rank that
            # stops here must still take part, or its peers would wait for it until the
            # collective timeout. It raises its own error; they raise PeerRankError.
            fail = getattr(lm_head, "raise_collectively", None)
            if fail is not None:
                fail(error)
            raise
        return lm_head(selected).float()

    @staticmethod
    def _select(hidden_states: Any, seq_lens: Any, return_context_logits: bool, idle_ok: bool = False) -> torch.Tensor:
        """The rows the head must see: each sequence's last one, or all of them."""
        error = hidden_states_error(hidden_states, allow_empty=True)
        if error is not None:
            raise error
        total = hidden_states.shape[0]
        if total == 0:
            empty_lens = seq_lens is None or len(seq_lens) == 0
            if idle_ok and empty_lens:
                return hidden_states
            raise InputError("hidden_states: empty batch (T = 0)")
        if return_context_logits:
            if seq_lens is not None:
                last_token_rows(seq_lens, total)  # still validate
            return hidden_states
        if seq_lens is None:
            return hidden_states[-1:]
        rows = last_token_rows(seq_lens, total).to(hidden_states.device)
        return hidden_states.index_select(0, rows)


def shard_logits(head: nn.Module, hidden_states: torch.Tensor, seq_lens: Any = None, *,
                 return_context_logits: bool = False) -> torch.Tensor:
    """This rank's float32 ``[B or T, V_local]`` logits of the rows the LogitsProcessor selects,
    with no collective: the per-rank PyTorch fallback that exported graphs and engines
    (which also compute one rank's columns) are compared with and stand in for."""
    rows = LogitsProcessor._select(hidden_states, seq_lens, return_context_logits)
    with torch.no_grad():
        return head.local_logits(rows)[:, : head.local_vocab_size].float()
