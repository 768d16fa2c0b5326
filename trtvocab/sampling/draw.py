"""Seeded sampling on the shards: the draw of the gathered, filtered softmax, without the gather.

For each row, in the order of docs/sampling.md (vLLM v1's, except that min-p follows top-p): the
column-local logits processors (bans, bias, penalties),
temperature (``x / T``; ``T < GREEDY_BELOW = 1e-5``, 0 included, is greedy:
:attr:`SamplingParams.greedy`), top-k (the exact global top-k, ties to the lower id), top-p (the
exact nucleus of what is left), min-p, typical-p, then the draw, then the returned logprobs.
The draw is a Gumbel-max race: token ``i`` scores ``x_i / T + g_i`` with
``g_i = -log(-log(u_i))`` and the highest score wins, which picks ``i`` with probability
``softmax(x / T)_i`` over the kept tokens exactly. Each rank scores its own columns; only
each rank's best ``(score, id)`` per row crosses (``[tp, B]`` pairs). The noise ``u_i`` is
keyed by ``(seed, step, global id)`` (:mod:`trtvocab.sampling.noise`), so a seeded row gets
the same token at every tp size and layout, and as at tp 1, whenever the logits are equal
(a deterministic head makes them bitwise equal). The steps themselves are the prepared step's
(:class:`~trtvocab.sampling.prepared.DecodeStep`): one implementation, run here for one call's rows.

See docs/architecture.md, "Seeded sampling without the gather".
"""

from __future__ import annotations

from typing import Any

import torch

from trtvocab.errors import InputError
from trtvocab.parallel import distributed as D
from trtvocab.parallel.sharding import Placement, VocabPlacement
from trtvocab.sampling.args import (
    Logprobs,
    SamplerOutput,
    collective_plan,
    draw_args_error,
    params_tensor,
    prompt_args_error,
    state_error,
)
from trtvocab.sampling.params import SamplingParams
from trtvocab.sampling.prepared import DecodeStep
from trtvocab.sampling.reductions import (
    check_logits,
    gather_stack,
    handshake,
    merged_topk,
    own,
    sum_exp_and_picks,
)
from trtvocab.sampling.state import TokenState


def sample(
    local_logits: torch.Tensor,
    head: Placement,
    params: SamplingParams | list[SamplingParams],
    *,
    step: int = 0,
    vocab_limit: int | None = None,
    state: TokenState | None = None,
) -> torch.Tensor:
    """Token ids ``[B]`` (int64), the same on every rank, drawn as the module docstring says.

    ``local_logits``: this rank's ``[B, V_local]`` (or ``[B, width]``, padding ``-inf``) logits;
    ``head``: the head or its :class:`~trtvocab.parallel.sharding.VocabPlacement` (where these
    columns are, the process group: all the draw reads);
    ``-inf`` columns (a bitmask, :func:`apply_token_bitmask`) are never drawn. ``step``: the
    decode step, part of the noise key. ``vocab_limit``: ids at or past it are never drawn
    (a model whose config vocab is larger than its tokenizer: pass ``len(tokenizer)``).
    ``state``: the batch's :class:`~trtvocab.sampling.state.TokenState` (penalties, bad words, min
    tokens read it; None: an empty prompt and output). A row with no allowed token raises
    :class:`InputError` on every rank.
    """
    return sample_output(local_logits, head, params, step=step, vocab_limit=vocab_limit, state=state).token_ids


def sample_output(local_logits: torch.Tensor, head: Placement, params: SamplingParams | list[SamplingParams], *,
                  step: int = 0, vocab_limit: int | None = None, state: TokenState | None = None) -> SamplerOutput:
    """:func:`sample` with the logprobs the rows ask for (:class:`SamplerOutput`)."""
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, "sampling.sample")
    if error is None:
        error = state_error(state, local_logits.shape[0], head, "sample")
    return checked_sample(local_logits, head, params, step, vocab_limit, error, "sample", None, state)


