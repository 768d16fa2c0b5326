"""One beam-search step on the shards (TensorRT-LLM's): the best ``2 * beam_width`` continuations of
each request over all its beams, without gathering ``[B * W, V]``.

Each beam's scores are its global log-softmax (the vocab tree's log-sum-exp: bitwise at every tp)
plus the beam's cumulative score; each rank takes the best ``2W`` of its own ``[W, V_local]`` block per
request, and one all_gather merges them (score descending, then beam, then id ascending). The loop
around it (finished hypotheses, length penalty, early stop, the KV cache's reorder) is the caller's:
``generate`` has no beam search yet (docs/sampling.md).
"""

from __future__ import annotations

from typing import Any

import torch

from trtvocab.errors import InputError
from trtvocab.sampling.reductions import check_logits, gather_candidates, handshake, local_topk, own, sum_exp_and_picks


def beam_candidates(local_logits: torch.Tensor, head: Any, beam_scores: torch.Tensor,
                    beam_width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores [B, 2W] float32, parent beams [B, 2W] int64, token ids [B, 2W] int64)``, best first.

    ``local_logits``: this rank's ``[B * W, V_local]`` logits, request-major (beam ``j`` of request
    ``b`` is row ``b * W + j``); ``beam_scores``: ``[B * W]`` cumulative log-probabilities (a request's
    first step: 0 for beam 0 and ``-inf`` for the others, so that its candidates are distinct).
    """
    what = "sampling.beam_candidates"
    error = check_logits(local_logits, head, what)
    if error is None:
        error = _beam_error(local_logits.shape[0], head.vocab_size, beam_scores, beam_width, what)
    handshake(head, local_logits, error, "topk", extra=-(1 << 40) - beam_width if error is None else 0,
              argument=beam_scores.to(torch.float32) if error is None else None)
    x = own(local_logits, head).to(torch.float32)
    _, lse, _ = sum_exp_and_picks(x, head, None)
    total = x - lse[:, None] + beam_scores.to(torch.float32).to(x.device)[:, None]
    rows, n = total.shape
    w, vocab = beam_width, head.vocab_size
    k = 2 * w
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


__all__ = ["beam_candidates"]
