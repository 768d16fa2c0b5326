"""The sampler's column-local steps, written once for the materialized and the streamed paths.

A call's per-row arguments become one :class:`Metadata` (vLLM v1's ``SamplingMetadata``); each
step here is a pure function of a block of columns (global ids ``col_ids``) and that object, so
:class:`trtvocab.sampling.prepared.DecodeStep` applies it to a rank's whole shard and
:mod:`trtvocab.sampling.chunked` to each streamed chunk, with the same bits. The steps that need
the ranks (top-k, top-p, typical-p, the race's merge) live in :mod:`~trtvocab.sampling.prepared`.
Order and semantics: docs/sampling.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from trtvocab.sampling import noise
from trtvocab.sampling.params import SamplingParams
from trtvocab.sampling.state import TokenState


@dataclass(frozen=True)
class Metadata:
    """One call's validated per-row arguments as tensors: what every step reads."""

    per_row: list[SamplingParams]
    seeds: list[int]
    step: int
    vocab_limit: int | None
    temps: torch.Tensor  # float32 [B, 1]
    greedy: torch.Tensor  # bool [B, 1]
    top_k: list[int]  # 0 for greedy rows
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]
    typical_p: torch.Tensor  # float32 [B]
    keys: torch.Tensor  # int64 [B, 1]: the noise keys of (seed, step)
    state: TokenState | None = None
    # The column-local processors' sparse entries, built once per call (global ids): bans (allowed
    # ids, bad words, min tokens), the rows restricted to allowed ids, the logit bias.
    bans: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [M], ids [M])
    allow: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (restricted [B], rows [A], ids [A])
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows [N], ids [N], float32 values [N])

    @classmethod
    def build(cls, per_row: list[SamplingParams], seeds: list[int], step: int, vocab_limit: int | None,
              device: torch.device, state: TokenState | None = None) -> Metadata:
        """The tensors of ``per_row`` on ``device`` (``state``: the batch's token counts, or None)."""
        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)
        return cls(per_row, seeds, step, vocab_limit,
                   **_sparse(per_row, state, device),
                   temps=f32([p.temperature for p in per_row])[:, None],
                   greedy=torch.tensor([p.greedy for p in per_row], dtype=torch.bool, device=device)[:, None],
                   top_k=[0 if p.greedy else p.top_k for p in per_row],
                   top_p=f32([p.top_p for p in per_row]), min_p=f32([p.min_p for p in per_row]),
                   typical_p=f32([p.typical_p for p in per_row]),
                   keys=noise.row_keys(seeds, step).to(device), state=state)

    @property
    def sampled(self) -> torch.Tensor:
        """Bool ``[B]``: the rows that draw (temperature at or above ``GREEDY_BELOW``)."""
        return ~self.greedy[:, 0]

    def select(self, rows: list[int]) -> Metadata:
        """The metadata of a subset of the rows (in that order)."""
        index = torch.tensor(rows, dtype=torch.int64, device=self.temps.device)
        per_row = [self.per_row[r] for r in rows]
        state = None if self.state is None else self.state.select(rows)
        return replace(self, per_row=per_row, seeds=[self.seeds[r] for r in rows],
                       temps=self.temps[index], greedy=self.greedy[index], top_k=[self.top_k[r] for r in rows],
                       top_p=self.top_p[index], min_p=self.min_p[index], typical_p=self.typical_p[index],
                       keys=self.keys[index], state=state, **_sparse(per_row, state, self.temps.device))

    @property
    def processes(self) -> bool:
        """Whether any row has a column-local logits processor (:func:`process`)."""
        return any(p.processes for p in self.per_row)


def column_ids(first_id: int, n: int, device: torch.device) -> torch.Tensor:
    """The global ids ``[n]`` of a block of columns starting at ``first_id``."""
    return torch.arange(first_id, first_id + n, device=device)


def _sparse(per_row: list[SamplingParams], state: TokenState | None, device: torch.device) -> dict[str, Any]:
    """:class:`Metadata`'s ``bans``, ``allow`` and ``bias`` (None when no row has any)."""
    if not any(p.processes for p in per_row):
        return {"bans": None, "allow": None, "bias": None}
    outputs = state.output if state is not None else [[] for _ in per_row]
    eos = state.eos_token_ids if state is not None else ()
    bans: list[tuple[int, int]] = []
    allow: list[tuple[int, int]] = []
    bias: list[tuple[int, int, float]] = []
    for r, p in enumerate(per_row):
        out = outputs[r]
        bans += [(r, w[-1]) for w in p.bad_words
                 if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == list(w[:-1]))]
        if len(out) < p.min_tokens:
            bans += [(r, i) for i in (*p.stop_token_ids, *(() if p.ignore_eos else eos))]
        allow += [(r, i) for i in p.allowed_token_ids or ()]
        bias += [(r, i, b) for i, b in p.logit_bias.items()]

    def ints(pairs: list[Any], j: int) -> torch.Tensor:
        return torch.tensor([e[j] for e in pairs], dtype=torch.int64, device=device)
    restricted = torch.tensor([p.allowed_token_ids is not None for p in per_row], dtype=torch.bool, device=device)
    return {"bans": (ints(bans, 0), ints(bans, 1)),
            "allow": (restricted, ints(allow, 0), ints(allow, 1)) if allow else None,
            "bias": (ints(bias, 0), ints(bias, 1), torch.tensor([e[2] for e in bias], dtype=torch.float32,
                                                                 device=device)) if bias else None}


