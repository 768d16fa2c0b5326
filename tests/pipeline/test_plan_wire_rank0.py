"""``plan``'s decode step for a head with ``gather_output="rank0"`` against the bytes a real run hands to
torch.distributed (as tests/pipeline/test_plan_wire.py does for the other modes): the forward's handshake,
the logits to rank 0 (chunked or not, uneven and padded), then rank 0's broadcast of ``[1 + B]`` int64 (a
status word, the ids) and of the logprobs when asked; every call the same (no agreement rides on a gather
to one rank). One launch of 3 gloo ranks, tp 2 and 3, three steps each."""

from __future__ import annotations

import pytest

from tests.sampling.rank0_rank_fns import HIDDEN, PARAMS, ROWS, VOCAB, WIRE, rank0_wire_cases
from trtvocab.parallel.launch import run_ranks
from trtvocab.pipeline.plan import Sampler, make_plan

pytestmark = pytest.mark.ranks


def _sampler(params: object) -> Sampler:
    rows = params if isinstance(params, list) else [params]
    asked = [p.logprobs for p in rows if p.logprobs is not None]
    return Sampler(logprobs=max(asked) if asked else None)


def test_rank0_decode_sends_what_plan_prices() -> None:
    measured = run_ranks(rank0_wire_cases, 3, 5, timeout_s=120)
    for tp in (2, 3):
        for name, chunk, layout in WIRE:
            plan = make_plan(VOCAB, HIDDEN, tp, ROWS, layout, 64, gather_output="rank0", gather_chunk_rows=chunk,
                             sampler=_sampler(PARAMS[name]), logits_bytes=4)
            step = plan.decode_step
            assert step is not None and step.first == step.steady
            want = [(c.kind, c.bytes) for c in step.steady]
            assert want[-1][0] == "broadcast"
            for rank in range(tp):
                for call in measured[rank][f"tp={tp} {name} {chunk} {layout}"]:
                    assert [tuple(e) for e in call] == want, (tp, rank, name, chunk, layout, call, want)
