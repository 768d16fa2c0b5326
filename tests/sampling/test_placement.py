"""``VocabPlacement``: what ``trtvocab.sampling`` reads instead of a head.

* ``vocab_placement`` places a rank's columns as the head does (uneven and padded, tp 1-4), and
  ``LMHead.placement`` shares the head's handshake state.
* Every public sampler gives bitwise the same result with the head or with a placement built
  from the split alone (no weights): seeded tokens, logprobs, greedy, top-k, prompt logprobs,
  a bitmask, beam candidates; the reference is the head itself.
* Anything else is refused with a ``ConfigError`` naming its type.
"""

from __future__ import annotations

import pytest
import torch

from trtvocab import LMHead, Mapping, sampling
from trtvocab.errors import ConfigError
from trtvocab.parallel.sharding import VocabPlacement, vocab_placement
from trtvocab.sampling import SamplingParams, TokenState
from trtvocab.sampling.beam import beam_candidates

VOCAB, HIDDEN = 1009, 64


@pytest.mark.parametrize("layout", ["uneven", "padded"])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_placement_places_columns_as_the_head(tp: int, layout: str) -> None:
    for rank in range(tp):
        mapping = Mapping(world_size=tp, rank=rank, tp_size=tp) if tp > 1 else None
        head = LMHead(VOCAB, HIDDEN, dtype=torch.float32, mapping=mapping, vocab_layout=layout, pad_to=16)
        place = vocab_placement(VOCAB, tp, rank, layout, 16)
        got = head.placement
        assert (got.shard, got.shards, got.pad_to, got.is_split) == (place.shard, place.shards, 16, tp > 1)
        assert got.handshake_state is head.handshake_state  # one agreement per head, whichever is passed
        assert (place.vocab_start, place.vocab_end, place.tp_size, place.tp_rank) == \
            (head.vocab_start, head.vocab_end, head.tp_size, head.tp_rank)


def test_every_sampler_gives_the_same_result_with_a_placement() -> None:
    head = LMHead(VOCAB, HIDDEN, dtype=torch.float32, gather_output=False)
    with torch.no_grad():
        head.weights.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(0))
    place = vocab_placement(VOCAB, 1, 0)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1))
    logits = head.local_logits(x)
    params = [SamplingParams(temperature=0.8, seed=1, top_p=0.9, logprobs=3),
              SamplingParams(temperature=1.0, seed=2, top_k=20, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=0.0, logit_bias={5: 3.0}, logprobs=2, logprobs_mode="processed_logprobs"),
              SamplingParams(temperature=1.1, seed=3, typical_p=0.8, min_p=0.05, bad_words=[[7, 8]])]
    prompts = [[1, 2, 3, 7], [4, 4, 9], [5], [8, 7, 8]]
    a = sampling.sample_output(logits, head, params, step=3, state=TokenState.for_head(head, prompts))
    b = sampling.sample_output(logits, place, params, step=3, state=TokenState.for_head(place, prompts))
    assert torch.equal(a.token_ids, b.token_ids)
    assert a.logprobs is not None and b.logprobs is not None
    for f in ("ids", "values", "ranks"):
        assert torch.equal(getattr(a.logprobs, f), getattr(b.logprobs, f)), f
    assert torch.equal(sampling.greedy(logits, head), sampling.greedy(logits, place))
    assert all(torch.equal(u, v) for u, v in zip(sampling.topk(logits, head, 7), sampling.topk(logits, place, 7),
                                                 strict=True))
    ids = torch.tensor([3, 1, 4, 1])
    pa, pb = sampling.prompt_logprobs(logits, head, ids, 2), sampling.prompt_logprobs(logits, place, ids, 2)
    assert torch.equal(pa.values, pb.values) and torch.equal(pa.ids, pb.ids)
    mask = torch.full((4, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    mask[:, 0] = 0
    assert torch.equal(sampling.apply_token_bitmask(logits.clone(), mask, head),
                       sampling.apply_token_bitmask(logits.clone(), mask, place))
    scores = torch.tensor([0.0, -1.0, -0.5, -2.0])
    assert all(torch.equal(u, v) for u, v in zip(beam_candidates(logits, head, scores, 2),
                                                 beam_candidates(logits, place, scores, 2), strict=True))


def test_anything_else_is_refused_naming_its_type() -> None:
    logits = torch.zeros(1, VOCAB)
    with pytest.raises(ConfigError, match="got dict"):
        sampling.sample(logits, {}, SamplingParams())
    with pytest.raises(ConfigError, match="got str"):
        VocabPlacement.of("head")
