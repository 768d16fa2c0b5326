"""Rank functions of tests/pipeline/test_generate_head_groups.py (run_ranks forks ranks that import them):
:meth:`BodyRows.exchange` on real gloo ranks, each head group's draws made up here so the test knows them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trtvocab.errors import DistributedError
from trtvocab.pipeline.generate import rank_blocks
from trtvocab.pipeline.generate.loop import BodyRows
from trtvocab.sampling import Logprobs, SamplerOutput, SamplingParams

# (batch, bodies, head_tp, the active rows, each row's logprobs (None: not asked)) on a world of 4.
CASES = {
    "2x2 all rows, logprobs in both groups": (5, 2, 2, [0, 1, 2, 3, 4], [2, None, None, 0, 4]),
    "2x2 group 0 done, no logprobs": (4, 2, 2, [2, 3], [None] * 4),
    "4x1 two idle groups, logprobs in one": (3, 2, 1, [0, 1, 2], [None, None, 1]),
    "4x1 rows in three groups": (6, 3, 1, [0, 2, 3, 5], [1, None, None, None, 0, 3]),
}


def drawn(row: int) -> int:
    """The id a group draws for ``row`` in these cases."""
    return 1000 + 7 * row


def group_logprobs(rows: list[int], asked: list[int | None]) -> Logprobs | None:
    """What a head group's sampler returns for ``rows``: ``[b, 1 + n]`` (n: the widest its rows ask),
    made-up values, -1 / -inf / 0 in the slots a row did not ask for."""
    width = max((asked[b] + 1 for b in rows if asked[b] is not None), default=0)
    if not width:
        return None
    ids = torch.full((len(rows), width), -1, dtype=torch.int64)
    values = torch.full((len(rows), width), float("-inf"), dtype=torch.float32)
    ranks = torch.zeros((len(rows), width), dtype=torch.int64)
    for j, b in enumerate(rows):
        n = asked[b]
        if n is not None:
            ids[j, : n + 1] = torch.arange(n + 1) + 10 * b
            values[j, : n + 1] = -0.1 * (torch.arange(n + 1) + 1) - b / 3
            ranks[j, : n + 1] = torch.arange(n + 1) + 1
    return Logprobs(ids, values, ranks)


def exchange_cases(rank: int, world: int) -> dict[str, Any]:
    """Per case: the ids and logprobs the exchange gave this rank, and the (kind, bytes) of every collective
    it handed to torch.distributed; then a rank whose own draw differs from its group's first rank's."""
    sent: list[tuple[str, int]] = []
    real = dist.all_gather

    def counted(out: Any, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        sent.append(("all_gather", tensor.numel() * tensor.element_size()))
        return real(out, tensor, group=group, async_op=async_op)

    dist.all_gather = counted
    results: dict[str, Any] = {}
    try:
        for name, (batch, bodies, head_tp, active, asked) in CASES.items():
            blocks = rank_blocks(batch, world, bodies, head_tp)
            rows = BodyRows(True, *blocks[rank], blocks, 8, rank, head_tp, None)
            mine = rows.own(active)
            out = SamplerOutput(torch.tensor([drawn(b) for b in mine], dtype=torch.int64),
                                group_logprobs(mine, asked)) if mine else None
            params = [SamplingParams(temperature=0.0, logprobs=asked[b]) for b in active]
            sent.clear()
            got = rows.exchange(out, active, params)
            lp = got.logprobs
            results[name] = {"ids": got.token_ids.tolist(), "sent": list(sent), "mine": mine,
                             "logprobs": None if lp is None else (lp.ids.tolist(), lp.values.tolist(),
                                                                  lp.ranks.tolist())}
        blocks = rank_blocks(4, world, 2, 2)
        rows = BodyRows(True, *blocks[rank], blocks, 8, rank, 2, None)
        mine = rows.own([0, 1, 2, 3])
        ids = [drawn(b) + (rank == 1) for b in mine]  # rank 1 drew otherwise than rank 0, its group's first
        try:
            rows.exchange(SamplerOutput(torch.tensor(ids)), [0, 1, 2, 3], [SamplingParams()] * 4)
            results["mismatch"] = None
        except DistributedError as exc:
            results["mismatch"] = str(exc)
    finally:
        dist.all_gather = real
    return results
