"""One decode step: ``hidden -> next ids``, materialized or streamed by the head's logits budget.

:func:`decode` takes the last hidden rows (or packed rows with ``seq_lens``, selected as the
:class:`~trtvocab.logits.LogitsProcessor` selects them), xgrammar's bitmask and the sampling
params, and returns the next ids, the same on every rank. When this batch's float32
``[B, V_local]`` logits (``V_local`` the widest shard, so every rank decides alike) fit in
``head.logits_budget_bytes`` it computes them and draws (the prepared step's pipeline,
:class:`~trtvocab.sampling.prepared.DecodeStep`);
otherwise it streams the shard in vocab chunks (:func:`trtvocab.sampling.chunked.stream_decode`): the
same ids bitwise, the logits never held. Both paths share one cached handshake (docs/generate.md,
"How one step runs"; docs/architecture.md, "The vocab-chunked head").
"""

from __future__ import annotations

from typing import Any

import torch

from trtvocab.errors import InputError
from trtvocab.lm_head import LMHead
from trtvocab.logits import select_rows
from trtvocab.parallel.sharding import VocabPlacement
from trtvocab.sampling import added_vocab, chunked
from trtvocab.sampling.added_vocab import has_added_vocab
from trtvocab.sampling.args import SamplerOutput, state_error
from trtvocab.sampling.bitmask import apply_bitmask_, bitmask_error
from trtvocab.sampling.draw import checked_sample
from trtvocab.sampling.params import SamplingParams
from trtvocab.sampling.rank0 import gathers_to_rank0, rank0_output
from trtvocab.sampling.reductions import check_logits
from trtvocab.sampling.state import TokenState


def streams(head: object, rows: int) -> bool:
    """Whether a decode step of ``rows`` rows streams: float32 ``[rows, V_local]`` (the widest
    shard) above ``head.logits_budget_bytes``, on an LMHead the chunked path serves (not attention
    DP with LM-head TP, where ranks bring different rows)."""
    if not isinstance(head, LMHead) or (head.is_split and head.mapping.enable_attention_dp):
        return False
    widest = max(s.size for s in head.shards)
    if has_added_vocab(head):  # the added piece streams as one more chunk: its columns count too
        widest += max(s.added.size for s in head.added_shards if s.added is not None)
    return rows * widest * 4 > head.logits_budget_bytes


def decode(
    hidden: torch.Tensor,
    head: LMHead,
    params: SamplingParams | list[SamplingParams],
    *,
    step: int = 0,
    vocab_limit: int | None = None,
    bitmask: torch.Tensor | None = None,
    seq_lens: Any = None,
    state: TokenState | None = None,
) -> torch.Tensor:
    """:func:`decode_output`'s token ids ``[B]``."""
    return decode_output(hidden, head, params, step=step, vocab_limit=vocab_limit, bitmask=bitmask,
                         seq_lens=seq_lens, state=state).token_ids


def decode_output(
    hidden: torch.Tensor,
    head: LMHead,
    params: SamplingParams | list[SamplingParams],
    *,
    step: int = 0,
    vocab_limit: int | None = None,
    bitmask: torch.Tensor | None = None,
    seq_lens: Any = None,
    state: TokenState | None = None,
) -> SamplerOutput:
    """One decode step's token ids ``[B]`` from the last hidden rows ``hidden [B, H]``: the head's
    local logits, xgrammar's ``bitmask`` (optional, ``int32 [B, W]``), then ``sampling.sample``.

    ``seq_lens``: ``hidden`` is packed ``[T, H]`` and each sequence's last row is the step's row
    (``LogitsProcessor``'s selection). The same tokens as ``sample(apply_token_bitmask(
    head.local_logits(hidden), bitmask, head), head, params)``, but every input of the step
    (hidden, bitmask, params) is validated before one handshake, which runs only on the first
    step and when the step's signature (batch size, dtypes, filters, the path) changes; on the
    other steps the verdict rides on the step's first data collective. Without top-k / top-p /
    min-p a steady materialized step of a split head is therefore **one** collective (the race's
    ``[tp, B]`` pairs) instead of three (the forward's handshake, the sampler's, the race). Above
    the head's logits budget the step streams (module docstring). A bad input on one rank still
    raises on every rank. ``state``: the batch's :class:`~trtvocab.sampling.state.TokenState`
    (penalties, bad words, min tokens read it; the caller appends each step's ids). Returns the
    token ids and the logprobs the rows ask for (:class:`~trtvocab.sampling.args.SamplerOutput`).

    A split head with ``gather_output="rank0"`` is sampled as vLLM does it instead: its forward gathers the
    ``[B, V]`` logits to rank 0 of its group, rank 0 samples them on the whole vocabulary and broadcasts the
    ids (:mod:`trtvocab.sampling.rank0`; the same ids, its state covers the whole vocabulary). Every other
    mode (``True``, ``False``) samples on the shards as above; so does ``DecodeStep``, whatever the mode.
    """
    error: InputError | None = None
    if seq_lens is not None:
        try:
            hidden = select_rows(hidden, seq_lens)
        except InputError as exc:
            error = exc
    if gathers_to_rank0(head):  # gather_output="rank0": rank 0 samples the gathered logits, broadcasts the ids
        return rank0_output(hidden, head, params, step=step, vocab_limit=vocab_limit, bitmask=bitmask, error=error,
                            state=state)
    rows = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() == 2 else 0
    if streams(head, rows):
        return chunked.stream_output(hidden, head, params, step=step, vocab_limit=vocab_limit, bitmask=bitmask,
                                     error=error, state=state)
    if has_added_vocab(head):  # two id ranges per rank: trtvocab.sampling.added_vocab
        return added_vocab.token_order_output(hidden, head, params, step=step, vocab_limit=vocab_limit, bitmask=bitmask,
                                         error=error, state=state)
    logits = None
    place = VocabPlacement.of(head)  # what the draw reads: the shards, the group, the handshake state
    if error is None:
        error = head.check_input(hidden)
    if error is None:
        logits = head.local_logits(hidden)
        error = bitmask_error(logits, bitmask, place) if bitmask is not None else None
        if error is None and bitmask is not None:
            apply_bitmask_(logits, bitmask, place)
        error = error or check_logits(logits, place, "sampling.decode")
        error = error or state_error(state, logits.shape[0], place, "sampling.decode")
    return checked_sample(logits, place, params, step, vocab_limit, error, "decode",
                          bitmask if error is None else None, state)


__all__ = ["decode", "decode_output", "streams"]
