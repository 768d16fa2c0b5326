"""Reductions over a vocab-split head's logits without gathering ``[B, V]``.

Each function takes one rank's logits (``head.local_logits(hidden)``, padding ``-inf``, or
``head(hidden)`` with ``gather_output=False``) and the head or its ``VocabPlacement``, and returns
exactly what the same operation gives on the gathered logits; only ``O(B * k)`` numbers cross ranks::

    greedy      local (max, global id)   -> all_gather [tp, B] pairs  -> pick
    topk        local top-k (vals, ids)  -> all_gather [tp, B, k]     -> merge
    logsumexp   the vocab tree's (max, sum exp) node pairs -> all_gather -> merge (logprobs: + picks)
    min_p       a threshold against the global max
    top_p       the exact nucleus: 4 radix rounds of [B, 256] int64 mass histograms (prefix_keep)

Ids travel as int64, values as their float32 bits in the same tensor (one collective). Ties go
to the lower token id (``topk``: value descending, id ascending). NaN and ``+inf`` logits raise
:class:`InputError`; inputs are validated on every rank before one fixed-shape handshake, so one
rank's bad input makes every rank raise. A replicated head runs plain torch.

See docs/architecture.md, "Seeded sampling without the gather".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from trtvocab.errors import InputError
from trtvocab.parallel import distributed as D
from trtvocab.parallel.sharding import LAYOUT_FIELD, Placement, VocabPlacement
from trtvocab.sampling.treesum import merge_ranges, range_nodes, tree_logsumexp

NO_ID = torch.iinfo(torch.int64).max  # id of an empty candidate slot: sorts after every real id
_PLAN = "k / ids per row / sampling plan (top-k width, filters)"
_DIGEST = "argument digest (top_p / min_p values, logprobs token ids)"
_OPS = ("greedy", "topk", "logsumexp", "log_softmax", "logprobs", "min_p", "top_p", "sample", "bitmask", "decode")
# What the ranks agree on before every public call (protocol: trtvocab.parallel.distributed.Handshake).
# A decode loop makes the same calls step after step: the handshake runs on an operation's
# first call and whenever its signature (every field but the per-call argument digest) changes;
# otherwise its verdict rides on the call's first data collective (trtvocab.parallel.distributed.Agreement).
HANDSHAKE = D.Handshake("sampling", (
    D.Field("vocab_size"), D.Field("tp_size"), D.Field(LAYOUT_FIELD),
    D.Field("operation", _OPS), D.Field(_PLAN), D.Field("batch rows"),
    D.Field(_DIGEST, per_call=True),
    D.Field("proposal", per_rank=True),  # sample: each rank's fresh seed; rank 0's is used
))


def argument_digest(value: torch.Tensor | None) -> int:
    """A signed 63-bit digest of a tensor's dtype, shape and bytes (0 for None): what the ranks
    compare for arguments that must be equal everywhere but are too long for the handshake row
    (a ``[B]`` top_p, ``[B, n]`` token ids). Equal tensors give equal digests on every rank."""
    return D.tensor_digest(value)


# ---- validation and plumbing ---------------------------------------------------------------
def check_logits(local_logits: Any, head: VocabPlacement, what: str) -> InputError | None:
    if not isinstance(local_logits, torch.Tensor):
        return InputError(f"{what}: local_logits must be a torch.Tensor, got {type(local_logits).__name__}")
    if local_logits.dim() != 2 or local_logits.shape[1] not in (head.owned, head.local_width):
        widths = sorted({head.owned, head.local_width})
        ranges = " and ".join(f"[{a}, {b})" for a, b in head.owned_ranges()[head.tp_rank])
        return InputError(f"{what}: local_logits must have shape [B, {' or '.join(map(str, widths))}] "
                          f"(this rank's columns {ranges}), got {list(local_logits.shape)}")
    if local_logits.shape[0] == 0:
        return InputError(f"{what}: local_logits is an empty batch (B = 0)")
    if not local_logits.dtype.is_floating_point:
        return InputError(f"{what}: local_logits must be floating point, got {local_logits.dtype}")
    bad = nonfinite_rows(own(local_logits, head))
    if bool(bad.any()):
        return InputError(f"{what}: local_logits contain NaN or +inf (row(s) {bad.nonzero()[:, 0].tolist()}: an "
                          "overflow upstream; -inf is a ban, +inf would win every draw)")
    return None


def nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """Bool ``[B]``: which rows of ``x [B, n]`` hold a NaN or a ``+inf``, by each row's max (a max propagates
    NaN, and is ``+inf`` iff the row holds one): one read, no ``[B, n]`` mask (8 x 262144 float32: 0.1 ms
    against ``isnan().any()``'s 2.3). ``-inf`` is a ban and stays allowed."""
    if x.shape[1] == 0:
        return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    top = x.amax(dim=1)
    return torch.isnan(top) | (top == float("inf"))


class Agreed(NamedTuple):
    """What :func:`handshake` returns: rank 0's ``proposal``, and the call's ``pending`` verdict, which the
    caller hands to the call's first data collective (None: nothing rides, the handshake ran or the head is
    replicated)."""

    proposal: int
    pending: D.Pending | None


def handshake(head: VocabPlacement, local_logits: Any, error: InputError | None, op: str, extra: int = 0,
              argument: torch.Tensor | None = None, proposal: int = 0, cache: bool = True) -> Agreed:
    """Raise everywhere if any rank failed validation or the ranks disagree on the call.

    Returns rank 0's ``proposal`` (a value one rank picks for all, such as a fresh seed) and the pending
    verdict (:class:`Agreed`). After an operation's first call the handshake is skipped while its signature
    stays the same (see :class:`~trtvocab.parallel.distributed.Agreement`): its verdict rides on the call's
    first data collective, to which the caller passes ``pending`` (``pending=`` of :func:`gather_stack`,
    :func:`global_max`, :func:`sum_exp_and_picks`, ...), and the proposal is derived from the one agreed first
    and a call counter (the same on every rank). ``head.handshake_every_call = True`` (or ``cache=False``, for
    a caller whose first data collective does not carry the verdict, such as :mod:`trtvocab.sampling.chunked`)
    turns that off: a full handshake on every call.
    """
    if not head.is_split:
        if error is not None:
            raise error
        return Agreed(proposal, None)
    D.require_initialized(head.tp_size)
    rows = local_logits.shape[0] if isinstance(local_logits, torch.Tensor) and local_logits.dim() else 0
    values = {"vocab_size": head.vocab_size, "tp_size": head.tp_size, LAYOUT_FIELD: head.layout_code,
              "operation": op, _PLAN: extra, "batch rows": rows,
              _DIGEST: argument_digest(argument) if error is None else 0, "proposal": proposal}
    device = local_logits.device if isinstance(local_logits, torch.Tensor) else head.device
    # bitmask moves no data that could carry a verdict
    agreement = None if op == "bitmask" or not cache else D.agreement_of(head, f"sampling.{op}")
    out, pending = D.open_call(HANDSHAKE, agreement, values, error, head.process_group, device,
                               what=f"sampling.{op}")
    if pending is None or not pending.steady:
        agreed = int(out["proposal"][0])
        if agreement is not None:
            agreement.base_seed = agreed
        return Agreed(agreed, pending)
    return Agreed((pending.agreement.base_seed + pending.agreement.calls * 0x9E3779B97F4A7C15) % 2**62, pending)


def own(local_logits: torch.Tensor, head: VocabPlacement) -> torch.Tensor:
    """The owned columns only: padding never takes part (not even as a ``-inf`` tie). With a second
    segment, the base piece's then the added piece's owned columns (ascending token ids); a tensor
    already that wide is returned as is."""
    if head.added is None:
        return local_logits[:, : head.shard.size]
    if local_logits.shape[1] == head.owned:
        return local_logits
    base = head.shard.width
    return torch.cat([local_logits[:, : head.shard.size], local_logits[:, base : base + head.added.size]], dim=1)


def gather_stack(t: torch.Tensor, head: VocabPlacement, pending: D.Pending | None = None) -> torch.Tensor:
    """``[tp, *t.shape]``: every rank's ``t`` (same shape on every rank; a replicated head: ``t[None]``).
    ``pending``: the call's verdict (:func:`handshake`) when this is its first data collective."""
    if not head.is_split:
        return t[None]
    return torch.stack(D.gather_verdict(pending, t, head.tp_size, head.process_group))


def _pack(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 values + int64 ids -> one int64 tensor ``[..., 2]`` (values as their bit pattern)."""
    bits = values.to(torch.float32).view(torch.int32).to(torch.int64)
    return torch.stack([bits, ids], dim=-1)


def _unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return packed[..., 0].to(torch.int32).view(torch.float32), packed[..., 1]


def _order_by_value_then_id(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Permutation along dim 1 that sorts by value descending, then id ascending."""
    by_id = torch.argsort(ids, dim=1, stable=True)
    by_value = torch.argsort(values.gather(1, by_id), dim=1, descending=True, stable=True)
    return by_id.gather(1, by_value)


def local_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``x [B, n]`` (no NaN, ``k <= n``) with ties broken towards the lower column.

    ``torch.topk`` fixes the top-k *values* but not which of several equal columns it
    returns at the k-th place, so: every column strictly above the k-th value, plus the
    lowest-numbered columns equal to it until there are ``k``. O(n), no full sort, fixed shapes (no
    ``nonzero``: the kept columns are picked by a second ``topk`` over keys distinct on them).
    """
    n = x.shape[1]
    kth = torch.topk(x, k, dim=1, sorted=True).values[:, -1:]
    above = x > kth
    at = x == kth
    keep = above | (at & (torch.cumsum(at, dim=1) <= k - above.sum(dim=1, keepdim=True)))
    key = torch.where(keep, n - torch.arange(n, device=x.device), -1)
    cols = torch.topk(key, k, dim=1, sorted=True).indices  # ascending columns per row
    vals = x.gather(1, cols)
    order = torch.argsort(vals, dim=1, descending=True, stable=True)
    return vals.gather(1, order), cols.gather(1, order)


# ---- greedy and top-k ------------------------------------------------------------------------
def greedy(local_logits: torch.Tensor, head: Placement) -> torch.Tensor:
    """Token ids ``[B]`` (int64) of the largest logit, lowest id among ties: ``argmax`` of the gathered logits."""
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, "sampling.greedy")
    pending = handshake(head, local_logits, error, "greedy").pending
    best, chosen = argmax_over_vocab(own(local_logits, head), head, pending)
    if bool(torch.isneginf(best).any()):
        # A row masked to -inf everywhere (a bitmask that allows nothing): no id is right. Every
        # rank sees the same gathered maxima, so every rank raises.
        raise InputError(f"sampling.greedy: row(s) {torch.isneginf(best).nonzero()[:, 0].tolist()} allow no token "
                         "(every logit is -inf)")
    return chosen


MAX_BLOCK = 256  # columns a block of first_max's first pass


def first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.max(x, dim=1)``'s values and indices (each row's largest value and its first column; NaN
    wins, as there) of ``x [B, n]``, by blocks: the maxima of blocks of :data:`MAX_BLOCK` columns
    without an index (``amax``), the first block holding the row's maximum (no earlier block can hold a
    value equal to it), then the index inside that block. torch's indexed max read 8 x 262144 float32 in
    1.8 ms, this in 0.19."""
    rows, n = x.shape
    if rows == 0 or n < 2 * MAX_BLOCK:
        best, cols = torch.max(x, dim=1)
        return best, cols
    full = n - n % MAX_BLOCK
    heads = x[:, :full].reshape(rows, full // MAX_BLOCK, MAX_BLOCK).amax(dim=2)
    if full < n:
        heads = torch.cat([heads, x[:, full:].amax(dim=1, keepdim=True)], dim=1)
    block = torch.max(heads, dim=1).indices
    # The last block's overhang repeats column n - 1 after the real columns: a first maximum stays first.
    cols = (block[:, None] * MAX_BLOCK + torch.arange(MAX_BLOCK, device=x.device)).clamp(max=n - 1)
    at = torch.max(x.gather(1, cols), dim=1).indices
    col = cols.gather(1, at[:, None])[:, 0]
    return x.gather(1, col[:, None])[:, 0], col


def argmax_over_vocab(scores: torch.Tensor, head: VocabPlacement,
                      pending: D.Pending | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(best [B], token id [B])`` of the largest of every rank's ``scores [B, V_local]`` (owned
    columns), lowest id among ties; one all_gather of ``[B, 2]`` int64 pairs (values as float64
    bits: float32 scores widen exactly), carrying ``pending`` (:func:`gather_stack`). A row that is
    ``-inf`` everywhere gets id ``NO_ID``."""
    rows = scores.shape[0]
    if scores.shape[1]:
        best, cols = first_max(scores)  # the first maximum: the lowest local column, the lowest id
        chosen = head.token_ids(cols)
    else:  # a trailing padded-layout rank that owns no columns
        best = scores.new_full((rows,), float("-inf"))
        chosen = torch.full((rows,), NO_ID, dtype=torch.int64, device=scores.device)
    chosen = torch.where(torch.isneginf(best), torch.full_like(chosen, NO_ID), chosen)
    if not head.is_split:
        return best, chosen
    packed = gather_stack(torch.stack([best.to(torch.float64).view(torch.int64), chosen], dim=-1), head, pending)
    values, ids = packed[..., 0].view(torch.float64), packed[..., 1]  # [tp, B]
    top = values.max(dim=0).values
    return top, torch.where(values == top, ids, torch.full_like(ids, NO_ID)).min(dim=0).values


def topk(local_logits: torch.Tensor, head: Placement, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [B, k], ids [B, k] int64)``: the k largest logits, by value desc then id asc.

    Values are in the logits' dtype and equal ``torch.topk(gathered, k).values``.
    """
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, "sampling.topk")
    if error is None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= head.vocab_size):
        error = InputError(f"sampling.topk: k must be an int in [1, vocab_size={head.vocab_size}], got {k!r}")
    pending = handshake(head, local_logits, error, "topk", extra=int(k) if error is None else 0).pending
    return merged_topk(local_logits, head, k, pending)


def merged_topk(local_logits: torch.Tensor, head: VocabPlacement, k: int,
                pending: D.Pending | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk` on validated input whose call the ranks already agreed on (one all_gather, carrying
    ``pending``: :func:`gather_stack`)."""
    x = own(local_logits, head)
    if not head.is_split:
        return local_topk(x, k)
    k_local = min(k, x.shape[1])
    vals = x.new_empty(x.shape[0], 0)
    cols = torch.empty(x.shape[0], 0, dtype=torch.int64, device=x.device)
    if k_local:
        vals, cols = local_topk(x, k_local)
    values, ids = gather_candidates(vals, head.token_ids(cols), head, k, pending)
    return values.to(local_logits.dtype), ids


def gather_candidates(vals: torch.Tensor, ids: torch.Tensor, head: VocabPlacement, k: int,
                      pending: D.Pending | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` (value descending, id ascending) of every rank's candidates ``vals`` / ``ids
    [B, <= k]`` (global ids; padded with empty slots): float32 ``[B, k]`` and int64 ``[B, k]``, one
    all_gather (carrying ``pending``: :func:`gather_stack`). A NaN value sorts first, so it stays in the result."""
    rows, have = vals.shape
    packed = _pack(torch.full((rows, k), float("-inf"), device=vals.device),
                   torch.full((rows, k), NO_ID, dtype=torch.int64, device=vals.device))
    if have:
        packed[:, :have] = _pack(vals, ids)
    all_values, all_ids = _unpack(gather_stack(packed, head, pending))  # [tp, B, k]
    all_values = all_values.permute(1, 0, 2).reshape(rows, -1)
    all_ids = all_ids.permute(1, 0, 2).reshape(rows, -1)
    order = _order_by_value_then_id(all_values, all_ids)[:, :k]
    # Sum of the shards' sizes is V >= k, so the first k are real candidates, never empty slots.
    return all_values.gather(1, order), all_ids.gather(1, order)


def owned_ranges(head: VocabPlacement) -> list[tuple[int, int]]:
    """Every rank's owned global ids ``[start, end)``, in rank order (what the vocab tree needs; a
    one-segment placement: :meth:`VocabPlacement.owned_ranges` gives both segments')."""
    return [(s.start, s.start + s.size) for s in head.shards]


def pick_owned(x: torch.Tensor, token_ids: torch.Tensor, head: VocabPlacement, into: torch.Tensor) -> torch.Tensor:
    """:func:`pick_logits` on this rank's owned columns ``x`` of ``head`` (one or two segments)."""
    if head.added is None:
        return pick_logits(x, token_ids, head.vocab_start, into)
    if not x.shape[1]:
        return into
    cols, mine = head.owned_columns(token_ids)
    return torch.where(mine, x.gather(1, cols), into)


def pick_logits(x: torch.Tensor, token_ids: torch.Tensor, first_id: int, into: torch.Tensor) -> torch.Tensor:
    """``into`` with the logits of ``token_ids [B, n]`` (global ids) that fall in ``x``'s columns
    (ids ``first_id .. first_id + x.shape[1]``) filled in; the other entries unchanged."""
    if not x.shape[1]:
        return into
    local = token_ids - first_id
    mine = (local >= 0) & (local < x.shape[1])
    return torch.where(mine, x.gather(1, local.clamp(0, x.shape[1] - 1)), into)


# ---- normalization: global log-softmax ------------------------------------------------------------
def global_max(x: torch.Tensor, head: VocabPlacement, pending: D.Pending | None = None) -> torch.Tensor:
    """``[B]`` float32 max over the whole vocab (``-inf`` for a rank with no columns)."""
    local = x.amax(dim=1) if x.shape[1] else x.new_full((x.shape[0],), float("-inf"))
    local = local.to(torch.float32)
    if head.is_split:
        # An all_gather + max rather than an all_reduce MAX (the same exact values): it may be a
        # call's first data collective, which carries the call's verdict (``pending``, see handshake).
        local = gather_stack(local, head, pending).amax(dim=0)
    return local


def sum_exp_and_picks(
    x: torch.Tensor, head: VocabPlacement, token_ids: torch.Tensor | None, pending: D.Pending | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Global ``(max [B], logsumexp [B], picked logits [B, n] or None)`` in float32.

    The logsumexp is the fixed pairwise tree of ``(max, sum exp)`` pairs over global token ids
    (:mod:`trtvocab.sampling.treesum`): bitwise the same at every tp size and layout, and the same
    as a vocab-chunked caller that builds the tree's nodes chunk by chunk while the logits stream
    (:mod:`trtvocab.sampling.chunked`). One collective: the node pairs, with the picked logits
    riding along (exactly one rank owns each id; the others add an exact 0), and the call's verdict
    (``pending``, :func:`handshake`) when it is the call's first."""
    x = x.to(torch.float32)
    picked = None
    if token_ids is not None:
        picked = pick_owned(x, token_ids, head, torch.zeros(token_ids.shape, dtype=torch.float32, device=x.device))
    if head.added is None:
        return tree_logsumexp(x, head.vocab_start, head.vocab_size, head.tp_size, head.process_group,
                              owned_ranges(head), extra=picked, pending=pending)
    # Two segments: each piece's nodes of the one tree over [0, V + A), merged as one range's would be.
    (a, _), (c, _) = head.owned_ranges()[head.tp_rank]
    nodes = range_nodes(x[:, : head.shard.size], a) + range_nodes(x[:, head.shard.size :], c)
    return merge_ranges(nodes, head.vocab_size, head.tp_size, head.process_group, head.owned_ranges(), like=x,
                        extra=picked, pending=pending)


def logsumexp(local_logits: torch.Tensor, head: Placement) -> torch.Tensor:
    """``[B]`` float32 ``log(sum(exp(logits)))`` over the *whole* vocab: the global softmax denominator."""
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, "sampling.logsumexp")
    pending = handshake(head, local_logits, error, "logsumexp").pending
    return sum_exp_and_picks(own(local_logits, head), head, None, pending)[1]


def log_softmax(local_logits: torch.Tensor, head: Placement) -> torch.Tensor:
    """This rank's columns ``[B, V_local]`` (float32) of the global log-softmax."""
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, "sampling.log_softmax")
    pending = handshake(head, local_logits, error, "log_softmax").pending
    x = own(local_logits, head)
    lse = sum_exp_and_picks(x, head, None, pending)[1]
    return x.to(torch.float32) - lse[:, None]


def token_ids_error(token_ids: Any, rows: int, vocab_size: int, what: str) -> tuple[InputError | None, int]:
    """``(why token_ids cannot be scored, ids per row)``: an integer ``[B]`` or ``[B, n]`` tensor
    with ``B = rows`` and every id in ``[0, vocab_size)``."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype.is_floating_point \
            or token_ids.dtype in (torch.bool, torch.complex64, torch.complex128):
        kind = token_ids.dtype if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
        return InputError(f"{what}: token_ids must be an integer tensor, got {kind}"), 0
    if token_ids.dim() not in (1, 2) or token_ids.shape[0] != rows:
        return InputError(f"{what}: token_ids must have shape [B] or [B, n] with B = {rows}, "
                          f"got {list(token_ids.shape)}"), 0
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        return InputError(f"{what}: token_ids must be in [0, {vocab_size}), "
                          f"got values in [{int(token_ids.min())}, {int(token_ids.max())}]"), 0
    return None, 1 if token_ids.dim() == 1 else token_ids.shape[1]


def logprobs(local_logits: torch.Tensor, head: Placement, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (float32, global softmax) of ``token_ids`` (``[B]`` or ``[B, n]``, global ids)."""
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, "sampling.logprobs")
    n = 0
    if error is None:
        error, n = token_ids_error(token_ids, local_logits.shape[0], head.vocab_size, "sampling.logprobs")
    pending = handshake(head, local_logits, error, "logprobs", extra=n,
                        argument=token_ids.to(torch.int64) if error is None else None).pending
    ids = token_ids.to(torch.int64).reshape(token_ids.shape[0], -1).to(local_logits.device)
    _, lse, picked = sum_exp_and_picks(own(local_logits, head), head, ids, pending)
    assert picked is not None
    return (picked - lse[:, None]).reshape(token_ids.shape)


