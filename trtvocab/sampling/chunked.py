"""Greedy, top-k, logsumexp / logprobs, seeded sampling and the decode step straight from ``hidden``,
streaming the head's weight in vocab chunks: the ``[B, V_local]`` logits are never materialized.

Each function takes the rows to score, ``hidden [B, H]`` (in the head dtype), and the
:class:`~trtvocab.lm_head.LMHead`; it computes this rank's logits a chunk of columns at a time
(:meth:`LMHead.column_logits`) and merges as it goes (a running best ``(value, id)``, a running
top-k, the vocab tree's node sums); the cross-rank merges are those of
:mod:`trtvocab.sampling.reductions`. ``chunk`` (columns) is a memory granularity, rounded up to GEMM
tiles the weight format declares next to its GEMM (:func:`gemm_tiles`), so every result is
bitwise the materialized path's (``head.local_logits`` then ``trtvocab.sampling``). ``chunk=None``
uses the head's ``logits_budget_bytes``: one chunk when the float32 logits fit, else chunks whose
temporaries stay about one budget. Every public call starts with one handshake; NaN logits raise
:class:`InputError` on every rank; attention DP with LM-head TP is refused.

See docs/architecture.md, "The vocab-chunked head".
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trtvocab.base.dtypes import DTYPES
from trtvocab.base.formats import WeightFormat
from trtvocab.errors import ConfigError, InputError
from trtvocab.lm_head import LMHead
from trtvocab.parallel import distributed as D
from trtvocab.parallel.sharding import VocabPlacement
from trtvocab.sampling import treesum
from trtvocab.sampling.added_vocab import segmented_placement
from trtvocab.sampling.args import (
    Logprobs,
    SamplerOutput,
    collective_plan,
    draw_args_error,
    params_tensor,
    prompt_args_error,
    state_error,
)
from trtvocab.sampling.bitmask import allowed_columns
from trtvocab.sampling.params import SamplingParams
from trtvocab.sampling.prepared import DecodeStep
from trtvocab.sampling.reductions import (
    NO_ID,
    first_max,
    gather_candidates,
    gather_stack,
    handshake,
    kept_prefix,
    local_topk,
    nonfinite_rows,
    owned_ranges,
    pick_logits,
    token_ids_error,
)
from trtvocab.sampling.state import TokenState
from trtvocab.sampling.treesum import Node, aligned_nodes, merge_ranges, range_nodes
from trtvocab.weights.dense import DENSE_TILE

TOP_P_CANDIDATES = 1024  # candidates a top-p row without top-k tracks (at least; more when the budget allows)
SAMPLE_BYTES_PER_LOGIT = 32  # sample's temporaries per logit of a chunk (float64 scores, int64 noise keys)
# The other passes' temporaries per logit of a chunk: the logits themselves, a NaN mask, and the
# float32 accumulator a half-precision GEMM allocates on CPUs without native bf16 (measured: 8
# bytes keeps a bf16 greedy chunk's peak at about one budget; 4 let it reach 1.5 budgets).
STREAM_BYTES_PER_LOGIT = 8
# What the ranks must also agree on for a chunked call, read from the head's handshake_identity and folded into
# the handshake's argument digest: the budget sets chunk and candidate counts, hence collective sizes; each
# row's adapter (LMHead.use_adapters) changes the logits, so ranks must pick the same ones.
STREAM_IDENTITY = D.Handshake("sampling.chunked", (
    D.Field("hidden_size"), D.Field("dtype", DTYPES), D.Field("weight format", WeightFormat),
    D.Field("deterministic"), D.Field("output dtype", DTYPES), D.Field("logits budget"), D.Field("adapters (digest)"),
))


# ---- tiles, chunks and the stream ---------------------------------------------------------------
def gemm_tiles(head: LMHead) -> list[tuple[int, int]]:
    """``[(lo, hi)]``: the local owned rows of every GEMM tile, in order, as the head's weight format
    declares them (:meth:`LMHead.gemm_tiles`): chunks are runs of these, never cut inside one."""
    return head.gemm_tiles()


def chunk_columns(head: LMHead, rows: int, chunk: int | None, bytes_per_logit: int = STREAM_BYTES_PER_LOGIT) -> int:
    """Columns per chunk before rounding to tiles: ``chunk``, or what the head's budget allows: the
    whole shard when its float32 logits fit, else ``budget // (bytes_per_logit * rows)`` (``sample``
    counts :data:`SAMPLE_BYTES_PER_LOGIT` for its float64 scores and noise)."""
    if chunk is not None:
        return chunk
    budget = head.logits_budget_bytes
    if rows * head.shard.size * 4 <= budget:
        return max(1, head.shard.size)
    return max(1, budget // (bytes_per_logit * max(1, rows)))


def plan_chunks(head: LMHead, rows: int, chunk: int | None,
                bytes_per_logit: int = STREAM_BYTES_PER_LOGIT) -> list[list[tuple[int, int]]]:
    """The tiles grouped into chunks: consecutive tiles until a chunk holds ``chunk`` columns."""
    want = chunk_columns(head, rows, chunk, bytes_per_logit)
    chunks: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    for lo, hi in gemm_tiles(head):
        current.append((lo, hi))
        if hi - current[0][0] >= want:
            chunks.append(current)
            current = []
    if current:
        chunks.append(current)
    return chunks


class _Stream:
    """This rank's logits, chunk by chunk: iterating yields ``(lo, hi, logits [B, hi - lo])`` (local
    owned columns, :attr:`LMHead.output_dtype`, from :meth:`LMHead.column_logits`). Iterate again for
    a second pass (activations are prepared once). ``bitmask`` (xgrammar's ``int32 [B, W]``): the
    columns it does not allow are ``-inf`` in every chunk, as ``apply_token_bitmask`` leaves them."""

    def __init__(self, hidden: torch.Tensor, head: LMHead, chunk: int | None,
                 bytes_per_logit: int = STREAM_BYTES_PER_LOGIT, bitmask: torch.Tensor | None = None,
                 base_limit: int | None = None) -> None:
        self.hidden, self.head = hidden, head
        self.chunks = plan_chunks(head, hidden.shape[0], chunk, bytes_per_logit)
        self.prepared = head.weights.prepare(hidden)
        self.bitmask = None if bitmask is None else bitmask.to(hidden.device)
        self.base_limit = base_limit  # a head with an added segment: base ids at or past it are -inf
        self.passes = 0

    def __iter__(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        self.passes += 1
        head = self.head
        for tiles in self.chunks:
            lo, hi = tiles[0][0], tiles[-1][1]
            yield lo, hi, self._masked(head.column_logits(self.hidden, lo, hi, prepared=self.prepared), lo)
        added = _place(head).added
        if added is not None and added.size:  # the added piece (A / tp columns): one last chunk
            lo = head.shard.size
            yield lo, lo + added.size, self._masked(head.added_logits(self.hidden)[:, : added.size], lo)

    def _masked(self, out: torch.Tensor, lo: int) -> torch.Tensor:
        first, n = first_id(self.head, lo), out.shape[1]
        if self.bitmask is not None:
            keep = allowed_columns(self.bitmask, first, n, n)
            out = out.masked_fill(~keep, float("-inf"))
        if self.base_limit is not None and first < self.head.vocab_size:
            ids = torch.arange(first, first + n, device=out.device)
            out = out.masked_fill((ids >= self.base_limit)[None, :], float("-inf"))
        return out


def _place(head: LMHead) -> VocabPlacement:
    """What the streamed reductions read: the head's placement, with its added segment as the second
    one when it has one (:func:`trtvocab.sampling.added_vocab.segmented_placement`)."""
    return segmented_placement(head) if head.added_vocab else head.placement


def first_id(head: LMHead, lo: int) -> int:
    """The token id of owned column ``lo`` (a chunk's first: a chunk never spans the two segments)."""
    place = _place(head)
    if place.added is None or lo < head.shard.size:
        return head.vocab_start + lo
    return place.shard.vocab_size + place.added.start + lo - head.shard.size


# ---- validation and the handshake -----------------------------------------------------------------
def _stream_identity(head: LMHead) -> torch.Tensor:
    """int64 codes of :data:`STREAM_IDENTITY`'s fields of the head's :meth:`LMHead.handshake_identity`."""
    return torch.tensor(STREAM_IDENTITY.codes(head.handshake_identity()), dtype=torch.int64)


def _check(hidden: Any, head: LMHead, chunk: Any, what: str) -> InputError | None:
    if not isinstance(head, LMHead):
        raise ConfigError(f"{what}: head must be an LMHead, got {type(head).__name__}")
    if head.is_split and head.mapping.enable_attention_dp:
        raise ConfigError(f"{what}: attention DP with LM-head TP (ranks bring different rows) is not supported "
                          "by the chunked head; use head(hidden) with gather_output=False and trtvocab.sampling")
    error = head.check_input(hidden)
    if error is not None:
        return InputError(f"{what}: {error}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        return InputError(f"{what}: chunk must be None or an int >= 1 (columns per chunk), got {chunk!r}")
    return None


def _stream_handshake(head: LMHead, hidden: Any, error: InputError | None, op: str, extra: int = 0,
                      argument: torch.Tensor | None = None, proposal: int = 0) -> int:
    """The sampling handshake of a chunked call ``op``, the head's :data:`STREAM_IDENTITY` (then ``argument``)
    in its argument digest; returns rank 0's ``proposal``."""
    ident = _stream_identity(head)
    if argument is not None:
        ident = torch.cat([ident.to(argument.dtype), argument.reshape(-1).cpu()])
    # A full handshake on every call (cache=False): the streamed passes' first collectives (an
    # all_reduce, the tree's node sums) do not carry the verdict of a skipped handshake.
    return handshake(_place(head), hidden, error, op, extra=extra, argument=ident if error is None else None,
                     proposal=proposal, cache=False).proposal


def _raise_nan(bad: torch.Tensor, what: str) -> None:
    if bool(bad.any()):
        raise InputError(f"{what}: the logits of row(s) {bad.nonzero()[:, 0].tolist()} contain NaN or +inf "
                         "(an overflow: the head's GEMM, a scale or a filter)")


# ---- merges ------------------------------------------------------------------------------------------
def _update_best(best: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor, first_id: int) -> None:
    """Fold a chunk's ``scores [B, n]`` (columns ``first_id ..``) into the running best, in place: a
    later chunk wins only when strictly larger, so the lowest id wins among ties."""
    if scores.shape[1] == 0:
        return
    value, col = first_max(scores)  # the first maximum: the lowest column
    value = value.to(best.dtype)
    better = value > best
    best.copy_(torch.where(better, value, best))
    ids.copy_(torch.where(better, col + first_id, ids))


def _merge_best(best: torch.Tensor, ids: torch.Tensor, nan: torch.Tensor, head: LMHead,
                what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's running ``(best, id)`` -> the global ``(best, id)``, lowest id among ties (what
    ``reductions.argmax_over_vocab`` does with a rank's whole shard); one all_gather of ``[B, 3]``
    int64 (value as float64 bits, id, NaN flag), so a NaN on any rank raises on every rank."""
    ids = torch.where(torch.isneginf(best), torch.full_like(ids, NO_ID), ids)
    best = best.to(torch.float64)
    if head.is_split:
        packed = gather_stack(torch.stack([best.view(torch.int64), ids, nan.to(torch.int64)], dim=-1), _place(head))
        values, all_ids = packed[..., 0].view(torch.float64), packed[..., 1]  # [tp, B]
        nan = packed[..., 2].amax(dim=0) > 0
        best = values.max(dim=0).values
        ids = torch.where(values == best, all_ids, torch.full_like(all_ids, NO_ID)).min(dim=0).values
    _raise_nan(nan, what)
    return best, ids


class _TopK:
    """A running top-k of the streamed columns (float32 values, global ids), ties to the lower id."""

    def __init__(self, rows: int, k: int, head: LMHead, device: torch.device) -> None:
        self.k, self.head = k, head
        self.vals = torch.empty(rows, 0, dtype=torch.float32, device=device)
        self.ids = torch.empty(rows, 0, dtype=torch.int64, device=device)

    def add(self, x: torch.Tensor, lo: int, bad: torch.Tensor) -> None:
        """Fold in chunk ``x`` (local columns from ``lo``); ``bad [B]``: its rows holding NaN."""
        kc = min(self.k, x.shape[1])
        if kc and bool(bad.any()):
            # NaN rows are flagged by the caller and raise on every rank after the merge; here they
            # only must not break the selection (a NaN compares false).
            x = x.masked_fill(torch.isnan(x), float("-inf"))
        if kc and self.vals.shape[1] == self.k:
            # Full: only values above the k-th can enter (a tie loses to the lower id already here).
            kc = min(kc, int((x > self.vals[:, -1:]).sum(dim=1).max()))
        if kc == 0:
            return
        v, c = local_topk(x, kc)
        # Every streamed id is above every id held, so a stable sort by value alone keeps (value
        # descending, id ascending): held entries first among equal values, the chunk's in its order.
        vals = torch.cat([self.vals, v.to(torch.float32)], dim=1)
        ids = torch.cat([self.ids, c + first_id(self.head, lo)], dim=1)
        order = torch.argsort(vals, dim=1, descending=True, stable=True)[:, : self.k]
        self.vals, self.ids = vals.gather(1, order), ids.gather(1, order)

    def merged(self, nan: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The global top-k ``(float32 [B, k], int64 [B, k])``: one all_gather when split (what
        ``reductions.merged_topk`` does with the ranks' local top-k)."""
        if not self.head.is_split:
            _raise_nan(nan, what)
            return self.vals, self.ids
        vals = torch.where(nan[:, None], torch.full_like(self.vals, float("nan")), self.vals)  # travels along
        values, ids = gather_candidates(vals, self.ids, _place(self.head), self.k)
        _raise_nan(torch.isnan(values).any(dim=1), what)
        return values, ids


class _TreeSum:
    """The vocab tree's nodes (:mod:`~trtvocab.sampling.treesum`) over this rank's ids, built chunk by
    chunk: each chunk's maximal aligned nodes come from ``range_nodes`` and are pushed; a node whose
    left sibling is on top of the stack merges with it, so every merge is one of the tree's and the
    stack ends as the shard's ``aligned_nodes``, with the same bits."""

    def __init__(self, head: LMHead) -> None:
        self.ranges = _place(head).owned_ranges()[head.tp_rank]  # one range, or the base's and the added's
        self.stacks: list[list[Node]] = [[] for _ in self.ranges]  # one per range: nodes never merge across

    def add(self, x: torch.Tensor, first: int) -> None:
        stack = self.stacks[next(j for j, (a, b) in enumerate(self.ranges) if a <= first < b)]
        for node in range_nodes(x, first):
            treesum.push(stack, node)

    def total(self, head: LMHead, like: torch.Tensor,
              extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        place = _place(head)
        for stack, (start, end) in zip(self.stacks, self.ranges, strict=True):
            nodes = [(lv, i) for lv, i, _, _ in stack]
            if nodes != aligned_nodes(start, end):  # pragma: no cover - a bug, not an input
                raise AssertionError(f"chunked tree: nodes {nodes} != {aligned_nodes(start, end)}")
        ranges = owned_ranges(place) if place.added is None else place.owned_ranges()
        return merge_ranges([n for stack in self.stacks for n in stack], place.vocab_size, head.tp_size,
                            head.process_group, ranges, like=like, extra=extra)


# ---- public functions ----------------------------------------------------------------------------------
def stream_greedy(hidden: torch.Tensor, head: LMHead, *, chunk: int | None = None) -> torch.Tensor:
    """Token ids ``[B]`` (int64) of the largest logit, lowest id among ties: ``sampling.greedy`` of
    ``head.local_logits(hidden)``, one streaming pass."""
    what = "sampling.chunked.stream_greedy"
    error = _check(hidden, head, chunk, what)
    _stream_handshake(head, hidden, error, "greedy")
    stream = _Stream(hidden, head, chunk)
    rows = hidden.shape[0]
    best = torch.full((rows,), float("-inf"), dtype=torch.float32, device=hidden.device)
    ids = torch.full((rows,), NO_ID, dtype=torch.int64, device=hidden.device)
    nan = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
    for lo, _, x in stream:
        nan |= nonfinite_rows(x)
        _update_best(best, ids, x, first_id(head, lo))
    top, chosen = _merge_best(best, ids, nan, head, what)
    if bool(torch.isneginf(top).any()):
        raise InputError(f"{what}: row(s) {torch.isneginf(top).nonzero()[:, 0].tolist()} allow no token "
                         "(every logit is -inf)")
    return chosen


def stream_topk(hidden: torch.Tensor, head: LMHead, k: int, *,
                chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [B, k], ids [B, k] int64)`` by value descending then id ascending, values in
    ``head.output_dtype``: ``sampling.topk`` of ``head.local_logits(hidden)``, one streaming pass."""
    what = "sampling.chunked.stream_topk"
    error = _check(hidden, head, chunk, what)
    if error is None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= _place(head).vocab_size):
        error = InputError(f"{what}: k must be an int in [1, vocab_size={_place(head).vocab_size}], got {k!r}")
    _stream_handshake(head, hidden, error, "topk", extra=int(k) if error is None else 0)
    rows = hidden.shape[0]
    running = _TopK(rows, k, head, hidden.device)
    nan = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
    for lo, _, x in _Stream(hidden, head, chunk):
        bad = nonfinite_rows(x)
        nan |= bad
        running.add(x, lo, bad)
    vals, ids = running.merged(nan, what)
    return vals.to(head.output_dtype), ids


def _lse_and_picks(hidden: torch.Tensor, head: LMHead, token_ids: torch.Tensor | None, chunk: int | None,
                   what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One streaming pass: the vocab tree's nodes, the picked logits and a NaN flag per row, then
    one all_gather (the picks and the flag ride with the node pairs)."""
    rows = hidden.shape[0]
    n = 0 if token_ids is None else token_ids.shape[1]
    extra = torch.zeros(rows, n + 1, dtype=torch.float32, device=hidden.device)  # picks, then the NaN flag
    tree = _TreeSum(head)
    for lo, _, x in _Stream(hidden, head, chunk):
        x = x.to(torch.float32)
        tree.add(x, first_id(head, lo))
        extra[:, n] += nonfinite_rows(x).to(torch.float32)
        if token_ids is not None:
            extra[:, :n] = pick_logits(x, token_ids, first_id(head, lo), extra[:, :n])
    _, lse, summed = tree.total(head, hidden, extra)
    assert summed is not None
    _raise_nan(summed[:, n] > 0, what)
    return lse, (summed[:, :n] if token_ids is not None else None)


def stream_logsumexp(hidden: torch.Tensor, head: LMHead, *, chunk: int | None = None) -> torch.Tensor:
    """``[B]`` float32 ``log(sum(exp(logits)))`` over the whole vocab, one streaming pass: bitwise
    ``sampling.logsumexp`` of ``head.local_logits(hidden)`` (the same vocab tree)."""
    what = "sampling.chunked.stream_logsumexp"
    error = _check(hidden, head, chunk, what)
    _stream_handshake(head, hidden, error, "logsumexp")
    return _lse_and_picks(hidden, head, None, chunk, what)[0]


def stream_logprobs(hidden: torch.Tensor, head: LMHead, token_ids: torch.Tensor, *,
                    chunk: int | None = None) -> torch.Tensor:
    """Log-probabilities (float32, global softmax) of ``token_ids`` (``[B]`` or ``[B, n]``, global
    ids): bitwise ``sampling.logprobs`` of ``head.local_logits(hidden)``, one streaming pass."""
    what = "sampling.chunked.stream_logprobs"
    error = _check(hidden, head, chunk, what)
    n = 0
    if error is None:
        error, n = token_ids_error(token_ids, hidden.shape[0], _place(head).vocab_size, what)
    argument = token_ids.to(torch.int64).reshape(-1).cpu() if error is None else None
    _stream_handshake(head, hidden, error, "logprobs", extra=n, argument=argument)
    ids = token_ids.to(torch.int64).reshape(token_ids.shape[0], -1).to(hidden.device)
    lse, picked = _lse_and_picks(hidden, head, ids, chunk, what)
    assert picked is not None
    return (picked - lse[:, None]).reshape(token_ids.shape)


def stream_prompt_logprobs(hidden: torch.Tensor, head: LMHead, token_ids: torch.Tensor, n: int, *,
                    chunk: int | None = None) -> Logprobs:
    """vLLM's ``prompt_logprobs`` streamed: bitwise ``sampling.prompt_logprobs`` of
    ``head.local_logits(hidden)`` (``hidden [T, H]``: every prompt position; ``token_ids [T]``: each
    position's next prompt token), ``[T, 1 + n]``, without the ``[T, V_local]`` logits (bounded by the
    head's ``logits_budget_bytes``). Two passes: the vocab tree and the picked logits, then the values
    ``x - lse``, their running top-``n`` and the rank count."""
    what = "sampling.chunked.stream_prompt_logprobs"
    error = _check(hidden, head, chunk, what)
    if error is None:
        error = prompt_args_error(token_ids, n, hidden.shape[0], _place(head).vocab_size, what)
    argument = token_ids.to(torch.int64).reshape(-1).cpu() if error is None else None
    _stream_handshake(head, hidden, error, "logprobs", extra=-2 - n if error is None else 0, argument=argument)
    rows = hidden.shape[0]
    ids = token_ids.to(torch.int64).to(hidden.device)
    lse, picked = _lse_and_picks(hidden, head, ids[:, None], chunk, what)
    assert picked is not None
    sampled = picked[:, 0] - lse
    count = torch.zeros(rows, dtype=torch.int64, device=hidden.device)
    running = _TopK(rows, min(n, _place(head).vocab_size), head, hidden.device) if n else None
    no_nan = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
    for lo, _, x in _Stream(hidden, head, chunk):
        values = x.to(torch.float32) - lse[:, None]
        count += (values >= sampled[:, None]).sum(dim=1)
        if running is not None:
            running.add(values, lo, no_nan)
    rank = gather_stack(count, _place(head)).sum(dim=0) if head.is_split else count
    out_ids, out_v, out_r = ids[:, None], sampled[:, None], rank[:, None]
    if running is not None:
        top_v, top_ids = running.merged(no_nan, what)
        slot = torch.arange(top_ids.shape[1], device=hidden.device)[None, :].expand(rows, -1)
        out_ids = torch.cat([out_ids, top_ids], dim=1)
        out_v = torch.cat([out_v, top_v], dim=1)
        out_r = torch.cat([out_r, slot + 1], dim=1)
    return Logprobs(out_ids, out_v.to(torch.float32), out_r.to(torch.int64))


def _draw_args(hidden: torch.Tensor, head: LMHead, params: SamplingParams | list[SamplingParams], step: int,
               vocab_limit: int | None, chunk: int | None, what: str,
               error: InputError | None) -> tuple[InputError | None, list[SamplingParams]]:
    """The first error among a draw's arguments (``error``: the caller's own, kept first), and the
    per-row params (empty on an error): the checks ``sample`` and ``decode`` share."""
    if error is None:
        error = _check(hidden, head, chunk, what)
    if error is not None:
        return error, []
    if head.added_vocab and vocab_limit is not None and (isinstance(vocab_limit, bool) or not isinstance(
            vocab_limit, int) or not 1 <= vocab_limit <= head.vocab_size):
        return InputError(f"{what}: vocab_limit must be an int in [1, base vocab_size={head.vocab_size}] (it bounds "
                          f"the base ids of a head with added tokens), got {vocab_limit!r}"), []
    return draw_args_error(params, hidden.shape[0], step, vocab_limit, _place(head).vocab_size, what)


def stream_sample(hidden: torch.Tensor, head: LMHead, params: SamplingParams | list[SamplingParams], *, step: int = 0,
           vocab_limit: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """Token ids ``[B]`` (int64), the same on every rank: ``sampling.sample`` of
    ``head.local_logits(hidden)`` with the same params, step and vocab_limit, streamed.

    One pass, or two when a sampled row without top-k / top-p has min-p (its threshold needs the
    global max first) or a nucleus is longer than the first candidates (module docstring)."""
    what = "sampling.chunked.stream_sample"
    error, per_row = _draw_args(hidden, head, params, step, vocab_limit, chunk, what, None)
    rows = len(per_row)
    digest_of = params_tensor(per_row, step, vocab_limit) if error is None else None
    fresh = int(torch.randint(0, 2**62, (1,)).item())
    fresh = _stream_handshake(head, hidden, error, "sample", extra=rows, argument=digest_of, proposal=fresh)
    seeds = [fresh + r if p.seed is None else p.seed for r, p in enumerate(per_row)]
    return _draw(hidden, head, per_row, seeds, step, vocab_limit, chunk, what).token_ids


def stream_decode(hidden: torch.Tensor, head: LMHead, params: SamplingParams | list[SamplingParams], *, step: int = 0,
           vocab_limit: int | None = None, bitmask: torch.Tensor | None = None, chunk: int | None = None,
           error: InputError | None = None, state: TokenState | None = None) -> torch.Tensor:
    """:func:`decode_output`'s token ids ``[B]``."""
    return stream_output(hidden, head, params, step=step, vocab_limit=vocab_limit, bitmask=bitmask, chunk=chunk,
                         error=error, state=state).token_ids


def stream_output(hidden: torch.Tensor, head: LMHead, params: SamplingParams | list[SamplingParams], *,
                  step: int = 0, vocab_limit: int | None = None, bitmask: torch.Tensor | None = None,
                  chunk: int | None = None, error: InputError | None = None,
                  state: TokenState | None = None) -> SamplerOutput:
    """``sampling.decode`` streamed: token ids ``[B]``, bitwise those of the materialized decode step
    (``head.local_logits(hidden)``, xgrammar's ``bitmask``, the draw) with the same params, step,
    vocab_limit and seeds, without the ``[B, V_local]`` logits (``sampling.decode`` calls this
    when they would exceed ``head.logits_budget_bytes``).

    Its handshake is the decode step's (the operation ``decode``, cached while the step's
    signature stays the same); its first data collective carries the verdict, so ranks that
    disagree on the path, the batch or the arguments raise together. ``error``: a verdict of
    the caller's own checks (such as its row selection), raised after the handshake. ``state``:
    the batch's :class:`~trtvocab.sampling.state.TokenState` (penalties, bad words, min tokens).
    """
    what = "sampling.decode"
    error, per_row = _draw_args(hidden, head, params, step, vocab_limit, chunk, what, error)
    rows = len(per_row)
    if error is None:
        error = state_error(state, rows, _place(head), what)
    if error is None and bitmask is not None and (
            not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32 or bitmask.dim() != 2
            or bitmask.shape[0] != rows):
        got = f"{bitmask.dtype} {list(bitmask.shape)}" if isinstance(bitmask, torch.Tensor) else type(bitmask).__name__
        error = InputError(f"apply_token_bitmask: bitmask must be an int32 [{rows}, W] tensor (xgrammar's layout, "
                           f"one row per hidden row), got {got}")
    argument = None
    if error is None:
        parts = [_stream_identity(head),
                 params_tensor(per_row, step, vocab_limit).reshape(-1)]
        if bitmask is not None:
            parts.append(bitmask.reshape(-1).to(torch.int64).cpu())
        argument = torch.cat(parts)
    plan = -1 - collective_plan(per_row, _place(head).vocab_size) if error is None else 0  # < 0: the streamed path
    fresh = int(torch.randint(0, 2**62, (1,)).item())
    fresh, pending = handshake(_place(head), hidden, error, "decode", extra=plan, argument=argument, proposal=fresh)
    if head.is_split:
        # The verdict of a steady step rides here (the streamed passes' own first collectives vary).
        gather_stack(torch.zeros(1, dtype=torch.int64, device=hidden.device), _place(head), pending)
    seeds = [fresh + r if p.seed is None else p.seed for r, p in enumerate(per_row)]
    return _draw(hidden, head, per_row, seeds, step, vocab_limit, chunk, what, bitmask, state)


def _draw(hidden: torch.Tensor, head: LMHead, per_row: list[SamplingParams], seeds: list[int], step: int,
          vocab_limit: int | None, chunk: int | None, what: str, bitmask: torch.Tensor | None = None,
          state: TokenState | None = None) -> SamplerOutput:
    """The prepared step's pipeline (``prepared.DecodeStep``) over the streamed chunks: its column-local steps
    on each chunk, the race as it goes, top-k / top-p among
    merged candidates. Rows with typical-p or returned logprobs are drawn by the materialized
    pipeline on row groups the budget holds (:func:`_long_nuclei`): the same tokens."""
    device, rows = hidden.device, hidden.shape[0]
    # A head with an added segment: vocab_limit bounds the base ids only, masked in the stream (as the
    # materialized step masks its logits) rather than by the draw's id test.
    base_limit = vocab_limit if head.added_vocab else None
    call = _Call(per_row, seeds, step, None if head.added_vocab else vocab_limit, state)
    stream = _Stream(hidden, head, chunk, SAMPLE_BYTES_PER_LOGIT, bitmask, base_limit)
    if any(p.logprobs is not None or (p.typical_p < 1 and not p.greedy) for p in per_row):
        outs = _long_nuclei(stream, head, list(range(rows)), call)
        return _concat(outs)
    vocab = _place(head).vocab_size
    pipe = call.step_of(_place(head))  # the prepared step's column-local steps and race scores, chunk by chunk
    sampled = ~pipe.greedy[:, 0]
    top_k = [0 if p.greedy else p.top_k for p in per_row]
    by_topk = torch.tensor([kr > 0 for kr in top_k], device=device)
    top_p = pipe.top_p
    p_on = (top_p < 1) & sampled
    by_cand = by_topk | p_on  # rows whose kept tokens are a prefix of the merged candidates
    nucleus_rows = p_on & ~by_topk  # top-p over the whole vocab: its nucleus may outgrow the candidates
    k = min(max(top_k), vocab) if max(top_k) > 0 else 0
    if bool(nucleus_rows.any()):  # as many candidates as the budget holds (~64 bytes each), at least 1024
        k = max(k, min(vocab, max(TOP_P_CANDIDATES, min(4 * TOP_P_CANDIDATES,
                                                         head.logits_budget_bytes // (64 * rows)))))
    min_p = pipe.min_p
    min_p_on = (min_p > 0) & sampled
    two_pass = bool((min_p_on & ~by_cand).any())  # streamed rows whose min-p needs the global max first
    nan = torch.zeros(rows, dtype=torch.bool, device=device)
    running = _TopK(rows, k, head, device) if k else None
    tree = _TreeSum(head) if bool(nucleus_rows.any()) else None
    best = torch.full((rows,), float("-inf"), dtype=torch.float64, device=device)
    ids = torch.full((rows,), NO_ID, dtype=torch.int64, device=device)
    local_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)

    def scaled_of(x: torch.Tensor, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        return pipe._scale(pipe._process(x.to(torch.float32), lo), lo), pipe.col_ids[lo : lo + x.shape[1]]

    def race(scaled: torch.Tensor, col_ids: torch.Tensor, lo: int, m: torch.Tensor | None) -> None:
        if m is not None:  # min-p of the streamed rows, against the global max of pass 1
            scaled = scaled.masked_fill((min_p_on & ~by_cand)[:, None] & ~_min_p_keep(scaled, m, min_p),
                                        float("-inf"))
        _update_best(best, ids, pipe._race_scores(scaled, col_ids), first_id(head, lo))

    for lo, _, x in stream:
        scaled, col_ids = scaled_of(x, lo)
        bad = nonfinite_rows(scaled)
        nan |= bad
        if running is not None:
            running.add(scaled, lo, bad)
        if tree is not None:
            tree.add(scaled, first_id(head, lo))
        if two_pass:
            local_max = torch.maximum(local_max, scaled.amax(dim=1) if scaled.shape[1] else local_max)
        else:
            race(scaled, col_ids, lo, None)
    cand_vals = cand_ids = None
    if running is not None:
        cand_vals, cand_ids = running.merged(nan, what)  # every rank: the same merged candidates
    if two_pass:
        acc = torch.cat([local_max, nan.to(torch.float32)])
        if head.is_split:
            D.all_reduce(acc, dist.ReduceOp.MAX, head.process_group)
        _raise_nan(torch.isnan(acc[:rows]) | (acc[rows:] > 0), what)
        m = acc[:rows]
        for lo, _, x in stream:
            scaled, col_ids = scaled_of(x, lo)
            race(scaled, col_ids, lo, m)
    top, chosen = _merge_best(best, ids, nan, head, what)
    if cand_vals is not None and cand_ids is not None:
        cut, long = _candidate_cut(hidden, head, tree, top_k, top_p, p_on, by_topk, nucleus_rows, cand_vals,
                                   cand_ids)
        # Rows with top-k / top-p: the kept tokens are exactly their first `cut` candidates; min-p
        # against the global max of what is kept (the first candidate); the race among them.
        width = cand_vals.shape[1]
        valid = torch.arange(width, device=device)[None, :] < cut[:, None]
        valid &= ~min_p_on[:, None] | _min_p_keep(cand_vals, cand_vals[:, 0], min_p)
        score = pipe._race_scores(cand_vals, cand_ids).masked_fill(~valid, float("-inf"))
        c_top = score.max(dim=1).values
        c_chosen = torch.where(score == c_top[:, None], cand_ids, torch.full_like(cand_ids, NO_ID)).min(dim=1).values
        top = torch.where(by_cand, c_top, top)
        chosen = torch.where(by_cand, c_chosen, chosen)
        if bool(long.any()):  # the same decision on every rank: candidates and denominator are global
            rows_long = long.nonzero()[:, 0].tolist()
            chosen[long] = _concat(_long_nuclei(stream, head, rows_long, call)).token_ids
            top = top.masked_fill(long, 0.0)  # drawn (or refused) by the materialized sampler
    empty = torch.isneginf(top) | (chosen == NO_ID)
    if bool(empty.any()):
        # Every rank sees the same merged values, so every rank raises here.
        by = "the bitmask / vocab_limit / filters" if bitmask is not None else "the vocab_limit / filters"
        raise InputError(f"{what}: row(s) {empty.nonzero()[:, 0].tolist()} allow no token (every logit is -inf "
                         f"after {by})")
    return SamplerOutput(chosen)


def _concat(outs: list[SamplerOutput]) -> SamplerOutput:
    """One output of the row groups' outputs, in order (logprobs padded to the widest: id -1,
    value ``-inf``, rank 0, as ``DecodeStep._logprobs`` fills the slots a row did not ask for)."""
    ids = torch.cat([o.token_ids for o in outs])
    parts = [o.logprobs for o in outs]
    if all(p is None for p in parts):
        return SamplerOutput(ids)
    width = max(p.ids.shape[1] for p in parts if p is not None)

    def pad(t: torch.Tensor | None, rows: int, fill: float, dtype: torch.dtype) -> torch.Tensor:
        if t is None:
            return torch.full((rows, width), fill, dtype=dtype, device=ids.device)
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)
    sizes = [o.token_ids.shape[0] for o in outs]
    return SamplerOutput(ids, Logprobs(
        torch.cat([pad(None if p is None else p.ids, n, -1, torch.int64) for p, n in zip(parts, sizes, strict=True)]),
        torch.cat([pad(None if p is None else p.values, n, float("-inf"), torch.float32)
                   for p, n in zip(parts, sizes, strict=True)]),
        torch.cat([pad(None if p is None else p.ranks, n, 0, torch.int64) for p, n in zip(parts, sizes, strict=True)])))


def _candidate_cut(hidden: torch.Tensor, head: LMHead, tree: _TreeSum | None, top_k: list[int],
                   top_p: torch.Tensor, p_on: torch.Tensor, by_topk: torch.Tensor, nucleus_rows: torch.Tensor,
                   cand_vals: torch.Tensor, cand_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cut [B], long [B])``: how many merged candidates each row keeps (top-k, then top-p as
    ``reductions.nucleus`` decides it; rows without either get the width), and the top-p rows
    whose nucleus may run past the candidates (:func:`_long_nuclei` draws those)."""
    device, rows = hidden.device, hidden.shape[0]
    width = cand_vals.shape[1]
    cut_k = torch.tensor([min(kr, width) if kr else width for kr in top_k], device=device)
    if not bool(p_on.any()):
        return cut_k, torch.zeros(rows, dtype=torch.bool, device=device)
    lse = torch.zeros(rows, dtype=torch.float32, device=device)
    if tree is not None:  # top-p over the whole vocab: the tree of every (scaled) logit
        _, lse, _ = tree.total(head, hidden, torch.zeros(rows, 1, device=device))
    beyond = torch.arange(width, device=device)[None, :] >= cut_k[:, None]
    vals = cand_vals.masked_fill(beyond, float("-inf"))  # what top-k left: the rest is -inf
    if bool((p_on & by_topk).any()):  # top-p after top-k: the tree of the kept candidates only
        sparse = treesum.sparse_logsumexp(cand_ids.masked_fill(beyond, NO_ID), vals, _place(head).vocab_size)
        lse = torch.where(by_topk, sparse, lse)
    kept = kept_prefix(torch.exp(vals - lse[:, None]), top_p)  # the exact mass before each candidate
    long = nucleus_rows & (kept >= width) & (width < _place(head).vocab_size)
    return torch.where(p_on, torch.minimum(cut_k, kept), cut_k), long


def _min_p_keep(scaled: torch.Tensor, m: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Bool: the columns min-p keeps, ``exp(x - max) >= min_p`` (``m [B]`` the global max), as
    ``DecodeStep._min_p`` decides them."""
    return torch.exp(scaled - m[:, None]) >= min_p[:, None]


@dataclass(frozen=True)
class _Call:
    """One streamed draw's validated per-row arguments: the prepared step of any subset of its rows."""

    per_row: list[SamplingParams]
    seeds: list[int]
    step: int
    vocab_limit: int | None
    state: TokenState | None

    def step_of(self, place: VocabPlacement, rows: list[int] | None = None) -> DecodeStep:
        """``DecodeStep.for_rows`` of ``rows`` (None: all of them)."""
        if rows is None:
            return DecodeStep.for_rows(place, self.per_row, self.seeds, self.step, self.vocab_limit, self.state)
        state = None if self.state is None else self.state.select(rows)
        return DecodeStep.for_rows(place, [self.per_row[r] for r in rows], [self.seeds[r] for r in rows], self.step,
                                   self.vocab_limit, state)


def _long_nuclei(stream: _Stream, head: LMHead, rows: list[int], call: _Call) -> list[SamplerOutput]:
    """The outputs of ``rows`` (top-p rows whose nucleus is longer than the candidates, or every row
    when one has typical-p or logprobs): their logits are streamed again, bitwise the same (the same
    GEMM calls over the whole batch), as many rows at a time as the head's budget holds, and drawn by
    the materialized pipeline (``DecodeStep.for_rows``, on sub-groups its temporaries fit in): the same
    tokens. Each group costs one more pass over the weight."""
    # The same on every rank: the same groups, the same collectives.
    width = max(1, max(sum(b - a for a, b in rank) for rank in _place(head).owned_ranges()))
    budget = head.logits_budget_bytes
    group = max(1, budget // (torch.finfo(head.output_dtype).bits // 8 * width))
    sub = max(1, budget // (SAMPLE_BYTES_PER_LOGIT * width))
    out = []
    for g0 in range(0, len(rows), group):
        sel = rows[g0 : g0 + group]
        index = torch.tensor(sel, device=stream.hidden.device)
        logits = torch.empty(len(sel), _place(head).owned, dtype=head.output_dtype, device=stream.hidden.device)
        for lo, hi, x in stream:
            logits[:, lo:hi] = x.index_select(0, index)
        for s0 in range(0, len(sel), sub):
            part = sel[s0 : s0 + sub]
            out.append(call.step_of(_place(head), part).draw_once(logits[s0 : s0 + sub], "sample"))
    return out


__all__ = ["DENSE_TILE", "chunk_columns", "gemm_tiles", "plan_chunks", "stream_decode", "stream_greedy",
           "stream_logprobs", "stream_logsumexp", "stream_output", "stream_prompt_logprobs", "stream_sample",
           "stream_topk"]