def checked_sample(local_logits: Any, head: VocabPlacement, params: Any, step: Any, vocab_limit: Any,
                   error: InputError | None, op: str, bitmask: torch.Tensor | None,
                   state: TokenState | None = None) -> SamplerOutput:
    """:func:`sample` and ``sampling.decode`` after their own validation (``error``: this rank's
    verdict so far): the params checks, the handshake (``op``; ``bitmask`` joins the argument
    digest), then :func:`pipeline`."""
    per_row: list[SamplingParams] = []
    if error is None:
        error, per_row = draw_args_error(params, local_logits.shape[0], step, vocab_limit, head.vocab_size, "sample")
    digest_of = params_tensor(per_row, step, vocab_limit) if error is None else None
    fresh = int(torch.randint(0, 2**62, (1,)).item())
    if digest_of is not None and bitmask is not None:
        digest_of = torch.cat([digest_of.reshape(-1), bitmask.reshape(-1).to(torch.int64)])
    plan = collective_plan(per_row, head.vocab_size) if digest_of is not None else 0
    fresh, pending = handshake(head, local_logits, error, op, extra=plan, argument=digest_of, proposal=fresh)
    seeds = [fresh + r if p.seed is None else p.seed for r, p in enumerate(per_row)]
    # The one step implementation (trtvocab.sampling.prepared), for this call's rows; the call's verdict rides
    # on its first gather.
    return DecodeStep.for_rows(head, per_row, seeds, step, vocab_limit, state).draw_once(own(local_logits, head),
                                                                                         "sample", pending)


def ranked_logprobs(src: torch.Tensor, chosen: torch.Tensor, head: VocabPlacement, want: list[int],
                    as_logits: torch.Tensor | None = None, pending: D.Pending | None = None) -> Logprobs:
    """:class:`Logprobs` of this rank's float32 columns ``src [B, V_local]``: ``chosen [B]``'s value and
    rank, then each row's top-``want[r]`` (``-1``: the row asked for none). The global log-sum-exp (the
    vocab tree), the rank count and the merged top-N: three all_gathers, the first carrying ``pending`` (the
    call's verdict, ``reductions.handshake``; ``as_logits [B, 1]``: rows that return logits, not logprobs)."""
    rows = src.shape[0]
    n = max(want)
    logits = torch.zeros(rows, 1, dtype=torch.bool, device=src.device) if as_logits is None else as_logits
    _, lse, picked = sum_exp_and_picks(src, head, chosen[:, None], pending)
    assert picked is not None
    values = torch.where(logits, src, src - lse[:, None])
    sampled = torch.where(logits, picked, picked - lse[:, None])
    count = (values >= sampled).sum(dim=1)
    rank = gather_stack(count, head).sum(dim=0) if head.is_split else count
    ids, out_v, out_r = chosen[:, None], sampled, rank[:, None]
    if n > 0:
        top_v, top_ids = merged_topk(values, head, min(n, head.vocab_size))
        width = top_ids.shape[1]
        slot = torch.arange(width, device=src.device)[None, :]
        inside = slot < torch.tensor(want, device=src.device)[:, None]
        ids = torch.cat([ids, torch.where(inside, top_ids, torch.full_like(top_ids, -1))], dim=1)
        out_v = torch.cat([out_v, top_v.to(torch.float32).masked_fill(~inside, float("-inf"))], dim=1)
        out_r = torch.cat([out_r, torch.where(inside, slot + 1, torch.zeros_like(slot))], dim=1)
    asking = torch.tensor([w >= 0 for w in want], device=src.device)[:, None]
    return Logprobs(torch.where(asking, ids, torch.full_like(ids, -1)),
                    out_v.to(torch.float32).masked_fill(~asking, float("-inf")),
                    torch.where(asking, out_r.to(torch.int64), torch.zeros_like(out_r, dtype=torch.int64)))


def prompt_logprobs(local_logits: torch.Tensor, head: Placement, token_ids: torch.Tensor, n: int) -> Logprobs:
    """vLLM's ``prompt_logprobs`` of materialized rows: ``token_ids [T]`` (row ``t``'s next prompt token)
    with its logprob and rank, then the top-``n`` (raw logprobs), ``[T, 1 + n]``. The streamed twin,
    bitwise the same without the ``[T, V_local]`` logits: ``sampling.chunked.stream_prompt_logprobs``."""
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, "sampling.prompt_logprobs")
    if error is None:
        error = prompt_args_error(token_ids, n, local_logits.shape[0], head.vocab_size, "sampling.prompt_logprobs")
    pending = handshake(head, local_logits, error, "logprobs", extra=-2 - n if error is None else 0,
                        argument=token_ids.to(torch.int64) if error is None else None).pending
    x = own(local_logits, head).to(torch.float32)
    return ranked_logprobs(x, token_ids.to(torch.int64).to(x.device), head, [n] * x.shape[0], pending=pending)
