"""``gather_output="rank0"`` with sampling (docs/architecture.md, "Gather strategies"): rank 0 of the head's
group gathers the ``[B, V]`` logits, samples them and broadcasts the ids, so every rank returns them.

One launch of 3 gloo ranks runs tp 2 (uneven: 501 + 500 columns) and tp 3 (and both layouts at each,
padded 64-wide pieces included). For greedy, seeded, top-k, top-p, min-p, logprobs, per-row params and
penalties with a state, over three steps: the ids (and the logprobs, bits included) every rank returns equal
the same step on the shards (``gather_output=True``, the gather-free sampler) and, for a deterministic head,
a replicated head's (tp 1): independent references, neither through the rank-0 path. A bitmask with a
vocab limit too. A bad input on one rank, a row only rank 0 can find unsampleable, params wrong on one rank
and a shard state on rank 0 raise a typed error on the rank that failed and PeerRankError on the others,
and the group works afterwards. A head with an added segment (an adapter that adds tokens) gives the
token-order path's ids and logprobs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.sampling.rank0_rank_fns import PARAMS, rank0_added_cases, rank0_cases
from tests.sampling.test_lora_added_vocab import EMB, HEAD, _adapter
from trtvocab import LMHead
from trtvocab.parallel.launch import run_ranks
from trtvocab.sampling import SamplingParams, decode_output
from trtvocab.sampling.rank0 import gathers_to_rank0

CASES_PER_TP = 2 * (3 * len(PARAMS) + 1)  # 2 layouts x (3 heads x params + the bitmask case)
FAILURES = {  # case -> (what the failing rank raises, which rank fails)
    "nan hidden on rank 1": ("InputError", 1),
    "no allowed token": ("InputError", 0),
    "params wrong on rank 1": ("InputError", 1),
    "shard state": ("InputError", 0),
}


@pytest.fixture(scope="module")
def records() -> list[list[dict]]:
    return run_ranks(rank0_cases, 3, 5, timeout_s=240)


@pytest.mark.ranks
@pytest.mark.parametrize("tp", [2, 3])
def test_rank0_sampling_gives_every_rank_the_ids_of_the_shards_and_of_tp1(records: list[list[dict]],
                                                                          tp: int) -> None:
    failures = []
    per_rank = [[r for r in records[rank] if r["tp"] == tp and not r.get("failure")] for rank in range(tp)]
    for rank, recs in enumerate(per_rank):
        assert len(recs) == CASES_PER_TP
        for rec in recs:
            if not rec["shards"]:
                failures.append(f"rank {rank} {rec['case']}: not the gather-free path's ids")
            if rec["single"] is False:
                failures.append(f"rank {rank} {rec['case']}: not tp 1's ids")
    for case in zip(*per_rank, strict=True):  # every rank returns the same ids
        if len({str(rec["ids"]) for rec in case}) != 1:
            failures.append(f"{case[0]['case']}: ranks return different ids")
    assert not failures, "\n".join(failures)


@pytest.mark.ranks
@pytest.mark.parametrize("tp", [2, 3])
def test_a_failure_on_any_rank_raises_everywhere_and_the_group_goes_on(records: list[list[dict]], tp: int) -> None:
    for rank in range(tp):
        got = {r["case"].split(" ", 1)[1]: r for r in records[rank] if r["tp"] == tp and r.get("failure")}
        for name, (error, bad) in FAILURES.items():
            want = error if rank == bad else "PeerRankError"
            assert got[name]["error"] == want, (tp, rank, name, got[name])
        assert "whole vocabulary" in got["shard state"]["message"] or rank != 0
        assert got["a good call after the failures"]["error"] == "ok", got["a good call after the failures"]


@pytest.mark.ranks
def test_rank0_sampling_with_added_tokens_is_the_token_order_paths(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    rows = {EMB: torch.randn(53, 16, generator=gen), HEAD: torch.randn(53, 16, generator=gen)}  # 3 added tokens
    folder = _adapter(tmp_path / "add", rows)
    for rank, rec in enumerate(run_ranks(rank0_added_cases, 2, str(folder), timeout_s=120)):
        assert all(rec.values()), (rank, rec)


def test_only_a_split_rank0_head_takes_the_rank0_path() -> None:
    # tp 1: the forward returns [N, V] everywhere; the step is the ordinary one (no collective)
    head = LMHead(50, 8, dtype=torch.float32, gather_output="rank0")
    head.load_weights({"lm_head.weight": torch.randn(50, 8, generator=torch.Generator().manual_seed(0))})
    assert not gathers_to_rank0(head)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    ids = decode_output(x, head, SamplingParams(temperature=0.0)).token_ids
    assert torch.equal(ids, (x.double() @ head.weights.weight.double().t()).argmax(dim=1))
