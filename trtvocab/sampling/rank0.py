"""A decode step of a head that gathers to one rank (``LMHead(..., gather_output="rank0")``): vLLM's
``_gather_logits``, then the broadcast of the sampled ids.

::

    every rank   validate (hidden, params, bitmask, state) -> LMHead.forward: handshake, gather to rank 0
    rank 0       [B, V] logits -> bitmask -> sample on the whole vocabulary (a replicated placement)
    every rank   broadcast [1 + B] int64 from rank 0: a status word, the ids   (+ the logprobs when asked)

Rank 0 runs the sampler a tp-1 head runs, on every rank's columns moved (never recomputed), so the ids
are tp 1's whenever the logits are, and the shard sampler's (noise keyed by token id). What rank 0 finds
only after the gather (NaN logits, a row with no allowed token) rides on the status word: rank 0 raises
it, the others :class:`~trtvocab.errors.PeerRankError`. The status word also says how many logprobs
columns follow, so only rank 0's params count (as in vLLM, where only the driver samples). Rank 0's
state covers the whole vocabulary: ``TokenState.for_head(token_order_view(head), prompts)``.
docs/architecture.md, "Gather strategies".
"""

from __future__ import annotations

from typing import Any

import torch

from trtvocab.errors import InputError, PeerRankError
from trtvocab.lm_head import LMHead
from trtvocab.parallel import distributed as D
from trtvocab.parallel.sharding import VocabPlacement
from trtvocab.sampling.added_vocab import has_added_vocab, token_order_view
from trtvocab.sampling.args import Logprobs, SamplerOutput, draw_args_error, state_error
from trtvocab.sampling.bitmask import apply_bitmask_, bitmask_error
from trtvocab.sampling.draw import sample_output
from trtvocab.sampling.params import SamplingParams
from trtvocab.sampling.state import TokenState

FAILED = -1  # the status word when rank 0 could not sample; otherwise the logprobs columns that follow (0: none)
WHAT = "sampling.decode (gather_output='rank0')"


def gathers_to_rank0(head: object) -> bool:
    """Whether a decode step of ``head`` samples on rank 0 (:func:`rank0_output`): a split ``LMHead`` whose
    ``gather_output`` is ``"rank0"``."""
    return isinstance(head, LMHead) and head.is_split and head.gather_output == "rank0"


def whole_vocab(head: LMHead) -> VocabPlacement:
    """What rank 0 samples on: a replicated placement over the gathered columns, ``[0, V)`` (``V + A`` with
    an added segment) -- :func:`~trtvocab.sampling.added_vocab.token_order_view`'s, the placement a
    rank-0 :class:`~trtvocab.sampling.state.TokenState` is built on."""
    return token_order_view(head).placement


def _input_error(hidden: Any, head: LMHead, params: Any, step: Any, vocab_limit: Any, bitmask: Any, state: Any,
                 rows: int) -> InputError | None:
    """This rank's verdict on the step's inputs, before any collective (the checks rank 0's sampler makes)."""
    error = head.check_input(hidden)
    place = whole_vocab(head)
    added = has_added_vocab(head)
    if error is None:  # vocab_limit bounds the base ids; with added tokens the sampler never sees it
        error, _ = draw_args_error(params, rows, step, None if added else vocab_limit, place.vocab_size, WHAT)
    if error is None and added and vocab_limit is not None and (
            isinstance(vocab_limit, bool) or not isinstance(vocab_limit, int)
            or not 1 <= vocab_limit <= head.vocab_size):
        error = InputError(f"{WHAT}: vocab_limit must be an int in [1, base vocab_size={head.vocab_size}], "
                           f"got {vocab_limit!r}")
    if error is None and bitmask is not None:
        error = bitmask_error(torch.empty(rows, place.vocab_size, device="meta"), bitmask, place)
    if error is None and state is not None:
        if D.group_rank(head.process_group) == 0:
            error = state_error(state, rows, place, WHAT)
            if error is not None:
                error = InputError(f"{error} -- rank 0 samples the whole vocabulary: build its state with "
                                   "TokenState.for_head(token_order_view(head), prompts)")
        elif not isinstance(state, TokenState) or state.rows != rows:
            error = InputError(f"{WHAT}: state must be None or a TokenState of the batch's {rows} rows")
    return error


