"""Rank functions of tests/sampling/test_rank0_sampling.py: ``sampling.decode_output`` of a head with
``gather_output="rank0"`` (rank 0 gathers, samples, broadcasts the ids) against the same step on the shards
(``gather_output=True``, the gather-free sampler) and against a replicated head (tp 1).

Spawned ranks unpickle these by module name, as for ``tests.parallel.rank_fns``. Each function runs every
case in one launch and returns per-case records; the test makes the assertions.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel.rank_fns import catch, hidden_states, subgroups, weights
from trtvocab import LMHead, Mapping
from trtvocab.sampling import SamplerOutput, SamplingParams, TokenState, decode_output
from trtvocab.sampling.added_vocab import token_order_view

VOCAB = 1001  # 7 * 11 * 13: uneven at tp 2 and 3
HIDDEN = 32
ROWS = 4
STEPS = 3
PROMPTS = [[1, 5, 600, 999], [7], [500, 501, 502], []]
SAMPLED = {"temperature": 0.8, "seed": 11}
PARAMS: dict[str, Any] = {
    "greedy": SamplingParams(temperature=0.0),
    "seeded": SamplingParams(**SAMPLED),
    "top_k": SamplingParams(**SAMPLED, top_k=20),
    "top_p": SamplingParams(**SAMPLED, top_p=0.9),
    "min_p": SamplingParams(**SAMPLED, min_p=0.05),
    "logprobs": SamplingParams(temperature=0.0, logprobs=3),
    "seeded+logprobs": SamplingParams(**SAMPLED, logprobs=2),
    "per row": [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
                SamplingParams(temperature=0.7, seed=4, top_k=5, logprobs=1), SamplingParams(temperature=0.0)],
    "penalties": SamplingParams(**SAMPLED, repetition_penalty=1.3, frequency_penalty=0.5),
}


def _same_ids(a: SamplerOutput, b: SamplerOutput) -> bool:
    """Equal ids and, where returned, equal logprobs (ids, ranks, the values' bits)."""
    if not torch.equal(a.token_ids.cpu(), b.token_ids.cpu()):
        return False
    if (a.logprobs is None) != (b.logprobs is None):
        return False
    if a.logprobs is None or b.logprobs is None:
        return True
    x, y = a.logprobs, b.logprobs
    return bool(torch.equal(x.ids, y.ids) and torch.equal(x.ranks, y.ranks)
                and torch.equal(x.values.view(torch.int32), y.values.view(torch.int32)))


def _head(mapping: Mapping | None, group: Any, layout: str, dtype: torch.dtype, deterministic: bool,
          w32: torch.Tensor, gather_output: Any = True) -> LMHead:
    head = LMHead(VOCAB, HIDDEN, dtype=dtype, mapping=mapping, process_group=group, vocab_layout=layout, pad_to=64,
                  deterministic=deterministic, gather_output=gather_output)
    head.load_weights({"lm_head.weight": w32})
    return head


def _run(head: LMHead, params: Any, state: TokenState | None, xs: list[torch.Tensor], **kw: Any
         ) -> list[SamplerOutput]:
    outs = []
    for step, x in enumerate(xs):
        out = decode_output(x, head, params, step=step, state=state, **kw)
        if state is not None:
            state.append(out.token_ids)
        outs.append(out)
    return outs


def rank0_cases(rank: int, world: int, seed: int) -> list[dict[str, Any]]:
    """For every tp in 2..world (one launch; ranks >= tp sit a phase out) and both layouts: each params set's
    ids over STEPS steps of the rank-0 head against the gather-free head and the replicated head."""
    groups = subgroups(world)
    w32 = weights(VOCAB, HIDDEN, seed)
    xs32 = [hidden_states(ROWS, HIDDEN, seed + 1 + s) for s in range(STEPS)]
    out: list[dict[str, Any]] = []
    for tp in (t for t in groups if rank < t):
        group = groups[tp]
        mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
        for layout in ("uneven", "padded"):
            for dtype, deterministic in ((torch.float32, True), (torch.bfloat16, True), (torch.float32, False)):
                xs = [x.to(dtype) for x in xs32]
                tag = f"tp={tp} {layout} {str(dtype)[6:]} det={deterministic}"
                single = _head(None, None, "uneven", dtype, deterministic, w32)
                shards = _head(mapping, group, layout, dtype, deterministic, w32, gather_output=True)
                to0 = _head(mapping, group, layout, dtype, deterministic, w32, gather_output="rank0")
                for name, params in PARAMS.items():
                    penalties = name == "penalties"
                    states = [TokenState.for_head(h, PROMPTS) if penalties else None
                              for h in (single, shards, token_order_view(to0))]
                    got = _run(to0, params, states[2], xs)
                    ref_shards = _run(shards, params, states[1], xs)
                    ref_single = _run(single, params, states[0], xs)
                    out.append({"case": f"{tag} {name}", "tp": tp, "rank": rank,
                                "shards": all(_same_ids(a, b) for a, b in zip(got, ref_shards, strict=True)),
                                # tp 1's logits are the split head's bits only for a deterministic head
                                "single": all(_same_ids(a, b) for a, b in zip(got, ref_single, strict=True))
                                if deterministic else None,
                                "ids": [o.token_ids.tolist() for o in got]})
                if deterministic and dtype == torch.float32:
                    out.append(_masked(rank, tp, tag, single, shards, to0, xs))
        out.extend(_failures(rank, tp, group, w32, xs32))
    return out


def _masked(rank: int, tp: int, tag: str, single: LMHead, shards: LMHead, to0: LMHead,
            xs: list[torch.Tensor]) -> dict[str, Any]:
    """A grammar's bitmask and a vocab limit: the same ids in every mode."""
    bitmask = torch.zeros(ROWS, (VOCAB + 31) // 32, dtype=torch.int32)
    allowed = [[3, 40, 700], [999, 1000], [0, 1, 2, 500], list(range(100, 400, 7))]
    for r, ids in enumerate(allowed):
        for i in ids:
            bitmask[r, i // 32] |= torch.tensor(1 << (i % 32), dtype=torch.int64).to(torch.int32)
    params = SamplingParams(**SAMPLED)
    runs = [[decode_output(x, h, params, step=s, bitmask=bitmask, vocab_limit=1000).token_ids
             for s, x in enumerate(xs)] for h in (to0, shards, single)]
    ok = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*runs, strict=True))
    inside = all(int(i) in allowed[r] and int(i) < 1000 for ids in runs[0] for r, i in enumerate(ids))
    return {"case": f"{tag} bitmask + vocab_limit", "tp": tp, "rank": rank, "shards": ok, "single": ok and inside,
            "ids": [t.tolist() for t in runs[0]]}


def _failures(rank: int, tp: int, group: Any, w32: torch.Tensor, xs32: list[torch.Tensor]) -> list[dict[str, Any]]:
    """What each rank raises: a bad input on rank 1 (before the forward), a row rank 0 cannot sample (after the
    gather), params that only rank 1 gets wrong, and a shard state given to rank 0."""
    mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
    head = _head(mapping, group, "uneven", torch.float32, False, w32, gather_output="rank0")
    params = SamplingParams(**SAMPLED)
    x = xs32[0]
    decode_output(x, head, params)  # a good call first: the failures below are not first calls
    records = []
    bad = x.clone()
    if rank == 1:
        bad[2, 0] = float("nan")
    records.append(("nan hidden on rank 1", catch(lambda: decode_output(bad, head, params))))
    nothing = torch.full((ROWS, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    nothing[1] = 0  # row 1 allows no token: only rank 0, which samples, can tell
    records.append(("no allowed token", catch(lambda: decode_output(x, head, params, bitmask=nothing))))
    wrong = [params] * (ROWS - 1) if rank == 1 else params
    records.append(("params wrong on rank 1", catch(lambda: decode_output(x, head, wrong))))
    shard_state = TokenState.for_head(head, PROMPTS)
    records.append(("shard state", catch(lambda: decode_output(x, head, params, state=shard_state))))
    # after every failure the group still works: one more good call
    again = catch(lambda: decode_output(x, head, SamplingParams(temperature=0.0)))
    records.append(("a good call after the failures", again))
    return [{"case": f"tp={tp} {name}", "tp": tp, "rank": rank, "failure": True, "error": err[0], "message": err[1]}
            for name, err in records]


WIRE = [("greedy", None, "uneven"), ("seeded+logprobs", 3, "padded"), ("top_k", None, "padded"),
        ("per row", 1, "uneven")]


def rank0_wire_cases(rank: int, world: int, seed: int) -> dict[str, Any]:
    """The bytes every collective of three rank-0 decode steps takes on this rank, for each ``WIRE`` case
    (params, gather_chunk_rows, layout) at every tp in 2..world (``tests.parallel.wire_counter``)."""
    from tests.parallel.wire_counter import count_collectives

    groups = subgroups(world)
    w32 = weights(VOCAB, HIDDEN, seed)
    out: dict[str, Any] = {}
    for tp in (t for t in groups if rank < t):
        mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
        for name, chunk, layout in WIRE:
            head = LMHead(VOCAB, HIDDEN, dtype=torch.float32, mapping=mapping, process_group=groups[tp],
                          vocab_layout=layout, gather_output="rank0", gather_chunk_rows=chunk)
            head.load_weights({"lm_head.weight": w32})
            calls = []
            for step in range(STEPS):
                with count_collectives() as events:
                    decode_output(hidden_states(ROWS, HIDDEN, seed + step), head, PARAMS[name], step=step)
                calls.append(list(events))
            out[f"tp={tp} {name} {chunk} {layout}"] = calls
    return out


def rank0_added_cases(rank: int, world: int, folder: str) -> dict[str, bool]:
    """A head with an added segment (an adapter that adds 3 tokens to a 50-token vocab), rows with and without
    the adapter: the rank-0 head's ids and logprobs against the token-order path on the shards."""
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)
    w = torch.randn(50, 16, generator=torch.Generator().manual_seed(2))
    heads = []
    for mode in (True, "rank0"):
        head = LMHead(50, 16, dtype=torch.float32, mapping=mapping, gather_output=mode)
        head.load_weights({"weight": w})
        head.load_adapter(folder)
        heads.append(head)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(4)) * 3
    picks = torch.tensor([0, -1, 0])
    out = {}
    for name, params, kw in (("greedy", SamplingParams(temperature=0.0), {}),
                             ("seeded", SamplingParams(temperature=1.5, seed=7), {"step": 2}),
                             ("seeded top-p logprobs", SamplingParams(temperature=1.2, top_p=0.9, seed=8, logprobs=2),
                              {}),
                             ("greedy vocab_limit", SamplingParams(temperature=0.0), {"vocab_limit": 40})):
        runs = []
        for head in heads:
            with head.use_adapters(picks):
                runs.append(decode_output(x, head, params, **kw))
        out[name] = _same_ids(*runs)
    return out