def min_p_mask(local_logits: torch.Tensor, head: Placement, min_p: float | torch.Tensor) -> torch.Tensor:
    """Bool ``[B, V_local]``: tokens kept by min-p, ``p >= min_p * p_max`` over the whole vocab.

    ``p / p_max = exp(x - max)``: the global max is all min-p needs (the softmax
    denominator cancels), so one all_reduce MAX. ``min_p`` is a float or a ``[B]`` tensor in [0, 1].
    """
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, "sampling.min_p")
    if error is None:
        threshold = torch.as_tensor(min_p, dtype=torch.float32, device=local_logits.device)
        if threshold.dim() > 1 or (threshold.dim() == 1 and threshold.shape[0] != local_logits.shape[0]):
            error = InputError(f"sampling.min_p: min_p must be a float or a [B] tensor, got {list(threshold.shape)}")
        elif bool(((threshold < 0) | (threshold > 1) | torch.isnan(threshold)).any()):
            error = InputError(f"sampling.min_p: min_p must be in [0, 1], got {min_p!r}")
    pending = handshake(head, local_logits, error, "min_p", argument=threshold if error is None else None).pending
    x = own(local_logits, head).to(torch.float32)
    m = global_max(x, head, pending)
    threshold = threshold.reshape(-1, 1) if threshold.dim() == 1 else threshold
    return torch.exp(x - m[:, None]) >= threshold