def process(x: torch.Tensor, col_ids: torch.Tensor, meta: Metadata, lo: int) -> torch.Tensor:
    """vLLM v1's steps 3-6 on float32 columns (``lo``: the block's first local owned column):
    allowed token ids, bad words, min tokens, logit bias, then the repetition, frequency and
    presence penalties. Column-local: each rank touches only the ids it owns (the call's sparse
    entries, :attr:`Metadata.bans` ..., that fall in the block). Returns ``x`` itself when no row has any."""
    if not meta.processes:
        return x
    n = x.shape[1]
    first = int(col_ids[0]) if n else 0
    # A block's ids ascend; they are one run except on a placement with an added segment (base piece,
    # then added piece): then an id's column is found by search.
    contiguous = not n or int(col_ids[-1]) - first == n - 1

    def inside(rows: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if contiguous:
            m = (ids >= first) & (ids < first + n)
            return m, rows[m], ids[m] - first
        at = torch.searchsorted(col_ids, ids).clamp(max=n - 1)
        m = col_ids[at] == ids
        return m, rows[m], at[m]
    banned = torch.zeros_like(x, dtype=torch.bool)
    if meta.allow is not None:
        restricted, rows, ids = meta.allow
        banned |= restricted[:, None]
        _, r, c = inside(rows, ids)
        banned[r, c] = False
    if meta.bans is not None:
        _, r, c = inside(*meta.bans)
        banned[r, c] = True
    x = x.masked_fill(banned, float("-inf"))
    if meta.bias is not None:
        m, r, c = inside(meta.bias[0], meta.bias[1])
        if bool(m.any()):
            bias = torch.zeros_like(x)
            bias[r, c] = meta.bias[2][m]
            x = x + bias
    state = meta.state
    if state is not None and any(p.penalizes for p in meta.per_row):  # no state: no prompt, no output
        if contiguous:  # the state's columns of ids first .. first + n (``lo`` on the rank's own state)
            at0 = first - state.start
            counts = state.output_counts[:, at0 : at0 + n].to(x.device)
            seen = state.prompt_seen[:, at0 : at0 + n].to(x.device) | (counts > 0)
        else:  # a token-order state (it spans every id): read the block's ids
            at = (col_ids - state.start).to(state.output_counts.device)
            counts = state.output_counts[:, at].to(x.device)
            seen = state.prompt_seen[:, at].to(x.device) | (counts > 0)
        rep = torch.tensor([p.repetition_penalty for p in meta.per_row], dtype=torch.float32, device=x.device)[:, None]
        x = torch.where(seen & (rep != 1), torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([p.frequency_penalty for p in meta.per_row], dtype=torch.float32, device=x.device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in meta.per_row], dtype=torch.float32, device=x.device)[:, None]
        x = torch.where(freq != 0, x - freq * counts.to(torch.float32), x)
        x = torch.where(pres != 0, x - pres * (counts > 0).to(torch.float32), x)
    return x


def scale(x: torch.Tensor, col_ids: torch.Tensor, meta: Metadata) -> torch.Tensor:
    """Temperature (greedy rows keep their logits) and the vocab limit, on float32 columns (read only: an
    all-greedy batch without a vocab limit gets ``x`` itself back)."""
    if bool(meta.greedy.all()):  # every row keeps its logits: x itself, no [B, V] pass
        scaled = x
    else:
        divisor = torch.where(meta.greedy, torch.ones_like(meta.temps), meta.temps)
        scaled = torch.where(meta.greedy, x, x / divisor)
    if meta.vocab_limit is not None:
        scaled = scaled.masked_fill(col_ids[None, :] >= meta.vocab_limit, float("-inf"))
    return scaled


def min_p_keep(scaled: torch.Tensor, m: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Bool: the columns min-p keeps, ``exp(x - max) >= min_p`` (``m [B]`` the global max)."""
    return torch.exp(scaled - m[:, None]) >= min_p[:, None]


def race_scores(scaled: torch.Tensor, col_ids: torch.Tensor, meta: Metadata) -> torch.Tensor:
    """The Gumbel race's float64 scores: ``x + g(seed, step, id)`` on sampled rows, ``x`` on greedy
    ones, ``-inf`` kept (``col_ids``: ``[n]`` shared or ``[B, n]`` per row)."""
    score = scaled.to(torch.float64)
    sampled = meta.sampled
    if bool(sampled.any()):
        score = torch.where(sampled[:, None], score + noise.gumbel(meta.keys, col_ids), score)
    return score.masked_fill(torch.isneginf(scaled), float("-inf"))  # -inf + noise stays excluded


__all__ = ["Metadata", "column_ids", "min_p_keep", "process", "race_scores", "scale"]
