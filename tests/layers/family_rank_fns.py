"""Per-rank bodies of the model-family tests (spawned processes import this module)."""

from __future__ import annotations

from typing import Any

import torch

from trtvocab import LMHead, Mapping, VocabParallelEmbedding
from trtvocab.base.family import HeadOps
from trtvocab.embedding import load_tied
from trtvocab.sampling import SamplingParams, sample


def load_and_run(rank: int, world: int, path: str, hidden: torch.Tensor, ids: torch.Tensor,
                 layout: str) -> dict[str, Any]:
    """Gathered logits and reduced embedding rows of a checkpoint at this tp size and layout, loaded
    both ways (the head and the embedding apart, and ``load_tied``)."""
    mapping = Mapping(world_size=world, rank=rank, tp_size=world)
    head = LMHead.from_checkpoint(path, mapping=mapping, dtype=torch.float32, vocab_layout=layout, pad_to=8)
    emb = VocabParallelEmbedding.from_checkpoint(path, mapping=mapping, dtype=torch.float32, vocab_layout=layout,
                                                 pad_to=8)
    tied_emb, tied_head = load_tied(path, mapping=mapping, dtype=torch.float32, vocab_layout=layout, pad_to=8,
                                    gather_output=False)
    local = tied_head.local_logits(hidden)
    return {"logits": head(hidden), "rows": emb(ids), "tied_rows": tied_emb(ids), "local": local,
            "start": tied_head.vocab_start, "size": tied_head.local_vocab_size}


def softcap_draws(rank: int, world: int, z: torch.Tensor, cap: float, n: int, temperature: float) -> list[int]:
    """``n`` seeded draws (one seed a row) from one row of logits ``softcap(z)`` on a vocab-split head
    (the identity matrix as weight: the hidden row is the raw logits)."""
    v = z.shape[0]
    mapping = Mapping(world_size=world, rank=rank, tp_size=world) if world > 1 else None
    head = LMHead(v, v, dtype=torch.float32, mapping=mapping, gather_output=False, head_ops=HeadOps(softcap=cap))
    head.load_weights({"weight": torch.eye(v)})
    local = head.local_logits(z.expand(n, v).contiguous())
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(n)]
    return sample(local, head, params, step=0).tolist()
