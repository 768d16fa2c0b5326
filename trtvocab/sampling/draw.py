"""Seeded sampling on the shards: the draw of the gathered, filtered softmax, without the gather.

For each row, in the order of docs/sampling.md (vLLM v1's, except that min-p follows top-p): the
column-local logits processors (bans, bias, penalties: :mod:`~trtvocab.sampling.filters`),
temperature (``x / T``; ``T < GREEDY_BELOW = 1e-5``, 0 included, is greedy:
:attr:`SamplingParams.greedy`), top-k (the exact global top-k, ties to the lower id), top-p (the
exact nucleus of what is left), min-p, typical-p, then the draw, then the returned logprobs.
The draw is a Gumbel-max race: token ``i`` scores ``x_i / T + g_i`` with
``g_i = -log(-log(u_i))`` and the highest score wins, which picks ``i`` with probability
``softmax(x / T)_i`` over the kept tokens exactly. Each rank scores its own columns; only
each rank's best ``(score, id)`` per row crosses (``[tp, B]`` pairs). The noise ``u_i`` is
keyed by ``(seed, step, global id)`` (:mod:`trtvocab.sampling.noise`), so a seeded row gets
the same token at every tp size and layout, and as at tp 1, whenever the logits are equal
(a deterministic head makes them bitwise equal).

See docs/architecture.md, "Seeded sampling without the gather".
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from trtvocab.errors import InputError
from trtvocab.parallel.sharding import Placement, VocabPlacement
from trtvocab.sampling.filters import Metadata, column_ids, min_p_keep, process, race_scores, scale
from trtvocab.sampling.params import LOGPROBS_MODES, SamplingParams
from trtvocab.sampling.reductions import (
    NO_ID,
    TOP_P_FIRST_K,
    argmax_over_vocab,
    check_logits,
    gather_stack,
    global_max,
    handshake,
    merged_topk,
    nucleus,
    own,
    pick_owned,
    sum_exp_and_picks,
)
from trtvocab.sampling.state import TokenState

ENTROPY_BITS = 40  # typical-p's entropy terms in int64 fixed point: |p log p| <= 1/e, V * 2**40 / e < 2**63


def rows_params(params: Any, rows: int, what: str = "sample") -> list[SamplingParams] | InputError:
    if isinstance(params, SamplingParams):
        return [params] * rows
    if isinstance(params, list | tuple) and all(isinstance(p, SamplingParams) for p in params):
        if len(params) != rows:
            return InputError(f"{what}: params has {len(params)} entries for {rows} rows (one SamplingParams, "
                              "or one per row)")
        return list(params)
    return InputError(f"{what}: params must be a SamplingParams or a list of them, got {type(params).__name__}")


def _float_bits(value: float) -> int:
    """The float64 bit pattern of ``value`` as a signed int64 (exact: distinct floats, distinct ints)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def params_tensor(rows: list[SamplingParams], step: int, vocab_limit: int | None) -> torch.Tensor:
    """Every argument the ranks must agree on, as one int64 tensor (for the handshake digest).

    Integers (step, vocab_limit, top_k, seed, ...) go as themselves and floats as their float64 bit
    patterns, so nothing is rounded: seeds ``2**60`` and ``2**60 + 1``, equal as float64, differ here.
    The id lists and dicts (logit bias, allowed ids, bad words, stops) go as a digest of their JSON.
    """
    table = [[_float_bits(p.temperature), p.top_k, _float_bits(p.top_p), _float_bits(p.min_p),
              -1 if p.seed is None else p.seed, _float_bits(p.repetition_penalty), _float_bits(p.presence_penalty),
              _float_bits(p.frequency_penalty), p.min_tokens, int(p.ignore_eos), _float_bits(p.typical_p),
              -1 if p.logprobs is None else p.logprobs, LOGPROBS_MODES.index(p.logprobs_mode), _lists_digest(p)]
             for p in rows]
    head = [step, -1 if vocab_limit is None else vocab_limit] + [0] * 12
    return torch.tensor([head, *table], dtype=torch.int64)


