"""One beam-search step on the shards (TensorRT-LLM's): the best ``2 * beam_width`` continuations of
each request over all its beams, without gathering ``[B * W, V]``.

Each beam's scores are its global log-softmax (the vocab tree's log-sum-exp: bitwise at every tp)
plus the beam's cumulative score; each rank takes the best ``2W`` of its own ``[W, V_local]`` block per
request, and one all_gather merges them (score descending, then beam, then id ascending).
:class:`BeamSearch` keeps the loop's hypotheses as transformers does; ``generate`` with a ``beam_width`` runs
both, the KV cache reordered after each step (docs/sampling.md, "Beam search").
"""

from __future__ import annotations

from typing import Any

import torch

from trtvocab.errors import InputError
from trtvocab.parallel.sharding import Placement, VocabPlacement
from trtvocab.sampling.reductions import check_logits, gather_candidates, handshake, local_topk, own, sum_exp_and_picks


def beam_candidates(local_logits: torch.Tensor, head: Placement, beam_scores: torch.Tensor, beam_width: int,
                    k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores [B, k] float32, parent beams [B, k] int64, token ids [B, k] int64)``, best first
    (``k``: ``2W`` by default; transformers keeps ``max(2, 1 + n_eos) * W``).

    ``local_logits``: this rank's ``[B * W, V_local]`` logits, request-major (beam ``j`` of request
    ``b`` is row ``b * W + j``); ``beam_scores``: ``[B * W]`` cumulative log-probabilities (a request's
    first step: 0 for beam 0 and ``-inf`` for the others, so that its candidates are distinct).
    """
    what = "sampling.beam_candidates"
    head = VocabPlacement.of(head)
    error = check_logits(local_logits, head, what)
    if error is None:
        error = _beam_error(local_logits.shape[0], head.vocab_size, beam_scores, beam_width, what)
    k = 2 * beam_width if k is None else k
    if error is None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= beam_width * head.vocab_size):
        error = InputError(f"{what}: k must be an int in [1, beam_width * vocab_size], got {k!r}")
    pending = handshake(head, local_logits, error, "topk",
                        extra=-(1 << 40) - (beam_width << 20) - k if error is None else 0,
                        argument=beam_scores.to(torch.float32) if error is None else None).pending
    x = own(local_logits, head).to(torch.float32)
    _, lse, _ = sum_exp_and_picks(x, head, None, pending)
    total = x - lse[:, None] + beam_scores.to(torch.float32).to(x.device)[:, None]
    rows, n = total.shape
    w, vocab = beam_width, head.vocab_size
    flat = total.reshape(rows // w, w * n)  # column j * n + c: beam j, local column c
    k_local = min(k, flat.shape[1])
    vals = flat.new_empty(flat.shape[0], 0)
    keys = torch.empty(flat.shape[0], 0, dtype=torch.int64, device=x.device)
    if k_local:
        vals, cols = local_topk(flat, k_local)
        keys = (cols // n) * vocab + cols % n + head.vocab_start  # beam * V + global id: the tie order
    if head.is_split:
        vals, keys = gather_candidates(vals, keys, head, k)
    return vals.to(torch.float32), keys // vocab, keys % vocab


def _beam_error(rows: int, vocab: int, beam_scores: Any, beam_width: Any, what: str) -> InputError | None:
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1 or rows % beam_width:
        return InputError(f"{what}: beam_width must be an int >= 1 dividing the {rows} rows, got {beam_width!r}")
    if 2 * beam_width > beam_width * vocab:
        return InputError(f"{what}: beam_width {beam_width} needs a vocab of at least 2 ids")
    if not isinstance(beam_scores, torch.Tensor) or not beam_scores.dtype.is_floating_point \
            or list(beam_scores.shape) != [rows] or bool(torch.isnan(beam_scores).any()):
        got = f"{beam_scores.dtype} {list(beam_scores.shape)}" if isinstance(beam_scores, torch.Tensor) else \
            type(beam_scores).__name__
        return InputError(f"{what}: beam_scores must be a float [{rows}] tensor without NaN, got {got}")
    return None


class BeamSearch:
    """The host-side bookkeeping of greedy beam search, as transformers' ``_beam_search`` does it
    (``early_stopping=False``): running beams, the best ``W`` finished hypotheses per request (score
    ``sum log p / length ** length_penalty``), the early-stop heuristic. Every rank holds one and feeds
    it the same merged candidates (:func:`beam_candidates`), so every rank decides alike."""

    def __init__(self, batch: int, width: int, eos: set[int], max_new_tokens: int,
                 length_penalty: float = 1.0) -> None:
        self.width, self.eos, self.max_new, self.lp = width, set(eos), max_new_tokens, length_penalty
        self.k = max(2, 1 + len(self.eos)) * width
        self.running_scores = torch.full((batch, width), -1.0e9)
        self.running_scores[:, 0] = 0.0
        self.running: list[list[list[int]]] = [[[] for _ in range(width)] for _ in range(batch)]
        self.finished_scores = torch.full((batch, width), -1.0e9)
        self.finished: list[list[list[int]]] = [[[] for _ in range(width)] for _ in range(batch)]
        self.is_finished = torch.zeros(batch, width, dtype=torch.bool)
        self.unsatisfied = torch.ones(batch, 1, dtype=torch.bool)
        self.t = 0
        self.done = False

    def step(self, scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor) -> tuple[list[int], list[int]]:
        """Take one step's candidates ``[B, k]``; returns each new running beam's parent row (``b * W + j``,
        for the KV cache's reorder) and its token, flattened ``[B * W]``."""
        batch, w = self.running_scores.shape
        scores = scores.to(torch.float32).cpu()
        cands = [[self.running[b][int(parents[b, i])] + [int(tokens[b, i])] for i in range(self.k)]
                 for b in range(batch)]
        hits = torch.tensor([[c[-1] in self.eos or self.t + 1 >= self.max_new for c in row] for row in cands])
        run_idx = torch.topk(scores + hits.to(torch.float32) * -1.0e9, k=w)[1]
        self.running_scores = (scores + hits.to(torch.float32) * -1.0e9).gather(1, run_idx)
        self.running = [[cands[b][int(i)] for i in run_idx[b]] for b in range(batch)]
        top = torch.arange(self.k)[None, :] < w
        norm = scores / ((self.t + 1) ** self.lp)
        norm = norm + (~self.unsatisfied).to(torch.float32) * -1.0e9 + (~(hits & top)).to(torch.float32) * -1.0e9
        merged = torch.cat([self.finished_scores, norm], dim=1)
        keep = torch.topk(merged, k=w)[1]
        pool = [self.finished[b] + cands[b] for b in range(batch)]
        flags = torch.cat([self.is_finished, hits & top], dim=1)
        self.finished_scores, self.is_finished = merged.gather(1, keep), flags.gather(1, keep)
        self.finished = [[pool[b][int(i)] for i in keep[b]] for b in range(batch)]
        self.t += 1
        best = self.running_scores[:, :1] / (self.t ** self.lp)
        worst = torch.where(self.is_finished, self.finished_scores.min(dim=1, keepdim=True)[0], -1.0e9)
        self.unsatisfied &= (best > worst).any(dim=-1, keepdim=True)
        self.done = not (bool(self.unsatisfied.any()) and not bool(hits.all()))
        parent_rows = [b * w + int(parents[b, int(i)]) for b in range(batch) for i in run_idx[b]]
        return parent_rows, [self.running[b][j][-1] for b in range(batch) for j in range(w)]

    def best(self) -> list[list[int]]:
        """Each request's best finished hypothesis (its generated ids, an eos included)."""
        return [row[0] for row in self.finished]


__all__ = ["BeamSearch", "beam_candidates"]