def apply_min_p(local_logits: torch.Tensor, head: Placement, min_p: float | torch.Tensor) -> torch.Tensor:
    """This rank's owned columns with the tokens min-p drops set to ``-inf``."""
    head = VocabPlacement.of(head)
    keep = min_p_mask(local_logits, head, min_p)
    x = own(local_logits, head)
    return x.masked_fill(~keep, float("-inf"))


def top_p_mask(local_logits: torch.Tensor, head: Placement, top_p: float | torch.Tensor) -> torch.Tensor:
    """Bool ``[B, V_local]``: the nucleus, the shortest prefix of the vocab in (value desc, id asc)
    order whose probability under the *global* softmax reaches ``top_p`` (a token is kept when
    the mass before it is below ``top_p``; the top token is always kept).

    The mass before a token is the exact sum of the float32 probabilities before it (int64 fixed
    point, :func:`fixed_mass`), found by :func:`prefix_keep` in four fixed rounds: ``O(B)`` numbers
    move, never ``[B, V]``, and every rank, tp size and device makes the same decisions.
    """
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, "sampling.top_p")
    if error is None:
        threshold = torch.as_tensor(top_p, dtype=torch.float32, device=local_logits.device)
        if threshold.dim() > 1 or (threshold.dim() == 1 and threshold.shape[0] != local_logits.shape[0]):
            error = InputError(f"sampling.top_p: top_p must be a float or a [B] tensor, got {list(threshold.shape)}")
        elif bool(((threshold <= 0) | (threshold > 1) | torch.isnan(threshold)).any()):
            error = InputError(f"sampling.top_p: top_p must be in (0, 1], got {top_p!r}")
    pending = handshake(head, local_logits, error, "top_p", argument=threshold if error is None else None).pending
    return nucleus(local_logits, head, threshold, pending)


