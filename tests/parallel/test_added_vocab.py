"""The added-vocabulary layout (trtvocab.parallel.added_vocab): the docstring's drawing is the real layout."""

from __future__ import annotations

import re

import pytest
import torch

from trtvocab.errors import ConfigError
from trtvocab.parallel import added_vocab as av
from trtvocab.parallel.sharding import all_shards


def test_docstring_table_is_the_real_layout() -> None:
    doc = av.__doc__ or ""
    v, a, tp, pad_to = map(int, re.search(r"V = (\d+), A = (\d+), tp = (\d+), pad_to (\d+)", doc).groups())
    shards = av.added_vocab_shards(v, a, tp, "padded", pad_to)
    drawn = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\s*rank (\d+) \|(.*)\|", doc, re.MULTILINE)}
    assert sorted(drawn) == list(range(tp))
    for rank, row in drawn.items():
        cells = [c for part in row.split("|") for c in part.split()]
        assert [-1 if c == "p" else int(c) for c in cells] == shards[rank].columns(), rank
    gathered = re.search(r"^\s*gathered\s+(.*)$", doc, re.MULTILINE).group(1).split()
    assert [-1 if c == "p" else int(c) for c in gathered] == [t for s in shards for t in s.columns()]
    mapping = re.search(r"^\s*sharded_to_full_mapping\s+(.*)$", doc, re.MULTILINE).group(1).split()
    assert [int(c) for c in mapping] == av.sharded_to_full_mapping(shards)


@pytest.mark.parametrize("layout", ["padded", "uneven"])
def test_base_shards_never_move_and_the_mapping_restores_token_order(layout: str) -> None:
    for v, a, tp in ((10, 3, 2), (97, 5, 3), (50, 16, 4), (7, 0, 3), (64, 9, 1)):
        shards = av.added_vocab_shards(v, a, tp, layout, 4)  # type: ignore[arg-type]
        assert [s.base for s in shards] == all_shards(v, tp, layout, 4)  # type: ignore[arg-type]
        gathered_ids = torch.tensor([t for s in shards for t in s.columns()])
        mapping = av.sharded_to_full_mapping(shards)
        assert len(mapping) == gathered_ids.numel()
        assert gathered_ids[mapping[: v + a]].tolist() == list(range(v + a))  # column i is token i
        assert (gathered_ids[mapping[v + a :]] == -1).all()
        owners = [sum(s.local_column(t) is not None for s in shards) for t in range(v + a)]
        assert owners == [1] * (v + a)  # one owner per id
        for s in shards:
            cols = s.columns()
            assert all(cols[s.local_column(t)] == t for t in cols if t >= 0)


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="cannot be split over 4 ranks"):
        av.added_vocab_shards(10, 3, 4, "uneven")
    with pytest.raises(ConfigError, match="added_vocab must be an int >= 0"):
        av.added_vocab_shards(10, -1, 2)
