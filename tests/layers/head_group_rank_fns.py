"""Rank functions of tests/layers/test_head_groups.py: an LM head split over a group of its own
(``Mapping.lm_head_tp_size``), with real gloo groups, against the replicated head (tp 1).

Every arrangement returns per-rank records: the logits each rank gets back (a deterministic head: bitwise
the replicated head's on the same rows) and the greedy and seeded ids of ``trtvocab.sampling.decode``,
``trtvocab.sampling.DecodeStep`` and ``sampling.sample`` on ``forward``'s un-gathered columns (each
equal to the replicated head's ids for the same rows and params). The test makes the assertions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.parallel.rank_fns import catch, hidden_states, weights
from tests.parallel.wire_counter import count_collectives
from trtvocab import LMHead, Mapping, sampling
from trtvocab.parallel import distributed as D
from trtvocab.sampling import DecodeStep, SamplingParams

VOCAB = 1001  # 7 * 11 * 13: uneven over 2, 4 and 8 ranks
HIDDEN = 16
ROWS = 12  # the batch of the whole world (every arrangement takes its rows from it)
STEPS = 2
WIRE_ROWS = (3, 0, 5, 2)  # rows each rank brings in the wire count (group {2, 3} brings the most)


def params_list(rows: int, seeded: bool) -> list[SamplingParams]:
    """Greedy, or seeded sampling with a seed per row (tokens keyed by (seed, step, id): tp-invariant)."""
    if not seeded:
        return [SamplingParams(temperature=0.0)] * rows
    return [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=100 + r) for r in range(rows)]


def _head(mapping: Mapping | None, gather_output: bool | str = True, group: Any = None) -> LMHead:
    head = LMHead(VOCAB, HIDDEN, dtype=torch.float32, mapping=mapping, deterministic=True,
                  gather_output=gather_output, process_group=group)
    head.load_weights({"lm_head.weight": weights(VOCAB, HIDDEN, 3)})
    return head


def reference(rows: list[int]) -> dict[str, Any]:
    """The replicated head's logits and ids for the world's rows ``rows`` (global row indices)."""
    x = hidden_states(ROWS, HIDDEN, 5)[rows]
    head = _head(None)
    if not rows:  # a rank that brings no rows gets none back
        return {"logits": torch.zeros(0, VOCAB), **{f"ids seeded={s}": [[]] * STEPS for s in (False, True)}}
    out: dict[str, Any] = {"logits": head(x)}
    for seeded in (False, True):
        p = [params_list(ROWS, seeded)[r] for r in rows]
        out[f"ids seeded={seeded}"] = [sampling.decode(x, head, p, step=s).tolist() for s in range(STEPS)]
    return out


def _ids(head: LMHead, x: torch.Tensor, rows: list[int], how: str) -> dict[str, list[list[int]]]:
    """Greedy and seeded ids of ``x`` (the rows every rank of ``head``'s group holds) by ``how``."""
    out = {}
    for seeded in (False, True):
        p = [params_list(ROWS, seeded)[r] for r in rows]
        if how == "decode":
            out[f"ids seeded={seeded}"] = [sampling.decode(x, head, p, step=s).tolist() for s in range(STEPS)]
        else:
            step = DecodeStep(head, p)
            out[f"ids seeded={seeded}"] = [step(x).tolist() for _ in range(STEPS)]
    return out


def same_rows(rank: int, world: int, tp: int, head_tp: int) -> list[dict[str, Any]]:
    """Without attention DP: TP groups of ``tp`` ranks hold the same rows (group g: rows g, g + world/tp, ...),
    the head split over groups of ``head_tp`` inside them."""
    mapping = Mapping(world_size=world, rank=rank, tp_size=tp, lm_head_tp_size=head_tp)
    groups = world // tp
    rows = list(range(rank // tp, ROWS, groups))
    x = hidden_states(ROWS, HIDDEN, 5)[rows]
    head = _head(mapping)
    rec: dict[str, Any] = {"rank": rank, "rows": rows, "logits": head(x), "group": mapping.lm_head_tp_group,
                           "tp": head.tp_size, "placement group size": D.group_size(head.placement.process_group)}
    rec["decode"] = _ids(head, x, rows, "decode")
    rec["step"] = _ids(head, x, rows, "step")
    return [rec]


def own_rows(rank: int, world: int, tp: int, head_tp: int, counts: tuple[int, ...],
             owner: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
    """Attention DP + LM-head TP: rank r brings ``counts[r]`` rows of its own (``owner[r]``: the rank whose
    requests it holds, for ranks of one attention-TP group holding the same ones; default itself); the head
    is split over groups of ``head_tp``. Each rank: ``forward``'s logits of its rows, the ids of every row
    of its head group from ``sample`` on the un-gathered columns, and from ``decode`` / ``DecodeStep`` on the
    group's rows gathered by the caller."""
    owner = owner or tuple(range(world))
    start: dict[int, int] = {}  # each block of requests: its first row (blocks in owner order)
    for o in sorted(set(owner)):
        start[o] = sum(max(counts[r] for r in range(world) if owner[r] == p) for p in start)
    mine = list(range(start[owner[rank]], start[owner[rank]] + counts[rank]))
    mapping = Mapping(world_size=world, rank=rank, tp_size=tp, enable_attention_dp=True,
                      enable_lm_head_tp_in_adp=True, lm_head_tp_size=head_tp)
    x_all = hidden_states(ROWS, HIDDEN, 5)
    x = x_all[mine]
    head = _head(mapping)
    group = mapping.lm_head_tp_group
    group_rows = [r for g in group for r in range(start[owner[g]], start[owner[g]] + counts[g])]
    rec: dict[str, Any] = {"rank": rank, "rows": mine, "group rows": group_rows, "logits": head(x),
                           "tp": head.tp_size}
    local = _head(mapping, gather_output=False)
    for seeded in (False, True):
        p = [params_list(ROWS, seeded)[r] for r in group_rows]
        cols = [local(x) for _ in range(STEPS)]
        rec[f"sample seeded={seeded}"] = [sampling.sample(c, local, p, step=s).tolist() for s, c in enumerate(cols)]
    gathered = D.all_gather_rows(x, [counts[g] for g in group], head.process_group)
    rec["decode"] = _ids(local, gathered, group_rows, "decode")
    rec["step"] = _ids(local, gathered, group_rows, "step")
    return [rec]


def mismatch(rank: int, world: int) -> list[dict[str, Any]]:
    """Ranks 0 and 1 in one group of 2, built for other arrangements (rank 0: world 4 as 2 head groups;
    rank 1: one group of 2, the group given): every rank of the group raises naming the field. Ranks 2, 3
    only make the groups."""
    pair = D.lm_head_group(Mapping(world_size=world, rank=rank, tp_size=world, enable_attention_dp=True,
                                   enable_lm_head_tp_in_adp=True, lm_head_tp_size=2))
    if rank > 1:
        return [{"rank": rank}]
    if rank == 0:
        mapping = Mapping(world_size=4, rank=0, tp_size=4, lm_head_tp_size=2)
    else:
        mapping = Mapping(world_size=2, rank=1, tp_size=2)
    head = _head(mapping, group=pair)
    kind, message = catch(lambda: head(hidden_states(2, HIDDEN, 5)))
    return [{"rank": rank, "error": kind, "message": message}]


def wire(rank: int, world: int) -> list[dict[str, Any]]:
    """The bytes every collective takes (:func:`tests.parallel.wire_counter.count_collectives`), call by call,
    for ``plan --tp 4 --lm-head-tp 2`` to price: attention DP's forward over 2 head groups of 2 (rows
    ``WIRE_ROWS``) and a greedy decode step on the group's gathered rows."""
    mapping = Mapping(world_size=world, rank=rank, tp_size=world, enable_attention_dp=True,
                      enable_lm_head_tp_in_adp=True, lm_head_tp_size=2)
    head = _head(mapping)
    local = _head(mapping, gather_output=False)
    x = hidden_states(WIRE_ROWS[rank], HIDDEN, 9)
    counts = [WIRE_ROWS[g] for g in mapping.lm_head_tp_group]
    gathered = D.all_gather_rows(x, counts, head.process_group)
    greedy = params_list(len(gathered), False)
    forward, decode = [], []
    for call in range(3):
        with count_collectives() as events:
            head(x)
        forward.append(list(events))
        with count_collectives() as events:
            sampling.decode(gathered, local, greedy, step=call)
        decode.append(list(events))
    return [{"rank": rank, "forward": forward, "decode": decode, "group rows": sum(counts)}]


def arrangements(rank: int, world: int) -> list[dict[str, Any]]:
    """Every arrangement this world size holds, in one launch (every rank makes the same groups in order)."""
    out: list[dict[str, Any]] = []
    if world == 4:
        for rec in same_rows(rank, 4, 4, 2):
            out.append({"case": "world 4, tp 4, head over 2", **rec})
        for rec in own_rows(rank, 4, 4, 2, (3, 0, 5, 2)):
            out.append({"case": "world 4 ADP, 2 head groups of 2", **rec})
        for rec in own_rows(rank, 4, 2, 4, (2, 3, 1, 4)):
            out.append({"case": "world 4 ADP tp 2, head over 4", **rec})
        for rec in mismatch(rank, 4):
            out.append({"case": "mismatch", **rec})
        for rec in wire(rank, 4):
            out.append({"case": "wire", **rec})
    if world == 8:
        # attention TP 2 x DP 4, the head over 4: each pair holds one block of requests, brought once
        # (the pair's second rank brings none and reads its ids from the sampler) or twice.
        for rec in own_rows(rank, 8, 2, 4, (3, 0, 2, 0, 4, 0, 3, 0), (0, 0, 2, 2, 4, 4, 6, 6)):
            out.append({"case": "world 8, attention TP 2 x DP 4, head over 4 (pairs bring rows once)", **rec})
        for rec in own_rows(rank, 8, 2, 4, (3, 3, 2, 2, 4, 4, 3, 3), (0, 0, 2, 2, 4, 4, 6, 6)):
            out.append({"case": "world 8, attention TP 2 x DP 4, head over 4 (pairs bring rows twice)", **rec})
        for rec in same_rows(rank, 8, 4, 2):
            out.append({"case": "world 8, 2 TP groups of 4, head over 2", **rec})
    # Rank 0 holds the rendezvous store: it stays until every rank is done connecting its last groups.
    dist.barrier()
    return out