def _sample(logits: torch.Tensor, head: LMHead, params: Any, step: int, vocab_limit: int | None,
            bitmask: torch.Tensor | None, state: TokenState | None) -> SamplerOutput:
    """Rank 0: the gathered ``[B, V]`` logits (token order) sampled on :func:`whole_vocab`, as a tp-1 head's
    ``decode_output`` samples its own (and, with an added segment, as ``added_vocab.gathered_output``)."""
    place = whole_vocab(head)
    if has_added_vocab(head):
        logits = logits.float()
        if vocab_limit is not None and vocab_limit < head.vocab_size:
            logits[:, vocab_limit: head.vocab_size] = float("-inf")
        vocab_limit = None
    if bitmask is not None:
        apply_bitmask_(logits, bitmask, place)
    return sample_output(logits, place, params, step=step, vocab_limit=vocab_limit, state=state)


def _pack(out: SamplerOutput) -> tuple[int, torch.Tensor | None]:
    """The logprobs columns and, when there are any, ``[B, 3 C]`` int64: ids, ranks, the values' float32 bits."""
    lp = out.logprobs
    if lp is None:
        return 0, None
    bits = lp.values.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    return lp.ids.shape[1], torch.cat([lp.ids.to(torch.int64), lp.ranks.to(torch.int64), bits], dim=1)


def _unpack(packed: torch.Tensor, cols: int) -> Logprobs:
    ids, ranks, bits = packed[:, :cols], packed[:, cols: 2 * cols], packed[:, 2 * cols:]
    return Logprobs(ids.clone(), bits.to(torch.int32).view(torch.float32).clone(), ranks.clone())


def rank0_output(hidden: Any, head: LMHead, params: SamplingParams | list[SamplingParams], *, step: int = 0,
                 vocab_limit: int | None = None, bitmask: torch.Tensor | None = None,
                 error: InputError | None = None, state: TokenState | None = None) -> SamplerOutput:
    """``sampling.decode_output`` of a head that gathers to rank 0 (the module docstring): the same
    :class:`SamplerOutput` on every rank. ``hidden``: the step's rows ``[B, H]`` (already selected);
    ``error``: the caller's own verdict so far (row selection), raised on every rank with the others."""
    rows = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() == 2 else 0
    error = error or _input_error(hidden, head, params, step, vocab_limit, bitmask, state, rows)
    if error is not None:
        head.raise_collectively(error)  # the forward's handshake, with this verdict: the peers raise there
    logits = head(hidden)  # the handshake every call, then the gather: [B, V] on group rank 0, None elsewhere
    device = hidden.device
    failure: BaseException | None = None
    out: SamplerOutput | None = None
    cols, packed = 0, None
    if logits is not None:
        try:
            out = _sample(logits, head, params, step, vocab_limit, bitmask, state)
            cols, packed = _pack(out)
        except Exception as exc:  # the peers wait in the broadcast: tell them, then raise it
            failure = exc
    word = torch.full((1 + rows,), FAILED, dtype=torch.int64, device=device)
    if out is not None and failure is None:
        word[0] = cols
        word[1:] = out.token_ids.to(device=device, dtype=torch.int64)
    D.broadcast_from(word, head.process_group)
    if failure is not None:
        raise failure
    status = int(word[0])
    if status == FAILED:
        raise PeerRankError(f"{WHAT}: rank 0 of the head's group could not sample the gathered logits; see its error")
    if out is not None:  # rank 0: its own output, the logprobs sent as they are
        if packed is not None:
            D.broadcast_from(packed.to(device), head.process_group)
        return out
    logprobs = None
    if status > 0:
        packed = D.broadcast_from(torch.empty(rows, 3 * status, dtype=torch.int64, device=device), head.process_group)
        logprobs = _unpack(packed, status)
    return SamplerOutput(word[1:].clone(), logprobs)


__all__ = ["FAILED", "gathers_to_rank0", "rank0_output", "whole_vocab"]
