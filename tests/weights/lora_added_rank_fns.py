"""Per-rank bodies of tests/test_lora_added_vocab.py (spawned processes import this module by name).

One call loads a base checkpoint's embedding and head at one tp size and layout, attaches the adapters
(one adds tokens, one does not), and returns what each end computes for one batch of per-row adapters.
"""

from __future__ import annotations

from typing import Any

import torch

from trtvocab import LMHead, Mapping, VocabParallelEmbedding
from trtvocab.sampling import SamplingParams, decode


def added_case(rank: int, world: int, case: dict[str, Any], layout: str) -> dict[str, Any]:
    """``case``: ``base``, ``adapters`` (folders), ``ids [B, T]``, ``adapter_ids [B]``, ``hidden [B * T, H]``,
    ``probe_ids [1, n]`` (looked up without an adapter and with each adapter)."""
    mapping = Mapping(world_size=world, rank=rank, tp_size=world) if world > 1 else None
    kw: dict[str, Any] = {"mapping": mapping, "dtype": torch.float32, "vocab_layout": layout, "pad_to": 4}
    emb = VocabParallelEmbedding.from_checkpoint(case["base"], **kw)
    head = LMHead.from_checkpoint(case["base"], **kw)
    for folder in case["adapters"]:
        assert emb.load_adapter(folder, other_modules="ignore") == head.load_adapter(folder, other_modules="ignore")
    ids, per_seq = case["ids"], case["adapter_ids"]
    per_row = per_seq.repeat_interleave(ids.shape[1])
    hidden = case["hidden"]
    with head.use_adapters(per_row):
        greedy = decode(hidden, head, SamplingParams(temperature=0.0))  # gather-free
        gathered = decode(hidden, head, SamplingParams(temperature=0.0, logprobs=1))  # the token-order path
        drawn = decode(hidden, head, SamplingParams(temperature=1.5, top_p=0.95, seed=7), step=2)  # gathered
        raced = decode(hidden, head, SamplingParams(temperature=1.5, seed=7), step=2)  # gather-free
        raced_gathered = decode(hidden, head, SamplingParams(temperature=1.5, seed=7, logprobs=0), step=2)
    probe = case["probe_ids"]
    probes = [emb(probe, torch.tensor([k])) for k in range(-1, len(case["adapters"]))]
    return {"rows": emb(ids, per_seq), "logits": head(hidden, per_row), "local": head.local_logits(hidden, per_row),
            "columns": head.added_shards[head.tp_rank].columns(),
            "emb_columns": emb.added_shards[emb.tp_rank].columns(),
            "greedy": greedy, "gathered": gathered, "drawn": drawn, "raced": raced,
            "raced_gathered": raced_gathered, "probes": probes,
            "added_vocab": (emb.added_vocab, head.added_vocab),
            "adapter_bytes": head.adapter_bytes() + emb.adapter_bytes()}


def disagreeing_params(rank: int, world: int, folder: str) -> str:
    """A head with an added segment whose ranks bring different params (or rank 1 a bad vocab_limit): every
    rank raises before the gather instead of drawing different tokens."""
    head = LMHead(50, 16, dtype=torch.float32, mapping=Mapping(world_size=world, rank=rank, tp_size=world))
    head.load_weights({"weight": torch.ones(50, 16)})
    head.load_adapter(folder)
    hidden = torch.ones(2, 16)
    names = []
    for params, limit in ((SamplingParams(temperature=0.5 + rank, seed=1), None),
                          (SamplingParams(temperature=0.0), 10 if rank == 0 else 99)):
        try:
            with head.use_adapters(torch.tensor([0, -1])):
                decode(hidden, head, params, vocab_limit=limit)
            names.append("")
        except Exception as exc:
            names.append(type(exc).__name__)
    return " ".join(names)
