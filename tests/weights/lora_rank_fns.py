"""Per-rank bodies of tests/weights/test_lora.py (spawned processes import this module by name).

One call runs every case of one tp size and layout: each case loads a base checkpoint's embedding and
head, attaches adapters, and returns the embedding rows, the gathered logits and the tokens of the
materialized decode and of the chunked (streamed) decode for one batch of per-row adapter indices.
"""

from __future__ import annotations

from typing import Any

import torch

from trtvocab import LMHead, Mapping, VocabParallelEmbedding
from trtvocab.sampling import SamplingParams, chunked, decode


def run_case(case: dict[str, Any], mapping: Mapping | None, layout: str) -> dict[str, Any]:
    """One case: ``base`` (checkpoint), ``adapters`` ([(folder, other_modules)]), ``ids [B, T]``,
    ``adapter_ids [B]``, ``hidden [B * T, H]`` (each row's own final hidden states)."""
    kw: dict[str, Any] = {"mapping": mapping, "dtype": torch.float32, "vocab_layout": layout, "pad_to": 4}
    emb = VocabParallelEmbedding.from_checkpoint(case["base"], **kw)
    head = LMHead.from_checkpoint(case["base"], **kw)
    for folder, other in case["adapters"]:
        assert emb.load_adapter(folder, other_modules=other) == head.load_adapter(folder, other_modules=other)
    ids, per_seq = case["ids"], case["adapter_ids"]
    per_row = per_seq.repeat_interleave(ids.shape[1])
    rows = emb(ids, per_seq)
    logits = head(case["hidden"], per_row)
    greedy = [SamplingParams(temperature=0.0)] * per_row.shape[0]
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=7)] * per_row.shape[0]
    with head.use_adapters(per_row):
        tokens = decode(case["hidden"], head, greedy)
        streamed = chunked.stream_greedy(case["hidden"], head, chunk=3)
        drawn = decode(case["hidden"], head, seeded, step=2)
        drawn_streamed = chunked.stream_sample(case["hidden"], head, seeded, step=2, chunk=5)
    return {"rows": rows, "logits": logits, "tokens": tokens, "streamed": streamed, "drawn": drawn,
            "drawn_streamed": drawn_streamed,
            "adapter_bytes": head.adapter_bytes() + emb.adapter_bytes()}


def lora_cases(rank: int, world: int, cases: list[dict[str, Any]], layout: str) -> list[dict[str, Any]]:
    """Every case at tp ``world`` (``world == 1``: replicated, no process group needed)."""
    mapping = Mapping(world_size=world, rank=rank, tp_size=world) if world > 1 else None
    return [run_case(case, mapping, layout) for case in cases]


def refusals(rank: int, world: int, bad: str) -> tuple[str, int]:
    """A split head loading an adapter whose bad rows only the last rank reads: every rank raises (the
    last its AdapterError, the others PeerRankError) and none keeps the adapter."""
    head = LMHead(50, 16, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    head.load_weights({"weight": torch.zeros(50, 16)})
    name = ""
    try:
        head.load_adapter(bad)
    except Exception as exc:
        name = type(exc).__name__
    return name, len(head.adapters)


def disagreeing_picks(rank: int, world: int, folder: str) -> str:
    """Ranks that pick different adapters for the same rows fail in the forward's handshake, every rank."""
    head = LMHead(50, 16, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    head.load_weights({"weight": torch.zeros(50, 16)})
    head.load_adapter(folder)
    x = torch.ones(2, 16)
    head(x, torch.tensor([0, -1]))  # agreed: fine
    try:
        head(x, torch.tensor([0, rank - 1]))  # rank 0 picks none for row 1, rank 1 the adapter
    except Exception as exc:
        return type(exc).__name__
    return "no error"
