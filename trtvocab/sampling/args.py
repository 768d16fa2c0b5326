"""What a draw is called with and what it returns, checked once for every path: the per-row
:class:`SamplingParams`, the step, the vocab limit, the state, the digest the ranks compare, the plan of
collectives, and the outputs (:class:`SamplerOutput`, :class:`Logprobs`). The prepared step
(:mod:`~trtvocab.sampling.prepared`), the per-call draw (:mod:`~trtvocab.sampling.draw`) and the streamed one
(:mod:`~trtvocab.sampling.chunked`) read them from here.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from trtvocab.errors import InputError
from trtvocab.parallel.sharding import VocabPlacement
from trtvocab.sampling.params import LOGPROBS_MODES, SamplingParams
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


__all__ = ["ENTROPY_BITS", "Logprobs", "SamplerOutput", "collective_plan", "draw_args_error", "params_tensor",
           "prompt_args_error", "rows_params", "state_error", "step_error"]
