"""Rank functions of tests/sampling/test_nucleus.py: ``prefix_keep`` on a real gloo group."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from trtvocab.parallel.sharding import vocab_placement, vocab_shard
from trtvocab.sampling.reductions import gather_stack, prefix_keep


def cases(seed: int, rows: int = 3) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``(order [B, V + A], mass [B], A)``: logits with many ties, masked tokens and zero-mass tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for trial in range(12):
        vocab = int(torch.randint(5, 400, (), generator=g))
        added = int(torch.randint(1, 30, (), generator=g)) if trial % 3 == 2 else 0
        x = torch.randn(rows, vocab + added, generator=g) * (1 + trial % 5)
        if trial % 2:
            x = torch.round(x)  # ties: the cut falls inside a run of equal keys
        if trial % 4 == 0:
            x[:, ::3] = float("-inf")
        if trial % 5 == 1:
            x[:, 1::4] = -300.0  # probabilities that underflow to 0
        x[0, 0], x[-1, -1] = 0.0, -0.0
        mass = torch.rand(rows, generator=g).clamp(min=0.02)
        mass[0] = (1.0, 0.5, 1e-9)[trial % 3]
        out.append((x, mass, added))
    return out


def placement(vocab: int, added: int, tp: int, rank: int, layout: str, **kw: Any) -> Any:
    base = vocab_placement(vocab, tp, rank, layout, 16, **kw)
    if not added:
        return base
    shards = tuple(vocab_shard(added, tp, r, layout, 16) for r in range(tp))
    return replace(base, added=shards[rank], added_shards=shards)


def columns(place: Any, vocab: int) -> list[int]:
    """The global ids of ``place``'s owned columns, in its column order (base piece, then added piece)."""
    cols = list(range(place.vocab_start, place.vocab_start + place.shard.size))
    if place.added is not None:
        cols += [vocab + place.added.start + i for i in range(place.added.size)]
    return cols


def split_keep(rank: int, world: int, layout: str, seed: int) -> list[list[list[list[bool]]]]:
    """Every case's keep mask over the whole vocab (this rank's columns set, the others False), with
    ties cut by id, then with the whole tie kept."""
    return [_masks(rank, world, layout, seed, ties) for ties in (False, True)]


def _masks(rank: int, world: int, layout: str, seed: int, ties: bool) -> list[list[list[bool]]]:
    out = []
    for x, mass, added in cases(seed):
        vocab = x.shape[1] - added
        place = placement(vocab, added, world, rank, layout, process_group=torch.distributed.group.WORLD)
        cols = columns(place, vocab)
        probs = torch.softmax(x, dim=1)
        keep = prefix_keep(x[:, cols], probs[:, cols], mass, place, gather_stack, whole_ties=ties)
        full = torch.zeros(x.shape, dtype=torch.bool)
        full[:, cols] = keep
        out.append(full.tolist())
    return out