def _lists_digest(p: SamplingParams) -> int:
    """A signed 63-bit digest of a row's id lists and bias (0 when it has none)."""
    if not (p.logit_bias or p.allowed_token_ids is not None or p.bad_words or p.stop_token_ids):
        return 0
    text = json.dumps([sorted(p.logit_bias.items()), p.allowed_token_ids, p.bad_words, p.stop_token_ids])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def step_error(step: Any, what: str) -> InputError | None:
    """Why ``step`` is not a decode step (None: it is): an int in ``[0, 2**63)``."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        return InputError(f"{what}: step must be an int >= 0 (below 2**63), got {step!r}")
    return None


def draw_args_error(params: Any, rows: int, step: Any, vocab_limit: Any, vocab_size: int,
                    what: str) -> tuple[InputError | None, list[SamplingParams]]:
    """The checks every draw makes of its arguments, in this order: the per-row params, the step,
    ``vocab_limit``. Returns the first error (None: all hold) and the per-row params (empty on an error)."""
    per_row = rows_params(params, rows, what)
    if isinstance(per_row, InputError):
        return per_row, []
    error = step_error(step, what)
    if error is None and vocab_limit is not None and (
            isinstance(vocab_limit, bool) or not isinstance(vocab_limit, int) or not 1 <= vocab_limit <= vocab_size):
        error = InputError(f"{what}: vocab_limit must be an int in [1, vocab_size={vocab_size}], got {vocab_limit!r}")
    for r, p in enumerate(per_row):
        if error is None and p.max_token_id() >= vocab_size:
            error = InputError(f"{what}: row {r}: SamplingParams names token id {p.max_token_id()} (logit_bias / "
                               f"allowed_token_ids / bad_words / stop_token_ids), outside the vocab [0, {vocab_size})")
    return error, per_row if error is None else []


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


def state_error(state: Any, rows: int, head: VocabPlacement, what: str) -> InputError | None:
    """Why ``state`` is not this batch's state on ``head``'s columns (None: it is, or is None)."""
    if state is None:
        return None
    if not isinstance(state, TokenState):
        return InputError(f"{what}: state must be a TokenState or None, got {type(state).__name__}")
    if head.added is not None:  # two segments: a token-order state (trtvocab.sampling.added_vocab)
        if state.rows != rows or (state.start, state.size) != (0, head.vocab_size):
            return InputError(f"{what}: a head with added tokens samples with a token-order state (built with "
                              f"TokenState.for_head(token_order_view(head), ...)): ids [0, {head.vocab_size}) of "
                              f"{rows} rows; got {state.rows} rows of [{state.start}, {state.start + state.size})")
        return None
    if state.rows != rows or state.start != head.vocab_start or state.size != head.shard.size:
        return InputError(f"{what}: state holds {state.rows} rows of ids [{state.start}, {state.start + state.size}); "
                          f"this call has {rows} rows of [{head.vocab_start}, {head.vocab_start + head.shard.size})")
    return None


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
    fresh = handshake(head, local_logits, error, op, extra=plan, argument=digest_of, proposal=fresh)
    seeds = [fresh + r if p.seed is None else p.seed for r, p in enumerate(per_row)]
    x = own(local_logits, head)
    return pipeline(x, head, Metadata.build(per_row, seeds, step, vocab_limit, x.device, state))


def collective_plan(rows: list[SamplingParams], vocab_size: int) -> int:
    """Which collectives a call makes, as one integer (part of the handshake's signature: a
    change of it renegotiates): the merged top-k width, the logprobs width, whether top-p, min-p,
    typical-p and the logprobs run."""
    sampled = [p for p in rows if not p.greedy]
    k = min(max([p.top_k for p in sampled] or [0]), vocab_size)
    n = max([p.logprobs + 1 for p in rows if p.logprobs is not None] or [0])
    typical, top_p = any(p.typical_p < 1 for p in sampled), any(p.top_p < 1 for p in sampled)
    min_p = any(p.min_p > 0 for p in sampled)
    return (k * (vocab_size + 2) + min(n, vocab_size + 1)) * 8 + 4 * typical + 2 * top_p + min_p


@dataclass(frozen=True)
class Logprobs:
    """Returned logprobs (vLLM's ``LogprobsTensors``): column 0 the sampled token, then the top-N
    best first; ``ids``, ``values`` (float32) and 1-based ``ranks`` (ids whose value is ``>=``), all ``[B, 1 + N]``.
    Slots a row did not ask for (past its own N, or every slot when its ``logprobs`` is None) hold
    id -1, value ``-inf`` and rank 0."""

    ids: torch.Tensor
    values: torch.Tensor
    ranks: torch.Tensor

    def row(self, r: int, n: int) -> list[tuple[int, float, int]]:
        """Row ``r``'s ``(id, value, rank)``: its top-``n`` best first, then the sampled token if not among them."""
        ids, values, ranks = self.ids[r].tolist(), self.values[r].tolist(), self.ranks[r].tolist()
        top = list(zip(ids[1 : 1 + n], values[1 : 1 + n], ranks[1 : 1 + n], strict=True))
        if ids[0] not in [t[0] for t in top]:
            top.append((ids[0], values[0], ranks[0]))
        return top


@dataclass(frozen=True)
class SamplerOutput:
    """One step's result, the same on every rank: the token ids ``[B]`` and, when asked, the logprobs."""

    token_ids: torch.Tensor
    logprobs: Logprobs | None = None


def pipeline(x: torch.Tensor, head: VocabPlacement, meta: Metadata) -> SamplerOutput:
    """vLLM v1's ``Sampler.forward`` on one rank's owned columns ``x [B, V_local]`` (docs/sampling.md,
    "Order"): float32 → raw logprobs → logits processors (bans, bias, penalties) → greedy or
    temperature → top-k → top-p → min-p (vLLM: before top-k) → typical-p → the race → returned logprobs."""
    ids = column_ids(head.vocab_start, x.shape[1], x.device) if head.added is None else \
        head.column_ids(x.shape[1], x.device)  # two segments: base piece then added piece
    x = x.to(torch.float32)
    raw = x if meta.vocab_limit is None else x.masked_fill(ids[None, :] >= meta.vocab_limit, float("-inf"))
    x = process(x, ids, meta, 0)
    scaled = scale(x, ids, meta)
    scaled = apply_top_k(scaled, ids, head, meta)
    scaled = apply_top_p(scaled, head, meta)
    scaled = apply_min_p(scaled, head, meta)
    scaled = apply_typical_p(scaled, head, meta)
    chosen = race(scaled, ids, head, meta)
    return SamplerOutput(chosen, returned_logprobs(raw, scaled, chosen, head, meta))


def apply_top_k(scaled: torch.Tensor, ids: torch.Tensor, head: VocabPlacement, meta: Metadata) -> torch.Tensor:
    """Keep each row's k largest (exact global top-k, ties to the lower id): one all_gather."""
    top_k = meta.top_k
    if max(top_k) <= 0:
        return scaled
    device = scaled.device
    k = min(max(top_k), head.vocab_size)
    values, top_ids = merged_topk(scaled, head, k)  # one all_gather; exact, ties to the lower id
    cut = torch.tensor([min(kr, k) - 1 if kr else k - 1 for kr in top_k], device=device)[:, None]
    cut_v, cut_id = values.gather(1, cut), top_ids.gather(1, cut)
    keep = (scaled > cut_v) | ((scaled == cut_v) & (ids[None, :] <= cut_id))
    active = torch.tensor([kr > 0 for kr in top_k], device=device)[:, None]
    return scaled.masked_fill(active & ~keep, float("-inf"))


def apply_top_p(scaled: torch.Tensor, head: VocabPlacement, meta: Metadata) -> torch.Tensor:
    """Keep each sampled row's exact nucleus of what is left (k doubling, ``reductions.nucleus``)."""
    on = (meta.top_p < 1) & meta.sampled
    if not bool(on.any()):
        return scaled
    # Threshold 0 for the other rows: their nucleus is one token at once, so they never make
    # the candidate count double (their mask is not applied anyway).
    keep = nucleus(scaled, head, torch.where(on, meta.top_p, torch.zeros_like(meta.top_p)))
    return scaled.masked_fill(on[:, None] & ~keep, float("-inf"))


def apply_min_p(scaled: torch.Tensor, head: VocabPlacement, meta: Metadata) -> torch.Tensor:
    """Keep ``p >= min_p * p_max`` on sampled rows (the global max: one all_gather)."""
    on = (meta.min_p > 0) & meta.sampled
    if not bool(on.any()):
        return scaled
    keep = min_p_keep(scaled, global_max(scaled, head), meta.min_p)
    return scaled.masked_fill(on[:, None] & ~keep, float("-inf"))


def entropy(scaled: torch.Tensor, lse: torch.Tensor, head: VocabPlacement) -> torch.Tensor:
    """``[B]`` float32 ``H = -sum p log p`` over the whole vocab, bitwise the same at every tp size:
    each id's float32 term in int64 fixed point (``2**-40``), an exact integer sum across shards."""
    logp = scaled - lse[:, None]
    term = torch.where(torch.isneginf(scaled), torch.zeros_like(logp), torch.exp(logp) * logp)
    local = torch.round(term.to(torch.float64) * 2.0**ENTROPY_BITS).to(torch.int64).sum(dim=1)
    total = gather_stack(local, head).sum(dim=0) if head.is_split else local
    return (-(total.to(torch.float64) * 2.0**-ENTROPY_BITS)).to(torch.float32)


def apply_typical_p(scaled: torch.Tensor, head: VocabPlacement, meta: Metadata) -> torch.Tensor:
    """Locally typical sampling (transformers' ``TypicalLogitsWarper``) on sampled rows: the global
    entropy ``H``, then the shortest prefix of the ids ordered by ``|-log p - H|`` (ascending, ties
    to the lower id) whose mass reaches ``typical_p``; every id whose key equals the last kept key stays.
    The prefix is found as the nucleus is: merged candidates, k doubling."""
    on = (meta.typical_p < 1) & meta.sampled
    if not bool(on.any()):
        return scaled
    _, lse, _ = sum_exp_and_picks(scaled, head, None)
    h = entropy(scaled, lse, head)
    masked = torch.isneginf(scaled)
    key = torch.abs(-(scaled - lse[:, None]) - h[:, None]).masked_fill(masked, float("inf"))
    mass = torch.where(on, meta.typical_p, torch.zeros_like(meta.typical_p))[:, None]
    # The typical set holds about exp(H) ids (the perplexity): start there, not at 64, so that a flat
    # row needs one or two rounds. H is the same on every rank, so is k.
    perplexity = float(torch.exp(h[on].max().to(torch.float64)))
    k = min(head.vocab_size, max(TOP_P_FIRST_K, 1 << max(0, math.ceil(math.log2(max(1.0, 2 * perplexity))))))
    while True:
        neg, cand = merged_topk(-key, head, k)
        picked = pick_owned(scaled, cand, head, torch.zeros(cand.shape, device=scaled.device))
        if head.is_split:
            picked = gather_stack(picked, head).sum(dim=0)  # one owner per id: the others add an exact 0
        probs = torch.exp(picked - lse[:, None]).masked_fill(torch.isneginf(neg), 0.0)
        before = torch.cumsum(probs, dim=1) - probs
        kept = (before < mass).sum(dim=1).clamp(min=1)
        if k == head.vocab_size or bool((kept < k)[on].all()):
            break
        k = min(2 * k, head.vocab_size)
    cut_key = -neg.gather(1, (kept - 1)[:, None])
    return scaled.masked_fill(on[:, None] & (key > cut_key), float("-inf"))


def race(scaled: torch.Tensor, ids: torch.Tensor, head: VocabPlacement, meta: Metadata) -> torch.Tensor:
    """The Gumbel race over what is left (greedy rows: the argmax); each rank's best ``(score, id)``,
    one all_gather. A row with nothing left raises on every rank."""
    # An all-greedy batch races on the logits themselves (race_scores' float64 copy of them would hold the
    # same order: float32 widens exactly, and no noise is added).
    scores = race_scores(scaled, ids, meta) if bool(meta.sampled.any()) else scaled
    top, chosen = argmax_over_vocab(scores, head)
    empty = torch.isneginf(top) | (chosen == NO_ID)
    if bool(empty.any()):
        # Every rank sees the same gathered values, so every rank raises here.
        raise InputError(f"sample: row(s) {empty.nonzero()[:, 0].tolist()} allow no token (every logit is -inf "
                         "after the bitmask / vocab_limit / filters)")
    return chosen


def returned_logprobs(raw: torch.Tensor, processed: torch.Tensor, chosen: torch.Tensor, head: VocabPlacement,
                      meta: Metadata) -> Logprobs | None:
    """vLLM's step 8 for the rows with ``logprobs`` set (None when no row asks): the sampled token's
    value and rank, and the top-N, of the raw or processed logits or logprobs (each row's mode)."""
    asked = [p.logprobs for p in meta.per_row if p.logprobs is not None]
    if not asked:
        return None
    modes = [p.logprobs_mode for p in meta.per_row]
    is_raw = torch.tensor([m.startswith("raw") for m in modes], device=raw.device)[:, None]
    as_logits = torch.tensor([m.endswith("logits") for m in modes], device=raw.device)[:, None]
    want = [-1 if p.logprobs is None else p.logprobs for p in meta.per_row]
    return ranked_logprobs(torch.where(is_raw, raw, processed), chosen, head, want, as_logits)


def ranked_logprobs(src: torch.Tensor, chosen: torch.Tensor, head: VocabPlacement, want: list[int],
                    as_logits: torch.Tensor | None = None) -> Logprobs:
    """:class:`Logprobs` of this rank's float32 columns ``src [B, V_local]``: ``chosen [B]``'s value and
    rank, then each row's top-``want[r]`` (``-1``: the row asked for none). The global log-sum-exp (the
    vocab tree), the rank count and the merged top-N: three all_gathers (``as_logits [B, 1]``: rows that
    return logits, not logprobs)."""
    rows = src.shape[0]
    n = max(want)
    logits = torch.zeros(rows, 1, dtype=torch.bool, device=src.device) if as_logits is None else as_logits
    _, lse, picked = sum_exp_and_picks(src, head, chosen[:, None])
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
    bitwise the same without the ``[T, V_local]`` logits: ``sampling.chunked.prompt_logprobs``."""
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, "sampling.prompt_logprobs")
    if error is None:
        error = prompt_args_error(token_ids, n, local_logits.shape[0], head.vocab_size, "sampling.prompt_logprobs")
    handshake(head, local_logits, error, "logprobs", extra=-2 - n if error is None else 0,
              argument=token_ids.to(torch.int64) if error is None else None)
    x = own(local_logits, head).to(torch.float32)
    return ranked_logprobs(x, token_ids.to(torch.int64).to(x.device), head, [n] * x.shape[0])


def prompt_args_error(token_ids: Any, n: Any, rows: int, vocab_size: int, what: str) -> InputError | None:
    """Why ``(token_ids, n)`` are not prompt-logprobs arguments: an integer ``[T]`` tensor of ids in
    ``[0, vocab_size)`` with ``T = rows``, and an int ``n`` in ``[0, vocab_size]``."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= vocab_size:
        return InputError(f"{what}: n must be an int in [0, vocab_size={vocab_size}], got {n!r}")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool \
            or token_ids.dim() != 1 or token_ids.shape[0] != rows:
        got = f"{token_ids.dtype} {list(token_ids.shape)}" if isinstance(token_ids, torch.Tensor) else \
            type(token_ids).__name__
        return InputError(f"{what}: token_ids must be an integer [{rows}] tensor (one next token per row), got {got}")
    if rows and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        return InputError(f"{what}: token_ids must be in [0, {vocab_size}), got values in "
                          f"[{int(token_ids.min())}, {int(token_ids.max())}]")
    return None