def nucleus(local_logits: torch.Tensor, head: VocabPlacement, threshold: torch.Tensor,
            pending: D.Pending | None = None) -> torch.Tensor:
    """:func:`top_p_mask` on validated input whose call the ranks already agreed on (``pending``: the
    call's verdict, for its first gather, the vocab tree's).

    ``threshold``: a 0-d or ``[B]`` float32 tensor. ``-inf`` logits (masked tokens) carry no
    mass, so the nucleus is that of the distribution renormalized over the rest.
    """
    x = own(local_logits, head).to(torch.float32)
    lse = sum_exp_and_picks(x, head, None, pending)[1]
    return prefix_keep(x, torch.exp(x - lse[:, None]), threshold, head, gather_stack)


# ---- the nucleus: an exact prefix mass in fixed rounds ---------------------------------------------
# Probabilities in int64 fixed point. Their sum is ~1, but a float32 logsumexp rounded down at huge logits
# can make every one of many tied tokens p = 1: bounded by V * 2**40, no sum overflows for V <= 2**23.
MASS_BITS = 40
_DIGIT = 8  # bits of the order key settled per round
RADIX_BINS = 1 << _DIGIT
RADIX_ROUNDS = 32 // _DIGIT  # prefix_keep's gathers: a float32 order key in 8-bit digits


