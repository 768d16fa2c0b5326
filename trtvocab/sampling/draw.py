"""Seeded sampling on the shards: the draw of the gathered, filtered softmax, without the gather.

For each row, in vLLM's order: temperature (``x / T``; ``T < GREEDY_BELOW = 1e-5``, 0 included, is
greedy: :attr:`SamplingParams.greedy`), top-k (the exact
global top-k, ties to the lower id), top-p (the exact nucleus of what is left), min-p, then
the draw. The draw is a Gumbel-max race: token ``i`` scores ``x_i / T + g_i`` with
``g_i = -log(-log(u_i))`` and the highest score wins, which picks ``i`` with probability
``softmax(x / T)_i`` over the kept tokens exactly. Each rank scores its own columns; only
each rank's best ``(score, id)`` per row crosses (``[tp, B]`` pairs). The noise ``u_i`` is
keyed by ``(seed, step, global id)`` (:mod:`trtvocab.sampling.noise`), so a seeded row gets
the same token at every tp size and layout, and as at tp 1, whenever the logits are equal
(a deterministic head makes them bitwise equal).

See docs/architecture.md, "Seeded sampling without the gather".
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from trtvocab.errors import InputError
from trtvocab.sampling import noise
from trtvocab.sampling.params import SamplingParams
from trtvocab.sampling.reductions import (
    NO_ID,
    argmax_over_vocab,
    check_logits,
    global_max,
    handshake,
    merged_topk,
    nucleus,
    own,
)


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

    Integers (step, vocab_limit, top_k, seed) go as themselves and floats as their float64 bit
    patterns, so nothing is rounded: seeds ``2**60`` and ``2**60 + 1``, equal as float64, differ here.
    """
    table = [[_float_bits(p.temperature), p.top_k, _float_bits(p.top_p), _float_bits(p.min_p),
              -1 if p.seed is None else p.seed] for p in rows]
    return torch.tensor([[step, -1 if vocab_limit is None else vocab_limit, 0, 0, 0], *table], dtype=torch.int64)


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
    return error, per_row if error is None else []


def sample(
    local_logits: torch.Tensor,
    head: Any,
    params: SamplingParams | list[SamplingParams],
    *,
    step: int = 0,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """Token ids ``[B]`` (int64), the same on every rank, drawn as the module docstring says.

    ``local_logits``: this rank's ``[B, V_local]`` (or ``[B, width]``, padding ``-inf``) logits;
    ``-inf`` columns (a bitmask, :func:`apply_token_bitmask`) are never drawn. ``step``: the
    decode step, part of the noise key. ``vocab_limit``: ids at or past it are never drawn
    (a model whose config vocab is larger than its tokenizer: pass ``len(tokenizer)``).
    A row with no allowed token raises :class:`InputError` on every rank.
    """
    error = check_logits(local_logits, head, "sampling.sample")
    return checked_sample(local_logits, head, params, step, vocab_limit, error, "sample", None)


def checked_sample(local_logits: Any, head: Any, params: Any, step: Any, vocab_limit: Any, error: InputError | None,
                   op: str, bitmask: torch.Tensor | None) -> torch.Tensor:
    """:func:`sample` and ``sampling.decode`` after their own validation (``error``: this rank's
    verdict so far): the params checks, the handshake (``op``; ``bitmask`` joins the argument
    digest), then :func:`filtered_draw`."""
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
    return filtered_draw(own(local_logits, head), head, per_row, seeds, step, vocab_limit)


def collective_plan(rows: list[SamplingParams], vocab_size: int) -> int:
    """Which collectives a call makes, as one integer (part of the handshake's signature: a
    change of it renegotiates): the merged top-k width, whether top-p and min-p run."""
    sampled = [p for p in rows if not p.greedy]
    k = min(max([p.top_k for p in sampled] or [0]), vocab_size)
    return 4 * k + 2 * any(p.top_p < 1 for p in sampled) + any(p.min_p > 0 for p in sampled)


def filtered_draw(x: torch.Tensor, head: Any, per_row: list[SamplingParams], seeds: list[int], step: int,
                  vocab_limit: int | None) -> torch.Tensor:
    """The draw of validated, agreed input: ``x`` this rank's owned columns ``[B, V_local]``, one
    params entry and one seed per row; temperature, top-k, top-p, min-p, then the race (module
    docstring). Its collectives: the merged top-k, the nucleus, the global max, the race."""
    n = x.shape[1]
    device = x.device
    ids = torch.arange(head.vocab_start, head.vocab_start + n, device=device)
    temps = torch.tensor([p.temperature for p in per_row], dtype=torch.float32, device=device)[:, None]
    greedy = torch.tensor([p.greedy for p in per_row], dtype=torch.bool, device=device)[:, None]
    x = x.to(torch.float32)
    scaled = torch.where(greedy, x, x / torch.where(greedy, torch.ones_like(temps), temps))
    if vocab_limit is not None:
        scaled = scaled.masked_fill(ids[None, :] >= vocab_limit, float("-inf"))
    sampled = ~greedy[:, 0]
    top_k = [p.top_k if not g else 0 for p, g in zip(per_row, greedy[:, 0].tolist(), strict=True)]
    if max(top_k) > 0:
        k = min(max(top_k), head.vocab_size)
        values, top_ids = merged_topk(scaled, head, k)  # one all_gather; exact, ties to the lower id
        cut = torch.tensor([min(kr, k) - 1 if kr else k - 1 for kr in top_k], device=device)[:, None]
        cut_v, cut_id = values.gather(1, cut), top_ids.gather(1, cut)
        keep = (scaled > cut_v) | ((scaled == cut_v) & (ids[None, :] <= cut_id))
        active = torch.tensor([kr > 0 for kr in top_k], device=device)[:, None]
        scaled = scaled.masked_fill(active & ~keep, float("-inf"))
    top_p = torch.tensor([p.top_p for p in per_row], dtype=torch.float32, device=device)
    if bool(((top_p < 1) & sampled).any()):
        # Threshold 0 for the other rows: their nucleus is one token at once, so they never make
        # the candidate count double (their mask is not applied anyway).
        keep = nucleus(scaled, head, torch.where((top_p < 1) & sampled, top_p, torch.zeros_like(top_p)))
        scaled = scaled.masked_fill(((top_p < 1) & sampled)[:, None] & ~keep, float("-inf"))
    min_p = torch.tensor([p.min_p for p in per_row], dtype=torch.float32, device=device)
    if bool(((min_p > 0) & sampled).any()):
        m = global_max(scaled, head)
        keep = torch.exp(scaled - m[:, None]) >= min_p[:, None]
        scaled = scaled.masked_fill(((min_p > 0) & sampled)[:, None] & ~keep, float("-inf"))
    score = scaled.to(torch.float64)
    if bool(sampled.any()):
        g = noise.gumbel(noise.row_keys(seeds, step).to(device), ids)
        score = torch.where(sampled[:, None], score + g, score)
    score = score.masked_fill(torch.isneginf(scaled), float("-inf"))  # -inf + noise stays excluded
    top, chosen = argmax_over_vocab(score, head)  # the race: each rank's best (score, id), one all_gather
    empty = torch.isneginf(top) | (chosen == NO_ID)
    if bool(empty.any()):
        # Every rank sees the same gathered values, so every rank raises here.
        raise InputError(f"sample: row(s) {empty.nonzero()[:, 0].tolist()} allow no token (every logit is -inf "
                         "after the bitmask / vocab_limit / filters)")
    return chosen
