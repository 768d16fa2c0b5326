"""Sampling a head whose vocabulary has an added segment (adapters that add tokens), on its shards.

Such a head (:mod:`trtvocab.parallel.added_vocab`) owns two id ranges per rank, its base piece
``[start, end)`` and its added piece ``V + [a, b)``, end to end in ``head.local_logits``.
:func:`segmented_placement` gives the sampler a :class:`~trtvocab.parallel.sharding.VocabPlacement` with
a second segment (``added``), whose ``column_ids`` / ``token_ids`` / ``owned_columns`` are the one place a
local column becomes a token id (and back). Every reduction of ``trtvocab.sampling`` reads ids through
it, so :func:`token_order_output` (``sampling.decode`` for such a head) draws on the shards with ``O(B * k)``
numbers crossing ranks -- bitwise the draw of the gathered token-order logits (:func:`gathered_output`,
the tests' reference): a rank's owned ids still ascend, the noise is keyed by token id and the vocab
tree is one fixed tree over ``[0, V + A)``. A row's vocabulary limit is in its logits (``-inf`` on the
added ids its adapter does not add); ``vocab_limit`` bounds the base ids only. Above the logits budget
``sampling.decode`` streams (:mod:`trtvocab.sampling.chunked`: the added piece is one more chunk).
Its :class:`~trtvocab.sampling.state.TokenState` is a token-order one (:func:`token_order_view`); rows
that draw by the race alone skip the sampler's own handshake (:func:`_race`: one ``[tp, B]`` exchange).
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import torch

from trtvocab.errors import InputError
from trtvocab.lm_head import LMHead
from trtvocab.parallel.distributed import HandshakeState
from trtvocab.parallel.sharding import Placement, VocabPlacement
from trtvocab.sampling.args import SamplerOutput, params_tensor, rows_params, step_error
from trtvocab.sampling.bitmask import apply_bitmask_, bitmask_error
from trtvocab.sampling.draw import sample_output
from trtvocab.sampling.params import SamplingParams
from trtvocab.sampling.prepared import DecodeStep
from trtvocab.sampling.reductions import handshake
from trtvocab.sampling.state import TokenState

_VIEWS: weakref.WeakKeyDictionary[Any, LMHead] = weakref.WeakKeyDictionary()


def has_added_vocab(head: object) -> bool:
    """Whether ``head`` has an added segment (then :func:`token_order_output` samples it)."""
    return bool(getattr(head, "added_vocab", 0))


def token_order_view(head: LMHead) -> LMHead:
    """A replicated placement over ``[0, V + A)`` (its ``[V + A, 1]`` weight is never read) for sampling
    ``head``'s token-order logits (column ``i`` == token id ``i``); what a
    :class:`~trtvocab.sampling.state.TokenState` for such a head is built on
    (``TokenState.for_head(token_order_view(head), ...)``)."""
    view = _VIEWS.get(head)
    if view is None or view.vocab_size != head.full_vocab_size or view.device != head.device:
        view = LMHead(head.full_vocab_size, 1, dtype=torch.float32, device=head.device)
        _VIEWS[head] = view
    return view


def state_placement(head: Placement) -> VocabPlacement:
    """What a :class:`~trtvocab.sampling.state.TokenState` of ``head``'s rows is built on: the head itself,
    or :func:`token_order_view` for a head with an added segment."""
    return token_order_view(head) if has_added_vocab(head) else head


def token_order_output(hidden: torch.Tensor, head: LMHead, params: SamplingParams | list[SamplingParams], *,
                  step: int = 0, vocab_limit: int | None = None, bitmask: torch.Tensor | None = None,
                  error: InputError | None = None, state: TokenState | None = None) -> SamplerOutput:
    """``trtvocab.sampling.decode_output`` for a head with an added segment, on its shards (module docstring).

    ``hidden``: the step's rows ``[B, H]`` (``sampling.decode_output`` has already selected them from a
    packed batch). ``error``: a verdict of the caller's own checks (such as that row selection), raised on
    every rank after the handshake. ``vocab_limit`` bounds the base ids only (a tokenizer shorter than the
    base vocabulary); the added ids are bounded per row by the adapters. ``state``: built on
    :func:`token_order_view`. The inputs are checked on every rank, then one handshake
    (``sampling.reductions.handshake``: the params' digest, a fresh seed) makes a bad input on one rank --
    or params that differ between ranks -- raise on every rank before any data moves.
    """
    error = error or head.check_input(hidden)
    rows = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() == 2 else 0
    view = token_order_view(head)
    per_row = rows_params(params, rows, "sampling.decode")
    if isinstance(per_row, InputError):
        error, per_row = error or per_row, []
    if vocab_limit is not None and (isinstance(vocab_limit, bool) or not isinstance(vocab_limit, int)
                                    or not 1 <= vocab_limit <= head.vocab_size):
        error = error or InputError(f"sampling.decode: vocab_limit must be an int in [1, base vocab_size="
                                    f"{head.vocab_size}], got {vocab_limit!r}")
    if state is not None and (not isinstance(state, TokenState) or (state.start, state.size) != (0, view.vocab_size)):
        error = error or InputError("sampling.decode: a head with added tokens samples in token order; build the "
                                    "state with TokenState.for_head(token_order_view(head), ...)")
    # The ranks agree on the params (and pick rank 0's fresh seed for unseeded rows) before any data moves:
    # the token-order draw below makes no collective that could catch a rank whose params differ.
    digest = None
    if error is None:
        error = step_error(step, "sampling.decode")
    if error is None:
        digest = params_tensor(per_row, step, vocab_limit).reshape(-1)
        if bitmask is not None and isinstance(bitmask, torch.Tensor):
            digest = torch.cat([digest, bitmask.reshape(-1).to(torch.int64).cpu()])
    fresh = handshake(head, hidden, error, "decode", argument=digest,
                      proposal=int(torch.randint(0, 2**62, (1,)).item()), cache=False).proposal
    if any(p.seed is None for p in per_row):
        per_row = [p if p.seed is not None else p.model_copy(update={"seed": (fresh + r) % 2**62})
                   for r, p in enumerate(per_row)]
    place = segmented_placement(head)
    logits = head.local_logits(hidden).float()
    if vocab_limit is not None and vocab_limit < head.vocab_size:
        ids = place.local_token_ids(logits.device)
        logits[:, (ids >= vocab_limit) & (ids < head.vocab_size)] = float("-inf")
    if bitmask is None and all(_races_alone(p) for p in per_row):
        # The race alone (no processor, filter or logprobs): the prepared step's race on this rank's two
        # pieces, one [B, 3] gather, the same ids as the token-order path (tested).
        seeds = [int(p.seed) for p in per_row]  # type: ignore[arg-type]  # every row has one by now
        return DecodeStep.for_rows(place, per_row, seeds, step, None, None).draw_once(logits, "sampling.decode")
    if bitmask is not None:
        error = bitmask_error(logits, bitmask, place)
        if error is not None:  # the digest agreed on the bitmask: every rank raises alike
            raise error
        apply_bitmask_(logits, bitmask, place)
    return sample_output(logits, place, per_row, step=step, state=state)


def gathered_output(hidden: torch.Tensor, head: LMHead, per_row: list[SamplingParams], *, step: int = 0,
                    vocab_limit: int | None = None, bitmask: torch.Tensor | None = None,
                    state: TokenState | None = None) -> SamplerOutput:
    """The reference the sharded path is tested against: ``head(hidden)`` gathered in token order
    (``[B, V + A]``) and sampled on :func:`token_order_view` (seeded ``per_row``; every rank alike)."""
    view = token_order_view(head)
    gather = head.gather_output
    head.gather_output = True
    try:
        logits = head(hidden).float()
    finally:
        head.gather_output = gather
    if vocab_limit is not None and vocab_limit < head.vocab_size:
        logits[:, vocab_limit : head.vocab_size] = float("-inf")
    if bitmask is not None:
        error = bitmask_error(logits, bitmask, view)
        if error is not None:
            raise error
        apply_bitmask_(logits, bitmask, view)
    return sample_output(logits, view, per_row, step=step, state=state)


_PLACEMENTS: weakref.WeakKeyDictionary[Any, VocabPlacement] = weakref.WeakKeyDictionary()


def segmented_placement(head: LMHead) -> VocabPlacement:
    """``head``'s placement with its added segment as the second one (``VocabPlacement.added``): the
    local columns of ``head.local_logits`` are ids ``[start, end)`` then ``V + [a, b)``. Its own handshake
    state (the sampler's calls on it are not the forward's); cached per head, rebuilt when the head's
    placement or added segment changes."""
    base = head.placement
    place = _PLACEMENTS.get(head)
    shards = tuple(s.added for s in head.added_shards)
    if place is None or place.shard != base.shard or place.added_shards != shards or place.device != base.device \
            or place.process_group is not base.process_group:
        place = replace(base, added=shards[base.tp_rank], added_shards=shards, handshake_state=HandshakeState())
        _PLACEMENTS[head] = place
    return place


def _races_alone(p: SamplingParams) -> bool:
    """Whether a row's draw is the race alone (greedy, or temperature and noise): no logits processor,
    filter or logprobs: what the race decides without the gather."""
    filtered = p.top_k != 0 or p.top_p != 1.0 or p.min_p != 0.0 or p.typical_p != 1.0
    return not p.processes and p.logprobs is None and (p.greedy or not filtered)


__all__ = ["gathered_output", "has_added_vocab", "segmented_placement", "state_placement", "token_order_output",
           "token_order_view"]
