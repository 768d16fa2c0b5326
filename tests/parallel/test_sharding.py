"""Shard math (contract §1.1, §1.2: docs/contract.md) as properties over V up to 10**6 and tp up to 64, and Mapping."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtvocab import Mapping, calc_shard, padded_vocab_size, shard_sizes, vocab_shard
from trtvocab.errors import ConfigError
from trtvocab.parallel.sharding import all_shards, owner_of

vocabs = st.integers(min_value=1, max_value=10**6)
tps = st.integers(min_value=1, max_value=64)
pads = st.integers(min_value=1, max_value=256)

SETTINGS = settings(max_examples=300, deadline=None)


@SETTINGS
@given(vocabs, tps)
def test_uneven_contiguous_covering_balanced(vocab: int, tp: int) -> None:
    starts = [calc_shard(vocab, tp, r) for r in range(tp + 1)]
    assert starts[0] == 0 and starts[-1] == vocab  # calc_shard(V, tp, tp) == V
    assert starts == sorted(starts)  # contiguous, in rank order
    sizes = shard_sizes(vocab, tp)
    assert sizes == [b - a for a, b in itertools.pairwise(starts)]
    assert sum(sizes) == vocab
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # first ranks larger
    assert sizes.count(max(sizes)) == (vocab % tp or tp)
    for r, shard in enumerate(all_shards(vocab, tp)):
        assert (shard.start, shard.end, shard.width, shard.padding) == (starts[r], starts[r + 1], sizes[r], 0)


@SETTINGS
@given(vocabs, tps, st.data())
def test_calc_shard_formula(vocab: int, tp: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, tp))
    assert calc_shard(vocab, tp, rank) == (vocab // tp) * rank + min(vocab % tp, rank)


@SETTINGS
@given(vocabs, tps, pads)
def test_padded_equal_widths_cover_and_exclusive(vocab: int, tp: int, pad_to: int) -> None:
    padded = padded_vocab_size(vocab, tp, pad_to)
    assert padded >= vocab and padded % (pad_to * tp) == 0 and padded - vocab < pad_to * tp
    shards = all_shards(vocab, tp, "padded", pad_to)
    widths = {s.width for s in shards}
    assert widths == {padded // tp}  # equal widths
    # owned ranges tile [0, V) in rank order: covering and exclusive
    position = 0
    for r, s in enumerate(shards):
        assert s.start == min(r * s.width, vocab) and s.end == min((r + 1) * s.width, vocab)
        assert s.start == position and s.size >= 0 and s.size + s.padding == s.width
        position = s.end
    assert position == vocab
    assert sum(s.size for s in shards) == vocab
    assert sum(s.width for s in shards) == padded


@SETTINGS
@given(vocabs, tps, pads, st.sampled_from(["uneven", "padded"]), st.data())
def test_owner_of_matches_shards(vocab: int, tp: int, pad_to: int, layout: str, data: st.DataObject) -> None:
    token = data.draw(st.integers(0, vocab - 1))
    owner = owner_of(token, vocab, tp, layout, pad_to)
    shards = all_shards(vocab, tp, layout, pad_to)
    owning = [s.rank for s in shards if s.start <= token < s.end]
    assert owning == [owner]  # exactly one owner
    # the owner's local column of the token is inside its owned (non-padding) columns
    assert 0 <= token - shards[owner].start < shards[owner].size


def test_examples_from_the_docstring() -> None:
    assert shard_sizes(10, 3) == [4, 3, 3]
    assert [(s.start, s.end, s.width) for s in all_shards(10, 3, "padded", 2)] == [(0, 4, 4), (4, 8, 4), (8, 10, 4)]
    # a padded layout can leave trailing ranks with no column at all
    assert [(s.start, s.end) for s in all_shards(100, 4, "padded", 64)] == [(0, 64), (64, 100), (100, 100),
                                                                             (100, 100)]


@pytest.mark.parametrize(("args", "match"), [
    ((0, 2, 0), "vocab size"),
    ((10, 0, 0), "tp_size"),
    ((10, 2, 3), "rank"),
    ((10, 2, -1), "rank"),
])
def test_calc_shard_rejects(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        calc_shard(*args)


def test_vocab_shard_rejects() -> None:
    with pytest.raises(ConfigError, match="vocab_layout"):
        vocab_shard(10, 2, 0, "striped")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rank"):
        vocab_shard(10, 2, 2)
    with pytest.raises(ConfigError, match="pad_to"):
        padded_vocab_size(10, 2, 0)
    with pytest.raises(ConfigError, match="token id"):
        owner_of(10, 10, 2)


# ---- Mapping ---------------------------------------------------------------------------------------
@SETTINGS
@given(st.integers(1, 8), st.integers(1, 8), st.data())
def test_mapping_tp_rank_and_group(groups: int, tp: int, data: st.DataObject) -> None:
    world = groups * tp
    rank = data.draw(st.integers(0, world - 1))
    m = Mapping(world_size=world, rank=rank, tp_size=tp)
    assert m.tp_rank == rank % tp
    assert m.tp_group == list(range(rank - rank % tp, rank - rank % tp + tp))
    assert rank in m.tp_group and len(m.tp_group) == tp
    assert m.lm_head_is_split == (tp > 1)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"world_size": 2, "rank": 2, "tp_size": 2}, "rank"),
    ({"world_size": 2, "rank": -1, "tp_size": 2}, "rank"),
    ({"world_size": 6, "rank": 0, "tp_size": 4}, "multiple of tp_size"),
    ({"world_size": 0}, "world_size"),
    ({"world_size": 2, "tp_size": 0}, "tp_size"),
    ({"world_size": 2, "tp_size": 2, "enable_lm_head_tp_in_adp": True}, "enable_attention_dp"),
])
def test_mapping_rejects(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Mapping(**kwargs)


def test_mapping_attention_dp_replicates_unless_lm_head_tp() -> None:
    adp = Mapping(world_size=4, rank=1, tp_size=4, enable_attention_dp=True)
    assert not adp.lm_head_is_split
    split = Mapping(world_size=4, rank=1, tp_size=4, enable_attention_dp=True, enable_lm_head_tp_in_adp=True)
    assert split.lm_head_is_split
    assert not Mapping().lm_head_is_split


def test_mapping_is_frozen_and_strict() -> None:
    m = Mapping(world_size=2, rank=1, tp_size=2)
    with pytest.raises(Exception):  # noqa: B017  (pydantic's frozen-instance error type)
        m.rank = 0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="pp_size"):
        Mapping(world_size=2, pp_size=2)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="world_size"):
        Mapping(world_size="two")  # type: ignore[arg-type]
