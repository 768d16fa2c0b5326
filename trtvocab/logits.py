"""Last-token-only logits: pick each sequence's last row *before* the GEMM.

Hidden states arrive packed, ``[T, H]`` for a batch of ``B`` sequences of
lengths ``seq_lens``. Generation needs one row per sequence, so computing all
``T`` rows would waste ``T / B`` of the head's FLOPs and logits memory::

    seq_lens = [3, 1, 2]     rows: a a a | b | c c
    last rows = cumsum - 1 = [2, 3, 5]   -> logits [3, V]

:func:`select_rows` is the selection (no collective); :class:`LogitsProcessor` runs the head
on it; :class:`LogitsHead` / :class:`CollectiveHead` declare what it needs of a head. For the next ids of a decode step
without the logits, ``trtvocab.sampling.decode(hidden, head, params, seq_lens=...)`` selects
the same rows and streams the vocab above the head's budget (docs/generate.md, "How one step runs").
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from trtvocab.base.inputs import hidden_states_error, last_token_rows
from trtvocab.errors import InputError

__all__ = ["CollectiveHead", "LogitsHead", "LogitsProcessor", "last_rows", "last_token_rows", "select_rows",
           "shard_logits"]


@runtime_checkable
class LogitsHead(Protocol):
    """What :class:`LogitsProcessor` needs of any head: ``head(rows)``, the logits of the selected rows."""

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class CollectiveHead(LogitsHead, Protocol):
    """A head whose ranks may meet (:class:`~trtvocab.lm_head.LMHead`): what the processor also uses.

    ``mapping.enable_attention_dp``: whether a rank may bring no rows (it still joins the
    collectives); ``raise_collectively(error)``: raise a rank's own input error after telling
    the group, so a split head's peers raise :class:`~trtvocab.errors.PeerRankError` instead of
    waiting in its handshake. A plain :class:`LogitsHead` (a reference ``nn.Module``) never meets:
    no empty batch, and its input errors are raised as they are.
    """

    mapping: Any

    def raise_collectively(self, error: BaseException) -> None: ...


class LogitsProcessor(nn.Module):
    """Selects rows, runs the head, returns float32 logits (no arguments; stateless).

    ``forward(hidden_states [T, H], lm_head, seq_lens=None, *, return_context_logits=False,
    num_logits_per_seq=1)``: by default only each sequence's last row (``cumsum(seq_lens) - 1``;
    ``seq_lens=None`` means one sequence, the last row) goes through the head;
    ``num_logits_per_seq=k`` (an int, or one per sequence) sends each sequence's last ``k``
    rows, in order (what a draft-then-verify step of speculative decoding scores);
    ``return_context_logits`` sends all ``T`` rows. ``lm_head``: a :class:`LogitsHead` (one whose
    ranks meet: a :class:`CollectiveHead`). The head's gather mode holds here too: with
    ``gather_output="rank0"`` rank 0 of its group gets the ``[rows, V]`` logits and the others None; with
    ``gather_chunk_rows`` the rows are gathered that many at a time into one output.

    The logits budget: ``forward`` returns the logits, so it always materializes them, whatever
    ``lm_head.logits_budget_bytes`` says. A step that needs only the next ids calls
    ``trtvocab.sampling.decode(hidden_states, lm_head, params, seq_lens=seq_lens)`` instead: the
    same rows, and above the budget the vocab streamed in chunks (``[B, V_local]`` never held).
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        lm_head: LogitsHead,
        seq_lens: Any = None,
        *,
        return_context_logits: bool = False,
        num_logits_per_seq: Any = 1,
        adapter_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``adapter_ids``: each sequence's LoRA adapter (int ``[B]``, ``-1``: none; ``LMHead.load_adapter``),
        given to every row the head sees of that sequence."""
        # Under attention DP a rank may have no requests this step, yet its head must still
        # join the others' collectives: it passes an empty [0, H] batch through.
        meets = isinstance(lm_head, CollectiveHead)
        idle_ok = meets and bool(lm_head.mapping.enable_attention_dp)
        try:
            selected = select_rows(hidden_states, seq_lens, return_context_logits=return_context_logits,
                                   num_logits_per_seq=num_logits_per_seq, idle_ok=idle_ok)
            row_adapters = None
            if adapter_ids is not None:
                if not hasattr(lm_head, "use_adapters"):
                    raise InputError(f"adapter_ids: {type(lm_head).__name__} holds no adapters")
                row_adapters = select_adapter_ids(adapter_ids, hidden_states.shape[0], seq_lens,
                                                  return_context_logits=return_context_logits,
                                                  num_logits_per_seq=num_logits_per_seq)
        except InputError as error:
            # The ranks of a split head are about to meet in its handshake: a rank that
            # stops here must still take part, or its peers would wait for it until the
            # collective timeout. It raises its own error; they raise PeerRankError.
            if meets:
                lm_head.raise_collectively(error)
            raise
        if row_adapters is not None:
            with lm_head.use_adapters(row_adapters):  # type: ignore[attr-defined]
                return _float(lm_head(selected))
        return _float(lm_head(selected))


def _float(logits: torch.Tensor | None) -> torch.Tensor | None:
    """float32 logits, or None where the head gathered them to another rank (``gather_output="rank0"``)."""
    return None if logits is None else logits.float()


def select_adapter_ids(adapter_ids: Any, total: int, seq_lens: Any = None, *, return_context_logits: bool = False,
                       num_logits_per_seq: Any = 1) -> torch.Tensor:
    """Each selected row's adapter index, from one per sequence (``[B]``), for the rows that
    :func:`select_rows` picks with the same arguments (no collective; :class:`InputError` for bad input)."""
    lens = [total] if seq_lens is None else seq_lens
    lens_t = torch.as_tensor(lens if not isinstance(lens, torch.Tensor) else lens.cpu()).to(torch.int64)
    if not isinstance(adapter_ids, torch.Tensor) or adapter_ids.dtype.is_floating_point \
            or adapter_ids.dtype == torch.bool or adapter_ids.dim() != 1 or adapter_ids.numel() != lens_t.numel():
        raise InputError(f"adapter_ids: expected an integer tensor [{lens_t.numel()}] (one per sequence), got "
                         f"{getattr(adapter_ids, 'shape', type(adapter_ids).__name__)}")
    per_row = adapter_ids.cpu().to(torch.int64).repeat_interleave(lens_t)
    if return_context_logits:
        return per_row
    if seq_lens is None and isinstance(num_logits_per_seq, int) and num_logits_per_seq == 1:
        return per_row[-1:]
    return per_row[last_rows(last_token_rows(lens, total), lens_t, num_logits_per_seq)]


def select_rows(hidden_states: Any, seq_lens: Any = None, *, return_context_logits: bool = False,
                num_logits_per_seq: Any = 1, idle_ok: bool = False) -> torch.Tensor:
    """The rows the head must see: each sequence's last ``k``, or all of them (no collective; an
    :class:`InputError` for bad input). ``idle_ok``: an empty batch without sequences is fine."""
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
    if seq_lens is None and isinstance(num_logits_per_seq, int) and num_logits_per_seq == 1:
        return hidden_states[-1:]
    lens = [total] if seq_lens is None else seq_lens
    ends = last_token_rows(lens, total)
    rows = last_rows(ends, torch.as_tensor(lens if not isinstance(lens, torch.Tensor) else lens.cpu()),
                     num_logits_per_seq)
    return hidden_states.index_select(0, rows.to(hidden_states.device))


def last_rows(ends: torch.Tensor, lens: torch.Tensor, k: Any) -> torch.Tensor:
    """Indices of each sequence's last ``k`` rows, in order (``k`` an int or one per sequence).

    ``ends``: each sequence's last row (:func:`last_token_rows`); ``lens``: the lengths.
    """
    lens = lens.to(torch.int64)
    if isinstance(k, int) and not isinstance(k, bool):
        counts = torch.full_like(lens, k)
    elif isinstance(k, list | tuple | torch.Tensor) and not isinstance(k, bool):
        try:
            counts = torch.as_tensor(list(k.tolist() if isinstance(k, torch.Tensor) else k))
        except (TypeError, ValueError):
            raise InputError(f"num_logits_per_seq: expected an int or one int per sequence, got {k!r}") from None
        if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype == torch.bool \
                or counts.numel() != lens.numel():
            raise InputError(f"num_logits_per_seq: expected {lens.numel()} ints (one per sequence), got {k!r}")
        counts = counts.to(torch.int64)
    else:
        raise InputError(f"num_logits_per_seq: expected an int or one int per sequence, got {k!r}")
    if bool((counts < 1).any()) or bool((counts > lens).any()):
        raise InputError(f"num_logits_per_seq: each k must be in [1, its sequence length]; "
                         f"got k={counts.tolist()} for seq_lens={lens.tolist()}")
    if bool((counts == 1).all()):
        return ends
    starts = ends.cpu() - counts + 1
    return torch.cat([torch.arange(int(s), int(s) + int(c)) for s, c in zip(starts, counts, strict=True)])


def shard_logits(head: nn.Module, hidden_states: torch.Tensor, seq_lens: Any = None, *,
                 return_context_logits: bool = False) -> torch.Tensor:
    """This rank's float32 ``[B or T, V_local]`` logits of the rows the LogitsProcessor selects,
    with no collective: the per-rank PyTorch fallback that exported graphs and engines
    (which also compute one rank's columns) are compared with and stand in for."""
    rows = select_rows(hidden_states, seq_lens, return_context_logits=return_context_logits)
    with torch.no_grad():
        return head.local_logits(rows)[:, : head.local_vocab_size].float()