def fixed_mass(p: torch.Tensor) -> torch.Tensor:
    """int64 ``round(p * 2**MASS_BITS)`` (half to even) of float32 probabilities (NaN: 0): sums of these are
    exact, so the mass before a token is the same number whatever order or grouping adds it (any tp, any
    device). A probability is exact from ``2**-16`` up, else rounded to a multiple of ``2**-40``."""
    p = torch.nan_to_num(p.to(torch.float32), nan=0.0).clamp(0.0, 1.0)
    return torch.round(p * 2.0**MASS_BITS).to(torch.int64)  # exact in float32: a power-of-two scale, then round


def kept_prefix(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """``[B]``: how many of a row's tokens, listed in the total order (``probs [B, n]``), the nucleus of
    ``mass [B]`` keeps: those whose exact mass strictly before them is below ``mass``; at least 1."""
    w, t = _weights(probs, _fixed_threshold(mass))
    before = torch.cumsum(w, dim=1) - w
    kept = (before < t).sum(dim=1).clamp(min=1)
    return torch.where(mass.reshape(-1) >= 1, probs.shape[1], kept)  # a threshold of 1 keeps every token


def _weights(probs: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, t)``: the tokens' fixed-point masses and the threshold. A row with no mass at all (every logit
    ``-inf``: its probabilities are NaN on every rank) weighs each token 1 against a threshold of 1, so that
    only its first token is kept, as a float reference keeps it."""
    void = torch.isnan(probs).all(dim=1, keepdim=True)
    return torch.where(void, 1, fixed_mass(probs)), torch.where(void, 1, t)


def _fixed_threshold(mass: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` int64 ``mass * 2**MASS_BITS``, at least 1 (the first token is always kept)."""
    return fixed_mass(mass).reshape(-1, 1).clamp(min=1)


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in ``[0, 2**32)`` ordered as the float32 values ``x`` (``-0.0`` as ``0.0``)."""
    x = torch.where(x == 0, torch.zeros_like(x), x.to(torch.float32))
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2**31


def prefix_keep(order: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor, head: VocabPlacement,
                gather: Callable[[torch.Tensor, VocabPlacement], torch.Tensor], *,
                whole_ties: bool = False) -> torch.Tensor:
    """Bool ``[B, n]`` over this rank's owned columns: the shortest prefix of the whole vocab, in the
    total order (``order`` descending, then token id ascending), whose exact mass reaches ``mass [B]``:
    a token is kept when the :func:`fixed_mass` of the tokens before it is below ``mass`` (the first
    token always is). ``probs``: each column's probability (0 for masked tokens). Top-p orders by the
    logits; typical-p by ``-|surprise - entropy|`` with ``whole_ties`` (transformers' rule: every token
    whose key equals the last kept token's is kept too).

    A radix search for the cut with no sort and no host read: four rounds, each a histogram of the
    int64 masses over the next 8 bits of the order key (:func:`_order_key`) among the tokens still in
    the running, summed over the ranks (``gather``: a ``[tp, ...]`` all_gather), settle the key of the
    last kept token; the last round's histogram, kept per rank and id segment, orders the tokens tied on
    it by id. Integer sums: the same cut at every tp, layout and device, and the same as
    :func:`kept_prefix` on the sorted list.
    """
    rows, n = order.shape
    key = _order_key(order)
    w, t = _weights(probs, _fixed_threshold(mass.expand(rows) if mass.dim() == 0 else mass))
    segments = 1 if head.added is None or whole_ties else 2
    second = (torch.arange(n, device=order.device) >= head.shard.size).to(torch.int64)[None, :]
    prefix = torch.zeros(rows, 1, dtype=torch.int64, device=order.device)
    above = torch.zeros(rows, 1, dtype=torch.int64, device=order.device)  # mass of keys beyond the prefix's
    every = above
    for shift in range(32 - _DIGIT, -1, -_DIGIT):
        digit = (key >> shift) & (RADIX_BINS - 1)
        inside = (key >> (shift + _DIGIT)) == prefix
        width = RADIX_BINS if shift else RADIX_BINS * segments
        if not shift and segments > 1:  # the last round keeps the id segments apart for the tie order
            digit = digit + RADIX_BINS * second
        hist = torch.zeros(rows, width, dtype=torch.int64, device=order.device)
        hist = hist.scatter_add(1, digit, w.masked_fill(~inside, 0))
        every = gather(hist, head)  # [tp, B, width]
        total = every.sum(dim=0).view(rows, -1, RADIX_BINS).sum(dim=1)
        beyond = torch.flip(torch.cumsum(torch.flip(total, [1]), dim=1), [1]) - total  # mass of higher digits
        reach = above + beyond  # the mass before the first token of each digit
        d = (reach >= t).sum(dim=1, keepdim=True)  # the first digit whose tokens start below the mass
        above = reach.gather(1, d)
        prefix = prefix * RADIX_BINS + d
    everything = (mass >= 1).reshape(-1, 1)  # a threshold of 1 keeps every token (float32 masses may pass 1)
    if whole_ties:  # some token holds the cut key (its mass took M below the threshold), or all are kept
        return (key >= prefix) | everything
    tp = every.shape[0]
    # The cut key's mass on each (segment, rank), in token id order: segment-major, then rank.
    at = every.view(tp, rows, segments, RADIX_BINS).gather(3, prefix.remainder(RADIX_BINS).view(1, rows, 1, 1)
                                                    .expand(tp, rows, segments, 1))[..., 0]
    at = at.permute(1, 2, 0).reshape(rows, segments * tp)
    earlier = torch.cumsum(at, dim=1) - at
    rank = head.tp_rank
    prior = earlier[:, rank:rank + 1] if segments == 1 else \
        torch.where(second.bool(), earlier[:, tp + rank:tp + rank + 1], earlier[:, rank:rank + 1])
    tied = key == prefix
    tw = torch.where(tied, w, torch.zeros_like(w))
    local = torch.cumsum(tw, dim=1) - tw
    if segments > 1:  # the added segment's ties start after the base segment's (counted in prior)
        local = local - second * tw[:, : head.shard.size].sum(dim=1, keepdim=True)
    return (key > prefix) | (tied & (above + prior + local < t)) | everything


def apply_top_p(local_logits: torch.Tensor, head: Placement, top_p: float | torch.Tensor) -> torch.Tensor:
    """This rank's owned columns with the tokens outside the nucleus set to ``-inf``."""
    head = VocabPlacement.of(head)
    keep = top_p_mask(local_logits, head, top_p)
    return own(local_logits, head).masked_fill(~keep, float("-inf"))
