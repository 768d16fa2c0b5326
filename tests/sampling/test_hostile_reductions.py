"""Values that must match on every rank (the handshake of ``trtvocab/sampling/reductions.py``): a top_p /
min_p value, logprobs token ids or the head's mapping that differs between ranks is a RankMismatchError
on every rank naming the field, and the group still works after it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.hostile import TP, H, V
from trtvocab.errors import RankMismatchError


def cross_rank_cases(rank: int, world: int) -> dict[str, tuple[str, str]]:
    from trtvocab import LMHead, Mapping, sampling

    def catch(fn: Any) -> tuple[str, str]:
        try:
            fn()
            return ("ok", "")
        except Exception as exc:
            return (type(exc).__name__, str(exc))

    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(V, H, generator=gen), torch.randn(3, H, generator=gen)
    head = LMHead(V, H, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    head.load_weights({"weight": w})
    local = head.local_logits(x)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6 if rank == 0 else 7]])
    adp = rank == 0  # rank 0 built with attention DP + LM-head TP, rank 1 plain TP: both split
    mixed = LMHead(V, H, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world,
                                                              enable_attention_dp=adp, enable_lm_head_tp_in_adp=adp))
    mixed.load_weights({"weight": w})
    return {
        "top_p equal": catch(lambda: sampling.top_p_mask(local, head, 0.9)),
        "top_p differs": catch(lambda: sampling.top_p_mask(local, head, 0.9 if rank == 0 else 0.5)),
        "top_p [B] differs": catch(lambda: sampling.top_p_mask(local, head, torch.tensor([0.9, 0.8, 0.7 + rank / 10]))),
        "min_p differs": catch(lambda: sampling.min_p_mask(local, head, 0.1 if rank == 0 else 0.2)),
        "logprobs ids differ": catch(lambda: sampling.logprobs(local, head, ids)),
        "mapping differs": catch(lambda: mixed(x)),
        "after the mismatches": catch(lambda: sampling.greedy(local, head)),  # the group still works
    }


@pytest.fixture(scope="module")
def cross_rank() -> list[dict[str, tuple[str, str]]]:
    from trtvocab.parallel.launch import run_ranks

    return run_ranks(cross_rank_cases, TP, timeout_s=60)


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, field", [
    ("top_p differs", "argument digest"), ("top_p [B] differs", "argument digest"),
    ("min_p differs", "argument digest"), ("logprobs ids differ", "argument digest"),
    ("mapping differs", "ranks disagree on mapping: ['attention DP + LM-head TP', 'tensor parallel']"),
])
def test_values_that_must_match_across_ranks_are_compared(cross_rank, case: str, field: str) -> None:
    for rank in range(TP):
        kind, text = cross_rank[rank][case]
        assert kind == RankMismatchError.__name__ and field in text, (rank, kind, text)


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_equal_values_pass_the_handshake(cross_rank) -> None:
    for rank in range(TP):
        assert cross_rank[rank]["top_p equal"] == ("ok", "")
        assert cross_rank[rank]["after the mismatches"] == ("ok", "")
