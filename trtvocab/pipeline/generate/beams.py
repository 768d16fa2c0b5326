"""Greedy beam search of every prompt (``GenerateSpec.beam_width`` beams each, as transformers' ``num_beams``)."""

from __future__ import annotations

import time
from typing import Any

import torch

from trtvocab.pipeline.decode import VocabEnds
from trtvocab.pipeline.generate.model import Body, ModelFacts
from trtvocab.pipeline.generate.options import GenerateSpec
from trtvocab.pipeline.generate.report import RankOutput
from trtvocab.sampling.beam import BeamSearch, beam_candidates


def decode_beams(spec: GenerateSpec, model: Any, ends: VocabEnds, facts: ModelFacts) -> RankOutput:
    """The body on ``B * W`` rows, :func:`~trtvocab.sampling.beam.beam_candidates` on the shards, the
    bookkeeping of :class:`~trtvocab.sampling.beam.BeamSearch`, the KV cache reordered after each step."""

    w, batch = spec.beam_width, len(spec.prompt_ids)
    body = Body(model, body_kernels=spec.body_kernels)
    longest = max(len(p) for p in spec.prompt_ids)
    ids = torch.full((batch, longest), facts.pad, dtype=torch.int64)
    mask = torch.zeros((batch, longest), dtype=torch.int64)
    for b, p in enumerate(spec.prompt_ids):
        ids[b, longest - len(p):] = torch.tensor(p, dtype=torch.int64)
        mask[b, longest - len(p):] = 1
    ids, mask = ids.repeat_interleave(w, 0), mask.repeat_interleave(w, 0)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    padded = not bool(mask.all())
    search = BeamSearch(batch, w, set(facts.eos), spec.max_new_tokens)
    start = time.perf_counter()
    prefill_s = 0.0
    with torch.inference_mode():
        hidden = body(ends.embed(ids), mask if padded else None, positions)
        while True:
            logits = ends.local_logits(hidden[:, -1, :])
            scores, parents, tokens = beam_candidates(logits, ends.placement, search.running_scores.reshape(-1), w,
                                                      k=search.k)
            rows, feed = search.step(scores, parents, tokens)
            if prefill_s == 0.0:
                prefill_s = time.perf_counter() - start
            if search.done:
                break
            body.cache.reorder_cache(torch.tensor(rows, dtype=torch.int64))
            mask = torch.cat([mask, torch.ones((batch * w, 1), dtype=torch.int64)], dim=-1)
            positions = positions[:, -1:] + 1
            hidden = body(ends.embed(torch.tensor(feed, dtype=torch.int64)[:, None]), mask if padded else None,
                          positions)
    decode_s = time.perf_counter() - start - prefill_s
    return RankOutput(search.best(), [[] for _ in range(batch)], [None] * batch, sorted(ends.ran_on), prefill_s,
                      decode_s, ends.deterministic)


__all__ = ["decode_beams"]
