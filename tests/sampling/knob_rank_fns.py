"""Per-rank bodies of the sampling-knob tests (spawned processes import this module).

A decode loop of :data:`STEPS` steps over synthetic logits that depend only on ``(step, row)`` (so the
test process recomputes them on one device), every row a different knob, run at every (tp, layout) of
:data:`SPLITS`; and a real deterministic head decoded with a per-rank ``TokenState``, materialized and
streamed (a tiny logits budget), which must give the same tokens and logprobs.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel.rank_fns import subgroups
from trtvocab import LMHead, Mapping
from trtvocab.sampling import SamplingParams, TokenState, chunked, decode_output, prompt_logprobs, sample_output
from trtvocab.sampling.beam import beam_candidates

VOCAB = 1009
STEPS = 6
EOS, STOP = 7, 9
SPLITS = [(1, "uneven"), (2, "uneven"), (3, "uneven"), (4, "padded")]
PROMPTS = [[200, 201, 3], [5, 6], [1], [2], [3], [4], [4], [8], [200], [200, 11], [12], [13]]


def rows() -> list[SamplingParams]:
    """One knob per row (greedy unless a seed is set)."""
    return [
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(temperature=0.0, logit_bias={5: 8.0, 17: -100.0, 900: 3.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[*range(300, 340), 1000]),
        SamplingParams(temperature=0.0, bad_words=[[100, 101], [103], [555, 556, 557]]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[STOP]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[STOP], ignore_eos=True),
        SamplingParams(temperature=1.0, typical_p=0.5, seed=3),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.3, logprobs=5,
                       logprobs_mode="processed_logprobs", seed=4),
        SamplingParams(temperature=1.3, top_p=0.9, min_p=0.02, typical_p=0.8, presence_penalty=-0.5, seed=5),
        SamplingParams(temperature=0.0, logprobs=0, logprobs_mode="processed_logits", frequency_penalty=2.0),
    ]


def step_logits(step: int) -> torch.Tensor:
    """float32 ``[B, V]``: random logits plus boosts that make each knob matter."""
    b = len(PROMPTS)
    g = torch.randn(b, VOCAB, generator=torch.Generator().manual_seed(1000 + step)) * 2
    g[0:2, 200] += 9.0  # repeated unless penalized
    g[9, 200] += 9.0
    g[11, 50 + step % 2] += 9.0
    g[4, 100 + step] += 20.0  # greedy would write 100, 101, 102, ...: bad words cut it
    g[4, 103] += 19.0
    g[5:7, EOS] += 30.0
    g[5:7, STOP] += 29.0
    return g


def beam_scores() -> torch.Tensor:
    """``[12]``: 3 requests x 4 beams of cumulative scores (request 0 at its first step: 0, -inf, ...)."""
    scores = -torch.rand(12, generator=torch.Generator().manual_seed(5)) * 3
    scores[1:4] = float("-inf")
    return scores


def local(g: torch.Tensor, head: LMHead) -> torch.Tensor:
    s = head.shard
    out = torch.full((g.shape[0], s.width), float("-inf"))
    out[:, : s.size] = g[:, s.start : s.end]
    return out


def knob_cases(rank: int, world: int) -> list[dict[str, Any]]:
    """Every (tp, layout) of SPLITS on ranks ``[0, tp)``: the loop's ids and logprobs (rank 0's), and
    the real-head loop materialized and streamed."""
    groups = subgroups(world)
    out: list[dict[str, Any]] = []
    for tp, layout in SPLITS:
        if rank >= tp:
            continue
        mapping = Mapping(world_size=tp, rank=rank, tp_size=tp) if tp > 1 else None
        head = LMHead(VOCAB, 16, dtype=torch.float32, mapping=mapping, vocab_layout=layout, pad_to=16,
                      process_group=groups.get(tp), deterministic=True, gather_output=False)
        state = TokenState.for_head(head, PROMPTS, eos_token_ids=[EOS])
        ids, lps = [], []
        for step in range(STEPS):
            res = sample_output(local(step_logits(step), head), head, rows(), step=step, state=state)
            state.append(res.token_ids)
            ids.append(res.token_ids.tolist())
            assert res.logprobs is not None
            lps.append({"ids": res.logprobs.ids.tolist(), "values": res.logprobs.values.tolist(),
                        "ranks": res.logprobs.ranks.tolist()})
        scores, parents, tokens = beam_candidates(local(step_logits(0), head), head, beam_scores(), 4)
        beams = {"scores": scores.tolist(), "parents": parents.tolist(), "tokens": tokens.tolist()}
        out.append({"case": f"tp={tp} {layout}", "ids": ids, "logprobs": lps, "streamed": _streamed(head),
                    "beams": beams})
    return out


def _streamed(head: LMHead) -> dict[str, Any]:
    """A real deterministic head decoded 4 steps with a TokenState: materialized vs streamed."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(VOCAB, 16, generator=gen)
    table = torch.randn(VOCAB, 16, generator=gen)
    head.load_weights({"weight": w})
    params = [p.model_copy(update={"logprobs": None}) if i % 2 else p for i, p in enumerate(rows())]
    runs = {}
    for name, budget in (("materialized", 1 << 30), ("streamed", 4096)):
        head.logits_budget_bytes = budget
        state = TokenState.for_head(head, PROMPTS, eos_token_ids=[EOS])
        prev = torch.tensor([p[-1] for p in PROMPTS])
        got = []
        for step in range(4):
            res = decode_output(table[prev], head, params, step=step, state=state)
            state.append(res.token_ids)
            prev = res.token_ids
            assert res.logprobs is not None
            got.append((res.token_ids.tolist(), res.logprobs.ids.tolist(), res.logprobs.values.tolist()))
        runs[name] = got
    prompt = {}  # prompt logprobs of 40 positions: materialized, and streamed 97 columns at a time
    hidden = torch.randn(40, 16, generator=gen)
    nexts = torch.randint(0, VOCAB, (40,), generator=gen)
    for name, lp in (("materialized", prompt_logprobs(head.local_logits(hidden), head, nexts, 4)),
                     ("streamed", chunked.stream_prompt_logprobs(hidden, head, nexts, 4, chunk=97))):
        prompt[name] = {"ids": lp.ids.tolist(), "values": lp.values.tolist(), "ranks": lp.ranks.tolist()}
    return {"equal": runs["materialized"] == runs["streamed"], "ids": [g[0] for g in runs["materialized"]],
            "prompt": prompt}
